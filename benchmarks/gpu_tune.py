"""Tune and check structinfer's GPU forward kernels on one card (no model path, no peers).

For each case of ``benchmarks/gpu.py`` and each size, the edge site is lowered once and
its forward kernels timed on it: the Pallas (Triton) forward at its defaults, and the
Mosaic GPU (Hopper) forward at each pipeline depth (``max_concurrent_steps``). Each
Mosaic GPU output is checked against the Pallas forward's (relative to its largest
magnitude) and its row log-normaliser to float32 rounding. ``benchmarks/gpu.py`` times
the whole model path against the peers; this script answers which kernel and which
depth to pick.

    python benchmarks/gpu_tune.py                         # n = 4096 x 32 heads, 16384 x 16
    python benchmarks/gpu_tune.py --sizes 4096 --heads 32 --steps 2 3 --cases relpos
    python benchmarks/gpu_tune.py --quick     # tiny sizes on a CPU (Pallas interpreted;
                                              # the Mosaic GPU cells say why not)

Cells: milliseconds per forward call (best of 3 groups of 10 after a warm-up, compile
excluded) / dense-equivalent TFLOP/s on the allowed pairs, as in ``benchmarks/gpu.py``.
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
from structinfer.lowering.accel import pallas_forward  # noqa: E402
from structinfer.lowering.mosaic import mosaic_forward  # noqa: E402

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
    cols = ["pallas"] + [f"mosaic s={s}" for s in args.steps]
    print("| n | heads | case | " + " | ".join(cols) + " | mosaic err (y rel., L abs.) |")
    print("|" + " --- |" * (len(cols) + 4), flush=True)
    sync = jax.block_until_ready
    for n, H in zip(args.sizes, heads):
        p = gpu.Problem(n, H, args.head_dim, dtype)
        for case in args.cases:
            if time.perf_counter() - t_start > args.budget_seconds:
                print(f"| {n} | {H} | {case} | skipped (budget) |", flush=True)
                continue
            low = lower_edge(prior(case, p, args.window),
                             si.scores.Dot(p.q, p.k, scale=args.head_dim ** -0.5),
                             p.v, n, (H,))
            terms, bs, mask = low.terms, low.batch_shape, low.mask
            rate = gpu.flops(case, H, n, args.head_dim, "fwd", args.window) / 1e12
            cells, ref, errs = [], None, []
            runs = [("pallas", lambda pr: pallas_forward(terms, pr, bs, mask=mask))]
            for s in args.steps:
                runs.append((f"mosaic s={s}", lambda pr, s=s: mosaic_forward(
                    terms, pr, bs, max_concurrent_steps=s, mask=mask)))
            for name, fn in runs:
                why = KERNELS[name.split()[0]].unsupported(low)
                if why:
                    cells.append(f"refused: {why}")
                    continue
                try:
                    f = jax.jit(fn)
                    first, _, best, _ = gpu.time_calls(lambda f=f: f(low.problem), sync,
                                                       3, 10, 15.0)
                except Exception as err:  # noqa: BLE001 (report and go on)
                    cells.append(f"failed: {gpu._short(err, 300)}")
                    continue
                cells.append(f"{best * 1e3:.3g} ms / {rate / best:.0f}")
                y, lse = (np.asarray(x, np.float32) for x in first)
                if ref is None:
                    ref = (y, lse)
                    continue
                scale = float(np.abs(ref[0]).max()) or 1.0
                fin = np.isfinite(ref[1])
                errs.append(f"{float(np.abs(y - ref[0]).max()) / scale:.1e}, "
                            f"{float(np.abs(lse[fin] - ref[1][fin]).max()):.1e}")
            print(f"| {n} | {H} | {case} | " + " | ".join(cells) + " | "
                  + "; ".join(errs) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
