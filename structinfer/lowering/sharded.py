r"""Multi-device attention with ``jax.shard_map``: head/batch sharding and ring attention.

**Head / batch sharding.** The leading batch axis (heads or batch) is split over
a mesh axis; each device runs, on its slice, the kernel of the kernel table
(`structinfer.lowering.kernels.KERNELS`) the single-device path chose: on a GPU cuDNN or
the Pallas kernel, on a CPU the dense, blocked or windowed kernel. Arrays that are
broadcast along that axis (a key shared by all heads) are replicated.

**Sequence parallelism (ring attention).** Children and parents are split into
$D$ contiguous chunks, one per device. Device $r$ keeps its
children and, over $D$ steps, sees every parent chunk as the parent
arrays travel round the ring (``lax.ppermute``). Each step is a flash forward of
the chunk pair with *global* indices (so relative-position, geometric and band priors
are computed exactly): the Pallas kernel's passes where the chosen kernel is a fused one
(cuDNN or Pallas: its entry's ``ring_step``), the blocked kernel otherwise. The partial
results are merged by their rows' statistics, the largest logit $m$ and $\log l$
($L = m + \log l$), with the log-sum-exp rule

$$
m = \max(m_a, m_b), \quad
l = e^{m_a - m} l_a + e^{m_b - m} l_b, \quad
y = \big(e^{m_a - m} l_a\, y_a + e^{m_b - m} l_b\, y_b\big) / l
$$

(the online softmax's merge, shared with the single-device kernels:
`_softmax.online_merge`; merging by $L$ alone would lose $\log l$ to rounding where
a row's logits are huge, and weigh every chunk alike), so the gradient reaches each step
through its $\log l$, whose cotangent is its log-normaliser's, as well as its output,
and each step's backward rebuilds its probabilities from its own $m$ and $\log l$.
Chunk pairs that a distance band forbids entirely are skipped (``lax.cond``).
Memory per device is $O((n + m) d / D)$ plus the kernel's block. Both are
differentiable (the ring by autodiff through ``ppermute``; each chunk by the
kernel's custom VJP, whose backward takes the cotangent of $\log l$ as that of $L$).
Liu et al., "Ring attention with blockwise transformers" (2023).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._lower import Lowered
from ._softmax import RowStats, online_merge, with_nan_rows
from ._spec import Problem, Terms, accum_dtype
from .blocked import blocked_attention, make_schedule
from .kernels import KERNELS, KernelConfig

__all__ = ["head_sharded_attention", "ring_attention", "head_sharded", "sequence_sharded",
           "ring_step_kernel", "ShardedRunner", "SHARDS"]

#: the accepted values of ``shard``: split the leading plate (heads / batch), or run ring
#: attention over the sequence
SHARDS = ("heads", "sequence")


def _shard_map_unchecked():
    """``shard_map`` without its replication check, on every supported JAX: the top-level
    ``jax.shard_map`` (whose ``check_rep`` became ``check_vma``) where the release has it,
    ``jax.experimental.shard_map.shard_map`` before."""
    sm = getattr(jax, "shard_map", None)
    if sm is None:  # JAX < 0.6
        from jax.experimental.shard_map import shard_map as sm
    check = "check_vma" if "check_vma" in inspect.signature(sm).parameters else "check_rep"
    return functools.partial(sm, **{check: False})


_shard_map = _shard_map_unchecked()


def _axis(mesh: Mesh, axis_name: str | None) -> str:
    """The mesh axis to shard over: ``axis_name``, or the mesh's only axis; ``mesh`` and
    ``axis_name`` checked."""
    if not isinstance(mesh, Mesh):
        raise TypeError("mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((4,), ('x',))), "
                        f"got {type(mesh).__name__}")
    if axis_name is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"mesh has axes {mesh.axis_names}: pass axis_name to choose the one to shard over"
            )
        return mesh.axis_names[0]
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh: expected one of "
                         f"{mesh.axis_names}")
    return axis_name


def _devices(ndev: int, ax: str) -> str:
    return f"{ndev} device{'s' if ndev != 1 else ''} of mesh axis '{ax}'"


def _check_heads(batch: tuple[int, ...], ndev: int, ax: str, site: str | None) -> None:
    """Head / batch sharding needs a leading batch dim the mesh axis divides."""
    if batch and batch[0] % ndev == 0:
        return
    where = f"edge site '{site}': " if site else ""
    raise ValueError(
        f"{where}shard='heads' splits the leading batch dim (the outermost plate: heads / "
        f"batch) over the {_devices(ndev, ax)}: expected it divisible by {ndev}, got batch "
        f"shape {batch}" + ("" if batch else " (no plate to split: use shard='sequence')"))


def _check_sequence(n: int, m: int, ndev: int, ax: str, site: str | None) -> None:
    """Ring attention needs children and parents the mesh axis divides."""
    if n % ndev == 0 and m % ndev == 0:
        return
    where = f"edge site '{site}': " if site else ""
    raise ValueError(
        f"{where}ring attention (shard='sequence') splits the children and the parents over "
        f"the {_devices(ndev, ax)}: expected both divisible by {ndev}, got {n} children and "
        f"{m} parents")


def _placed(mesh: Mesh, specs, tree):
    """On a mesh with explicit axes, reshard the arguments to the ``in_specs`` first."""
    axis_type = getattr(jax.sharding, "AxisType", None)  # JAX >= 0.5: explicit axes
    if axis_type is None or not any(
            t == axis_type.Explicit for t in getattr(mesh, "axis_types", ())):
        return tree
    return jax.tree.map(
        lambda s, x: jax.reshard(x, NamedSharding(mesh, s)), specs, tree,
        is_leaf=lambda s: isinstance(s, P),
    )


def head_sharded_attention(
    terms: Terms,
    prob: Problem,
    batch_shape: tuple[int, ...],
    mesh: Mesh,
    axis_name: str | None = None,
    *,
    block_q: int = 256,
    block_k: int = 256,
    mask=None,
    precision=None,
    kernel: str = "blocked",
    site: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Attention with the leading batch axis (heads / batch) split over devices.

    Each device runs the table's kernel ``kernel`` on its slice of the batch.

    Args:
        terms, prob, batch_shape: a lowered edge site (see `blocked_attention`).
        mesh: a ``jax.sharding.Mesh``; ``axis_name`` the axis to shard over (default: the
            only one). ``batch_shape[0]`` must be divisible by its size.
        block_q, block_k, mask, precision: as `blocked_attention`'s (the blocked kernel
            narrows its blocks for a narrow distance band, `band_blocks`, as on one
            device).
        kernel: a key of `structinfer.lowering.kernels.KERNELS` (``"dense"``,
            ``"blocked"``, ``"windowed"``, ``"cudnn"``, ``"pallas"``).
        site: the edge site's name, for error messages.

    Returns:
        ``(y, L)`` as the kernel's, sharded along the leading axis; rows whose ``L`` is
        not finite are NaN in ``y`` (whatever the kernel).

    Raises:
        TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
        ValueError: ``axis_name`` is not an axis of the mesh (or is ``None`` on a mesh of
            several axes), ``kernel`` is not in the table or cannot run the edge, or the
            leading batch dim is not divisible by the number of devices (naming the edge
            site).
    """
    entry = _entry(kernel, Lowered(terms, prob, batch_shape, mask))
    ax = _axis(mesh, axis_name)
    ndev = mesh.shape[ax]
    batch = tuple(batch_shape)
    _check_heads(batch, ndev, ax, site)
    local = (batch[0] // ndev,) + batch[1:]

    def spec(x, core):
        nb = x.ndim - core
        return P(ax) if nb == len(batch) and x.shape[0] == batch[0] else P()

    def specs(group, core):
        return jax.tree.map(lambda x: spec(x, core), group)

    groups = (prob.row, prob.col, prob.pair, prob.glob, prob.const)
    in_specs = (specs(prob.row, 2), specs(prob.col, 2), specs(prob.pair, 2),
                specs(prob.glob, 1),
                prob.const.map(lambda x: spec(x, 2), lambda x: spec(x, 1)), spec(prob.v, 2))

    config = KernelConfig(block_q, block_k, precision)

    def body(row, col, pair, glob, const, v):
        p = Problem(row, col, pair, glob, const, v)
        y, lse = entry.run(Lowered(terms, p, local, mask), p, local, config)
        if not entry.nan_rows:
            y = with_nan_rows(y, lse, pass_through=entry.rows_allowed)
        return y, lse

    f = _shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(ax), P(ax)))
    return f(*_placed(mesh, in_specs, (*groups, prob.v)))


def _entry(kernel: str, lowered: Lowered):
    """The table entry ``kernel``, checked to run ``lowered``."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {kernel!r}")
    why = KERNELS[kernel].unsupported(lowered)
    if why:
        raise ValueError(f"kernel {kernel!r} cannot run this edge: {why}")
    return KERNELS[kernel]


def ring_step_kernel(kernel: str, lowered: Lowered) -> str:
    """The kernel each step of ring attention runs for an edge whose single-device
    kernel is ``kernel``.

    Args:
        kernel: a key of `structinfer.lowering.kernels.KERNELS`, the edge's kernel on one
            device.
        lowered: the lowered edge site.

    Returns:
        The entry's ``ring_step`` (the Pallas kernel for cuDNN and Pallas, the blocked
        kernel otherwise), or ``"blocked"`` when that one cannot run the edge.
    """
    step = KERNELS[kernel].ring_step
    return step if KERNELS[step].unsupported(lowered) is None else "blocked"


def ring_attention(
    terms: Terms,
    prob: Problem,
    batch_shape: tuple[int, ...],
    mesh: Mesh,
    axis_name: str | None = None,
    *,
    block_q: int = 256,
    block_k: int = 256,
    precision=None,
    kernel: str = "blocked",
    site: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Sequence-parallel (ring) attention: children and parents split over devices.

    Args:
        terms, prob, batch_shape: a lowered edge site (see `blocked_attention`).
        mesh, axis_name: the mesh and the axis of ``D`` devices; ``n`` and ``m`` must be
            divisible by ``D``.
        block_q, block_k, precision: as `blocked_attention`'s.
        kernel: the kernel of each step: ``"blocked"``, or ``"pallas"`` (the Pallas
            flash kernel's forward and backward passes, given the chunk's traced global
            offsets; interpreted off a GPU) — a table entry with ``passes``.
        site: the edge site's name, for error messages.

    Returns:
        ``(y, L)`` as `blocked_attention`, sharded along the children axis. The partial
        results are merged in the accumulation dtype (float32 for bfloat16 inputs) and
        ``y`` is cast to the value dtype once, at the end.

    Raises:
        TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
        ValueError: ``axis_name`` is not an axis of the mesh (or is ``None`` on a mesh of
            several axes), ``kernel`` takes no start offsets or cannot run the edge, or
            ``n`` or ``m`` is not divisible by the number of devices (naming the edge
            site).
    """
    entry = _entry(kernel, Lowered(terms, prob, batch_shape))
    if entry.passes is None:
        raise ValueError(f"ring attention: kernel {kernel!r} takes no start offsets (use "
                         f"one of {tuple(k for k, e in KERNELS.items() if e.passes)})")
    forward, backward = entry.passes
    ax = _axis(mesh, axis_name)
    ndev = mesh.shape[ax]
    n, m = terms.num_children, terms.num_parents
    _check_sequence(n, m, ndev, ax, site)
    nl, ml = n // ndev, m // ndev
    batch = tuple(batch_shape)
    local = dataclasses.replace(terms, num_children=nl, num_parents=ml)
    sched = make_schedule(
        dataclasses.replace(local, dmin=None, dmax=None), min(block_q, nl), min(block_k, ml)
    )

    def seq_spec(x, core, axis_from_end):
        parts = [None] * x.ndim
        parts[x.ndim - axis_from_end] = ax
        del core
        return P(*parts)

    def seq_specs(group):
        return jax.tree.map(lambda x: seq_spec(x, 2, 2), group)

    row_specs, col_specs, pair_specs = (seq_specs(prob.row), seq_specs(prob.col),
                                        seq_specs(prob.pair))
    const_specs = prob.const.map(lambda x: seq_spec(x, 2, 2), lambda x: P())
    glob_specs = jax.tree.map(lambda x: P(), prob.glob)
    v_spec = seq_spec(prob.v, 2, 2)
    perm = [(i, (i + 1) % ndev) for i in range(ndev)]

    def body(row, col, pair, glob, const, v):
        me = lax.axis_index(ax)
        i_start = me * nl
        dtype, dv = accum_dtype(v.dtype), v.shape[-1]
        y = jnp.zeros(batch + (nl, dv), dtype)
        none = jnp.full(batch + (nl,), -jnp.inf, dtype)  # a row's statistics before a chunk
        stats = RowStats(none, none)
        for step in range(ndev):
            src = (me - step) % ndev
            j_start = src * ml

            def cols_of(x, j_start=j_start):  # this step's parents: last axis of pair / const
                return lax.dynamic_slice_in_dim(x, j_start, ml, axis=x.ndim - 1)

            pair_c, const_c = jax.tree.map(cols_of, pair), const.map(cols_of, cols_of)
            chunk = Problem(row, col, pair_c, glob, const_c, v)

            def compute(chunk, j_start=j_start):
                return blocked_attention(local, chunk, batch, schedule=sched,
                                         starts=(i_start, j_start), precision=precision,
                                         out_dtype=dtype, forward=forward,
                                         backward=backward, stats=True)

            def empty(chunk):
                return jnp.zeros(batch + (nl, dv), dtype), RowStats(none, none)

            d_lo = i_start + terms.offset - (j_start + ml - 1)
            d_hi = i_start + nl - 1 + terms.offset - j_start
            live = jnp.asarray(True)
            if terms.dmin is not None:
                live = live & (d_hi >= terms.dmin)
            if terms.dmax is not None:
                live = live & (d_lo <= terms.dmax)
            yc, sc = lax.cond(live, compute, empty, chunk)
            y, stats = online_merge(y, stats, yc, sc)
            if step < ndev - 1:
                col, v = lax.ppermute((col, v), ax, perm)
        return y.astype(v.dtype), stats.lse()

    nb = len(batch)
    out_specs = (P(*([None] * nb), ax, None), P(*([None] * nb), ax))
    in_specs = (row_specs, col_specs, pair_specs, glob_specs, const_specs, v_spec)
    f = _shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    args = (prob.row, prob.col, prob.pair, prob.glob, prob.const, prob.v)
    return f(*_placed(mesh, in_specs, args))


def _full_batch(prob: Problem, batch) -> Problem:
    """Broadcast every array to the full batch so the children / parents axis is at a fixed
    position (ring attention shards it)."""
    b = tuple(batch)

    def bc(x):  # an array whose last two axes are its core
        return jnp.broadcast_to(x, b + x.shape[x.ndim - 2:])

    return Problem(
        jax.tree.map(bc, prob.row),
        jax.tree.map(bc, prob.col),
        jax.tree.map(bc, prob.pair),
        prob.glob,
        prob.const.map(bc, lambda x: x),
        bc(prob.v),
    )


@dataclasses.dataclass(frozen=True)
class ShardedRunner:
    """A ``runner`` for `structinfer.attention` that runs each edge over a mesh axis.

    Built by `head_sharded` and `sequence_sharded` (and by `structinfer.attention`'s
    ``mesh=``); ``mesh`` and ``axis_name`` are checked when it is built, the sizes the
    mesh axis must divide when an edge runs.

    Attributes:
        shard: ``"heads"`` (`head_sharded_attention`) or ``"sequence"``
            (`ring_attention`).
        mesh: a ``jax.sharding.Mesh``.
        axis_name: the mesh axis to shard over (``None``: the mesh's only axis).
        block_q, block_k, precision: as `blocked_attention`'s.
        kernel: the kernel to run instead of the one `structinfer.attention` chose
            (``None``: that one).

    Raises:
        TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
        ValueError: ``shard`` is not one of `SHARDS`, or ``axis_name`` is not an axis of
            the mesh (or is ``None`` on a mesh of several axes).
    """

    shard: str
    mesh: Mesh
    axis_name: str | None = None
    block_q: int = 256
    block_k: int = 256
    precision: object = None
    kernel: str | None = None

    def __post_init__(self):
        if self.shard not in SHARDS:
            raise ValueError(f"shard must be one of {SHARDS}, got {self.shard!r}")
        _axis(self.mesh, self.axis_name)

    @property
    def axis(self) -> str:
        """The mesh axis the edges are split over."""
        return _axis(self.mesh, self.axis_name)

    def __call__(self, kind: str, lowered: Lowered, prob: Problem, batch
                 ) -> tuple[jax.Array, jax.Array]:
        """Run edge ``lowered`` (chosen kernel ``kind``) on ``prob`` over the mesh."""
        common = dict(block_q=self.block_q, block_k=self.block_k, precision=self.precision,
                      site=lowered.site)
        if self.shard == "heads":
            return head_sharded_attention(lowered.terms, prob, batch, self.mesh, self.axis,
                                          mask=lowered.mask, kernel=self.kernel or kind,
                                          **common)
        return ring_attention(lowered.terms, _full_batch(prob, batch), batch, self.mesh,
                              self.axis, kernel=self.step_kernel(kind, lowered), **common)

    def step_kernel(self, kind: str, lowered: Lowered) -> str:
        """The kernel each shard (each ring step) runs for an edge whose chosen kernel is
        ``kind``."""
        k = self.kernel or kind
        return k if self.shard == "heads" else ring_step_kernel(k, lowered)

    def describe(self, kind: str, lowered: Lowered) -> str:
        """How an edge whose chosen kernel is ``kind`` runs on the mesh (for ``explain``)."""
        ax = self.axis
        ndev = self.mesh.shape[ax]
        where = f"mesh axis '{ax}' ({ndev} device{'s' if ndev != 1 else ''})"
        label = KERNELS[self.step_kernel(kind, lowered)].label
        if self.shard == "heads":
            return (f"heads / batch split over {where}: each device runs the {label} kernel "
                    "on its slice")
        return (f"ring attention over {where}: children and parents in {ndev} "
                f"chunk{'s' if ndev != 1 else ''} each, the parents passed round the ring; "
                f"each step runs the {label} kernel")


def head_sharded(mesh: Mesh, axis_name: str | None = None, *, block_q: int = 256,
                 block_k: int = 256, precision=None, kernel: str | None = None
                 ) -> ShardedRunner:
    """A ``runner`` for `structinfer.attention` that shards heads / batch over ``mesh``.

    Each device runs the kernel `structinfer.attention` chose for the edge (the runner's
    ``kind``), or ``kernel`` when given, on its slice (`head_sharded_attention`).
    ``mesh`` and ``axis_name`` are checked here (see `ShardedRunner`)."""
    return ShardedRunner("heads", mesh, axis_name, block_q, block_k, precision, kernel)


def sequence_sharded(mesh: Mesh, axis_name: str | None = None, *, block_q: int = 256,
                     block_k: int = 256, precision=None, kernel: str | None = None
                     ) -> ShardedRunner:
    """A ``runner`` for `structinfer.attention` running ring attention over ``mesh``.

    Each step runs `ring_step_kernel` of the kernel `structinfer.attention` chose (the
    runner's ``kind``), or of ``kernel`` when given: the Pallas kernel for cuDNN and
    Pallas, the blocked kernel otherwise. ``mesh`` and ``axis_name`` are checked here (see
    `ShardedRunner`)."""
    return ShardedRunner("sequence", mesh, axis_name, block_q, block_k, precision, kernel)
