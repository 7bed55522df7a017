"""si.infer.nuts raises FloatingPointError("site 'logp' has non-finite draws; check the
priors' supports and the data for NaN/inf") for a valid model that records a
numpyro.deterministic holding -inf (e.g. a causal prior's log-table, whose forbidden
edges are -inf by design): MCMC.get_samples() includes deterministic sites, and every
one of them is required to be finite. NumPyro's own MCMC runs the same model fine.
Responsible: structinfer/infer/fit.py nuts(), the loop over mcmc.get_samples() after
mcmc.run. Fix: check only the latent sample sites (info.latent), or only NaN."""
import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
from numpyro.infer import MCMC
import structinfer as si

def model(y):
    q = numpyro.sample("q", dist.Beta(2.0, 2.0))
    prior = si.priors.Geometric(q, 4)                      # causal: parents j > i forbidden
    numpyro.deterministic("logp", prior.log_table(4))      # -inf above the diagonal
    with numpyro.plate("children", 4):
        phi = si.edge("phi", prior)
        numpyro.sample("y", dist.Normal(jnp.arange(4.0)[phi], 0.5), obs=y)

y = jnp.array([0.1, 0.9, 0.2, 2.8])
m = MCMC(si.infer.NUTS(model), num_warmup=20, num_samples=10, progress_bar=False)
m.run(jax.random.key(0), y)
print("MCMC(si.infer.NUTS(model)) fine: q draws", m.get_samples()["q"][:3])
try:
    si.infer.nuts(jax.random.key(0), model, y, num_warmup=20, num_samples=10, progress_bar=False)
    print("si.infer.nuts: ok")
except FloatingPointError as e:
    print("si.infer.nuts:", type(e).__name__, str(e)[:120])
