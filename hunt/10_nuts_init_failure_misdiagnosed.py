"""si.infer.nuts / svi turn a model-construction error into a misleading one. A Markov edge
without log_initial raises a clear ValueError in the exact engine ("the chain's first edge
(previous=-1) has no initial distribution: give the Markov prior log_initial=").
Under si.infer.nuts the user instead gets NonFiniteEnergyError "no initial point has a
finite log density ... responsible: (the model raised ValueError: sample site 's' is latent
and not enumerable ...). Check the data for NaN/inf": the named cause is an artefact of
the diagnosis (nonfinite_site runs inspect_model on the model with its continuous site
unsubstituted) and the advice is wrong.
Responsible: structinfer/infer/fit.py _init_failure -> _diagnose.nonfinite_site (it
should substitute an initial point for the continuous latents, e.g. the prior median /
NumPyro's init strategy, and report the model's own exception as the cause)."""
import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
from numpyro.contrib.control_flow import scan
from numpyro.handlers import substitute
import structinfer as si

lt = jnp.log(jnp.array([[0.9, 0.1], [0.2, 0.8]]))
mu = jnp.array([-1.0, 1.0])
def model(y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    prior = si.priors.Markov(lt)                 # forgot log_initial=
    def step(prev, yt):
        z = si.edge("z", prior, previous=prev)
        numpyro.sample("y", dist.Normal(mu[z], s), obs=yt)
        return z, None
    scan(step, jnp.asarray(-1), y)

y = jnp.array([-1.1, -0.9, 1.2, 0.8, 1.0, -1.0])
try:
    si.log_marginal(substitute(model, data={"s": jnp.array(0.5)}), y)
except ValueError as e:
    print("exact engine (the real cause):", str(e)[:150])
try:
    si.infer.nuts(jax.random.key(0), model, y, num_warmup=5, num_samples=5, progress_bar=False)
except Exception as e:
    print("\nsi.infer.nuts:", type(e).__name__, str(e)[:420])

# The diagnosis fails the same way for every model with a continuous latent (i.e. every
# model NUTS samples): here the observation y[2] = 5 is impossible under every structure,
# and the message should name site 'y' (nonfinite_site's "-inf for every structure").
def model2(y):
    w = numpyro.sample("w", dist.HalfNormal(0.1))
    with numpyro.plate("children", 3):
        phi = si.edge("phi", si.priors.Uniform(2))
        numpyro.sample("y", dist.Uniform(jnp.array([-1.0, 1.0])[phi] - 0.5, jnp.array([-1.0, 1.0])[phi] + 0.5), obs=y * w / w)
try:
    si.infer.nuts(jax.random.key(0), model2, jnp.array([-1.0, 1.0, 5.0]), num_warmup=5, num_samples=5, progress_bar=False)
except Exception as e:
    print("\nsi.infer.nuts (impossible observation):", type(e).__name__, str(e)[:330])
try:
    si.infer.svi(jax.random.key(0), model2, jnp.array([-1.0, 1.0, 5.0]), num_steps=5, progress_bar=False)
except Exception as e:
    print("\nsi.infer.svi (impossible observation):", type(e).__name__, str(e)[:330])
