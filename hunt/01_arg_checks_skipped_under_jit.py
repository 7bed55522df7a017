"""Argument checks that run only on concrete values: eager raises, jit returns FINITE numbers.
gmm_em / linear_mixture_em weights, cccp precision, geometric_beta alpha0/beta0.
give a finite answer (negative weight -> component silently switched off; a sum != 1 is
silently renormalised). The project's rule (and check_nonnegative's own policy for `reg`)
is NaN under jit, never a finite wrong number.
Responsible: structinfer/infer/_common.py check_weights (no traced branch), safe_log."""
import numpy as np, jax, jax.numpy as jnp
import structinfer as si

rng = np.random.default_rng(0)
x = np.concatenate([rng.normal(size=(20, 2)), rng.normal(size=(15, 2)) + 3]).astype(np.float32)
means, covs = x[[0, 25]], np.stack([np.eye(2, dtype=np.float32)] * 2)

for w in ([-0.5, 1.5], [0.2, 0.2]):
    w = np.array(w, np.float32)
    try:
        si.infer.gmm_em(x, means, covs, w, max_iters=3)
        print("eager: no error")
    except ValueError as e:
        print("eager: ValueError:", str(e)[:80])
    st, info = jax.jit(lambda w: si.infer.gmm_em(x, means, covs, w, max_iters=3))(w)
    print(f"  jit weights={w}: log_likelihood={float(st.log_likelihood):.4f} "
          f"weights out={np.asarray(st.weights).round(3)} nonfinite={bool(info.nonfinite)}"
          "   (expected: NaN / nonfinite=True, as for a negative reg)")
st, info = jax.jit(lambda r: si.infer.gmm_em(x, means, covs, reg=r, max_iters=3))(-1.0)
print("for comparison, negative reg under jit: ll =", float(st.log_likelihood), "nonfinite =", bool(info.nonfinite))

# --- the same pattern in two more algorithms: eager raises, jit returns finite numbers
import numpyro
X = jax.random.normal(jax.random.key(0), (7, 3))
def hop(X, mu):
    with numpyro.plate("q", mu.shape[0]):
        si.edge("m", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=1.0))
mu0 = X[:2] + 0.1
st, info = jax.jit(lambda p: si.infer.cccp(si.infer.model_log_z(hop, "mu", X), mu0, precision=p))(-1.0)
print("cccp precision=-1 under jit (eager: ValueError): mu finite =", bool(jnp.all(jnp.isfinite(st.mu))),
      "energy =", float(st.energy), "nonfinite =", bool(info.nonfinite),
      "   [convex_concave.py _check_precision: concrete only]")
s = jax.random.normal(jax.random.key(2), (4, 4))
st, info = jax.jit(lambda a: si.infer.geometric_beta(s, a, 0.9))(-0.5)
print("geometric_beta alpha0=-0.5 under jit (eager: ValueError): energy =", np.asarray(st.energy).round(3),
      "attention finite =", bool(jnp.all(jnp.isfinite(st.attention))), "nonfinite =", np.asarray(info.nonfinite),
      "   [mean_field.py _setup: concrete only]")
