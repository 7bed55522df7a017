"""Quickstart: attention mechanisms written as NumPyro models, checked against the formulas.

Each mechanism below is an ordinary NumPyro model: one edge site per child with a
structural prior and a score, and the output recorded as a deterministic site.
structinfer collapses the edges exactly and we compare its answers with the
hand-written softmax expressions (Singh & Buckley, sec. 3 and appendix 8).

    python examples/quickstart.py            # n = 64 tokens
    python examples/quickstart.py --quick    # n = 11 tokens (CI smoke run)
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpyro

import structinfer as si


def make_model(prior_fn):
    """Self/cross attention with a given structural prior: only the prior changes."""

    def model(xq, xk, wq, wk, wv):
        n, m = xq.shape[0], xk.shape[0]
        with numpyro.plate("queries", n):
            q, k = xq @ wq.T, xk @ wk.T
            j = si.edge("phi", prior_fn(n, m), si.scores.Dot(q, k, scale=q.shape[-1] ** -0.5))
            numpyro.deterministic("out", (xk @ wv.T)[j])

    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    jax.config.update("jax_enable_x64", True)

    n, d, dk = (11, 5, 3) if args.quick else (64, 32, 16)
    keys = jax.random.split(jax.random.PRNGKey(args.seed), 5)
    x = jax.random.normal(keys[0], (n, d))
    xk = jax.random.normal(keys[1], (n + 3, d))
    wq, wk, wv = (jax.random.normal(kk, (dk, d)) / d**0.5 for kk in keys[2:])
    Q, K, V = x @ wq.T, x @ wk.T, x @ wv.T
    S = Q @ K.T / dk**0.5

    i, jj = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    bias = jnp.sin(jnp.arange(2 * n - 1) / 3.0)  # a relative-position log-bias
    graph = (jnp.abs(i - jj) % 3 == 0)  # an arbitrary sparse graph (keeps self-edges)
    cases = {
        "cross attention": (
            make_model(lambda n_, m: si.priors.Uniform(m)),
            (x, xk, wq, wk, wv),
            jax.nn.softmax((x @ wq.T) @ (xk @ wk.T).T / dk**0.5, -1) @ (xk @ wv.T),
        ),
        "self attention": (
            make_model(lambda n_, m: si.priors.Uniform(m)),
            (x, x, wq, wk, wv),
            jax.nn.softmax(S, -1) @ V,
        ),
        "causal (masked) attention": (
            make_model(lambda n_, m: si.priors.Restricted.causal(n_)),
            (x, x, wq, wk, wv),
            jax.nn.softmax(jnp.where(i >= jj, S, -jnp.inf), -1) @ V,
        ),
        "graph attention": (
            make_model(lambda n_, m: si.priors.Restricted.from_graph(graph)),
            (x, x, wq, wk, wv),
            jax.nn.softmax(jnp.where(graph, S, -jnp.inf), -1) @ V,
        ),
        "relative-position attention": (
            make_model(lambda n_, m: si.priors.RelativePosition(bias, m)),
            (x, x, wq, wk, wv),
            jax.nn.softmax(S + bias[i - jj + n - 1], -1) @ V,
        ),
        "geometric (recency) attention": (
            make_model(lambda n_, m: si.priors.Geometric(0.2, m)),
            (x, x, wq, wk, wv),
            jax.nn.softmax(
                jnp.where(i >= jj, S + (i - jj) * jnp.log1p(-0.2), -jnp.inf), -1
            ) @ V,
        ),
    }
    print(f"{'mechanism':32s} {'max |model - formula|':>22s}")
    worst = 0.0
    for name, (model, margs, ref) in cases.items():
        out = jax.jit(lambda *a, model=model: si.expectation(model, "out", *a))(*margs)
        err = float(jnp.max(jnp.abs(out - ref)))
        worst = max(worst, err)
        print(f"{name:32s} {err:22.2e}")
    ok = worst < 1e-10
    print("all equal to the hand-written formulas (float64):", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
