import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
import structinfer as si
from structinfer.diagnostics._common import read_fit, posterior_draws
from numpyro.infer.autoguide import AutoDelta
def model(y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("children", 5):
        phi = si.edge("phi", si.priors.Uniform(3))
        numpyro.sample("y", dist.Normal(jnp.array([-1.0, 0.0, 1.0])[phi], s), obs=y)
def guide(y):
    loc = numpyro.param("loc", -1.0); sc = numpyro.param("sc", 0.3, constraint=dist.constraints.positive)
    numpyro.sample("s", dist.LogNormal(loc, sc))
y = jnp.array([-1.0, 0.1, 0.9, -0.9, 1.1])
fit = si.infer.svi(jax.random.key(1), model, y, guide=guide, num_steps=200, optim=numpyro.optim.Adam(0.05), progress_bar=False)
dt = si.diagnostics.to_inference_data(fit, y, num_draws=100, posterior_predictive=False)
a = dt["posterior"]["s"].values.ravel(); b = posterior_draws(read_fit(fit,"x"), (y,), {}, 100, ["s"])["s"].ravel()
print("custom guide: idata draws == posterior_draws (plots)?", np.allclose(a,b), a[:3], b[:3])
