"""Derive new attention mechanisms by editing a model (the code of docs/tutorial.md).

Start from cross attention written as a NumPyro model, then change one statement at a
time — the prior (uniform -> window -> relative position -> geometric x Beta), the
score (dot -> inverse distance) and the value (one hop -> two hops) — and print what
each edit does to the attention matrix. Every matrix comes out of the exact engine
(``si.marginals`` / ``si.expectation``); nothing is derived by hand.

    python examples/derive_mechanisms.py            # 13 tokens
    python examples/derive_mechanisms.py --quick    # 7 tokens, a coarse q grid (smoke test)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.handlers import substitute

import structinfer as si

# ----------------------------------------------------------------------- the base model


def cross_attention(xq, xk, wq, wk, wv):
    """Singh & Buckley sec. 3.2: each query takes one key; uniform prior, dot potential."""
    n, m = xq.shape[0], xk.shape[0]
    with numpyro.plate("queries", n):
        j = si.edge("phi", si.priors.Uniform(m), si.scores.Dot(xq @ wq.T, xk @ wk.T))
        numpyro.deterministic("out", (xk @ wv.T)[j])


# ------------------------------------------------------------------ edit 1: the prior


def window_attention(xq, xk, wq, wk, wv, size=3):
    """Prior: uniform over the last `size` keys (a restricted prior)."""
    n, m = xq.shape[0], xk.shape[0]
    with numpyro.plate("queries", n):
        prior = si.priors.Restricted.window(n, size, num_parents=m)  # <- the edit
        j = si.edge("phi", prior, si.scores.Dot(xq @ wq.T, xk @ wk.T))
        numpyro.deterministic("out", (xk @ wv.T)[j])


def relative_attention(xq, xk, wq, wk, wv, slope=0.7):
    """Prior: a log-weight per distance d = i - j (a categorical, relative-position prior)."""
    n, m = xq.shape[0], xk.shape[0]
    d = jnp.arange(-(m - 1), n)  # every distance, in the order RelativePosition reads them
    with numpyro.plate("queries", n):
        prior = si.priors.RelativePosition(-slope * jnp.abs(d), m, causal=True)  # <- the edit
        j = si.edge("phi", prior, si.scores.Dot(xq @ wq.T, xk @ wk.T))
        numpyro.deterministic("out", (xk @ wv.T)[j])


def expanding_attention(xq, xk, wq, wk, wv, alpha=1.0, beta=3.0):
    """Prior: geometric in the distance, with a Beta hyperprior on its parameter q."""
    n, m = xq.shape[0], xk.shape[0]
    q = numpyro.sample("q", dist.Beta(alpha, beta))  # <- the edit (two lines)
    with numpyro.plate("queries", n):
        prior = si.priors.Geometric(q, m)
        j = si.edge("phi", prior, si.scores.Dot(xq @ wq.T, xk @ wk.T))
        numpyro.deterministic("out", (xk @ wv.T)[j])


# ------------------------------------------------------------------ edit 2: the score


def idw_attention(xq, xk, wq, wk, wv, eps=1e-2):
    """Score: -log(eps + ||q - k||^2), inverse distance weighting (McCarter)."""
    n, m = xq.shape[0], xk.shape[0]
    with numpyro.plate("queries", n):
        score = si.scores.NegLogDist(xq @ wq.T, xk @ wk.T, p=2.0, eps=eps)  # <- the edit
        j = si.edge("phi", si.priors.Uniform(m), score)
        numpyro.deterministic("out", (xk @ wv.T)[j])


# ------------------------------------------------------------------ edit 3: the value


def two_hop_attention(xq, xk, wq, wk, wv):
    """Value: follow the edge of the node the first hop reached (Singh & Buckley sec. 5.1).

    Each position is one node carrying a query and a key vector, so node j's edge is
    the query-j row. ``reach`` records which nodes the two hops visit, so its
    expectation is the matrix P + P^2 that multiplies the values."""
    n = xq.shape[0]
    prior, score = si.priors.Uniform(n), si.scores.Dot(xq @ wq.T, xk @ wk.T)
    with numpyro.plate("queries", n):
        j1 = si.edge("hop1", prior, score)
        j2 = si.edge("hop2", prior, score, child=j1)  # <- the edit (and the value below)
        numpyro.deterministic("out", (xk @ wv.T)[j1] + (xk @ wv.T)[j2])
        numpyro.deterministic("reach", jax.nn.one_hot(j1, n) + jax.nn.one_hot(j2, n))


# ------------------------------------------------------------------------ the data


def make_data(n: int, d: int = 5, seed: int = 0):
    """Keys k_j at random; the query of token i looks for the key two positions back
    (q_i = k_{i-2} + noise), so attention has a structure to find. Identity projections."""
    r = np.random.default_rng(seed)
    keys = r.normal(size=(n, d))
    queries = r.normal(size=(n, d))
    queries[2:] = keys[:-2] + 0.5 * r.normal(size=(n - 2, d))
    eye = jnp.eye(d)
    return jnp.asarray(queries), jnp.asarray(keys), eye, eye, eye


def attention_of(model, *args):
    """The attention matrix p(phi_i = j | x) from the exact engine."""
    return jax.jit(lambda *a: si.marginals(model, *a)["phi"])(*args)


def expanding_posterior(xq, xk, wq, wk, wv, grid_size: int):
    """Integrate q out on a grid: p(phi | x) = sum_q p(q | x) p(phi | x, q).

    ``si.log_marginal`` gives log p(x, q) with the edges collapsed exactly; the grid does
    the one remaining (continuous) dimension."""
    qs = jnp.linspace(0.02, 0.98, grid_size)

    def at(q):
        m = substitute(expanding_attention, data={"q": q})
        return si.log_marginal(m, xq, xk, wq, wk, wv), si.marginals(m, xq, xk, wq, wk, wv)["phi"]

    logp, att = jax.jit(jax.vmap(at))(qs)
    w = jax.nn.softmax(logp)  # uniform grid: the posterior weights of the grid points
    return jnp.einsum("g,gij->ij", w, att), float(w @ qs)


def summary(a) -> str:
    a = np.asarray(a)
    n, m = a.shape
    dist_ = (np.arange(n)[:, None] - np.arange(m)[None, :]) * 1.0
    mean_d = float(np.mean(np.sum(a * dist_, -1)))
    ent = float(np.mean(-np.sum(np.where(a > 0, a * np.log(np.where(a > 0, a, 1.0)), 0.0), -1)))
    return f"mean distance i - j = {mean_d:+.2f}, mean entropy = {ent:.2f} nats"


def show(title: str, a, rows: int) -> None:
    print(f"\n== {title}\n   {summary(a)}")
    with np.printoptions(precision=2, suppress=True, linewidth=120):
        print(np.asarray(a)[:rows])


def main(argv=None) -> dict[str, np.ndarray]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--tokens", type=int, default=None, help="sequence length")
    args = parser.parse_args(argv)
    n = args.tokens or (7 if args.quick else 13)
    grid = 9 if args.quick else 49
    data = make_data(n)
    rows = n

    results = {}
    results["uniform"] = attention_of(cross_attention, *data)
    show("cross attention (uniform prior, dot score)", results["uniform"], rows)
    results["window"] = attention_of(window_attention, *data)
    show("prior -> window of 3 (Restricted.window)", results["window"], rows)
    results["relative"] = attention_of(relative_attention, *data)
    show("prior -> relative position, log p = -0.7 |i - j|, causal", results["relative"], rows)
    results["expanding"], q_mean = expanding_posterior(*data, grid)
    show(
        f"prior -> geometric x Beta(1, 3), q integrated out (E[q | x] = {q_mean:.2f})",
        results["expanding"],
        rows,
    )
    results["idw"] = attention_of(idw_attention, *data)
    show("score -> inverse distance weighting", results["idw"], rows)
    two_hop = jax.jit(lambda *a: si.expectation(two_hop_attention, "reach", *a))
    results["two_hop"] = two_hop(*data)
    show("value -> two hops (the matrix P + P^2 applied to the values)", results["two_hop"], rows)
    p = np.asarray(results["uniform"])
    err = float(np.max(np.abs(np.asarray(results["two_hop"]) - (p + p @ p))))
    print(f"\ntwo hops vs (P + P^2) from the one-hop attention: max |difference| = {err:.1e}")
    return {k: np.asarray(v) for k, v in results.items()}


if __name__ == "__main__":
    main()
