r"""Blocked online-softmax attention that never builds the children x parents matrix.

For one edge site with logits $\ell_{ij} = \psi_{ij} + \log\tilde p(\phi_i=j)$
(see `structinfer.lowering._spec`) and a value table $V$,

$$
y_i = \sum_j \frac{e^{\ell_{ij}}}{\sum_{j'} e^{\ell_{ij'}}} V_j, \qquad
L_i = \log \sum_j e^{\ell_{ij}},
$$

computed over blocks of ``bq`` children and ``bk`` parents with the running
maximum / running sum recursion of the online softmax (Milakov & Gimelshein
2018; the "flash attention" schedule; one step function, shared with
the Pallas kernel and ring attention's merge). Per block the logits are recomputed from
their factors and index grids, so memory is $O(n\,d + b_q b_k)$.
Blocks that the structure forbids entirely (causal triangle, sliding window,
geometric truncation, block-sparse masks known at trace time) are *skipped*:
each child block loops only over its list of live parent blocks. Blocks inside the
distance band are computed without a mask, and those the band's edge crosses are cut
into the rectangles that hold their allowed edges (`Schedule`).

Gradients use a custom VJP that stores only $y$ and the rows' statistics $m_i$ (the
largest logit) and $\log l_i$ (`_softmax.RowStats`, $L_i = m_i + \log l_i$) and
recomputes every block's logits in the backward pass:

$$
P_{ij} = e^{(\ell_{ij} - m_i) - \log l_i},\quad
\bar V_j = \sum_i P_{ij} \bar y_i,\quad
\bar\ell_{ij} = P_{ij}\big(\bar y_i^\top V_j - \bar y_i^\top y_i + \bar L_i\big),
$$

and $\bar\ell$ is pulled back to the factors: to queries and keys of the
dot-product term by hand ($\bar Q = \bar\ell K$, $\bar K = \bar\ell^\top Q$;
the block is built parents x children when the logits are a dot product and a mask,
so that only $\bar\ell$ is copied transposed and every dot is in a form XLA:CPU runs
fast), to everything else (prior parameters, biases, IDW features, tables) by the
VJP of the block-logit function itself.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from ._masks import BlockMask, ConcreteMask, mask_key, tile_grid
from ._softmax import (
    RowStats,
    Running,
    as_row_stats,
    backward_delta,
    backward_probs,
    online_finish,
    online_start,
    online_stats,
    online_step,
    scale_grad,
    scale_row_sums,
    with_nan_rows,
)
from ._spec import (
    Cols,
    Consts,
    Pairs,
    Problem,
    Rows,
    Terms,
    accum_dtype,
    block_logits,
    sum_to,
)

__all__ = ["Schedule", "make_schedule", "block_grids", "blocked_attention", "band_blocks",
           "mask_per_block"]


#: one rectangle of a block that a kernel computes: ``(r0, rn, c0, cn, masked)`` — rows
#: ``r0 : r0 + rn`` and columns ``c0 : c0 + cn`` of the block, with or without the mask
Piece = tuple[int, int, int, int, bool]


@dataclass(frozen=True)
class Schedule:
    """Which parent blocks each child block visits, and what of each block (static, hashable).

    ``fwd[a]`` lists the live parent blocks of child block ``a``; ``bwd[b]`` the
    live child blocks of parent block ``b``. ``full`` holds the live blocks
    ``(a, b)`` whose every edge is allowed (inside the distance band, no padded
    parent, no mask): the kernels compute those without building a mask, and the
    others (the band's edges, the diagonal of a causal mask) with it. ``pieces`` maps
    some of those others to the rectangles worth computing (`Piece`): a causal
    diagonal block is its top half rows against the left half columns and its bottom
    half rows against all columns, three quarters of the work; a block not listed is
    computed whole, masked.
    """

    block_q: int
    block_k: int
    num_children: int
    num_parents: int
    fwd: tuple[tuple[int, ...], ...]
    bwd: tuple[tuple[int, ...], ...]
    full: frozenset[tuple[int, int]] = frozenset()
    pieces: tuple[tuple[tuple[int, int], tuple[Piece, ...]], ...] = ()

    @property
    def nqb(self) -> int:
        return len(self.fwd)

    @property
    def nkb(self) -> int:
        return len(self.bwd)

    @property
    def live_fraction(self) -> float:
        return sum(len(r) for r in self.fwd) / max(self.nqb * self.nkb, 1)

    def pattern(self, a: int, b: int) -> tuple[Piece, ...]:
        """The rectangles computed of live block ``(a, b)``."""
        if (a, b) in self.full:
            return ((0, self.block_q, 0, self.block_k, False),)
        return dict(self.pieces).get((a, b), ((0, self.block_q, 0, self.block_k, True),))

    def groups(self, rows: tuple[tuple[int, ...], ...], transpose: bool = False):
        """``[(pattern, lists), ...]``: the blocks of ``rows`` (``fwd``, or ``bwd`` with
        ``transpose``) grouped by the rectangles computed of them, each list in the
        order of ``rows``; the groups computed without a mask first."""
        out: dict = {}
        for r, row in enumerate(rows):
            for c in row:
                pat = self.pattern(*((c, r) if transpose else (r, c)))
                out.setdefault(pat, [[] for _ in rows])[r].append(c)
        return sorted(((pat, tuple(map(tuple, lists))) for pat, lists in out.items()),
                      key=lambda g: (any(piece[4] for piece in g[0]), g[0]))

    def without_full(self) -> Schedule:
        """The same schedule with every block computed whole and masked (for shifted
        index grids)."""
        return dataclasses.replace(self, full=frozenset(), pieces=())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_schedule(
    terms: Terms,
    block_q: int,
    block_k: int,
    mask: ConcreteMask | None = None,
    min_piece: int = 64,
) -> Schedule:
    """Live blocks from the distance band of ``terms`` and an optional concrete mask.

    Args:
        terms: the static terms (its ``dmin``/``dmax``/``offset`` give the band).
        block_q, block_k: block sizes.
        mask: optional concrete mask of allowed edges known at trace time (block-sparse
            / graph priors), a NumPy boolean ``(..., n, m)`` array or a
            [`BlockMask`][structinfer.lowering.BlockMask]; batch dims are OR-ed.
        min_piece: a partial block is cut into rectangles (`Schedule.pieces`) only when
            halves of it are at least this long on both sides (smaller matmuls than
            that cost more than the skipped work saves).
    """
    n, m = terms.num_children, terms.num_parents
    bq, bk = int(block_q), int(block_k)
    nqb, nkb = _cdiv(n, bq), _cdiv(m, bk)
    live, full = _live_full(terms, bq, bk, nqb, nkb, mask)
    fwd = tuple(tuple(int(x) for x in np.flatnonzero(live[i])) for i in range(nqb))
    bwd = tuple(tuple(int(x) for x in np.flatnonzero(live[:, j])) for j in range(nkb))
    blocks = frozenset((int(i), int(j)) for i, j in zip(*np.nonzero(full)))
    pieces = _pieces(terms, bq, bk, nqb, nkb, mask, live & ~full, min_piece)
    return Schedule(bq, bk, n, m, fwd, bwd, blocks, pieces)


def block_grids(terms: Terms, block_q: int, block_k: int, mask: ConcreteMask | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """``(live, full)``: boolean grids of the ``block_q x block_k`` blocks (``nqb x nkb``,
    ceil-divided) that some edge of the distance band of ``terms`` and of the concrete
    ``mask`` allows / whose every edge the band allows with no padded parent (never with
    a mask or column mask in ``terms``: those blocks are read masked)."""
    bq, bk = int(block_q), int(block_k)
    nqb, nkb = _cdiv(terms.num_children, bq), _cdiv(terms.num_parents, bk)
    return _live_full(terms, bq, bk, nqb, nkb, mask)


def _live_full(terms: Terms, bq: int, bk: int, nqb: int, nkb: int, mask) -> tuple:
    """``(live, full)`` boolean ``(nqb, nkb)`` grids of blocks of ``bq x bk``: some edge
    allowed / every (unpadded) edge allowed and no padded parent. A block wholly in the
    padding past ``n`` or ``m`` is dead."""
    n, m = terms.num_children, terms.num_parents
    a = np.arange(nqb)[:, None]
    b = np.arange(nkb)[None, :]
    i_lo, i_hi = a * bq, np.minimum((a + 1) * bq, n) - 1
    j_lo, j_hi = b * bk, np.minimum((b + 1) * bk, m) - 1
    d_lo = i_lo + terms.offset - j_hi  # smallest distance in the block
    d_hi = i_hi + terms.offset - j_lo
    live = (i_lo < n) & (j_lo < m)
    full = np.broadcast_to((b + 1) * bk <= m, (nqb, nkb)).copy()
    if terms.dmin is not None:
        live &= d_hi >= terms.dmin
        full &= d_lo >= terms.dmin
    if terms.dmax is not None:
        live &= d_lo <= terms.dmax
        full &= d_hi <= terms.dmax
    if terms.exclude_zero:
        full &= (d_lo > 0) | (d_hi < 0)
    if terms.pair_ok or terms.col_ok or terms.mask_blocks is not None:
        full[:] = False
    if mask is not None:
        live &= tile_grid(mask, n, m, bq, bk, nqb, nkb, reduce=np.any, over_batch=np.any)
    return live, full & live


#: at most this many distinct cuts (each is a loop of its own in the program)
_MAX_PATTERNS = 4


def _pieces(terms: Terms, bq: int, bk: int, nqb: int, nkb: int, mask, partial: np.ndarray,
            min_piece: int):
    """The rectangles worth computing of each partial block (see `Schedule`).

    Each half of a block's rows computes the span of its live half-columns, masked
    unless every half-block in it is full; halves with nothing live are skipped and
    neighbouring halves with the same span merge. A cut that computes the whole block
    is left out (the default), and only the ``_MAX_PATTERNS`` most common cuts are
    kept.
    """
    if bq % 2 or bk % 2 or min(bq, bk) // 2 < max(min_piece, 1) or not partial.any():
        return ()
    hq, hk = bq // 2, bk // 2
    live, full = _live_full(terms, hq, hk, 2 * nqb, 2 * nkb, mask)
    whole = ((0, bq, 0, bk, True),)
    cuts: dict = {}
    for a, b in zip(*np.nonzero(partial)):
        rows = []
        for r in range(2):
            cols = np.flatnonzero(live[2 * a + r, 2 * b: 2 * b + 2])
            if not len(cols):
                continue
            lo, hi = int(cols[0]), int(cols[-1]) + 1
            masked = not bool(full[2 * a + r, 2 * b + lo: 2 * b + hi].all())
            rows.append((r, lo, hi, masked))
        pat = _merge(rows, hq, hk)
        if pat != whole:
            cuts.setdefault(pat, []).append((int(a), int(b)))
    keep = sorted(cuts, key=lambda p: -len(cuts[p]))[:_MAX_PATTERNS]
    return tuple(sorted((blk, pat) for pat in keep for blk in cuts[pat]))


def _merge(rows, hq: int, hk: int) -> tuple[Piece, ...]:
    """Row halves ``(r, lo, hi, masked)`` as rectangles, equal neighbours merged."""
    out: list = []
    for r, lo, hi, masked in rows:
        piece = (r * hq, hq, lo * hk, (hi - lo) * hk, masked)
        if out and out[-1][0] + out[-1][1] == piece[0] and out[-1][2:] == piece[2:]:
            prev = out.pop()
            piece = (prev[0], prev[1] + hq) + piece[2:]
        out.append(piece)
    return tuple(out)


def band_blocks(terms: Terms, block_q: int, block_k: int) -> tuple[int, int]:
    """Block sizes for a narrow distance band: square blocks about half as wide as the band.

    With a band of ``W`` distances, a child block of ``b`` rows needs ``b + W - 1``
    parents, so square blocks of ``b`` compute about ``(b + W) / W`` times the useful
    logits: ``b ~ W / 2`` (at least 64, a power of two) keeps that near 1.5 without making
    the blocks' matmuls too small (``W = 128`` at ``n = 4096``: 64 x 64 blocks took 10%
    less CPU time than 128 x 128, forward and backward).
    """
    if terms.dmin is None or terms.dmax is None:
        return block_q, block_k
    width = terms.dmax - terms.dmin + 1
    if width >= block_k:
        return block_q, block_k
    b = 64
    while 2 * b < width:
        b *= 2
    bk = min(b, block_k)
    return min(block_q, bk), bk


def _table(lists: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """Pad ragged index lists into an ``(rows, max_len)`` int32 table + counts."""
    cnt = np.array([len(x) for x in lists], np.int32)
    width = max(int(cnt.max()) if len(cnt) else 0, 1)
    tab = np.zeros((len(lists), width), np.int32)
    for r, x in enumerate(lists):
        if x:
            tab[r, : len(x)] = x
            tab[r, len(x) :] = x[-1]
    return tab, cnt


def _pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    axis = axis % x.ndim
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _slice(x: jax.Array, start, size: int, axis: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis % x.ndim)


def _update(buf: jax.Array, delta: jax.Array, starts: dict[int, jax.Array]) -> jax.Array:
    """``buf[..., block] += delta`` with dynamic starts on the given (negative) axes."""
    idx = [jnp.zeros((), jnp.int32)] * buf.ndim
    for ax, st in starts.items():
        idx[ax % buf.ndim] = jnp.asarray(st, jnp.int32)
    cur = lax.dynamic_slice(buf, idx, delta.shape)
    return lax.dynamic_update_slice(buf, cur + delta, idx)


def _rows(d: Rows | Cols, start, size: int) -> Rows | Cols:
    return jax.tree.map(lambda x: _slice(x, start, size, -2), d)


def _pair_block(d: Pairs, i0, j0, bq: int, bk: int) -> Pairs:
    return jax.tree.map(lambda x: _slice(_slice(x, i0, bq, -2), j0, bk, -1), d)


def _const_block(d: Consts, i0, j0, bq: int, bk: int) -> Consts:
    return d.map(lambda x: _slice(_slice(x, i0, bq, -2), j0, bk, -1),
                 lambda x: _slice(x, j0, bk, -1))


def _pad_problem(terms: Terms, prob: Problem, n_pad: int, m_pad: int) -> Problem:
    row = jax.tree.map(lambda x: _pad_axis(x, -2, n_pad), prob.row)
    col = jax.tree.map(lambda x: _pad_axis(x, -2, m_pad), prob.col)
    pair = jax.tree.map(lambda x: _pad_axis(_pad_axis(x, -2, n_pad), -1, m_pad), prob.pair)
    const = prob.const.map(
        lambda x: _pad_axis(_pad_axis(x, -2, n_pad, False), -1, m_pad, False),
        lambda x: _pad_axis(x, -1, m_pad, False))
    v = _pad_axis(prob.v, -2, m_pad)
    return Problem(row, col, pair, prob.glob, const, v)


def _transposed(x: jax.Array) -> jax.Array:
    """``x`` with its last two axes swapped, materialised.

    XLA folds a plain transpose into the dot's dimension numbers, and a dot that
    contracts the *leading* block axis of both operands (``P^T dO``, ``dS^T Q``) runs
    about 2.5x slower on CPU than the same dot on a row-major copy; the barrier keeps
    the copy (one pass over the block) so the backward's dots are all fast forms.
    """
    return lax.optimization_barrier(jnp.swapaxes(x, -1, -2))


def _masked(s: jax.Array, ok) -> jax.Array:
    return s if ok is None else jnp.where(ok, s, -jnp.inf)


def _unbanded(terms: Terms) -> Terms:
    """``terms`` without its distance band: the logits of a block that lies inside it."""
    return dataclasses.replace(terms, dmin=None, dmax=None, exclude_zero=False)


def _loops(tables, lo: int, body_of, carry):
    """Run ``body_of(pattern, tab)`` over each group of blocks of row ``lo`` in turn
    (``tables`` from `_group_tables`)."""
    for pattern, tab, cnt in tables:
        carry = lax.fori_loop(0, cnt[lo], body_of(pattern, tab), carry)
    return carry


def _group_tables(sched: Schedule, rows, transpose: bool):
    """``[(pattern, tab, cnt), ...]``: each group of `Schedule.groups` as an index table."""
    out = []
    for pattern, lists in sched.groups(rows, transpose):
        tab, cnt = _table(lists)
        out.append((pattern, jnp.asarray(tab), jnp.asarray(cnt)))
    return out


def _sub(x: jax.Array, start: int, size: int, axis: int) -> jax.Array:
    """A static slice (the array itself when it is the whole axis)."""
    axis = axis % x.ndim
    if start == 0 and size == x.shape[axis]:
        return x
    return lax.slice_in_dim(x, start, start + size, axis=axis)


def _piece_arrays(rect, row_b, col_b, pair_b, const_b, i_idx, j_loc):
    """The block's arrays cut to one rectangle ``(r0, rn, c0, cn, masked)``."""
    r0, rn, c0, cn, _ = rect
    row = jax.tree.map(lambda x: _sub(x, r0, rn, -2), row_b)
    col = jax.tree.map(lambda x: _sub(x, c0, cn, -2), col_b)
    pair = jax.tree.map(lambda x: _sub(_sub(x, r0, rn, -2), c0, cn, -1), pair_b)
    const = const_b.map(lambda x: _sub(_sub(x, r0, rn, -2), c0, cn, -1),
                        lambda x: _sub(x, c0, cn, -1))
    return row, col, pair, const, _sub(i_idx, r0, rn, 0), _sub(j_loc, c0, cn, 0)


def _add_at(buf: jax.Array, delta: jax.Array, start: int, axis: int) -> jax.Array:
    """``buf`` plus ``delta`` on ``start : start + len`` of ``axis`` (static)."""
    axis = axis % buf.ndim
    if delta.shape[axis] == buf.shape[axis]:
        return buf + delta
    idx = [slice(None)] * buf.ndim
    idx[axis] = slice(start, start + delta.shape[axis])
    return buf.at[tuple(idx)].add(delta)


def _forward(terms: Terms, sched: Schedule, batch: tuple[int, ...], prob: Problem, starts,
             nan_rows: bool = False, precision=None, out_dtype=None):
    bq, bk = sched.block_q, sched.block_k
    nqb, nkb = sched.nqb, sched.nkb
    n_pad, m_pad = nqb * bq, nkb * bk
    check_cols = m_pad != terms.num_parents
    i_start, j_start = starts
    p = _pad_problem(terms, prob, n_pad, m_pad)
    dtype = accum_dtype(p.v.dtype)  # logits, running max / sum and p·v accumulate in it
    out_dtype = p.v.dtype if out_dtype is None else out_dtype
    dv = p.v.shape[-1]
    tables = _group_tables(sched, sched.fwd, False)
    free = _unbanded(terms)

    def matmul(pr, v_c):
        return jnp.einsum("...ij,...jd->...id", pr, v_c, preferred_element_type=dtype,
                          precision=precision)

    def update(carry, s, ok, v_c):
        """One online-softmax step of the rows in ``carry`` over logits ``s``."""
        s = jnp.broadcast_to(_masked(s, ok), batch + s.shape[-2:])
        return tuple(online_step(Running(*carry), s, v_c, matmul))

    def q_block(a):
        i0 = a * bq
        row_b = _rows(p.row, i0, bq)
        pair_r = jax.tree.map(lambda x: _slice(x, i0, bq, -2), p.pair)
        const_r = p.const.map(lambda x: _slice(x, i0, bq, -2), lambda x: x)
        i_idx = i_start + i0 + jnp.arange(bq)

        def body_of(pattern, tab):
            def body(t, carry):
                j0 = tab[a, t] * bk
                col_b = _rows(p.col, j0, bk)
                v_b = _slice(p.v, j0, bk, -2)
                pair_b = jax.tree.map(lambda x: _slice(x, j0, bk, -1), pair_r)
                const_b = const_r.map(*(lambda x: _slice(x, j0, bk, -1),) * 2)
                j_loc = j0 + jnp.arange(bk)
                # each rectangle updates its own rows; rows of no rectangle keep the carry
                rows = [None] * len(pattern)
                for n_rect, rect in enumerate(pattern):
                    r0, rn, c0, cn, masked = rect
                    row, col, pair, const, i_r, j_r = _piece_arrays(
                        rect, row_b, col_b, pair_b, const_b, i_idx, j_loc)
                    s, ok = block_logits(
                        terms if masked else free, row, col, pair, p.glob, const, i_r,
                        j_start + j_r, dtype,
                        (j_r < terms.num_parents) if (check_cols and masked) else None,
                        precision=precision,
                    )
                    mine = tuple(_sub(x, r0, rn, ax) for x, ax in zip(carry, (-1, -1, -2)))
                    rows[n_rect] = (r0, rn, update(mine, s, ok, _sub(v_b, c0, cn, -2)))
                return _merge_rows(carry, rows, bq)

            return body

        init = tuple(online_start(batch + (bq,), dv, dtype))
        state = Running(*_loops(tables, a, body_of, init))
        out, lse = online_finish(state)
        if nan_rows:  # the engine's convention, in the same pass as the division
            out = with_nan_rows(out, lse)
        return out.astype(out_dtype), online_stats(state)

    def write(a, bufs):
        # each child block's rows go straight to their place in the output (no stacked
        # (blocks, *batch, bq, dv) array to transpose afterwards)
        out, stats = q_block(a)
        i0 = a * bq
        return tuple(lax.dynamic_update_slice_in_dim(buf, x, i0, axis=len(batch))
                     for buf, x in zip(bufs, (out, *stats)))

    out, m, log_l = lax.fori_loop(0, nqb, write, (jnp.zeros(batch + (n_pad, dv), out_dtype),
                                                  jnp.zeros(batch + (n_pad,), dtype),
                                                  jnp.zeros(batch + (n_pad,), dtype)))
    n = terms.num_children
    return out[..., :n, :], RowStats(m[..., :n], log_l[..., :n])


def _merge_rows(carry, rows, bq: int):
    """The carry ``(m, l, acc)`` with the rows of each ``(r0, rn, new)`` replaced."""
    if len(rows) == 1 and rows[0][1] == bq:
        return rows[0][2]
    parts, at = [], 0
    for r0, rn, new in sorted(rows, key=lambda r: r[0]):
        if r0 > at:
            parts.append(tuple(_sub(x, at, r0 - at, ax) for x, ax in zip(carry, (-1, -1, -2))))
        parts.append(new)
        at = r0 + rn
    if at < bq:
        parts.append(tuple(_sub(x, at, bq - at, ax) for x, ax in zip(carry, (-1, -1, -2))))
    return tuple(jnp.concatenate([q[i] for q in parts], axis=(-1, -1, -2)[i]) for i in range(3))


def _backward(terms, sched, batch, prob: Problem, starts, out, stats: RowStats, d_out,
              d_lse, precision=None):
    bq, bk = sched.block_q, sched.block_k
    nqb, nkb = sched.nqb, sched.nkb
    n_pad, m_pad = nqb * bq, nkb * bk
    check_cols = m_pad != terms.num_parents
    i_start, j_start = starts
    p = _pad_problem(terms, prob, n_pad, m_pad)
    # the matmuls multiply in the operands' dtype and accumulate in `dtype`, as the
    # gradients do across blocks; each gradient is cast to its input's dtype at the end
    dtype = accum_dtype(p.v.dtype)
    mm = dict(preferred_element_type=dtype, precision=precision)
    delta = backward_delta(out, d_out, stats.lse(), d_lse, dtype)
    d_out = _pad_axis(d_out.astype(p.v.dtype), -2, n_pad)
    delta = _pad_axis(delta, -1, n_pad)
    # padded rows have no edge (log l = -inf): p = 0 there
    stats = RowStats(_pad_axis(stats.m, -1, n_pad), _pad_axis(stats.log_l, -1, n_pad, -jnp.inf))
    tables = _group_tables(sched, sched.bwd, True)

    def zeros(tree):  # gradient accumulators, in the accumulation dtype
        return jax.tree.map(lambda x: jnp.zeros(x.shape, dtype), tree)

    rest = dataclasses.replace(terms, dot=False)
    has_rest = bool(terms.idw or terms.col_bias or terms.pair_logits or terms.geometric
                    or terms.relpos is not None)
    rest_free = _unbanded(rest)

    def rect_grads(rect, row, col, pair, const, i_r, j_r, glob, v_c, do_r, stats_r, delta_r):
        """Gradients of one rectangle: to its rows, columns, pairs, globals and values.

        Without terms besides the dot product and the mask, the rectangle is worked on
        transposed, parents x children (`block_logits(transposed=True)`): every dot but
        dQ then reads its operands in a fast form without a copy (see `_transposed`), so
        one block is materialised instead of two. With other terms it is worked on
        children x parents: their VJPs reduce along the block's rows (a geometric
        prior's over each row's distances), which XLA:CPU runs several times faster
        along the minor axis."""
        masked = rect[4]
        col_valid = (j_r < terms.num_parents) if (check_cols and masked) else None
        tr = not has_rest

        def f(r, c, pp, g):
            return block_logits(rest if masked else rest_free, r, c, pp, g, const, i_r,
                                j_start + j_r, dtype, col_valid, transposed=tr,
                                precision=precision)

        # the dot term is differentiated by hand below; the rest through its VJP
        s_rest, vjp_fn, ok = jax.vjp(f, row, col, pair, glob, has_aux=True)
        s = s_rest
        if terms.dot:
            spec = "...jf,...if->...ji" if tr else "...if,...jf->...ij"
            s_dot = jnp.einsum(spec, col.k, row.q, **mm) if tr else jnp.einsum(
                spec, row.q, col.k, **mm)
            if terms.dot_scale is not None:
                s_dot = s_dot * jnp.asarray(terms.dot_scale, s_dot.dtype)
            qk = s_dot  # the unscaled products, for a traced scale's gradient
            if glob.dot_scale is not None:  # a traced scale, (1,)
                s_dot = s_dot * glob.dot_scale[0].astype(s_dot.dtype)
            s = s_dot + s_rest
        sm = jnp.broadcast_to(_masked(s, ok), batch + s.shape[-2:])
        if tr:  # pt, dpt, dst: (..., cn, rn)
            pt = backward_probs(sm, *(x[..., None, :] for x in stats_r))
            d_v = jnp.einsum("...ji,...id->...jd", pt.astype(do_r.dtype), do_r, **mm)
            dpt = jnp.einsum("...jd,...id->...ji", v_c, do_r, **mm)
            ds_t = pt * (dpt - delta_r[..., None, :])
            ds = _transposed(ds_t) if terms.dot else None
        else:  # pr, dp, ds: (..., rn, cn)
            pr = backward_probs(sm, *(x[..., :, None] for x in stats_r))
            d_v = jnp.einsum("...ji,...id->...jd", _transposed(pr.astype(do_r.dtype)), do_r,
                             **mm)
            dp = jnp.einsum("...id,...jd->...ij", do_r, v_c, **mm)
            ds = pr * (dp - delta_r[..., :, None])
            ds_t = _transposed(ds) if terms.dot else None
        dr, dc, dpp, dg = vjp_fn(sum_to(ds_t if tr else ds, s_rest.shape))
        if terms.dot:
            q_r, k_c = row.q, col.k
            shape_t = jnp.broadcast_shapes(q_r.shape[:-2], k_c.shape[:-2]) + (
                k_c.shape[-2], q_r.shape[-2])
            dq = jnp.einsum("...ij,...jf->...if",
                            sum_to(ds, shape_t[:-2] + shape_t[-1:] + shape_t[-2:-1]).astype(
                                k_c.dtype), k_c, **mm)
            dk = jnp.einsum("...ji,...if->...jf", sum_to(ds_t, shape_t).astype(q_r.dtype),
                            q_r, **mm)
            if terms.dot_scale is not None:  # d(s q.k): s times the unscaled products
                dq, dk = (x * jnp.asarray(terms.dot_scale, x.dtype) for x in (dq, dk))
            if glob.dot_scale is not None:  # a traced s: s times the unscaled products
                dq, dk = (x * glob.dot_scale[0].astype(x.dtype) for x in (dq, dk))
            dr = dataclasses.replace(dr, q=dr.q + sum_to(dq, q_r.shape))
            dc = dataclasses.replace(dc, k=dc.k + sum_to(dk, k_c.shape))
        sums = None
        if terms.dot and glob.dot_scale is not None:  # a traced s: its row sums
            ax = -2 if tr else -1
            pm, dsm = (pt, ds_t) if tr else (pr, ds)
            sums = jnp.stack(scale_row_sums(pm, dsm, qk, ax), -1)
        return dr, dc, dpp, dg, d_v, sums

    def k_block(carry, b):
        d_row, d_pair, d_glob, d_sums = carry
        j0 = b * bk
        col_b = _rows(p.col, j0, bk)
        v_b = _slice(p.v, j0, bk, -2)
        j_loc = j0 + jnp.arange(bk)

        def body_of(pattern, tab):
            def body(t, inner):
                d_row, d_pair, d_glob, d_sums, d_col, d_v = inner
                i0 = tab[b, t] * bq
                i_idx = i_start + i0 + jnp.arange(bq)
                row_b = _rows(p.row, i0, bq)
                pair_b = _pair_block(p.pair, i0, j0, bq, bk)
                const_b = _const_block(p.const, i0, j0, bq, bk)
                do_b = _slice(d_out, i0, bq, -2)
                stats_b = [_slice(x, i0, bq, -1) for x in stats]
                delta_b = _slice(delta, i0, bq, -1)
                for rect in pattern:
                    r0, rn, c0, cn, _ = rect
                    row, col, pair, const, i_r, j_r = _piece_arrays(
                        rect, row_b, col_b, pair_b, const_b, i_idx, j_loc)
                    dr, dc, dpp, dg, dv, sums = rect_grads(
                        rect, row, col, pair, const, i_r, j_r, p.glob, _sub(v_b, c0, cn, -2),
                        _sub(do_b, r0, rn, -2), [_sub(x, r0, rn, -1) for x in stats_b],
                        _sub(delta_b, r0, rn, -1))
                    d_row = jax.tree.map(partial(_update, starts={-2: i0 + r0}), d_row, dr)
                    d_pair = jax.tree.map(partial(_update, starts={-2: i0 + r0, -1: j0 + c0}),
                                          d_pair, dpp)
                    d_glob = jax.tree.map(jnp.add, d_glob, dg)
                    if sums is not None:
                        d_sums = _update(d_sums, sums, starts={-2: i0 + r0})
                    d_col = jax.tree.map(partial(_add_at, start=c0, axis=-2), d_col, dc)
                    d_v = _add_at(d_v, dv, c0, -2)
                return d_row, d_pair, d_glob, d_sums, d_col, d_v

            return body

        d_col0 = zeros(col_b)
        d_v0 = jnp.zeros(batch + v_b.shape[-2:], dtype)
        d_row, d_pair, d_glob, d_sums, d_col, d_v = _loops(
            tables, b, body_of, (d_row, d_pair, d_glob, d_sums, d_col0, d_v0)
        )
        return (d_row, d_pair, d_glob, d_sums), (d_col, sum_to(d_v, v_b.shape))

    # a traced scale's gradient is read off three sums per row (`scale_row_sums`)
    sums0 = (jnp.zeros(batch + (n_pad, 3), dtype)
             if terms.dot and p.glob.dot_scale is not None else None)
    (d_row, d_pair, d_glob, d_sums), (d_col, d_v) = lax.scan(
        k_block, (zeros(p.row), zeros(p.pair), zeros(p.glob), sums0), jnp.arange(nkb)
    )
    n, m = terms.num_children, terms.num_parents
    if d_sums is not None:
        r, e, c = (d_sums[..., :n, i] for i in range(3))
        d_s = scale_grad(r, e, c, d_lse, stats.lse()[..., :n])
        d_glob = dataclasses.replace(d_glob, dot_scale=d_glob.dot_scale + d_s.reshape(
            d_glob.dot_scale.shape))

    def unblock(x):  # (nkb, ..., bk, f) -> (..., m, f)
        x = jnp.moveaxis(x, 0, -3)
        return x.reshape(x.shape[:-3] + (m_pad, x.shape[-1]))[..., :m, :]

    d_row = jax.tree.map(lambda x, a: x[..., :n, :].astype(a.dtype), d_row, prob.row)
    d_pair = jax.tree.map(lambda x, a: x[..., :n, :m].astype(a.dtype), d_pair, prob.pair)
    d_col = jax.tree.map(lambda x, a: unblock(x).astype(a.dtype), d_col, prob.col)
    d_glob = jax.tree.map(lambda x, a: x.astype(a.dtype), d_glob, prob.glob)
    return d_row, d_col, d_pair, d_glob, unblock(d_v).astype(prob.v.dtype)


def _hook_kwargs(hook: Callable, precision, has_starts: bool, starts, mask) -> dict:
    """The keyword arguments of a replacement pass: ``precision``, ``starts`` and the
    concrete per-edge ``mask`` when given (a replacement that takes none of them is called
    without them; ``mask`` only where ``hook`` takes it)."""
    kw = {} if precision is None else {"precision": precision}
    if has_starts:
        kw["starts"] = starts
    if mask is not None and _takes(hook, "mask"):
        kw["mask"] = mask.array
    return kw


def _takes(fn: Callable, name: str, catch_all: bool = True) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (or any, ``**kwargs``, unless
    ``catch_all`` is False: then only a parameter of that name counts)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: do not pass it
        return False
    return any(p.name == name and p.kind != p.POSITIONAL_ONLY
               or catch_all and p.kind == p.VAR_KEYWORD for p in params)


class _ArrayKey:
    """A concrete mask (NumPy array or `BlockMask`) as part of a static argument: hashed
    and compared by its contents
    (so that equal masks give equal static arguments from call to call). Not a copy: a
    key is made and read within one trace (at n = 16384 a copy of a mask took 0.5 s)."""

    def __init__(self, array: ConcreteMask):
        self.array = array if isinstance(array, BlockMask) else np.asarray(array)
        self._key = mask_key(self.array)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other) -> bool:
        return isinstance(other, _ArrayKey) and self._key == other._key


def mask_per_block(terms: Terms, prob: Problem, batch_shape, mask: ConcreteMask | None
                   ) -> tuple[Terms, Problem]:
    """The edge with its per-edge mask read per block from a `BlockMask` (`Terms.
    mask_blocks`, ``const.block_ok``) in place of the ``(n, m)`` ``const.pair_ok``, which
    XLA would hold in memory for the blocked kernel's loops to slice.

    ``mask`` must *be* the per-edge mask, equal to ``const.pair_ok`` in every batch
    element, as a site's `Lowered.mask` is (not only meet the looser contract of
    `blocked_attention`'s ``mask``). The edge is returned unchanged unless ``mask`` is a
    `BlockMask` whose batch dims are those of ``batch_shape`` (not, e.g., those of the
    whole batch when these are a shard's arrays). For the blocked kernel's own passes
    (not replacement passes, which read ``const.pair_ok``)."""
    if not (isinstance(mask, BlockMask) and terms.pair_ok):
        return terms, prob
    blocks = mask.blocks
    batch = tuple(batch_shape)
    try:
        if np.broadcast_shapes(blocks.shape[:-2], batch) != batch:
            return terms, prob
    except ValueError:
        return terms, prob
    terms = dataclasses.replace(terms, pair_ok=False, mask_blocks=mask.block_size)
    const = dataclasses.replace(prob.const, pair_ok=None, block_ok=jnp.asarray(blocks))
    return terms, dataclasses.replace(prob, const=const)


def _run_forward(static, prob: Problem, starts) -> tuple[jax.Array, RowStats]:
    """``(y, RowStats)`` of the forward (this kernel's or the replacement's)."""
    terms, sched, batch, forward, _, nan_rows, precision, out_dtype, has_starts, mask, _ = (
        static.value)
    if forward is not None:
        kw = _hook_kwargs(forward, precision, has_starts, starts, mask)
        # a replacement that names `nan_rows` writes the NaN rows itself (one pass less)
        writes = nan_rows and _takes(forward, "nan_rows", catch_all=False)
        if writes:
            kw["nan_rows"] = True
        # one that names `stats` returns the rows' statistics in place of L
        if _takes(forward, "stats", catch_all=False):
            kw["stats"] = True
        out, stats = forward(terms, prob, batch, **kw)
        stats = as_row_stats(stats)
        if nan_rows and not writes:
            out = with_nan_rows(out, stats.lse())
        acc = accum_dtype(prob.v.dtype)
        return (out.astype(out_dtype or prob.v.dtype),
                RowStats(*(x.astype(acc) for x in stats)))
    return _forward(terms, sched, batch, prob, starts, nan_rows, precision, out_dtype)


def _public(static, out, stats: RowStats):
    """The kernel's result: ``(y, L)``, or ``(y, RowStats)`` when ``stats`` was asked."""
    return (out, stats) if static.value[-1] else (out, stats.lse())


@jax.custom_vjp
def _attend(static, row, col, pair, glob, const, v, starts):
    return _public(static, *_run_forward(static, Problem(row, col, pair, glob, const, v),
                                         starts))


def _is_primal(x) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _attend_fwd(static, row, col, pair, glob, const, v, starts):
    # symbolic zeros: each array comes with whether it is differentiated (`perturbed`); a
    # replacement backward skips the gradients nobody asked for (the relative-position
    # table's takes a pass of its own)
    def perturbed(x) -> bool:  # some array of a `Globals` field is differentiated
        return any(_is_primal(a) and a.perturbed for a in jax.tree.leaves(x, is_leaf=_is_primal))

    need = tuple(f.name for f in dataclasses.fields(glob) if perturbed(getattr(glob, f.name)))
    row, col, pair, glob, const, v, starts = jax.tree.map(
        lambda x: x.value if _is_primal(x) else x, (row, col, pair, glob, const, v, starts),
        is_leaf=_is_primal)
    prob = Problem(row, col, pair, glob, const, v)
    _, _, _, forward, *_ = static.value
    if forward is not None:  # a fused kernel's forward
        prob = _no_derivative(prob)
    out, stats = _run_forward(static, prob, starts)
    return _public(static, out, stats), (static, _Static(frozenset(need)), prob, starts, out,
                                         stats)


def _float0(tree):
    return jax.tree.map(lambda x: np.zeros(np.shape(x), jax.dtypes.float0), tree)


def _attend_bwd(res, cts):
    static, need, prob, starts, out, stats = res
    terms, sched, batch, _, backward, nan_rows, precision, _, has_starts, mask, with_stats = (
        static.value)
    d_out, d_second = jax.tree.map(
        lambda c: jnp.zeros(c.aval.shape, c.aval.dtype) if isinstance(c, SymbolicZero) else c,
        cts, is_leaf=lambda c: isinstance(c, SymbolicZero))
    if nan_rows:  # the NaN rows are a `with_nan_rows` where: their cotangent is zeroed
        # (a loss that drops them after a nonlinearity sends 0 * NaN there)
        d_out = jnp.where(jnp.isfinite(stats.lse())[..., None], d_out, 0)
    # with `stats`, m is a shift (not differentiated) and log l's cotangent is L's
    d_lse = d_second.log_l if with_stats else d_second
    if backward is not None:
        prob, out, stats, d_out, d_lse = _no_derivative((prob, out, stats, d_out, d_lse))
        d_row, d_col, d_pair, d_glob, d_v = backward(
            terms, prob, batch, out, stats, d_out, d_lse, need_glob=need.value,
            **_hook_kwargs(backward, precision, has_starts, starts, mask))
    else:
        d_row, d_col, d_pair, d_glob, d_v = _backward(
            terms, sched, batch, prob, starts, out, stats, d_out, d_lse, precision
        )
    return (None, d_row, d_col, d_pair, d_glob, _float0(prob.const), d_v, _float0(starts))


_attend.defvjp(_attend_fwd, _attend_bwd, symbolic_zeros=True)


@jax.custom_jvp
def _no_derivative(x):
    """The identity on the inputs of a replacement forward or backward (the fused
    kernels' passes, which have no derivative of their own), refusing to be
    differentiated with a message that names the way out (Pallas' own error is a bare
    ``AssertionError``). A gradient never differentiates it: the custom VJP runs the
    passes on primal values; a second derivative does."""
    return x


@_no_derivative.defjvp
def _no_derivative_jvp(primals, tangents):
    raise TypeError(
        "structinfer.attention: a derivative of a gradient (jax.hessian, "
        "jax.jacfwd(jax.grad(f)), jax.grad(jax.grad(f))) through the fused kernels "
        "(Pallas, Mosaic GPU) is not available: their passes have no derivative of their "
        "own; backend 'blocked', 'dense', 'windowed' or 'exact' differentiates its gradient")


class _Static:
    """Hashable-by-identity holder for static kernel configuration (a custom_vjp arg
    that carries no arrays)."""

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(
    _Static, lambda s: ((), s.value), lambda value, _: _Static(value)
)


def blocked_attention(
    terms: Terms,
    prob: Problem,
    batch_shape: tuple[int, ...],
    *,
    block_q: int = 128,
    block_k: int = 128,
    mask: ConcreteMask | None = None,
    schedule: Schedule | None = None,
    starts: tuple | None = None,
    forward: Callable | None = None,
    backward: Callable | None = None,
    nan_rows: bool = False,
    precision: lax.PrecisionLike = None,
    out_dtype=None,
    stats: bool = False,
) -> tuple[jax.Array, jax.Array | RowStats]:
    r"""Run the blocked kernel: posterior expectation and row log-partition.

    Args:
        terms, prob: a lowered edge site (`structinfer.lowering._spec`).
        batch_shape: the broadcast batch shape (heads, batch) of the result.
        block_q, block_k: block sizes (any lengths; the last block is padded).
        mask: optional concrete mask used to skip empty blocks, a NumPy boolean array or
            a [`BlockMask`][structinfer.lowering.BlockMask] (a replacement pass that
            takes ``mask=`` may be given either): the value of the per-edge mask when the
            terms have one (``terms.pair_ok``), with the contract
            `structinfer.lowering.accel.pallas_forward` states for its ``mask``.
        schedule: a precomputed `Schedule` (overrides the three above).
        starts: optional traced ``(i_start, j_start)`` global indices of the first
            child / parent of these arrays (a shard of a longer sequence); distances
            are computed from global indices. Use a dense schedule with them. Passed on
            to ``forward`` and ``backward`` as ``starts=`` when given.
        forward: optional ``forward(terms, prob, batch_shape) -> (y, L)`` that replaces
            this kernel's forward pass (an accelerator's fused kernel, e.g.
            `structinfer.lowering.accel.pallas_forward`), called with ``precision=``
            and ``starts=`` too when they are given, and with ``mask=`` when it takes a
            ``mask`` argument, there is a per-edge mask, ``mask`` is given and
            ``starts`` is not, with ``nan_rows=True`` when ``nan_rows`` is set and it
            has a parameter of that name (it then writes the NaN rows itself; otherwise
            this function does), and with ``stats=True`` when it has a parameter of that
            name: it then returns ``(y, RowStats)``, the rows' $m$ and $\log l$, which the
            backward reads (a forward that returns only ``L`` stands for $m = L$,
            $\log l = 0$: `RowStats.of_lse`); the gradient is still this kernel's
            backward (which needs only ``y`` and the statistics) unless ``backward`` is
            given too.
        backward: optional ``backward(terms, prob, batch_shape, y, stats, dy, dL, *,
            need_glob) -> (d_row, d_col, d_pair, d_glob, d_v)`` that replaces this
            kernel's backward pass (e.g. `structinfer.lowering.accel.pallas_backward`),
            given the forward's `RowStats` ``stats``:
            cotangents with the structure of ``prob.row``, ``.col``, ``.pair``, ``.glob``
            and ``.v``; ``need_glob`` names the `Globals` fields being differentiated
            (the others' gradients may be zeros); called with ``precision=``,
            ``starts=`` and ``mask=`` as ``forward`` is. ``dL`` is the cotangent of the
            log-normaliser (nonzero when partial results are merged by it, as ring
            attention does).
        nan_rows: rows whose log-partition is not finite (no allowed parent, a NaN / inf
            logit) are NaN in ``y`` — the exact engine's answer under ``jit`` — instead of
            0 (what merging partial results, as ring attention does, needs). Written in
            the kernel's last pass over each block of rows, not as a pass of its own.
        precision: the ``precision`` of every matmul, forward and backward (``None``:
            JAX's default, which follows ``jax.default_matmul_precision``).
        out_dtype: dtype of ``y`` (``None``: the value table's; ring attention merges
            partial results in the accumulation dtype).
        stats: return the rows' `RowStats` ($m$ and $\log l$, $L = m + \log l$) in place
            of ``L``, for merging partial results exactly (ring attention,
            `_softmax.online_merge`): $m$ is a shift and is not differentiated (its
            cotangent is dropped), the cotangent of $\log l$ is read as that of $L$.

    Returns:
        ``(y, L)`` with ``y`` of shape ``batch + (n, dv)`` and ``L`` the row
        log-sum-exp of the (unnormalised) logits, ``batch + (n,)`` (with ``stats``:
        ``(y, RowStats)``, whose $m$ carries no gradient: differentiate $L$ =
        ``RowStats.lse()`` instead). Both are differentiable (custom VJP, memory $O(n d)$: the
        backward keeps ``y``, $m$ and $\log l$ and rebuilds each block's
        $p = e^{(\ell - m) - \log l}$). The matmuls multiply in the
        operands' dtype and accumulate in float32 (float64 for float64 operands), as do
        the online softmax's running maximum and sum, ``L`` and the gradients across
        blocks; ``y`` is in ``out_dtype`` and each gradient in its input's dtype.

    Cost: $O(\text{live blocks} \cdot b_q b_k (d + d_v))$ time,
    $O(b_q b_k)$ extra memory per step.
    """
    if schedule is None:
        bq = max(1, min(int(block_q), terms.num_children))
        bk = max(1, min(int(block_k), terms.num_parents))
        # with both passes replaced, this kernel's own blocks are never visited: no need
        # to read the mask for them
        replaced = forward is not None and backward is not None
        schedule = None if replaced else make_schedule(terms, bq, bk, mask)
    dtype = prob.v.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"blocked_attention: value table must be floating, got {dtype}")
    has_starts = starts is not None
    if not has_starts:
        starts = (0, 0)
    elif schedule is not None:  # distances come from shifted (traced) indices: mask
        schedule = schedule.without_full()  # every block
    # a replacement pass is given the concrete per-edge mask (its own blocks differ)
    hook_mask = (_ArrayKey(mask) if mask is not None and terms.pair_ok and not has_starts
                 and (forward is not None or backward is not None) else None)
    static = _Static((terms, schedule, tuple(batch_shape), forward, backward, bool(nan_rows),
                      precision, None if out_dtype is None else jnp.dtype(out_dtype),
                      has_starts, hook_mask, bool(stats)))
    starts = tuple(jnp.asarray(s, jnp.int32) for s in starts)
    return _attend(static, prob.row, prob.col, prob.pair, prob.glob, prob.const, prob.v, starts)
