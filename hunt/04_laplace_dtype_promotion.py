"""si.infer.laplace returns float64 var_term/hessian/precision/covariance for a float32
model when jax_enable_x64 is on (mean and expectation_term stay float32, and
si.log_marginal of the same model is float32): the edge tables are promoted by the
prior's log-table, so the Laplace result silently changes dtype (float32 computed in
float64, a dtype that differs between fields of one result and from the exact engine's).
Responsible: structinfer/infer/laplace_approx.py `_edge_terms` (table = prior.log_table(..)
+ score.dense(), no cast to the score/latent dtype) -> probs -> var, hess, prec, cov.
Run also with X64=0 to see bf16."""
import os, sys
import numpy as np, jax, jax.numpy as jnp, numpyro
if os.environ.get("X64", "1") == "1":
    jax.config.update("jax_enable_x64", True)
import structinfer as si

X = jnp.asarray(np.random.default_rng(0).normal(size=(7, 3)), jnp.float32)

def hop(X, mu):
    numpyro.factor("node", -0.5 * jnp.sum(mu ** 2))
    with numpyro.plate("q", mu.shape[0]):
        si.edge("m", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=1.0))

print("x64:", jax.config.jax_enable_x64)
for dt in (jnp.float32, jnp.bfloat16):
    Xd = X.astype(dt)
    r = si.infer.laplace(hop, "mu", Xd[:2], Xd)
    print(f"model {jnp.dtype(dt).name}: log_marginal ->", si.log_marginal(hop, Xd, mu=Xd[:2]).dtype,
          "| Uniform.log_table ->", si.priors.Uniform(7).log_table(2).dtype,
          "| laplace ->", {k: jnp.dtype(getattr(r, k).dtype).name for k in r._fields})
