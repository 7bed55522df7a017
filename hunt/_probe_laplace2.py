import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
jax.config.update("jax_enable_x64", True)
import structinfer as si
rng=np.random.default_rng(0)
X=jnp.asarray(rng.normal(size=(2,6,3)))
def m(X, mu):
    numpyro.factor("node", -0.5*jnp.sum(mu**2) + jnp.sum(jnp.sin(mu)))
    with numpyro.plate("heads",2,dim=-2):
        with numpyro.plate("q", mu.shape[-2], dim=-1):
            si.edge("e", si.priors.Restricted.causal(6, offset=2) if False else si.priors.Geometric(0.3, 6, offset=2), si.scores.NegSqDist(mu, X, precision=2.0))
mu=jnp.asarray(rng.normal(size=(2,4,3)))
H=jax.hessian(lambda u: si.log_marginal(m, X, mu=u.reshape(mu.shape)))(mu.ravel())
r=si.infer.laplace(m,"mu",mu,X)
print("hess diff", float(jnp.abs(r.hessian-H).max()), "scale", float(jnp.abs(H).max()))
rj=jax.jit(lambda mu: si.infer.laplace(m,"mu",mu,X))(mu); print("jit diff", float(jnp.abs(rj.hessian-H).max()))
# pytree mu
def m2(X, mu):
    a,b=mu["a"],mu["b"]
    with numpyro.plate("q", 3):
        si.edge("e", si.priors.Uniform(6), si.scores.Dot(a*b, X[0], scale=1.0))
mu2={"a":jnp.ones((3,3))*0.3,"b":jnp.asarray(rng.normal(size=(3,3)))}
from jax.flatten_util import ravel_pytree
flat,unr=ravel_pytree(mu2)
H2=jax.hessian(lambda u: si.log_marginal(m2, X, mu=unr(u)))(flat)
r2=si.infer.laplace(m2,"mu",mu2,X); print("pytree hess diff", float(jnp.abs(r2.hessian-H2).max()))
