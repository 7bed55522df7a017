"""Bad argument shapes crash with errors that do not name the argument:
 * geometric_beta: alpha0/beta0 that do not broadcast against (..., children) -> JAX's
   "Incompatible types for broadcasting" (mean_field.py _setup, jnp.broadcast_to);
 * cccp: a `precision` that is not broadcastable *to mu's shape* (a full (D, D) matrix, or
   one with extra leading dims) -> "mul got incompatible shapes" or, worse, an error about
   edge site 'm' having too many batch dims (mu silently broadcast to the precision's
   shape inside step(); convex_concave.py step/like_tree)."""
import jax, jax.numpy as jnp, numpyro
import structinfer as si

s = jnp.zeros((2, 4, 6))
for a0 in (jnp.full((6,), 0.1), jnp.full((3, 4), 0.1)):
    try:
        si.infer.geometric_beta(s, a0, 0.9, offset=2)
    except Exception as e:
        print(f"geometric_beta alpha0 {a0.shape}: {type(e).__name__}: {str(e)[:110]}")
X = jax.random.normal(jax.random.key(0), (7, 3))
def hop(X, mu):
    with numpyro.plate("q", mu.shape[0]):
        si.edge("m", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=1.0))
for p in (jnp.ones((3, 3)), jnp.ones((4, 2, 3)), jnp.ones((1, 2, 3))):
    try:
        st, _ = si.infer.cccp(si.infer.model_log_z(hop, "mu", X), X[:2], precision=p, max_iters=3)
        print(f"cccp precision {p.shape}: no error, mu shape {st.mu.shape} (mu0 was (2, 3))")
    except Exception as e:
        print(f"cccp precision {p.shape}: {type(e).__name__}: {str(e)[:130]}")
