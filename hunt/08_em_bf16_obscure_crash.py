"""gmm_em / linear_mixture_em / markov_switching_em on bfloat16 data crash deep inside
jnp.linalg (XLA:CPU has no bf16 LU) with `NotImplementedError: (KeyError(bfloat16),
'Unsupported dtype bfloat16.')`, naming neither the function nor the argument; the
project's rule is that everything works in bf16 where a model can be bf16 (the exact
engine computes a bf16 GMM's log Z in float32), or else a clear error.
Responsible: em_gmm.py _e_step (jnp.linalg.inv(covs) in x.dtype), _common.weighted_affine_fit
(jnp.linalg.solve in bf16). Fix: do the linear algebra (and the M-step sums) in
float32-at-least (like priors' float32_at_least) and cast back, or refuse 16-bit inputs
in _prepare with a message naming 'x'/'inputs'."""
import numpy as np, jax, jax.numpy as jnp
import structinfer as si
rng = np.random.default_rng(0)
x = np.concatenate([rng.normal(size=(20, 2)), rng.normal(size=(15, 2)) + 3])
xb = jnp.asarray(x, jnp.bfloat16)
c = np.stack([np.eye(2)] * 2)
print("exact engine on the bf16 GMM model: log Z =",
      float(si.log_marginal(si.mechanisms.gaussian_mixture, xb, xb[jnp.array([0, 25])],
                            jnp.asarray(c, jnp.bfloat16), jnp.log(jnp.full(2, 0.5, jnp.bfloat16)), normalize=True)))
for name, f in (("gmm_em", lambda: si.infer.gmm_em(xb, x[[0, 25]], c, max_iters=3)),
                ("linear_mixture_em", lambda: si.infer.linear_mixture_em(xb[:-1], xb[1:], c, np.zeros((2, 2)), c, max_iters=3)),
                ("markov_switching_em", lambda: si.infer.markov_switching_em(xb, c, np.zeros((2, 2)), np.ones((2, 2)), max_iters=3))):
    try:
        f()
        print(name, "ok")
    except Exception as e:
        print(f"{name}(bf16): {type(e).__name__}: {str(e)[:90]}")
try:
    si.infer.slot_em(xb, xb[jnp.array([0, 25])], np.eye(2), np.eye(2), max_iters=2)
    print("slot_em ok")
except Exception as e:
    print(f"slot_em(bf16): {type(e).__name__}: {str(e)[:90]}")
