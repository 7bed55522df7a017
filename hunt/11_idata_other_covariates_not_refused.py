"""to_inference_data refuses observations other than those the MCMC ran on, but not other
*covariates*: passing a different non-observed argument (here the keys X of the scores)
silently gives the log_likelihood / edge_posterior / LOO of another model-data pair
(finite, wrong). The fit knows its arguments (NumPyro's MCMC keeps them as mcmc._args /
_kwargs, which ArviZ's from_numpyro itself reads).
Responsible: structinfer/diagnostics/data.py _check_same_data (observed sites only).
Fix: compare every array argument with mcmc._args/_kwargs (for SVI there is no record;
document it)."""
import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
import structinfer as si

def model(X, y):
    t = numpyro.sample("t", dist.HalfNormal(2.0))
    with numpyro.plate("children", 4):
        phi = si.infer.conditional_edge("phi", si.priors.Uniform(4), si.scores.Dot(X, X, scale=t))
        numpyro.sample("y", dist.Normal(X[phi, 0], 0.5), obs=y)

rng = np.random.default_rng(0)
X = jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)
y = jnp.array([0.3, -0.2, 1.0, 0.1])
mcmc = si.infer.nuts(jax.random.key(0), model, X, y, num_warmup=30, num_samples=20, progress_bar=False)
print("the fit's own arguments are recorded:", [tuple(a.shape) for a in mcmc._args])
try:
    si.diagnostics.to_inference_data(mcmc, X, y + 1.0, posterior_predictive=False)
except ValueError as e:
    print("other y  -> ValueError:", str(e)[:70])
dt = si.diagnostics.to_inference_data(mcmc, X, y, posterior_predictive=False)
dt2 = si.diagnostics.to_inference_data(mcmc, X[::-1] * 3.0, y, posterior_predictive=False)
print("other X  -> no error; sum log_likelihood", float(dt2["log_likelihood"]["y"].values.mean(axis=(0, 1)).sum()),
      "vs the fit's", float(dt["log_likelihood"]["y"].values.mean(axis=(0, 1)).sum()))
