import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
import structinfer as si
from numpyro.infer import MCMC, NUTS
def model(y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("children", 5):
        phi = si.edge("phi", si.priors.Uniform(3))
        numpyro.sample("y", dist.Normal(jnp.array([-1.0, 0.0, 1.0])[phi], s), obs=y)
y = jnp.array([-1.0, 0.1, 0.9, -0.9, 1.1])
for K in (si.infer.NUTS, NUTS):
    try:
        m = MCMC(K(model), num_warmup=10, num_samples=4, progress_bar=False)
        m.run(jax.random.key(3), y, init_params={"s": jnp.array(0.5)})
        print(K.__module__, np.asarray(m.get_samples()["s"]), m.get_samples()["s"].shape)
    except Exception as e: print(K.__module__, type(e).__name__, str(e)[:300])
