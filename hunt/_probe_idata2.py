import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist, warnings
import structinfer as si
from scipy.special import logsumexp
from scipy.stats import norm
H,n=2,4
v=jnp.array([[-1.,0.,1.,2.],[2.,1.,0.,-1.]])
def model(y):
    s=numpyro.sample("s", dist.HalfNormal(1.0))
    q=numpyro.sample("q", dist.Beta(2.,2.))
    with numpyro.plate("heads", H, dim=-2):
        with numpyro.plate("children", n, dim=-1):
            phi=si.edge("phi", si.priors.Geometric(q, n))
            numpyro.sample("y", dist.Normal(jnp.take_along_axis(v, phi, -1) if phi.ndim==2 else v[jnp.arange(H)[:,None], phi], s), obs=y)
y=jnp.asarray(np.random.default_rng(0).normal(size=(H,n)))
mcmc=si.infer.nuts(jax.random.key(0), model, y, num_warmup=50, num_samples=20, num_chains=2, progress_bar=False)
dt=si.diagnostics.to_inference_data(mcmc, y)
S=mcmc.get_samples(group_by_chain=True); s=np.asarray(S["s"],np.float64); q=np.asarray(S["q"],np.float64)
d=np.arange(n)[:,None]-np.arange(n)[None,:]
def lw(q):
    l=np.where(d>=0, np.log(q)+np.clip(d,0,None)*np.log1p(-q), -np.inf); return l-logsumexp(l,1,keepdims=True)
ll=np.zeros(s.shape+(H,n)); marg=np.zeros((H,n,n))
for c in range(s.shape[0]):
  for k in range(s.shape[1]):
    lp=lw(q[c,k])[None]+norm.logpdf(np.asarray(y)[:,:,None], np.asarray(v)[:,None,:], s[c,k])
    ll[c,k]=logsumexp(lp,-1); marg+=np.exp(lp-logsumexp(lp,-1,keepdims=True))
marg/=s.size
print("ll dims", dt["log_likelihood"]["y"].dims, "diff", np.abs(dt["log_likelihood"]["y"].values-ll).max())
print("marg dims", dt["edge_posterior"]["phi"].dims, "diff", np.abs(dt["edge_posterior"]["phi"].values-marg).max())
print("prior dims", dt["edge_posterior"]["phi_prior"].dims, "diff", np.abs(dt["edge_posterior"]["phi_prior"].values - np.mean([np.exp(lw(qq)) for qq in q.ravel()],0)).max())
print(si.diagnostics.edge_summary(dt))
pp=dt["posterior_predictive"]["y"]; print("pp dims", pp.dims, pp.shape)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always"); print(si.diagnostics.loo(dt).elpd, [str(x.message)[:100] for x in w])
import arviz_stats as azs
print("arviz loo", azs.loo(dt).elpd)
