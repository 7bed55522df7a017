import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
import structinfer as si
from numpyro.infer import MCMC, NUTS
def model(y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("children", 5):
        phi = si.edge("phi", si.priors.Uniform(3))
        numpyro.sample("y", dist.Normal(jnp.array([-1.0, 0.0, 1.0])[phi], s), obs=y)
y = jnp.array([-1.0, 0.1, 0.9, -0.9, 1.1])
a = MCMC(si.infer.NUTS(model), num_warmup=20, num_samples=5, progress_bar=False); a.run(jax.random.key(3), y)
b = MCMC(NUTS(model), num_warmup=20, num_samples=5, progress_bar=False); b.run(jax.random.key(3), y)
print(np.asarray(a.get_samples()["s"])); print(np.asarray(b.get_samples()["s"]))
m = si.infer.nuts(jax.random.key(3), model, y, num_warmup=20, num_samples=5, num_chains=2, progress_bar=False)
s = np.asarray(m.get_samples(group_by_chain=True)["s"]); print("2 chains identical?", np.allclose(s[0], s[1]), s)
