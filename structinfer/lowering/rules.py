r"""The built-in lowering rules: one small function per prior, score and pattern type.

Each rule rewrites the log-potential up to a per-child constant (which the softmax
ignores) into `TermBuilder` terms:

* ``Dot(q, k, s)``, ``Bilinear`` — $s\,q_i^\top k_j$; ``Cosine`` — a dot product of
  normalised features.
* ``NegSqDist(x, mu, Λ)`` with identity / scalar / diagonal / full shared precision —
  $x_i^\top \bar\Lambda \mu_j - \tfrac12 \mu_j^\top\Lambda\mu_j + \log w_j$
  ($\bar\Lambda = (\Lambda+\Lambda^\top)/2$); per-parent diagonal precision — features
  $[x_i, x_i^2]\cdot[\Lambda_j\mu_j, -\tfrac12\Lambda_j]$ plus $\tfrac12\log|\Lambda_j|$
  when normalised. ``LinearGaussian`` is the same with $\mu_j = A z_j + b$.
* ``NegLogDist`` (IDW) — $-\log(\epsilon + \|q_i-k_j\|^p)$ per block.
* ``Custom`` — its table, sliced per block (nothing saved, but exact).
* ``Sum`` — the sum of its terms' rules (dot-like terms share one matmul).
* Priors: ``Uniform`` (nothing); ``Restricted`` — its mask (sliced per block; empty
  blocks skipped when the mask is known at trace time), or the distance band its
  pattern's rule names (``Causal``, ``Window``) when that band is checked equal to the
  mask; ``Categorical`` (per-edge or per-parent logits); ``RelativePosition`` (bias
  looked up from the distance grid); ``Geometric``
  ($\log q_i + (d-d_0)\log(1-q_i)$ on the band $d_0 \le d \le d_{\max}$); ``Masked`` —
  its base prior's rule and its mask (per parent, or per edge).

Not lowered (no rule): ``InvDist``, ``GaussianKernel`` (their potentials are not
log-linear in a matmul), per-parent full precision (raised by the ``NegSqDist`` rule).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .. import priors as P
from .. import scores as S
from .._checks import float32_at_least
from ._lower import (
    PATTERN_RULES,
    DistanceBand,
    NotLowered,
    TermBuilder,
    register_pattern_rule,
    register_prior_rule,
    register_score_rule,
)
from ._masks import BlockMask
from ._spec import accum_dtype

__all__: list[str] = []  # everything here is registered, nothing is called by name;
# the module is public so that its rules can be read as examples of registering one


# --- scores -----------------------------------------------------------------------------


@register_score_rule(S.Sum)
def _sum(score: S.Sum, terms: TermBuilder) -> None:
    for s in score.scores:
        terms.add_score(s)
    terms.note(f"score Sum of {len(score.scores)} terms")


def _scaled_dot(terms: TermBuilder, q, k, scale, what: str, dtype=None) -> None:
    r"""$s_{ij}\, q_i^\top k_j$ for a scale broadcasting against the score table
    $(\dots, n, m)$: a scalar, or one per child (it scales $q_i$) or per parent (it
    scales $k_j$), per batch element too; a scale varying with both is not a matmul.

    ``dtype``: the features' nominal dtype when they come wider (``add_dot``'s)."""
    if scale is None or np.ndim(scale) == 0:
        terms.add_dot(q, k, scale, dtype=dtype)
        return
    scale = jnp.asarray(scale)
    if scale.ndim == 1:
        scale = scale[None, :]
    per_child, per_parent = scale.shape[-2] != 1, scale.shape[-1] != 1
    if per_child and per_parent:
        raise NotLowered(f"score {what}", f"a scale of shape {scale.shape} varies with both "
                         "the child and the parent (not a matmul)")
    if dtype is not None:  # the scale promotes the features as it would nominal ones
        dtype = jnp.result_type(dtype, scale)
    if per_parent:
        terms.add_dot(q, k * jnp.swapaxes(scale, -1, -2), dtype=dtype)
    else:
        terms.add_dot(q * scale, k, dtype=dtype)


@register_score_rule(S.Dot)  # and Bilinear, which is a Dot of its projections
def _dot(score: S.Dot, terms: TermBuilder) -> None:
    _scaled_dot(terms, score.q, score.k, score.scale, type(score).__name__)
    terms.note(f"score {type(score).__name__} (matmul)")


@register_score_rule(S.Cosine)
def _cosine(score: S.Cosine, terms: TermBuilder) -> None:
    # normalised in float32 at least and handed over unrounded, nominally in q's and
    # k's common dtype: the kernels cast them once, to the operands' dtype (with float32
    # values, bfloat16 q and k are not rounded back to bfloat16 once normalised)
    dtype = jnp.result_type(score.q, score.k)

    def unit(x):  # the norm in float32 at least: ||x||^2 overflows float16 above 256
        w = float32_at_least(x)
        return w / jnp.sqrt(jnp.sum(w * w, -1, keepdims=True) + score.eps)

    _scaled_dot(terms, unit(score.q), unit(score.k), score.scale, "Cosine", dtype)
    terms.note("score Cosine (matmul of normalised features)")


def _gaussian(terms: TermBuilder, x, mu, prec, form: str, log_w, normalize: bool, what: str,
              mu_dtype=None):
    r"""$-\tfrac12 (x_i-\mu_j)^\top\Lambda_j(x_i-\mu_j) + \log w_j$ as a matmul plus a
    per-parent bias (dropping the per-child $-\tfrac12 x_i^\top\Lambda x_i$).

    The features are first centred on $c = \operatorname{mean}_j \mu_j$ (per batch
    element): $x_i - \mu_j$ is unchanged, so the score is too (gradients through $c$
    cancel), but the expansion $x_i^\top\mu_j - \tfrac12\|\mu_j\|^2$ no longer cancels
    catastrophically when the features share a large offset. The centring, the
    precision-weighted means and the bias are computed in float32 at least (float64 for
    float64 inputs); the matmul features are handed over in that width, nominally in
    the features' common dtype, and the kernels cast them once to the operands' dtype
    (a bfloat16 ``x`` beside float32 means, or bfloat16 features beside float32 values,
    are not rounded to bfloat16 once centred).
    What the expansion still loses is relative to the features' spread about $c$:
    about $\epsilon\,\|x_i - c\|\,\|\mu_j - c\|$ per score ($\epsilon$ the operands'
    precision), which a direct $\|x_i - \mu_j\|^2$ would not.

    ``mu_dtype``: the means' nominal dtype when ``mu`` comes wider (``LinearGaussian``'s
    predictions, computed in float32 at least); default ``mu.dtype``.
    """
    mu_dtype = mu.dtype if mu_dtype is None else jnp.dtype(mu_dtype)
    k_dtype = mu_dtype if prec is None else jnp.result_type(mu_dtype, prec)
    dtype = jnp.result_type(x.dtype, k_dtype)  # the features' nominal common dtype
    wide = accum_dtype(jnp.result_type(x.dtype, mu_dtype))
    x, mu = x.astype(wide), mu.astype(wide)
    centre = jnp.mean(mu, -2, keepdims=True)
    x, mu = x - centre, mu - centre
    if prec is not None:
        prec = prec.astype(wide)

    def dot(a, b):
        terms.add_dot(a, b, dtype=dtype)

    if form == "identity":
        dot(x, mu)
        bias = -0.5 * jnp.sum(mu * mu, -1)
    elif form == "scalar":
        dot(x, prec * mu)
        bias = -0.5 * prec * jnp.sum(mu * mu, -1)
    elif form == "diag" and prec.ndim == 1:
        dot(x, prec * mu)
        bias = -0.5 * jnp.sum(prec * mu * mu, -1)
    elif form == "diag":  # (parents, d)
        shape = jnp.broadcast_shapes(prec.shape, mu.shape)
        terms.add_dot(
            jnp.concatenate([x, x * x], -1),
            jnp.concatenate([jnp.broadcast_to(prec * mu, shape),
                             jnp.broadcast_to(-0.5 * prec, shape)], -1),
            dtype=dtype,
        )
        bias = -0.5 * jnp.sum(prec * mu * mu, -1)
        if normalize:
            bias = bias + 0.5 * jnp.sum(jnp.log(prec), -1)
    elif form == "full" and prec.ndim == 2:
        sym = 0.5 * (prec + prec.T)
        dot(x, jnp.einsum("...jd,de->...je", mu, sym))
        bias = -0.5 * jnp.einsum("...jd,de,...je->...j", mu, prec, mu)
    else:
        raise NotLowered(
            f"score {what}",
            "per-parent full precision matrices (parents, d, d) are not lowered "
            "(the quadratic term x_i^T Λ_j x_i does not factor into a matmul)",
        )
    if log_w is not None:
        bias = bias + log_w
    terms.add_column_bias(bias)


@register_score_rule(S.NegSqDist)
def _neg_sq_dist(score: S.NegSqDist, terms: TermBuilder) -> None:
    form = score.precision_form
    _gaussian(terms, score.q, score.k, score.precision, form, score.log_weights,
              score.normalize, type(score).__name__)
    terms.note(f"score NegSqDist ({form} precision, matmul + bias)")


@register_score_rule(S.LinearGaussian)
def _linear_gaussian(score: S.LinearGaussian, terms: TermBuilder) -> None:
    prec = score.precision
    d = score.x.shape[-1]
    if prec is None:
        form = "identity"
    elif prec.ndim == 0:
        form = "scalar"
    elif prec.shape == (d,):
        form = "diag"
    else:
        raise NotLowered("score LinearGaussian", f"precision of shape {prec.shape}")
    # the predictions A z + b in float32 at least, handed over unrounded and nominally in
    # their inputs' dtype (as the exact engine computes them): in 16 bits they were
    # rounded to the ulp of |A z + b| before the features were centred, and in float16
    # A z overflows above 65504
    nominal = jnp.result_type(*(a for a in (score.A, score.z, score.b) if a is not None))
    wide = accum_dtype(jnp.result_type(score.x.dtype, nominal))
    pred = score.predictions(lambda a: a.astype(wide))
    _gaussian(terms, score.x, pred, prec, form, None, False, type(score).__name__,
              mu_dtype=nominal)
    terms.note("score LinearGaussian (matmul against predictions A z + b)")


@register_score_rule(S.NegLogDist)
def _neg_log_dist(score: S.NegLogDist, terms: TermBuilder) -> None:
    for name in ("p", "eps"):  # one per batch element at most: the kernels slice no table
        shape = (1, 1) + np.shape(getattr(score, name))
        if shape[-2:] != (1, 1):
            raise NotLowered("score NegLogDist", f"its {name} of shape {shape[2:]} varies "
                             "with the child or the parent (not lowered)")
    terms.add_inverse_distance(score.q, score.k, score.p, score.eps)
    terms.note("score NegLogDist (IDW, per block)")


@register_score_rule(S.Custom)
def _custom(score: S.Custom, terms: TermBuilder) -> None:
    terms.add_pair_logits(score.dense())
    terms.note("score Custom (table sliced per block)")


# --- restriction patterns ------------------------------------------------------------


@register_pattern_rule(P.RestrictionPattern)  # Mask, Graph, BlockSparse and user patterns
def _mask_only(pattern: P.RestrictionPattern) -> None:
    return None


@register_pattern_rule(P.Causal)
def _causal(pattern: P.Causal) -> DistanceBand:
    return DistanceBand(dmin=0 if pattern.include_self else 1, offset=pattern.offset)


@register_pattern_rule(P.Window)
def _window(pattern: P.Window) -> DistanceBand:
    size, inc = pattern.size, pattern.include_self
    if pattern.causal:
        lo = 0 if inc else 1
        return DistanceBand(dmin=lo, dmax=lo + size - 1, offset=pattern.offset)
    return DistanceBand(dmin=-(size - 1), dmax=size - 1, exclude_zero=not inc,
                        offset=pattern.offset)


# --- priors --------------------------------------------------------------------------


@register_prior_rule(P.Uniform)
def _uniform(prior: P.Uniform, terms: TermBuilder) -> None:
    terms.note("prior Uniform")


def _pattern_name(pattern: P.RestrictionPattern) -> str:
    return getattr(pattern, "label", None) or pattern.kind


@register_prior_rule(P.Restricted)
def _restricted(prior: P.Restricted, terms: TermBuilder) -> None:
    n, m = terms.num_children, terms.num_parents
    t = _pattern_name(prior.pattern)
    if prior.blocks is not None:
        _block_sparse(prior, terms, t)
        return
    rule = PATTERN_RULES.lookup(prior.pattern)
    band = rule(prior.pattern)
    if band is not None and not isinstance(band, DistanceBand):
        raise TypeError(f"pattern rule {getattr(rule, '__qualname__', rule)!r} for "
                        f"{type(prior.pattern).__name__} returned {band!r}; a pattern rule "
                        "returns a structinfer.lowering.DistanceBand or None")
    conc = getattr(prior, "concrete_mask", None)
    if band is not None:
        if conc is not None:
            want = band.mask(n, m)
            shape = np.broadcast_shapes(conc.shape, want.shape)
            if np.array_equal(np.broadcast_to(conc, shape), np.broadcast_to(want, shape)):
                terms.restrict_band(band.dmin, band.dmax, exclude_zero=band.exclude_zero,
                                    offset=band.offset)
                terms.note(f"prior Restricted.{t} (distance band {_band_text(band)}; "
                           "blocks skipped)")
                return
            terms.note(f"prior Restricted: pattern '{t}' does not match its mask; using the mask")
        else:
            terms.note(f"prior Restricted.{t}: mask not known at trace time; using the mask "
                       "without block skipping")
    terms.restrict_pairs(prior.mask, conc)
    if conc is not None:
        terms.note(f"prior Restricted ({t} mask; empty blocks skipped)")
    elif band is None:
        terms.note(f"prior Restricted ({t} mask, traced: no block skipping)")


def _block_sparse(prior: P.Restricted, terms: TermBuilder, name: str) -> None:
    """A block-sparse prior: its mask expanded from the block mask inside the trace (the
    kernels that read it per tile), and the block mask itself as the concrete mask."""
    bc, bp = prior.pattern.block_size
    rows = prior.size[0]
    if rows != terms.num_children:
        raise NotLowered("prior", f"Restricted.block_sparse: its block mask covers {rows} "
                         f"children, the children plate has {terms.num_children}")
    conc = prior.concrete_blocks
    terms.restrict_pairs(prior.mask,
                         None if conc is None else BlockMask(conc, (bc, bp), prior.size))
    if conc is not None:
        terms.note(f"prior Restricted ({name} mask, blocks of {bc} x {bp}; empty blocks "
                   "skipped)")
    else:
        terms.note(f"prior Restricted ({name} mask, traced: no block skipping)")


def _band_text(band: DistanceBand) -> str:
    """``"0 <= d <= 2, d = i + 6 - j"`` for explain's notes."""
    lo = "" if band.dmin is None else f"{band.dmin} <= "
    hi = "" if band.dmax is None else f" <= {band.dmax}"
    ne = ", d != 0" if band.exclude_zero else ""
    return f"{lo}d{hi}{ne}, d = i + {band.offset} - j"


@register_prior_rule(P.Categorical)
def _categorical(prior: P.Categorical, terms: TermBuilder) -> None:
    lg = prior.logits
    if lg.ndim == 1 or lg.shape[-2] == 1:
        row = lg if lg.ndim == 1 else lg[..., 0, :]
        ok = jnp.isfinite(row)
        terms.add_column_bias(jnp.where(ok, row, 0.0))
        terms.restrict_columns(ok)
        terms.note("prior Categorical (one row shared by every child: per-parent bias)")
    else:
        ok = jnp.isfinite(lg)
        terms.add_pair_logits(jnp.where(ok, lg, 0.0))
        terms.restrict_pairs(ok)
        terms.note("prior Categorical (logits sliced per block)")


@register_prior_rule(P.RelativePosition)
def _relative_position(prior: P.RelativePosition, terms: TermBuilder) -> None:
    try:  # the exact engine's check: a bias too short is an error there
        prior.check_bias_length(terms.num_children)
    except ValueError as err:
        raise NotLowered("prior", str(err)) from None
    terms.add_relative_position(prior.bias, mode=prior.mode, max_distance=prior.max_distance,
                                period=prior.period, offset=prior.offset)
    terms.restrict_band(dmin=0 if prior.causal else None, offset=prior.offset)
    terms.note(f"prior RelativePosition ({prior.mode}; bias from the distance grid)")


@register_prior_rule(P.Masked)
def _masked(prior: P.Masked, terms: TermBuilder) -> None:
    terms.add_prior(prior.prior)
    terms.restrict_pairs(prior.mask, prior.concrete_mask)
    rows = "one per parent" if prior.mask.shape[-2] == 1 else "per edge"
    terms.note(f"prior Masked ({rows}{'' if prior.concrete_mask is not None else ', traced'})")


@register_prior_rule(P.Geometric)
def _geometric(prior: P.Geometric, terms: TermBuilder) -> None:
    if prior.max_distance is not None and not isinstance(prior.max_distance, int):
        raise NotLowered("prior", "Geometric max_distance is traced (the kernels need "
                         "a static band); pass a Python int to lower it")
    terms.add_geometric(prior.q, prior.min_distance, offset=prior.offset)
    terms.restrict_band(dmin=prior.min_distance, dmax=prior.max_distance, offset=prior.offset)
    terms.note(
        "prior Geometric (log-prior from the distance grid"
        + (f", truncated at distance {prior.max_distance})" if prior.max_distance is not None
           else ")")
    )
