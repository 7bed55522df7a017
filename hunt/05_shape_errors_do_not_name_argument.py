"""Bad argument shapes crash with errors that do not name the argument:
 * geometric_beta: alpha0/beta0 that do not broadcast against (..., children) -> JAX's
   "Incompatible types for broadcasting" (mean_field.py _setup, jnp.broadcast_to);
 * cccp: a `precision` that is not broadcastable *to mu's shape* (a full (D, D) matrix, or
   one with extra leading dims) -> "mul got incompatible shapes" or, worse, an error about
   edge site 'm' having too many batch dims (mu silently broadcast to the precision's
   shape inside step(); convex_concave.py step/like_tree);
 * a traced `mass` in effective_window / geometric_beta: TracerBoolConversionError
   (edges.py effective_window and mean_field.py _setup test `0 < mass` in Python);
 * energy_em with integer params: JAX grad TypeError (em_energy.py does not as_float_tree params)."""
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

# --- a traced `mass` (a float argument) is not jittable and the error does not name it
a = jnp.full((3, 3), 1 / 3)
for name, f in (("diagnostics.effective_window", lambda a, m: si.diagnostics.effective_window(a, 0, m)),
                ("infer.geometric_beta", lambda a, m: si.infer.geometric_beta(a, 0.1, 0.9, mass=m)[0].window)):
    try:
        jax.jit(f)(a, 0.9)
    except Exception as e:
        print(f"jit {name} with traced mass: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
# --- energy_em: integer params are not cast (latents are), error does not name `params`
try:
    si.infer.energy_em(lambda v, th: jnp.sum((v - th) ** 2), jnp.zeros(2), jnp.array([1, 2]), max_iters=3)
except Exception as e:
    print(f"energy_em int params: {type(e).__name__}: {str(e)[:80]}")
