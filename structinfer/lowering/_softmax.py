r"""The online softmax, written once: every blocked kernel's step, finish and merge.

A row's softmax-weighted sum $y_i = \sum_j e^{\ell_{ij}} V_j / \sum_j e^{\ell_{ij}}$ and
its log-normaliser $L_i = \log\sum_j e^{\ell_{ij}}$ are accumulated over blocks of parents
in a running state $(m_i, l_i, a_i)$: the largest logit seen, $l_i = \sum_j
e^{\ell_{ij} - m_i}$ and $a_i = \sum_j e^{\ell_{ij} - m_i} V_j$. A block of logits $s$
updates it as

$$
m' = \max(m, \max_j s_j), \qquad
l' = e^{m - m'}\, l + \sum_j e^{s_j - m'}, \qquad
a' = e^{m - m'}\, a + \sum_j e^{s_j - m'} V_j,
$$

and the row ends as $y = a / l$, $L = m + \log l$ (Milakov & Gimelshein 2018; the
flash-attention schedule). While a row has seen no allowed edge its maximum is
$-\infty$; the shift is then 0 (`online_shift`), so $e^{-\infty - 0} = 0$ rather than NaN, and a
row that never sees one ends with $y = 0$, $L = -\infty$ (the kernels write it NaN where
the engine's convention asks for it).

The functions are plain `jax.numpy` on arrays whose last axis is the block's parents
(``s``: ``(..., rows, cols)``, the state's rows ``(..., rows)``): the same code runs in
the blocked kernel's XLA loops and inside the Pallas kernel body, and merges the partial
results of ring attention. Every quantity is in the state's dtype (the accumulation dtype,
`accum_dtype`); ``matmul`` multiplies the probabilities, cast to the value's dtype, with
the values and accumulates in it.

The backward (FlashAttention-2's) recomputes each block's probabilities from the
forward's saved row statistics (`RowStats`: $m_i$ and $\log l_i$, `online_stats`) as
$p_{ij} = e^{(\ell_{ij} - m_i) - \log l_i}$ (`backward_probs`), not from $L_i$: where a
row's logits are huge (a fully masked row written as a finite $-10^9$ bias) float32 rounds
$m_i$ and $L_i = m_i + \log l_i$ to the same number, and $e^{\ell_{ij} - L_i}$ would be 1
on every key while the forward's $e^{\ell_{ij} - m_i} / l_i$ is $1/n$. It needs one number
per row, $\delta_i$ (`backward_delta`): with $\mathrm{d}p_{ij} = \mathrm{d}y_i^\top V_j$,
the logits' cotangent is $\mathrm{d}s_{ij} = p_{ij}(\mathrm{d}p_{ij} - \delta_i)$. Every
backward (the blocked kernel's loops, the Pallas passes; the Mosaic GPU passes in base 2)
computes both here. Partial results of ring attention are merged by their statistics too
(`online_merge`): the weights of the parts stay exact, and each part's backward reads
its own $m$ and $\log l$ and the cotangents of its $y$ and $\log l$ that the merge's
gradient gives it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["Running", "RowStats", "as_row_stats", "require_row_stats", "online_start",
           "online_shift", "online_step", "online_finish", "online_stats", "online_merge",
           "with_nan_rows", "backward_delta", "backward_probs", "scale_row_sums",
           "scale_grad", "weighted_values"]


class Running(NamedTuple):
    """The online softmax's state for a block of rows (a pytree)."""

    #: the largest logit seen, ``(..., rows)`` (``-inf`` before any allowed edge)
    m: jax.Array
    #: $\sum_j e^{\ell_{ij} - m_i}$, ``(..., rows)``
    l: jax.Array  # noqa: E741
    #: $\sum_j e^{\ell_{ij} - m_i} V_j$, ``(..., rows, dv)``
    acc: jax.Array


def online_start(rows: tuple[int, ...], dv: int, dtype) -> Running:
    """The state of ``rows`` (a shape, batch dims included) before any block."""
    return Running(jnp.full(rows, -jnp.inf, dtype), jnp.zeros(rows, dtype),
                   jnp.zeros(rows + (dv,), dtype))


def online_shift(m: jax.Array) -> jax.Array:
    """The exponent shift for running maxima ``m``: ``m``, or 0 where it is ``-inf``."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def online_step(state: Running, s: jax.Array, v: jax.Array,
         matmul: Callable[[jax.Array, jax.Array], jax.Array]) -> Running:
    r"""One block: ``state`` updated with logits ``s`` ``(..., rows, cols)`` (``-inf`` on
    forbidden edges) and values ``v`` ``(..., cols, dv)``; ``matmul(p, v)`` is the
    ``(..., rows, dv)`` product of the block's $e^{s - m'}$ (in ``v``'s dtype) with ``v``,
    accumulated in the state's dtype."""
    m_new = jnp.maximum(state.m, jnp.max(s, axis=-1))
    m_safe = online_shift(m_new)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(state.m - m_safe)
    acc = state.acc * corr[..., None] + matmul(p.astype(v.dtype), v)
    return Running(m_new, state.l * corr + jnp.sum(p, axis=-1), acc)


class RowStats(NamedTuple):
    r"""The rows' softmax statistics a forward saves for its backward (a pytree):
    $m_i$ and $\log l_i$ with $l_i = \sum_j e^{\ell_{ij} - m_i}$, so that
    $L_i = m_i + \log l_i$ and $p_{ij} = e^{(\ell_{ij} - m_i) - \log l_i}$.

    A row with no allowed edge, or whose sum is not positive (a NaN logit: $l_i$ NaN), has
    $\log l_i = -\infty$ and $L_i = -\infty$ (its $m_i$ is then $-\infty$, NaN, or for a
    merged result 0); the backward gives it $p = 0$."""

    #: the largest logit, ``(..., rows)``
    m: jax.Array
    #: $\log \sum_j e^{\ell_{ij} - m_i}$, ``(..., rows)`` (``-inf``: no edge)
    log_l: jax.Array

    def lse(self) -> jax.Array:
        r"""The row log-normalisers $L = m + \log l$ (``-inf`` where $\log l = -\infty$)."""
        return jnp.where(self.log_l == -jnp.inf, -jnp.inf, self.m + self.log_l)

    @staticmethod
    def of_lse(lse: jax.Array) -> RowStats:
        r"""Statistics that stand for log-normalisers ``lse`` alone ($m = L$, $\log l = 0$,
        or $-\infty$ where $L = -\infty$): $p = e^{\ell - L}$, exact except in rows whose
        logits are so large that float32 rounds $\log l$ out of $L$ (pass the forward's
        `RowStats` for those)."""
        return RowStats(lse, jnp.where(lse == -jnp.inf, -jnp.inf, jnp.zeros_like(lse)))


def as_row_stats(stats: RowStats | jax.Array) -> RowStats:
    """``stats``, or `RowStats.of_lse` of an array of log-normalisers."""
    return stats if isinstance(stats, RowStats) else RowStats.of_lse(stats)


def require_row_stats(stats: Any, caller: str) -> RowStats:
    r"""``stats`` when it is a `RowStats`; a backward refuses anything else.

    Raises:
        TypeError: naming ``caller`` and its ``stats`` argument. An array of row
            log-normalisers $L$ alone is refused: read as $m = L$, $\log l = 0$ it gives
            finite wrong gradients in rows whose logits are so large that float32 rounds
            $\log l$ out of $L$.
    """
    if isinstance(stats, RowStats):
        return stats
    got = (f"an array of shape {tuple(jnp.shape(stats))}" if hasattr(stats, "shape")
           else type(stats).__name__)
    raise TypeError(
        f"{caller}: stats must be the forward's row statistics (m and log l: the second "
        f"result of pallas_forward / mosaic_forward with stats=True), got {got}; the row "
        "log-normaliser L alone gives wrong gradients in rows of very large logits"
    )


def online_stats(state: Running) -> RowStats:
    r"""The rows' `RowStats`: $m$ and $\log l$ ($-\infty$ where $l$ is not positive)."""
    pos = state.l > 0
    return RowStats(state.m, jnp.where(pos, jnp.log(jnp.where(pos, state.l, 1.0)), -jnp.inf))


def online_finish(state: Running) -> tuple[jax.Array, jax.Array]:
    r"""``(y, L)`` of the rows: $a / l$ and $m + \log l$; a row with no allowed edge
    ($l = 0$) gives $y = 0$, $L = -\infty$."""
    pos = state.l > 0
    l_safe = jnp.where(pos, state.l, 1.0)
    return state.acc / l_safe[..., None], online_stats(state).lse()


def online_merge(ya: jax.Array, sa: RowStats, yb: jax.Array, sb: RowStats
                 ) -> tuple[jax.Array, RowStats]:
    r"""Two normalised partial results of the same rows, over disjoint sets of parents,
    as one, by their statistics (`RowStats`): with $m = \max(m_a, m_b)$,

    $$
    l = e^{m_a - m + \log l_a} + e^{m_b - m + \log l_b}, \qquad
    y = \big(e^{m_a - m + \log l_a} y_a + e^{m_b - m + \log l_b} y_b\big) / l,
    $$

    and the result's statistics are $(m, \log l)$, so $L = \log(e^{L_a} + e^{L_b})$.
    Exact where a row's logits are so large that float32 rounds $\log l$ out of $L$
    (merging by $L$ alone would weigh the parts alike, whatever their numbers of
    parents). The maxima are shifts, not differentiated (the merged $y$ and $L$ do not
    depend on them): the gradient reaches each part through its $y$ and $\log l$, whose
    cotangent is that of its $L$ (`blocked_attention`'s ``stats``). A part with
    $\log l = -\infty$ contributes nothing."""
    def key(s):  # a part without an edge has no maximum (its m may be -inf or NaN)
        return jnp.where(s.log_l == -jnp.inf, -jnp.inf, lax.stop_gradient(s.m))

    ka, kb = key(sa), key(sb)
    m = online_shift(jnp.maximum(ka, kb))
    ea, eb = jnp.exp(ka - m + sa.log_l), jnp.exp(kb - m + sb.log_l)
    state = Running(m, ea + eb, ea[..., None] * ya + eb[..., None] * yb)
    return online_finish(state)[0], online_stats(state)


def with_nan_rows(y: jax.Array, lse: jax.Array, *, pass_through: bool = False,
                  scatter: bool = True) -> jax.Array:
    r"""The engine's convention on a kernel's output: NaN in the rows whose log-normaliser
    $L_i$ is not finite (no allowed parent, a NaN / inf score), ``y`` elsewhere.

    Differentiated as a ``where`` by default: those rows' cotangent is zeroed, so a loss
    that drops the NaN rows, even after a nonlinearity (``where(ok, sin(y), 0)``), keeps
    finite gradients; forward mode and higher derivatives work. With ``pass_through``
    (for a kernel whose every row has an allowed parent, `Kernel.rows_allowed`, where
    $L_i$ is not finite only for non-finite inputs) it is differentiated as the identity
    in ``y`` (nothing from ``L``), and the reverse pass adds nothing over the cotangent.
    Then, with ``scatter`` (reverse mode only), a ``y`` that is not differentiated gets
    its NaN rows by a scatter into it, which XLA may run in place (reading one index per
    row and writing only the NaN rows, not a pass over ``y``; not yet timed on a GPU),
    and a differentiated one by the ``where``, left to fuse into its consumer (the
    loss). Without ``scatter`` (an array sharded over a mesh, where a scatter's indices
    would be gathered across devices) it is the ``where``, in any mode.

    Args:
        y: ``(..., rows, dv)`` output.
        lse: ``(..., rows)`` row log-normalisers (broadcasting against ``y``'s batch).
        pass_through: differentiate as the identity in ``y``.
        scatter: with ``pass_through``, scatter the NaN rows where not differentiated.

    Returns:
        ``y`` with its rows of non-finite ``lse`` set to NaN.
    """
    if not pass_through:
        return _nan_rows_where(y, lse)
    if scatter:
        return _nan_rows_in_place(y, lse)
    return _nan_rows_identity(y, lse)


def _nan_rows_where(y: jax.Array, lse: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(lse)[..., None], y, jnp.nan)


@jax.custom_jvp
def _nan_rows_identity(y: jax.Array, lse: jax.Array) -> jax.Array:
    return _nan_rows_where(y, lse)


@_nan_rows_identity.defjvp
def _nan_rows_identity_jvp(primals, tangents):
    y, lse = primals
    return _nan_rows_identity(y, lse), tangents[0]


@jax.custom_vjp
def _nan_rows_in_place(y: jax.Array, lse: jax.Array) -> jax.Array:
    """NaN scattered into the rows of non-finite ``lse``: the update of row ``r`` goes to
    ``r``, or past the end (dropped) where ``lse`` is finite; all indices distinct."""
    dv = y.shape[-1]
    rows = math.prod(y.shape[:-1])
    flat = y.reshape((rows, dv))
    finite = jnp.broadcast_to(jnp.isfinite(lse), y.shape[:-1]).reshape(rows)
    at = jnp.arange(rows, dtype=jnp.int32)
    at = jnp.where(finite, at + rows, at)[:, None]
    dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                           scatter_dims_to_operand_dims=(0,))
    out = jax.lax.scatter(flat, at, jnp.full(flat.shape, jnp.nan, flat.dtype), dims,
                          unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
    return out.reshape(y.shape)


def _nan_rows_in_place_fwd(y, lse):
    return _nan_rows_where(y, lse), None


def _nan_rows_in_place_bwd(_, ct):
    return ct, None


_nan_rows_in_place.defvjp(_nan_rows_in_place_fwd, _nan_rows_in_place_bwd)


def backward_delta(out: jax.Array, d_out: jax.Array, lse: jax.Array, d_lse: jax.Array,
                   dtype) -> jax.Array:
    r"""The backward's per-row term $\delta_i = \sum_c \mathrm{d}y_{ic}\, y_{ic} -
    \mathrm{d}L_i$, in ``dtype``, for outputs ``out`` ``(..., rows, dv)`` with cotangent
    ``d_out`` and log-normalisers ``lse`` ``(..., rows)`` with cotangent ``d_lse``. A row
    without a finite $L$ contributes nothing from its output (which may be NaN)."""
    kept = jnp.where(jnp.isfinite(lse)[..., None], out.astype(dtype), 0.0)
    return jnp.sum(d_out.astype(dtype) * kept, -1) - d_lse.astype(dtype)


def backward_probs(s: jax.Array, m: jax.Array, log_l: jax.Array) -> jax.Array:
    r"""A block's probabilities $p_{ij} = e^{(\ell_{ij} - m_i) - \log l_i}$ from its logits
    ``s`` (``-inf`` on forbidden edges) and the rows' saved `RowStats` ``m`` and ``log_l``,
    broadcast against ``s`` (so that a transposed block passes ``m[..., None, :]``). The
    difference $\ell_{ij} - m_i$ comes first: it is exact where the logits are huge, where
    $e^{\ell_{ij} - L_i}$ would lose $\log l_i$ to rounding. A row with no edge
    ($\log l = -\infty$; padding rows too) gets $p = 0$ whatever its logits: not $e^{s}$,
    which a large bias overflows to ``inf`` (and a zero cotangent to ``inf * 0 = NaN``), nor
    NaN from a non-finite key or bias that only a padding row reads."""
    none = log_l == -jnp.inf
    return jnp.where(none, 0.0, jnp.exp((s - jnp.where(none, 0.0, m))
                                        - jnp.where(none, 0.0, log_l)))


def scale_row_sums(p: jax.Array, ds: jax.Array, qk: jax.Array, axis: int = -1
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""A block's share of a traced dot scale's gradient: per row, $r_i = \sum_j
    \mathrm{d}s_{ij}\, q_i^\top k_j$, $e_i = \sum_j \mathrm{d}s_{ij}$ and $c_i = \sum_j
    p_{ij}\, q_i^\top k_j$, summed along ``axis`` (the block's parents) of ``p``, ``ds`` and
    the unscaled products ``qk``. Added up over a row's blocks, `scale_grad` reads the
    gradient off them."""
    return (jnp.sum(ds * qk, axis), jnp.sum(ds, axis), jnp.sum(p * qk, axis))


def scale_grad(r: jax.Array, e: jax.Array, c: jax.Array, d_lse: jax.Array,
               lse: jax.Array) -> jax.Array:
    r"""The gradient of a traced scale $s$ of the dot term, $\partial/\partial s = \sum_{ij}
    \mathrm{d}s_{ij}\, q_i^\top k_j$, from every row's `scale_row_sums` (``r``, ``e``,
    ``c``, ``(..., rows)``) and its log-normaliser ``lse`` with cotangent ``d_lse``.

    $\sum_i r_i$ alone would be wrong by $\sum_i (\delta_i - \tilde\delta_i)\, c_i$: the
    kernels' $\delta_i$ (`backward_delta`) is read off the output rounded to its dtype
    (bfloat16), not the exact $\tilde\delta_i = \sum_j p_{ij}\,\mathrm{d}p_{ij} -
    \mathrm{d}L_i$, and although its error moves each $\mathrm{d}s_{ij}$ by little, it is
    multiplied here by $c_i$, the row's mean product, which is large and of one sign where
    rows are peaked (uncorrected, the sum came out 1.6x too large for bfloat16 inputs at
    head dim 128). Since
    $\sum_j \mathrm{d}s_{ij} = \mathrm{d}L_i + \tilde\delta_i - \delta_i$, the
    correction is $(\mathrm{d}L_i - e_i)\, c_i$. Rows without a finite $L$ add nothing
    (their sums are 0; their ``d_lse`` is not read)."""
    d_lse = jnp.where(jnp.isfinite(lse), d_lse.astype(c.dtype), 0.0)
    return jnp.sum(r + (d_lse - e) * c)


@partial(jax.custom_jvp, nondiff_argnums=(0, 3))
def weighted_values(spec: str, p: jax.Array, v: jax.Array, precision=None) -> jax.Array:
    r"""``einsum(spec, p, v)`` of probabilities ``p`` (in the accumulation dtype) and values
    ``v``: multiplied in ``v``'s dtype, accumulated in ``p``'s (the p·v product of the
    kernels that are differentiated by JAX: the dense and windowed ones).

    Its derivative in ``p``, $\mathrm{d}p = \mathrm{d}y\, V^\top$, is computed in ``p``'s
    dtype: JAX's own derivative of ``p.astype(v.dtype)`` rounds it to ``v``'s (bfloat16),
    and $\mathrm{d}s = p(\mathrm{d}p - \sum_j p\,\mathrm{d}p)$ then cancels much of it:
    a traced dot scale's gradient, which sums it against the logits, was 2 % off
    (the blocked and Pallas kernels compute $\mathrm{d}p$ in float32, as flash kernels
    do). The derivative in ``v`` is as before."""
    return jnp.einsum(spec, p.astype(v.dtype), v, preferred_element_type=p.dtype,
                      precision=precision)


@weighted_values.defjvp
def _weighted_values_jvp(spec, precision, primals, tangents):
    p, v = primals
    dp, dv = tangents
    mm = dict(preferred_element_type=p.dtype, precision=precision)
    # linear in (dp, dv): transposed, dp's cotangent is dy V^T in p's dtype
    t = jnp.einsum(spec, dp, v.astype(p.dtype), **mm) + jnp.einsum(
        spec, p.astype(v.dtype), dv, **mm)
    return weighted_values(spec, p, v, precision), t
