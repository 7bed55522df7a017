r"""Accelerator kernels: cuDNN fused attention and a Pallas flash kernel, chosen on GPUs.

On a GPU, `structinfer.attention(model, "out")` (`backend="auto"`) sends a recognised
edge site with logits $\ell_{ij} = q_i^\top k_j + b_{ij}$ on an allowed set of edges to
the platform's fused kernels instead of the portable blocked kernel
(`structinfer.lowering.blocked`), in this order:

* **cuDNN** flash attention, through
  `jax.nn.dot_product_attention(..., implementation="cudnn")`, when the edge is a dot
  product with no mask, a causal mask or a causal sliding window (child $i$ sees parents
  $i - W < j \le i$), plus an optional additive bias $b_{ij}$ (per-parent bias,
  relative-position bias, geometric recency log-prior; materialised as one
  $(n, m)$ table per head, so only up to `CUDNN_BIAS_MAX` entries), and the queries,
  keys and values are float16 / bfloat16 (the prior's parameters may be float32: they
  never promote them) with query and value head dims equal, a multiple of 8 and at most
  128 (what cuDNN accepts on every GPU it supports) — except where our kernels
  measured faster (`pallas_measured_faster`: the geometric prior; and a
  relative-position table where the Mosaic GPU kernel runs, the kernel table's rule).
* A **Pallas** (Triton) flash-attention kernel, `pallas_forward`, for the rest of
  the dot-product family in any floating dtype: it computes on each block the same logits
  the blocked kernel does — dot product, per-parent bias, relative-position bias looked up
  from the distance grid $d_{ij} = i + \text{offset} - j$, geometric log-prior
  $\log q_i + (d_{ij} - d_0)\log(1 - q_i)$, a per-edge mask (block-sparse, graph) — and
  skips the blocks outside the distance band (causal, windows, truncation) and, when
  the mask is known at trace time, the blocks it forbids (the rest read it only where
  some edge of the block is forbidden), multiplying in the inputs' dtype and accumulating
  in float32 (the prior's terms are added in float32). Its gradient, `pallas_backward`,
  is fused too (FlashAttention-2's two passes on the output $y$ and the row
  log-partition $L$, with the prior's parameters' gradients; the relative-position
  table's, summed with atomics, only when the table is differentiated; the backward
  reads a relative-position bias as one tile per block diagonal, `relpos_tiles`); both enter
  through `blocked_attention(..., forward=pallas_forward, backward=pallas_backward)`.
* Everything else (IDW scores, per-edge tables of logits) keeps the blocked kernel,
  which runs on every platform.

A third fused kernel, for NVIDIA Hopper GPUs, is in `structinfer.lowering.mosaic`
(Pallas' Mosaic GPU dialect: warpgroup matmuls fed by the tensor memory accelerator):
its forward, and a backward whose dQ and dK/dV passes enter `pallas_backward` through
its ``dq_pass`` / ``dkdv_pass`` hooks (the dK/dV pass sums a trained relative-position
table's gradient too, `relpos_tiles_grad`, so the third pass runs only where it cannot). In
`GPU_KERNELS` it comes before the Triton kernel: on an H100 (bfloat16, head dim 128)
its forward measured 1.3-1.9x and its backward 1.2-2.4x faster at every prior and size
measured (docs/results/gpu/).
``"auto"`` takes it only on a Hopper GPU of the running process; lowering for CUDA
elsewhere takes the Triton kernel.

These are entries of the kernel table (`structinfer.lowering.kernels.KERNELS`), which
holds the order above (`auto_kernel`) and what runs when cuDNN refuses when traced. On a
mesh (``mesh=``) every shard runs them too: head sharding the chosen kernel on each
device's heads, ring attention the Pallas passes on each chunk pair, given the chunk's
traced global offsets (``starts=``).

Every kernel answers in the value's dtype (bfloat16 in, bfloat16 out). Float32 inputs
through the Pallas kernel follow JAX's matmul precision: ``precision=None`` is JAX's
default (TF32 tensor cores on recent NVIDIA GPUs, relative errors ~1e-3), which
``jax.default_matmul_precision("highest")`` or ``structinfer.attention(...,
precision="highest")`` raises to full float32.

`structinfer.explain` names the kernel and, when cuDNN was not used, why. A
forced `backend="cudnn"` or `"pallas"` raises `NotLowerableError` with
the reason when the edge is outside the kernel's reach; `backend="pallas"` on a CPU
runs the kernel in Pallas' interpreter (slow; for tests).

Reference: Dao et al., "FlashAttention" (2022) and "FlashAttention-2" (2023) for the
schedule; NVIDIA cuDNN's fused attention (its graph API, reached through JAX).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ._masks import BlockMask, ConcreteMask, mask_shape, tile_grid
from ._softmax import (
    RowStats,
    backward_delta,
    backward_probs,
    online_finish,
    online_start,
    online_stats,
    online_step,
    require_row_stats,
    scale_grad,
    scale_row_sums,
)
from ._spec import (
    Problem,
    Terms,
    accum_dtype,
    band_ok,
    geometric_log_prior,
    relpos_index,
    relpos_weights,
    sum_to,
)
from .blocked import block_grids

__all__ = [
    "GPU_KERNELS",
    "CUDNN_BIAS_MAX",
    "RELPOS_TILES_MAX_BYTES",
    "platform",
    "cudnn_unsupported",
    "cudnn_wrapper_missing",
    "pallas_unsupported",
    "pallas_measured_faster",
    "cudnn_attention",
    "pallas_forward",
    "pallas_backward",
    "relpos_tiles",
    "relpos_tiles_grad",
    # the building blocks the Mosaic GPU kernels (structinfer.lowering.mosaic) share
    "Layout",
    "dot_only",
    "block_table",
    "live_range",
    "live_children",
    "full_parents",
    "full_children",
]

#: the fused kernels ``backend="auto"`` tries on a GPU, in order (names in the kernel table)
GPU_KERNELS = ("cudnn", "mosaic", "pallas")

#: largest additive-bias table (entries, all heads) handed to cuDNN
CUDNN_BIAS_MAX = 2**26

#: largest set of relative-position tiles (bytes, every distinct table of the batch) the
#: Pallas backward expands a relative-position table into (`relpos_tiles`); past it the
#: table is looked up per element
RELPOS_TILES_MAX_BYTES = 2**29


def platform() -> str:
    """The platform the kernels are built for: `jax.default_backend()` (`"cpu"`,
    `"gpu"`, `"tpu"`). Tests replace this function to exercise the GPU dispatch on a
    CPU."""
    return jax.default_backend()


def _prod(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def _additive(t: Terms) -> bool:
    return bool(t.col_bias or t.relpos is not None or t.geometric)


def dot_only(t: Terms, prob: Problem) -> str | None:
    """Reason the edge is outside the dot-product family (or None)."""
    if t.idw:
        return "an IDW score (pairwise distances per block)"
    if t.pair_logits:
        return "a per-edge table (sliced per block)"
    if not t.dot:
        return "the score has no dot-product term"
    return None


def cudnn_wrapper_missing() -> str | None:
    """Why this JAX's ``jax.nn.dot_product_attention`` cannot serve the cuDNN kernel (older
    releases take no ``return_residual``, which gives the rows' log-normalisers, nor
    ``local_window_size``), or `None`."""
    params = inspect.signature(jax.nn.dot_product_attention).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    missing = [p for p in ("return_residual", "local_window_size") if p not in params]
    if missing:
        return (f"this JAX ({jax.__version__})'s jax.nn.dot_product_attention takes no "
                f"{' / '.join(missing)} (a newer JAX's does)")
    return None


def cudnn_unsupported(terms: Terms, prob: Problem, batch_shape: tuple[int, ...]) -> str | None:
    """Why cuDNN's fused attention cannot run this edge, or `None` when it can.

    Checked statically (shapes, dtypes, the structure in `terms`; whether this JAX's
    cuDNN wrapper takes what the kernel passes is `cudnn_wrapper_missing`); cuDNN's own
    version and compute-capability checks run when the call is traced, and a failure
    there falls back to the next kernel.
    """
    why = dot_only(terms, prob)
    if why:
        return why
    if prob.glob.dot_scale is not None:
        return ("a traced dot-product scale of 16-bit operands (cuDNN takes one known at "
                "trace time; folded into the queries it would round them to 16 bits)")
    if terms.col_ok:
        return "a per-parent mask"
    if terms.pair_ok:
        return "a per-edge mask"
    q, k, v = prob.row.q, prob.col.k, prob.v
    dts = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dts) != 1 or next(iter(dts)) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return f"inputs are {sorted(str(d) for d in dts)} (cuDNN takes float16 / bfloat16)"
    f, dv = q.shape[-1], v.shape[-1]
    if f != dv:
        return f"query head dim {f} differs from value head dim {dv}"
    if f % 8 or f > 128:
        return f"head dim {f} (cuDNN: a multiple of 8, at most 128)"
    n, m = terms.num_children, terms.num_parents
    if terms.has_band:
        if terms.exclude_zero or terms.dmin != 0 or terms.offset != 0 or n != m:
            return ("a distance band other than causal / causal window on a square "
                    "self-attention (offset 0, self included)")
    if _additive(terms):
        heads = _prod(batch_shape)
        if n * m * heads > CUDNN_BIAS_MAX:
            return f"its bias table ({heads} x {n} x {m}) is over CUDNN_BIAS_MAX entries"
        if n % 2 or m % 2:
            return "odd sequence lengths with a bias (cuDNN's backward needs even ones)"
    return None


@functools.cache
def _triton():
    """The Pallas Triton backend's ``dot``, ``atomic_add`` and ``CompilerParams``:
    ``jax.experimental.pallas.triton`` where this JAX has it, else (older releases)
    ``pallas.atomic_add``, ``pallas.gpu.TritonCompilerParams`` and a ``dot`` that
    accumulates float64 in float64, as the newer one does."""
    try:
        from jax.experimental.pallas import triton

        return triton
    except ImportError:
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import gpu

        return types.SimpleNamespace(dot=_dot_in_input_precision, atomic_add=pl.atomic_add,
                                     CompilerParams=gpu.TritonCompilerParams)


def _dot_in_input_precision(a, b, trans_a: bool = False, trans_b: bool = False,
                            precision=None):
    """``pallas.triton.dot``'s rule for older JAX, whose ``pallas.dot`` accumulates every
    product in float32 (a float64 model would answer to float32 rounding): float64
    operands accumulate in float64, others in float32."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    out = jnp.float64 if dtype == jnp.float64 else jnp.float32
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out)


@functools.cache
def _pallas_missing() -> str | None:
    """Why this JAX has no Pallas Triton backend, or `None`."""
    try:
        _triton()
    except (ImportError, AttributeError) as err:
        return f"this JAX ({jax.__version__}) has no Pallas Triton backend ({err})"
    return None


def pallas_unsupported(terms: Terms, prob: Problem, batch_shape: tuple[int, ...]) -> str | None:
    """Why the Pallas kernel cannot run this edge (its structure, or a JAX without the
    Pallas Triton backend), or `None` when it can."""
    return _pallas_missing() or dot_only(terms, prob)


def pallas_measured_faster(terms: Terms) -> str | None:
    """Why the Pallas kernel is taken although cuDNN could run the edge, or `None`.

    The measured rule (NVIDIA H100, JAX 0.11.2, bfloat16, head dim 128, 16 heads; the
    logs in docs/results/gpu/): with a geometric prior, at n = 1024 and 2048, the Pallas
    kernel ran 1.6-1.7x faster than cuDNN with the prior's bias table materialised in
    forward + backward and 1.6-2.0x faster in the forward; at n = 4096 (32 heads, a
    table over `CUDNN_BIAS_MAX`, cuDNN forced) 1.4x faster in forward + backward, 0.9x in
    the forward. With a relative-position table cuDNN was as fast (n = 1024) or 1.2x
    faster (n = 2048) in forward + backward, so it keeps cuDNN. Other GPUs, float16 and
    smaller head dims were not measured.
    """
    if terms.geometric:
        return ("the Pallas kernel measured faster than cuDNN with the geometric prior's "
                "bias table materialised (the Mosaic GPU kernel faster still, forward and "
                "backward)")
    return None


# --- cuDNN ----------------------------------------------------------------------------


def _bias_table(terms: Terms, prob: Problem, dtype) -> jax.Array:
    """The additive part $b_{ij}$ of the logits as a `(..., n, m)` table."""
    n, m = terms.num_children, terms.num_parents
    d = jnp.arange(n)[:, None] + terms.offset - jnp.arange(m)[None, :]
    b = jnp.zeros((n, m), jnp.float32)
    if terms.col_bias:
        b = b + prob.col.bias[..., 0][..., None, :]
    if terms.relpos is not None:
        b = b + relpos_weights(terms.relpos, prob.glob.relpos, d)
    if terms.geometric:
        g = prob.row.geo.astype(jnp.float32)
        b = b + geometric_log_prior(g[..., 0:1], g[..., 1:2], d - terms.geo_d0)
    return b.astype(dtype)


def cudnn_attention(terms: Terms, prob: Problem, batch_shape: tuple[int, ...],
                    unscaled: tuple[jax.Array, float] | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    r"""$y = \mathrm{softmax}(q k^\top + b)\,V$ and $L$ through cuDNN's fused attention.

    Requires `cudnn_unsupported` to return `None`. The batch dims (heads, batch) become
    cuDNN's batch, one head each, so the call reads and writes our arrays where they are
    (queries, keys or values shared across the batch are broadcast first); with an
    additive bias they become the heads of one batch element instead. The dot product's
    scale is folded into ``prob.row.q`` or is ``terms.dot_scale`` (16-bit operands), or
    given with the unscaled queries as
    ``unscaled`` (`Lowered.unscaled_dot`): cuDNN then applies it to $q^\top k$ in float32,
    and the call reads the queries where they are (no scaled copy, and no pass scaling
    their gradient).

    Args:
        terms: the static terms of a lowered edge site.
        prob: the arrays those terms read.
        batch_shape: the broadcast batch shape (heads, batch) of the result.
        unscaled: optional ``(q, s)``: queries to use in place of ``prob.row.q`` (which
            is ``s * q``, or ``q`` with ``terms.dot_scale = s``) and the static scale ``s``.

    Returns:
        `(y, L)`: `batch + (n, dv)` in the value dtype and `batch + (n,)` in float32.
        JAX's cuDNN wrapper returns ``L`` rounded to the inputs' dtype and without a
        gradient: a gradient through ``L`` raises ``NotImplementedError`` (one through
        ``y`` is cuDNN's own).

    Raises:
        NotImplementedError: from JAX's cuDNN wrapper when the installed cuDNN or the GPU
            cannot run it (the caller falls back); so can ``ValueError`` and
            ``RuntimeError``.
    """
    batch = tuple(batch_shape)
    n, m = terms.num_children, terms.num_parents
    B = _prod(batch)
    q, k, v = prob.row.q, prob.col.k, prob.v
    scale = 1.0 if terms.dot_scale is None else terms.dot_scale
    if unscaled is not None:
        q, scale = unscaled

    # Without a bias, our batch is cuDNN's batch of one head each: (B, L, 1, f) in its BTNH
    # layout is our (B, L, f) in memory, so no operand or result is copied. With a bias,
    # our batch is the heads of one batch element, (1, L, B, f): its bias (1, B, n, m) is
    # the shape every JAX release returns the gradient of (older ones return zeros for a
    # bias with a batch axis), and the transposes are small beside the bias table.
    as_heads = _additive(terms)

    def to_cudnn(x):  # (..., L, f) -> (B, L, 1, f) or (1, L, B, f)
        x = jnp.broadcast_to(x, batch + x.shape[-2:]).reshape((B,) + x.shape[-2:])
        return jnp.swapaxes(x, 0, 1)[None] if as_heads else x[:, :, None]

    def from_cudnn(x):  # (B, L, 1, ...) or (1, L, B, ...) -> (B, L, ...)
        return jnp.swapaxes(x[0], 0, 1) if as_heads else x[:, :, 0]

    bias = None
    if as_heads:
        b = _bias_table(terms, prob, q.dtype)
        bias = jnp.broadcast_to(b, batch + (n, m)).reshape((1, B, n, m))
    causal = terms.has_band
    window = (terms.dmax, 0) if terms.dmax is not None else None
    y, res = jax.nn.dot_product_attention(
        to_cudnn(q), to_cudnn(k), to_cudnn(v), bias=bias, scale=scale, is_causal=causal,
        local_window_size=window, implementation="cudnn", return_residual=True,
    )
    y = from_cudnn(y).reshape(batch + (n, v.shape[-1]))
    lse = from_cudnn(res).reshape(batch + (n,))
    lse = _not_differentiated(lse.astype(accum_dtype(v.dtype)), q, k, v)
    return y.astype(v.dtype), lse


@jax.custom_vjp
def _not_differentiated(lse: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """cuDNN's row log-normaliser, which its JAX wrapper returns without a gradient (the
    cotangent of its residual is dropped): a gradient through it raises. ``q``, ``k``,
    ``v`` (what it depends on) make the check independent of how the wrapper cut the
    gradient."""
    return lse


def _not_differentiated_fwd(lse, q, k, v):
    return lse.value, None  # symbolic zeros: the primals come as CustomVJPPrimal


def _not_differentiated_bwd(_, ct):
    if type(ct) is not SymbolicZero:
        raise NotImplementedError(
            "the row log-normaliser of the cuDNN kernel has no gradient (JAX's cuDNN "
            "wrapper drops it); differentiate it on backend='pallas', 'blocked' or "
            "'dense'")
    return None, None, None, None  # zero cotangents


_not_differentiated.defvjp(_not_differentiated_fwd, _not_differentiated_bwd,
                           symbolic_zeros=True)


# --- Pallas ----------------------------------------------------------------------------


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, int(x) - 1).bit_length())


def _block_span(first, last, b: int, nb: int):
    """First and one-past-last block of size ``b`` (of ``nb``) holding the indices
    ``first .. last`` (traced; ``None``: unbounded on that side)."""
    b = jnp.int32(b)  # int32 under x64 too, like the program ids
    lo = jnp.int32(0) if first is None else lax.div(jnp.maximum(first, 0), b)
    hi = jnp.int32(nb) if last is None else jnp.where(
        last < 0, 0, jnp.minimum(lax.div(jnp.maximum(last, 0), b) + 1, nb))
    return lo, jnp.maximum(hi, lo)


def live_range(terms: Terms, a, bq: int, bk: int, nkb: int, off):
    r"""Parent blocks child block `a` (traced) can see: the parents $j$ with
    $d_{\min} \le i + \text{off} - j \le d_{\max}$ for an $i$ of it (``off``: the
    offset, traced when the arrays are a shard of a longer sequence)."""
    i_lo, t = a * bq, terms
    return _block_span(None if t.dmax is None else i_lo + off - t.dmax,
                       None if t.dmin is None else i_lo + bq - 1 + off - t.dmin, bk, nkb)


def live_children(terms: Terms, t, bq: int, bk: int, nqb: int, off):
    r"""Child blocks that can see parent block `t` (traced): the children $i$ with
    $d_{\min} \le i + \text{off} - j \le d_{\max}$ for a $j$ of it."""
    j_lo, tm = t * bk, terms
    return _block_span(None if tm.dmin is None else j_lo + tm.dmin - off,
                       None if tm.dmax is None else j_lo + bk - 1 + tm.dmax - off, bq, nqb)


def _floor_div(x, b: int):
    """``floor(x / b)`` of an int32 scalar that may be negative (``lax.div`` truncates)."""
    b = jnp.int32(b)
    return jnp.where(x >= 0, lax.div(x, b), -lax.div(b - 1 - x, b))


def full_parents(terms: Terms, a, bq: int, bk: int, off):
    r"""Parent blocks ``f_lo .. f_hi - 1`` whose every edge with child block `a` (traced)
    is allowed: all distances $d_{ij} = i + \text{off} - j$ of the tile (its padded rows
    too) in the band, and no padded parent. ``None`` with an excluded self-edge (the
    tiles without it are not one range); an empty range is fine (``f_hi <= f_lo``)."""
    if terms.exclude_zero:
        return None
    i0 = a * bq
    f_lo = jnp.int32(0)
    if terms.dmax is not None:  # largest distance i0 + bq - 1 + off - j0 <= dmax
        f_lo = jnp.maximum(f_lo, -_floor_div(terms.dmax + 1 - bq - off - i0, bk))
    f_hi = jnp.int32(terms.num_parents // bk)
    if terms.dmin is not None:  # smallest distance i0 + off - (j0 + bk - 1) >= dmin
        f_hi = jnp.minimum(f_hi, _floor_div(i0 + off - terms.dmin + 1, bk))
    return f_lo, f_hi


def full_children(terms: Terms, t, bq: int, bk: int, nqb: int, off):
    r"""Child blocks ``f_lo .. f_hi - 1`` whose every edge with parent block `t` (traced)
    is allowed (as `full_parents`); none when the parent block holds padding."""
    if terms.exclude_zero:
        return None
    j0 = t * bk
    f_lo = jnp.int32(0)
    if terms.dmin is not None:  # i0 + off - j0 - bk + 1 >= dmin
        f_lo = jnp.maximum(f_lo, -_floor_div(off - j0 - bk + 1 - terms.dmin, bq))
    f_hi = jnp.where(j0 + bk <= terms.num_parents, jnp.int32(nqb), 0)
    if terms.dmax is not None:  # i0 + bq - 1 + off - j0 <= dmax
        f_hi = jnp.minimum(f_hi, _floor_div(terms.dmax - bq + 1 - off + j0, bq) + 1)
    return f_lo, f_hi


def _offset(terms: Terms, named: dict):
    r"""The offset of the distances $d_{ij} = i + \text{offset} - j$ a kernel computes
    with: ``terms.offset`` (static), plus the traced shift $i_0 - j_0$ between the global
    starts of the children and parents when the kernel runs on a shard (operand
    ``"shift"``, `pallas_forward`'s ``starts``)."""
    if "shift" not in named:
        return terms.offset
    return terms.offset + named["shift"][0]


def _tile(terms: Terms, named: dict, q, k, i0, j0, g0, g1, acc_dtype, precision, off,
          masked: bool = True, unscaled: bool = False):
    r"""Logits of one (child block, parent block) tile, the allowed-edge mask and the
    distance grid: $q k^\top$ plus the per-parent bias, the relative-position bias and the
    geometric log-prior, computed from the index grids (shared by every Pallas pass).
    ``masked``: forbidden edges (padded parents, outside the band, and where the per-edge
    mask, operand ``"pmask"``, says so) are ``-inf``; ``False`` for a tile whose every
    edge is allowed, which then builds no mask (and returns ``None`` for it).
    ``unscaled``: also return the products $q k^\top$ before a traced scale (operand
    ``"scale"``) multiplies them, fourth."""
    i_idx = i0 + jnp.arange(q.shape[0], dtype=jnp.int32)  # int32 under x64 too
    j_idx = j0 + jnp.arange(k.shape[0], dtype=jnp.int32)
    s = _dot(q, k, precision, acc_dtype, trans_b=True)
    if terms.dot_scale is not None:
        s = s * terms.dot_scale
    qk = s
    if "scale" in named:  # a traced scale (the dK and dQ passes leave it out of dk, dq)
        s = s * named["scale"][0]
    d = i_idx[:, None] + off - j_idx[None, :]
    if "bias" in named:  # per-parent bias, -inf on parents a per-parent mask forbids
        s = s + named["bias"][_pl_ds(j0, k.shape[0])][None, :].astype(acc_dtype)
    if "rtiles" in named:  # the relative-position bias, expanded per block diagonal
        c = lax.div(i0 - j0 + (named["k"].shape[0] - k.shape[0]),
                    jnp.int32(min(q.shape[0], k.shape[0])))
        s = s + named["rtiles"][c].astype(acc_dtype)
    elif terms.relpos is not None:  # looked up per element
        s = s + named["relpos"][relpos_index(terms.relpos, d)].astype(acc_dtype)
    if terms.geometric:
        s = s + geometric_log_prior(g0[:, None], g1[:, None], d - terms.geo_d0)
    extra = (qk,) if unscaled else ()
    if not masked:
        return (s, None, d) + extra
    ok = (j_idx < terms.num_parents)[None, :]
    band = band_ok(terms, d)
    if band is not None:
        ok = ok & band
    if "pmask" in named:
        ok = ok & (named["pmask"][_pl_ds(i0, q.shape[0]), _pl_ds(j0, k.shape[0])] != 0)
    return (jnp.where(ok, s, -jnp.inf), ok, d) + extra


def _pl_ds(start, size: int):
    from jax.experimental import pallas as pl

    return pl.ds(pl.multiple_of(start, size), size)


def _over_blocks(named: dict, lo, hi, full, body, init):
    r"""Run ``body(t, masked, carry)`` over the blocks a program visits, the blocks whose
    every edge is allowed with ``masked=False`` (no mask built), the others masked
    (FlashAttention's split of a causal loop, FlexAttention's full and partial blocks).
    With block lists (operand ``"blocks"``: ``[full count, partial count, full
    blocks..., partial blocks...]``, `block_table`), the program's row of them;
    else the band's range ``lo .. hi``, of which ``full = (f_lo, f_hi)`` are full
    (`full_parents`, `full_children`; ``None``: none is)."""
    if "blocks" in named:
        row = named["blocks"]
        nf = row[0]
        carry = lax.fori_loop(0, nf, lambda u, c: body(row[2 + u], False, c), init)
        return lax.fori_loop(nf, nf + row[1], lambda u, c: body(row[2 + u], True, c), carry)
    if full is None:
        return lax.fori_loop(lo, hi, lambda t, c: body(t, True, c), init)
    f_lo = jnp.minimum(jnp.maximum(full[0], lo), hi)
    f_hi = jnp.maximum(jnp.minimum(full[1], hi), f_lo)
    carry = lax.fori_loop(lo, f_lo, lambda t, c: body(t, True, c), init)
    carry = lax.fori_loop(f_lo, f_hi, lambda t, c: body(t, False, c), carry)
    return lax.fori_loop(f_hi, hi, lambda t, c: body(t, True, c), carry)


def _pallas_kernel(*refs, terms: Terms, bq: int, bk: int, nkb: int, keys: tuple[str, ...],
                   acc_dtype, precision, nan_rows: bool):
    r"""Forward: one child block of one batch element, online softmax over its live parent
    blocks; writes $y$ (NaN in the rows of non-finite $L$ with ``nan_rows``) and the rows'
    statistics $m$ and $\log l$ (`RowStats`; $L = m + \log l$)."""
    from jax.experimental import pallas as pl

    named = dict(zip(keys, refs[: len(keys)]))
    o_ref, m_ref, log_l_ref = refs[len(keys):]
    a = pl.program_id(0)
    q = named["q"][...]
    g0 = g1 = None
    if terms.geometric:
        g0 = named["geo0"][...].astype(acc_dtype)
        g1 = named["geo1"][...].astype(acc_dtype)
    off = _offset(terms, named)
    lo, hi = live_range(terms, a, bq, bk, nkb, off)

    def matmul(p, v):
        return _dot(p, v, precision, acc_dtype)

    def body(t, tile_masked, state):
        j0 = t * bk
        k = named["k"][_pl_ds(j0, bk), :]
        s, _, _ = _tile(terms, named, q, k, a * bq, j0, g0, g1, acc_dtype, precision, off,
                        tile_masked)
        return online_step(state, s, named["v"][_pl_ds(j0, bk), :], matmul)

    full = None if terms.pair_ok else full_parents(terms, a, bq, bk, off)
    state = _over_blocks(named, lo, hi, full, body,
                         online_start((bq,), o_ref.shape[-1], acc_dtype))
    y, lse = online_finish(state)
    if nan_rows:  # |L| < inf: False for -inf, +inf and NaN
        y = jnp.where((jnp.abs(lse) < jnp.inf)[:, None], y, jnp.nan)
    o_ref[...] = y.astype(o_ref.dtype)
    m_ref[...], log_l_ref[...] = online_stats(state)


def _dot(a, b, precision, acc_dtype, trans_a: bool = False, trans_b: bool = False):
    return _triton().dot(a, b, trans_a=trans_a, trans_b=trans_b,
                     precision=precision).astype(acc_dtype)


class Layout:
    """Block sizes and padded shapes of one Pallas launch, and the operands it reads
    (feature and value dims padded to a power of two of at least ``min_dim``)."""

    def __init__(self, terms: Terms, prob: Problem, batch_shape, block_q: int, block_k: int,
                 min_dim: int = 16):
        self.batch = tuple(batch_shape)
        self.B = _prod(self.batch)
        n, m = terms.num_children, terms.num_parents
        self.bq = min(_pow2(block_q), _pow2(n))
        self.bk = min(_pow2(block_k), _pow2(m))
        self.nqb, self.nkb = -(-n // self.bq), -(-m // self.bk)
        self.n_pad, self.m_pad = self.nqb * self.bq, self.nkb * self.bk
        q, v = prob.row.q, prob.v
        self.fp, self.dvp = _pow2(q.shape[-1], min_dim), _pow2(v.shape[-1], min_dim)
        self.acc = accum_dtype(v.dtype)

    def flat(self, x, core: int):
        """``x`` broadcast to the batch and flattened to ``(B,) + core dims``."""
        return jnp.broadcast_to(x, self.batch + x.shape[x.ndim - core:]).reshape(
            (self.B,) + x.shape[x.ndim - core:])

    def unpad(self, x, length: int, core: int | None = None):
        """A kernel's ``(B, padded length[, padded core])`` result cut to ``length`` (and
        ``core``) and shaped ``batch + (length[, core])``."""
        x = x[:, :length] if core is None else x[:, :length, :core]
        return x.reshape(self.batch + x.shape[1:])

    @staticmethod
    def pad(x, *sizes, value=0):
        """``x`` ``(B, ...)`` padded with ``value`` at the end of each later dim to
        ``sizes``."""
        return jnp.pad(x, [(0, 0)] + [(0, s - x.shape[i + 1]) for i, s in enumerate(sizes)],
                       constant_values=value)

    def distinct(self, x, core: int):
        """``x``'s rows without broadcasting them to the batch: ``(R,) + core dims``, and
        the map from a flat batch index ``b`` (traced) to its row."""
        own = x.shape[:x.ndim - core]
        own = (1,) * (len(self.batch) - len(own)) + own
        rows = x.reshape((-1,) + x.shape[x.ndim - core:])

        def row_of(b):
            row, b_stride, r_stride = 0, 1, 1
            for size, mine in zip(reversed(self.batch), reversed(own)):
                if mine > 1:  # a dim x has: b's coordinate there picks the row
                    coord = lax.rem(lax.div(b, jnp.int32(b_stride)), jnp.int32(size))
                    row = row + coord * r_stride
                b_stride, r_stride = b_stride * size, r_stride * mine
            return row

        return rows, row_of

    def tiles_bytes(self, table) -> int:
        """Bytes of this launch's `relpos_tiles` of ``table`` (one set per distinct row)."""
        g = min(self.bq, self.bk)
        count = (self.n_pad - self.bq + self.m_pad - self.bk) // g + 1
        return (int(np.prod(table.shape[:-1])) * count * self.bq * self.bk
                * jnp.dtype(table.dtype).itemsize)

    def operands(self, terms: Terms, prob: Problem, whole_rows: bool, shift=None,
                 tiles: bool = False):
        """The kernels' inputs and block specs: q / k / v and the prior's terms. With
        ``whole_rows`` the per-child arrays are passed whole (a pass over parent blocks
        that loops over child blocks), else one child block per program. ``shift``
        (traced, optional): the global start of the children minus that of the parents,
        passed as the operand ``"shift"`` (see `_offset`). ``tiles``: the
        relative-position table as `relpos_tiles` (operand ``"rtiles"``) instead of
        whole (``"relpos"``, looked up per element)."""
        from jax.experimental import pallas as pl

        bq, n_pad, m_pad, fp, dvp = self.bq, self.n_pad, self.m_pad, self.fp, self.dvp
        arrays = {"q": self.pad(self.flat(prob.row.q, 2), n_pad, fp),
                  "k": self.pad(self.flat(prob.col.k, 2), m_pad, fp),
                  "v": self.pad(self.flat(prob.v, 2), m_pad, dvp)}
        rows = ((lambda i, b: (b, 0, 0)), (None, n_pad)) if whole_rows else (
            (lambda i, b: (b, i, 0)), (None, bq))
        row_vec = (lambda i, b: (b, 0)) if whole_rows else (lambda i, b: (b, i))
        specs = {
            "q": pl.BlockSpec(rows[1] + (fp,), rows[0]),
            "k": pl.BlockSpec((None, m_pad, fp), lambda i, b: (b, 0, 0)),
            "v": pl.BlockSpec((None, m_pad, dvp), lambda i, b: (b, 0, 0)),
        }
        if terms.col_bias or terms.col_ok:
            cb = jnp.zeros((terms.num_parents,), self.acc)
            if terms.col_bias:
                cb = cb + prob.col.bias[..., 0].astype(self.acc)
            if terms.col_ok:
                cb = jnp.where(prob.const.col_ok, cb, -jnp.inf)
            arrays["bias"] = self.pad(self.flat(cb, 1), m_pad)
            specs["bias"] = pl.BlockSpec((None, m_pad), lambda i, b: (b, 0))
        if terms.geometric:
            geo = self.flat(prob.row.geo, 2)
            for r in (0, 1):
                arrays[f"geo{r}"] = self.pad(geo[..., r], n_pad)
                specs[f"geo{r}"] = pl.BlockSpec(rows[1], row_vec)
        if terms.relpos is not None and tiles:  # one set per distinct table, not per b
            rows, row_of = self.distinct(prob.glob.relpos, 1)
            rt = relpos_tiles(terms, rows, self.bq, self.bk, self.n_pad, self.m_pad)
            arrays["rtiles"] = rt
            specs["rtiles"] = pl.BlockSpec((None,) + rt.shape[1:],
                                           lambda i, b: (row_of(b), 0, 0, 0))
        elif terms.relpos is not None:
            rb = self.flat(prob.glob.relpos, 1)
            arrays["relpos"] = rb
            specs["relpos"] = pl.BlockSpec((None, rb.shape[-1]), lambda i, b: (b, 0))
        if shift is not None:
            arrays["shift"] = jnp.reshape(shift, (1,))
            specs["shift"] = pl.BlockSpec((1,), lambda i, b: (0,))
        if prob.glob.dot_scale is not None:  # a traced scale of the dot term, (1,)
            arrays["scale"] = prob.glob.dot_scale.astype(self.acc)
            specs["scale"] = pl.BlockSpec((1,), lambda i, b: (0,))
        return arrays, specs


def relpos_tiles(terms: Terms, table: jax.Array, bq: int, bk: int, n_pad: int,
                 m_pad: int) -> jax.Array:
    r"""A relative-position table expanded into the tiles the kernels add, one per block
    diagonal: ``(..., C, bq, bk)`` with tile $c$ holding $b_{r(\Delta + a + \text{offset}
    - s)}$ at $(a, s)$, for the block-start difference $\Delta = i_0 - j_0 = cg - (m_{pad}
    - b_k)$, $g = \min(b_q, b_k)$ (both powers of two, so every tile of child block
    $i_0 / b_q$ and parent block $j_0 / b_k$ is one of these $C = (n_{pad} - b_q + m_{pad}
    - b_k)/g + 1$).

    A tile depends on $i_0 - j_0$ alone (the bias is a function of the distance), so the
    kernels load it whole, like a key block, instead of looking up $b_q b_k$ scattered
    entries of the table per tile (a gather, the relative-position kernels' largest cost
    on a GPU). Memory: $C b_q b_k \approx (n + m) \max(b_q, b_k)$ entries per table,
    linear in the sequence (`RELPOS_TILES_MAX_BYTES` bounds it); the values are the table's own, in
    its dtype, so the logits are unchanged bit for bit.

    Args:
        terms: the lowered edge's terms (``terms.relpos`` set, ``terms.offset`` static).
        table: the bias over distances, ``(..., L)``.
        bq: the launch's child block size (a power of two).
        bk: its parent block size (a power of two).
        n_pad: the padded number of children (a multiple of ``bq``).
        m_pad: the padded number of parents (a multiple of ``bk``).

    Returns:
        ``table.shape[:-1] + (C, bq, bk)``, in the table's dtype.

    Reference: the relative-position prior of Singh & Buckley (appendix 8.2, Table 1
    row 4), `structinfer.priors.RelativePosition`; the blocks are FlashAttention-2's
    (Dao, 2023).
    """
    g = min(bq, bk)
    first = -(m_pad - bk)
    count = (n_pad - bq - first) // g + 1
    start = first + g * jnp.arange(count, dtype=jnp.int32)
    a = jnp.arange(bq, dtype=jnp.int32)
    s = jnp.arange(bk, dtype=jnp.int32)
    d = start[:, None, None] + a[None, :, None] + terms.offset - s[None, None, :]
    return jnp.take(table, relpos_index(terms.relpos, d), axis=-1)


def relpos_tiles_grad(terms: Terms, d_tiles: jax.Array, length: int, n_pad: int,
                      m_pad: int) -> jax.Array:
    r"""The transpose of `relpos_tiles`: the table's gradient from its tiles' cotangents,

    $$
    \frac{\partial}{\partial b_r} = \sum_c \sum_{(a, s):\; r(\Delta_c + a + \text{offset}
    - s) = r} \mathrm{d}T_{c,a,s},
    $$

    without the scatter of every tile entry that `jax.vjp` of `relpos_tiles` would run
    (one atomic add per entry, most of them into the same few hundred addresses): each
    tile is first summed along its diagonals $a - s$ (a shear of the tile, then a sum
    over rows), and only those $b_q + b_k - 1$ sums per tile
    are added into the table. The kernels whose table gradient is accumulated per tile
    (the Mosaic GPU dK/dV pass) end with this.

    Args:
        terms: the lowered edge's terms (``terms.relpos`` set, ``terms.offset`` static).
        d_tiles: the tiles' cotangents, ``(..., C, bq, bk)`` (as `relpos_tiles` gives).
        length: the table's length $L$.
        n_pad: the padded number of children the tiles were built for.
        m_pad: the padded number of parents.

    Returns:
        ``d_tiles.shape[:-3] + (length,)``, in ``d_tiles``' dtype.

    Raises:
        ValueError: ``d_tiles`` does not hold the tiles of those padded lengths.

    Reference: the relative-position prior of Singh & Buckley (appendix 8.2, Table 1
    row 4), `structinfer.priors.RelativePosition`; the blocks are FlashAttention-2's
    (Dao, 2023).
    """
    *lead, count, bq, bk = d_tiles.shape
    g = min(bq, bk)
    if count != (n_pad - bq + m_pad - bk) // g + 1:
        raise ValueError(f"relpos_tiles_grad: {count} tiles, expected "
                         f"{(n_pad - bq + m_pad - bk) // g + 1} for {n_pad} x {m_pad} "
                         f"padded lengths with {bq} x {bk} tiles")
    # x[a, s'] = dT[a, bk - 1 - s']: row a of the padded tile read as rows of bq + bk - 1
    # puts entry (a, s') in column a + s' = a - s + bk - 1, its diagonal
    x = jnp.flip(d_tiles, -1)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, bq)])
    width = bq + bk - 1
    x = x.reshape(*lead, count, bq * (bk + bq))[..., : bq * width]
    sums = x.reshape(*lead, count, bq, width).sum(-2)
    first = -(m_pad - bk)
    start = first + g * jnp.arange(count, dtype=jnp.int32)
    d = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :] - (bk - 1) + terms.offset
    idx = relpos_index(terms.relpos, d)
    return jnp.zeros((*lead, length), sums.dtype).at[..., idx].add(sums)


def _use_tiles(terms: Terms, prob: Problem, lay: Layout, shift, tiles: bool | None) -> bool:
    """Whether a launch reads `relpos_tiles`: a relative-position table, a static offset
    (not a shard of a longer sequence), and within `RELPOS_TILES_MAX_BYTES` (``tiles``:
    forced on or off, for tests and tuning)."""
    if terms.relpos is None or shift is not None:
        return False
    if tiles is not None:
        return bool(tiles)
    return lay.tiles_bytes(prob.glob.relpos) <= RELPOS_TILES_MAX_BYTES


def _block_grids(terms: Terms, mask: ConcreteMask | None, lay: Layout
                 ) -> tuple[np.ndarray, np.ndarray, bool]:
    r"""The blocks of a launch's grid when the edge has a per-edge mask: ``(live, full,
    needs_mask)``, two ``(nqb, nkb)`` boolean grids and whether some live block needs the
    mask itself.

    A block is live when the distance band allows some edge of it and the concrete
    ``mask`` (the per-edge mask's value, OR-ed over its batch dims) some edge too, and
    *full* when both allow every edge of it (the mask in every batch element) and it
    holds no padded parent: full blocks are computed without building a mask. A block
    needs the mask when the mask forbids some edge of it (padding aside). Without
    ``mask`` (traced) every block in the band is partial and needs it.

    The band's full blocks are checked on the real children only: a padded child row of
    a full block is computed unmasked, which is harmless, as the forward and dQ passes
    drop padded rows and the dK/dV pass gives them $p = 0$ (their $L$ is padded with
    $-\infty$, `backward_probs`).
    """
    live, band_full = block_grids(dataclasses.replace(terms, pair_ok=False, col_ok=False),
                                  lay.bq, lay.bk)
    if mask is None:
        return live, np.zeros_like(live), True
    n, m = terms.num_children, terms.num_parents
    tiles = (n, m, lay.bq, lay.bk, lay.nqb, lay.nkb)
    live &= tile_grid(mask, *tiles, reduce=np.any, over_batch=np.any)
    # the mask allows every edge of the block (padding aside)
    whole = tile_grid(mask, *tiles, reduce=np.all, over_batch=np.all)
    # full: every edge in the band, no padded parent, and the mask allows them all
    return live, band_full & whole & live, bool((live & ~whole).any())


def block_table(grids: tuple[np.ndarray, ...], by_parent: bool = False,
                min_width: int = 16) -> np.ndarray:
    """The blocks each program visits, from ``(live, full, ...)`` boolean ``(nqb, nkb)``
    block grids (`_block_grids`): one row per child block (per parent block with
    ``by_parent``), ``[full count, partial count, full blocks..., partial blocks...,
    0...]`` (int32, a power-of-two width of at least ``min_width``). Full blocks are
    computed without a mask, partial ones masked (FlexAttention's block masks)."""
    live, full = grids[0], grids[1]
    if by_parent:
        live, full = live.T, full.T
    full = full & live
    rows = [(np.flatnonzero(f), np.flatnonzero(lv & ~f)) for lv, f in zip(live, full)]
    width = _pow2(2 + max(len(f) + len(p) for f, p in rows), min_width)
    out = np.zeros((len(rows), width), np.int32)
    for r, (f, p) in enumerate(rows):
        out[r, :2] = len(f), len(p)
        out[r, 2:2 + len(f) + len(p)] = np.concatenate([f, p])
    return out


#: smallest tile `_fit_blocks` narrows a kernel's tiles to (smaller tiles waste the
#: matmul units more than reading the mask in the tiles that straddle two blocks costs;
#: a guess, not measured on a GPU)
FIT_MIN = 32


def _fit_blocks(size: int, mask: ConcreteMask | None, axis: int) -> int:
    """A default block size lowered to divide a `BlockMask`'s block size along ``axis``
    (0: children, 1: parents) when a power of two of at least `FIT_MIN` divides it: blocks
    then never straddle two of the mask's, so none needs the per-edge mask."""
    if not isinstance(mask, BlockMask):
        return size
    b = mask.block_size[axis]
    p = b & -b  # the largest power of two dividing b
    return min(size, p) if p >= FIT_MIN else size


def _check_mask(mask: ConcreteMask | None, terms: Terms, who: str) -> None:
    """A concrete per-edge mask must broadcast to the edge's ``(..., n, m)``."""
    if mask is None:
        return
    shape, n, m = mask_shape(mask), terms.num_children, terms.num_parents
    if len(shape) < 2 or shape[-2:] != (n, m):
        raise ValueError(f"{who}: mask of shape {shape}, expected (..., {n}, {m})")


def _launch_grids(terms: Terms, mask: ConcreteMask | None, lay: Layout, shift):
    """`_block_grids` of a launch whose programs walk block lists: an edge with a per-edge
    mask and no traced ``shift`` (whose band is traced); else ``None``."""
    return _block_grids(terms, mask, lay) if terms.pair_ok and shift is None else None


def _mask_operands(terms: Terms, prob: Problem, lay: Layout, arrays: dict, specs: dict,
                   grids, *, by_parent: bool = False) -> None:
    """Add a launch's per-edge mask operands, if the edge has one: its block lists
    (``"blocks"``, `block_table` of ``grids``; none without them) and, when some block
    needs it, the mask itself (``"pmask"``, int8, one copy per distinct mask of the
    batch)."""
    from jax.experimental import pallas as pl

    if not terms.pair_ok:
        return
    if grids is not None:
        table = block_table(grids, by_parent)
        arrays["blocks"] = jnp.asarray(table)
        specs["blocks"] = pl.BlockSpec((None, table.shape[1]), lambda i, b: (i, 0))
    if grids is None or grids[2]:
        rows, row_of = lay.distinct(prob.const.pair_ok, 2)
        arrays["pmask"] = lay.pad(rows.astype(jnp.int8), lay.n_pad, lay.m_pad)
        specs["pmask"] = pl.BlockSpec((None, lay.n_pad, lay.m_pad),
                                      lambda i, b: (row_of(b), 0, 0))


def _wide_rows(prob: Problem) -> bool:
    """Whether a query / key / value row takes more than 256 bytes (float32 with head dim
    over 64, bfloat16 over 128): smaller blocks and fewer pipeline stages then keep a
    program's tiles within a GPU's shared memory."""
    return any(_pow2(x.shape[-1]) * jnp.dtype(x.dtype).itemsize > 256
               for x in (prob.row.q, prob.col.k, prob.v))


def _compiler_params(fp: int, num_warps: int | None, num_stages: int):
    return _triton().CompilerParams(num_warps=num_warps or (4 if fp <= 64 else 8),
                                num_stages=num_stages)


def _shift(starts) -> jax.Array | None:
    """``i_start - j_start`` as an int32 scalar (``None`` without ``starts``)."""
    if starts is None:
        return None
    i_start, j_start = (jnp.asarray(x, jnp.int32) for x in starts)
    return i_start - j_start


def _interpret(interpret: bool | None) -> bool:
    # the real backend, not platform(): tests fake that one
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def pallas_forward(terms: Terms, prob: Problem, batch_shape: tuple[int, ...], *,
                   block_q: int | None = None, block_k: int | None = None,
                   interpret: bool | None = None, precision: lax.PrecisionLike = None,
                   num_warps: int | None = None, num_stages: int | None = None,
                   starts: tuple | None = None, tiles: bool | None = None,
                   mask: ConcreteMask | None = None, nan_rows: bool = False,
                   stats: bool = False) -> tuple[jax.Array, jax.Array | RowStats]:
    r"""Forward pass of the Pallas flash-attention kernel: $y$ and $L$ of one edge site.

    The grid runs one program per (child block, batch element); each loops over the parent
    blocks its distance band allows, computing the block logits (dot product, per-parent
    bias, relative-position bias, geometric log-prior, band and padding masks — no mask
    in a block whose every edge is allowed) and the online softmax in float32: the
    matmuls multiply in the inputs' dtype and accumulate in float32, the prior's terms
    are added in float32. Feature and value dims are zero-padded to a power of two (at
    least 16), lengths to the block sizes.

    A per-edge mask (``prob.const.pair_ok``: block-sparse, graph and other `Restricted`
    priors) is read per tile. Given its value at trace time (``mask``), each program
    visits only the parent blocks with an allowed edge, as FlexAttention's block masks do,
    and reads the mask only in blocks where some edge is not allowed; a block-sparse
    pattern aligned with the blocks never reads it.

    Args:
        terms: the static terms of a lowered edge site with `pallas_unsupported` `None`.
        prob: the arrays those terms read.
        batch_shape: the broadcast batch shape (heads, batch) of the result.
        block_q: children per block (rounded up to a power of two, at least 16, at most
            that of ``n``; default 128, or 64 for rows of more than 256 bytes, e.g.
            float32 with head dim 128, to stay within a GPU's shared memory).
        block_k: parents per block (rounded up to a power of two, at least 16, at most
            that of ``m``; default 64). With a `BlockMask` ``mask``, either default is
            lowered to divide the mask's block size when a power of two of at least
            `FIT_MIN` (32) does, so that no block straddles two of the mask's and none
            reads the mask.
        interpret: run in Pallas' interpreter (default: when JAX's backend is not a GPU).
        precision: the matmuls' ``precision`` (``None``: JAX's default, which follows
            ``jax.default_matmul_precision``; for float32 inputs on a GPU that default is
            TF32, ``"highest"`` is full float32).
        num_warps: Triton warps per program (default: 4 for head dims up to 64, else 8).
        num_stages: Triton software-pipelining stages of the parent-block loop (default
            3, or 2 for rows of more than 256 bytes).
        starts: optional ``(i_start, j_start)`` (int scalars, may be traced): the global
            indices of the first child and parent of these arrays, when they are a shard
            of a longer sequence (ring attention's steps): distances are
            $d_{ij} = (i_{\text{start}} + i) + \text{offset} - (j_{\text{start}} + j)$,
            and the parent blocks outside the distance band are still skipped (the live
            range is computed from the traced offset in each program).
        tiles: ``True`` reads a relative-position table as `relpos_tiles` (ignored with
            ``starts``); the default, ``None`` or ``False``, looks each entry up (on an
            H100 the forward ran 3-10 % slower with tiles, the backward 1.1-1.7x faster).
            The logits are the same either way.
        mask: the per-edge mask's value when known at trace time, a NumPy boolean
            ``(..., n, m)`` array or a [`BlockMask`][structinfer.lowering.BlockMask]
            (ignored with ``starts`` and without a per-edge mask).
            Its contract: OR-ed over its batch dims it allows every edge the site allows
            in any batch element (blocks it forbids are skipped), and AND-ed over them it
            allows only edges ``prob.const.pair_ok`` allows in every batch element (blocks
            it allows whole are computed without the mask). `Lowered.mask` keeps it, also
            for a shard of the batch.
        nan_rows: write NaN in the rows whose $L$ is not finite, in the kernel (the
            engine's convention, with no pass of its own over $y$); default $y = 0$ there,
            which ring attention's steps merge.
        stats: return the rows' `RowStats` ($m$ and $\log l$, $L = m + \log l$) in place
            of $L$: what `pallas_backward` reads (exact where the logits are so large that
            float32 rounds $\log l$ out of $L$).

    Returns:
        `(y, L)`: `batch + (n, dv)` in the value dtype and `batch + (n,)` in float32
        (float64 for float64 inputs); with ``stats``, `(y, RowStats)`. A row with no
        allowed parent has $y = 0$ (NaN with ``nan_rows``) and $L = -\infty$
        ($\log l = -\infty$).

    Raises:
        ValueError: `pallas_unsupported` names a reason the kernel cannot run the edge.

    Cost: $O(\text{live blocks}\cdot b_q b_k (d + d_v))$ time, $O(n d)$ memory.
    """
    from jax.experimental import pallas as pl

    why = pallas_unsupported(terms, prob, batch_shape)
    if why:
        raise ValueError(f"pallas_forward: {why}")
    _check_mask(mask, terms, "pallas_forward")
    wide = _wide_rows(prob)
    block_q = block_q or _fit_blocks(64 if wide else 128, mask, 0)
    block_k = block_k or _fit_blocks(64, mask, 1)
    num_stages = num_stages or (2 if wide else 3)
    lay = Layout(terms, prob, batch_shape, block_q, block_k)
    shift = _shift(starts)
    arrays, specs = lay.operands(terms, prob, whole_rows=False, shift=shift,
                                 tiles=bool(tiles) and _use_tiles(terms, prob, lay, shift, tiles))
    _mask_operands(terms, prob, lay, arrays, specs, _launch_grids(terms, mask, lay, shift))
    keys = tuple(arrays)
    kernel = functools.partial(_pallas_kernel, terms=terms, bq=lay.bq, bk=lay.bk, nkb=lay.nkb,
                               keys=keys, acc_dtype=lay.acc, precision=precision,
                               nan_rows=bool(nan_rows))
    v = prob.v
    out, m, log_l = pl.pallas_call(
        kernel,
        grid=(lay.nqb, lay.B),
        in_specs=[specs[x] for x in keys],
        out_specs=[pl.BlockSpec((None, lay.bq, lay.dvp), lambda i, b: (b, i, 0))]
        + [pl.BlockSpec((None, lay.bq), lambda i, b: (b, i))] * 2,
        out_shape=[jax.ShapeDtypeStruct((lay.B, lay.n_pad, lay.dvp), v.dtype)]
        + [jax.ShapeDtypeStruct((lay.B, lay.n_pad), lay.acc)] * 2,
        compiler_params=_compiler_params(lay.fp, num_warps, num_stages),
        interpret=_interpret(interpret),
        name="structinfer_attention",
    )(*[arrays[x] for x in keys])
    n = terms.num_children
    y = out[:, :n, : v.shape[-1]].reshape(lay.batch + (n, v.shape[-1]))
    rows = RowStats(*(x[:, :n].reshape(lay.batch + (n,)) for x in (m, log_l)))
    return y, (rows if stats else rows.lse())


# --- Pallas backward ---------------------------------------------------------------------


def _child_rows(terms: Terms, named: dict, idx, acc_dtype):
    """A child block's operands of the backward passes (``idx``: its slice, or ``...``
    for a program's own block): q, dy, the rows' `RowStats`, delta and the geometric
    prior's two terms."""
    g0 = g1 = None
    if terms.geometric:
        g0 = named["geo0"][idx].astype(acc_dtype)
        g1 = named["geo1"][idx].astype(acc_dtype)
    rows = idx if idx is Ellipsis else (idx, slice(None))
    stats = RowStats(named["row_m"][idx], named["row_log_l"][idx])
    return named["q"][rows], named["do"][rows], stats, named["delta"][idx], g0, g1


def _ds_tile(terms: Terms, named: dict, q, k, v, do, stats, delta, i0, j0, g0, g1, acc_dtype,
             precision, off, masked: bool = True, unscaled: bool = False):
    r"""One tile of the backward: $p_{ij}$, $\mathrm{d}s_{ij} = p_{ij}(\mathrm{d}y_i^\top
    V_j - \delta_i)$, the allowed-edge mask and the distance grid (and with ``unscaled``
    the products $q k^\top$ before a traced scale, as `_tile`'s)."""
    s, ok, d, *qk = _tile(terms, named, q, k, i0, j0, g0, g1, acc_dtype, precision, off,
                          masked, unscaled)
    p = backward_probs(s, stats.m[:, None], stats.log_l[:, None]).astype(acc_dtype)
    dp = _dot(do, v, precision, acc_dtype, trans_b=True)
    return (p, p * (dp - delta[:, None]), ok, d, *qk)


def _dkdv_kernel(*refs, terms: Terms, bq: int, bk: int, nqb: int, keys: tuple[str, ...],
                 acc_dtype, precision, col_grad: bool):
    """dK, dV (and the per-parent bias' gradient) of one parent block: a loop over the
    child blocks that see it, recomputing $p$ from $L$ (FlashAttention-2's first pass)."""
    from jax.experimental import pallas as pl

    named = dict(zip(keys, refs[: len(keys)]))
    outs = refs[len(keys):]
    dk_ref, dv_ref = outs[0], outs[1]
    t = pl.program_id(0)
    k = named["k"][_pl_ds(t * bk, bk), :]
    v = named["v"][_pl_ds(t * bk, bk), :]
    off = _offset(terms, named)
    lo, hi = live_children(terms, t, bq, bk, nqb, off)

    def body(a, tile_masked, carry):
        dk, dv, db = carry
        i0 = a * bq
        q, do, stats, delta, g0, g1 = _child_rows(terms, named, _pl_ds(i0, bq), acc_dtype)
        p, ds, _, _ = _ds_tile(terms, named, q, k, v, do, stats, delta, i0, t * bk, g0, g1,
                               acc_dtype, precision, off, tile_masked)
        dv = dv + _dot(p.astype(do.dtype), do, precision, acc_dtype, trans_a=True)
        dk = dk + _dot(ds.astype(q.dtype), q, precision, acc_dtype, trans_a=True)
        if col_grad:
            db = db + jnp.sum(ds, axis=0)
        return dk, dv, db

    init = (jnp.zeros((bk, k.shape[-1]), acc_dtype), jnp.zeros((bk, v.shape[-1]), acc_dtype),
            jnp.zeros((bk,), acc_dtype))
    full = None if terms.pair_ok else full_children(terms, t, bq, bk, nqb, off)
    dk, dv, db = _over_blocks(named, lo, hi, full, body, init)
    if terms.dot_scale is not None:
        dk = dk * terms.dot_scale
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    if col_grad:
        outs[2][...] = db


def _dq_kernel(*refs, terms: Terms, bq: int, bk: int, nkb: int, keys: tuple[str, ...],
               acc_dtype, precision):
    """dQ and the geometric prior's gradients of one child block: a loop over its live
    parent blocks (FlashAttention-2's second pass)."""
    from jax.experimental import pallas as pl

    named = dict(zip(keys, refs[: len(keys)]))
    outs = refs[len(keys):]
    a = pl.program_id(0)
    q, do, stats, delta, g0, g1 = _child_rows(terms, named, ..., acc_dtype)
    off = _offset(terms, named)
    lo, hi = live_range(terms, a, bq, bk, nkb, off)

    scaled = "scale" in named  # a traced scale: its gradient's row sums too

    def body(t, tile_masked, carry):
        dq, dg0, dg1, sums = carry
        j0 = t * bk
        k = named["k"][_pl_ds(j0, bk), :]
        v = named["v"][_pl_ds(j0, bk), :]
        p, ds, _, d, *qk = _ds_tile(terms, named, q, k, v, do, stats, delta, a * bq, j0, g0,
                                    g1, acc_dtype, precision, off, tile_masked, scaled)
        dq = dq + _dot(ds.astype(k.dtype), k, precision, acc_dtype)
        if terms.geometric:
            dg0 = dg0 + jnp.sum(ds, axis=-1)
            dg1 = dg1 + jnp.sum(ds * (d - terms.geo_d0).astype(acc_dtype), axis=-1)
        if scaled:
            sums = tuple(x + y for x, y in zip(sums, scale_row_sums(p, ds, qk[0], -1)))
        return dq, dg0, dg1, sums

    zero = jnp.zeros((bq,), acc_dtype)
    init = (jnp.zeros((bq, q.shape[-1]), acc_dtype), zero, zero,
            (zero, zero, zero) if scaled else ())
    full = None if terms.pair_ok else full_parents(terms, a, bq, bk, off)
    dq, dg0, dg1, sums = _over_blocks(named, lo, hi, full, body, init)
    if terms.dot_scale is not None:
        dq = dq * terms.dot_scale
    outs[0][...] = dq.astype(outs[0].dtype)
    if terms.geometric:
        outs[1][...] = dg0
        outs[2][...] = dg1
    if scaled:  # r - e c and c (`scale_grad`), the row's sums complete here
        r, e, c = sums
        outs[-2][...] = r - e * c
        outs[-1][...] = c


def _diagonals(terms: Terms, b: int, nqb: int, nkb: int) -> tuple[int, int]:
    r"""The live block diagonals of square blocks of size ``b``: the offsets
    $\Delta$ (parent block $a + \Delta$ of child block $a$) whose tiles hold an allowed
    distance, as an inclusive range (empty when first > last). A tile's distances
    $i + \text{offset} - j$ lie in $\text{offset} - \Delta b \pm (b - 1)$: they depend on
    $\Delta$ alone."""
    first, last = -(nqb - 1), nkb - 1
    if terms.dmax is not None:  # the tile's least distance is at most dmax
        first = max(first, -((terms.dmax + b - 1 - terms.offset) // b))
    if terms.dmin is not None:  # the tile's greatest distance >= dmin
        last = min(last, (terms.offset + b - 1 - terms.dmin) // b)
    return first, last


def _drelpos_kernel(*refs, terms: Terms, b: int, nqb: int, nkb: int, first: int,
                    keys: tuple[str, ...], acc_dtype, precision, interpret: bool):
    r"""The relative-position table's gradient from one block diagonal: $\partial/\partial
    b_r = \sum_{ij:\,r(d_{ij}) = r} \mathrm{d}s_{ij}$. The tiles (child block $a$, parent
    block $a + \Delta$) of square blocks share one distance grid, so their
    $\mathrm{d}s$ tiles are summed in registers and added into the table once per program,
    with atomics (contention once per diagonal, not once per tile)."""
    from jax.experimental import pallas as pl

    named = dict(zip(keys, refs[: len(keys)]))
    table = refs[-1]
    diag = jnp.int32(first) + pl.program_id(0)  # int32 under x64 too
    off = _offset(terms, named)
    lo = jnp.maximum(jnp.int32(0), -diag)
    hi = jnp.maximum(jnp.minimum(jnp.int32(nqb), jnp.int32(nkb) - diag), lo)

    def body(a, acc):
        i0, j0 = a * b, (a + diag) * b
        q, do, stats, delta, g0, g1 = _child_rows(terms, named, _pl_ds(i0, b), acc_dtype)
        k = named["k"][_pl_ds(j0, b), :]
        v = named["v"][_pl_ds(j0, b), :]
        _, ds, ok, _ = _ds_tile(terms, named, q, k, v, do, stats, delta, i0, j0, g0, g1,
                                acc_dtype, precision, off)
        return acc + jnp.where(ok, ds, 0.0)

    acc = lax.fori_loop(lo, hi, body, jnp.zeros((b, b), acc_dtype))
    r = jnp.arange(b, dtype=jnp.int32)
    d = off - diag * b + r[:, None] - r[None, :]
    idx = relpos_index(terms.relpos, d)
    if interpret:  # the interpreter's atomics drop repeated indices: a scatter-add
        table[...] = table[...] + jnp.zeros(table.shape, acc_dtype).at[idx].add(acc)
    else:
        _triton().atomic_add(table, (idx,), acc)


def _dq_pass(terms: Terms, prob: Problem, lay: Layout, shared: Callable, shift, tiles,
             grids, params, interp: bool, precision
             ) -> tuple[jax.Array, jax.Array | None, tuple | None]:
    """`pallas_backward`'s own dQ pass (child blocks: dQ and the geometric prior's
    gradients), as its ``dq_pass`` returns them, and with a traced scale the rows'
    ``(r - e c, c)`` of `scale_grad` (else ``None``)."""
    from jax.experimental import pallas as pl

    bq, bk, fp, dvp, acc = lay.bq, lay.bk, lay.fp, lay.dvp, lay.acc
    arrays, specs = lay.operands(terms, prob, whole_rows=False, shift=shift,
                                 tiles=_use_tiles(terms, prob, lay, shift, tiles))
    arrays.update(shared(lay))
    specs["do"] = pl.BlockSpec((None, bq, dvp), lambda i, b: (b, i, 0))
    specs["row_m"] = specs["row_log_l"] = specs["delta"] = pl.BlockSpec(
        (None, bq), lambda i, b: (b, i))
    _mask_operands(terms, prob, lay, arrays, specs, grids)
    keys = tuple(arrays)
    out_specs = [pl.BlockSpec((None, bq, fp), lambda i, b: (b, i, 0))]
    out_shape = [jax.ShapeDtypeStruct((lay.B, lay.n_pad, fp), acc)]
    scaled = prob.glob.dot_scale is not None
    if terms.geometric:
        out_specs += [pl.BlockSpec((None, bq), lambda i, b: (b, i))] * 2
        out_shape += [jax.ShapeDtypeStruct((lay.B, lay.n_pad), acc)] * 2
    if scaled:
        out_specs += [pl.BlockSpec((None, bq), lambda i, b: (b, i))] * 2
        out_shape += [jax.ShapeDtypeStruct((lay.B, lay.n_pad), acc)] * 2
    res = pl.pallas_call(
        functools.partial(_dq_kernel, terms=terms, bq=bq, bk=bk, nkb=lay.nkb, keys=keys,
                          acc_dtype=acc, precision=precision),
        grid=(lay.nqb, lay.B), in_specs=[specs[x] for x in keys], out_specs=out_specs,
        out_shape=out_shape, compiler_params=params, interpret=interp,
        name="structinfer_attention_dq",
    )(*[arrays[x] for x in keys])
    n = terms.num_children
    dq = lay.unpad(res[0], n, prob.row.q.shape[-1])
    dgeo = None
    if terms.geometric:
        dgeo = jnp.stack([lay.unpad(res[1], n), lay.unpad(res[2], n)], -1)
    sums = (lay.unpad(res[-2], n), lay.unpad(res[-1], n)) if scaled else None
    return dq, dgeo, sums


def pallas_backward(terms: Terms, prob: Problem, batch_shape: tuple[int, ...], out: jax.Array,
                    stats: RowStats, d_out: jax.Array, d_lse: jax.Array, *,
                    block_q: int | None = None, block_k: int | None = None,
                    interpret: bool | None = None,
                    precision: lax.PrecisionLike = None, num_warps: int | None = 4,
                    num_stages: int = 2, need_glob: frozenset[str] | None = None,
                    starts: tuple | None = None, tiles: bool | None = None,
                    mask: ConcreteMask | None = None, dq_pass: Callable | None = None,
                    dkdv_pass: Callable | None = None
                    ) -> tuple[dict, dict, dict, dict, jax.Array]:
    r"""Backward pass of the Pallas flash-attention kernel: the gradients of one edge site.

    FlashAttention-2's schedule on the forward's $y$ and row statistics alone (the
    largest logit $m_i$ and $\log l_i$, `RowStats`): with
    $\delta_i = \sum_c \mathrm{d}y_{ic}\, y_{ic} - \mathrm{d}L_i$ and, recomputed per tile,
    $p_{ij} = e^{(\ell_{ij} - m_i) - \log l_i}$,
    $\mathrm{d}s_{ij} = p_{ij}(\mathrm{d}y_i^\top V_j - \delta_i)$, one pass over parent
    blocks gives $\mathrm{d}V_j = \sum_i p_{ij}\,\mathrm{d}y_i$, $\mathrm{d}K_j = \sum_i
    \mathrm{d}s_{ij}\, q_i$ and the per-parent bias' gradient $\sum_i \mathrm{d}s_{ij}$;
    one pass over child blocks gives $\mathrm{d}Q_i = \sum_j \mathrm{d}s_{ij} K_j$ and the
    geometric prior's $\sum_j \mathrm{d}s_{ij}$ and $\sum_j \mathrm{d}s_{ij}(d_{ij} - d_0)$;
    a third pass (its own launch, run only when the table is differentiated,
    ``need_glob``, and a ``dkdv_pass`` hook did not sum it) gives the relative-position
    table's $\sum_{ij:\,r(d_{ij}) = r} \mathrm{d}s_{ij}$, one
    program per block diagonal of square blocks: the diagonal's tiles share one distance
    grid, so their $\mathrm{d}s$ tiles are summed first and added into the table once
    (float32 atomics: the table's gradient is not bit-reproducible from run to run).
    Every pass skips the blocks outside the distance band, and the dK/dV and dQ passes
    the blocks a concrete per-edge ``mask`` forbids (as `pallas_forward`); memory is
    $O(n d)$ (plus the per-edge mask, as int8, when some block reads it). Second
    derivatives are not supported (use the ``"dense"`` backend for them).

    Args:
        terms: the static terms of a lowered edge site (as for `pallas_forward`).
        prob: the arrays those terms read.
        batch_shape: the broadcast batch shape (heads, batch) of the result.
        out: the forward's output $y$.
        stats: the forward's row statistics $m$ and $\log l$ (`RowStats`: the second
            result of `pallas_forward` with ``stats=True``). Its $L$ alone is refused: $p =
            e^{\ell - L}$ is wrong in rows whose logits are so large that float32 rounds
            $\log l$ out of $L$.
        d_out: the cotangent of $y$.
        d_lse: the cotangent of $L$.
        block_q: children per block in both passes (rounded up to a power of two, at
            least 16; default 64, or 32 for rows of more than 256 bytes; fitted to a
            `BlockMask` ``mask`` as in `pallas_forward`).
        block_k: parents per block (the same rule).
        interpret: run in Pallas' interpreter (default: when JAX's backend is not a GPU).
        precision: the matmuls' ``precision`` (as for `pallas_forward`).
        num_warps: Triton warps per program of every pass (default, and for ``None``, 4:
            on an H100, at head dim 128 in bfloat16, 1.5-2x faster than 8 with these
            blocks).
        num_stages: Triton software-pipelining stages of both passes.
        need_glob: the `Globals` fields whose gradients are wanted (default: all); the
            relative-position table's pass runs only when it is among them.
        starts: optional ``(i_start, j_start)`` global indices of the first child and
            parent (may be traced), as for `pallas_forward`; with them the table's pass
            visits every block diagonal (which ones hold an allowed distance is known
            only when the offset is).
        tiles: read a relative-position table as `relpos_tiles` in every pass (default,
            ``None``: when there are no ``starts`` and they stay within
            `RELPOS_TILES_MAX_BYTES`; on an H100, bfloat16, head dims 64 and 128, n = 4096
            and 16384, the passes ran 1.1-1.7x faster than with the lookup per element;
            ``True`` forces them, except with ``starts``; ``False``: the lookup).
        mask: the per-edge mask's value at trace time, as for `pallas_forward`.
        dq_pass: another kernel's dQ pass in place of this one's:
            ``dq_pass(terms, prob, batch_shape, d_out, stats, delta, mask) -> (dq,
            dgeo)`` (``stats``: the forward's `RowStats`),
            ``batch + (n, d)`` and (a geometric prior) ``batch + (n, 2)`` or ``None``
            (`structinfer.lowering.mosaic.mosaic_dq`).
        dkdv_pass: another kernel's dK/dV pass in place of this one's, called the same
            way plus ``table_grad=`` (whether the relative-position table's gradient is
            wanted), returning ``(dk, dv, dbias, dtable)``: ``batch + (m, d)``,
            ``batch + (m, dv)``, (a per-parent bias) ``batch + (m,)`` or ``None``, and
            the table's gradient shaped like it, or ``None`` when that pass did not sum
            it (then this kernel's third pass does)
            (`structinfer.lowering.mosaic.mosaic_dkdv`).

    Returns:
        ``(d_row, d_col, d_pair, d_glob, d_v)``: cotangents shaped and typed like the
        problem's ``row``, ``col``, ``pair`` and ``glob`` groups and its value table.

    Raises:
        TypeError: ``stats`` is not the forward's `RowStats` (e.g. an array of $L$).
        ValueError: the kernel cannot run the edge, or ``mask`` does not fit it.

    Reference: Dao, "FlashAttention-2" (2023), Algorithm 2.
    """
    from jax.experimental import pallas as pl

    stats = require_row_stats(stats, "pallas_backward")
    why = pallas_unsupported(terms, prob, batch_shape)
    if why:
        raise ValueError(f"pallas_backward: {why}")
    _check_mask(mask, terms, "pallas_backward")
    scale = prob.glob.dot_scale  # a traced scale: dq and dk come unscaled from the passes
    if scale is not None and (dq_pass is not None or dkdv_pass is not None):
        raise ValueError("pallas_backward: another kernel's pass cannot take a traced dot "
                         "scale (glob.dot_scale)")
    block = 32 if _wide_rows(prob) else 64
    lay = Layout(terms, prob, batch_shape, block_q or _fit_blocks(block, mask, 0),
                  block_k or _fit_blocks(block, mask, 1))
    acc, m, B = lay.acc, terms.num_parents, lay.B
    bq, bk, m_pad, fp, dvp = lay.bq, lay.bk, lay.m_pad, lay.fp, lay.dvp
    delta = backward_delta(out, d_out, stats.lse(), d_lse, acc)
    v_dt = prob.v.dtype
    shift = _shift(starts)

    def shared(lay):  # the cotangent's rows, padded to a launch's blocks
        return {"do": lay.pad(lay.flat(d_out.astype(v_dt), 2), lay.n_pad, lay.dvp),
                # padded rows have no edge (log l = -inf): p = 0 there
                "row_m": lay.pad(lay.flat(stats.m.astype(acc), 1), lay.n_pad),
                "row_log_l": lay.pad(lay.flat(stats.log_l.astype(acc), 1), lay.n_pad,
                                     value=-jnp.inf),
                "delta": lay.pad(lay.flat(delta, 1), lay.n_pad)}

    def whole_rows(lay):  # operands of a pass that loops over child blocks
        arrays, specs = lay.operands(terms, prob, whole_rows=True, shift=shift,
                                     tiles=_use_tiles(terms, prob, lay, shift, tiles))
        arrays.update(shared(lay))
        specs["do"] = pl.BlockSpec((None, lay.n_pad, lay.dvp), lambda i, b: (b, 0, 0))
        specs["row_m"] = specs["row_log_l"] = specs["delta"] = pl.BlockSpec(
            (None, lay.n_pad), lambda i, b: (b, 0))
        return arrays, specs

    params = _compiler_params(fp, num_warps or 4, num_stages)
    interp = _interpret(interpret)

    # pass 1: parent blocks (dK, dV, per-parent bias)
    grids = (None if dq_pass is not None and dkdv_pass is not None  # both passes' blocks
             else _launch_grids(terms, mask, lay, shift))
    want_table = terms.relpos is not None and (need_glob is None or "relpos" in need_glob)
    d_table = None
    if dkdv_pass is not None:
        dk, dv, db, d_table = dkdv_pass(terms, prob, batch_shape, d_out, stats, delta, mask,
                                        table_grad=want_table)
    else:
        arrays, specs = whole_rows(lay)
        _mask_operands(terms, prob, lay, arrays, specs, grids, by_parent=True)
        keys = tuple(arrays)
        col_grad = bool(terms.col_bias)
        out_specs = [pl.BlockSpec((None, bk, fp), lambda i, b: (b, i, 0)),
                     pl.BlockSpec((None, bk, dvp), lambda i, b: (b, i, 0))]
        out_shape = [jax.ShapeDtypeStruct((B, m_pad, fp), acc),
                     jax.ShapeDtypeStruct((B, m_pad, dvp), acc)]
        if col_grad:
            out_specs.append(pl.BlockSpec((None, bk), lambda i, b: (b, i)))
            out_shape.append(jax.ShapeDtypeStruct((B, m_pad), acc))
        res1 = pl.pallas_call(
            functools.partial(_dkdv_kernel, terms=terms, bq=bq, bk=bk, nqb=lay.nqb, keys=keys,
                              acc_dtype=acc, precision=precision, col_grad=col_grad),
            grid=(lay.nkb, B), in_specs=[specs[x] for x in keys], out_specs=out_specs,
            out_shape=out_shape, compiler_params=params, interpret=interp,
            name="structinfer_attention_dkdv",
        )(*[arrays[x] for x in keys])
        dk = lay.unpad(res1[0], m, prob.col.k.shape[-1])
        dv = lay.unpad(res1[1], m, prob.v.shape[-1])
        db = lay.unpad(res1[2], m) if col_grad else None

    # pass 2: child blocks (dQ, geometric prior)
    sums = None
    if dq_pass is not None:
        dq, dgeo = dq_pass(terms, prob, batch_shape, d_out, stats, delta, mask)
    else:
        dq, dgeo, sums = _dq_pass(terms, prob, lay, shared, shift, tiles, grids, params,
                                  interp, precision)

    def zeros(d):  # a cotangent for every array of the problem (the kernels fill theirs)
        return jax.tree.map(jnp.zeros_like, d)

    d_row, d_col, d_pair, d_glob = (zeros(prob.row), zeros(prob.col), zeros(prob.pair),
                                    zeros(prob.glob))
    if scale is not None:  # d(s q.k): s times the unscaled products; d/ds from the dQ
        # pass's row sums (`scale_grad`)
        if need_glob is None or "dot_scale" in need_glob:
            d_s = scale_grad(sums[0], 0.0, sums[1], d_lse, stats.lse())
            d_glob = dataclasses.replace(d_glob, dot_scale=jnp.reshape(d_s, scale.shape)
                                         .astype(scale.dtype))
        dq, dk = (x * scale[0].astype(acc) for x in (dq, dk))
    d_row = dataclasses.replace(d_row, q=sum_to(dq, prob.row.q.shape).astype(prob.row.q.dtype))
    if terms.geometric:
        d_row = dataclasses.replace(
            d_row, geo=sum_to(dgeo, prob.row.geo.shape).astype(prob.row.geo.dtype))

    d_col = dataclasses.replace(d_col, k=sum_to(dk, prob.col.k.shape).astype(prob.col.k.dtype))
    if terms.col_bias:
        bias = prob.col.bias
        d_col = dataclasses.replace(d_col, bias=sum_to(db[..., None], bias.shape).astype(
            bias.dtype))
    d_v = sum_to(dv, prob.v.shape).astype(prob.v.dtype)

    # pass 3: the relative-position table, one program per live block diagonal of square
    # blocks (its own launch, only when the table is differentiated and the dK/dV pass
    # did not sum its gradient)
    if want_table and d_table is not None:
        d_glob = dataclasses.replace(d_glob, relpos=d_table.astype(prob.glob.relpos.dtype))
    elif want_table:
        rel = prob.glob.relpos
        rlay = Layout(terms, prob, batch_shape, min(bq, bk), min(bq, bk))
        first, last = ((-(rlay.nqb - 1), rlay.nkb - 1) if shift is not None
                       else _diagonals(terms, rlay.bq, rlay.nqb, rlay.nkb))
        drel = jnp.zeros((B, rel.shape[-1]), acc)
        if last >= first:
            arrays, specs = whole_rows(rlay)
            _mask_operands(terms, prob, rlay, arrays, specs, None)  # every tile masked
            keys = tuple(arrays)
            spec = pl.BlockSpec((None, drel.shape[-1]), lambda i, b: (b, 0))
            drel = pl.pallas_call(
                functools.partial(_drelpos_kernel, terms=terms, b=rlay.bq, nqb=rlay.nqb,
                                  nkb=rlay.nkb, first=first, keys=keys, acc_dtype=acc,
                                  precision=precision, interpret=interp),
                grid=(last - first + 1, B), in_specs=[specs[x] for x in keys] + [spec],
                out_specs=spec, out_shape=jax.ShapeDtypeStruct(drel.shape, acc),
                input_output_aliases={len(keys): 0},  # accumulated from zeros
                compiler_params=params, interpret=interp, name="structinfer_attention_drelpos",
            )(*[arrays[x] for x in keys], drel)
        d_glob = dataclasses.replace(d_glob, relpos=sum_to(
            drel.reshape(lay.batch + drel.shape[-1:]), rel.shape).astype(rel.dtype))
    return d_row, d_col, d_pair, d_glob, d_v
