"""Tune and check structinfer's GPU kernels on one card (no model path, no peers).

For each case of ``benchmarks/gpu.py`` and each size, the edge site is lowered once and
its kernels timed on it: the Pallas (Triton) forward at its defaults and the Mosaic GPU
(Hopper) forward at each pipeline depth (``max_concurrent_steps``); then the backward on
the Triton forward's output (the queries', keys' and values' gradients, the prior's
parameters not differentiated): the Triton kernel's own passes, with the Mosaic GPU dQ
pass (`mosaic_dq`), with the Mosaic GPU dK/dV pass (`mosaic_dkdv`), and with both; then,
for a relative-position prior, both with the table's gradient too, two ways side by
side: the Triton kernel's table pass after them, and the sum in the Mosaic GPU dK/dV
pass (``table_grad``, what ``auto`` runs; the difference is what training the table
adds). Each Mosaic GPU result is checked against the Triton kernel's (relative to its
largest magnitude; the row log-normaliser to float32 rounding; the table's gradient
summed in the dK/dV pass against the Triton table pass's). ``benchmarks/gpu.py`` times
the whole model path against the peers; this script answers which kernel and which depth to pick.

    python benchmarks/gpu_tune.py                         # n = 4096 x 32 heads, 16384 x 16
    python benchmarks/gpu_tune.py --sizes 4096 --heads 32 --steps 2 3 --cases relpos
    python benchmarks/gpu_tune.py --quick     # tiny sizes on a CPU (Pallas interpreted;
                                              # the Mosaic GPU cells say why not)

Cells: milliseconds per call (best of 3 groups of 10 after a warm-up, compile excluded) /
dense-equivalent TFLOP/s on the allowed pairs, as in ``benchmarks/gpu.py`` (the backward
counted as 2.5 forwards).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu  # noqa: E402  (benchmarks/gpu.py: cases, inputs, timing)

import structinfer as si  # noqa: E402
from structinfer.lowering import KERNELS  # noqa: E402
from structinfer.lowering._lower import lower_edge  # noqa: E402
from structinfer.lowering.accel import pallas_backward, pallas_forward  # noqa: E402
from structinfer.lowering.mosaic import (  # noqa: E402
    mosaic_dkdv,
    mosaic_dkdv_unsupported,
    mosaic_dq,
    mosaic_dq_unsupported,
    mosaic_forward,
)

CASES = ("dense", "causal", "window", "relpos", "geometric", "bias", "block_sparse")


def prior(case: str, p: gpu.Problem, window: int):
    """The structural prior of ``benchmarks/gpu.py``'s case."""
    n = p.n
    return {
        "dense": lambda: si.priors.Uniform(n),
        "causal": lambda: si.priors.Restricted.causal(n),
        "window": lambda: si.priors.Restricted.window(n, window),
        "relpos": lambda: si.priors.RelativePosition(p.relpos, n),
        "geometric": lambda: si.priors.Geometric(gpu.bench.GEO_Q, n),
        "bias": lambda: si.priors.Categorical(p.colbias),
        "block_sparse": lambda: si.priors.Restricted.block_sparse(*gpu.sparse_blocks(n)),
    }[case]()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, nargs="+", default=[32, 16])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--steps", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--budget-seconds", type=float, default=240.0)
    ap.add_argument("--quick", action="store_true",
                    help="n = 256, 2 heads, head dim 64, every case (runs on a CPU)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.heads, args.head_dim = [256], [2], 64
    heads = args.heads + args.heads[-1:] * (len(args.sizes) - len(args.heads))
    dtype = jnp.dtype(args.dtype)
    t_start = time.perf_counter()
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}; {args.dtype}, "
          f"head dim {args.head_dim}; load {os.getloadavg()[0]:.2f}", flush=True)
    cols = (["pallas"] + [f"mosaic s={s}" for s in args.steps]
            + ["bwd pallas", "bwd mosaic dQ", "bwd mosaic dK/dV", "bwd mosaic both",
               "+ table's gradient: Triton pass", "+ table's gradient: in dK/dV"])
    print("| n | heads | case | " + " | ".join(cols)
          + " | mosaic err (y rel., L abs.; dQ, dK, dV rel.; table rel.) |")
    print("|" + " --- |" * (len(cols) + 4), flush=True)
    for n, H in zip(args.sizes, heads):
        p = gpu.Problem(n, H, args.head_dim, dtype)
        for case in args.cases:
            if time.perf_counter() - t_start > args.budget_seconds:
                print(f"| {n} | {H} | {case} | skipped (budget) |", flush=True)
                continue
            print(row(p, case, args), flush=True)
    return 0


def timed(fn, arg, rate: float):
    """``(cell, first result or None)`` of ``jax.jit(fn)(arg)`` (``arg`` a pytree): best of
    3 groups of 10 calls after a warm-up, or why it failed."""
    f = jax.jit(fn)
    try:
        first, _, best, _ = gpu.time_calls(lambda: f(arg), jax.block_until_ready, 3, 10, 15.0)
    except Exception as err:  # noqa: BLE001 (report and go on)
        return f"failed: {gpu._short(err, 300)}", None
    return f"{best * 1e3:.3g} ms / {rate / best:.0f}", first


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max()) / (float(np.abs(want).max()) or 1.0)


def row(p: gpu.Problem, case: str, args) -> str:
    """One table row: the forwards at each depth, then the backward (the queries', keys'
    and values' gradients): the Triton kernel's, with the Mosaic GPU dQ pass, with its
    dK/dV pass, and with both; then both with a relative-position table's gradient, from
    the Triton table pass and summed in the Mosaic GPU dK/dV pass."""
    n, H, d = p.n, p.H, p.d
    low = lower_edge(prior(case, p, args.window), si.scores.Dot(p.q, p.k, scale=d ** -0.5),
                     p.v, n, (H,))
    terms, bs, mask = low.terms, low.batch_shape, low.mask
    rate = gpu.flops(case, H, n, d, "fwd", args.window) / 1e12
    cells, errs = [], []
    fwd, first = timed(lambda pr: pallas_forward(terms, pr, bs, mask=mask), low.problem, rate)
    cells.append(fwd)
    for s in args.steps:
        why = KERNELS["mosaic"].unsupported(low)
        if why:
            cells.append(f"refused: {why}")
            continue
        cell, got = timed(lambda pr, s=s: mosaic_forward(
            terms, pr, bs, max_concurrent_steps=s, mask=mask), low.problem, rate)
        cells.append(cell)
        if got is not None and first is not None:
            fin = np.isfinite(np.asarray(first[1]))
            dl = np.abs(np.asarray(got[1])[fin] - np.asarray(first[1])[fin])
            errs.append(f"{rel_err(got[0], first[0]):.1e}, {float(dl.max()):.1e}")
    if first is None:
        return f"| {n} | {H} | {case} | " + " | ".join(cells) + " |"
    y, lse = first
    # the backward reads the forward's row statistics (m, log l), as the kernel table's does
    stats = pallas_forward(terms, low.problem, bs, mask=mask, stats=True)[1]
    d_out = p.w.astype(y.dtype)
    d_lse = jnp.zeros_like(lse)
    none = frozenset()  # the prior's parameters not differentiated (as benchmarks/gpu.py)
    args_bwd = (low.problem, y, stats, d_out, d_lse)  # arguments, not constants of the program
    own, ref = timed(lambda a: pallas_backward(terms, a[0], bs, *a[1:], mask=mask,
                                               need_glob=none), args_bwd, 2.5 * rate)
    cells.append(own)
    why_dq = (KERNELS["mosaic"].unsupported(low)
              or mosaic_dq_unsupported(terms, low.problem, bs, mask))
    why_dkdv = (KERNELS["mosaic"].unsupported(low)
                or mosaic_dkdv_unsupported(terms, low.problem, bs, mask))
    for passes, why in (({"dq_pass": mosaic_dq}, why_dq),
                        ({"dkdv_pass": mosaic_dkdv}, why_dkdv),
                        ({"dq_pass": mosaic_dq, "dkdv_pass": mosaic_dkdv}, why_dq or why_dkdv)):
        if why:
            cells.append(f"refused: {why}")
            continue
        cell, got = timed(lambda a, kw=passes: pallas_backward(
            terms, a[0], bs, *a[1:], mask=mask, need_glob=none, **kw), args_bwd, 2.5 * rate)
        cells.append(cell)
        if got is not None and ref is not None:
            errs.append(", ".join(f"{rel_err(a, b):.1e}" for a, b in (
                (got[0].q, ref[0].q), (got[1].k, ref[1].k), (got[4], ref[4]))))
    if terms.relpos is None:
        cells += ["—", "—"]
    elif why_dq or why_dkdv:
        cells += ["refused: " + (why_dq or why_dkdv)] * 2
    else:  # every parameter differentiated: the table's gradient too
        def apart(*a, table_grad, **kw):  # the dK/dV pass leaves the table to its own pass
            return mosaic_dkdv(*a, **kw)

        why_sum = mosaic_dkdv_unsupported(terms, low.problem, bs, mask, table_grad=True)
        tables = []
        for hook in (apart, mosaic_dkdv):
            if hook is mosaic_dkdv and why_sum:
                cells.append(f"refused: {why_sum}")
                tables.append(None)
                continue
            cell, got = timed(lambda a, h=hook: pallas_backward(
                terms, a[0], bs, *a[1:], mask=mask, dq_pass=mosaic_dq, dkdv_pass=h),
                args_bwd, 2.5 * rate)
            cells.append(cell)
            tables.append(None if got is None else got[3].relpos)
        if None not in tables:
            errs.append(f"table {rel_err(tables[1], tables[0]):.1e}")
    return f"| {n} | {H} | {case} | " + " | ".join(cells) + " | " + "; ".join(errs) + " |"


if __name__ == "__main__":
    raise SystemExit(main())
