import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
import structinfer as si
from structinfer.diagnostics._common import read_fit, posterior_draws
from scipy.special import logsumexp
from scipy.stats import norm
def model(y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("children", 5):
        phi = si.edge("phi", si.priors.Uniform(3))
        numpyro.sample("y", dist.Normal(jnp.array([-1.0, 0.0, 1.0])[phi], s), obs=y)
y = jnp.array([-1.0, 0.1, 0.9, -0.9, 1.1])
fit = si.infer.svi(jax.random.key(1), model, y, num_steps=300, optim=numpyro.optim.Adam(0.05), progress_bar=False)
dt = si.diagnostics.to_inference_data(fit, y, num_draws=200)
s_id = dt["posterior"]["s"].values
pd_ = posterior_draws(read_fit(fit,"x"), (y,), {}, 200, ["s"])["s"]
print("posterior dims", dt["posterior"]["s"].dims, "idata draws == plot draws?", np.allclose(s_id, pd_), s_id.ravel()[:3], pd_.ravel()[:3])
s=s_id.astype(np.float64)
ll=logsumexp(norm.logpdf(np.asarray(y)[None,None,:,None], np.array([-1.,0,1]), s[...,None,None])+np.log(1/3),-1)
print("ll diff", np.abs(dt["log_likelihood"]["y"].values-ll).max())
print("loo", si.diagnostics.loo(dt).elpd)
fitd = si.infer.svi(jax.random.key(1), model, y, guide="delta", num_steps=300, optim=numpyro.optim.Adam(0.05), progress_bar=False)
dtd = si.diagnostics.to_inference_data(fitd, y, num_draws=10)
try: si.diagnostics.loo(dtd); print("delta loo: no error")
except ValueError as e: print("delta loo:", str(e)[:100])
