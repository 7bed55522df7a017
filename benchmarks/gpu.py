"""GPU comparison table: structinfer's lowered attention against the fused kernels a GPU
user would otherwise call, with every structinfer result checked against a float32
reference. One command, a few minutes on one H100 / H200.

    python benchmarks/gpu.py                      # default table (two sizes, 7 cases)
    python benchmarks/gpu.py --out $OUT           # write the files somewhere else
    python benchmarks/gpu.py --quick --out /tmp/x # tiny sizes on a CPU (a test runs this)
    python benchmarks/gpu.py --sizes 8192 --heads 16 --cases causal window --impls \\
        structinfer structinfer-pallas cudnn

Cases (batch 1; default bfloat16, shapes n=4096 x 32 heads and n=16384 x 16 heads, head
dim 128): ``dense``; ``causal``; ``window`` (causal sliding window of 256); ``relpos``
(learned per-head relative-position bias over all 2n-1 distances, no mask:
``si.priors.RelativePosition(bias, n)``); ``geometric`` (recency prior q = 0.02,
causal); ``bias`` (per-head additive bias over parents, written as a
``si.priors.Categorical`` prior with one row of logits shared by every child, which the
lowering turns into a per-parent bias); ``block_sparse`` (``si.priors.Restricted.
block_sparse`` on blocks of 128: each block row sees its own block and its two
neighbours, the first block row and column are global, and one block in 16 of the rest
at random, fixed by ``n``); and, asked for by name, ``relpos_grad``: ``relpos`` with
a float32 table trained, its gradient taken too in ``fwd+bwd`` (structinfer's own pass;
cuDNN / tokamax on the bias table made from it in the program; SDPA on the float mask
made from it in each call; FlexAttention through its ``score_mod``'s captured table)
and checked against the reference's (FlexAttention's backward is not checked). Modes:
``fwd`` and ``fwd+bwd`` (gradient with respect to q, k and v of ``sum(out * w)`` for a
fixed random ``w``).

Implementations, one row each (a missing one is skipped with a note; one that raises is
reported as ``failed: <reason>`` and the run goes on):

* ``structinfer`` -- ``si.attention(model, "out")`` with ``backend="auto"``; the kernel
  ``si.explain`` says it chose (and why not cuDNN) is printed beside it;
* ``structinfer-pallas`` -- the same model with ``backend="pallas"`` forced (skipped
  where auto already chose Pallas; interpreted off a GPU);
* ``structinfer-mosaic`` -- the same model with ``backend="mosaic"`` forced: the Mosaic
  GPU (Hopper) forward and backward (skipped, with the kernel's reason, where
  it cannot run, e.g. off a Hopper GPU);
* ``structinfer-cudnn`` -- the same model with ``backend="cudnn"`` forced (skipped where
  auto already chose cuDNN, or with cuDNN's reason where it cannot run the edge);
* ``cudnn`` -- ``jax.nn.dot_product_attention(implementation="cudnn")``: ``is_causal`` /
  ``local_window_size`` for the masks, the bias table materialised for relpos (per head),
  geometric (one table, with ``is_causal``), bias (per head) and block_sparse (one table
  of 0 and -1e4);
* ``pallas-mha`` -- JAX's Pallas reference ``jax.experimental.pallas.ops.gpu.attention.mha``
  (dense and causal only);
* ``torch-sdpa`` -- ``torch.nn.functional.scaled_dot_product_attention`` (``is_causal``,
  a boolean window or block-sparse mask, a float bias built on the device);
* ``torch-flex`` -- ``torch.compile(flex_attention)`` through ``benchmarks/attention.py``'s
  ``flex_fn`` (block masks, ``score_mod`` biases; a per-parent ``score_mod`` for bias;
  for block_sparse a ``create_block_mask`` of the same pattern);
  its backward differentiates ``sum(out * v[..., :1])``, the same cost;
* ``tokamax-triton`` / ``tokamax-mosaic`` -- ``tokamax.dot_product_attention(...,
  implementation=...)`` when tokamax is importable;
* run only when named: ``cudnn-residual`` -- the ``cudnn`` call with
  ``return_residual=True`` (cuDNN's training-mode forward, which also writes the row
  log-normalisers), and ``cudnn-as-ours`` -- that call with the heads as cuDNN's batch,
  (heads, n, 1, d): the call structinfer's cuDNN kernel makes, to split its overhead
  over ``cudnn``.

Timing: each implementation is called once (compile, tracing and first run), once more
(warm; the compile seconds printed are the first call minus this one), then timed as the
best of ``--groups`` (3) groups of ``--calls`` (10) back-to-back calls, synchronised at
the end of each group (``jax.block_until_ready`` / ``torch.cuda.synchronize``); a call
slower than ``--row-seconds / (groups x calls)`` gets fewer calls per group (the table
says so). JAX peers take their inputs already in their (batch, seq, heads, dim) layout,
so no transposes are timed. Rate: dense-equivalent TFLOP/s on *useful* pairs only (allowed
edges: n^2 for dense / relpos / bias, n(n+1)/2 for causal / geometric, sum_i min(i+1, W)
for the window, the pattern's blocks times the block size squared for block_sparse):
forward 4 * heads * pairs * head_dim (two matmuls), forward+backward
3.5x that (the backward counted as 2.5x the forward, as FlashAttention's benchmarks
count it).

Correctness: every structinfer row -- and every peer whose result is comparable (all but
FlexAttention's fwd+bwd) -- is checked against the dense softmax formula in float32 under
``jax.default_matmul_precision("highest")`` on the same (rounded) inputs, on a subset of
heads (``--check-heads``) and, when ``heads x n^2`` is large, of query rows
(``--check-rows``): the output for ``fwd``; dq, and dk / dv (and ``relpos_grad``'s
table gradient) when all rows are checked, for ``fwd+bwd``. The error is the max
absolute difference over the largest reference magnitude; a row passes under ``--tol``
(default 2e-2 for bfloat16, 1e-2 for float16 and float32 -- float32 products run in
TF32 on a GPU by default). A failed check is reported in the table; it does not stop
the run.

Budget: no row is started once the run is past ``--budget-seconds`` (270 by default);
the rows left are listed as ``skipped (budget)`` and the output says so. Each row costs
its compile (2-19 s; 10-19 s for a fused forward + backward) more than its timing, so a
budget is reached sooner than the timings suggest. With ``--order case`` (the default)
every implementation runs a case (a size, a case, a mode) before the next case starts,
so a cut loses the rest of the case it falls in and every later case, and the cases
before it have all their rows; within a case they run
in tiers -- structinfer and cuDNN first, then forced Pallas / Mosaic GPU, torch SDPA and
FlexAttention (the peers the structured priors are measured against), then JAX's Pallas
reference and tokamax. ``--order impl`` runs the tiers one after the other over every
case instead (structinfer's rows first, the peers' only if the budget allows). A second
command (say, ``--impls pallas-mha tokamax-triton tokamax-mosaic``) times what a cut
left out (its files get the time of day in their name).

Output: a Markdown table (printed, and written to ``<out>/<device-slug>_<date>.md``) and a
``.json`` beside it with every number, the device (``jax.devices()[0].device_kind``), the
versions (jax, jaxlib, numpyro, torch, triton, tokamax) and the command line. ``--out``
defaults to ``docs/results/gpu/``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time

# share the GPU with torch: JAX would otherwise take 75% of its memory at start-up
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_START = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import attention as bench  # noqa: E402  (puts the repository root on sys.path too)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
from numpyro.ops.indexing import Vindex  # noqa: E402

import structinfer as si  # noqa: E402

CASES = ("dense", "causal", "window", "relpos", "geometric", "bias", "block_sparse")
#: cases run only when named: ``relpos_grad`` is ``relpos`` with the table's gradient
EXTRA_CASES = ("relpos_grad",)
MODES = ("fwd", "fwd+bwd")
#: implementations in the order they are tried (tier, label)
IMPLS = {
    "structinfer": (0, "structinfer (auto)"),
    "cudnn": (0, "jax.nn cuDNN"),
    "structinfer-pallas": (1, "structinfer (pallas)"),
    "structinfer-mosaic": (1, "structinfer (mosaic)"),
    "structinfer-cudnn": (1, "structinfer (cudnn)"),
    "torch-sdpa": (1, "torch SDPA"),
    "torch-flex": (1, "torch Flex"),
    "pallas-mha": (2, "JAX Pallas mha"),
    "tokamax-triton": (2, "tokamax triton"),
    "tokamax-mosaic": (2, "tokamax mosaic"),
    "cudnn-residual": (3, "jax.nn cuDNN + L"),
    "cudnn-as-ours": (3, "jax.nn cuDNN + L, heads as batch"),
}
#: implementations run only when named: the bare cuDNN call made as structinfer's cuDNN
#: kernel makes it, to split the model path's overhead over ``cudnn`` (the forward with
#: the row log-normalisers, then also the heads as cuDNN's batch)
EXTRA_IMPLS = ("cudnn-residual", "cudnn-as-ours")
GEO_Q = bench.GEO_Q


class Skip(Exception):
    """An implementation that does not apply here (not installed, not this case)."""


def base_case(case: str) -> str:
    """The case whose model and prior ``case`` uses (``relpos_grad``: relpos)."""
    return "relpos" if case == "relpos_grad" else case


def _short(err: BaseException, width: int = 160) -> str:
    msg = str(err).strip().splitlines()
    first = next((line.strip() for line in msg if line.strip()), "")
    return f"{type(err).__name__}: {first}"[:width]


def _elapsed() -> float:
    return time.perf_counter() - _START


# --------------------------------------------------------------------------- problems


def sparse_blocks(n: int) -> tuple[np.ndarray, int]:
    """The block_sparse case's ``(block pattern, block size)``: blocks of 128 (of n / 4
    when n is under 512; halved until they divide n), each block row seeing its own block
    and its two neighbours, the first block row and column global, one block in 16 of the
    rest at random (seeded by n). Every child has a parent (its own block)."""
    b = max(1, min(128, n // 4))
    while n % b:
        b //= 2
    nb = n // b
    a = np.arange(nb)
    blocks = np.abs(a[:, None] - a[None, :]) <= 1
    blocks[0, :] = blocks[:, 0] = True
    blocks |= np.random.default_rng(n).random((nb, nb)) < 1 / 16
    return blocks, b


def sparse_mask(n: int) -> np.ndarray:
    """The block_sparse case's ``(n, n)`` boolean mask."""
    blocks, b = sparse_blocks(n)
    return np.kron(blocks, np.ones((b, b), bool))


def make_model(case: str, H: int, n: int):
    """The mechanism as a NumPyro model; ``bias`` and ``block_sparse`` here are this
    script's own cases (the rest come from benchmarks/attention.py)."""
    case = base_case(case)
    if case == "block_sparse":
        prior = si.priors.Restricted.block_sparse(*sparse_blocks(n))

        def model(q, k, v, extra):  # extra: unused (the prior has no parameter)
            with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
                j = si.edge("phi", prior, si.scores.Dot(q, k, scale=q.shape[-1] ** -0.5))
                numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

        return model
    if case != "bias":
        return bench.make_model(case, H, n)

    def model(q, k, v, bias):  # bias: (H, 1, n) logits, one row shared by every child
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", si.priors.Categorical(bias),
                        si.scores.Dot(q, k, scale=q.shape[-1] ** -0.5))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    return model


def pairs(case: str, n: int, window: int) -> float:
    """Allowed (child, parent) pairs: the useful work of one head."""
    if case in ("dense", "relpos", "relpos_grad", "bias"):
        return float(n * n)
    if case == "block_sparse":
        blocks, b = sparse_blocks(n)
        return float(blocks.sum() * b * b)
    if case in ("causal", "geometric"):
        return n * (n + 1) / 2
    w = min(window, n)
    return w * (w + 1) / 2 + (n - w) * w  # sum_i min(i + 1, w)


def flops(case: str, H: int, n: int, d: int, mode: str, window: int) -> float:
    fwd = 4.0 * H * pairs(case, n, window) * d
    return fwd if mode == "fwd" else 3.5 * fwd


class Problem:
    """Inputs of one size in every layout the implementations take (made once)."""

    def __init__(self, n: int, H: int, d: int, dtype, seed: int = 0):
        self.n, self.H, self.d, self.dtype = n, H, d, dtype
        key = jax.random.split(jax.random.key(seed + n), 6)
        self.q, self.k, self.v = (jax.random.normal(key[i], (H, n, d), jnp.float32).astype(dtype)
                                  for i in range(3))
        self.w = jax.random.normal(key[3], (H, n, d), jnp.float32)
        # relpos_grad trains a float32 table (its gradient summed in float32 by everyone)
        self.relpos32 = 0.1 * jax.random.normal(key[4], (H, 2 * n - 1), jnp.float32)
        self.relpos = self.relpos32.astype(dtype)
        self.colbias = jax.random.normal(key[5], (H, 1, n), jnp.float32).astype(dtype)
        t = lambda x: jnp.swapaxes(x, 0, 1)[None]  # (H, n, d) -> (1, n, H, d)  # noqa: E731
        self.bthd = tuple(t(x) for x in (self.q, self.k, self.v, self.w))

    def extra(self, case: str):
        return {"bias": self.colbias, "relpos_grad": self.relpos32}.get(case, self.relpos)

    def args(self, case: str):
        return self.q, self.k, self.v, self.extra(case)


# --------------------------------------------------------------------------- reference


def check_subset(n: int, H: int, heads: int, rows: int, max_entries: int):
    """(head indices, row indices or None for all rows) the reference is computed on."""
    hs = np.unique(np.linspace(0, H - 1, min(heads, H)).round().astype(int))
    if len(hs) * n * n <= max_entries:
        return hs, None
    rs = np.unique(np.linspace(0, n - 1, min(rows, n)).round().astype(int))
    return hs, rs


def reference(case: str, p: Problem, hs, rs, window: int, need_grad: bool) -> dict:
    """Dense softmax formula in float32 at 'highest' matmul precision on the subset."""
    n, d = p.n, p.d
    rows = np.arange(n) if rs is None else rs
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    q = f32(p.q[hs][:, rows])
    k, v = f32(p.k[hs]), f32(p.v[hs])
    w = p.w[hs][:, rows]
    extra = f32(p.extra(case)[hs])
    ri = jnp.asarray(rows)[:, None]
    table_grad = case == "relpos_grad"
    case = base_case(case)

    def attn(q, k, v, extra):
        s = jnp.einsum("hid,hjd->hij", q, k) * d**-0.5
        dd = ri - jnp.arange(n)[None, :]
        if case in ("causal", "geometric"):
            s = jnp.where(dd >= 0, s, -jnp.inf)
        if case == "window":
            s = jnp.where((dd >= 0) & (dd < window), s, -jnp.inf)
        if case == "relpos":
            s = s + jnp.take(extra, dd + n - 1, axis=-1)
        if case == "geometric":
            s = s + (math.log(GEO_Q) + dd * math.log1p(-GEO_Q))
        if case == "bias":
            s = s + extra
        if case == "block_sparse":
            s = jnp.where(jnp.asarray(sparse_mask(n))[rows], s, -jnp.inf)
        return jax.nn.softmax(s, axis=-1) @ v

    with jax.default_matmul_precision("highest"):
        def run(q, k, v, extra, w):
            out, vjp = jax.vjp(attn, q, k, v, extra)
            return (out, *vjp(w)) if need_grad else (out,)

        res = jax.jit(run)(q, k, v, extra, w)
    names = ("out", "dq", "dk", "dv") + (("dtable",) if table_grad else ())
    ref = dict(zip(names, res))
    if rs is not None:  # dk, dv and the table's gradient need every row's contribution
        for name in ("dk", "dv", "dtable"):
            ref.pop(name, None)
    return ref


def compare(got: dict, ref: dict, hs, rs, tol: float) -> dict:
    """Max |got - ref| / max |ref| per quantity on the checked subset (H, n, d layout)."""
    out = {"tol": tol, "heads": [int(h) for h in hs],
           "rows": "all" if rs is None else len(rs)}
    worst = 0.0
    for name, r in ref.items():
        if name not in got:
            continue
        g = jnp.asarray(got[name])[hs]
        if name in ("out", "dq") and rs is not None:
            g = g[:, rs]
        g = g.astype(jnp.float32)
        err = float(jnp.max(jnp.abs(g - r)))
        scale = float(jnp.max(jnp.abs(r)))
        rel = err / scale if scale > 0 else err
        if not math.isfinite(rel):
            rel = math.inf
        out[name] = {"max_abs_err": err, "ref_scale": scale, "rel": rel}
        worst = max(worst, rel)
    out["worst_rel"] = worst
    out["passed"] = worst <= tol
    return out


# --------------------------------------------------------------------------- builders
#
# Each builder returns (call, sync, to_check, info): call() runs the implementation once;
# sync(result) waits for it; to_check(result) gives {"out" | "dq" | "dk" | "dv": (H, n, d)}
# for the correctness check (or None: not checked); info: extra fields for the row.


def _jax_sync(x):
    return jax.block_until_ready(x)


def _loss_grad(f, w, extra: bool = False):
    """(q, k, v, x) -> grads of sum(f(q, k, v, x) * w) w.r.t. q, k, v (and x, the prior's
    parameter, with ``extra``)."""
    def g(q, k, v, x):
        def loss(q, k, v, x):
            return jnp.sum(f(q, k, v, x).astype(jnp.float32) * w)

        return jax.grad(loss, argnums=(0, 1, 2, 3) if extra else (0, 1, 2))(q, k, v, x)

    return g


def _ours_check(mode):
    if mode == "fwd":
        return lambda y: {"out": y}
    return lambda g: dict(zip(("dq", "dk", "dv", "dtable"), g))


def build_structinfer(ctx, backend: str):
    case, p, mode = ctx["case"], ctx["p"], ctx["mode"]
    model = make_model(case, p.H, p.n)
    args = p.args(case)
    info = {}
    try:
        ex = si.explain(model, "out", *args, backend=backend)
    except si.lowering.NotLowerableError as err:
        if backend == "auto":
            raise
        raise Skip(str(err)) from err
    if ex.path != "lowered":
        raise RuntimeError(f"not lowered: {ex}")
    kernel = ex.kernels["phi"]
    why = [s for s in ex.notes.get("phi", ()) if s.startswith("not ")]
    info["kernel"] = kernel
    if why:
        info["kernel_notes"] = why
    if backend == "auto":
        ctx["auto_kernel"][(p.n, case)] = kernel
    elif ctx["auto_kernel"].get((p.n, case)) == backend:
        raise Skip(f"auto already runs the {backend} kernel")
    f = si.attention(model, "out", backend=backend)
    fn = jax.jit(f) if mode == "fwd" else jax.jit(_loss_grad(f, p.w, case == "relpos_grad"))
    return (lambda: fn(*args)), _jax_sync, _ours_check(mode), info


def _peer_kwargs(case: str, p: Problem, window: int, dtype) -> tuple[dict, jax.Array | None]:
    """(static keyword arguments, bias table or None) of jax.nn / tokamax attention
    (``relpos_grad``'s forward: relpos' on its float32 table)."""
    n = p.n
    dd = None if case in ("dense", "causal", "window", "bias", "block_sparse") else (
        jnp.arange(n)[:, None] - jnp.arange(n)[None, :])  # (n, n): only where a bias needs it
    if case == "dense":
        return {}, None
    if case == "causal":
        return {"is_causal": True}, None
    if case == "window":
        return {"is_causal": True, "local_window_size": (window - 1, 0)}, None
    if case in ("relpos", "relpos_grad"):  # (1, H, n, n): one table per head
        return {}, jnp.take(p.extra(case), dd + n - 1, axis=-1).astype(dtype)[None]
    if case == "geometric":  # (1, 1, n, n), finite (the causal flag masks)
        w = math.log(GEO_Q) + jnp.maximum(dd, 0) * math.log1p(-GEO_Q)
        return {"is_causal": True}, w.astype(dtype)[None, None]
    if case == "block_sparse":  # (1, 1, n, n): 0 on allowed edges, -1e4 elsewhere
        return {}, jnp.where(jnp.asarray(sparse_mask(n)), 0.0, -1e4).astype(dtype)[None, None]
    # bias: the per-parent row broadcast to a (1, H, n, n) table
    return {}, jnp.broadcast_to(p.colbias, (p.H, n, n)).astype(dtype)[None]


def _bthd_check(mode, heads_as_batch: bool = False):
    if heads_as_batch:
        back = lambda x: x[:, :, 0]  # (H, n, 1, d) -> (H, n, d)  # noqa: E731
    else:
        back = lambda x: jnp.swapaxes(x[0], 0, 1)  # (1, n, H, d) -> (H, n, d)  # noqa: E731
    if mode == "fwd":
        return lambda y: {"out": back(y)}
    # the relative-position table's gradient, (H, 2n - 1), as it is
    return lambda g: {name: back(x) if name != "dtable" else x
                      for name, x in zip(("dq", "dk", "dv", "dtable"), g)}


def _build_bthd(ctx, attend, heads_as_batch: bool = False):
    """A peer taking (1, n, H, d) inputs: ``attend(q, k, v, bias=, **static) -> out``;
    with ``heads_as_batch``, (H, n, 1, d) inputs and a (H, 1, n, n) bias table instead
    (the layout structinfer's cuDNN kernel passes: the model's (H, n, d) arrays as they
    are), made before the timed calls."""
    case, p, mode = ctx["case"], ctx["p"], ctx["mode"]
    q, k, v, w = p.bthd
    if heads_as_batch:
        q, k, v, w = (x[:, :, None] for x in (p.q, p.k, p.v, p.w))
    if case == "relpos_grad" and mode != "fwd":  # the table made in the program, trained
        n = p.n

        def f(q, k, v, rel):
            dd = jax.lax.iota(jnp.int32, n)[:, None] - jax.lax.iota(jnp.int32, n)[None, :]
            table = jnp.take(rel, dd + n - 1, axis=-1).astype(p.dtype)
            return attend(q, k, v, bias=table[:, None] if heads_as_batch else table[None])

        bias = p.extra(case)
    else:
        static, bias = _peer_kwargs(case, p, ctx["window"], p.dtype)
        if bias is not None:  # the table is an input, made before the timed calls
            bias = jax.block_until_ready(jnp.swapaxes(bias, 0, 1) if heads_as_batch else bias)

        def f(q, k, v, bias):
            return attend(q, k, v, bias=bias, **static)

    fn = jax.jit(f) if mode == "fwd" else jax.jit(_loss_grad(f, w, case == "relpos_grad"))
    return (lambda: fn(q, k, v, bias)), _jax_sync, _bthd_check(mode, heads_as_batch), {}


def build_cudnn(ctx, residual: bool = False, heads_as_batch: bool = False):
    """jax.nn's cuDNN call; ``residual`` asks for the row log-normalisers too (cuDNN's
    training-mode forward, which structinfer's kernel runs), ``heads_as_batch`` passes
    the heads as cuDNN's batch (structinfer's layout)."""
    if jax.default_backend() != "gpu":
        raise Skip("cuDNN needs a GPU")
    scale = ctx["p"].d ** -0.5

    def attend(q, k, v, **kw):
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn",
                                           return_residual=residual, **kw)
        return out[0] if residual else out

    return _build_bthd(ctx, attend, heads_as_batch)


def build_tokamax(ctx, implementation: str):
    try:
        tokamax = importlib.import_module("tokamax")
    except Exception as err:
        raise Skip(f"tokamax not importable ({type(err).__name__})") from None
    scale = ctx["p"].d ** -0.5
    return _build_bthd(ctx, lambda q, k, v, **kw: tokamax.dot_product_attention(
        q, k, v, scale=scale, implementation=implementation, **kw))


def build_pallas_mha(ctx):
    case = ctx["case"]
    if case not in ("dense", "causal"):
        raise Skip("dense / causal only")
    try:
        from jax.experimental.pallas.ops.gpu import attention as ref_attention
    except Exception as err:
        raise RuntimeError(f"not importable: {_short(err)}") from None
    interpret = jax.default_backend() != "gpu"
    scale = ctx["p"].d ** -0.5
    return _build_bthd(ctx, lambda q, k, v, bias, is_causal=False: ref_attention.mha(
        q, k, v, None, sm_scale=scale, causal=is_causal, interpret=interpret))


def _torch():
    try:
        import torch
    except Exception as err:  # not installed, or a broken install
        raise Skip(f"torch not importable ({type(err).__name__})") from None
    return torch


def _torch_sync(torch, device):
    if device == "cuda":
        return lambda _: torch.cuda.synchronize()
    return lambda _: None


def build_torch_sdpa(ctx):
    torch = _torch()
    import torch.nn.functional as F

    case, p, mode, window = ctx["case"], ctx["p"], ctx["mode"], ctx["window"]
    device = bench._torch_device()
    n = p.n
    tq, tk, tv, tb = (bench._to_torch(x, device).unsqueeze(0)
                      for x in (p.q, p.k, p.v, p.extra(case)))
    tw = bench._to_torch(p.w, device).unsqueeze(0)
    dd = None  # (n, n) distances, made only for the cases that need them
    if case in ("window", "relpos", "relpos_grad", "geometric"):
        dd = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)[None, :]
    mask, causal = None, case == "causal"
    # relpos_grad's forward + backward makes the mask from the (trained) table in each call
    table_grad = case == "relpos_grad" and mode != "fwd"
    if case == "window":
        mask = (dd >= 0) & (dd < window)
    elif case in ("relpos", "relpos_grad") and not table_grad:
        # (1, H, n, n), built on the device
        mask = tb[0][:, dd + n - 1].unsqueeze(0).to(tq.dtype)
    elif case == "geometric":
        g = math.log(GEO_Q) + dd.to(torch.float32) * math.log1p(-GEO_Q)
        mask = torch.where(dd >= 0, g, -math.inf).to(tq.dtype)[None, None]
    elif case == "bias":
        mask = tb.expand(1, p.H, n, n)  # (1, H, 1, n) broadcast over the rows
    elif case == "block_sparse":
        mask = torch.from_numpy(sparse_mask(n)).to(device)
    scale = p.d ** -0.5

    def attend(q, k, v, table=None):
        m = mask if table is None else table[:, dd + n - 1].unsqueeze(0).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal,
                                              scale=scale)

    if mode == "fwd":
        def call():
            with torch.no_grad():
                return attend(tq, tk, tv)
    else:
        leaves = tuple(x.detach().requires_grad_(True) for x in (tq, tk, tv))
        if table_grad:  # (H, 2n - 1), its gradient taken too
            leaves += (tb[0].detach().requires_grad_(True),)

        def call():
            out = attend(*leaves)
            return torch.autograd.grad((out.float() * tw).sum(), leaves)

    def to_check(res):
        if mode == "fwd":
            return {"out": _from_torch(res[0])}
        got = {name: _from_torch(x[0]) for name, x in zip(("dq", "dk", "dv"), res)}
        if table_grad:
            got["dtable"] = _from_torch(res[3])
        return got

    return call, _torch_sync(torch, device), to_check, {}


def _from_torch(t):
    return jnp.asarray(t.detach().float().cpu().numpy())


def build_flex(ctx):
    torch = _torch()
    case, p, mode = ctx["case"], ctx["p"], ctx["mode"]
    if case == "bias":
        res, why = _flex_bias_fn(torch, p)
    elif case == "block_sparse":
        res, why = _flex_block_sparse_fn(torch, p)
    elif case == "relpos_grad":
        res, why = _flex_relpos_grad_fn(torch, p)
    else:
        res, why = bench.flex_fn(case, p.H, p.n)
    if res is None:
        raise Skip(why)
    prep, fwd, fwdbwd = res
    targs = prep(p.q, p.k, p.v, p.extra(case) if case != "bias" else p.colbias[:, 0])
    fn = fwd if mode == "fwd" else fwdbwd
    device = bench._torch_device()
    to_check = (lambda y: {"out": _from_torch(y[0])}) if mode == "fwd" else None
    return (lambda: fn(*targs)), _torch_sync(torch, device), to_check, {}


def _flex_own_fn(torch, mods):
    """flex_fn's shape for this script's own cases: ``mods(extra, device)`` gives the
    keyword arguments of ``flex_attention`` (a ``score_mod``, a ``block_mask``)."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except Exception as err:
        return None, f"torch FlexAttention not importable ({type(err).__name__})"
    device = bench._torch_device()
    bench.flex_recompile_budget(torch)
    compiled = torch.compile(flex_attention, dynamic=False)

    def prep(q, k, v, extra):
        tq, tk, tv = (bench._to_torch(x, device).unsqueeze(0) for x in (q, k, v))
        return tq, tk, tv, mods(extra, device)

    def fwd(tq, tk, tv, kw):
        with torch.no_grad():
            return compiled(tq, tk, tv, **kw)

    def fwdbwd(tq, tk, tv, kw):
        tq, tk, tv = (x.detach().requires_grad_(True) for x in (tq, tk, tv))
        out = compiled(tq, tk, tv, **kw)
        (out * tv[..., :1]).sum().backward()
        return tq.grad

    return (prep, fwd, fwdbwd), None


def _flex_bias_fn(torch, p: Problem):
    """The per-parent bias: ``score_mod`` adds ``b[h, kv_idx]``."""
    def mods(b, device):
        tb = bench._to_torch(b, device)  # (H, n)

        def score_mod(score, b_, h, q_idx, kv_idx):
            return score + tb[h, kv_idx]

        return {"score_mod": score_mod}

    return _flex_own_fn(torch, mods)


def _flex_relpos_grad_fn(torch, p: Problem):
    """relpos_grad: ``score_mod`` adds ``t[h, i - j + n - 1]`` from a captured float32
    table that requires a gradient (each backward adds the table's into its ``.grad``,
    across the timed calls: a sum of (H, 2n - 1) entries per call)."""
    n = p.n

    def mods(t, device):
        tb = bench._to_torch(t, device).requires_grad_(True)  # (H, 2n - 1)

        def score_mod(score, b_, h, q_idx, kv_idx):
            return score + tb[h, q_idx - kv_idx + n - 1]

        return {"score_mod": score_mod}

    return _flex_own_fn(torch, mods)


def _flex_block_sparse_fn(torch, p: Problem):
    """block_sparse: a ``create_block_mask`` of the pattern (on blocks of 128, FlexAttention's
    own, every live block is a full one)."""
    blocks, b = sparse_blocks(p.n)

    def mods(_, device):
        from torch.nn.attention.flex_attention import create_block_mask

        tb = torch.from_numpy(blocks).to(device)

        def mask_mod(b_, h, q_idx, kv_idx):
            return tb[q_idx // b, kv_idx // b]

        return {"block_mask": create_block_mask(mask_mod, None, None, p.n, p.n,
                                                device=device)}

    return _flex_own_fn(torch, mods)


BUILDERS = {
    "structinfer": lambda ctx: build_structinfer(ctx, "auto"),
    "structinfer-pallas": lambda ctx: build_structinfer(ctx, "pallas"),
    "structinfer-mosaic": lambda ctx: build_structinfer(ctx, "mosaic"),
    "structinfer-cudnn": lambda ctx: build_structinfer(ctx, "cudnn"),
    "cudnn": build_cudnn,
    "cudnn-residual": lambda ctx: build_cudnn(ctx, residual=True),
    "cudnn-as-ours": lambda ctx: build_cudnn(ctx, residual=True, heads_as_batch=True),
    "pallas-mha": build_pallas_mha,
    "torch-sdpa": build_torch_sdpa,
    "torch-flex": build_flex,
    "tokamax-triton": lambda ctx: build_tokamax(ctx, "triton"),
    "tokamax-mosaic": lambda ctx: build_tokamax(ctx, "mosaic"),
}


# --------------------------------------------------------------------------- timing


def time_calls(call, sync, groups: int, calls: int, row_seconds: float):
    """(first result, compile s, best seconds per call, calls per group)."""
    t0 = time.perf_counter()
    first = call()
    sync(first)
    t1 = time.perf_counter()
    sync(call())
    t2 = time.perf_counter()
    warm = t2 - t1
    compile_s = max(0.0, (t1 - t0) - warm)
    per_group = calls
    if warm * groups * calls > row_seconds:
        per_group = max(1, int(row_seconds / (groups * max(warm, 1e-9))))
    best = math.inf
    for _ in range(groups):
        t0 = time.perf_counter()
        res = None
        for _ in range(per_group):
            res = call()
        sync(res)
        best = min(best, (time.perf_counter() - t0) / per_group)
        del res
    return first, compile_s, best, per_group


def run_row(ctx, impl: str, args) -> dict:
    p, case, mode = ctx["p"], ctx["case"], ctx["mode"]
    row = {"n": p.n, "heads": p.H, "head_dim": p.d, "case": case, "mode": mode,
           "impl": impl, "status": "ok"}
    if _elapsed() > args.budget_seconds:
        row.update(status="skipped", note="budget")
        return row
    try:
        call, sync, to_check, info = BUILDERS[impl](ctx)
        row.update(info)
        first, comp, best, per_group = time_calls(call, sync, args.groups, args.calls,
                                                  args.row_seconds)
        f = flops(case, p.H, p.n, p.d, mode, ctx["window"])
        row.update(ms=best * 1e3, tflops=f / best / 1e12, compile_s=comp,
                   calls_per_group=per_group, calls=args.calls, groups=args.groups, flops=f)
        if to_check is not None:
            try:
                got = to_check(first)
                row["check"] = compare(got, ctx["ref"](), ctx["hs"], ctx["rs"], args.tol)
            except Exception as err:  # the check itself broke: say so, keep the timing
                row["check"] = {"passed": False, "error": _short(err)}
        del first
    except Skip as why:
        row.update(status="skipped", note=str(why))
    except Exception as err:  # noqa: BLE001 - one implementation failing is a result
        row.update(status="failed", note=_short(err))
    finally:
        if impl.startswith("torch"):
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except Exception:
                pass
    return row


def fmt_row(row: dict) -> str:
    head = f"n={row['n']:<6} {row['case']:>9} {row['mode']:>7}  {row['impl']:<19}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row.get('note', '')}"
    kern = f" [{row['kernel']}]" if "kernel" in row else ""
    if row.get("kernel_notes"):
        kern += " (" + "; ".join(row["kernel_notes"]) + ")"
    chk = ""
    if "check" in row:
        c = row["check"]
        chk = (f"  check {'ok' if c['passed'] else 'FAILED'}"
               + (f" ({c['worst_rel']:.1e})" if "worst_rel" in c else f" ({c.get('error')})"))
    calls = "" if row["calls_per_group"] == row["calls"] else f" ({row['calls_per_group']} calls)"
    return (f"{head} {row['ms']:9.3f} ms {row['tflops']:8.2f} TFLOP/s  "
            f"compile {row['compile_s']:6.1f} s{kern}{chk}{calls}")


# --------------------------------------------------------------------------- output


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "numpyro",
                 "torch", "triton", "tokamax", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if jax.default_backend() == "gpu":
        try:  # private, best effort: the cuDNN that jax.nn's cuDNN attention calls
            from jax._src.lib import cuda_versions

            out["cudnn"] = str(cuda_versions.cudnn_get_version())
        except Exception:
            pass
    def git(*args):  # its output, or "" (no git, not a checkout, a timeout)
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except Exception:
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain"):  # the tree differs: edited or new files
        commit += "+changes"
    out["structinfer_commit"] = commit or None
    return out


def slug(text: str) -> str:
    s = "".join(c if c.isalnum() else "-" for c in text.lower())
    while "--" in s:
        s = s.replace("--", "-")
    return s.strip("-") or "device"


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row["status"] == "skipped":
        if row.get("note") == "budget":
            return "skipped (budget)"
        return "= auto" if str(row.get("note", "")).startswith("auto already") else "—"
    if row["status"] == "failed":  # the whole reason is in the notes
        why = str(row.get("note", ""))
        return "failed: " + (why if len(why) <= 60 else why[:57] + "...").replace("|", "/")
    c = row.get("check")
    mark = "" if c is None or c.get("passed") else " ✗"
    return f"{row['ms']:.3g} ms / {row['tflops']:.3g}{mark}"


def markdown(meta: dict, rows: list[dict], impls: list[str]) -> str:
    cfg = meta["config"]
    L = [f"# GPU attention benchmark: {meta['device']}", ""]
    L.append(f"{meta['date']}; `{meta['command']}`")
    L.append("")
    L.append("Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".")
    L.append("")
    L.append(f"{cfg['dtype']}, batch 1, window {cfg['window']}, geometric q = {GEO_Q}; "
             f"best of {cfg['groups']} groups of {cfg['calls']} calls after a warm-up "
             "(compile excluded). Cells: milliseconds / dense-equivalent TFLOP/s on useful "
             "pairs (forward 4·heads·pairs·head_dim, forward+backward 3.5× that); ✗: the "
             f"correctness check failed (tolerance {cfg['tol']:g} of the output scale). "
             "—: not applicable or not available (see the notes).")
    L.append("")
    if meta.get("budget_hit"):
        L.append(f"**Budget reached:** no row was started after {cfg['budget_seconds']:g} s "
                 f"(`--budget-seconds`); {meta['budget_skipped']} rows were not run.")
        L.append("")
    # columns: implementations with a row that ran, failed or was cut by the budget (one
    # skipped everywhere -- not installed, no GPU -- is only in the notes)
    present = [i for i in impls if any(r["impl"] == i and (r["status"] != "skipped"
                                                          or r.get("note") == "budget")
                                       for r in rows)]
    for shape in meta["shapes"]:
        n, H, d = shape
        L.append(f"## n = {n}, {H} heads, head dim {d}")
        L.append("")
        L.append("| case | mode | " + " | ".join(IMPLS[i][1] for i in present) + " |")
        L.append("| --- | --- |" + " --- |" * len(present))
        for case in cfg["cases"]:
            for mode in cfg["modes"]:
                sel = {r["impl"]: r for r in rows
                       if (r["n"], r["heads"], r["head_dim"]) == (n, H, d)
                       and r["case"] == case and r["mode"] == mode}
                if not sel:
                    continue
                kern = sel.get("structinfer", {}).get("kernel")
                label = f"{case}" + (f" (auto: {kern})" if kern else "")
                L.append(f"| {label} | {mode} | "
                         + " | ".join(_cell(sel.get(i)) for i in present) + " |")
        L.append("")
    L.append("## Correctness against the float32 reference")
    L.append("")
    L.append("| n | case | mode | implementation | kernel | max abs err | rel. to scale "
             "| checked | passed |")
    L.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        c = r.get("check")
        if not c:
            continue
        if "error" in c:
            L.append(f"| {r['n']} | {r['case']} | {r['mode']} | {IMPLS[r['impl']][1]} | "
                     f"{r.get('kernel', '')} | — | — | check failed: {c['error']} | no |")
            continue
        qs = [q for q in ("out", "dq", "dk", "dv", "dtable") if q in c]
        err = max(c[q]["max_abs_err"] for q in qs)
        L.append(f"| {r['n']} | {r['case']} | {r['mode']} | {IMPLS[r['impl']][1]} | "
                 f"{r.get('kernel', '')} | {err:.2e} | {c['worst_rel']:.2e} | "
                 f"{', '.join(qs)} ({len(c['heads'])} heads, {c['rows']} rows) | "
                 f"{'yes' if c['passed'] else '**no**'} |")
    L.append("")
    notes = []
    seen = set()
    for r in rows:
        if r["status"] == "failed" or (r["status"] == "skipped" and r.get("note") != "budget"):
            key = (r["impl"], r["status"], r.get("note"))
            if key in seen:
                continue
            seen.add(key)
            where = [f"{x['n']} {x['case']} {x['mode']}" for x in rows
                     if (x["impl"], x["status"], x.get("note")) == key]
            what = "failed" if r["status"] == "failed" else "skipped"
            notes.append(f"* {IMPLS[r['impl']][1]} {what}: {r.get('note')} "
                         f"({len(where)} row{'s' if len(where) > 1 else ''}: "
                         f"{'; '.join(where[:4])}{'; ...' if len(where) > 4 else ''})")
    kn = {}
    for r in rows:
        for s in r.get("kernel_notes", ()):
            kn.setdefault((r["impl"], r["case"], s), []).append(str(r["n"]))
    for (impl, case, s), ns in kn.items():
        if impl == "structinfer":
            notes.append(f"* structinfer (auto), {case}, n = {'/'.join(sorted(set(ns)))}: {s}")
    slow = [r for r in rows if r["status"] == "ok" and r["calls_per_group"] < cfg["calls"]]
    for r in slow:
        notes.append(f"* {IMPLS[r['impl']][1]}, n = {r['n']} {r['case']} {r['mode']}: "
                     f"{r['calls_per_group']} calls per group (slow call)")
    if notes:
        L.append("## Notes")
        L.append("")
        L.extend(notes)
        L.append("")
    L.append("## Compile seconds (first call minus a warm call)")
    L.append("")
    L.append("| n | case | mode | " + " | ".join(IMPLS[i][1] for i in present) + " |")
    L.append("| --- | --- | --- |" + " --- |" * len(present))
    for shape in meta["shapes"]:
        for case in cfg["cases"]:
            for mode in cfg["modes"]:
                sel = {r["impl"]: r for r in rows
                       if (r["n"], r["heads"], r["head_dim"]) == tuple(shape)
                       and r["case"] == case and r["mode"] == mode}
                if not sel:
                    continue
                cells = [f"{sel[i]['compile_s']:.1f}" if i in sel and sel[i]["status"] == "ok"
                         else "" for i in present]
                L.append(f"| {shape[0]} | {case} | {mode} | " + " | ".join(cells) + " |")
    L.append("")
    L.append(f"Wall clock: {meta['elapsed_s']:.0f} s.")
    L.append("")
    return "\n".join(L)


def write(out_dir: str, stem: str, meta: dict, rows: list[dict], impls: list[str]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(meta, elapsed_s=_elapsed())
    md = markdown(meta, rows, impls)
    with open(os.path.join(out_dir, stem + ".md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(out_dir, stem + ".json"), "w") as fh:
        json.dump(dict(meta, rows=rows), fh, indent=1, default=str)
    return md


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes in float32 (n=128, 2 heads, head dim 32; a CPU smoke test)")
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="sequence lengths (default 4096 16384)")
    ap.add_argument("--heads", type=int, nargs="+", default=None,
                    help="heads, one per size or one for all (default 32 up to n = 8192, "
                    "16 above)")
    ap.add_argument("--head-dim", type=int, default=None, help="default 128")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES + EXTRA_CASES)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--impls", nargs="+", choices=list(IMPLS),
                    default=[i for i in IMPLS if i not in EXTRA_IMPLS])
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default bfloat16 (float32 with --quick)")
    ap.add_argument("--window", type=int, default=None, help="sliding window (default 256)")
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--row-seconds", type=float, default=15.0,
                    help="timed seconds one row may take before it gets fewer calls")
    ap.add_argument("--order", choices=("case", "impl"), default="case",
                    help="case: every implementation runs a case before the next (a "
                    "budget cut drops whole cases); impl: each tier over every case")
    ap.add_argument("--budget-seconds", type=float, default=270.0,
                    help="start no new row after this many seconds of the run")
    ap.add_argument("--tol", type=float, default=None,
                    help="check tolerance relative to the output scale (default by dtype)")
    ap.add_argument("--check-heads", type=int, default=2)
    ap.add_argument("--check-rows", type=int, default=512)
    ap.add_argument("--check-max-entries", type=int, default=2**26,
                    help="check every row when heads x n^2 of the subset is at most this")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "gpu"),
                    help="folder for the .md and .json (default docs/results/gpu)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes = args.sizes or [128]
        args.heads = args.heads or [2]
        args.head_dim = args.head_dim or 32
        args.dtype = args.dtype or "float32"
        args.window = args.window or 32
        if "--groups" not in argv:
            args.groups = 2
        if "--calls" not in argv:
            args.calls = 2
    sizes = args.sizes or [4096, 16384]
    heads = args.heads or [32 if n <= 8192 else 16 for n in sizes]
    if len(heads) not in (1, len(sizes)):
        ap.error("--heads takes one value, or one per size")
    heads = heads * len(sizes) if len(heads) == 1 else heads
    d = args.head_dim or 128
    args.window = args.window or 256
    dtype = jnp.dtype(args.dtype or "bfloat16")
    if args.tol is None:
        args.tol = 2e-2 if dtype == jnp.bfloat16 else 1e-2
    bench.WINDOW = args.window  # attention.py's models and peers read it at call time
    impls = sorted(args.impls, key=lambda i: (IMPLS[i][0], list(IMPLS).index(i)))

    dev = jax.devices()[0]
    device = getattr(dev, "device_kind", dev.platform)
    now = datetime.datetime.now(datetime.UTC)
    stem = f"{slug(device)}_{now:%Y-%m-%d}"
    if os.path.exists(os.path.join(args.out, stem + ".md")):
        stem += f"_{now:%H%M%S}"
    meta = {
        "device": device, "platform": jax.default_backend(),
        "date": f"{now:%Y-%m-%d %H:%M} UTC", "versions": versions(),
        "command": shlex.join(["python", os.path.relpath(os.path.abspath(__file__), ROOT),
                               *argv]),
        "argv": argv,
        "shapes": [[n, H, d] for n, H in zip(sizes, heads)],
        "config": {"dtype": str(dtype), "window": args.window, "geo_q": GEO_Q,
                   "cases": args.cases, "modes": args.modes, "impls": impls,
                   "groups": args.groups, "calls": args.calls,
                   "row_seconds": args.row_seconds, "budget_seconds": args.budget_seconds,
                   "tol": args.tol, "check_heads": args.check_heads,
                   "check_rows": args.check_rows,
                   "flops": "fwd 4*heads*pairs*head_dim; fwd+bwd 3.5x fwd (bwd = 2.5x fwd)"},
    }
    print(f"{device} ({jax.default_backend()}); "
          + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))
    print(f"shapes {meta['shapes']} {dtype}; cases {' '.join(args.cases)}; "
          f"modes {' '.join(args.modes)}; budget {args.budget_seconds:g} s", flush=True)

    problems = {n: Problem(n, H, d, dtype) for n, H in zip(sizes, heads)}
    refs: dict = {}
    auto_kernel: dict = {}
    rows: list[dict] = []
    budget_note = False
    said: set = set()
    # (tier, size, case, mode) in the order they run: a case's tiers together by default
    tiers = sorted({IMPLS[i][0] for i in impls})
    order = [(tier, n, H, case, mode) for tier in tiers for n, H in zip(sizes, heads)
             for case in args.cases for mode in args.modes]
    if args.order == "case":
        order.sort(key=lambda c: (sizes.index(c[1]), args.cases.index(c[3]),
                                  args.modes.index(c[4]), c[0]))
    need_grad = "fwd+bwd" in args.modes
    for tier, n, H, case, mode in order:
        p = problems[n]
        hs, rs = check_subset(n, H, args.check_heads, args.check_rows, args.check_max_entries)

        def ref(case=case, p=p, hs=hs, rs=rs):
            key = (p.n, case)
            if key not in refs:
                refs[key] = reference(case, p, hs, rs, args.window, need_grad)
            return refs[key]

        ctx = {"p": p, "case": case, "mode": mode, "window": args.window,
               "ref": ref, "hs": hs, "rs": rs, "auto_kernel": auto_kernel}
        for impl in (i for i in impls if IMPLS[i][0] == tier):
            row = run_row(ctx, impl, args)
            rows.append(row)
            if row.get("note") == "budget":
                if not budget_note:
                    print(f"budget of {args.budget_seconds:g} s reached at "
                          f"{_elapsed():.0f} s: starting no more rows", flush=True)
                    budget_note = True
            elif row["status"] != "skipped" or (impl, row.get("note")) not in said:
                if row["status"] == "skipped":  # once per reason
                    said.add((impl, row.get("note")))
                print(fmt_row(row), flush=True)
                # every finished row is on disk: a killed run keeps its rows
                write(args.out, stem, meta, rows, impls)
    skipped = sum(1 for r in rows if r.get("note") == "budget")
    meta.update(budget_hit=skipped > 0, budget_skipped=skipped)
    md = write(args.out, stem, meta, rows, impls)
    print()
    print(md)
    print(f"wrote {os.path.join(args.out, stem)}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
