import numpy as np, jax, jax.numpy as jnp, numpyro
jax.config.update("jax_enable_x64", True)
import structinfer as si
X=jnp.asarray(np.random.default_rng(0).normal(size=(7,3)),jnp.float32)
def hop(X, mu):
    with numpyro.plate("q", mu.shape[0]):
        si.edge("m", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=1.0))
r=si.infer.laplace(hop,"mu",X[:2],X)
print({k: str(getattr(r,k).dtype) for k in r._fields})
print("log_marginal dtype", si.log_marginal(hop, X, mu=X[:2]).dtype, " bf16:", si.log_marginal(hop, X.astype(jnp.bfloat16), mu=X[:2].astype(jnp.bfloat16)).dtype)
def hop2(X, mu):
    numpyro.factor("node", -0.5*jnp.sum(mu**2))
    hop(X, mu)
r=si.infer.laplace(hop2,"mu",X[:2],X)
print("with node factor:", {k: str(getattr(r,k).dtype) for k in r._fields})
