import numpy as np, jax, jax.numpy as jnp, numpyro
import structinfer as si
X = jax.random.normal(jax.random.key(0), (7, 3))
def hop(X, mu):
    with numpyro.plate("q", mu.shape[0]):
        si.edge("m", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=1.0))
mu0 = X[:2]+0.1
try: si.infer.cccp(si.infer.model_log_z(hop,"mu",X), mu0, precision=-1.0); print("eager ok")
except ValueError as e: print("eager:", str(e)[:90])
st, info = jax.jit(lambda p: si.infer.cccp(si.infer.model_log_z(hop,"mu",X), mu0, precision=p))(-1.0)
print("cccp jit precision=-1: mu finite?", bool(jnp.all(jnp.isfinite(st.mu))), "energy", float(st.energy), "nonfinite", bool(info.nonfinite), "conv", bool(info.converged))
s = jax.random.normal(jax.random.key(2),(4,4))
try: si.infer.geometric_beta(s, -0.5, 0.9); print("eager ok")
except ValueError as e: print("eager:", str(e)[:90])
st, info = jax.jit(lambda a: si.infer.geometric_beta(s, a, 0.9))(-0.5)
print("geometric_beta jit alpha0=-0.5: attention finite?", bool(jnp.all(jnp.isfinite(st.attention))), "energy", np.asarray(st.energy), "nonfinite", np.asarray(info.nonfinite))
st, info = jax.jit(lambda a: si.infer.geometric_beta(s, a, 0.9, method="plugin"))(-0.5)
print("plugin jit alpha0=-0.5: attention finite?", bool(jnp.all(jnp.isfinite(st.attention))), "energy", np.asarray(st.energy), "nonfinite", np.asarray(info.nonfinite), "mean_q", np.asarray(st.mean_q))
