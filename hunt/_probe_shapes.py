import numpy as np, jax, jax.numpy as jnp, numpyro
import structinfer as si
s=jnp.zeros((2,4,6))
for a0 in (jnp.full((6,),0.1), jnp.full((3,4),0.1)):
    try: si.infer.geometric_beta(s, a0, 0.9, offset=2); print("ok", a0.shape)
    except Exception as e: print(a0.shape, type(e).__name__, str(e)[:160])
X = jax.random.normal(jax.random.key(0), (7, 3))
def hop(X, mu):
    with numpyro.plate("q", mu.shape[0]):
        si.edge("m", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=1.0))
for p in (jnp.ones((3,3)), jnp.ones((4,2,3))):
    try: si.infer.cccp(si.infer.model_log_z(hop,"mu",X), X[:2], precision=p, max_iters=3); print("ok", p.shape)
    except Exception as e: print("cccp precision", p.shape, type(e).__name__, str(e)[:200])
