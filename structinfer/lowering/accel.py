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
  128 (what cuDNN accepts on every GPU it supports).
* A **Pallas** (Triton) flash-attention kernel, `pallas_forward`, for the rest of
  the dot-product family in any floating dtype: it computes on each block the same logits
  the blocked kernel does — dot product, per-parent bias, relative-position bias looked up
  from the distance grid $d_{ij} = i + \text{offset} - j$, geometric log-prior
  $\log q_i + (d_{ij} - d_0)\log(1 - q_i)$ — and skips the blocks outside the distance
  band (causal, windows, truncation), multiplying in the inputs' dtype and accumulating
  in float32 (the prior's terms are added in float32). Its gradient is the
  blocked kernel's backward (`blocked_attention(..., forward=pallas_forward)`), which
  needs only the output $y$ and the row log-partition $L$.
* Everything else (IDW scores, per-edge tables, masks given as arrays, multi-device runs)
  keeps the blocked kernel, which runs on every platform.

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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._spec import Problem, Terms, accum_dtype, band_ok, relpos_index, relpos_weights

__all__ = [
    "GPU_KERNELS",
    "CUDNN_BIAS_MAX",
    "platform",
    "cudnn_unsupported",
    "pallas_unsupported",
    "gpu_kernel",
    "cudnn_attention",
    "pallas_forward",
]

#: the fused kernels tried on a GPU, in order
GPU_KERNELS = ("cudnn", "pallas")

#: largest additive-bias table (entries, all heads) handed to cuDNN
CUDNN_BIAS_MAX = 2**26


def platform() -> str:
    """The platform the kernels are built for: `jax.default_backend()` (`"cpu"`,
    `"gpu"`, `"tpu"`). Tests replace this function to exercise the GPU dispatch on a
    CPU."""
    return jax.default_backend()


def _prod(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def _additive(t: Terms) -> bool:
    return bool(t.col_bias or t.relpos is not None or t.geometric)


def _dot_only(t: Terms, prob: Problem) -> str | None:
    """Reason the edge is outside the dot-product family (or None)."""
    if t.idw:
        return "an IDW score (pairwise distances per block)"
    if t.pair_logits or t.pair_ok:
        return "a per-edge table or mask (sliced per block)"
    if not t.dot:
        return "the score has no dot-product term"
    return None


def cudnn_unsupported(terms: Terms, prob: Problem, batch_shape: tuple[int, ...]) -> str | None:
    """Why cuDNN's fused attention cannot run this edge, or `None` when it can.

    Checked statically (shapes, dtypes, the structure in `terms`); cuDNN's own version
    and compute-capability checks run when the call is traced, and a failure there falls
    back to the next kernel.
    """
    why = _dot_only(terms, prob)
    if why:
        return why
    if terms.col_ok:
        return "a per-parent mask"
    q, k, v = prob.row["q"], prob.col["k"], prob.v
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


def pallas_unsupported(terms: Terms, prob: Problem, batch_shape: tuple[int, ...]) -> str | None:
    """Why the Pallas kernel cannot run this edge, or `None` when it can."""
    return _dot_only(terms, prob)


def gpu_kernel(terms: Terms, prob: Problem, batch_shape: tuple[int, ...]
               ) -> tuple[str | None, tuple[str, ...]]:
    """The fused kernel for this edge on a GPU (`"cudnn"`, `"pallas"` or `None`) and
    notes saying why the ones before it were not taken."""
    notes = []
    why = cudnn_unsupported(terms, prob, batch_shape)
    if why is None:
        return "cudnn", ()
    notes.append(f"not cuDNN: {why}")
    why = pallas_unsupported(terms, prob, batch_shape)
    if why is None:
        return "pallas", tuple(notes)
    notes.append(f"not Pallas: {why}")
    return None, tuple(notes)


# --- cuDNN ----------------------------------------------------------------------------


def _bias_table(terms: Terms, prob: Problem, dtype) -> jax.Array:
    """The additive part $b_{ij}$ of the logits as a `(..., n, m)` table."""
    n, m = terms.num_children, terms.num_parents
    d = jnp.arange(n)[:, None] + terms.offset - jnp.arange(m)[None, :]
    b = jnp.zeros((n, m), jnp.float32)
    if terms.col_bias:
        b = b + prob.col["bias"][..., 0][..., None, :]
    if terms.relpos is not None:
        b = b + relpos_weights(terms.relpos, prob.glob["relpos"], d)
    if terms.geometric:
        g = prob.row["geo"].astype(jnp.float32)
        b = b + g[..., 0:1] + (d - terms.geo_d0).astype(jnp.float32) * g[..., 1:2]
    return b.astype(dtype)


def cudnn_attention(terms: Terms, prob: Problem, batch_shape: tuple[int, ...]
                    ) -> tuple[jax.Array, jax.Array]:
    r"""$y = \mathrm{softmax}(q k^\top + b)\,V$ and $L$ through cuDNN's fused attention.

    Requires `cudnn_unsupported` to return `None`. The batch dims (heads, batch)
    become cuDNN's heads; the score's scale is already folded into `q`.

    Args:
        terms: the static terms of a lowered edge site.
        prob: the arrays those terms read.
        batch_shape: the broadcast batch shape (heads, batch) of the result.

    Returns:
        `(y, L)`: `batch + (n, dv)` in the value dtype and `batch + (n,)` in float32.

    Raises:
        NotImplementedError: from JAX's cuDNN wrapper when the installed cuDNN or the GPU
            cannot run it (the caller falls back); so can ``ValueError`` and
            ``RuntimeError``.
    """
    batch = tuple(batch_shape)
    n, m = terms.num_children, terms.num_parents
    B = _prod(batch)
    q, k, v = prob.row["q"], prob.col["k"], prob.v

    def heads(x):  # (..., L, f) -> (1, L, B, f): cuDNN's BTNH layout, our batch as heads
        x = jnp.broadcast_to(x, batch + x.shape[-2:]).reshape((B,) + x.shape[-2:])
        return jnp.swapaxes(x, 0, 1)[None]

    bias = None
    if _additive(terms):
        b = _bias_table(terms, prob, q.dtype)
        bias = jnp.broadcast_to(b, batch + (n, m)).reshape((1, B, n, m))
    causal = terms.has_band
    window = (terms.dmax, 0) if terms.dmax is not None else None
    y, res = jax.nn.dot_product_attention(
        heads(q), heads(k), heads(v), bias=bias, scale=1.0, is_causal=causal,
        local_window_size=window, implementation="cudnn", return_residual=True,
    )
    y = jnp.swapaxes(y[0], 0, 1).reshape(batch + (n, v.shape[-1]))
    lse = jnp.swapaxes(res[0], 0, 1).reshape(batch + (n,))
    return y.astype(v.dtype), lse.astype(accum_dtype(v.dtype))


# --- Pallas ----------------------------------------------------------------------------


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, int(x) - 1).bit_length())


def _live_range(terms: Terms, a, bq: int, bk: int, nkb: int):
    """First and one-past-last parent block that child block `a` (traced) can see."""
    i_lo = a * bq
    lo = jnp.int32(0)
    hi = jnp.int32(nkb)
    if terms.dmax is not None:
        lo = lax.div(jnp.maximum(i_lo + terms.offset - terms.dmax, 0), bk)
    if terms.dmin is not None:
        top = i_lo + bq - 1 + terms.offset - terms.dmin
        hi = jnp.where(top < 0, 0, jnp.minimum(lax.div(jnp.maximum(top, 0), bk) + 1, nkb))
    return lo, jnp.maximum(hi, lo)


def _pallas_kernel(*refs, terms: Terms, bq: int, bk: int, nkb: int, keys: tuple[str, ...],
                   acc_dtype, precision):
    """One child block of one batch element: online softmax over its live parent blocks."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    named = dict(zip(keys, refs[: len(keys)]))
    o_ref, lse_ref = refs[len(keys):]
    a = pl.program_id(0)
    q = named["q"][...]
    i_idx = a * bq + jnp.arange(bq)
    if terms.geometric:
        g0 = named["geo0"][...].astype(acc_dtype)
        g1 = named["geo1"][...].astype(acc_dtype)
    m = terms.num_parents
    lo, hi = _live_range(terms, a, bq, bk, nkb)

    def body(t, carry):
        m_i, l_i, acc = carry
        j0 = pl.multiple_of(t * bk, bk)
        k = named["k"][pl.ds(j0, bk), :]
        s = plgpu.dot(q, k, trans_b=True, precision=precision).astype(acc_dtype)
        j_idx = j0 + jnp.arange(bk)
        d = i_idx[:, None] + terms.offset - j_idx[None, :]
        if "bias" in named:  # per-parent bias, -inf on parents a per-parent mask forbids
            s = s + named["bias"][pl.ds(j0, bk)][None, :].astype(acc_dtype)
        if terms.relpos is not None:
            s = s + named["relpos"][relpos_index(terms.relpos, d)].astype(acc_dtype)
        if terms.geometric:
            s = s + g0[:, None] + (d - terms.geo_d0).astype(acc_dtype) * g1[:, None]
        ok = (j_idx < m)[None, :]
        band = band_ok(terms, d)
        if band is not None:
            ok = ok & band
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        corr = jnp.exp(m_i - m_safe)
        v = named["v"][pl.ds(j0, bk), :]
        acc = acc * corr[:, None] + plgpu.dot(p.astype(v.dtype), v,
                                              precision=precision).astype(acc_dtype)
        return m_new, l_i * corr + jnp.sum(p, axis=-1), acc

    dvp = o_ref.shape[-1]
    init = (jnp.full((bq,), -jnp.inf, acc_dtype), jnp.zeros((bq,), acc_dtype),
            jnp.zeros((bq, dvp), acc_dtype))
    m_i, l_i, acc = lax.fori_loop(lo, hi, body, init)
    pos = l_i > 0
    l_safe = jnp.where(pos, l_i, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(pos, m_i + jnp.log(l_safe), -jnp.inf)


def pallas_forward(terms: Terms, prob: Problem, batch_shape: tuple[int, ...], *,
                   block_q: int = 64, block_k: int = 64, interpret: bool | None = None,
                   precision: lax.PrecisionLike = None, num_warps: int | None = None,
                   num_stages: int = 2) -> tuple[jax.Array, jax.Array]:
    r"""Forward pass of the Pallas flash-attention kernel: $y$ and $L$ of one edge site.

    The grid runs one program per (child block, batch element); each loops over the parent
    blocks its distance band allows, computing the block logits (dot product, per-parent
    bias, relative-position bias, geometric log-prior, band and padding masks) and the
    online softmax in float32: the matmuls multiply in the inputs' dtype and accumulate
    in float32, the prior's terms are added in float32. Feature and value dims are zero-padded to a power of two
    (at least 16), lengths to the block sizes.

    Args:
        terms: the static terms of a lowered edge site with `pallas_unsupported` `None`.
        prob: the arrays those terms read.
        batch_shape: the broadcast batch shape (heads, batch) of the result.
        block_q: children per block (rounded up to a power of two, at least 16, at most
            that of ``n``).
        block_k: parents per block (rounded up to a power of two, at least 16, at most
            that of ``m``).
        interpret: run in Pallas' interpreter (default: when JAX's backend is not a GPU).
        precision: the matmuls' ``precision`` (``None``: JAX's default, which follows
            ``jax.default_matmul_precision``; for float32 inputs on a GPU that default is
            TF32, ``"highest"`` is full float32).
        num_warps: Triton warps per program (default: 4 for head dims up to 64, else 8).
        num_stages: Triton software-pipelining stages of the parent-block loop.

    Returns:
        `(y, L)`: `batch + (n, dv)` in the value dtype and `batch + (n,)` in float32
        (float64 for float64 inputs).

    Raises:
        ValueError: `pallas_unsupported` names a reason the kernel cannot run the edge.

    Cost: $O(\text{live blocks}\cdot b_q b_k (d + d_v))$ time, $O(n d)$ memory.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    why = pallas_unsupported(terms, prob, batch_shape)
    if why:
        raise ValueError(f"pallas_forward: {why}")
    if interpret is None:  # the real backend, not platform(): tests fake that one
        interpret = jax.default_backend() != "gpu"
    batch = tuple(batch_shape)
    B = _prod(batch)
    n, m = terms.num_children, terms.num_parents
    bq = min(_pow2(block_q), _pow2(n))
    bk = min(_pow2(block_k), _pow2(m))
    nqb, nkb = -(-n // bq), -(-m // bk)
    n_pad, m_pad = nqb * bq, nkb * bk
    q, k, v = prob.row["q"], prob.col["k"], prob.v
    acc = accum_dtype(v.dtype)
    fp, dvp = _pow2(q.shape[-1]), _pow2(v.shape[-1])

    def flat(x, core: int):
        return jnp.broadcast_to(x, batch + x.shape[x.ndim - core:]).reshape(
            (B,) + x.shape[x.ndim - core:])

    def pad(x, *sizes):
        return jnp.pad(x, [(0, 0)] + [(0, s - x.shape[i + 1]) for i, s in enumerate(sizes)])

    arrays = {"q": pad(flat(q, 2), n_pad, fp), "k": pad(flat(k, 2), m_pad, fp),
              "v": pad(flat(v, 2), m_pad, dvp)}
    specs = {
        "q": pl.BlockSpec((None, bq, fp), lambda i, b: (b, i, 0)),
        "k": pl.BlockSpec((None, m_pad, fp), lambda i, b: (b, 0, 0)),
        "v": pl.BlockSpec((None, m_pad, dvp), lambda i, b: (b, 0, 0)),
    }
    if terms.col_bias or terms.col_ok:
        cb = jnp.zeros((m,), acc)
        if terms.col_bias:
            cb = cb + prob.col["bias"][..., 0].astype(acc)
        if terms.col_ok:
            cb = jnp.where(prob.const["col_ok"], cb, -jnp.inf)
        arrays["bias"] = pad(flat(cb, 1), m_pad)
        specs["bias"] = pl.BlockSpec((None, m_pad), lambda i, b: (b, 0))
    if terms.geometric:
        geo = flat(prob.row["geo"], 2)
        for r in (0, 1):
            arrays[f"geo{r}"] = pad(geo[..., r], n_pad)
            specs[f"geo{r}"] = pl.BlockSpec((None, bq), lambda i, b: (b, i))
    if terms.relpos is not None:
        rb = flat(prob.glob["relpos"], 1)
        arrays["relpos"] = rb
        specs["relpos"] = pl.BlockSpec((None, rb.shape[-1]), lambda i, b: (b, 0))
    keys = tuple(arrays)
    kernel = functools.partial(_pallas_kernel, terms=terms, bq=bq, bk=bk, nkb=nkb, keys=keys,
                               acc_dtype=acc, precision=precision)
    out, lse = pl.pallas_call(
        kernel,
        grid=(nqb, B),
        in_specs=[specs[x] for x in keys],
        out_specs=[pl.BlockSpec((None, bq, dvp), lambda i, b: (b, i, 0)),
                   pl.BlockSpec((None, bq), lambda i, b: (b, i))],
        out_shape=[jax.ShapeDtypeStruct((B, n_pad, dvp), v.dtype),
                   jax.ShapeDtypeStruct((B, n_pad), acc)],
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or (4 if fp <= 64 else 8), num_stages=num_stages),
        interpret=interpret,
        name="structinfer_attention",
    )(*[arrays[x] for x in keys])
    y = out[:, :n, : v.shape[-1]].reshape(batch + (n, v.shape[-1]))
    lse = lse[:, :n].reshape(batch + (n,))
    return y, lse

