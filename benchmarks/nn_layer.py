"""Training step of ``structinfer.nn.Attention`` vs ``flax.nnx.MultiHeadAttention``.

One training step = the layer's forward pass on ``(batch, n, features)``, the gradient
of a linear loss with respect to every parameter, and an Adam update, jitted as one
program. Both layers have the same parameters (the structinfer layer built from
``si.nn.causal()`` / ``si.nn.window(W)`` equals flax's with a causal / banded mask; the
script checks it at the smallest size). Printed per sequence length: the median step
time of each (the two take turns, in a shuffled order each round, so a slow spell of
this shared machine hits both), their ratio (flax / structinfer, > 1: structinfer is
faster) and XLA's temporary-buffer size of each compiled step (peak extra memory). The
load average is printed before and after: read the ratios, not the absolute times.

    python benchmarks/nn_layer.py --quick     # seconds (a test runs this)
    python benchmarks/nn_layer.py             # n = 512 .. 4096, causal and window 128
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from structinfer import nn as sinn


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):  # pragma: no cover
        return "n/a"


def band_mask(n: int, window: int | None) -> jax.Array:
    d = jnp.arange(n)[:, None] - jnp.arange(n)[None, :]
    keep = d >= 0 if window is None else (d >= 0) & (d < window)
    return keep[None, None]  # (1, 1, n, n), broadcast over batch and heads


class Flax(nnx.Module):
    """flax.nnx.MultiHeadAttention with the case's mask (causal, or a causal band)."""

    def __init__(self, cfg, window, rngs):
        self.mha = nnx.MultiHeadAttention(num_heads=cfg.heads, in_features=cfg.features,
                                          decode=False, rngs=rngs)
        self.window = window

    def __call__(self, x):
        return self.mha(x, mask=band_mask(x.shape[-2], self.window))


def make_layers(cfg, case: str):
    window = None if case == "causal" else cfg.window
    ours = sinn.Attention(sinn.causal() if window is None else sinn.window(window),
                          num_heads=cfg.heads, in_features=cfg.features, rngs=nnx.Rngs(0),
                          block_q=cfg.block_q, block_k=cfg.block_k)
    peer = Flax(cfg, window, nnx.Rngs(0))
    return {"structinfer": ours, "flax": peer}


def make_step(module):
    """A pure jitted training step ``(params, opt_state, x, w) -> (params, opt_state, loss)``."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    tx = optax.adam(1e-3)

    def loss(params, x, w):
        return jnp.sum(nnx.merge(graphdef, params, rest)(x) * w)

    @jax.jit
    def step(params, opt_state, x, w):
        value, grads = jax.value_and_grad(loss)(params, x, w)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, params, tx.init(params)


def temp_mib(compiled) -> float | None:
    try:
        ma = compiled.memory_analysis()
        return ma.temp_size_in_bytes / 2**20 if ma is not None else None
    except Exception:  # pragma: no cover - backend without memory analysis
        return None


def interleaved(calls: dict, reps: int) -> dict:
    """Median seconds of each ``name: thunk``; the thunks take turns in a shuffled order."""
    ts = {name: [] for name in calls}
    for f in calls.values():  # compile and warm up
        jax.block_until_ready(f())
    rng = np.random.default_rng(0)
    for _ in range(reps):
        order = list(calls)
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            jax.block_until_ready(calls[name]())
            ts[name].append(time.perf_counter() - t0)
    return {name: statistics.median(x) for name, x in ts.items()}


def check_equal(cfg, case: str, n: int) -> float:
    layers = make_layers(cfg, case)
    nnx.update(layers["structinfer"], nnx.state(layers["flax"].mha, nnx.Param))
    x = jax.random.normal(jax.random.key(1), (cfg.batch, n, cfg.features))
    return float(jnp.abs(layers["structinfer"](x) - layers["flax"](x)).max())


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a test runs this)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--cases", nargs="+", default=["causal", "window"],
                    choices=["causal", "window"])
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-q", type=int, default=256)
    ap.add_argument("--block-k", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    cfg = ap.parse_args(argv)
    if cfg.quick:
        cfg.sizes, cfg.heads, cfg.head_dim, cfg.window, cfg.reps = [160], 2, 8, 16, 2
        cfg.cases = cfg.cases if argv and "--cases" in argv else ["window"]
        cfg.block_q, cfg.block_k = 32, 64
    cfg.features = cfg.heads * cfg.head_dim
    print(f"load average {loadavg()}; jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"{os.cpu_count()} CPUs; float32, batch {cfg.batch}, {cfg.heads} heads x head dim "
          f"{cfg.head_dim}; training step = forward + gradient + Adam")
    rows = []
    for case in cfg.cases:
        err = check_equal(cfg, case, min(cfg.sizes))
        print(f"\n{case}{'' if case == 'causal' else f' {cfg.window}'}: max |structinfer - flax| "
              f"output at n={min(cfg.sizes)}: {err:.1e}")
        assert err < 1e-4, err
        print(f"{'n':>6s} {'structinfer ms':>15s} {'flax ms':>9s} {'flax/ours':>10s} "
              f"{'ours MiB':>9s} {'flax MiB':>9s}")
        for n in cfg.sizes:
            x = jax.random.normal(jax.random.key(2), (cfg.batch, n, cfg.features))
            w = jax.random.normal(jax.random.key(3), (cfg.batch, n, cfg.features))
            calls, mem = {}, {}
            for name, module in make_layers(cfg, case).items():
                step, params, opt_state = make_step(module)
                args = (params, opt_state, x, w)
                compiled = step.lower(*args).compile()  # compiled once: timed and measured
                mem[name] = temp_mib(compiled)
                calls[name] = lambda compiled=compiled, args=args: compiled(*args)[2]
            t = interleaved(calls, cfg.reps)
            row = {"case": case, "n": n, "seconds": t, "temp_mib": mem}
            rows.append(row)
            fmt = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
            print(f"{n:6d} {t['structinfer'] * 1e3:15.1f} {t['flax'] * 1e3:9.1f} "
                  f"{t['flax'] / t['structinfer']:10.2f} {fmt(mem['structinfer']):>9s} "
                  f"{fmt(mem['flax']):>9s}", flush=True)
    print(f"\nload average {loadavg()}")
    return rows


if __name__ == "__main__":
    main()
