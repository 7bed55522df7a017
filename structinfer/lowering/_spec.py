r"""The lowered form of one edge site: block-computable logits plus a value table.

A recognised edge site becomes a `Problem`: a *static* description of the
terms of its logits (`Terms`, hashable, no arrays) and the arrays those
terms read, in five typed groups (frozen dataclasses, JAX pytrees whose absent
arrays are ``None``) split by how a block of children $I$ and parents $J$
slices them:

* ``row``   — `Rows`, per-child arrays ``(..., n, f)`` (query features, geometric ``log q``),
* ``col``   — `Cols`, per-parent arrays ``(..., m, f)`` (key features, per-parent biases),
* ``pair``  — `Pairs`, per-edge arrays ``(..., n, m)`` (categorical prior logits, custom scores),
* ``glob``  — `Globals`, arrays read whole (relative-position bias over distances),
* ``const`` — `Consts`, non-differentiable boolean masks (``(..., n, m)`` or ``(..., m)``,
  or a block mask read whole),
* ``v``     — the value table ``(..., m, dv)``: the output is
  $y_i = \sum_j p(\phi_i = j \mid x)\, V_j$.

The arrays of `Rows`, `Cols` and `Pairs` each slice alike, so a kernel slices, pads or
accumulates a whole group with ``jax.tree.map`` (`Consts.map` for the masks, whose
arrays slice differently), and reads a term by name (``prob.row.q``,
``prob.glob.relpos``).

`block_logits` evaluates the unnormalised log-posterior
$\ell_{ij} = \psi_{ij} + \log \tilde p(\phi_i = j)$ on one block from the
index grids of that block (distances $d_{ij} = i + \text{offset} - j$), so
no kernel ever needs the ``(n, m)`` table. Row-constant terms (the prior's
normaliser, a Gaussian's $-\tfrac12 x_i^\top\Lambda x_i$) cancel in the
softmax and are left out.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from .._checks import is_concrete
from ..priors import RelativePosition
from ..scores import safe_pow_dist

__all__ = ["Terms", "RelPos", "Rows", "Cols", "Pairs", "Globals", "Consts", "Problem",
           "block_logits", "accum_dtype", "logit_scale", "logit_scale_array", "sum_to",
           "geometric_log_prior"]


def logit_scale(scale, dtype: DTypeLike) -> float | None:
    """The `Terms.dot_scale` of a dot product of ``dtype`` operands scaled by ``scale``:
    the number itself where the operands are 16-bit and ``scale`` is a 0-d number known
    at trace time that keeps their dtype and is not 1 (the kernels then multiply the
    float32 ``q.k`` by it); else ``None`` (the scale, if any, is folded into ``q``)."""
    if (scale is None or np.ndim(scale) != 0 or not is_concrete(scale)
            or jnp.dtype(dtype).itemsize >= 4 or jnp.result_type(dtype, scale) != dtype):
        return None
    s = float(scale)
    return None if s == 1.0 else s


def logit_scale_array(scale, dtype: DTypeLike) -> jax.Array | None:
    """The `Globals.dot_scale` of a dot product of ``dtype`` operands scaled by ``scale``:
    where the operands are 16-bit and ``scale`` is a traced 0-d number that keeps their
    dtype (a model argument, a learned temperature), the scale as a ``(1,)`` array in the
    accumulation dtype, which the kernels multiply the float32 ``q.k`` by, as they do a
    static one (`logit_scale`); else ``None``. Folded into ``q`` instead, it would be
    rounded to 16 bits, and so would every ``s q``."""
    if (scale is None or np.ndim(scale) != 0 or is_concrete(scale)
            or jnp.dtype(dtype).itemsize >= 4 or jnp.result_type(dtype, scale) != dtype):
        return None
    return jnp.reshape(jnp.asarray(scale).astype(accum_dtype(dtype)), (1,))


def accum_dtype(dtype: DTypeLike) -> jnp.dtype:
    """The dtype the lowered engine accumulates in for operands of `dtype`.

    float32 for bfloat16 / float16 / float32 operands, float64 for float64 (as
    flash-attention kernels do: logits, running maximum, exp-sum and the p·v product).
    The prior's terms (its parameters, tables, masks' biases) are added to the logits in
    this dtype, so a float32 prior parameter never promotes bfloat16 queries, keys and
    values; `structinfer.nn.Attention` keeps its hyperparameters in it.

    Args:
        dtype: the dtype of the queries, keys and values (anything `jnp.dtype` reads).

    Returns:
        `jnp.promote_types(dtype, jnp.float32)`.
    """
    return jnp.promote_types(dtype, jnp.float32)


def sum_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sum the broadcast dims of ``x`` so that it has ``shape`` (a gradient computed on the
    broadcast batch, returned to an input that was broadcast to it)."""
    if x.shape == tuple(shape):
        return x
    lead = x.ndim - len(shape)
    x = jnp.sum(x, axis=tuple(range(lead))) if lead > 0 else x
    axes = tuple(i for i, (s, t) in enumerate(zip(x.shape, shape)) if t == 1 and s != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


@dataclass(frozen=True)
class RelPos:
    """Static part of a relative-position prior (see ``priors.RelativePosition``)."""

    mode: str
    num_parents: int
    max_distance: int | None
    period: int | None
    length: int


@dataclass(frozen=True)
class Terms:
    """Static description of the logits of one edge site (hashable; no arrays)."""

    num_children: int
    num_parents: int
    #: dot-product term: row.q . col.k (all dot-like scores concatenated)
    dot: bool = False
    #: a static scale s of the dot term, applied to the accumulated row.q . col.k (float32)
    #: rather than folded into row.q (None: folded, or 1); set for 16-bit operands, where
    #: s * q rounded to 16 bits would move a logit by up to about 2^-9 |s| sum_f |q_f k_f|
    #: (a traced scale of 16-bit operands is glob.dot_scale, applied the same way)
    dot_scale: float | None = None
    #: number of IDW terms -log(eps + ||x_i - y_j||^p): row.idw[r], col.idw[r],
    #: glob.idw_p[r], glob.idw_eps[r] (p and eps are arrays: traceable)
    idw: int = 0
    #: per-parent additive term col.bias (..., m, 1)
    col_bias: bool = False
    #: per-edge additive term pair.logits (finite part)
    pair_logits: bool = False
    #: relative-position log-weights from glob.relpos (..., L)
    relpos: RelPos | None = None
    #: geometric log-prior from row.geo (..., n, 2) = (log q, log(1-q))
    geometric: bool = False
    geo_d0: int = 0
    #: distance d = i + offset - j of child i to parent j
    offset: int = 0
    #: allowed distances dmin <= d <= dmax (None: unbounded), optionally d != 0
    dmin: int | None = None
    dmax: int | None = None
    exclude_zero: bool = False
    #: boolean masks in const: pair_ok (..., n, m), col_ok (..., m)
    pair_ok: bool = False
    col_ok: bool = False
    #: the per-edge mask read per block from const.block_ok (..., nbc, nbp): edge (i, j)
    #: is allowed when block_ok[..., i // bc, j // bp] for these (bc, bp) (the blocked
    #: kernel's form of a block-sparse mask known at trace time)
    mask_blocks: tuple[int, int] | None = None
    #: human-readable description of the recognised parts (for explain)
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def has_band(self) -> bool:
        return self.dmin is not None or self.dmax is not None or self.exclude_zero


def _pytree(cls):
    """Register the frozen dataclass ``cls`` as a pytree whose children are all its fields
    (an absent array is ``None``, an empty pytree: ``jax.tree.map`` skips it)."""
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@_pytree
@dataclass(frozen=True)
class Rows:
    """Per-child arrays ``(..., n, f)``: a block of children slices each along axis -2.

    Attributes:
        q: the dot product's query features (every dot-like score's, concatenated).
        geo: a geometric prior's ``(..., n, 2)`` = ``(log q, log(1 - q))``.
        idw: the child features of each IDW term.
    """

    q: jax.Array | None = None
    geo: jax.Array | None = None
    idw: tuple[jax.Array, ...] = ()


@_pytree
@dataclass(frozen=True)
class Cols:
    """Per-parent arrays ``(..., m, f)``: a block of parents slices each along axis -2.

    Attributes:
        k: the dot product's key features.
        bias: the per-parent additive term, ``(..., m, 1)``.
        idw: the parent features of each IDW term.
    """

    k: jax.Array | None = None
    bias: jax.Array | None = None
    idw: tuple[jax.Array, ...] = ()


@_pytree
@dataclass(frozen=True)
class Pairs:
    """Per-edge arrays ``(..., n, m)``: a block slices children on axis -2, parents on -1.

    Attributes:
        logits: the per-edge additive term (finite).
    """

    logits: jax.Array | None = None


@_pytree
@dataclass(frozen=True)
class Globals:
    """Arrays every block reads whole.

    Attributes:
        relpos: the relative-position bias ``(..., L)`` over distances.
        idw_p: each IDW term's exponent ``p``.
        idw_eps: each IDW term's ``eps``.
        dot_scale: the dot term's traced scale ``(1,)`` with 16-bit operands, in the
            accumulation dtype (`logit_scale_array`): the kernels multiply the float32
            ``row.q . col.k`` by it (``row.q`` is unscaled), as by a static
            `Terms.dot_scale`.
    """

    relpos: jax.Array | None = None
    idw_p: tuple[jax.Array, ...] = ()
    idw_eps: tuple[jax.Array, ...] = ()
    dot_scale: jax.Array | None = None


@_pytree
@dataclass(frozen=True)
class Consts:
    """Boolean masks (not differentiated): ``False`` forbids the edge.

    Attributes:
        pair_ok: per edge, ``(..., n, m)``.
        col_ok: per parent, ``(..., m)``.
        block_ok: per block of edges, ``(..., ceil(n / b_c), ceil(m / b_p))``
            (``Terms.mask_blocks``
            gives ``(b_c, b_p)``), read whole: a block reads it at its edges' indices.
    """

    pair_ok: jax.Array | None = None
    col_ok: jax.Array | None = None
    block_ok: jax.Array | None = None

    def map(self, per_edge: Callable, per_parent: Callable) -> Consts:
        """The masks with ``per_edge`` applied to ``pair_ok`` and ``per_parent`` to
        ``col_ok`` (each where present): the two slice differently; ``block_ok`` is read
        whole and kept."""
        return Consts(None if self.pair_ok is None else per_edge(self.pair_ok),
                      None if self.col_ok is None else per_parent(self.col_ok),
                      self.block_ok)


@_pytree
@dataclass(frozen=True)
class Problem:
    """Arrays of a lowered edge site (a pytree); ``terms`` says how to combine them.

    Attributes:
        row, col, pair, glob, const: the five groups (see the module docstring).
        v: the value table ``(..., m, dv)``.
    """

    row: Rows
    col: Cols
    pair: Pairs
    glob: Globals
    const: Consts
    v: jax.Array


def relpos_index(rp: RelPos, d: jax.Array) -> jax.Array:
    """Index into the relative-position bias for an int distance grid ``d``.

    Delegates to `structinfer.priors.RelativePosition.bias_index` (one
    implementation of the bucket lookup). Padded rows / columns of a block have
    distances outside the bias; they are clipped into it (the real ones all lie in
    ``[-(m-1), L-m]``, checked by ``RelativePosition.check_bias_length``).
    """
    if rp.mode != "circulant" and rp.max_distance is None:
        d = jnp.clip(d, -(rp.num_parents - 1), rp.length - rp.num_parents)
    with jax.ensure_compile_time_eval():  # its placeholder bias: no constant in a kernel
        lookup = RelativePosition(
            np.zeros(1, np.float32), rp.num_parents, max_distance=rp.max_distance,
            causal=False, _mode=rp.mode, _period=rp.period,
        )
    return lookup.bias_index(d)


def relpos_weights(rp: RelPos, bias: jax.Array, d: jax.Array) -> jax.Array:
    """Relative-position log-weights ``b(d)`` for an int distance grid ``d`` (no causal mask;
    the causal mask is the kernels' distance band)."""
    return jnp.take(bias, relpos_index(rp, d), axis=-1)


def geometric_log_prior(log_q: jax.Array, log_1mq: jax.Array, t: jax.Array) -> jax.Array:
    r"""The geometric (recency) log-prior at distance $d_0 + t$, unnormalised:

    $$
    \log p(\phi_i = j) = \log q_i + t_{ij} \log(1 - q_i), \qquad t_{ij} = d_{ij} - d_0
    $$

    (parents nearer than $d_0$ are forbidden by the distance band, not here). The one
    place every kernel computes it: on a block's distance grid (`block_logits`, the Pallas
    tiles), as a cuDNN bias table, on the windowed kernels' band.

    Args:
        log_q: $\log q_i$, broadcasting against ``t`` (per child: ``(..., n, 1)``).
        log_1mq: $\log(1 - q_i)$, shaped like ``log_q``.
        t: the distances past $d_0$ (int or float), cast to ``log_q``'s dtype.

    Returns:
        The broadcast log-prior, in ``log_q``'s dtype.
    """
    return log_q + t.astype(log_q.dtype) * log_1mq


def band_ok(t: Terms, d: jax.Array) -> jax.Array | None:
    """The distance constraints of ``t`` on a distance grid (None when unconstrained)."""
    ok = None

    def conj(a, b):
        return b if a is None else a & b

    if t.dmin is not None:
        ok = conj(ok, d >= t.dmin)
    if t.dmax is not None:
        ok = conj(ok, d <= t.dmax)
    if t.exclude_zero:
        ok = conj(ok, d != 0)
    return ok


def block_logits(
    t: Terms,
    row: Rows,
    col: Cols,
    pair: Pairs,
    glob: Globals,
    const: Consts,
    i_idx: jax.Array,
    j_idx: jax.Array,
    dtype,
    col_valid: jax.Array | None = None,
    transposed: bool = False,
    precision=None,
) -> tuple[jax.Array, jax.Array | None]:
    r"""Logits $\ell_{ij}$ (finite part) and the allowed-edge mask on one block.

    Args:
        t: the static terms.
        row, col, pair, glob, const: the arrays, already sliced to the block
            (row ``(..., bq, f)``, col ``(..., bk, f)``, pair/const ``(..., bq, bk)``).
        i_idx: ``(bq,)`` global child indices; ``j_idx``: ``(bk,)`` parent indices.
        dtype: floating dtype of the result, the kernel's accumulation dtype
            (`accum_dtype`): the dot product multiplies the operands in their own dtype
            and accumulates in this one, the other terms are computed in it.
        col_valid: optional ``(bk,)`` boolean, False for padded parents.
        transposed: build the block parents x children, ``(..., bk, bq)`` (the blocked
            kernel's backward works on it so): each term is built in that layout from
            its factors rather than transposed afterwards (a strided pass).
        precision: the dot product's ``precision`` (``None``: JAX's default, which
            follows ``jax.default_matmul_precision``).

    Returns:
        ``(s, ok)``: ``s`` of shape ``(..., bq, bk)`` (``(..., bk, bq)`` transposed) is
        finite everywhere (so its vjp never meets ``0 * inf``); ``ok`` is a boolean mask
        or ``None`` when every edge of the block is allowed. Forbidden edges have logit
        ``-inf``.
    """
    s = None

    def add(a):
        nonlocal s
        s = a if s is None else s + a

    # where a per-child / per-parent vector goes: children along the rows of the block
    # and parents along its columns, or the other way round
    def per_child(x):
        return x[..., None, :] if transposed else x[..., :, None]

    def per_parent(x):
        return x[..., :, None] if transposed else x[..., None, :]

    def per_edge(x):  # a (..., bq, bk) array
        return jnp.swapaxes(x, -1, -2) if transposed else x

    if t.dot:
        mm = dict(preferred_element_type=dtype, precision=precision)
        qk = (jnp.einsum("...jf,...if->...ji", col.k, row.q, **mm) if transposed
              else jnp.einsum("...if,...jf->...ij", row.q, col.k, **mm))
        if t.dot_scale is not None:
            qk = qk * jnp.asarray(t.dot_scale, dtype)
        if glob.dot_scale is not None:  # a traced scale, (1,): one for the whole table
            qk = qk * glob.dot_scale[0].astype(dtype)
        add(qk)
    for r in range(t.idw):
        x, y = row.idw[r].astype(dtype), col.idw[r].astype(dtype)
        p, eps = glob.idw_p[r], glob.idw_eps[r]
        diff = (x[..., None, :, :] - y[..., :, None, :] if transposed
                else x[..., :, None, :] - y[..., None, :, :])
        add(-jnp.log(eps + safe_pow_dist(jnp.sum(diff * diff, -1), p)))
    if t.col_bias:
        add(per_parent(col.bias[..., 0].astype(dtype)))
    if t.pair_logits:
        add(per_edge(pair.logits.astype(dtype)))
    d = None
    if t.relpos is not None or t.geometric or t.has_band:
        d = per_child(i_idx + t.offset) - per_parent(j_idx)
    if t.relpos is not None:
        add(relpos_weights(t.relpos, glob.relpos, d).astype(dtype))
    if t.geometric:
        g = row.geo.astype(dtype)
        add(geometric_log_prior(per_child(g[..., 0]), per_child(g[..., 1]), d - t.geo_d0))
    if s is None:
        shape = (j_idx.shape[0], i_idx.shape[0]) if transposed else (i_idx.shape[0], j_idx.shape[0])
        s = jnp.zeros(shape, dtype)
    ok = band_ok(t, d) if d is not None else None

    def conj(a, b):
        return b if a is None else a & b

    if col_valid is not None:
        ok = conj(ok, per_parent(col_valid))
    if t.col_ok:
        ok = conj(ok, per_parent(const.col_ok))
    if t.pair_ok:
        ok = conj(ok, per_edge(const.pair_ok))
    if t.mask_blocks is not None:  # padded indices read the last block (masked anyway)
        b = const.block_ok
        rows = jnp.minimum(i_idx // t.mask_blocks[0], b.shape[-2] - 1)
        cols = jnp.minimum(j_idx // t.mask_blocks[1], b.shape[-1] - 1)
        ok = conj(ok, per_edge(b[..., rows, :][..., cols]))
    return s.astype(dtype), ok
