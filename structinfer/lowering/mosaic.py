r"""Mosaic GPU (NVIDIA Hopper) kernels for the dot-product edge with structure.

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

The backward's dQ and dK/dV passes are here too, in the same dialect (`mosaic_dq`,
`mosaic_dkdv`; both through `pallas_backward`'s hooks: `mosaic_backward`, which reads
the forward's $y$ and its rows' statistics, the largest logit $m$ and $\log l$: both
directions compute $p = 2^{(s - m)\log_2 e}$, the difference first, so a row of huge
logits keeps its exact differences). The dK/dV pass also sums a trained relative-position
table's gradient: each step's tile of $\mathrm{d}s$ is added, by a TMA reduction, into
its block diagonal's float32 tile of a sum shared by every program, which
`structinfer.lowering.accel.relpos_tiles_grad` then folds into the table. The kernel
table's ``"mosaic"`` entry runs the forward and `mosaic_backward` through
`blocked_attention`, and ``backend="auto"`` takes it on a Hopper GPU of the running
process (on an H100 the forward ran 1.3-1.9x and the backward 1.2-2.4x faster than the
Triton kernel's at every prior measured; ``docs/benchmarks.md``). All three kernels'
values and gradients are checked on a Hopper GPU, in JAX's Mosaic GPU interpreter, and
their compilation for CUDA on a CPU (``tests/test_mosaic.py``; the table's gradient
summed in the dK/dV pass is not yet run on a GPU).
Queries, keys and values must be float16 or bfloat16 (one dtype), head dims 64, 128 or
256 after padding to a power of two; the matmuls accumulate in float32 and the prior's
terms are added in float32.

Reference: Shah et al., "FlashAttention-3" (2024) for the warp-specialised Hopper
schedule; Dao, "FlashAttention-2" (2023); the relative-position and geometric priors of
Singh & Buckley (appendix 8.2, Table 1).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._masks import ConcreteMask, mask_shape, tile_grid
from ._softmax import RowStats, require_row_stats
from ._spec import Problem, Terms, band_ok, geometric_log_prior
from .accel import (
    RELPOS_TILES_MAX_BYTES,
    Layout,
    block_table,
    dot_only,
    full_children,
    full_parents,
    live_children,
    live_range,
    pallas_backward,
    relpos_tiles,
    relpos_tiles_grad,
)
from .blocked import block_grids

__all__ = ["MOSAIC_SMEM_BYTES", "mosaic_unsupported", "mosaic_forward", "mosaic_dq",
           "mosaic_dq_unsupported", "mosaic_dkdv", "mosaic_dkdv_unsupported",
           "mosaic_backward", "mosaic_backward_refusals"]

#: children per compute warpgroup (a program takes two of these)
_BQ = 64
#: parents per step
_BK = 64
#: compute warpgroups per program
_WGS = 2
#: shared memory a program may use, as accounted (`_smem_bytes`, with `_SMEM_SLACK` for
#: the compiler's own): under the 227 KiB an H100 / H200 gives a block. 200 KiB when the
#: kernels kept one row statistic, 201 since they keep two (m and log l): every layout
#: that fit then still fits, and the measured slack leaves over 20 KiB to the hardware.
MOSAIC_SMEM_BYTES = 201 * 1024
_LOG2E = math.log2(math.e)


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


@functools.cache
def _param(fn, name: str) -> inspect.Parameter | None:
    """Parameter ``name`` of ``fn``'s signature (the JAX release's API), or `None`."""
    return inspect.signature(fn).parameters.get(name)


def _load(plgpu, ref, layout):
    """``plgpu.load`` of the whole of an indexed ref (``ref.at[...]``) into ``layout``:
    JAX 0.10 takes the index as a second argument, later releases deprecate it."""
    idx = _param(plgpu.load, "idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _kernel_call(entry, out_types: list, arrays: dict, grid: tuple[int, int],
                 axis: str, sums: dict | None = None) -> list[jax.Array]:
    """Launch ``entry(named input refs, output refs)`` over ``grid`` (named ``("batch",
    axis)``) with two compute warpgroups and a memory one, on ``arrays``, giving
    ``out_types``; the outputs' keyword is this JAX's (``out_type``; ``out_shape`` in
    releases before it). ``sums``: name -> ``jax.ShapeDtypeStruct`` of arrays the
    programs add into (TMA reductions from many programs): each starts as zeros, is
    passed to ``entry`` among the named refs, and comes back after the outputs."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    params = plgpu.CompilerParams(approx_math=True)
    keys = tuple(arrays) + tuple(sums or {})

    def body(*refs):
        entry(dict(zip(keys, refs[: len(keys)])), refs[len(keys):])

    operands = [arrays[x] for x in arrays]
    if sums:
        return list(_with_sums(body, list(out_types), list(sums.values()), grid,
                               ("batch", axis), params)(*operands))
    name = "out_type" if _param(plgpu.kernel, "out_type") is not None else "out_shape"
    call = plgpu.kernel(body, **{name: tuple(out_types)}, grid=grid,
                        grid_names=("batch", axis), num_threads=_WGS + 1, thread_name="wg",
                        compiler_params=params)
    return list(call(*operands))


def _with_sums(body, out_types: list, sums: list, grid: tuple, grid_names: tuple, params):
    """``pl.kernel`` of ``body(*operand refs, *sum refs, *output refs)`` on a mesh of
    ``grid`` with our warpgroups, as a function of the operands returning the outputs
    then the sums. Every sum and output is a mutable array of zeros aliased in and out
    of the kernel, held by `jax.experimental.pallas.run_state` so none escapes
    (`plgpu.kernel` takes no refs). Under `jax.vmap` it launches once with a grid axis
    for the mapped one, slicing the mapped operands, the outputs and the sums, as
    `plgpu.kernel` does."""
    from jax import custom_batching
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @custom_batching.custom_vmap
    def call(*operands):
        def run(refs):
            mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=_WGS + 1,
                              thread_name="wg")
            pl.kernel(body, out_type=(), mesh=mesh, compiler_params=params)(*operands, *refs)

        final = pl.run_state(run)([jnp.zeros(t.shape, t.dtype) for t in (*sums, *out_types)])
        return (*final[len(sums):], *final[:len(sums)])

    @call.def_vmap
    def _(axis_size, in_batched, *operands):
        axis = object()
        count = len(operands)

        def batched(*refs):
            idx = lax.axis_index(axis)
            mine = [r.at[idx] if b else r for r, b in zip(refs[:count], in_batched)]
            body(*mine, *[r.at[idx] for r in refs[count:]])

        def more(t):
            return jax.ShapeDtypeStruct((axis_size, *t.shape), t.dtype)

        outs = _with_sums(batched, [more(t) for t in out_types], [more(t) for t in sums],
                          (axis_size, *grid), (axis, *grid_names), params)(*operands)
        return outs, (True,) * len(outs)

    return call


def _layout(terms: Terms, prob: Problem, batch_shape) -> Layout:
    """The launch's blocks: ``_WGS * _BQ`` children per program, ``_BK`` parents per
    step, feature and value dims padded to a power of two of at least 64."""
    return Layout(terms, prob, batch_shape, _WGS * _BQ, _BK, min_dim=64)


#: shared memory Mosaic GPU adds to a program's buffers (reduction scratch, alignment;
#: measured 2.7-4.8 KiB on the lowered programs)
_SMEM_SLACK = 6 * 1024


def _smem_bytes(terms: Terms, prob: Problem, lay: Layout, steps: int, lists: int = 0,
                dq: bool = False) -> int:
    """Shared memory of one program: queries (and outputs; with ``dq`` the output's
    cotangent), ``steps`` slots of keys, values and the step's tiles of the prior, the
    block list (``lists`` entries) and the compiler's own."""
    item = jnp.dtype(prob.v.dtype).itemsize
    total = _WGS * _BQ * (lay.fp + (lay.dvp if dq or lay.dvp != lay.fp else 0)) * item
    total += steps * _BK * (lay.fp + lay.dvp) * item + (2 + dq) * _WGS * _BQ * 4
    if terms.relpos is not None:
        # the table's dtype, float32 for a wider one
        total += steps * _WGS * _BQ * _BK * min(jnp.dtype(prob.glob.relpos.dtype).itemsize, 4)
    if terms.col_bias or terms.col_ok:
        total += steps * _BK * 4
    if terms.geometric:
        total += 2 * _WGS * _BQ * 4
    return total + 4 * lists + _SMEM_SLACK


def _block_lists(terms: Terms, mask: ConcreteMask, lay: Layout,
                 by_parent: bool = False) -> np.ndarray | str:
    """A per-edge mask's block lists, one row per program (a child block of ``lay``; with
    ``by_parent`` a parent block, listing child blocks): ``[full count, partial count,
    full blocks..., partial blocks..., 0...]`` (int32; full: no edge of the block is
    outside the band or padded), or why the mask cannot be read as lists: it must allow
    all or none of each ``lay.bq x lay.bk`` tile in every batch element (it is never
    read in the kernel), as a block-sparse mask on blocks of multiples of those does."""
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
                f"block-sparse masks on blocks of multiples of {lay.bq} x {lay.bk}, the "
                "same in every batch element, run)")
    # rows of at least 128 bytes: a copy moves a multiple of a warpgroup (128 threads)
    return block_table((live, full), by_parent=by_parent, min_width=32)


def _unsupported(terms: Terms, prob: Problem, mask: ConcreteMask | None,
                 least: tuple[int, int], layout: Callable[[], Layout]
                 ) -> tuple[str | None, Layout | None]:
    """``(why not, layout)``: why the Mosaic GPU kernels cannot run the edge whatever the
    launch (a JAX without them, the edge's structure, dtypes, head dims, the
    relative-position tiles' bytes) or with fewer than ``least`` children and parents,
    else ``None`` and the launch's ``layout()``."""
    why = _mosaic_missing() or dot_only(terms, prob)
    if why:
        return why, None
    if prob.glob.dot_scale is not None:
        return ("a traced dot-product scale of 16-bit operands (the Mosaic GPU kernel takes "
                "one known at trace time)"), None
    if terms.mask_blocks is not None:
        return "a per-edge mask read per block (the blocked kernel's form)", None
    if terms.pair_ok and mask is None:
        return ("a per-edge mask not known at trace time (the Mosaic GPU kernel reads "
                "none)"), None
    q, k, v = prob.row.q, prob.col.k, prob.v
    dts = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dts) != 1 or next(iter(dts)) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return (f"inputs are {sorted(str(d) for d in dts)} (the Mosaic GPU kernel takes "
                "float16 / bfloat16, one dtype)"), None
    n, m = terms.num_children, terms.num_parents
    if n < least[0] or m < least[1]:
        return (f"{n} children and {m} parents (the Mosaic GPU kernel needs at least "
                f"{least[0]} and {least[1]})"), None
    lay = layout()
    if max(lay.fp, lay.dvp) > 256:
        return (f"head dims {q.shape[-1]} and {v.shape[-1]} (the Mosaic GPU kernel: at most "
                "256)"), None
    if terms.relpos is not None and lay.tiles_bytes(prob.glob.relpos) > RELPOS_TILES_MAX_BYTES:
        return "its relative-position tiles are over RELPOS_TILES_MAX_BYTES", None
    return None, lay


def _plan(terms: Terms, prob: Problem, batch_shape, mask: ConcreteMask | None, steps: int,
          dq: bool = False) -> tuple[str | None, Layout | None, np.ndarray | None]:
    """``(why not, layout, block lists)`` of a launch with ``steps`` slots (the forward,
    or with ``dq`` the backward's dQ pass): the reason the kernel cannot run the edge
    (else ``None``), and when it can, its `Layout` and a per-edge mask's `_block_lists`
    (``None`` without one)."""
    why, lay = _unsupported(terms, prob, mask, (_WGS * _BQ, _BK),
                            lambda: _layout(terms, prob, batch_shape))
    if why:
        return why, None, None
    if dq and prob.row.q.shape[:-2] != lay.batch:
        return ("queries shared by some batch dim (the Triton pass sums their gradient in "
                "float32)"), None, None
    lists = _block_lists(terms, mask, lay) if terms.pair_ok else None
    if isinstance(lists, str):
        return lists, None, None
    need = _smem_bytes(terms, prob, lay, steps, 0 if lists is None else lists.shape[1], dq)
    why = _over_smem(need, steps, "its tiles")
    return (why, None, None) if why else (None, lay, lists)


def _over_smem(need: int, steps: int, what: str) -> str | None:
    """Why ``need`` bytes of shared memory are too many for a program, or `None`."""
    if need <= MOSAIC_SMEM_BYTES:
        return None
    return (f"{what} need {-(-need // 1024)} KiB of shared memory with {steps} pipeline "
            f"slots (over {MOSAIC_SMEM_BYTES // 1024} KiB)")


def mosaic_unsupported(terms: Terms, prob: Problem, batch_shape: tuple[int, ...],
                       mask: ConcreteMask | None = None) -> str | None:
    """Why the Mosaic GPU forward cannot run this edge with its default two slots (its
    structure, dtypes, sizes, shared memory, a per-edge mask it cannot read as block
    lists, or a JAX without the Mosaic GPU backend), or `None` when it can. ``mask``: the
    per-edge mask's value when known at trace time (as `mosaic_forward`'s)."""
    return _plan(terms, prob, batch_shape, mask, 2)[0]


def _swizzled(shape: tuple[int, ...], dtype):
    """A shared-memory buffer whose last two dims are tiles of 8 rows of 128 bytes with
    the 128-byte swizzle: what ``wgmma`` reads bank-conflict free and TMA fills."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(128)))


def _check_rows(caller: str, terms: Terms, prob: Problem, lay: Layout, d_out,
                stats: RowStats, delta) -> None:
    """Raise naming the argument when the backward's per-child arrays are not shaped
    ``batch + (n, dv)`` (``d_out``) and ``batch + (n,)`` (the statistics ``stats``,
    ``delta``)."""
    n, dv = terms.num_children, prob.v.shape[-1]
    rows = lay.batch + (n,)
    for name, x, want, what in (("d_out", d_out, rows + (dv,), "children, value dim"),
                                ("stats.m", stats.m, rows, "children"),
                                ("stats.log_l", stats.log_l, rows, "children"),
                                ("delta", delta, rows, "children")):
        if tuple(jnp.shape(x)) != want:
            raise ValueError(f"{caller}: {name} of shape {tuple(jnp.shape(x))}, expected "
                             f"{want} (batch, {what})")


def _operands(terms: Terms, prob: Problem, lay: Layout, lists: np.ndarray | None,
              rows: tuple | None = None) -> tuple[dict, jax.Array | None, Callable | None]:
    """The arrays every Mosaic GPU launch reads, padded to ``lay``: ``q``, ``k``, ``v``,
    the per-parent bias, the block lists (``lists``: they stand for the mask, which is
    never read), the geometric prior's parameters as ``geo`` ``(B, 2, n_pad)`` float32
    (one copy per child block); with the backward's ``rows`` ``(d_out, stats, delta)``,
    ``do`` ``(B, n_pad, dvp)`` and ``ld`` ``(B, 3, n_pad)`` float32 rows of m, log l and
    delta (`RowStats`; log l = -inf and delta = 0 on padded children). Also the
    relative-position table's distinct rows (its own values; float32 for a wider table)
    and the map from a flat batch index to its row (`Layout.distinct`), from which the
    caller builds its tiles; ``None, None`` without one."""
    f32 = jnp.float32
    arrays, _ = lay.operands(terms, prob, whole_rows=True)
    arrays.pop("relpos", None)
    if terms.geometric:
        for r in (0, 1):
            arrays.pop(f"geo{r}")
        geo = jnp.swapaxes(lay.flat(prob.row.geo.astype(f32), 2), 1, 2)
        arrays["geo"] = lay.pad(geo, 2, lay.n_pad)
    if lists is not None:
        arrays["blocks"] = jnp.asarray(lists)
    if rows is not None:
        d_out, stats, delta = rows
        arrays["do"] = lay.pad(lay.flat(d_out.astype(prob.v.dtype), 2), lay.n_pad, lay.dvp)
        ld = jnp.stack([lay.flat(x.astype(f32), 1) for x in (*stats, delta)], 1)
        pad = jnp.broadcast_to(jnp.asarray([[0.0], [-jnp.inf], [0.0]], f32),
                               (lay.B, 3, lay.n_pad - ld.shape[-1]))
        arrays["ld"] = jnp.concatenate([ld, pad], -1)
    table = row_of = None
    if terms.relpos is not None:
        table, row_of = lay.distinct(prob.glob.relpos, 1)
        if jnp.dtype(table.dtype).itemsize > 4:
            table = table.astype(f32)
    return arrays, table, row_of


def _base2_rows(m: jax.Array, log_l: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""``(m, log2 l, 1.0 where log l = -inf else 0.0)`` of the rows' saved `RowStats`
    (0 in place of a row's without an edge): the backward passes'
    $p = 2^{(s - m) \log_2 e - \log_2 l}$ (`backward_probs` in base 2: the difference
    $s - m$ first, exact where the logits are huge), set to 0 in a row with no edge
    whatever its logits."""
    none = log_l == -jnp.inf
    return (jnp.where(none, 0.0, m), jnp.where(none, 0.0, log_l * _LOG2E),
            jnp.where(none, 1.0, 0.0))


def _walk(named: dict, list_smem, list_bar, pair, wg, live, full):
    """How a program walks its blocks: ``(count, block_of, u_lo, u_hi)``. Steps
    ``u = 0 .. count - 1`` visit blocks ``block_of(u)``: the band's range ``lo .. hi - 1``
    (``live()``), or with a per-edge mask known at trace time the program's row of the
    block lists, ``[full count, partial count, full blocks..., partial blocks...]``
    (copied into ``list_smem`` by the memory warpgroup). Steps ``u_lo .. u_hi - 1`` visit
    blocks whose every edge is allowed (``full()``: that range of blocks, or ``None``),
    which build no mask."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if list_smem is None:
        lo, hi = live()
        f = full()
        u_lo = u_hi = jnp.int32(0)
        if f is not None:
            f_lo = jnp.minimum(jnp.maximum(f[0], lo), hi)
            u_lo, u_hi = f_lo - lo, jnp.maximum(jnp.minimum(f[1], hi), f_lo) - lo
        return hi - lo, (lambda u: lo + u), u_lo, u_hi

    @pl.when(wg == _WGS)
    def _():
        plgpu.copy_gmem_to_smem(named["blocks"].at[pair], list_smem, list_bar.at[0])

    plgpu.barrier_wait(list_bar.at[0])
    n_full = list_smem[0]
    return n_full + list_smem[1], (lambda u: list_smem[2 + u]), jnp.int32(0), n_full


def _stream(steps: int, count, loads: tuple) -> None:
    """The memory warpgroup's pipeline over steps ``u = 0 .. count - 1`` in ``steps``
    slots: ``loads`` are ``(release barrier, load(u, slot))`` pairs. The first slots are
    filled without waiting; slot ``u mod steps`` is refilled, pair by pair, once its
    consumers release it; the last slots' releases are waited for too (every phase of
    a barrier is waited)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def fill(i: int):
        @pl.when(i < count)
        def _():
            for _, load in loads:
                load(jnp.int32(i), i)

    for i in range(steps):
        fill(i)

    @pl.loop(jnp.int32(steps), count)
    def _(u):
        slot = lax.rem(u, jnp.int32(steps))
        for bar, load in loads:
            plgpu.barrier_wait(bar.at[slot])
            load(u, slot)

    @pl.loop(jnp.maximum(count - steps, 0), count)
    def _(u):
        slot = lax.rem(u, jnp.int32(steps))
        for bar, _ in loads:
            plgpu.barrier_wait(bar.at[slot])


def _over_steps(step, carry, u_lo, u_hi, count):
    """``step(u, carry, masked)`` over ``u = 0 .. count - 1``, unmasked on ``u_lo ..
    u_hi - 1`` (`_walk`)."""
    carry = lax.fori_loop(0, u_lo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(u_lo, u_hi, functools.partial(step, masked=False), carry)
    return lax.fori_loop(u_hi, count, functools.partial(step, masked=True), carry)


def _kernel(named: dict, outs: tuple, scoped, *, terms: Terms, lay: Layout, steps: int,
            row_of, nan_rows: bool, dtype, dq: bool = False):
    """One program: children ``pair * 128 ...`` of batch element ``b``, two compute
    warpgroups of 64 children each and a memory warpgroup streaming the parent blocks.
    The forward (``outs``: y and L) or, with ``dq``, the backward's dQ pass (``outs``: dQ
    and, with a geometric prior, the prior's two gradients)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    smem, bars, consumed, schedule = scoped
    (q_smem, o_smem, k_smem, v_smem, lse_smem, rt_smem, bias_smem, geo_smem, list_smem,
     do_smem) = smem
    q_bar, g_bar, k_bar, v_bar, r_bar, b_bar, list_bar, do_bar = bars
    k_cons, v_cons = consumed
    b = lax.axis_index("batch")
    pair = lax.axis_index("q_seq")
    wg = lax.axis_index("wg")
    f32 = jnp.float32
    wgmma_layout, row_layout, col_layout = _layouts(plgpu)
    off = terms.offset
    a = pair * _WGS + wg  # a compute warpgroup's block of _BQ children
    count, block_of, u_lo, u_hi = _walk(
        named, list_smem, list_bar, pair, wg,
        lambda: live_range(terms, pair, _WGS * _BQ, _BK, lay.nkb, off),
        lambda: full_parents(terms, a, _BQ, _BK, off))

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
        i0 = a * _BQ
        q_s = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(named["q"].at[b, pl.ds(i0, _BQ)], q_s, q_bar.at[wg])
        if terms.geometric:
            plgpu.copy_gmem_to_smem(named["geo"].at[b, :, pl.ds(i0, _BQ)], geo_smem.at[wg],
                                    g_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        g0 = g1 = None
        if terms.geometric:
            plgpu.barrier_wait(g_bar.at[wg])
            g0 = _load(plgpu, geo_smem.at[wg, 0], row_layout)
            g1 = _load(plgpu, geo_smem.at[wg, 1], row_layout)

        def logits(slot, j0, masked: bool, turn: bool):
            """The step's logits (``-inf`` on masked edges) and distance grid (``None``
            when not needed); the caller releases the keys' slot. ``turn``: hand the
            tensor cores to the other compute warpgroup after the matmul."""
            def compute_qk(acc_ref):
                plgpu.wgmma(acc_ref, q_s, k_smem.at[slot].transpose((1, 0)))
                if turn:
                    schedule_barrier()
                return acc_ref[...]

            s = pl.run_scoped(compute_qk, plgpu.ACC((_BQ, _BK), f32))
            if terms.dot_scale is not None:
                s = s * terms.dot_scale
            if terms.relpos is not None:  # this warpgroup's rows of the step's tile
                plgpu.barrier_wait(r_bar.at[slot])
                s = s + _load(plgpu, rt_smem.at[slot, pl.ds(wg * _BQ, _BQ)],
                              wgmma_layout).astype(f32)
            if terms.col_bias or terms.col_ok:  # per-parent bias, -inf where masked
                plgpu.barrier_wait(b_bar.at[slot])
                bias = _load(plgpu, bias_smem.at[slot], col_layout)
                s = s + lax.broadcast_in_dim(bias, (_BQ, _BK), [1])
            d = None
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
            return s, d

        def over_steps(step, carry):
            return _over_steps(step, carry, u_lo, u_hi, count)

        if dq:
            do_s = do_smem.at[wg]
            plgpu.copy_gmem_to_smem(named["do"].at[b, pl.ds(i0, _BQ)], do_s, do_bar.at[wg])
            plgpu.copy_gmem_to_smem(named["ld"].at[b, :, pl.ds(i0, _BQ)], lse_smem.at[wg],
                                    do_bar.at[_WGS + wg])
            plgpu.barrier_wait(do_bar.at[wg])
            plgpu.barrier_wait(do_bar.at[_WGS + wg])
            m, l2, none = _base2_rows(_load(plgpu, lse_smem.at[wg, 0], row_layout),
                                      _load(plgpu, lse_smem.at[wg, 1], row_layout))
            delta = _load(plgpu, lse_smem.at[wg, 2], row_layout)
            # p = 2^((s - m) log2 e - log2 l); a row with no edge (log l = -inf) gets
            # p = 0 whatever its logits (as the Triton pass: `backward_probs`)

            def dq_step(u, carry, masked: bool):
                dq_acc, dg0, dg1 = carry
                slot = slot_of(u)
                j0 = block_of(u) * _BK
                plgpu.barrier_wait(k_bar.at[slot])
                s, d = logits(slot, j0, masked, turn=False)
                p = jnp.where(row_bcast(none, s.shape) > 0, 0.0,
                              jnp.exp2((s - row_bcast(m, s.shape)) * _LOG2E
                                       - row_bcast(l2, s.shape)))
                plgpu.barrier_wait(v_bar.at[slot])

                def compute_dp(acc_ref):
                    plgpu.wgmma(acc_ref, do_s, v_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                dp = pl.run_scoped(compute_dp, plgpu.ACC((_BQ, _BK), f32))
                plgpu.barrier_arrive(v_cons.at[slot])
                ds = p * (dp - row_bcast(delta, s.shape))

                def compute_dq(acc_ref):
                    plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])

                dq_acc = pl.run_state(compute_dq)(plgpu.ACC.init(dq_acc))
                plgpu.barrier_arrive(k_cons.at[slot])
                if terms.geometric:
                    dg0 = dg0 + ds.sum(axis=1)
                    dg1 = dg1 + (ds * (d - terms.geo_d0).astype(f32)).sum(axis=1)
                return dq_acc, dg0, dg1

            zero = plgpu.layout_cast(jnp.full((_BQ,), 0.0, f32), row_layout)
            carry = (plgpu.layout_cast(jnp.full((_BQ, lay.fp), 0.0, f32), wgmma_layout),
                     zero, zero)
            dq_acc, dg0, dg1 = over_steps(dq_step, carry)
            if terms.dot_scale is not None:
                dq_acc = dq_acc * terms.dot_scale
            q_s[...] = dq_acc.astype(dtype)  # the queries' buffer, read no more
            if terms.geometric:
                geo_smem.at[wg, 0][...] = dg0
                geo_smem.at[wg, 1][...] = dg1
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_s, outs[0].at[b, pl.ds(i0, _BQ)])
            if terms.geometric:
                plgpu.copy_smem_to_gmem(geo_smem.at[wg], outs[1].at[b, :, pl.ds(i0, _BQ)])
            plgpu.wait_smem_to_gmem(0)
            return

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

            s, _ = logits(slot, j0, masked, turn=True)
            plgpu.barrier_arrive(k_cons.at[slot])

            # the online softmax, in base 2, its maximum m in the logits' units: s - m
            # first (exact where the logits are huge), as the backward recomputes it
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            corr = jnp.exp2((m - m_safe) * _LOG2E)
            p = jnp.exp2((s - row_bcast(m_safe, s.shape)) * _LOG2E)
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

        acc, m, lsum = over_steps(step, (acc, m, lsum))
        pl.when(wg == 0)(schedule_barrier)

        pos = lsum > 0
        l_safe = jnp.where(pos, lsum, 1.0)
        log_l = jnp.where(pos, jnp.log(l_safe), -jnp.inf)  # the rows' `RowStats`: m, log l
        y = acc / row_bcast(l_safe, acc.shape)
        if nan_rows:  # y + NaN in the rows of a non-finite L (|L| < inf: False for NaN)
            lse = jnp.where(pos, m + log_l, -jnp.inf)
            y = y + row_bcast(jnp.where(jnp.abs(lse) < jnp.inf, 0.0, jnp.nan), acc.shape)
        o_s = q_s if o_smem is None else o_smem.at[wg]
        o_s[...] = y.astype(dtype)
        lse_smem.at[wg, 0][...] = m
        lse_smem.at[wg, 1][...] = log_l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, outs[0].at[b, pl.ds(i0, _BQ)])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], outs[1].at[b, :, pl.ds(i0, _BQ)])
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

        _stream(steps, count, ((k_cons, load_k), (v_cons, load_v)))


def mosaic_forward(terms: Terms, prob: Problem, batch_shape: tuple[int, ...], *,
                   max_concurrent_steps: int = 2, nan_rows: bool = False,
                   mask: ConcreteMask | None = None, precision: lax.PrecisionLike = None,
                   stats: bool = False) -> tuple[jax.Array, jax.Array | RowStats]:
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
        stats: return the rows' `RowStats` ($m$ and $\log l$, $L = m + \log l$) in place
            of $L$: what the backward passes read.

    Returns:
        `(y, L)`: `batch + (n, dv)` in the value dtype and `batch + (n,)` in float32;
        with ``stats``, `(y, RowStats)`. A row with no allowed parent has $y = 0$ (NaN
        with ``nan_rows``) and $L = -\infty$ ($\log l = -\infty$).

    Raises:
        ValueError: `mosaic_unsupported` names a reason the kernel cannot run the edge.

    Cost: $O(\text{live blocks}\cdot 64^2 (d + d_v))$ time, $O(n d)$ memory (with a
    relative-position table, $O((n + m) \cdot 64)$ per table for its tiles).
    """
    del precision
    out, rows = _launch(terms, prob, batch_shape, steps=max_concurrent_steps, mask=mask,
                        nan_rows=nan_rows, caller="mosaic_forward")
    lay, n = _layout(terms, prob, batch_shape), terms.num_children
    rows = RowStats(lay.unpad(rows[:, 0], n), lay.unpad(rows[:, 1], n))
    return lay.unpad(out, n, prob.v.shape[-1]), (rows if stats else rows.lse())


def mosaic_dq(terms: Terms, prob: Problem, batch_shape: tuple[int, ...], d_out: jax.Array,
              stats: RowStats, delta: jax.Array,
              mask: ConcreteMask | None = None, *,
              max_concurrent_steps: int = 2) -> tuple[jax.Array, jax.Array | None]:
    r"""The backward's dQ pass in the Mosaic GPU kernel: $\mathrm{d}Q$ and the geometric
    prior's gradients of one edge site.

    FlashAttention-2's second backward pass on the forward's row statistics $m_i$ and
    $\log l_i$ (`RowStats`): per parent block, recomputed,
    $p_{ij} = e^{(\ell_{ij} - m_i) - \log l_i}$ ($0$ in a row with $\log l_i = -\infty$)
    and $\mathrm{d}s_{ij} = p_{ij}(\mathrm{d}y_i^\top V_j - \delta_i)$, then
    $\mathrm{d}Q_i = \sum_j \mathrm{d}s_{ij} K_j$ and, with a geometric prior,
    $\sum_j \mathrm{d}s_{ij}$ and $\sum_j \mathrm{d}s_{ij}(d_{ij} - d_0)$. The schedule
    is the forward's (`mosaic_forward`: a memory warpgroup streams the parent blocks the
    band or the block lists allow; two compute warpgroups of 64 children), with two
    ``wgmma`` per step besides $q k^\top$: $\mathrm{d}y\, V^\top$ and $\mathrm{d}s\, K$.

    Args:
        terms: the static terms of a lowered edge site (as for `mosaic_forward`).
        prob: the arrays those terms read.
        batch_shape: the broadcast batch shape (heads, batch) of the result.
        d_out: the cotangent of $y$, ``batch + (n, dv)``.
        stats: the forward's row statistics $m$ and $\log l$ (`RowStats`, each
            ``batch + (n,)``: the second result of `mosaic_forward` with ``stats=True``);
            its $L$ alone is refused (wrong where float32 rounds $\log l$ out of $L$).
        delta: $\delta_i = \sum_c \mathrm{d}y_{ic} y_{ic} - \mathrm{d}L_i$,
            ``batch + (n,)`` (a row whose $L$ is not finite counts no output term).
        mask: the per-edge mask's value, as for `mosaic_forward`.
        max_concurrent_steps: shared-memory slots of the parent-block pipeline.

    Returns:
        ``(dq, dgeo)``: ``batch + (n, d)`` in the queries' dtype (the gradient with
        respect to ``prob.row.q``, the queries the kernel multiplies), and
        ``batch + (n, 2)`` float32 for a geometric prior's two parameters (``None``
        without one).

    Raises:
        ValueError: the kernel cannot run the edge (its shared memory with the output's
            cotangent, or any reason of `mosaic_unsupported`).

    Reference: Dao, "FlashAttention-2" (2023), Algorithm 2.
    """
    stats = require_row_stats(stats, "mosaic_dq")
    res = _launch(terms, prob, batch_shape, steps=max_concurrent_steps, mask=mask,
                  nan_rows=False, caller="mosaic_dq", rows=(d_out, stats, delta))
    lay, n = _layout(terms, prob, batch_shape), terms.num_children
    dgeo = None
    if terms.geometric:  # (B, 2, n_pad) -> batch + (n, 2)
        dgeo = lay.unpad(jnp.swapaxes(res[1], 1, 2), n, 2)
    return lay.unpad(res[0], n, prob.row.q.shape[-1]), dgeo


def mosaic_dq_unsupported(terms: Terms, prob: Problem, batch_shape: tuple[int, ...],
                          mask: ConcreteMask | None = None) -> str | None:
    """Why `mosaic_dq` cannot run this edge with two slots, or `None` when it can."""
    return _plan(terms, prob, batch_shape, mask, 2, dq=True)[0]


def _dkdv_layout(terms: Terms, prob: Problem, batch_shape) -> Layout:
    """The dK/dV pass's blocks: ``_BK`` children per step, ``_WGS * _BQ`` parents per
    program (``_BQ`` per compute warpgroup)."""
    return Layout(terms, prob, batch_shape, _BK, _WGS * _BQ, min_dim=64)


def _dkdv_smem_bytes(terms: Terms, prob: Problem, lay: Layout, steps: int,
                     lists: int = 0, table_grad: bool = False) -> int:
    r"""Shared memory of one dK/dV program: keys and values (then dK and dV) of its
    parents, ``steps`` slots of queries, output cotangents, the rows' m, log l and delta and
    the step's tiles of the prior (float32 with ``table_grad``: they hold the tile's
    $\mathrm{d}s$ too), the block list and the compiler's own."""
    item = jnp.dtype(prob.v.dtype).itemsize
    total = _WGS * _BQ * (lay.fp + lay.dvp) * item + _WGS * _BQ * 4
    total += steps * _BK * ((lay.fp + lay.dvp) * item + 3 * 4)
    if terms.relpos is not None:
        tile = 4 if table_grad else min(jnp.dtype(prob.glob.relpos.dtype).itemsize, 4)
        total += steps * _WGS * _BQ * _BK * tile
    if terms.geometric:
        total += steps * 2 * _BK * 4
    return total + 4 * lists + _SMEM_SLACK


def _dkdv_plan(terms: Terms, prob: Problem, batch_shape, mask: ConcreteMask | None,
               steps: int, table_grad: bool = False
               ) -> tuple[str | None, Layout | None, np.ndarray | None]:
    """``(why not, layout, block lists)`` of a dK/dV launch, as `_plan`; with
    ``table_grad``, one that also sums the relative-position table's gradient."""
    why, lay = _unsupported(terms, prob, mask, (_BK, _WGS * _BQ),
                            lambda: _dkdv_layout(terms, prob, batch_shape))
    if why:
        return why, None, None
    if prob.col.k.shape[:-2] != lay.batch or prob.v.shape[:-2] != lay.batch:
        return ("keys or values shared by some batch dim (the Triton pass sums their "
                "gradients in float32)"), None, None
    if table_grad:
        why = _table_grad_missing(terms)
        if why:
            return why, None, None
    lists = _block_lists(terms, mask, lay, by_parent=True) if terms.pair_ok else None
    if isinstance(lists, str):
        return lists, None, None
    need = _dkdv_smem_bytes(terms, prob, lay, steps, 0 if lists is None else lists.shape[1],
                            table_grad)
    why = _over_smem(need, steps, "the dK/dV pass's tiles" + (
        " (float32, for the table's gradient)" if table_grad else ""))
    return (why, None, None) if why else (None, lay, lists)


def _table_grad_missing(terms: Terms) -> str | None:
    """Why the dK/dV pass cannot sum the relative-position table's gradient (besides its
    shared memory): no table, or a JAX without what the sum is built of (``pl.kernel``
    on a Mosaic GPU mesh, ``pl.run_state``, TMA reductions)."""
    if terms.relpos is None:
        return "no relative-position table"
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    missing = [name for obj, name in ((pl, "kernel"), (pl, "run_state"), (plgpu, "Mesh"))
               if getattr(obj, name, None) is None]
    if not missing and (_param(pl.kernel, "out_type") is None
                        or _param(plgpu.copy_smem_to_gmem, "reduction_op") is None):
        missing = ["pl.kernel(out_type=) or copy_smem_to_gmem(reduction_op=)"]
    if missing:
        return (f"this JAX ({jax.__version__}) lacks {', '.join(missing)} (the sum across "
                "programs)")
    return None


def mosaic_dkdv_unsupported(terms: Terms, prob: Problem, batch_shape: tuple[int, ...],
                            mask: ConcreteMask | None = None, *,
                            table_grad: bool = False) -> str | None:
    """Why `mosaic_dkdv` cannot run this edge with two slots (with ``table_grad``: and
    sum the relative-position table's gradient), or `None` when it can."""
    return _dkdv_plan(terms, prob, batch_shape, mask, 2, table_grad)[0]


def mosaic_dkdv(terms: Terms, prob: Problem, batch_shape: tuple[int, ...], d_out: jax.Array,
                stats: RowStats, delta: jax.Array,
                mask: ConcreteMask | None = None, *,
                max_concurrent_steps: int = 2, table_grad: bool = False
                ) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    r"""The backward's dK/dV pass in the Mosaic GPU kernel: $\mathrm{d}K$, $\mathrm{d}V$
    and the per-parent bias' gradient of one edge site.

    FlashAttention-2's first backward pass, transposed: each program takes 128 parents
    (64 per compute warpgroup, their keys and values held in shared memory) and a memory
    warpgroup streams the child blocks of 64 that the band or the block lists allow
    (queries, output cotangents, $L$ and $\delta$, the geometric prior's parameters,
    the step's relative-position tiles). Per step, recomputed,
    $p_{ji} = e^{\ell_{ij} - L_i}$ ($0$ where $L_i = -\infty$) and $\mathrm{d}s_{ji} =
    p_{ji}(V_j^\top \mathrm{d}y_i - \delta_i)$, then $\mathrm{d}V_j \mathrel{+}=
    \sum_i p_{ji}\,\mathrm{d}y_i$, $\mathrm{d}K_j \mathrel{+}= \sum_i
    \mathrm{d}s_{ji}\, q_i$ and the bias' $\sum_i \mathrm{d}s_{ji}$: four ``wgmma``
    per step.

    With ``table_grad``, the relative-position table's gradient $\partial/\partial b_r =
    \sum_{ij:\, r(d_{ij}) = r} \mathrm{d}s_{ij}$ too, with no pass of its own: a step's
    tile of $\mathrm{d}s$ (64 parents x 64 children, one block diagonal, so one
    distance grid) replaces the step's relative-position tile in shared memory, whose
    values were read already, and is added by the tensor memory accelerator (a TMA
    reduction) into that block diagonal's float32 tile of a per-table sum, shared by
    every program; the tiles are then summed along their diagonals into the table
    (`structinfer.lowering.accel.relpos_tiles_grad`). The tiles must be float32 for that
    (the lowering gives 16-bit models a float32 table; a wider one is rounded to it), and,
    float32 additions in hardware order, the gradient is not bit-reproducible from run to
    run (nor is the Triton pass's). Under `jax.vmap` each mapped element has its own sum
    (float32, the size of the table's tiles: about $(n + m) \cdot 64$ entries per
    table), which the launch's memory grows with.

    Args:
        terms: the static terms of a lowered edge site (as for `mosaic_forward`).
        prob: the arrays those terms read.
        batch_shape: the broadcast batch shape (heads, batch) of the result.
        d_out: the cotangent of $y$, ``batch + (n, dv)``.
        stats: the forward's row statistics $m$ and $\log l$ (`RowStats`, each
            ``batch + (n,)``: the second result of `mosaic_forward` with ``stats=True``);
            its $L$ alone is refused (wrong where float32 rounds $\log l$ out of $L$).
        delta: $\delta_i$ per child, ``batch + (n,)`` (as for `mosaic_dq`).
        mask: the per-edge mask's value when known at trace time (block lists of child
            blocks of 64 per 128 parents: masks on blocks of multiples of 128 run).
        max_concurrent_steps: shared-memory slots of the child-block pipeline.
        table_grad: sum the relative-position table's gradient too (above).

    Returns:
        ``(dk, dv, dbias, dtable)``: ``batch + (m, d)`` and ``batch + (m, dv)`` in the
        inputs' dtype, ``batch + (m,)`` float32 for a per-parent bias (``None`` without
        one), and with ``table_grad`` the table's gradient, shaped like
        ``prob.glob.relpos``, float32 (``None`` without).

    Raises:
        ValueError: the kernel cannot run the edge (`mosaic_dkdv_unsupported`, with
            ``table_grad`` when given).

    Reference: Dao, "FlashAttention-2" (2023), Algorithm 2.
    """
    stats = require_row_stats(stats, "mosaic_dkdv")
    steps = max_concurrent_steps
    if steps < 2:
        raise ValueError(f"mosaic_dkdv: max_concurrent_steps={steps}, expected at least 2")
    why, lay, lists = _dkdv_plan(terms, prob, batch_shape, mask, steps, table_grad)
    if why:  # (also a JAX without Mosaic GPU: said before importing it)
        raise ValueError(f"mosaic_dkdv: {why}")
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    _check_rows("mosaic_dkdv", terms, prob, lay, d_out, stats, delta)
    dtype = prob.v.dtype
    f32 = jnp.float32
    arrays, table, row_of = _operands(terms, prob, lay, lists, (d_out, stats, delta))
    sums = None
    if table is not None:  # square tiles, transposed: parents x children
        if table_grad:  # float32: the step's tile of ds takes its place
            table = table.astype(f32)
        tiles = relpos_tiles(terms, table, _BK, _BK, lay.n_pad, lay.m_pad)
        arrays["rtiles"] = jnp.swapaxes(tiles, -1, -2)
        if table_grad:
            sums = {"dtable": jax.ShapeDtypeStruct(tiles.shape, f32)}
    col_grad = bool(terms.col_bias)

    def tiled(shape):
        return _swizzled(shape, dtype)

    def entry(named, outs):
        rt = None
        if terms.relpos is not None:
            rt = _swizzled((steps, _WGS, _BK, _BK), arrays["rtiles"].dtype)
        smem = (
            tiled((_WGS, _BQ, lay.fp)),  # keys, then dK
            tiled((_WGS, _BQ, lay.dvp)),  # values, then dV
            plgpu.SMEM((_WGS, _BQ), f32),  # bias, then its gradient
            tiled((steps, _BK, lay.fp)),  # queries
            tiled((steps, _BK, lay.dvp)),  # output cotangents
            plgpu.SMEM((steps, 3, _BK), f32),  # m, log l, delta
            plgpu.SMEM((steps, 2, _BK), f32) if terms.geometric else None,
            rt,
            plgpu.SMEM(arrays["blocks"].shape[1:], jnp.int32) if "blocks" in named else None,
        )
        bars = (plgpu.Barrier(num_barriers=3 * _WGS),  # keys, values, bias per warpgroup
                *(plgpu.Barrier(num_barriers=steps) for _ in range(4)),
                plgpu.Barrier(num_barriers=_WGS * steps),  # a tile per warpgroup and slot
                plgpu.Barrier(num_barriers=1) if "blocks" in named else None)
        pl.run_scoped(
            lambda *scoped: _dkdv_kernel(named, outs, scoped, terms=terms, lay=lay,
                                         steps=steps, row_of=row_of, dtype=dtype,
                                         col_grad=col_grad, table_grad=table_grad),
            smem, bars, plgpu.Barrier(num_arrivals=_WGS, num_barriers=steps),
            collective_axes="wg",
        )

    out_types = [jax.ShapeDtypeStruct((lay.B, lay.m_pad, lay.fp), dtype),
                 jax.ShapeDtypeStruct((lay.B, lay.m_pad, lay.dvp), dtype)]
    if col_grad:
        out_types.append(jax.ShapeDtypeStruct((lay.B, lay.m_pad), f32))
    res = _kernel_call(entry, out_types, arrays, (lay.B, lay.nkb), "kv_seq", sums)
    m = terms.num_parents
    dtable = None
    if table_grad:  # (R, C, parents, children) -> the table's (R, L) -> its shape
        rel = prob.glob.relpos
        dtable = relpos_tiles_grad(terms, jnp.swapaxes(res[-1], -1, -2), rel.shape[-1],
                                   lay.n_pad, lay.m_pad).reshape(rel.shape)
    return (lay.unpad(res[0], m, prob.col.k.shape[-1]), lay.unpad(res[1], m, prob.v.shape[-1]),
            lay.unpad(res[2], m) if col_grad else None, dtable)


def _dkdv_kernel(named: dict, outs: tuple, scoped, *, terms: Terms, lay: Layout, steps: int,
                 row_of, dtype, col_grad: bool, table_grad: bool):
    """One dK/dV program: parents ``pair * 128 ...`` of batch element ``b``, two compute
    warpgroups of 64 parents each and a memory warpgroup streaming the child blocks;
    with ``table_grad`` each step's tile of ds is added into ``named["dtable"]``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    smem, bars, consumed = scoped
    k_smem, v_smem, bias_smem, q_smem, do_smem, ld_smem, geo_smem, rt_smem, list_smem = smem
    own_bar, q_bar, do_bar, ld_bar, g_bar, r_bar, list_bar = bars
    b = lax.axis_index("batch")
    pair = lax.axis_index("kv_seq")
    wg = lax.axis_index("wg")
    f32 = jnp.float32
    wgmma_layout, row_layout, col_layout = _layouts(plgpu)
    off = terms.offset
    nqb = lay.n_pad // _BK
    count, block_of, u_lo, u_hi = _walk(
        named, list_smem, list_bar, pair, wg,
        lambda: live_children(terms, pair, _BK, _WGS * _BQ, nqb, off),
        lambda: full_children(terms, pair, _BK, _WGS * _BQ, nqb, off))

    def slot_of(u):
        return lax.rem(u, jnp.int32(steps))

    def col_bcast(x, shape):
        return lax.broadcast_in_dim(x, shape, [1])

    @pl.when(wg < _WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        j0 = (pair * _WGS + wg) * _BQ  # this warpgroup's parents
        k_s, v_s = k_smem.at[wg], v_smem.at[wg]
        plgpu.copy_gmem_to_smem(named["k"].at[b, pl.ds(j0, _BQ)], k_s, own_bar.at[wg])
        plgpu.copy_gmem_to_smem(named["v"].at[b, pl.ds(j0, _BQ)], v_s, own_bar.at[_WGS + wg])
        if "bias" in named:
            plgpu.copy_gmem_to_smem(named["bias"].at[b, pl.ds(j0, _BQ)], bias_smem.at[wg],
                                    own_bar.at[2 * _WGS + wg])
        plgpu.barrier_wait(own_bar.at[wg])
        plgpu.barrier_wait(own_bar.at[_WGS + wg])
        bias = None
        if "bias" in named:
            plgpu.barrier_wait(own_bar.at[2 * _WGS + wg])
            bias = _load(plgpu, bias_smem.at[wg], row_layout)

        def step(u, carry, masked: bool):
            dk, dv, db = carry
            slot = slot_of(u)
            i0 = block_of(u) * _BK
            q_s, do_s = q_smem.at[slot], do_smem.at[slot]
            plgpu.barrier_wait(q_bar.at[slot])

            def compute_st(acc_ref):
                plgpu.wgmma(acc_ref, k_s, q_s.transpose((1, 0)))
                return acc_ref[...]

            st = pl.run_scoped(compute_st, plgpu.ACC((_BQ, _BK), f32))  # parents x children
            if terms.dot_scale is not None:
                st = st * terms.dot_scale
            if terms.relpos is not None:  # this warpgroup's tile of the step
                plgpu.barrier_wait(r_bar.at[wg * steps + slot])
                st = st + _load(plgpu, rt_smem.at[slot, wg], wgmma_layout).astype(f32)
            if bias is not None:  # per-parent bias, -inf where masked
                st = st + lax.broadcast_in_dim(bias, (_BQ, _BK), [0])
            d = None
            if terms.geometric or masked:
                rows = plgpu.broadcasted_iota(jnp.int32, (_BQ, _BK), 0, layout=wgmma_layout)
                cols = plgpu.broadcasted_iota(jnp.int32, (_BQ, _BK), 1, layout=wgmma_layout)
                d = cols - rows + (i0 + off - j0)
            if terms.geometric:
                plgpu.barrier_wait(g_bar.at[slot])
                g0 = _load(plgpu, geo_smem.at[slot, 0], col_layout)
                g1 = _load(plgpu, geo_smem.at[slot, 1], col_layout)
                st = st + geometric_log_prior(col_bcast(g0, st.shape), col_bcast(g1, st.shape),
                                              d - terms.geo_d0)
            if masked:
                band = band_ok(terms, d)
                if band is not None:
                    st = jnp.where(band, st, -jnp.inf)
            plgpu.barrier_wait(ld_bar.at[slot])
            m, l2, none = _base2_rows(_load(plgpu, ld_smem.at[slot, 0], col_layout),
                                      _load(plgpu, ld_smem.at[slot, 1], col_layout))
            delta = _load(plgpu, ld_smem.at[slot, 2], col_layout)
            pt = jnp.where(col_bcast(none, st.shape) > 0, 0.0,
                           jnp.exp2((st - col_bcast(m, st.shape)) * _LOG2E
                                    - col_bcast(l2, st.shape)))
            plgpu.barrier_wait(do_bar.at[slot])

            def compute_dv_dpt(refs):
                dv_ref, dpt_ref = refs
                plgpu.wgmma(dv_ref, pt.astype(dtype), do_s)
                plgpu.wgmma(dpt_ref, v_s, do_s.transpose((1, 0)))

            zeros = plgpu.layout_cast(jnp.full((_BQ, _BK), 0.0, f32), wgmma_layout)
            dv, dpt = pl.run_state(compute_dv_dpt)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))
            dst = pt * (dpt - col_bcast(delta, st.shape))

            def compute_dk(acc_ref):
                plgpu.wgmma(acc_ref, dst.astype(dtype), q_s)

            dk = pl.run_state(compute_dk)(plgpu.ACC.init(dk))
            if col_grad:
                db = db + dst.sum(axis=1)
            if table_grad:  # the tile's ds into its block diagonal's tile of the sum
                if lay.m_pad != terms.num_parents:  # not the padded parents'
                    rows = plgpu.broadcasted_iota(jnp.int32, (_BQ, _BK), 0,
                                                  layout=wgmma_layout)
                    dst = jnp.where(rows < terms.num_parents - j0, dst, 0.0)
                rt = rt_smem.at[slot, wg]  # its relative-position values are read
                rt[...] = dst
                plgpu.commit_smem()
                c = lax.div(i0 - j0 + (lay.m_pad - _BK), jnp.int32(_BK))
                plgpu.copy_smem_to_gmem(rt, named["dtable"].at[row_of(b), c],
                                        reduction_op="add")
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # before the slot's refill
            plgpu.barrier_arrive(consumed.at[slot])
            return dk, dv, db

        carry = (plgpu.layout_cast(jnp.full((_BQ, lay.fp), 0.0, f32), wgmma_layout),
                 plgpu.layout_cast(jnp.full((_BQ, lay.dvp), 0.0, f32), wgmma_layout),
                 plgpu.layout_cast(jnp.full((_BQ,), 0.0, f32), row_layout))
        dk, dv, db = _over_steps(step, carry, u_lo, u_hi, count)
        if terms.dot_scale is not None:
            dk = dk * terms.dot_scale
        k_s[...] = dk.astype(dtype)  # the keys' and values' buffers, read no more
        v_s[...] = dv.astype(dtype)
        if col_grad:
            bias_smem.at[wg][...] = db
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_s, outs[0].at[b, pl.ds(j0, _BQ)])
        plgpu.copy_smem_to_gmem(v_s, outs[1].at[b, pl.ds(j0, _BQ)])
        if col_grad:
            plgpu.copy_smem_to_gmem(bias_smem.at[wg], outs[2].at[b, pl.ds(j0, _BQ)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        j_pair = pair * (_WGS * _BQ)

        def load(u, slot):
            i0 = block_of(u) * _BK
            plgpu.copy_gmem_to_smem(named["q"].at[b, pl.ds(i0, _BK)], q_smem.at[slot],
                                    q_bar.at[slot])
            if terms.relpos is not None:  # each warpgroup's tile: block diagonal c - w
                c = lax.div(i0 - j_pair + (lay.m_pad - _BK), jnp.int32(_BK))
                for w in range(_WGS):
                    plgpu.copy_gmem_to_smem(named["rtiles"].at[row_of(b), c - w],
                                            rt_smem.at[slot, w], r_bar.at[w * steps + slot])
            if terms.geometric:
                plgpu.copy_gmem_to_smem(named["geo"].at[b, :, pl.ds(i0, _BK)],
                                        geo_smem.at[slot], g_bar.at[slot])
            plgpu.copy_gmem_to_smem(named["ld"].at[b, :, pl.ds(i0, _BK)], ld_smem.at[slot],
                                    ld_bar.at[slot])
            plgpu.copy_gmem_to_smem(named["do"].at[b, pl.ds(i0, _BK)], do_smem.at[slot],
                                    do_bar.at[slot])

        _stream(steps, count, ((consumed, load),))


def mosaic_backward(terms: Terms, prob: Problem, batch_shape: tuple[int, ...],
                    out: jax.Array, stats: RowStats, d_out: jax.Array,
                    d_lse: jax.Array, **kw) -> tuple[dict, dict, dict, dict, jax.Array]:
    r"""The backward with its dK/dV and dQ passes in the Mosaic GPU kernel (`mosaic_dkdv`,
    `mosaic_dq`; the dK/dV pass sums a trained relative-position table's gradient too)
    through `structinfer.lowering.accel.pallas_backward`, whose arguments and result it
    takes; the Triton kernel's pass where a Mosaic GPU pass cannot run the edge (its
    shared memory, a shard's traced offsets), and its table pass where the dK/dV pass
    cannot sum the table's gradient (`mosaic_backward_refusals`). The gradients are those
    `pallas_backward` documents: $\mathrm{d}Q$, $\mathrm{d}K$, $\mathrm{d}V$ and the prior's
    parameters' from the forward's `RowStats` ``stats`` (`mosaic_forward` with
    ``stats=True``; its $L$ alone is refused with a ``TypeError``),
    $p_{ij} = e^{(\ell_{ij} - m_i) - \log l_i}$ and
    $\mathrm{d}s_{ij} = p_{ij}(\mathrm{d}y_i^\top V_j - \delta_i)$.

    Reference: Dao, "FlashAttention-2" (2023), Algorithm 2; Shah et al.,
    "FlashAttention-3" (2024) for the warp-specialised schedule.
    """
    stats = require_row_stats(stats, "mosaic_backward")
    if kw.get("starts") is None:
        refused = mosaic_backward_refusals(terms, prob, batch_shape, kw.get("mask"))
        if "dQ" not in refused:
            kw["dq_pass"] = mosaic_dq
        if "dK/dV" not in refused:
            kw["dkdv_pass"] = functools.partial(_dkdv_pass, table_ok="table" not in refused)
    return pallas_backward(terms, prob, batch_shape, out, stats, d_out, d_lse, **kw)


def _dkdv_pass(terms, prob, batch_shape, d_out, stats, delta, mask, *, table_grad: bool,
               table_ok: bool):
    """`mosaic_dkdv` as `pallas_backward`'s ``dkdv_pass``: it sums the relative-position
    table's gradient when asked to and ``table_ok`` (else the Triton pass does)."""
    return mosaic_dkdv(terms, prob, batch_shape, d_out, stats, delta, mask,
                       table_grad=table_grad and table_ok)


def mosaic_backward_refusals(terms: Terms, prob: Problem, batch_shape: tuple[int, ...],
                             mask: ConcreteMask | None = None) -> dict[str, str]:
    """What of `mosaic_backward`'s work the Triton kernel does on this edge instead of the
    Mosaic GPU kernel, with why: ``"dQ"`` and ``"dK/dV"`` for the passes
    `mosaic_dq_unsupported` / `mosaic_dkdv_unsupported` refuse, and ``"table"`` for a
    relative-position table's gradient that the dK/dV pass cannot sum (its own pass
    then); empty when everything runs in Mosaic GPU."""
    why = {"dQ": mosaic_dq_unsupported(terms, prob, batch_shape, mask),
           "dK/dV": mosaic_dkdv_unsupported(terms, prob, batch_shape, mask)}
    if terms.relpos is not None:
        why["table"] = ("the Triton kernel runs the dK/dV pass, so its table pass sums it"
                        if why["dK/dV"] else
                        mosaic_dkdv_unsupported(terms, prob, batch_shape, mask,
                                                table_grad=True))
    return {name: reason for name, reason in why.items() if reason}


def _launch(terms: Terms, prob: Problem, batch_shape, *, steps: int, mask, nan_rows: bool,
            caller: str, rows: dict | None = None) -> list[jax.Array]:
    """Launch `_kernel` on the edge: the forward's padded ``[y, (m, log l)]`` (the
    latter ``(B, 2, n_pad)``), or with ``rows`` (the backward's ``(do, stats, delta)``
    per child, batch-shaped) the dQ pass's padded
    ``[dQ]`` (and ``[dg]``, ``(B, 2, n_pad)``, with a geometric prior)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    dq = rows is not None
    if steps < 2:
        raise ValueError(f"{caller}: max_concurrent_steps={steps}, expected at least 2")
    why, lay, lists = _plan(terms, prob, batch_shape, mask, steps, dq=dq)
    if why:
        raise ValueError(f"{caller}: {why}")
    if dq:
        _check_rows(caller, terms, prob, lay, *rows)
    arrays, table, row_of = _operands(terms, prob, lay, lists, rows)
    if table is not None:
        arrays["rtiles"] = relpos_tiles(terms, table, lay.bq, lay.bk, lay.n_pad, lay.m_pad)
    dtype = prob.v.dtype

    def tiled(shape):
        return _swizzled(shape, dtype)

    def entry(named, outs):
        rt = None
        if terms.relpos is not None:
            rt = _swizzled((steps, _WGS * _BQ, _BK), arrays["rtiles"].dtype)
        smem = (
            tiled((_WGS, _BQ, lay.fp)),
            None if dq or lay.fp == lay.dvp else tiled((_WGS, _BQ, lay.dvp)),
            tiled((steps, _BK, lay.fp)),
            tiled((steps, _BK, lay.dvp)),
            # the rows' m and log l (and the backward's delta)
            plgpu.SMEM((_WGS, 2 + dq, _BQ), jnp.float32),
            rt,
            plgpu.SMEM((steps, _BK), jnp.float32) if "bias" in named else None,
            plgpu.SMEM((_WGS, 2, _BQ), jnp.float32) if terms.geometric else None,
            plgpu.SMEM(arrays["blocks"].shape[1:], jnp.int32) if "blocks" in named else None,
            tiled((_WGS, _BQ, lay.dvp)) if dq else None,
        )
        bars = (plgpu.Barrier(num_barriers=_WGS), plgpu.Barrier(num_barriers=_WGS),
                *(plgpu.Barrier(num_barriers=steps) for _ in range(4)),
                plgpu.Barrier(num_barriers=1) if "blocks" in named else None,
                plgpu.Barrier(num_barriers=2 * _WGS) if dq else None)
        consumed = (plgpu.Barrier(num_arrivals=_WGS, num_barriers=steps),) * 2
        pl.run_scoped(
            lambda *scoped: _kernel(named, outs, scoped, terms=terms, lay=lay, steps=steps,
                                    row_of=row_of, nan_rows=bool(nan_rows), dtype=dtype,
                                    dq=dq),
            smem, bars, consumed, plgpu.Barrier(num_arrivals=_WGS),
            collective_axes="wg",
        )

    if dq:
        out_types = [jax.ShapeDtypeStruct((lay.B, lay.n_pad, lay.fp), dtype)]
        if terms.geometric:
            out_types.append(jax.ShapeDtypeStruct((lay.B, 2, lay.n_pad), jnp.float32))
    else:
        out_types = [jax.ShapeDtypeStruct((lay.B, lay.n_pad, lay.dvp), dtype),
                     jax.ShapeDtypeStruct((lay.B, 2, lay.n_pad), jnp.float32)]
    return _kernel_call(entry, out_types, arrays, (lay.B, lay.nqb), "q_seq")
