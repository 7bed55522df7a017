r"""Windowed kernel: attention restricted to a band of distances, stored as ``(n, W)``.

Child $i$ may only take parents at distance
$d = i + \text{offset} - j \in \{d_0, \dots, d_0 + W - 1\}$. The band is
stored with $t = d - d_0$ as its last axis, so for the geometric (recency)
prior of expanding attention (Singh & Buckley sec. 5.2, Table 1 row 12)

$$
\ell_{it} = \psi_{i,\, i+\text{offset}-d_0-t} + \log q_i + t \log(1 - q_i),
\qquad p(\phi_i = t \mid x) = \mathrm{softmax}_t(\ell_{it}),
\qquad y_i = \sum_t p(\phi_i = t\mid x)\, V_{i+\text{offset}-d_0-t}.
$$

The window $W$ is the truncation horizon: cost $O(n (W + b) d)$ time
and $O(n W)$ memory for the scores (computed per block of ``b`` children as a
dense ``b x (b + W - 1)`` slab, then read off its diagonals). The scores do not
depend on $q$, so the mean-field loop of expanding attention computes them
once (`windowed_scores`) and each iteration only re-normalises
(`windowed_posterior`, $O(nW)$); the values are read once at the end
(`windowed_values`).

Truncation: if the untruncated posterior puts mass $\tau_i$ beyond the
window, the truncated output differs by
$\|y_i - y_i^{W}\| = \tau_i\, \|\bar V_{\text{tail}} - \bar V_{\text{window}}\|
\le \tau_i \max_{j,j'}\|V_j - V_{j'}\|$, and
$\tau_i \le \rho_i e^{\Delta_i} / (\rho_i e^{\Delta_i} + 1 - \rho_i)$ with
$\rho_i = (1-q)^{W}$ the prior mass left out and $\Delta_i$ the spread of
the scores ($\tau_i = \rho_i$ for equal scores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from .._checks import check_static_int, float32_at_least, is_concrete, require
from ._softmax import weighted_values
from ._spec import (
    Cols,
    Consts,
    Globals,
    Pairs,
    Problem,
    Rows,
    Terms,
    accum_dtype,
    block_logits,
    geometric_log_prior,
    logit_scale,
    logit_scale_array,
)

__all__ = [
    "band_logits",
    "windowed_kernel",
    "windowed_scores",
    "geometric_band_log_prior",
    "windowed_posterior",
    "windowed_values",
    "windowed_attention",
]



def _band_int(value, name: str, who: str, minimum: int | None = None) -> int:
    """A size of the band (it sets a shape) as a Python int: refuse a traced one, a bool, a
    float and one below ``minimum``, naming the argument."""
    check_static_int(value, name, who)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{who}: {name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{who}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _batch_of(a: tuple[int, ...], b: tuple[int, ...], na: str, nb: str, who: str
              ) -> tuple[int, ...]:
    """The broadcast of two arguments' batch dims, or an error naming both."""
    try:
        return tuple(np.broadcast_shapes(tuple(a), tuple(b)))
    except ValueError:
        raise ValueError(f"{who}: the batch dims of {na} {tuple(a)} and {nb} {tuple(b)} do not "
                         "broadcast") from None


def _pad2(x: jax.Array, axis: int, left: int, right: int, value=0) -> jax.Array:
    if left == 0 and right == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis % x.ndim] = (left, right)
    return jnp.pad(x, widths, constant_values=value)


def _skew_index(bq: int, W: int) -> jax.Array:
    """``idx[r, t] = r + W - 1 - t``: band position t of row r inside its slab."""
    return jnp.arange(bq)[:, None] + (W - 1) - jnp.arange(W)[None, :]


def _window(terms: Terms) -> int:
    if terms.dmin is None or terms.dmax is None:
        raise ValueError(
            "windowed kernel: the edge has no finite distance band (needs a Geometric "
            "prior with max_distance, a Restricted.window prior, or a window argument)"
        )
    return terms.dmax - terms.dmin + 1


def band_logits(
    terms: Terms, prob: Problem, batch_shape: tuple[int, ...], block_q: int = 128,
    precision=None,
) -> tuple[jax.Array, jax.Array]:
    r"""Logits on the band: ``(..., n, W)`` with ``-inf`` off the allowed edges.

    ``out[..., i, t]`` is $\ell_{ij}$ for $j = i + \text{offset} - d_{\min} - t$, in the
    accumulation dtype (float32, or float64 for float64 operands).
    """
    W = _window(terms)
    n, m = terms.num_children, terms.num_parents
    bq = max(1, min(int(block_q), n))
    nqb = -(-n // bq)
    n_pad = nqb * bq
    width = bq + W - 1
    left = max(0, terms.dmax - terms.offset)
    right = max(0, n_pad + terms.offset - terms.dmin - m)
    dtype = accum_dtype(prob.v.dtype)
    row = jax.tree.map(lambda x: _pad2(x, -2, 0, n_pad - n), prob.row)
    col = jax.tree.map(lambda x: _pad2(x, -2, left, right), prob.col)
    pair = jax.tree.map(lambda x: _pad2(_pad2(x, -2, 0, n_pad - n), -1, left, right), prob.pair)
    const = prob.const.map(
        lambda x: _pad2(_pad2(x, -2, 0, n_pad - n, False), -1, left, right, False),
        lambda x: _pad2(x, -1, left, right, False))
    skew = _skew_index(bq, W)

    def q_block(a):
        i0 = a * bq
        j_start = i0 + terms.offset - terms.dmax  # global index of slab column 0
        p0 = j_start + left  # position in the padded arrays
        sl = lambda x, st, size, ax: lax.dynamic_slice_in_dim(x, st, size, axis=ax % x.ndim)  # noqa: E731
        row_b = jax.tree.map(lambda x: sl(x, i0, bq, -2), row)
        col_b = jax.tree.map(lambda x: sl(x, p0, width, -2), col)
        pair_b = jax.tree.map(lambda x: sl(sl(x, i0, bq, -2), p0, width, -1), pair)
        const_b = const.map(lambda x: sl(sl(x, i0, bq, -2), p0, width, -1),
                            lambda x: sl(x, p0, width, -1))
        i_idx = i0 + jnp.arange(bq)
        j_idx = j_start + jnp.arange(width)
        s, ok = block_logits(terms, row_b, col_b, pair_b, prob.glob, const_b, i_idx, j_idx,
                             dtype, (j_idx >= 0) & (j_idx < m), precision=precision)
        s = jnp.broadcast_to(s, batch_shape + (bq, width))
        ok = jnp.broadcast_to(ok, batch_shape + (bq, width))
        idx = jnp.broadcast_to(skew, batch_shape + (bq, W))
        sb = jnp.take_along_axis(s, idx, axis=-1)
        okb = jnp.take_along_axis(ok, idx, axis=-1)
        return jnp.where(okb, sb, -jnp.inf), okb

    s, ok = lax.map(q_block, jnp.arange(nqb))
    s = jnp.moveaxis(s, 0, -3).reshape(batch_shape + (n_pad, W))[..., :n, :]
    ok = jnp.moveaxis(ok, 0, -3).reshape(batch_shape + (n_pad, W))[..., :n, :]
    return s, ok


def _band_values(probs: jax.Array, v: jax.Array, offset: int, dmin: int, block_q: int,
                 precision=None):
    """``y_i = sum_t probs[i, t] v[i + offset - dmin - t]`` blockwise (zero outside [0, m)),
    multiplied in ``v``'s dtype, accumulated in float32 (float64), returned in ``v``'s."""
    n, W = probs.shape[-2], probs.shape[-1]
    m = v.shape[-2]
    dmax = dmin + W - 1
    bq = max(1, min(int(block_q), n))
    nqb = -(-n // bq)
    n_pad = nqb * bq
    width = bq + W - 1
    left = max(0, dmax - offset)
    right = max(0, n_pad + offset - dmin - m)
    vp = _pad2(v, -2, left, right)
    pp = _pad2(probs, -2, 0, n_pad - n)
    skew = _skew_index(bq, W)
    batch = jnp.broadcast_shapes(pp.shape[:-2], vp.shape[:-2])

    def q_block(a):
        i0 = a * bq
        p0 = i0 + offset - dmax + left
        vs = lax.dynamic_slice_in_dim(vp, p0, width, axis=vp.ndim - 2)  # (..., width, dv)
        pb = lax.dynamic_slice_in_dim(pp, i0, bq, axis=pp.ndim - 2)  # (..., bq, W)
        vband = jnp.take(vs, skew, axis=-2)  # (..., bq, W, dv)
        # the p.v product accumulates in the accumulation dtype, and so does its
        # derivative in pb
        return weighted_values("...rt,...rtd->...rd", pb.astype(accum_dtype(v.dtype)), vband,
                               precision).astype(v.dtype)

    y = lax.map(q_block, jnp.arange(nqb))
    y = jnp.moveaxis(y, 0, -3)
    y = y.reshape(batch + (n_pad, y.shape[-1]))
    return y[..., :n, :]


def windowed_kernel(
    terms: Terms, prob: Problem, batch_shape: tuple[int, ...], block_q: int = 128,
    precision: lax.PrecisionLike = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Posterior expectation on the distance band of ``terms`` (exact for that band).

    Args:
        terms, prob: a lowered edge site (`structinfer.lowering._spec`) with a finite
            distance band.
        batch_shape: the broadcast batch shape (heads, batch) of the result.
        block_q: children per block.
        precision: the matmuls' ``precision`` (``None``: JAX's default, which follows
            ``jax.default_matmul_precision``).

    Returns:
        ``(y, L)``: ``batch + (n, dv)`` in the value table's dtype and the row
        log-partition ``batch + (n,)`` in the accumulation dtype (the logits, the
        softmax and the p·v product accumulate in float32, or float64).
    """
    s, _ = band_logits(terms, prob, batch_shape, block_q, precision)
    lse = jax.nn.logsumexp(s, axis=-1)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    probs = jnp.exp(s - safe[..., None])
    y = _band_values(probs, prob.v, terms.offset, terms.dmin, block_q, precision)
    return y, lse


def windowed_scores(
    q: jax.Array,
    k: jax.Array,
    window: int,
    *,
    offset: int = 0,
    min_distance: int = 0,
    scale: ArrayLike | None = None,
    block_size: int = 128,
) -> jax.Array:
    r"""Dot-product scores on the band, computed once and reused by the mean-field loop.

    $$
    S_{it} = s\, q_i^\top k_{i + \text{offset} - d_0 - t}, \qquad t = 0, \dots, W-1,
    $$

    the score of child $i$ for the parent at distance $d = d_0 + t$. The scores do not
    depend on the geometric prior's $q$, so expanding attention's mean-field loop computes
    them once and only re-normalises
    ([`windowed_posterior`][structinfer.lowering.windowed_posterior]) per iteration.

    Args:
        q: child features ``(..., n, d)``.
        k: parent features ``(..., m, d)``; batch dims broadcast against ``q``'s.
        window: $W$, the number of distances kept (the truncation horizon), at least 1.
        offset: child $i$ sits at parent position $i + \text{offset}$.
        min_distance: $d_0$, the nearest distance kept (0 with the self-edge, 1
            without).
        scale: optional scalar multiplier $s$ (``None``: 1); with 16-bit features a
            0-d scale that keeps their dtype, known at trace time or traced,
            multiplies the float32 $q_i^\top k_j$, not the queries rounded to 16 bits.
        block_size: children per block $b$.

    Returns:
        ``(..., n, W)`` scores; ``-inf`` where the parent index is outside ``[0, m)``.
            Accumulated in float32 for bfloat16 / float16 features (float64 for
            float64). Cost $O(n (W + b) d)$ time, $O(n W)$ memory.

    Raises:
        ValueError: ``q`` and ``k`` are not ``(..., n, d)`` and ``(..., m, d)`` with the
            same ``d`` and batch dims that broadcast, or ``window``, ``offset``,
            ``min_distance`` or ``block_size`` is not an int (``window`` and
            ``block_size`` at least 1).
        TypeError: one of those ints is traced (each sets a shape).

    Reference:
        Singh & Buckley, "Attention as implicit structural inference", sec. 5.2
        (expanding attention).
    """
    q = jnp.asarray(q)
    k = jnp.asarray(k)
    if q.ndim < 2 or k.ndim < 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"windowed_scores: q {q.shape} and k {k.shape} must be (..., n, d) "
                         "and (..., m, d) with the same d")
    who = "windowed_scores"
    window = _band_int(window, "window", who, 1)
    offset = _band_int(offset, "offset", who)
    min_distance = _band_int(min_distance, "min_distance", who)
    block_size = _band_int(block_size, "block_size", who, 1)
    n, m = q.shape[-2], k.shape[-2]
    # 16-bit features: a static or traced scale multiplies the float32 q.k, as the
    # kernels' does
    dot_scale = logit_scale(scale, jnp.result_type(q.dtype, k.dtype))
    traced_scale = logit_scale_array(scale, jnp.result_type(q.dtype, k.dtype))
    unscaled = scale is None or dot_scale is not None or traced_scale is not None
    qq = q if unscaled else q * scale
    dtype = jnp.result_type(qq.dtype, k.dtype)
    terms = Terms(n, m, dot=True, offset=int(offset), dmin=int(min_distance),
                  dmax=int(min_distance) + int(window) - 1, dot_scale=dot_scale)
    prob = Problem(Rows(q=qq.astype(dtype)), Cols(k=k.astype(dtype)), Pairs(),
                   Globals(dot_scale=traced_scale), Consts(), jnp.zeros((m, 1), dtype))
    batch = _batch_of(q.shape[:-2], k.shape[:-2], "q", "k", who)
    s, _ = band_logits(terms, prob, batch, block_size)
    return s


def geometric_band_log_prior(
    q: ArrayLike, window: int, horizon: ArrayLike | None = None
) -> jax.Array:
    r"""Unnormalised geometric log-prior on the band, $\log q + t\log(1-q)$.

    $$
    \log p_{it} = \log q_i + t \log(1 - q_i) \quad (t < H_i), \qquad
    \log p_{it} = -\infty \quad (t \ge H_i),
    $$

    the geometric (recency) prior of expanding attention on the band distances
    $d = d_0 + t$, $t = 0, \dots, W-1$, unnormalised over the band (the softmax of
    [`windowed_posterior`][structinfer.lowering.windowed_posterior] normalises it).

    Args:
        q: success probability in $(0, 1)$, any shape broadcasting against ``(..., n)``
            (scalar, per child, per head ``(..., 1)``); an integer array is cast to the
            default float dtype.
        window: $W$, the number of band distances.
        horizon: optional (traced) truncation $H$: distances $t \ge H$ get ``-inf``
            (the mean-field loop's $H(q_t)$), scalar or broadcasting like ``q``
            (``None``: no truncation inside the band).

    Returns:
        ``(..., n or 1, W)`` log-prior, in ``q``'s floating dtype (float32 for a 16-bit
            ``q``, computed from its exact value).

    Raises:
        ValueError: a concrete ``q`` outside $(0, 1)$ (a traced one gives NaN), or
            ``window`` is not an int >= 1.
        TypeError: ``window`` is traced (it sets a shape).

    Reference:
        Singh & Buckley, "Attention as implicit structural inference", sec. 5.2 and
        Table 1 (geometric prior of expanding attention).
    """
    q = jnp.asarray(q)
    if not jnp.issubdtype(q.dtype, jnp.floating):
        q = q.astype(jnp.result_type(float))
    q = require(lambda xp, q: (q > 0) & (q < 1),
                "geometric_band_log_prior: q must lie in (0, 1), got {}", q)
    # in float32 at least, as priors.Geometric: a 16-bit q's log-prior is its exact value's,
    # and band distances past 256 are not integers in bfloat16
    q = float32_at_least(q)
    qc = q[..., None] if q.ndim else q.reshape(1, 1)
    t = jnp.arange(_band_int(window, "window", "geometric_band_log_prior", 1), dtype=q.dtype)
    lp = geometric_log_prior(jnp.log(qc), jnp.log1p(-qc), t)
    if horizon is not None:
        h = jnp.asarray(horizon)
        hc = h[..., None] if h.ndim else h
        lp = jnp.where(t < hc, lp, -jnp.inf)
    return lp


def windowed_posterior(scores: jax.Array, log_prior: jax.Array) -> jax.Array:
    r"""Posterior over the band, $\mathrm{softmax}_t(S_{it} + \log p_{it})$.

    $$
    p(\phi_i = t \mid x) = \frac{\exp(S_{it} + \log p_{it})}
        {\sum_{t'} \exp(S_{it'} + \log p_{it'})}
    $$

    Args:
        scores: ``(..., n, W)`` band scores $S$
            ([`windowed_scores`][structinfer.lowering.windowed_scores]).
        log_prior: band log-prior $\log p$ broadcasting against ``scores``
            ([`geometric_band_log_prior`][structinfer.lowering.geometric_band_log_prior]).

    Returns:
        ``(..., n, W)`` posterior; rows with no allowed distance (all ``-inf``) are all
            zero. Cost $O(nW)$.
    """
    logits = scores + log_prior
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    return jnp.exp(logits - safe)


def windowed_values(
    probs: jax.Array, v: jax.Array, *, offset: int = 0, min_distance: int = 0,
    block_size: int = 128,
) -> jax.Array:
    r"""Read the values off the band: $y_i = \sum_t p_{it} V_{i+\text{offset}-d_0-t}$.

    A parent index outside ``[0, m)`` contributes nothing.

    Args:
        probs: ``(..., n, W)`` band posterior $p$
            ([`windowed_posterior`][structinfer.lowering.windowed_posterior]).
        v: ``(..., m, dv)`` parent values $V$.
        offset: child $i$ sits at parent position $i + \text{offset}$.
        min_distance: $d_0$, the distance of band position $t = 0$.
        block_size: children per block.

    Returns:
        ``(..., n, dv)``. Cost $O(n W d_v)$.

    Raises:
        ValueError: ``probs`` or ``v`` has fewer than two dims, their batch dims do not
            broadcast, or ``offset``,
            ``min_distance`` or ``block_size`` is not an int (``block_size`` at least 1).
        TypeError: one of them is traced (each sets a shape).
    """
    who = "windowed_values"
    offset = _band_int(offset, "offset", who)
    min_distance = _band_int(min_distance, "min_distance", who)
    block_size = _band_int(block_size, "block_size", who, 1)
    probs = jnp.asarray(probs)
    v = jnp.asarray(v)
    if probs.ndim < 2 or v.ndim < 2:
        raise ValueError(f"{who}: v must be (..., m, dv) and probs (..., n, W), got v "
                         f"{tuple(v.shape)} and probs {tuple(probs.shape)}")
    _batch_of(probs.shape[:-2], v.shape[:-2], "probs", "v", who)
    dtype = jnp.result_type(probs.dtype, v.dtype)
    return _band_values(probs.astype(dtype), v.astype(dtype), int(offset), int(min_distance),
                        block_size)


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (without growing it)."""
    try:
        return np.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except ValueError:
        return False


def _check_values_fit(k_shape: tuple[int, ...], s_shape: tuple[int, ...],
                      v_shape: tuple[int, ...]) -> None:
    """``v`` is ``(..., m, dv)`` with ``k``'s ``m`` parents and batch dims that broadcast
    against the scores' (a shorter ``v`` would give its missing parents a zero value)."""
    who = "windowed_attention"
    if len(v_shape) < 2 or v_shape[-2] != k_shape[-2]:
        raise ValueError(f"{who}: v of shape {tuple(v_shape)} must be (..., m, dv) with the "
                         f"{k_shape[-2]} parents of k (shape {tuple(k_shape)})")
    try:
        np.broadcast_shapes(tuple(v_shape[:-2]), tuple(s_shape[:-2]))
    except ValueError:
        raise ValueError(f"{who}: v of shape {tuple(v_shape)}: its batch dims "
                         f"{tuple(v_shape[:-2])} do not broadcast against those of q and k "
                         f"{tuple(s_shape[:-2])}") from None


def windowed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    geometric_q: ArrayLike,
    window: int,
    *,
    offset: int = 0,
    min_distance: int = 0,
    scale: ArrayLike | None = None,
    horizon: ArrayLike | None = None,
    block_size: int = 128,
) -> jax.Array:
    r"""Expanding-attention output with a geometric prior truncated to ``window`` distances.

    $$
    y_i = \sum_{t=0}^{W-1} \mathrm{softmax}_t\big(S_{it} + \log q_i + t\log(1-q_i)\big)\,
        V_{i+\text{offset}-d_0-t},
    $$

    [`windowed_scores`][structinfer.lowering.windowed_scores],
    [`geometric_band_log_prior`][structinfer.lowering.geometric_band_log_prior],
    [`windowed_posterior`][structinfer.lowering.windowed_posterior] and
    [`windowed_values`][structinfer.lowering.windowed_values] in one. Equal to the exact
    engine on a ``Geometric(q, m, max_distance=d0 + W - 1)`` prior (and ``horizon`` cuts
    further). Against the untruncated prior, a child whose posterior puts mass $\tau_i$
    beyond the window moves by at most $\tau_i \max_{j,j'}\|V_j - V_{j'}\|$, with
    $\tau_i \le \rho_i e^{\Delta_i} / (\rho_i e^{\Delta_i} + 1 - \rho_i)$,
    $\rho_i = (1-q_i)^W$ the prior mass left out and $\Delta_i$ the spread of the scores.

    Args:
        q: child features ``(..., n, d)``.
        k: parent features ``(..., m, d)``.
        v: parent values ``(..., m, dv)``.
        geometric_q: the geometric prior's success probability in $(0, 1)$: scalar, per
            child ``(..., n)`` or per head ``(..., 1)``.
        window: $W$, the number of distances kept.
        offset: child $i$ sits at parent position $i + \text{offset}$.
        min_distance: $d_0$, the nearest distance kept (0 with the self-edge, 1
            without).
        scale: optional scalar multiplier of the scores (``None``: 1).
        horizon: optional (traced) truncation $H$ inside the band: distances
            $t \ge H$ are forbidden.
        block_size: children per block.

    Returns:
        ``(..., n, dv)``, in ``v``'s floating dtype (the scores and the posterior are
            computed in float32 for bfloat16 / float16 inputs); NaN in the row of a child
            with no parent in the band, when traced.

    Raises:
        ValueError: as [`windowed_scores`][structinfer.lowering.windowed_scores], ``v``
            not ``(..., m, dv)`` with ``k``'s parents and batch dims broadcasting against
            ``q``'s and ``k``'s, a ``geometric_q`` or ``horizon`` that does not broadcast
            against the children ``(..., n)``, a
            concrete ``geometric_q`` outside $(0, 1)$ (a traced one gives NaN), or, on
            concrete inputs, a child with no parent in the band (none within the parents
            at distances ``min_distance .. min_distance + window - 1``, or the horizon).
        TypeError: as [`windowed_scores`][structinfer.lowering.windowed_scores].

    Reference:
        Singh & Buckley, "Attention as implicit structural inference", sec. 5.2 and
        Table 1 row 12 (expanding attention).
    """
    s = windowed_scores(q, k, window, offset=offset, min_distance=min_distance, scale=scale,
                        block_size=block_size)
    v = jnp.asarray(v)
    _check_values_fit(jnp.shape(k), s.shape, v.shape)
    who = "windowed_attention"
    for name, x, lead in (("geometric_q", geometric_q, s.shape[:-1]),
                          ("horizon", horizon, s.shape[:-1])):
        if x is not None and not _broadcasts(jnp.shape(x), lead):
            raise ValueError(f"{who}: {name} of shape {tuple(jnp.shape(x))} does not broadcast "
                             f"against the children (..., n) = {lead} (a scalar, per child "
                             "(..., n) or per head (..., 1))")
    lp = geometric_band_log_prior(geometric_q, window, horizon)
    y = windowed_values(windowed_posterior(s, lp), v, offset=offset,
                        min_distance=min_distance, block_size=block_size)
    # a child with no parent in the band has no posterior (the exact engine refuses it):
    # an error on concrete inputs, else NaN, never the posterior's row of zeros
    empty = jnp.all(jnp.isneginf(s + lp), axis=-1)
    if is_concrete(empty) and bool(jnp.any(empty)):
        idx = tuple(int(i) for i in np.argwhere(np.asarray(empty))[0])
        where = f"child {idx[-1]}" + (f" (batch index {idx[:-1]})" if idx[:-1] else "")
        raise ValueError(
            f"windowed_attention: {where} has no parent in the band (distances "
            f"{min_distance}..{min_distance + window - 1} from position {idx[-1]} + offset "
            f"{offset}, within the {jnp.shape(k)[-2]} parents and "
            "the horizon): it has no posterior; drop that child or widen the band"
        )
    y = jnp.where(empty[..., None], jnp.nan, y)
    return y.astype(v.dtype) if jnp.issubdtype(v.dtype, jnp.floating) else y
