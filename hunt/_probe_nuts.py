import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
import structinfer as si
from scipy.special import logsumexp
from scipy.stats import beta as B, norm
n=6
v=np.linspace(-1,1,n)
def model(y):
    q=numpyro.sample("q", dist.Beta(2.,2.))
    with numpyro.plate("children", n):
        phi=si.edge("phi", si.priors.Geometric(q, n))
        numpyro.sample("y", dist.Normal(jnp.asarray(v)[phi], 0.5), obs=y)
y=jnp.asarray(np.random.default_rng(0).normal(size=n))
mcmc=si.infer.nuts(jax.random.key(0), model, y, num_warmup=30, num_samples=10, progress_bar=False)
q=np.asarray(mcmc.get_samples()["q"], np.float64); U=np.asarray(mcmc.get_extra_fields()["potential_energy"])
def logp(q):
    d=np.arange(n)[:,None]-np.arange(n)[None,:]
    lw=np.where(d>=0, np.log(q)+np.clip(d,0,None)*np.log1p(-q), -np.inf)
    lw=lw-logsumexp(lw,1,keepdims=True)
    ll=norm.logpdf(np.asarray(y)[:,None], v[None,:], 0.5)
    return B(2,2).logpdf(q)+logsumexp(lw+ll,1).sum()
ref=np.array([-(logp(qq)+np.log(qq)+np.log1p(-qq)) for qq in q])
print("nuts U", U[:4]); print("ref   ", ref[:4]); print("max diff", np.abs(U-ref).max())
svi,res=si.infer.svi(jax.random.key(1), model, y, guide="delta", num_steps=300, optim=numpyro.optim.Adam(0.05), progress_bar=False)
qm=float(svi.guide.median(res.params)["q"]) 
print("svi last loss", float(res.losses[-1]), "ref -log p(q,x) at q", qm, -logp(qm), "(+jac?)", -(logp(qm)+np.log(qm)+np.log1p(-qm)))
