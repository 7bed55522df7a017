import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
import structinfer as si
from scipy.special import logsumexp
def model(y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("children", 5):
        phi = si.edge("phi", si.priors.Uniform(3))
        numpyro.sample("y", dist.Normal(jnp.array([-1.0, 0.0, 1.0])[phi], s), obs=y)
y = jnp.array([-1.0, 0.1, 0.9, -0.9, 1.1])
mcmc = si.infer.nuts(jax.random.key(0), model, y, num_warmup=100, num_samples=50, num_chains=1, progress_bar=False)
dt = si.diagnostics.to_inference_data(mcmc, y)
print(dt)
s = np.asarray(mcmc.get_samples(group_by_chain=True)["s"])
from scipy.stats import norm
mu=np.array([-1.,0.,1.])
ll = logsumexp(norm.logpdf(np.asarray(y)[None,None,:,None], mu, s[...,None,None]) + np.log(1/3), -1)
print("ll diff", np.abs(dt["log_likelihood"]["y"].values - ll).max())
lp = norm.logpdf(np.asarray(y)[None,None,:,None], mu, s[...,None,None])
post = np.exp(lp - logsumexp(lp,-1,keepdims=True)).mean((0,1))
print("marg diff", np.abs(dt["edge_posterior"]["phi"].values - post).max())
print(si.diagnostics.edge_summary(dt))
print(si.diagnostics.loo(dt))
