"""Hopfield retrieval with the one-step update, written as a structinfer model.

The modern continuous Hopfield update (Ramsauer et al.; Singh & Buckley sec. 4.2,
Table 1 row 7) is

$$
\\xi \\leftarrow X\\, \\mathrm{softmax}(\\beta X^\\top \\xi),
$$

the posterior expectation of the stored pattern $x_\\phi$ under the edge posterior
of a model in which the state $\\xi$ takes one of the ``N`` stored patterns as its
parent, uniformly a priori, with potential $\\beta\\, \\xi^\\top x_j$. We write exactly
that model (``hopfield_model`` below: one edge site per query state, a ``Uniform``
prior, a ``Dot`` score and the value ``X[φ]``) and compute the update with
``si.expectation``; it is checked against the formula written by hand in float64.

Experiment: ``N`` random ±1 patterns in ``d = 64`` dimensions; a query is a stored
pattern with a fraction ``ρ`` of its signs flipped; one update step; retrieval counts
as correct when ``sign(ξ_new)`` equals the stored pattern in every bit. Accuracy over
``--queries`` queries per cell, for ``β ∈ {1/√d, 1}`` (the transformer scale and a
sharper one). As an independent baseline, the classical Hopfield network's one-step
update ``sign(W ξ)`` with Hebbian ``W = Σ_μ x_μ x_μᵀ`` (zero diagonal) on the same queries.

The papers in ``../shared/papers`` state no retrieval numbers (Singh & Buckley derive the
update; Ramsauer et al. are not in that folder), so this script reports the capacity
curves only; ``docs/reproductions.md`` says so.

    structinfer reproduce hopfield            # full grid
    structinfer reproduce hopfield --quick    # CI smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
import numpyro
from jax.typing import ArrayLike

import structinfer as si


def hopfield_model(xi: jax.Array, patterns: jax.Array, beta: float | jax.Array) -> None:
    """Each query state ``ξ_i`` takes one stored pattern as parent: ``φ_i ~ Uniform(N)``.

    The score is ``ψ(ξ_i, x_j) = β ξ_iᵀ x_j``; the value is the pattern ``x_{φ_i}``.
    """
    with numpyro.plate("queries", xi.shape[-2]):
        j = si.edge("phi", si.priors.Uniform(patterns.shape[-2]), si.scores.Dot(xi, patterns, scale=beta))
        numpyro.deterministic("out", patterns[j])


@jax.jit
def one_step(xi: ArrayLike, patterns: ArrayLike, beta: float | jax.Array) -> jax.Array:
    """The one-step update ``E[x_φ | ξ]`` for every query, by the exact engine."""
    return si.expectation(hopfield_model, "out", xi, patterns, beta)


def formula(xi: ArrayLike, patterns: ArrayLike, beta: float) -> np.ndarray:
    """``softmax(β ξ Xᵀ) X`` in float64 numpy (independent reference)."""
    s = beta * np.asarray(xi, np.float64) @ np.asarray(patterns, np.float64).T
    s -= s.max(-1, keepdims=True)
    w = np.exp(s)
    return (w / w.sum(-1, keepdims=True)) @ np.asarray(patterns, np.float64)


def classical_one_step(xi: ArrayLike, patterns: ArrayLike) -> np.ndarray:
    """Classical Hopfield: ``sign(W ξ)``, ``W = Σ x xᵀ`` with zero diagonal."""
    X = np.asarray(patterns, np.float64)
    W = X.T @ X
    np.fill_diagonal(W, 0.0)
    h = np.asarray(xi, np.float64) @ W
    return np.where(h >= 0, 1.0, -1.0)


def make_queries(
    rng: np.random.Generator, patterns: np.ndarray, rho: float, num: int
) -> tuple[np.ndarray, np.ndarray]:
    """``num`` queries: random stored patterns with a fraction ``rho`` of their signs flipped."""
    idx = rng.integers(0, patterns.shape[0], num)
    target = patterns[idx]
    d = patterns.shape[1]
    k = int(round(rho * d))
    flips = np.zeros((num, d), bool)
    for i in range(num):
        flips[i, rng.choice(d, k, replace=False)] = True
    return np.where(flips, -target, target).astype(np.float32), target


def main(argv: list[str] | None = None) -> int:
    """Run the reproduction from the command line (``argv``); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke run")
    ap.add_argument("--no-progress", action="store_true",
                    help="hide progress bars (this one shows none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("results/hopfield"))
    cfg = ap.parse_args(argv)
    sizes = [4, 8, 16, 64, 256, 1024, 4096]
    rhos = [0.0, 0.1, 0.2, 0.3, 0.4]
    d = cfg.dim
    betas = {"1/sqrt(d)": d**-0.5, "1": 1.0}
    if cfg.quick:
        sizes, rhos, cfg.queries = [8, 256], [0.1, 0.3], 100

    rng = np.random.default_rng(cfg.seed)
    # the model's update equals the hand-written formula
    pats = np.where(rng.random((37, d)) < 0.5, -1.0, 1.0).astype(np.float32)
    q, _ = make_queries(rng, pats, 0.2, 11)
    err = float(np.max(np.abs(np.asarray(one_step(q, pats, 0.3), np.float64) - formula(q, pats, 0.3))))
    print(f"structinfer one-step update vs softmax formula: max |diff| = {err:.2e}")
    assert err < 1e-5, err

    t0 = time.time()
    grid = {name: {} for name in [*betas, "classical"]}
    for n in sizes:
        pats = np.where(rng.random((n, d)) < 0.5, -1.0, 1.0).astype(np.float32)
        for rho in rhos:
            q, target = make_queries(rng, pats, rho, cfg.queries)
            key = f"N={n},rho={rho}"
            for name, beta in betas.items():
                new = np.asarray(one_step(q, pats, beta))
                grid[name][key] = float(np.mean(np.all(np.sign(new) == target, -1)))
            grid["classical"][key] = float(np.mean(np.all(classical_one_step(q, pats) == target, -1)))
    secs = time.time() - t0

    for name in grid:
        label = f"beta={name}" if name in betas else "classical Hopfield (Hebbian)"
        print(f"\n{label}: exact retrieval after one step (rows N, columns flip fraction rho)")
        print(f"{'N':>6s}" + "".join(f"{r:>8.1f}" for r in rhos))
        for n in sizes:
            print(f"{n:6d}" + "".join(f"{grid[name][f'N={n},rho={r}']:8.2f}" for r in rhos))

    # sanity of the physics, in every mode: a lightly corrupted query among few patterns
    # is retrieved, and the modern update beats the classical one beyond its capacity
    small, big = f"N={sizes[0]},rho={rhos[0]}", f"N={sizes[-1]},rho={rhos[0]}"
    assert grid["1"][small] >= 0.95, grid["1"][small]
    assert grid["1"][big] > grid["classical"][big], (grid["1"][big], grid["classical"][big])

    if not cfg.quick:
        cfg.out.mkdir(parents=True, exist_ok=True)
        res = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
               "sizes": sizes, "rhos": rhos, "betas": betas, "formula_max_abs_diff": err,
               "retrieval": grid, "seconds": secs}
        (cfg.out / "results.json").write_text(json.dumps(res, indent=1))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(grid), figsize=(4 * len(grid), 3.2), sharey=True)
        for ax, name in zip(axes, grid):
            for r in rhos:
                ax.plot(sizes, [grid[name][f"N={n},rho={r}"] for n in sizes], marker="o", label=f"ρ={r}")
            ax.set_xscale("log")
            ax.set_title(f"β={name}" if name in betas else "classical (Hebbian)")
            ax.set_xlabel("stored patterns N")
        axes[0].set_ylabel("exact retrieval, one step")
        axes[-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(cfg.out / "retrieval.png", dpi=120)
        plt.close(fig)
        print(f"\nwrote {cfg.out}/results.json and retrieval.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
