import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
import structinfer as si
def model(y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("children", 5):
        phi = si.edge("phi", si.priors.Uniform(3))
        numpyro.sample("y", dist.Normal(jnp.array([-1.0, 0.0, 1.0])[phi], s), obs=y)
y = jnp.array([-1.0, jnp.nan, 0.9, -0.9, 1.1])
for f in (lambda: si.infer.nuts(jax.random.key(0), model, y, num_warmup=5, num_samples=5, progress_bar=False),
          lambda: si.infer.svi(jax.random.key(0), model, y, num_steps=5, progress_bar=False)):
    try: f(); print("no error!")
    except Exception as e: print(type(e).__name__, str(e)[:300])
x=np.random.default_rng(0).normal(size=(10,2)); x[3,1]=np.nan
try: si.infer.gmm_em(x, x[:2], np.stack([np.eye(2)]*2)); print("no error")
except Exception as e: print(type(e).__name__, str(e)[:300])
