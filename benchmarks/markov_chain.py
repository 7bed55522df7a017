"""Markov edges: the exact engine's cost in the chain length T, and the fused scan's.

A chain of T edges with K states written with ``si.priors.Markov`` in a ``scan`` (the
engine: NumPyro's enumeration of the scan, funsor's parallel-scan sum-product), timed
for ``si.log_marginal``, ``si.marginals`` (forward-backward as the gradient of log Z) and
``si.map_edges`` (Viterbi as the gradient of the max-product), next to a plain
``lax.scan`` forward algorithm (the naive twin, log Z only). Then the posterior
expectation of the value (the one-hot edge, i.e. the smoothed marginals) two ways, side
by side: ``si.expectation`` (the exact engine) and ``si.attention`` (the lowering's fused
forward-backward ``lax.scan``, kernel ``markov_scan``), with the ratio exact/fused of
their run times (and of their compile times), and the fused kernel alone on factors
already read off the model (``chain_factors``). Printed per T: compile seconds and the
best of three runs in milliseconds, and the load average before and after (read the
ratios, not the absolute times, on a shared machine).

    python benchmarks/markov_chain.py --quick     # T = 500, 2000
    python benchmarks/markov_chain.py             # T = 500 .. 100000, K = 8
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.contrib.control_flow import scan

import structinfer as si
from structinfer.exact import chain_factors
from structinfer.lowering.markov import markov_scan


def hmm(emission, log_transition, log_initial):
    """A chain of edges; the emission log-potentials are the edge's score."""
    prior = si.priors.Markov(log_transition, log_initial)
    k = emission.shape[-1]

    def step(previous, e):
        z = si.edge("z", prior, e, previous=previous)
        numpyro.deterministic("v", jax.nn.one_hot(z, k, dtype=emission.dtype))
        return z, None

    scan(step, jnp.asarray(-1), emission)


def forward(emission, log_transition, log_initial):
    """The naive twin: a lax.scan forward algorithm, O(T K^2), sequential."""
    lt = jax.nn.log_softmax(log_transition, -1)
    a0 = jax.nn.log_softmax(log_initial) + emission[0]
    step = lambda a, e: (e + jax.nn.logsumexp(a[:, None] + lt, 0), None)  # noqa: E731
    return jax.nn.logsumexp(jax.lax.scan(step, a0, emission[1:])[0])


def _time(f, x):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    compile_s = time.perf_counter() - t0
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        runs.append(time.perf_counter() - t0)
    return compile_s, 1e3 * min(runs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 500 and 2000 only")
    ap.add_argument("-k", type=int, default=8, help="states K")
    ap.add_argument("--lengths", type=int, nargs="+", help="chain lengths T (overrides)")
    ap.add_argument("--pair-only", action="store_true",
                    help="only the exact engine / fused scan comparison")
    args = ap.parse_args(argv)
    lengths = (500, 2000) if args.quick else (500, 2000, 8000, 100_000)
    lengths = tuple(args.lengths) if args.lengths else lengths
    rng = np.random.default_rng(0)
    k = args.k
    lt = jnp.asarray(rng.normal(size=(k, k)), jnp.float32)
    li = jnp.zeros(k, jnp.float32)
    print(f"load average {os.getloadavg()[0]:.1f}; K = {k}; compile s / run ms")
    for t in lengths:
        em = jnp.asarray(rng.normal(size=(t, k)), jnp.float32)
        fns = {
            "log_marginal": lambda e: si.log_marginal(hmm, e, lt, li),
            "marginals": lambda e: si.marginals(hmm, e, lt, li)["z"],
            "map_edges": lambda e: si.map_edges(hmm, e, lt, li)["z"],
            "lax.scan forward": lambda e: forward(e, lt, li),
        }
        if not args.pair_only:
            row = {n: _time(jax.jit(f), em) for n, f in fns.items()}
            print(f"T = {t:>6}: " + "; ".join(f"{n} {c:.1f} s / {r:.2f} ms"
                                              for n, (c, r) in row.items()))
        fused = si.attention(hmm, "v")
        pair = {
            "exact si.expectation": lambda e: si.expectation(hmm, "v", e, lt, li),
            "fused markov_scan": lambda e: fused(e, lt, li),
        }
        jitted = {n: jax.jit(f) for n, f in pair.items()}
        row = {n: _time(f, em) for n, f in jitted.items()}
        (ce, re), (cf_, rf) = row.values()
        # the programs just timed (an eager run would compile every primitive again)
        exact_v, fused_v = (f(em) for f in jitted.values())
        err = float(jnp.max(jnp.abs(exact_v - fused_v)))
        cf = chain_factors(hmm, (em, lt, li))
        one = jax.nn.one_hot(jnp.arange(k), k, dtype=em.dtype)
        table = jnp.broadcast_to(one, (t, k, k))
        _, kernel = _time(jax.jit(lambda p: markov_scan(cf.initial, p, table)[0]), cf.pair)
        print(f"T = {t:>6}, E[one-hot edge]: " + "; ".join(
            f"{n} {c:.1f} s / {r:.2f} ms" for n, (c, r) in row.items())
            + f"; exact/fused run {re / rf:.1f}x, compile {ce / cf_:.1f}x; max |diff| {err:.1e}; "
            f"the kernel alone on given factors {kernel:.2f} ms (the rest is the model's "
            "traced scan)")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
