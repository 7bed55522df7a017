import numpy as np, jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
import structinfer as si
v=jnp.array([-1.0,0.0,1.0])
def model(y):
    s = numpyro.sample("s", dist.LogNormal(jnp.log(0.6), 0.01))
    with numpyro.plate("children", 4):
        phi = si.edge("phi", si.priors.Categorical(jnp.log(jnp.array([0.2,0.3,0.5]))))
        numpyro.sample("y", dist.Normal(v[phi], s), obs=y)
y = jnp.array([-0.5, 0.5, 0.0, 2.0])
mcmc = si.infer.nuts(jax.random.key(0), model, y, num_warmup=50, num_samples=4000, progress_bar=False)
dt = si.diagnostics.to_inference_data(mcmc, y)
marg = dt["edge_posterior"]["phi"].values
yrep = dt["posterior_predictive"]["y"].values.reshape(-1,4)
# E[y_rep] = sum_j marg_j v_j ; Var = s^2 + Var(v_phi)
print("E[y_rep] emp", yrep.mean(0).round(3), "theory", (marg@np.asarray(v)).round(3))
print("sd emp", yrep.std(0).round(3), "theory", np.sqrt(0.36 + marg@np.asarray(v)**2 - (marg@np.asarray(v))**2).round(3))
dt2 = si.diagnostics.to_inference_data(mcmc, y, rng_key=jax.random.PRNGKey(7))
yrep = dt2["posterior_predictive"]["y"].values.reshape(-1,4)
print("key7 E[y_rep] emp", yrep.mean(0).round(3), "SE", (yrep.std(0)/np.sqrt(len(yrep))).round(3))
# correlation between children of y_rep (should be ~0: children independent given theta, theta ~ fixed)
print("corr", np.corrcoef(yrep.T).round(3))
