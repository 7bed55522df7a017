"""NUTS over the geometric rate q and a temperature beta of expanding attention,
with the edges enumerated (summed out exactly by funsor inside the potential).

Simulated data: each query i picks an earlier-or-same position with prior
Geo(q) over the distance and score beta * x_i^T x_j, and emits y_i ~ N(v_{phi_i}, s^2).
The posterior of (q, beta) is compared with the values that generated the data.

    python examples/infer_nuts_expanding.py [--quick]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import summary
from numpyro.ops.indexing import Vindex

import structinfer as si

N, D, NOISE = 11, 3, 0.2


def expanding_model(x, v, y=None):
    v = jnp.asarray(v)
    q = numpyro.sample("q", dist.Beta(1.0, 1.0))
    beta = numpyro.sample("beta", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("batch", x.shape[0], dim=-2), numpyro.plate("queries", N, dim=-1):
        phi = si.infer.conditional_edge("phi", si.priors.Geometric(q, N),
                                        si.scores.Dot(x, x, scale=beta))
        numpyro.sample("y", dist.Normal(Vindex(v[:, None])[..., phi], NOISE), obs=y)


def simulate(rng: np.random.Generator, batch: int, q: float, beta: float):
    x, v = rng.normal(size=(batch, N, D)), rng.normal(size=(batch, N))
    d = np.arange(N)[:, None] - np.arange(N)[None, :]
    logits = beta * np.einsum("bid,bjd->bij", x, x) + np.where(
        d >= 0, d * np.log1p(-q), -np.inf)
    A = np.exp(logits - logits.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    phi = np.array([[rng.choice(N, p=A[b, i]) for i in range(N)] for b in range(batch)])
    y = v[np.arange(batch)[:, None], phi] + NOISE * rng.normal(size=(batch, N))
    return x.astype(np.float32), v.astype(np.float32), y.astype(np.float32)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small data, short chains (smoke test)")
    p.add_argument("--q", type=float, default=0.3)
    p.add_argument("--beta", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--samples", type=int, default=None, help="warmup steps = draws")
    a = p.parse_args(argv)
    batch, draws = (16, 100) if a.quick else (64, 500)
    batch, draws = a.batch or batch, a.samples or draws
    warm = draws
    x, v, y = simulate(np.random.default_rng(a.seed), batch, a.q, a.beta)
    mcmc = si.infer.nuts(jax.random.PRNGKey(a.seed), expanding_model, x, v, y, num_warmup=warm,
                         num_samples=draws, progress_bar=False)
    s = mcmc.get_samples()
    summ = summary(mcmc.get_samples(group_by_chain=True), group_by_chain=True)
    for name, true in (("q", a.q), ("beta", a.beta)):
        print(f"{name}: true {true:.3f}  posterior mean {float(s[name].mean()):.3f} "
              f"sd {float(s[name].std()):.3f}  r_hat {float(summ[name]['r_hat']):.3f}")
    return {"samples": s, "summary": summ, "true": {"q": a.q, "beta": a.beta}}


if __name__ == "__main__":
    main()
