import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
jax.config.update("jax_enable_x64", True)
import structinfer as si
X = jax.random.normal(jax.random.key(0), (7, 3))
def hop(X, mu, s=1.0):
    numpyro.factor("node", -0.5*jnp.sum(mu**2))
    with numpyro.handlers.scale(scale=s):
        with numpyro.plate("q", mu.shape[0]):
            si.edge("m", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=2.0))
mu = 0.3*jax.random.normal(jax.random.key(1),(2,3))
H = jax.hessian(lambda u: si.log_marginal(hop, X, mu=u.reshape(2,3)))(mu.ravel())
r = si.infer.laplace(hop, "mu", mu, X)
print("plain: |hess - jax.hessian(logZ)| =", float(jnp.abs(r.hessian-H).max()))
H2 = jax.hessian(lambda u: si.log_marginal(hop, X, mu=u.reshape(2,3), s=3.0))(mu.ravel())
try:
    r2 = si.infer.laplace(hop, "mu", mu, X, s=3.0)
    print("scaled eager:", float(jnp.abs(r2.hessian-H2).max()))
except Exception as e: print("scaled eager:", type(e).__name__, str(e)[:200])
r3 = jax.jit(lambda mu: si.infer.laplace(hop, "mu", mu, X, s=3.0))(mu)
print("scaled jit: |hess - true| =", float(jnp.abs(r3.hessian-H2).max()), "true max", float(jnp.abs(H2).max()))
