"""Attention benchmarks: the lowered engine against XLA, hand-written jnp, the exact
engine, torch SDPA and torch FlexAttention, side by side in one process.

Prints, per case, the median time after warm-up of each implementation, the time
ratio of every peer to ``structinfer`` (>1: structinfer is faster), the attained
rate as a fraction of a same-FLOP square matmul on this machine, and XLA's
temporary-buffer size (peak extra memory of the compiled program). No numbers are
asserted anywhere: timings on a shared machine are noisy; read the ratios. The load
average is printed beside every table.

    python benchmarks/attention.py --quick            # seconds (a test runs this)
    python benchmarks/attention.py --suite            # every table of docs/benchmarks.md,
                                                      # each in its own process (long)
    python benchmarks/attention.py --sizes 1024 4096 --cases dense window
    python benchmarks/attention.py --cpu-devices 2 --sizes 4096   # heads over 2 devices
    python benchmarks/attention.py --expanding        # sec 5.2 / Figure 3 right
    python benchmarks/attention.py --exact-engine-only   # exact engine row

Implementations take turns in a shuffled order each round (medians reported), so
machine noise hits them alike. JAX starts as installed, with one CPU device: the
single-device rows are what a user gets. ``--cpu-devices N`` starts it with N devices
and times the same models with their heads split over them (``si.attention(...,
mesh=...)``) in a table of their own (``--suite`` runs it in a separate process).

Peers (each skipped with a note when missing): ``jax.nn.dot_product_attention``
(``xla``; on a GPU also ``cudnn``), jnp, the exact engine (n <= 256), torch SDPA and
torch FlexAttention (``torch.compile(flex_attention)``: ``create_block_mask`` for the
causal / window masks, ``score_mod`` for the relative-position and geometric biases;
its compile time is excluded from the timing and printed in its own column).

Cases (float32, batch 1, 8 heads, head dim 64): ``dense``, ``causal``, ``window``
(sliding window of 128, causal), ``relpos`` (per-head relative-position bias),
``geometric`` (recency prior q = 0.02, causal); ``fwd`` and ``fwd+bwd``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.ops.indexing import Vindex

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import structinfer as si  # noqa: E402
from structinfer.lowering._lower import lower_edge  # noqa: E402
from structinfer.lowering.blocked import band_blocks, blocked_attention  # noqa: E402

CASES = ("dense", "causal", "window", "relpos", "geometric")
WINDOW = 128
GEO_Q = 0.02


# --------------------------------------------------------------------------- models


def make_model(case: str, H: int, n: int):
    """The mechanism as a NumPyro model: the user-facing way to get the kernel."""

    def prior(n):
        if case == "dense":
            return si.priors.Uniform(n)
        if case == "causal":
            return si.priors.Restricted.causal(n)
        if case == "window":
            return si.priors.Restricted.window(n, WINDOW)
        if case == "relpos":
            return None  # built from the bias argument below
        return si.priors.Geometric(GEO_Q, n)

    def model(q, k, v, bias):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            p = si.priors.RelativePosition(bias, n) if case == "relpos" else prior(n)
            j = si.edge("phi", p, si.scores.Dot(q, k, scale=q.shape[-1] ** -0.5))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    return model


def kernel_fn(case: str, H: int, n: int, block_q: int, block_k: int):
    """The same computation calling the kernel directly (no model)."""
    def f(q, k, v, bias):
        if case == "relpos":
            prior = si.priors.RelativePosition(bias, n)
        elif case == "dense":
            prior = si.priors.Uniform(n)
        elif case == "causal":
            prior = si.priors.Restricted.causal(n)
        elif case == "window":
            prior = si.priors.Restricted.window(n, WINDOW)
        else:
            prior = si.priors.Geometric(GEO_Q, n)
        low = lower_edge(prior, si.scores.Dot(q, k, scale=q.shape[-1] ** -0.5), v, n, (H,))
        bq, bk = band_blocks(low.terms, block_q, block_k)  # as attention() does
        return blocked_attention(low.terms, low.problem, (H,), block_q=bq, block_k=bk,
                                 mask=low.mask)[0]

    return f


def _bias_table(case, bias, n, dtype):
    """(H or 1, n, n) additive bias / mask for the peers (they need the full table)."""
    i = jnp.arange(n)[:, None]
    j = jnp.arange(n)[None, :]
    d = i - j
    if case == "dense":
        return None
    if case == "causal":
        return jnp.where(d >= 0, 0.0, -jnp.inf).astype(dtype)[None]
    if case == "window":
        return jnp.where((d >= 0) & (d < WINDOW), 0.0, -jnp.inf).astype(dtype)[None]
    if case == "relpos":
        return jnp.take(bias, d + n - 1, axis=-1)
    w = math.log(GEO_Q) + d * math.log1p(-GEO_Q)
    return jnp.where(d >= 0, w, -jnp.inf).astype(dtype)[None]


def xla_fn(case: str, H: int, n: int, implementation: str = "xla"):
    def f(q, k, v, bias):
        t = lambda x: jnp.swapaxes(x, 0, 1)[None]  # (H, n, d) -> (1, n, H, d)  # noqa: E731
        kw = {}
        if case == "causal":
            kw["is_causal"] = True
        elif case == "window":
            kw["is_causal"] = True
            kw["local_window_size"] = (WINDOW - 1, 0)
        elif case == "relpos":
            kw["bias"] = _bias_table(case, bias, n, q.dtype)[None]
        elif case == "geometric":
            kw["bias"] = _bias_table(case, bias, n, q.dtype)[None]
        out = jax.nn.dot_product_attention(t(q), t(k), t(v), implementation=implementation,
                                           **kw)
        return jnp.swapaxes(out[0], 0, 1)

    return f


def jnp_fn(case: str, H: int, n: int):
    def f(q, k, v, bias):
        s = jnp.einsum("hid,hjd->hij", q, k) * q.shape[-1] ** -0.5
        b = _bias_table(case, bias, n, q.dtype)
        if b is not None:
            s = s + b
        return jax.nn.softmax(s, -1) @ v

    return f


def exact_fn(case: str, H: int, n: int):
    model = make_model(case, H, n)
    return lambda q, k, v, bias: si.expectation(model, "out", q, k, v, bias)


# --------------------------------------------------------------------------- timing


def _median_time(f, args, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _interleaved_times(calls: dict, reps: int, cheap_seconds: float = 1.5) -> dict:
    """Median time of each ``name: (fn, args)``, the implementations taking turns.

    One warm-up call each, then ``reps`` rounds in which every implementation runs
    once, in a shuffled order, so a slow spell of this shared machine hits all of them
    alike and the ratios stay meaningful. The exact engine (slow by orders of
    magnitude) runs once. Cheap implementations (median under 0.2 s: the windowed
    cases, small n) then keep taking turns among themselves until each has run for
    ``cheap_seconds`` (at most 20 x ``reps`` rounds): a 100 ms call is too noisy on a
    shared machine to compare the model path with the bare kernel at 5% from 5 samples.

    Each timed call comes right after an untimed call of the same implementation. A call
    that follows one of the n x n peers (GiBs of temporaries) was measured up to 100 ms
    slower at n=4096 -- most likely the allocator re-acquiring memory the peer handed
    back to the OS (raising glibc's malloc trim / mmap thresholds removed it in one
    test) -- a penalty that fell on whichever implementation ran next (JAX programs
    more than torch), not on the implementation being measured.
    """
    ts: dict = {name: [] for name in calls}
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    rng = np.random.default_rng(0)

    def round_(names):
        order = list(names)
        rng.shuffle(order)  # no implementation always runs after the cache-thrashing one
        for name in order:
            fn, args = calls[name]
            if name != "exact":
                jax.block_until_ready(fn(*args))  # settle: see the docstring
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts[name].append(time.perf_counter() - t0)

    for r in range(reps):
        round_([name for name in calls if name != "exact" or r == 0])
    cheap = [name for name in calls
             if name != "exact" and statistics.median(ts[name]) < 0.2]
    rounds = reps
    while len(cheap) > 1 and rounds < 20 * reps and min(sum(ts[c]) for c in cheap) < cheap_seconds:
        round_(cheap)
        rounds += 1
    return {name: statistics.median(x) for name, x in ts.items()}


def _with_grad(f):
    def g(q, k, v, bias):
        def loss(q, k, v):
            return jnp.sum(f(q, k, v, bias) * v[..., : q.shape[-2], :1])

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return g


def _temp_mib(jitted, args) -> float | None:
    try:
        ma = jitted.lower(*args).compile().memory_analysis()
        return ma.temp_size_in_bytes / 2**20 if ma is not None else None
    except Exception:  # pragma: no cover - backend without memory analysis
        return None


def _flops(case: str, H: int, n: int, d: int, mode: str) -> float:
    pairs = {"dense": n * n, "relpos": n * n, "causal": n * (n + 1) / 2,
             "geometric": n * (n + 1) / 2,
             "window": sum(min(i + 1, WINDOW) for i in range(n))}[case]
    fwd = 4.0 * H * pairs * d
    return fwd if mode == "fwd" else 3.5 * fwd  # backward = 5 matmuls, forward 2


_MATMUL_RATE: dict[int, float] = {}


def matmul_rate(flops: float, reps: int) -> float:
    """GFLOP/s of a square float32 matmul with the same FLOP count (cached per size)."""
    N = max(64, int(round((flops / 2) ** (1 / 3))))
    N = (N // 16) * 16
    if N not in _MATMUL_RATE:
        a = jnp.asarray(np.random.default_rng(0).normal(size=(N, N)), jnp.float32)
        f = jax.jit(lambda a: a @ a)
        t = _median_time(f, (a,), reps)
        _MATMUL_RATE[N] = 2 * N**3 / t / 1e9
    return _MATMUL_RATE[N]


# --------------------------------------------------------------------------- torch


def _torch_device() -> str:
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def _to_torch(x, device: str):
    import torch

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    t = torch.from_numpy(np.array(jnp.asarray(x, jnp.float32)))  # a writable copy
    return t.to(device=device, dtype=dt[str(jnp.asarray(x).dtype)])


def _synced(fn, device: str):
    if device != "cuda":
        return fn
    import torch

    def g(*a):
        out = fn(*a)
        torch.cuda.synchronize()
        return out

    return g


def torch_fn(case: str, H: int, n: int):
    try:
        import torch
        import torch.nn.functional as F
    except Exception:  # ImportError, or a broken install (missing shared libraries)
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    device = _torch_device()

    def prep(q, k, v, bias):
        tq, tk, tv = (_to_torch(x, device).unsqueeze(0) for x in (q, k, v))
        mask = None
        if case == "window":
            i = torch.arange(n, device=device)[:, None]
            j = torch.arange(n, device=device)[None, :]
            mask = (i - j >= 0) & (i - j < WINDOW)
        elif case in ("relpos", "geometric"):
            mask = _to_torch(_bias_table(case, jnp.asarray(bias), n, q.dtype), device)
        return tq, tk, tv, mask

    def fwd(tq, tk, tv, mask):
        with torch.no_grad():
            return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask,
                                                  is_causal=case in ("causal",))

    def fwdbwd(tq, tk, tv, mask):
        tq, tk, tv = (x.detach().requires_grad_(True) for x in (tq, tk, tv))
        out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask,
                                             is_causal=case in ("causal",))
        (out * tv[..., :1]).sum().backward()
        return tq.grad

    return prep, _synced(fwd, device), _synced(fwdbwd, device)


#: static FlexAttention compiles one table may need (sizes x cases)
FLEX_COMPILES = 256


def flex_recompile_budget(torch) -> None:
    """Let torch.compile keep one static FlexAttention kernel per (size, case) of a table.

    Each row is a compile of its own; past dynamo's recompile limit (8 by default)
    torch.compile runs FlexAttention *eagerly* — unfused, 10-60x slower, with no warning
    in the benchmark's output — and the later rows of a table (the n = 4096 ones after
    n = 256 and 1024) timed that.
    """
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # new name, old name
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), FLEX_COMPILES))


def flex_fn(case: str, H: int, n: int):
    """torch FlexAttention, compiled: ``(prep, fwd, fwdbwd)`` or ``(None, reason)``.

    ``create_block_mask`` gives the causal / window masks (FlexAttention skips the blocks
    they empty), ``score_mod`` adds the relative-position bias or the geometric
    log-prior. The first call of each compiled function compiles it (timed separately).
    """
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as err:  # not installed, or too old for FlexAttention
        return None, f"torch FlexAttention not importable ({type(err).__name__})"
    torch.set_num_threads(os.cpu_count() or 1)
    device = _torch_device()
    flex_recompile_budget(torch)
    compiled = torch.compile(flex_attention, dynamic=False)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    mask_mod = {"causal": causal, "window": window, "geometric": causal}.get(case)
    log_q, log_1mq = math.log(GEO_Q), math.log1p(-GEO_Q)

    def prep(q, k, v, bias):
        tq, tk, tv = (_to_torch(x, device).unsqueeze(0) for x in (q, k, v))
        tb = _to_torch(bias, device)
        block_mask = (None if mask_mod is None else
                      create_block_mask(mask_mod, None, None, n, n, device=device))
        score_mod = None
        if case == "relpos":
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + tb[h, q_idx - kv_idx + n - 1]
        elif case == "geometric":
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + (log_q + (q_idx - kv_idx) * log_1mq)
        return tq, tk, tv, block_mask, score_mod

    def fwd(tq, tk, tv, block_mask, score_mod):
        with torch.no_grad():
            return compiled(tq, tk, tv, score_mod=score_mod, block_mask=block_mask)

    def fwdbwd(tq, tk, tv, block_mask, score_mod):
        tq, tk, tv = (x.detach().requires_grad_(True) for x in (tq, tk, tv))
        out = compiled(tq, tk, tv, score_mod=score_mod, block_mask=block_mask)
        (out * tv[..., :1]).sum().backward()
        return tq.grad

    return (prep, _synced(fwd, device), _synced(fwdbwd, device)), None


def _compile_seconds(fn, args) -> tuple[float | None, str | None]:
    """Time of the first call minus the second (the compile), or the error it raised."""
    try:
        t0 = time.perf_counter()
        fn(*args)
        t1 = time.perf_counter()
        fn(*args)
        t2 = time.perf_counter()
    except Exception as err:  # no C++ compiler, an unsupported mod, ...
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
    return max(0.0, (t1 - t0) - (t2 - t1)), None


def _load() -> str:
    return "load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1/5/15 min)"


# --------------------------------------------------------------------------- main table


def run_table(args) -> list[dict]:
    H, d = args.heads, args.head_dim
    ndev = jax.device_count()
    sharded = ndev > 1
    if sharded and H % ndev:
        raise SystemExit(f"--heads {H} must be divisible by the {ndev} devices")
    print(f"\n{'heads split over ' + str(ndev) + ' ' + jax.devices()[0].platform.upper() + ' devices (mesh=)' if sharded else 'one device'}"
          f" -- {_load()} at the start")
    rows = []
    notes: dict[str, str] = {}
    for n in args.sizes:
        r = np.random.default_rng(n)
        q, k, v = (jnp.asarray(r.normal(size=(H, n, d)), args.dtype) for _ in range(3))
        bias = jnp.asarray(0.1 * r.normal(size=(H, 2 * n - 1)), args.dtype)
        a = (q, k, v, bias)
        for case in args.cases:
            ours = si.attention(make_model(case, H, n), "out", block_q=args.block_q,
                                block_k=args.block_k,
                                mesh=jax.make_mesh((ndev,), ("heads",)) if sharded else None)
            impls = {"structinfer": ours}
            if not sharded:
                impls["kernel"] = kernel_fn(case, H, n, args.block_q, args.block_k)
            impls["jax.nn(xla)"] = xla_fn(case, H, n)
            if jax.default_backend() == "gpu":
                impls["jax.nn(cudnn)"] = xla_fn(case, H, n, "cudnn")
            if not sharded:
                impls["jnp"] = jnp_fn(case, H, n)
                if n <= args.max_exact_n:
                    impls["exact"] = exact_fn(case, H, n)
            tfn = None if args.no_torch else torch_fn(case, H, n)
            if tfn is None and not args.no_torch:
                notes["torch"] = "torch not importable: torch SDPA column skipped"
            ffn = None
            if not (args.no_torch or args.no_flex):
                ffn, why = flex_fn(case, H, n)
                if ffn is None:
                    notes["flex"] = f"{why}: FlexAttention column skipped"
            for mode in args.modes:
                row = {"n": n, "case": case, "mode": mode, "t": {}, "mem": {},
                       "sharded": sharded, "compile": {}}
                calls = {}
                for name, f in impls.items():
                    if n > args.max_peer_n and name in ("jax.nn(xla)", "jnp"):
                        continue
                    jitted = jax.jit(f if mode == "fwd" else _with_grad(f))
                    try:
                        row["mem"][name] = _temp_mib(jitted, a)
                        jax.block_until_ready(jitted(*a))
                    except Exception as err:  # e.g. cuDNN refusing a shape / dtype
                        notes[name] = f"{name} failed ({type(err).__name__}): skipped"
                        continue
                    calls[name] = (jitted, a)
                if tfn is not None:
                    prep, fwd, fwdbwd = tfn
                    calls["torch"] = (fwd if mode == "fwd" else fwdbwd, prep(*a))
                if ffn is not None:
                    prep, fwd, fwdbwd = ffn
                    targs = prep(*a)
                    fn = fwd if mode == "fwd" else fwdbwd
                    sec, err = _compile_seconds(fn, targs)
                    if err:  # e.g. torch 2.13 has no FlexAttention backward on CPU
                        notes[f"flex {mode}"] = f"FlexAttention {mode} failed ({err}): skipped"
                    else:
                        row["compile"]["flex"] = sec
                        calls["flex"] = (fn, targs)
                row["t"] = _interleaved_times(calls, args.reps)
                flops = _flops(case, H, n, d, mode)
                row["gflops"] = flops / row["t"]["structinfer"] / 1e9
                row["matmul"] = matmul_rate(flops, args.reps)
                rows.append(row)
                print_row(row)
    print(f"{_load()} at the end")
    for note in notes.values():
        print(f"note: {note}")
    return rows


_HEADER_DONE = False


def print_row(row: dict) -> None:
    global _HEADER_DONE
    if not _HEADER_DONE:
        print(
            f"{'n':>5} {'case':>9} {'mode':>7} | {'structinfer':>11} | "
            "time ratio peer/structinfer (>1: we are faster)"
            " | GFLOP/s (x matmul) | temp MiB (structinfer / jax.nn / jnp) | flex compile s"
        )
        _HEADER_DONE = True
    t = dict(row["t"])
    ours = t.pop("structinfer")
    ratios = " ".join(f"{k}={v / ours:.2f}" for k, v in t.items())
    mem = row["mem"]
    fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    comp = row["compile"].get("flex")
    print(
        f"{row['n']:>5} {row['case']:>9} {row['mode']:>7} | {ours * 1e3:9.1f}ms | {ratios} | "
        f"{row['gflops']:.1f} ({row['gflops'] / row['matmul']:.2f}) | "
        f"{fmt(mem.get('structinfer'))} / {fmt(mem.get('jax.nn(xla)'))} / {fmt(mem.get('jnp'))}"
        f" | {'-' if comp is None else f'{comp:.1f}'}",
        flush=True,
    )


# --------------------------------------------------------------------------- expanding


def run_expanding(args) -> None:
    """Sec. 5.2 / Figure 3 right: operations and time of expanding attention relative to
    dense attention as the recency bias (1/p) and the feature dimension d vary.

    Task: B sequences of n tokens; the query is the last token; the token it needs
    sits a Geometric(p) number of steps back (the "geometric shuffle"). Expanding
    attention runs the paper's plug-in mean-field loop (Algorithm 3) on cached band
    scores; its window at convergence m and iteration count k give the paper's
    operation count n(md + k) against dense n^2 d (per query: m d + k m vs n d).
    Time: the windowed kernel with the converged window as its static width (JAX
    needs static shapes; finding that width is the untimed first run) plus the k
    iterations on the cached band, against dense softmax(qK^T)V over all n tokens.
    """
    from structinfer.lowering import (
        geometric_band_log_prior,
        windowed_posterior,
        windowed_scores,
        windowed_values,
    )

    n, B = args.expanding_n, args.expanding_batch
    ps = (0.1,) if args.quick else (0.5, 0.2, 0.1, 0.04)
    dims = (10,) if args.quick else (10, 50, 256)
    print(f"\nexpanding attention: n={n} tokens, batch {B}, alpha0=0.1, beta0=0.9, "
          f"95% horizon (times: median of reps) -- {_load()} at the start")
    print(f"{'1/p':>5} {'d':>4} | {'window m':>8} {'iters k':>7} | {'ops ratio':>9} | "
          f"{'time ratio':>10} (expanding / dense)")
    for p in ps:
        for d in dims:
            r = np.random.default_rng(int(100 * p) + d)
            K = r.normal(size=(B, n, d)) / math.sqrt(d)
            qv = r.normal(size=(B, 1, d))
            back = np.minimum(r.geometric(p, size=B) - 1, n - 1)  # steps back from the query
            K[np.arange(B), n - 1 - back] = 3.0 * qv[:, 0] / np.linalg.norm(qv[:, 0], axis=-1,
                                                                          keepdims=True)
            V = r.normal(size=(B, n, 4))
            K, qv, V = (jnp.asarray(x, jnp.float32) for x in (K, qv, V))
            off = n - 1

            def loop(qv, K, W, iters=50):
                s = windowed_scores(qv, K, W, offset=off)  # (B, 1, W) cached

                def body(carry, _):
                    a, b, _, _ = carry
                    qt = a / (a + b)
                    H = jnp.maximum(jnp.ceil(jnp.log(0.05) / jnp.log1p(-qt)), 1.0)
                    pr = windowed_posterior(s, geometric_band_log_prior(qt, W, H))
                    ek = jnp.sum(pr * jnp.arange(W), -1)
                    return (a + 1.0, b + ek, H, pr), H

                init = (jnp.full((B, 1), 0.1), jnp.full((B, 1), 0.9), jnp.zeros((B, 1)),
                        jnp.zeros((B, 1, W)))
                (a, b, H, pr), hs = jax.lax.scan(body, init, None, length=iters)
                return pr, hs

            # first (untimed) run on the full context: converged window and iterations
            _, hs = jax.jit(lambda a, b: loop(a, b, n))(qv, K)
            hs = np.asarray(hs)[..., 0]  # (iters, B)
            final = hs[-1]
            changed = np.abs(np.diff(hs, axis=0)) > 0
            k_iter = np.array([np.max(np.nonzero(c)[0]) + 2 if c.any() else 1
                               for c in changed.T])
            m_win = np.minimum(final, n)
            ops = np.mean((m_win * d + k_iter * m_win) / (n * d))
            W = int(min(n, max(8, int(np.ceil(m_win.max() / 8) * 8))))
            iters = int(k_iter.max())

            def expanding(qv, K, V, W=W, iters=iters):
                pr, _ = loop(qv, K, W, iters)
                return windowed_values(pr, V, offset=off)

            def dense(qv, K, V):
                s = jnp.einsum("bid,bjd->bij", qv, K)
                return jax.nn.softmax(s, -1) @ V

            te = _median_time(jax.jit(lambda a, b, c: expanding(a, b, c)), (qv, K, V), args.reps)
            td = _median_time(jax.jit(dense), (qv, K, V), args.reps)
            print(f"{1 / p:5.0f} {d:4d} | {np.mean(m_win):8.1f} {np.mean(k_iter):7.1f} | "
                  f"{ops:9.3f} | {te / td:10.2f}", flush=True)
    print(f"{_load()} at the end")


def run_exact_engine(args) -> None:
    """The exact (funsor) engine on one causal head, against a plain masked softmax.

    ``si.expectation`` of the causal model under ``jit`` (O(n m) memory since the
    edge log-prob is a column gather) next to ``softmax(where(mask, Q K^T)) V`` in
    jnp, timed in turns; XLA's temporary buffers for both. The exact engine is the
    reference every other path is checked against; this row says what it costs.
    """
    print(f"\nexact engine, one causal head (head dim {args.head_dim}) -- {_load()} at the start")
    print(f"{'n':>6} | {'exact (s)':>9} {'plain (s)':>9} {'exact/plain':>11} | "
          f"{'temp MiB exact / plain':>22} | max |diff|")
    for n in args.exact_sizes:
        r = np.random.default_rng(n)
        q, k, v = (jnp.asarray(r.normal(size=(n, args.head_dim)) / args.head_dim**0.25,
                               jnp.float32) for _ in range(3))

        def model(q, k, v):
            with numpyro.plate("queries", q.shape[0]):
                j = si.edge("phi", si.priors.Restricted.causal(q.shape[0]), si.scores.Dot(q, k))
                numpyro.deterministic("out", Vindex(v)[j])

        mask = np.tril(np.ones((n, n), bool))
        exact = jax.jit(lambda q, k, v: si.expectation(model, "out", q, k, v))
        plain = jax.jit(lambda q, k, v: jax.nn.softmax(jnp.where(mask, q @ k.T, -jnp.inf), -1) @ v)
        t = _interleaved_times({"exact": (exact, (q, k, v)), "plain": (plain, (q, k, v))},
                               args.reps)
        diff = float(jnp.max(jnp.abs(exact(q, k, v) - plain(q, k, v))))
        me, mp = _temp_mib(exact, (q, k, v)), _temp_mib(plain, (q, k, v))
        fmt = lambda x: "?" if x is None else f"{x:.0f}"  # noqa: E731
        print(f"{n:>6} | {t['exact']:>9.3f} {t['plain']:>9.3f} {t['exact'] / t['plain']:>11.2f} | "
              f"{fmt(me) + ' / ' + fmt(mp):>22} | {diff:.1e}")
    print(f"{_load()} at the end")


#: the tables of docs/benchmarks.md: (title, arguments), each run in its own process
SUITE = (
    ("single device (JAX as installed), n = 256 / 1024 / 4096, every case",
     ["--cpu-devices", "1", "--sizes", "256", "1024", "4096"]),
    ("single device, n = 8192, forward",
     ["--cpu-devices", "1", "--sizes", "8192", "--modes", "fwd"]),
    ("heads over one JAX CPU device per core, n = 4096 / 8192",
     ["--cpu-devices", "auto", "--sizes", "4096", "8192", "--cases", "dense", "causal",
      "window", "--max-peer-n", "4096"]),
    ("exact engine, one causal head", ["--cpu-devices", "1", "--exact-engine-only"]),
    ("expanding attention (sec. 5.2)", ["--cpu-devices", "1", "--expanding-only"]),
)


def run_suite(argv_extra: list[str]) -> None:
    """Run every table of docs/benchmarks.md, each in a fresh process (so single-device
    rows come from a default JAX process and multi-device rows from their own), printing
    the command, the load average before and after, and the wall time of each."""
    import subprocess

    start = time.perf_counter()
    for title, extra in SUITE:
        extra = [str(os.cpu_count() or 1) if x == "auto" else x for x in extra]
        cmd = [sys.executable, os.path.abspath(__file__), *extra, *argv_extra]
        print(f"\n=== {title}\n$ python benchmarks/attention.py {' '.join(extra + argv_extra)}"
              f"\n{_load()} before", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd)
        print(f"=== {_load()} after; {time.perf_counter() - t0:.0f} s; exit {proc.returncode}",
              flush=True)
    print(f"\nsuite: {(time.perf_counter() - start) / 60:.1f} min")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, seconds (smoke test)")
    ap.add_argument("--suite", action="store_true",
                    help="every table of docs/benchmarks.md, each in its own process")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu-devices", type=int, default=1,
                    help="JAX CPU devices (default 1, JAX as installed); with more than one "
                    "the table times the models with their heads split over them (mesh=)")
    ap.add_argument("--block-q", type=int, default=256)
    ap.add_argument("--block-k", type=int, default=256)
    ap.add_argument("--max-exact-n", type=int, default=256,
                    help="largest n timed with the exact (funsor) engine")
    ap.add_argument("--max-peer-n", type=int, default=8192,
                    help="largest n for the n x n peers (jax.nn, jnp)")
    ap.add_argument("--no-torch", action="store_true", help="skip torch SDPA and FlexAttention")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--exact-engine", action="store_true",
                    help="also time the exact engine on one causal head (--exact-sizes)")
    ap.add_argument("--exact-engine-only", action="store_true")
    ap.add_argument("--exact-sizes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--expanding", action="store_true", help="run the sec 5.2 experiment")
    ap.add_argument("--expanding-only", action="store_true")
    ap.add_argument("--expanding-n", type=int, default=1024)
    ap.add_argument("--expanding-batch", type=int, default=256)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.suite:
        passthrough = [x for x in argv if x in ("--no-torch", "--no-flex")]
        run_suite(passthrough)
        return
    if args.quick:
        args.sizes, args.heads, args.head_dim, args.reps = [64], 2, 16, 1
        args.cases = ["window"]
        args.block_q, args.block_k, args.max_exact_n = 32, 32, 64
        args.expanding_n, args.expanding_batch = 64, 8
        args.cpu_devices = 1
        args.exact_sizes = [64]
    args.dtype = jnp.dtype(args.dtype)
    try:  # must precede the first use of the backend
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    except RuntimeError as err:  # pragma: no cover - backend already initialised
        print(f"note: --cpu-devices ignored ({err})")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} "
          f"device{'s' if jax.device_count() > 1 else ''}), {os.cpu_count()} cores; "
          f"heads={args.heads} head_dim={args.head_dim} {args.dtype} batch 1; "
          f"blocks {args.block_q}x{args.block_k}; {_load()}")
    if not (args.expanding_only or args.exact_engine_only):
        run_table(args)
    if args.exact_engine or args.exact_engine_only or args.quick:
        run_exact_engine(args)
    if args.expanding or args.expanding_only or args.quick:
        run_expanding(args)


if __name__ == "__main__":
    main()
