"""to_inference_data: the edge_posterior group names an outer plate's dim '<site>_dim_0'
while log_likelihood / posterior_predictive / observed_data name it after the plate
('heads'), so xarray cannot align them (cosmetic; values are right).
Responsible: structinfer/diagnostics/data.py to_inference_data, `bdims = [f"{n}_dim_{k}" ...]`
(the edge's plates are known from the model's inspection)."""
import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
import structinfer as si
H, n = 2, 3
v = jnp.array([[-1., 0., 1.], [1., 0., -1.]])
def model(y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("heads", H, dim=-2):
        with numpyro.plate("children", n, dim=-1):
            phi = si.edge("phi", si.priors.Uniform(n))
            numpyro.sample("y", dist.Normal(v[jnp.arange(H)[:, None], phi], s), obs=y)
y = jnp.asarray(np.random.default_rng(0).normal(size=(H, n)))
mcmc = si.infer.nuts(jax.random.key(0), model, y, num_warmup=10, num_samples=5, progress_bar=False)
dt = si.diagnostics.to_inference_data(mcmc, y, posterior_predictive=False)
print("log_likelihood y dims:", dt["log_likelihood"]["y"].dims)
print("edge_posterior phi dims:", dt["edge_posterior"]["phi"].dims, " <- 'phi_dim_0' instead of 'heads'")
