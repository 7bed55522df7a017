import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
import structinfer as si
from scipy.special import logsumexp
from scipy.stats import norm
v=jnp.array([-1.0,0.0,1.0])
def model(y, obs):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("children", 5):
        phi = si.edge("phi", si.priors.Uniform(3))
        with numpyro.handlers.mask(mask=obs):
            numpyro.sample("y", dist.Normal(v[phi], s), obs=jnp.where(obs, y, 0.0))
y = jnp.array([-1.0, jnp.nan, 0.9, -0.9, 1.1]); obs=~jnp.isnan(y)
mcmc = si.infer.nuts(jax.random.key(0), model, y, obs, num_warmup=50, num_samples=50, progress_bar=False)
dt = si.diagnostics.to_inference_data(mcmc, y, obs, posterior_predictive=False)
ll=dt["log_likelihood"]["y"]; print(ll.dims, ll.coords["children"].values)
s=np.asarray(mcmc.get_samples(group_by_chain=True)["s"],np.float64)
yy=np.asarray(y)[[0,2,3,4]]
ref=logsumexp(norm.logpdf(yy[None,None,:,None], np.asarray(v), s[...,None,None])+np.log(1/3),-1)
print("ll diff", np.abs(ll.values-ref).max())
m=dt["edge_posterior"]["phi"].values; print("marg of missing child (should be prior 1/3):", m[1].round(4))
