r"""A Mosaic GPU (NVIDIA Hopper) forward kernel for the dot-product edge with structure.

`mosaic_forward` computes the same $y$ and row log-normaliser $L$ as
`structinfer.lowering.accel.pallas_forward` (the Triton kernel) for an edge site with
logits

$$
\ell_{ij} = q_i^\top k_j + b_j + r_{d_{ij}} + \log q_i + (d_{ij} - d_0)\log(1 - q_i),
\qquad d_{ij} = i + \text{offset} - j,
$$

on the allowed distances $d_{\min} \le d_{ij} \le d_{\max}$ (any of the terms may be
absent: per-parent bias $b$ and mask, relative-position table $r$, geometric prior),
written in Pallas' Mosaic GPU dialect: warpgroup matrix multiplies (``wgmma``) on
shared-memory tiles that a third, memory warpgroup streams in with the tensor memory
accelerator (TMA) ahead of the two compute warpgroups, FlashAttention-3's
warp-specialised schedule as in JAX's reference kernel
``jax.experimental.pallas.ops.gpu.attention_mgpu``. Each program takes 128 children
(64 per compute warpgroup) of one batch element and walks the parent blocks of 64 that
the distance band allows; the blocks whose every edge is allowed build no mask. A
relative-position table is read as one `relpos_tiles` tile per step (no gather in the
kernel); the geometric prior is computed from the distance grid. A per-edge mask known
at trace time that allows all or none of each 128 x 64 tile (block-sparse on blocks of
multiples of 128 x 64) is walked as per-program block lists, as FlexAttention's block
masks are, and never read.

Only the forward is here: the gradient is the Triton kernel's (`pallas_backward`), which
reads the same $y$ and $L$. The kernel table's ``"mosaic"`` entry runs the two through
`blocked_attention`, and ``backend="auto"`` takes it on a Hopper GPU of the running
process (on an H100 its forward ran 1.3-1.9x faster than the Triton kernel's at every
prior measured; ``docs/benchmarks.md``). Its values are checked on a GPU and, without
one, in JAX's Mosaic GPU interpreter, and its compilation for CUDA on a CPU
(``tests/test_mosaic.py``). Queries, keys and values must be float16 or bfloat16 (one dtype),
head dims 64, 128 or 256 after padding to a power of two; the matmuls accumulate in
float32 and the prior's terms are added in float32.

Reference: Shah et al., "FlashAttention-3" (2024) for the warp-specialised Hopper
schedule; Dao, "FlashAttention-2" (2023); the relative-position and geometric priors of
Singh & Buckley (appendix 8.2, Table 1).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._masks import ConcreteMask, mask_shape, tile_grid
from ._spec import Problem, Terms, band_ok, geometric_log_prior
from .accel import (
    RELPOS_TILES_MAX_BYTES,
    Layout,
    block_table,
    dot_only,
    full_parents,
    live_range,
    relpos_tiles,
)
from .blocked import block_grids

__all__ = ["MOSAIC_SMEM_BYTES", "mosaic_unsupported", "mosaic_forward"]

#: children per compute warpgroup (a program takes two of these)
_BQ = 64
#: parents per step
_BK = 64
#: compute warpgroups per program
_WGS = 2
#: shared memory a program may use (an H100 / H200 gives a block 227 KiB)
MOSAIC_SMEM_BYTES = 200 * 1024
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@functools.cache
def _mosaic_missing() -> str | None:
    """Why this JAX has no Pallas Mosaic GPU backend, or `None`."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        for name in ("kernel", "wgmma", "copy_gmem_to_smem", "load", "Layout", "ACC"):
            getattr(plgpu, name)
    except (ImportError, AttributeError) as err:
        return f"this JAX ({jax.__version__}) has no Pallas Mosaic GPU backend ({err})"
    return None


def _layouts(plgpu):
    """The register layouts of a ``wgmma`` tile, of its rows' and of its columns'
    vectors (``Layout.WGMMA.reduce(1)`` in JAX 0.10, ``WGMMA_ROW`` in some releases)."""
    wgmma = plgpu.Layout.WGMMA
    try:
        return wgmma, wgmma.reduce(1), wgmma.reduce(0)
    except AttributeError:
        return wgmma, plgpu.Layout.WGMMA_ROW, plgpu.Layout.WGMMA_COL


def _load(plgpu, ref, layout):
    """``plgpu.load`` of the whole of an indexed ref (``ref.at[...]``) into ``layout``:
    JAX 0.10 takes the index as a second argument, later releases deprecate it."""
    import inspect

    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _kernel_call(plgpu, entry, out, **kw):
    """``plgpu.kernel(entry, ...)`` with the outputs' types under this JAX's keyword
    (``out_type``; ``out_shape`` in releases before it)."""
    import inspect

    name = "out_type" if "out_type" in inspect.signature(plgpu.kernel).parameters else "out_shape"
    return plgpu.kernel(entry, **{name: out}, **kw)


def _layout(terms: Terms, prob: Problem, batch_shape) -> Layout:
    """The launch's blocks: ``_WGS * _BQ`` children per program, ``_BK`` parents per
    step, feature and value dims padded to a power of two of at least 64."""
    return Layout(terms, prob, batch_shape, _WGS * _BQ, _BK, min_dim=64)


#: shared memory Mosaic GPU adds to a program's buffers (reduction scratch, alignment;
#: measured 2.7-4.8 KiB on the lowered programs)
_SMEM_SLACK = 6 * 1024


def _smem_bytes(terms: Terms, prob: Problem, lay: Layout, steps: int, lists: int = 0) -> int:
    """Shared memory of one program: queries (and outputs), ``steps`` slots of keys,
    values and the step's tiles of the prior, the block list (``lists`` entries) and
    the compiler's own."""
    item = jnp.dtype(prob.v.dtype).itemsize
    total = _WGS * _BQ * (lay.fp + (lay.dvp if lay.dvp != lay.fp else 0)) * item
    total += steps * _BK * (lay.fp + lay.dvp) * item + _WGS * _BQ * 4
    if terms.relpos is not None:
        # the table's dtype, float32 for a wider one
        total += steps * _WGS * _BQ * _BK * min(jnp.dtype(prob.glob.relpos.dtype).itemsize, 4)
    if terms.col_bias or terms.col_ok:
        total += steps * _BK * 4
    if terms.geometric:
        total += 2 * _WGS * _BQ * 4
    return total + 4 * lists + _SMEM_SLACK


def _block_lists(terms: Terms, mask: ConcreteMask, lay: Layout) -> np.ndarray | str:
    """A per-edge mask's block lists, one row per program (128 children): ``[full count,
    partial count, full blocks..., partial blocks..., 0...]`` (int32; full: no edge of
    the block is outside the band or padded), or why the mask cannot be read as lists:
    it must allow all or none of each 128 x 64 tile in every batch element (it is never
    read in the kernel), as a block-sparse mask on blocks of multiples of 128 x 64 does."""
    n, m = terms.num_children, terms.num_parents
    shape = mask_shape(mask)
    if len(shape) < 2 or shape[-2:] != (n, m):
        return f"mask= of shape {shape}, expected (..., {n}, {m})"
    grid = (n, m, lay.bq, lay.bk, lay.nqb, lay.nkb)
    some = tile_grid(mask, *grid, reduce=np.any, over_batch=np.any)
    every = tile_grid(mask, *grid, reduce=np.all, over_batch=np.all)
    live, full = block_grids(dataclasses.replace(terms, pair_ok=False, col_ok=False),
                             lay.bq, lay.bk)
    live &= some
    if (live & ~every).any():
        return (f"a per-edge mask that allows part of a {lay.bq} x {lay.bk} tile, or a "
                "tile in some batch elements only (the Mosaic GPU kernel reads no mask: "
                "block-sparse masks on blocks of multiples of 128 x 64, the same in "
                "every batch element, run)")
    # rows of at least 128 bytes: a copy moves a multiple of a warpgroup (128 threads)
    return block_table((live, full), min_width=32)


def _plan(terms: Terms, prob: Problem, batch_shape, mask: ConcreteMask | None, steps: int
          ) -> tuple[str | None, Layout | None, np.ndarray | None]:
    """``(why not, layout, block lists)`` of a launch with ``steps`` slots: the reason
    the kernel cannot run the edge (else ``None``), and when it can, its `Layout` and a
    per-edge mask's `_block_lists` (``None`` without one)."""
    why = _mosaic_missing() or dot_only(terms, prob)
    if why:
        return why, None, None
    if terms.mask_blocks is not None:
        return "a per-edge mask read per block (the blocked kernel's form)", None, None
    if terms.pair_ok and mask is None:
        return ("a per-edge mask not known at trace time (the Mosaic GPU kernel reads none)",
                None, None)
    q, k, v = prob.row.q, prob.col.k, prob.v
    dts = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dts) != 1 or next(iter(dts)) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return (f"inputs are {sorted(str(d) for d in dts)} (the Mosaic GPU kernel takes "
                "float16 / bfloat16, one dtype)"), None, None
    n, m = terms.num_children, terms.num_parents
    if n < _WGS * _BQ or m < _BK:
        return (f"{n} children and {m} parents (the Mosaic GPU kernel needs at least "
                f"{_WGS * _BQ} and {_BK})"), None, None
    lay = _layout(terms, prob, batch_shape)
    if max(lay.fp, lay.dvp) > 256:
        return (f"head dims {q.shape[-1]} and {v.shape[-1]} (the Mosaic GPU kernel: at most "
                "256)"), None, None
    if terms.relpos is not None and lay.tiles_bytes(prob.glob.relpos) > RELPOS_TILES_MAX_BYTES:
        return "its relative-position tiles are over RELPOS_TILES_MAX_BYTES", None, None
    lists = _block_lists(terms, mask, lay) if terms.pair_ok else None
    if isinstance(lists, str):
        return lists, None, None
    need = _smem_bytes(terms, prob, lay, steps, 0 if lists is None else lists.shape[1])
    if need > MOSAIC_SMEM_BYTES:
        return (f"max_concurrent_steps={steps}: its tiles need {need // 1024} KiB of shared "
                f"memory (over {MOSAIC_SMEM_BYTES // 1024} KiB)"), None, None
    return None, lay, lists


def mosaic_unsupported(terms: Terms, prob: Problem, batch_shape: tuple[int, ...],
                       mask: ConcreteMask | None = None) -> str | None:
    """Why the Mosaic GPU forward cannot run this edge with its default two slots (its
    structure, dtypes, sizes, shared memory, a per-edge mask it cannot read as block
    lists, or a JAX without the Mosaic GPU backend), or `None` when it can. ``mask``: the
    per-edge mask's value when known at trace time (as `mosaic_forward`'s)."""
    return _plan(terms, prob, batch_shape, mask, 2)[0]


def _kernel(named: dict, out_ref, lse_ref, scoped, *, terms: Terms, lay: Layout, steps: int,
            row_of, nan_rows: bool, dtype):
    """One program: children ``pair * 128 ...`` of batch element ``b``, two compute
    warpgroups of 64 children each and a memory warpgroup streaming the parent blocks."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    smem, bars, consumed, schedule = scoped
    q_smem, o_smem, k_smem, v_smem, lse_smem, rt_smem, bias_smem, geo_smem, list_smem = smem
    q_bar, g_bar, k_bar, v_bar, r_bar, b_bar, list_bar = bars
    k_cons, v_cons = consumed
    b = lax.axis_index("batch")
    pair = lax.axis_index("q_seq")
    wg = lax.axis_index("wg")
    f32 = jnp.float32
    wgmma_layout, row_layout, col_layout = _layouts(plgpu)
    off = terms.offset
    # the program's steps u = 0 .. count - 1 visit parent blocks block_of(u): the band's
    # range lo .. hi - 1, or (a per-edge mask known at trace time) the program's row of
    # the block lists, [full count, partial count, full blocks..., partial blocks...]
    if list_smem is None:
        lo, hi = live_range(terms, pair, _WGS * _BQ, _BK, lay.nkb, off)
        count = hi - lo

        def block_of(u):
            return lo + u
    else:
        @pl.when(wg == _WGS)
        def _():
            plgpu.copy_gmem_to_smem(named["blocks"].at[pair], list_smem, list_bar.at[0])

        plgpu.barrier_wait(list_bar.at[0])
        n_full = list_smem[0]
        count = n_full + list_smem[1]

        def block_of(u):
            return list_smem[2 + u]

    def slot_of(u):
        return lax.rem(u, jnp.int32(steps))

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def row_bcast(x, shape):
        return lax.broadcast_in_dim(x, shape, [0])

    @pl.when(wg < _WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        a = pair * _WGS + wg  # this warpgroup's block of _BQ children
        i0 = a * _BQ
        q_s = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(named["q"].at[b, pl.ds(i0, _BQ)], q_s, q_bar.at[wg])
        if terms.geometric:
            for r in (0, 1):
                plgpu.copy_gmem_to_smem(named[f"geo{r}"].at[b, pl.ds(i0, _BQ)],
                                        geo_smem.at[r, wg], g_bar.at[2 * wg + r])
        plgpu.barrier_wait(q_bar.at[wg])
        g0 = g1 = None
        if terms.geometric:
            plgpu.barrier_wait(g_bar.at[2 * wg])
            plgpu.barrier_wait(g_bar.at[2 * wg + 1])
            g0 = _load(plgpu, geo_smem.at[0, wg], row_layout)
            g1 = _load(plgpu, geo_smem.at[1, wg], row_layout)

        m = plgpu.layout_cast(jnp.full((_BQ,), -jnp.inf, f32), row_layout)
        lsum = plgpu.layout_cast(jnp.full((_BQ,), 0.0, f32), row_layout)
        acc = plgpu.layout_cast(jnp.full((_BQ, lay.dvp), 0.0, f32), wgmma_layout)

        @pl.when(count > 0)
        def _():
            plgpu.barrier_wait(k_bar.at[0])

        pl.when(wg == 1)(schedule_barrier)

        def step(u, carry, masked: bool):
            acc, m, lsum = carry
            slot = slot_of(u)
            j0 = block_of(u) * _BK

            def compute_qk(acc_ref):
                plgpu.wgmma(acc_ref, q_s, k_smem.at[slot].transpose((1, 0)))
                schedule_barrier()
                return acc_ref[...]

            s = pl.run_scoped(compute_qk, plgpu.ACC((_BQ, _BK), f32))
            if terms.relpos is not None:  # this warpgroup's rows of the step's tile
                plgpu.barrier_wait(r_bar.at[slot])
                s = s + _load(plgpu, rt_smem.at[slot, pl.ds(wg * _BQ, _BQ)],
                              wgmma_layout).astype(f32)
            if terms.col_bias or terms.col_ok:  # per-parent bias, -inf where masked
                plgpu.barrier_wait(b_bar.at[slot])
                bias = _load(plgpu, bias_smem.at[slot], col_layout)
                s = s + lax.broadcast_in_dim(bias, (_BQ, _BK), [1])
            plgpu.barrier_arrive(k_cons.at[slot])
            if terms.geometric or masked:
                rows = plgpu.broadcasted_iota(jnp.int32, (_BQ, _BK), 0, layout=wgmma_layout)
                cols = plgpu.broadcasted_iota(jnp.int32, (_BQ, _BK), 1, layout=wgmma_layout)
                d = rows - cols + (i0 + off - j0)
            if terms.geometric:
                s = s + geometric_log_prior(row_bcast(g0, s.shape), row_bcast(g1, s.shape),
                                            d - terms.geo_d0)
            if masked:
                ok = cols < terms.num_parents - j0
                band = band_ok(terms, d)
                if band is not None:
                    ok = ok & band
                s = jnp.where(ok, s, -jnp.inf)

            # the online softmax, in base 2 (one fused multiply-add per logit)
            m_new = jnp.maximum(m, s.max(axis=1) * _LOG2E)
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            corr = jnp.exp2(m - m_safe)
            p = jnp.exp2(s * _LOG2E - row_bcast(m_safe, s.shape))
            acc = acc * row_bcast(corr, acc.shape)
            lsum = lsum * corr + p.sum(axis=1)
            p16 = p.astype(dtype)
            acc, lsum, m_new, p16 = lax.optimization_barrier((acc, lsum, m_new, p16))
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(schedule)

            def compute_pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                @pl.when(u + 1 < count)
                def _():
                    plgpu.barrier_wait(k_bar.at[slot_of(u + 1)])

            acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_cons.at[slot])
            return acc, m_new, lsum

        # steps u_lo .. u_hi - 1 visit blocks whose every edge is allowed: no mask built
        if list_smem is not None:
            u_lo, u_hi = jnp.int32(0), n_full
        else:
            full = full_parents(terms, a, _BQ, _BK, off)
            u_lo = u_hi = jnp.int32(0)
            if full is not None:
                f_lo = jnp.minimum(jnp.maximum(full[0], lo), hi)
                u_lo, u_hi = f_lo - lo, jnp.maximum(jnp.minimum(full[1], hi), f_lo) - lo
        carry = (acc, m, lsum)
        carry = lax.fori_loop(0, u_lo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(u_lo, u_hi, functools.partial(step, masked=False), carry)
        acc, m, lsum = lax.fori_loop(u_hi, count, functools.partial(step, masked=True), carry)
        pl.when(wg == 0)(schedule_barrier)

        pos = lsum > 0
        l_safe = jnp.where(pos, lsum, 1.0)
        lse = jnp.where(pos, m * _LN2 + jnp.log(l_safe), -jnp.inf)
        y = acc / row_bcast(l_safe, acc.shape)
        if nan_rows:  # y + NaN in the rows of a non-finite L (|L| < inf: False for NaN)
            y = y + row_bcast(jnp.where(jnp.abs(lse) < jnp.inf, 0.0, jnp.nan), acc.shape)
        o_s = q_s if o_smem is None else o_smem.at[wg]
        o_s[...] = y.astype(dtype)
        lse_smem.at[wg][...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, out_ref.at[b, pl.ds(i0, _BQ)])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, pl.ds(i0, _BQ)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        i_pair = pair * (_WGS * _BQ)

        def load_k(u, slot):  # the step's keys and the prior's tiles
            j0 = block_of(u) * _BK
            plgpu.copy_gmem_to_smem(named["k"].at[b, pl.ds(j0, _BK)], k_smem.at[slot],
                                    k_bar.at[slot])
            if terms.relpos is not None:
                c = lax.div(i_pair - j0 + (lay.m_pad - _BK), jnp.int32(min(lay.bq, _BK)))
                plgpu.copy_gmem_to_smem(named["rtiles"].at[row_of(b), c], rt_smem.at[slot],
                                        r_bar.at[slot])
            if terms.col_bias or terms.col_ok:
                plgpu.copy_gmem_to_smem(named["bias"].at[b, pl.ds(j0, _BK)],
                                        bias_smem.at[slot], b_bar.at[slot])

        def load_v(u, slot):
            plgpu.copy_gmem_to_smem(named["v"].at[b, pl.ds(block_of(u) * _BK, _BK)],
                                    v_smem.at[slot], v_bar.at[slot])

        def prefetch(i):  # the first slots, without waiting
            @pl.when(i < count)
            def _():
                load_k(jnp.int32(i), i)
                load_v(jnp.int32(i), i)

        for i in range(steps):
            prefetch(i)

        @pl.loop(jnp.int32(steps), count)
        def _(u):
            slot = slot_of(u)
            plgpu.barrier_wait(k_cons.at[slot])
            load_k(u, slot)
            plgpu.barrier_wait(v_cons.at[slot])
            load_v(u, slot)

        @pl.loop(jnp.maximum(count - steps, 0), count)
        def _(u):  # the last slots' releases: every phase of a barrier is waited for
            slot = slot_of(u)
            plgpu.barrier_wait(k_cons.at[slot])
            plgpu.barrier_wait(v_cons.at[slot])


def mosaic_forward(terms: Terms, prob: Problem, batch_shape: tuple[int, ...], *,
                   max_concurrent_steps: int = 2, nan_rows: bool = False,
                   mask: ConcreteMask | None = None, precision: lax.PrecisionLike = None
                   ) -> tuple[jax.Array, jax.Array]:
    r"""Forward pass of the Mosaic GPU flash-attention kernel: $y$ and $L$ of one edge site.

    The grid runs one program per (128 children, batch element); its memory warpgroup
    streams the parent blocks of 64 that the distance band allows into
    ``max_concurrent_steps`` shared-memory slots (keys, values, and the step's
    relative-position tile and per-parent bias), and its two compute warpgroups each run
    the online softmax of 64 children over them, with ``wgmma`` for $q k^\top$ and
    $p V$ (inputs' dtype in, float32 accumulation), taking turns on the tensor cores.
    Blocks whose every edge is allowed build no mask. Lengths are padded to the blocks,
    feature and value dims to a power of two of at least 64.

    Args:
        terms: the static terms of a lowered edge site with `mosaic_unsupported` `None`.
        prob: the arrays those terms read (queries already scaled).
        batch_shape: the broadcast batch shape (heads, batch) of the result.
        max_concurrent_steps: shared-memory slots of the parent-block pipeline (at
            least 2).
        nan_rows: write NaN in the rows whose $L$ is not finite, in the kernel; default
            $y = 0$ there.
        mask: the per-edge mask's value (``prob.const.pair_ok``), needed when the edge
            has one: a NumPy boolean ``(..., n, m)`` array or a
            [`BlockMask`][structinfer.lowering.BlockMask] that allows all or none of
            each 128 x 64 tile in every batch element (block-sparse on blocks of
            multiples of 128 x 64). Each program then visits only its list of blocks
            (FlexAttention's block masks) and reads no mask.
        precision: accepted for the kernel table's interface; the matmuls are ``wgmma``
            in the inputs' dtype with float32 accumulation whatever it says.

    Returns:
        `(y, L)`: `batch + (n, dv)` in the value dtype and `batch + (n,)` in float32.
        A row with no allowed parent has $y = 0$ (NaN with ``nan_rows``) and
        $L = -\infty$.

    Raises:
        ValueError: `mosaic_unsupported` names a reason the kernel cannot run the edge.

    Cost: $O(\text{live blocks}\cdot 64^2 (d + d_v))$ time, $O(n d)$ memory (with a
    relative-position table, $O((n + m) \cdot 64)$ per table for its tiles).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    del precision
    if max_concurrent_steps < 2:
        raise ValueError(f"mosaic_forward: max_concurrent_steps={max_concurrent_steps}, "
                         "expected at least 2")
    why, lay, lists = _plan(terms, prob, batch_shape, mask, max_concurrent_steps)
    if why:
        raise ValueError(f"mosaic_forward: {why}")
    arrays, _ = lay.operands(terms, prob, whole_rows=True)
    arrays.pop("relpos", None)
    if lists is not None:  # the block lists stand for the mask, which is never read
        arrays["blocks"] = jnp.asarray(lists)
    for r in (0, 1) if terms.geometric else ():  # the prior's terms are added in float32
        arrays[f"geo{r}"] = arrays[f"geo{r}"].astype(jnp.float32)
    row_of = None
    if terms.relpos is not None:  # the table's own values (float32 for a wider table)
        rows, row_of = lay.distinct(prob.glob.relpos, 1)
        if jnp.dtype(rows.dtype).itemsize > 4:
            rows = rows.astype(jnp.float32)
        arrays["rtiles"] = relpos_tiles(terms, rows, lay.bq, lay.bk, lay.n_pad, lay.m_pad)
    keys = tuple(arrays)
    dtype = prob.v.dtype
    steps = max_concurrent_steps
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)

    def tiled(shape):
        return plgpu.SMEM(shape, dtype, transforms=(tiling, swizzle))

    def entry(*refs):
        named = dict(zip(keys, refs[: len(keys)]))
        out_ref, lse_ref = refs[len(keys):]
        rt = None
        if terms.relpos is not None:
            rt_dtype = arrays["rtiles"].dtype  # swizzled 128-byte rows, as the tiles above
            rt = plgpu.SMEM((steps, _WGS * _BQ, _BK), rt_dtype, transforms=(
                plgpu.TilingTransform((8, 128 // jnp.dtype(rt_dtype).itemsize)), swizzle))
        smem = (
            tiled((_WGS, _BQ, lay.fp)),
            None if lay.fp == lay.dvp else tiled((_WGS, _BQ, lay.dvp)),
            tiled((steps, _BK, lay.fp)),
            tiled((steps, _BK, lay.dvp)),
            plgpu.SMEM((_WGS, _BQ), jnp.float32),
            rt,
            plgpu.SMEM((steps, _BK), jnp.float32) if "bias" in named else None,
            plgpu.SMEM((2, _WGS, _BQ), jnp.float32) if terms.geometric else None,
            plgpu.SMEM(arrays["blocks"].shape[1:], jnp.int32) if "blocks" in named else None,
        )
        bars = (plgpu.Barrier(num_barriers=_WGS), plgpu.Barrier(num_barriers=2 * _WGS),
                *(plgpu.Barrier(num_barriers=steps) for _ in range(4)),
                plgpu.Barrier(num_barriers=1) if "blocks" in named else None)
        consumed = (plgpu.Barrier(num_arrivals=_WGS, num_barriers=steps),) * 2
        pl.run_scoped(
            lambda *scoped: _kernel(named, out_ref, lse_ref, scoped, terms=terms, lay=lay,
                                    steps=steps, row_of=row_of, nan_rows=bool(nan_rows),
                                    dtype=dtype),
            smem, bars, consumed, plgpu.Barrier(num_arrivals=_WGS),
            collective_axes="wg",
        )

    out, lse = _kernel_call(
        plgpu, entry,
        (jax.ShapeDtypeStruct((lay.B, lay.n_pad, lay.dvp), dtype),
         jax.ShapeDtypeStruct((lay.B, lay.n_pad), jnp.float32)),
        grid=(lay.B, lay.nqb),
        grid_names=("batch", "q_seq"),
        num_threads=_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*[arrays[x] for x in keys])
    n, dv = terms.num_children, prob.v.shape[-1]
    y = out[:, :n, :dv].reshape(lay.batch + (n, dv))
    return y, lse[:, :n].reshape(lay.batch + (n,))
