import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
from numpyro.contrib.control_flow import scan
from numpyro.handlers import substitute
from numpyro.infer import MCMC, NUTS
import structinfer as si
lt=jnp.log(jnp.array([[0.9,0.1],[0.2,0.8]])); mu=jnp.array([-1.0,1.0])
def model(y):
    s=numpyro.sample("s", dist.HalfNormal(1.0))
    prior=si.priors.Markov(lt, jnp.log(jnp.array([0.5,0.5])))
    def step(prev, yt):
        z=si.edge("z", prior, previous=prev)
        numpyro.sample("y", dist.Normal(mu[z], s), obs=yt)
        return z, None
    scan(step, jnp.asarray(-1), y)
y=jnp.array([-1.1,-0.9,1.2,0.8,1.0,-1.0])
print("log_marginal at s=0.5:", float(si.log_marginal(substitute(model, data={"s": jnp.array(0.5)}), y)))
try:
    m=MCMC(NUTS(model), num_warmup=20, num_samples=5, progress_bar=False); m.run(jax.random.key(0), y); print("numpyro NUTS ok", m.get_samples()["s"])
except Exception as e: print("numpyro NUTS:", type(e).__name__, str(e)[:200])
try:
    m=MCMC(si.infer.NUTS(model), num_warmup=20, num_samples=5, progress_bar=False); m.run(jax.random.key(0), y); print("si NUTS ok", m.get_samples()["s"])
except Exception as e: print("si NUTS:", type(e).__name__, str(e)[:200])
