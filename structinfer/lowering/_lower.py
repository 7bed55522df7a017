r"""Recognise a structural prior and a score and turn them into block terms.

:func:`lower_edge` maps ``(prior, score, V)`` to a :class:`~._spec.Terms` /
:class:`~._spec.Problem` pair, or raises :class:`NotLowered` naming the part it
does not recognise. The rules (each a rewrite of the log-potential up to a
per-child constant, which the softmax ignores):

* ``Dot(q, k, s)``, ``Bilinear`` — :math:`s\,q_i^\top k_j`;
  ``Cosine`` — a dot product of normalised features.
* ``NegSqDist(x, mu, Λ)`` with identity / scalar / diagonal / full shared
  precision — :math:`x_i^\top \bar\Lambda \mu_j - \tfrac12 \mu_j^\top\Lambda\mu_j + \log w_j`
  (:math:`\bar\Lambda = (\Lambda+\Lambda^\top)/2`); per-parent diagonal precision
  — features :math:`[x_i, x_i^2]\cdot[\Lambda_j\mu_j, -\tfrac12\Lambda_j]` plus
  :math:`\tfrac12\log|\Lambda_j|` when normalised. ``LinearGaussian`` is the same
  with :math:`\mu_j = A z_j + b`.
* ``NegLogDist`` (IDW) — :math:`-\log(\epsilon + \|q_i-k_j\|^p)` per block.
* ``Custom`` — its table, sliced per block (nothing saved, but exact).
* ``Sum`` — the sum of its lowered terms (dot-like terms share one matmul).
* Priors: ``Uniform`` (nothing), ``Restricted`` causal / window (a distance band,
  checked against the mask when the mask is known at trace time) or any other
  mask (sliced per block; empty blocks skipped when known at trace time),
  ``Categorical`` (per-edge or per-parent logits), ``RelativePosition`` (bias
  looked up from the distance grid), ``Geometric`` (:math:`\log q_i + (d-d_0)\log(1-q_i)`
  on the band :math:`d_0 \le d \le d_{\max}`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import priors as P
from .. import scores as S
from ._spec import Problem, RelPos, Terms, band_mask_np

__all__ = ["NotLowered", "lower_edge", "Lowered"]


class NotLowered(Exception):
    """A part of the model that no kernel implements (``part`` says which)."""

    def __init__(self, part: str, reason: str):
        self.part = part
        self.reason = reason
        super().__init__(f"{part}: {reason}")


class Lowered:
    """A lowered edge site: static ``terms``, arrays ``problem``, and an optional
    concrete ``mask`` (NumPy) for block skipping."""

    def __init__(self, terms: Terms, problem: Problem, batch_shape, mask=None):
        self.terms = terms
        self.problem = problem
        self.batch_shape = tuple(batch_shape)
        self.mask = mask

    def __repr__(self) -> str:
        return f"Lowered({', '.join(self.terms.notes)}; batch={self.batch_shape})"


class _Acc:
    """Accumulates terms while walking a score / prior."""

    def __init__(self, n: int, m: int):
        self.n, self.m = n, m
        self.dot_q: list[jax.Array] = []
        self.dot_k: list[jax.Array] = []
        self.idw: list[tuple[jax.Array, jax.Array, jax.Array, jax.Array]] = []
        self.col_bias: list[jax.Array] = []
        self.pair: list[jax.Array] = []
        self.kw: dict[str, Any] = {}
        self.row: dict[str, jax.Array] = {}
        self.glob: dict[str, jax.Array] = {}
        self.const: dict[str, jax.Array] = {}
        self.mask: np.ndarray | None = None
        self.notes: list[str] = []


def _is_tracer_free(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _scale(x, scale):
    return x if scale is None else x * scale


def _add_negsqdist(acc: _Acc, x, mu, prec, kind: str, log_w, normalize: bool, what: str):
    d = x.shape[-1]
    if kind == "identity":
        acc.dot_q.append(x)
        acc.dot_k.append(mu)
        bias = -0.5 * jnp.sum(mu * mu, -1)
    elif kind == "scalar":
        acc.dot_q.append(x)
        acc.dot_k.append(prec * mu)
        bias = -0.5 * prec * jnp.sum(mu * mu, -1)
    elif kind == "diag" and prec.ndim == 1:
        acc.dot_q.append(x)
        acc.dot_k.append(prec * mu)
        bias = -0.5 * jnp.sum(prec * mu * mu, -1)
    elif kind == "diag":  # (parents, d)
        acc.dot_q.append(jnp.concatenate([x, x * x], -1))
        acc.dot_k.append(
            jnp.concatenate(
                [jnp.broadcast_to(prec * mu, jnp.broadcast_shapes(prec.shape, mu.shape)),
                 jnp.broadcast_to(-0.5 * prec, jnp.broadcast_shapes(prec.shape, mu.shape))],
                -1,
            )
        )
        bias = -0.5 * jnp.sum(prec * mu * mu, -1)
        if normalize:
            bias = bias + 0.5 * jnp.sum(jnp.log(prec), -1)
    elif kind == "full" and prec.ndim == 2:
        sym = 0.5 * (prec + prec.T)
        acc.dot_q.append(x)
        acc.dot_k.append(jnp.einsum("...jd,de->...je", mu, sym))
        bias = -0.5 * jnp.einsum("...jd,de,...je->...j", mu, prec, mu)
    else:
        raise NotLowered(
            f"score {what}",
            "per-parent full precision matrices (parents, d, d) are not lowered "
            "(the quadratic term x_i^T Λ_j x_i does not factor into a matmul)",
        )
    if log_w is not None:
        bias = bias + log_w
    acc.col_bias.append(bias)
    del d


def _walk_score(acc: _Acc, score: S.Score | None) -> None:
    if score is None:
        return
    what = type(score).__name__
    if isinstance(score, S.Sum):
        for s in score.scores:
            _walk_score(acc, s)
        acc.notes.append(f"score Sum of {len(score.scores)} terms")
        return
    if isinstance(score, S.Dot):  # includes Bilinear
        acc.dot_q.append(_scale(score.q, score.scale))
        acc.dot_k.append(score.k)
        acc.notes.append(f"score {what} (matmul)")
        return
    if isinstance(score, S.Cosine):
        qn = score.q / jnp.sqrt(jnp.sum(score.q**2, -1, keepdims=True) + score.eps)
        kn = score.k / jnp.sqrt(jnp.sum(score.k**2, -1, keepdims=True) + score.eps)
        acc.dot_q.append(score.scale * qn)
        acc.dot_k.append(kn)
        acc.notes.append("score Cosine (matmul of normalised features)")
        return
    if isinstance(score, S.NegSqDist):
        _add_negsqdist(
            acc, score.q, score.k, score.precision, score._prec_kind, score.log_weights,
            score.normalize, what,
        )
        acc.notes.append(f"score NegSqDist ({score._prec_kind} precision, matmul + bias)")
        return
    if isinstance(score, S.LinearGaussian):
        prec = score.precision
        d = score.x.shape[-1]
        if prec is None:
            kind = "identity"
        elif prec.ndim == 0:
            kind = "scalar"
        elif prec.shape == (d,):
            kind = "diag"
        else:
            raise NotLowered("score LinearGaussian", f"precision of shape {prec.shape}")
        _add_negsqdist(acc, score.x, score.predictions(), prec, kind, None, False, what)
        acc.notes.append("score LinearGaussian (matmul against predictions A z + b)")
        return
    if isinstance(score, S.NegLogDist):
        acc.idw.append((score.q, score.k, jnp.asarray(score.p), jnp.asarray(score.eps)))
        acc.notes.append("score NegLogDist (IDW, per block)")
        return
    if isinstance(score, S.Custom):
        acc.pair.append(score.dense())
        acc.notes.append("score Custom (table sliced per block)")
        return
    raise NotLowered(
        f"score {what}",
        f"score kind '{score.kind}' has no lowering (lowered: Dot, Bilinear, Cosine, "
        "NegSqDist, LinearGaussian, NegLogDist, Custom, Sum)",
    )


def _band(acc: _Acc, dmin=None, dmax=None, exclude_zero=False, offset=0):
    kw = acc.kw
    kw["offset"] = int(offset)
    if dmin is not None:
        kw["dmin"] = int(dmin) if kw.get("dmin") is None else max(kw["dmin"], int(dmin))
    if dmax is not None:
        kw["dmax"] = int(dmax) if kw.get("dmax") is None else min(kw["dmax"], int(dmax))
    if exclude_zero:
        kw["exclude_zero"] = True


def _restricted_band(prior: P.Restricted) -> dict | None:
    pat = prior.pattern
    t = pat.get("type")
    if t == "causal":
        lo = 0 if pat.get("include_self", True) else 1
        return {"dmin": lo, "offset": pat.get("offset", 0)}
    if t == "window":
        size, off = int(pat["size"]), pat.get("offset", 0)
        inc = pat.get("include_self", True)
        if pat.get("causal", True):
            lo = 0 if inc else 1
            return {"dmin": lo, "dmax": lo + size - 1, "offset": off}
        return {"dmin": -(size - 1), "dmax": size - 1, "exclude_zero": not inc, "offset": off}
    return None


def _mask_const(acc: _Acc, mask: jax.Array, concrete) -> None:
    if mask.shape[-2] == 1:
        acc.const["col_ok"] = mask[..., 0, :]
        acc.kw["col_ok"] = True
    else:
        acc.const["pair_ok"] = mask
        acc.kw["pair_ok"] = True
    acc.mask = None if concrete is None else np.asarray(concrete, bool)


def _walk_prior(acc: _Acc, prior: P.StructuralPrior) -> None:
    n, m = acc.n, acc.m
    if isinstance(prior, P.Uniform):
        acc.notes.append("prior Uniform")
        return
    if isinstance(prior, P.Restricted):
        band = _restricted_band(prior)
        t = prior.pattern.get("type")
        if band is not None:
            conc = getattr(prior, "concrete_mask", None)
            if conc is not None:
                probe = Terms(n, m, **band)
                want = band_mask_np(probe, n, m)
                if np.array_equal(np.broadcast_to(conc, np.broadcast_shapes(conc.shape, want.shape)),
                                  np.broadcast_to(want, np.broadcast_shapes(conc.shape, want.shape))):
                    _band(acc, **band)
                    acc.notes.append(f"prior Restricted.{t} (distance band {band}; blocks skipped)")
                    return
                acc.notes.append(f"prior Restricted: pattern '{t}' does not match its mask; "
                                 "using the mask")
            else:
                acc.notes.append(f"prior Restricted.{t}: mask not known at trace time; "
                                 "using the mask without block skipping")
        _mask_const(acc, prior.mask, getattr(prior, "concrete_mask", None))
        if acc.mask is not None:
            acc.notes.append(f"prior Restricted ({t} mask; empty blocks skipped)")
        elif band is None:
            acc.notes.append(f"prior Restricted ({t} mask, traced: no block skipping)")
        return
    if isinstance(prior, P.Categorical):
        lg = prior.logits
        if lg.ndim == 1 or lg.shape[-2] == 1:
            row = lg if lg.ndim == 1 else lg[..., 0, :]
            ok = jnp.isfinite(row)
            acc.col_bias.append(jnp.where(ok, row, 0.0))
            acc.const["col_ok"] = ok
            acc.kw["col_ok"] = True
            acc.notes.append("prior Categorical (one row shared by every child: per-parent bias)")
        else:
            ok = jnp.isfinite(lg)
            acc.pair.append(jnp.where(ok, lg, 0.0))
            acc.const["pair_ok"] = ok
            acc.kw["pair_ok"] = True
            acc.notes.append("prior Categorical (logits sliced per block)")
        return
    if isinstance(prior, P.RelativePosition):
        check = getattr(prior, "check_bias_length", None)
        if check is not None:  # the exact engine's check: a bias too short is an error there
            try:
                check(n)
            except ValueError as err:
                raise NotLowered("prior", str(err)) from None
        acc.glob["relpos"] = prior.bias
        acc.kw["relpos"] = RelPos(
            prior.mode, prior.num_parents, prior.max_distance, prior.period,
            int(prior.bias.shape[-1]),
        )
        _band(acc, dmin=0 if prior.causal else None, offset=prior.offset)
        acc.notes.append(f"prior RelativePosition ({prior.mode}; bias from the distance grid)")
        return
    if isinstance(prior, P.Geometric):
        q = prior.q
        qc = q[..., None] if q.ndim else jnp.reshape(q, (1, 1))
        geo = jnp.concatenate([jnp.log(qc), jnp.log1p(-qc)], -1)  # (..., n|1, 2)
        acc.row["geo"] = jnp.broadcast_to(geo, geo.shape[:-2] + (n, 2))
        acc.kw["geometric"] = True
        acc.kw["geo_d0"] = prior.min_distance
        if prior.max_distance is not None and not isinstance(prior.max_distance, int):
            raise NotLowered("prior", "Geometric max_distance is traced (the kernels need "
                             "a static band); pass a Python int to lower it")
        _band(acc, dmin=prior.min_distance, dmax=prior.max_distance, offset=prior.offset)
        acc.notes.append(
            "prior Geometric (log-prior from the distance grid"
            + (f", truncated at distance {prior.max_distance})" if prior.max_distance is not None
               else ")")
        )
        return
    raise NotLowered(
        f"prior {type(prior).__name__}",
        f"prior kind '{getattr(prior, 'kind', '?')}' has no lowering",
    )


def _batch(x: jax.Array, core: int) -> tuple[int, ...]:
    return tuple(x.shape[: x.ndim - core])


def _bcast_cat(xs: list[jax.Array]) -> jax.Array:
    """Concatenate along the feature axis after broadcasting the other axes."""
    if len(xs) == 1:
        return xs[0]
    shape = jnp.broadcast_shapes(*(x.shape[:-1] for x in xs))
    return jnp.concatenate([jnp.broadcast_to(x, shape + x.shape[-1:]) for x in xs], -1)


def lower_edge(
    prior: P.StructuralPrior,
    score: S.Score | None,
    value_table: jax.Array,
    num_children: int,
    plate_batch: tuple[int, ...] = (),
) -> Lowered:
    r"""Lower one edge site: ``y_i = E[V_{\phi_i}]`` under ``prior`` and ``score``.

    Args:
        prior: the structural prior (``EdgeInfo.prior``).
        score: the score (``EdgeInfo.score``) or ``None``.
        value_table: ``(..., m, dv)`` values of the parents.
        num_children: ``n``.
        plate_batch: batch shape of the plates around the edge, without the
            children plate (heads, batch).

    Raises:
        NotLowered: naming the part (``"prior ..."``/``"score ..."``) with no lowering.
    """
    n, m = int(num_children), int(prior.num_parents)
    acc = _Acc(n, m)
    _walk_prior(acc, prior)
    _walk_score(acc, score)
    arrays = []
    row, col, pair = dict(acc.row), {}, {}
    kw = dict(acc.kw)
    if acc.dot_q:
        row["q"] = _bcast_cat(acc.dot_q)
        col["k"] = _bcast_cat(acc.dot_k)
        kw["dot"] = True
    for r, (x, y, p, eps) in enumerate(acc.idw):
        row[f"idw{r}"], col[f"idw{r}"] = x, y
        acc.glob[f"idw{r}_p"], acc.glob[f"idw{r}_eps"] = p, eps
    kw["idw"] = len(acc.idw)
    if acc.col_bias:
        b = acc.col_bias[0]
        for x in acc.col_bias[1:]:
            b = b + x
        col["bias"] = b[..., None]
        kw["col_bias"] = True
    if acc.pair:
        t = acc.pair[0]
        for x in acc.pair[1:]:
            t = t + x
        pair["logits"] = t
        kw["pair_logits"] = True
    v = jnp.asarray(value_table)
    # common floating dtype
    floats = [x for d in (row, col, pair, acc.glob) for x in d.values()] + [v]
    dtype = jnp.result_type(*[x.dtype for x in floats if jnp.issubdtype(x.dtype, jnp.floating)]
                            or [jnp.result_type(float)])
    cast = lambda d: {k: x.astype(dtype) for k, x in d.items()}  # noqa: E731
    row, col, pair, glob = cast(row), cast(col), cast(pair), cast(acc.glob)
    v = v.astype(dtype)
    # shape checks and the batch shape
    for k, x in row.items():
        if x.shape[-2] != n:
            raise NotLowered(f"row array '{k}'", f"has {x.shape[-2]} children, expected {n}")
        arrays.append(_batch(x, 2))
    for k, x in col.items():
        if x.shape[-2] != m:
            raise NotLowered(f"column array '{k}'", f"has {x.shape[-2]} parents, expected {m}")
        arrays.append(_batch(x, 2))
    for k, x in pair.items():
        if x.shape[-1] != m or x.shape[-2] not in (1, n):
            raise NotLowered(f"pair array '{k}'", f"shape {x.shape}, expected (..., {n}, {m})")
        pair[k] = jnp.broadcast_to(x, x.shape[:-2] + (n, m))
        arrays.append(_batch(x, 2))
    const = dict(acc.const)
    for k, x in const.items():
        if k == "pair_ok":
            const[k] = jnp.broadcast_to(x, x.shape[:-2] + (n, m))
        arrays.append(_batch(x, 2 if k == "pair_ok" else 1))
    for x in glob.values():
        arrays.append(_batch(x, 1))
    if v.ndim < 2 or v.shape[-2] != m:
        raise NotLowered("value", f"value table has shape {v.shape}, expected (..., {m}, dv)")
    arrays.append(_batch(v, 2))
    try:
        batch = jnp.broadcast_shapes(tuple(plate_batch), *arrays)
    except ValueError:
        raise NotLowered("batch dims", f"arrays' batch shapes {arrays} do not broadcast "
                         f"against the plates {tuple(plate_batch)}") from None
    if len(batch) > len(plate_batch):
        raise NotLowered(
            "batch dims",
            f"some array has more batch dims ({batch}) than the plates around the edge "
            f"({tuple(plate_batch)}): it depends on another edge or on an extra dim",
        )
    terms = Terms(n, m, notes=tuple(acc.notes), **kw)
    return Lowered(terms, Problem(row, col, pair, glob, const, v), batch, acc.mask)
