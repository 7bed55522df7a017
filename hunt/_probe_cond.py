import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
jax.config.update("jax_enable_x64", True)
import structinfer as si
from scipy.special import logsumexp, log_softmax
from scipy.stats import norm
rng=np.random.default_rng(0)
H,n=2,5
S=rng.normal(size=(H,n,n)); v=rng.normal(size=(n,)); y=rng.normal(size=(H,n))
def model(S,y):
    with numpyro.plate("heads",H,dim=-2):
        with numpyro.plate("children",n,dim=-1):
            phi=si.infer.conditional_edge("phi", si.priors.Restricted.causal(n), S)
            numpyro.sample("y", dist.Normal(jnp.asarray(v)[phi], 0.5), obs=y)
mask=np.tril(np.ones((n,n),bool))
lp=log_softmax(np.where(mask,S,-np.inf),-1)
ref=logsumexp(lp+norm.logpdf(y[...,None], v[None,None,:], 0.5),-1).sum()
print("log_marginal", float(si.log_marginal(model,S,y)), "ref", ref)
print("jit", float(jax.jit(si.log_marginal, static_argnums=0)(model,S,y)))
g=jax.grad(lambda S: si.log_marginal(model,S,y))(jnp.asarray(S))
import scipy.optimize as so
def f(Sf):
    Sm=Sf.reshape(S.shape); lp=log_softmax(np.where(mask,Sm,-np.inf),-1); return logsumexp(lp+norm.logpdf(y[...,None], v[None,None,:], 0.5),-1).sum()
gn=so.approx_fprime(S.ravel(), f, 1e-6).reshape(S.shape)
print("grad diff", np.abs(np.where(mask,np.asarray(g)-gn,0)).max(), "grad at masked", np.abs(np.where(~mask,np.asarray(g),0)).max())
