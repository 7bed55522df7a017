import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
from numpyro.contrib.control_flow import scan
import structinfer as si
K=2
lt=jnp.log(jnp.array([[0.9,0.1],[0.2,0.8]]))
mu=jnp.array([-1.0,1.0])
def model(y):
    s=numpyro.sample("s", dist.HalfNormal(1.0))
    prior=si.priors.Markov(lt, jnp.log(jnp.array([0.5,0.5])))
    def step(prev, yt):
        z=si.edge("z", prior, previous=prev)
        numpyro.sample("y", dist.Normal(mu[z], s), obs=yt)
        return z, None
    scan(step, jnp.asarray(-1), y)
y=jnp.array([-1.1,-0.9,1.2,0.8,1.0,-1.0])
mcmc=si.infer.nuts(jax.random.key(0), model, y, num_warmup=30, num_samples=20, progress_bar=False)
try:
    dt=si.diagnostics.to_inference_data(mcmc, y)
    print(dt["edge_posterior"]); print(dt["log_likelihood"])
except Exception as e: print(type(e).__name__, str(e)[:400])
