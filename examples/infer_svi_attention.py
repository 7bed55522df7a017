"""Learn W_Q, W_K, W_V of cross attention by SVI with the edges enumerated.

The data are simulated from the structural model itself: each query i picks a key
phi_i ~ softmax_j(x_i^T W_Q^T W_K k_j) and emits y_i ~ N(W_V k_{phi_i}, sigma^2).
``structinfer.infer.svi`` maximises log p(y | x) = sum_i log sum_j p(phi_i = j | x)
N(y_i; W_V k_j, sigma^2) (TraceEnum_ELBO sums the edges out exactly) and we compare
the learned bilinear form W_Q^T W_K and W_V with the ones that generated the data.

    python examples/infer_svi_attention.py [--quick]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.ops.indexing import Vindex

import structinfer as si

D, DV, N, M = 3, 2, 5, 7
SIGMA = 0.3


def attention_model(xq, xk, y=None):
    wq = numpyro.param("wq", 0.1 * jnp.ones((D, D)) + 0.2 * jnp.eye(D))
    wk = numpyro.param("wk", 0.2 * jnp.eye(D))
    wv = numpyro.param("wv", jnp.zeros((DV, D)))
    with numpyro.plate("batch", xq.shape[0], dim=-2), numpyro.plate("queries", N, dim=-1):
        phi = si.infer.conditional_edge("phi", si.priors.Uniform(M),
                                        si.scores.Dot(xq @ wq.T, xk @ wk.T))
        values = xk @ wv.T  # (batch, keys, DV)
        numpyro.sample("y", dist.Normal(Vindex(values[:, None])[..., phi, :], SIGMA).to_event(1),
                       obs=y)


def simulate(rng: np.random.Generator, batch: int):
    wq, wk, wv = 1.5 * rng.normal(size=(D, D)), rng.normal(size=(D, D)), rng.normal(size=(DV, D))
    xq, xk = rng.normal(size=(batch, N, D)), rng.normal(size=(batch, M, D))
    S = np.einsum("bid,de,bje->bij", xq, wq.T @ wk, xk)
    A = np.exp(S - S.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    phi = np.array([[rng.choice(M, p=A[b, i]) for i in range(N)] for b in range(batch)])
    y = (xk @ wv.T)[np.arange(batch)[:, None], phi] + SIGMA * rng.normal(size=(batch, N, DV))
    return (xq.astype(np.float32), xk.astype(np.float32), y.astype(np.float32)), (wq, wk, wv)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small data, few steps (smoke test)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    batch = a.batch or (32 if a.quick else 256)
    steps = a.steps or (800 if a.quick else 3000)
    (xq, xk, y), (wq, wk, wv) = simulate(np.random.default_rng(a.seed), batch)
    _, result = si.infer.svi(jax.random.PRNGKey(a.seed), attention_model, xq, xk, y,
                             optim=numpyro.optim.Adam(0.05), num_steps=steps, progress_bar=False)
    P, losses = result.params, np.asarray(result.losses)
    bil, bil_true = np.asarray(P["wq"]).T @ np.asarray(P["wk"]), wq.T @ wk
    err_bil = np.linalg.norm(bil - bil_true) / np.linalg.norm(bil_true)
    err_wv = np.linalg.norm(np.asarray(P["wv"]) - wv) / np.linalg.norm(wv)
    print(f"steps {steps}  loss {losses[0]:.1f} -> {losses[-1]:.1f}")
    print(f"relative error  W_Q^T W_K: {err_bil:.3f}   W_V: {err_wv:.3f}")
    return {"err_bilinear": err_bil, "err_wv": err_wv, "losses": losses, "params": P}


if __name__ == "__main__":
    main()
