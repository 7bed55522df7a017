r"""Structured scores (edge potentials) $\psi(x_i, x_j)$.

A score is the log-potential added for the edge $\phi_i = j$:

$$
\log p(x, \phi) = \sum_i \big[\log p(\phi_i) + \psi(x_i, x_{\phi_i})\big] + \dots
$$

Scores are *lazy*: they keep their factors (queries, keys, weights) so the
lowered engine can compute them blockwise, and [`Score.dense`][structinfer.scores.Score.dense] materialises
the ``(..., children, parents)`` table the exact engine gathers from. The
similarity inside the softmax is a modelling choice (McCarter, "Inverse distance
weighting attention"); every choice here is the log-potential of some model.

Layout convention: child features are ``(..., children, d)``, parent features
``(..., parents, d)``; leading batch dims broadcast.

A parameter out of its range (a precision that is not positive, a kernel width
$\sigma \le 0$) raises a ``ValueError`` naming it; traced (under ``jax.jit``), where it
cannot raise, it is NaN, and so is everything computed from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ._checks import (
    as_float_array,
    check_ndim,
    float32_at_least,
    is_concrete,
    positive_definite,
    require,
)

__all__ = [
    "Score",
    "Dot",
    "Bilinear",
    "NegSqDist",
    "NegLogDist",
    "InvDist",
    "GaussianKernel",
    "Cosine",
    "LinearGaussian",
    "Sum",
    "Custom",
    "as_score",
]


def _pairwise_diff(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x[..., i, None, :] - y[..., None, j, :]`` — exact differences (no cancellation)."""
    return x[..., :, None, :] - y[..., None, :, :]


def _sq_dist(x: jax.Array, y: jax.Array) -> jax.Array:
    diff = _pairwise_diff(x, y)
    return jnp.sum(diff * diff, axis=-1)


def safe_pow_dist(sq: jax.Array, p: ArrayLike) -> jax.Array:
    r"""A distance to the power ``p`` from its square, $\|x\|^p = (\|x\|^2)^{p/2}$.

    The gradients (in the distance and in ``p``) stay finite at zero distance. Computed as $s \cdot s^{p/2 - 1}$ for $s = \|x\|^2 > 0$ and 0 at $s = 0$, which is
    exactly ``sq`` at ``p = 2`` (``x ** 0 == 1``), so the concrete ``p == 2`` shortcut and the
    traced path give the same number. The zero-distance entries are selected out twice (the
    double-``where``), so neither $s^{p/2-1}$ nor $\log s$ is evaluated at zero. Used by
    [`NegLogDist`][structinfer.scores.NegLogDist] / [`InvDist`][structinfer.scores.InvDist]
    and by the lowered kernels' IDW term
    (McCarter, "Inverse distance weighting attention", eq. 3-4).

    Args:
        sq: squared distances $s \ge 0$, any shape.
        p: the exponent (> 0); may be traced.

    Returns:
        $s^{p/2}$, shaped like ``sq``.
    """
    if is_concrete(p) and np.ndim(p) == 0 and float(p) == 2.0:
        return sq
    # a 16-bit p's exponent in float32 (p / 2 - 1 rounds in 16 bits), as the table is
    p = jnp.asarray(p)
    if jnp.issubdtype(p.dtype, jnp.floating):
        p = float32_at_least(p)
    pos = sq > 0
    safe = jnp.where(pos, sq, 1.0)
    return jnp.where(pos, safe * safe ** (p / 2.0 - 1.0), 0.0)


def _check_p_eps(p, eps, score: str) -> tuple[Any, Any]:
    """``(p, eps)``, both required ``> 0`` (traced: NaN unless they are, see ``require``)."""
    return require(lambda xp, p, eps: (p > 0) & (eps > 0),
                   score + ": need p > 0 and eps > 0, got p={}, eps={}", p, eps)


def _check_features(x, name: str, score: str) -> jax.Array:
    x = as_float_array(x, f"{score}: {name}")
    check_ndim(x, 2, f"{score}: {name}", "(..., nodes, features)")
    return x


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` (no more dims, each 1 or equal)."""
    return len(shape) <= len(target) and all(
        a in (1, b) for a, b in zip(reversed(shape), reversed(target)))


def _check_same_dim(a: jax.Array, b: jax.Array, na: str, nb: str, score: str) -> None:
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"{score}: {na} has feature size {a.shape[-1]} but {nb} has {b.shape[-1]} "
            f"(shapes {tuple(a.shape)} and {tuple(b.shape)})"
        )


class Score:
    r"""Base class: a lazy ``(..., children, parents)`` table of log-potentials $\psi_{ij}$.

    Subclasses keep their factors and implement [`dense`][structinfer.scores.Score.dense];
    ``a + b`` is their [`Sum`][structinfer.scores.Sum].
    """

    kind: str = "score"

    def dense(self) -> jax.Array:  # pragma: no cover - abstract
        r"""Materialise the score table.

        Returns:
            $\psi_{ij}$, shape ``(..., children, parents)``.
        """
        raise NotImplementedError

    @property
    def num_children(self) -> int:  # pragma: no cover - abstract
        """The number of children ``n`` (the table's second-last axis)."""
        raise NotImplementedError

    @property
    def num_parents(self) -> int:  # pragma: no cover - abstract
        """The number of parents ``m`` (the table's last axis)."""
        raise NotImplementedError

    def __add__(self, other: Score) -> Sum:
        return Sum(self, other)

    def describe(self) -> dict[str, Any]:
        """Structured description of the score (read by the lowering and ``si.explain``)."""
        return {"kind": self.kind}


class _PairScore(Score):
    """Score built from child features ``q`` and parent features ``k``."""

    def __init__(self, q: ArrayLike, k: ArrayLike):
        name = type(self).__name__
        self.q = _check_features(q, "child features", name)
        self.k = _check_features(k, "parent features", name)
        _check_same_dim(self.q, self.k, "child features", "parent features", name)

    @property
    def num_children(self) -> int:
        return int(self.q.shape[-2])

    @property
    def num_parents(self) -> int:
        return int(self.k.shape[-2])

    def _features(self) -> tuple[jax.Array, jax.Array]:
        """``(q, k)`` for `dense`: 16-bit features in float32, so that the table is
        summed and kept in float32 (as the kernels accumulate), not rounded to 16 bits."""
        return float32_at_least(self.q), float32_at_least(self.k)


class Dot(_PairScore):
    r"""Scaled dot product $\psi_{ij} = s\, q_i^\top k_j$.

    The potential of cross and self attention (Singh & Buckley sec. 3.2). ``scale=None``
    means ``s = 1``; pass ``1/sqrt(d)`` for transformer attention.

    Args:
        q: child features ``(..., children, d)`` (e.g. ``x W_Q^T``).
        k: parent features ``(..., parents, d)`` (e.g. ``x W_K^T``).
        scale: optional multiplier $s$: a scalar, or an array broadcasting against the
            score table ``(..., children, parents)`` (per head, per child or per parent).
    """

    kind = "dot"

    def __init__(self, q: ArrayLike, k: ArrayLike, scale: ArrayLike | None = None):
        super().__init__(q, k)
        self.scale = scale

    def dense(self) -> jax.Array:
        q, k = self._features()
        s = jnp.einsum("...id,...jd->...ij", q, k)
        return s if self.scale is None else s * self.scale


class Bilinear(Dot):
    r"""Bilinear potential $\psi_{ij} = s\, x_i^\top W_Q^\top W_K x_j$ (Table 1).

    Args:
        xc: child node features ``(..., children, d_in)``.
        xp: parent node features ``(..., parents, d_in)``.
        wq: query weights $W_Q$, ``(d_k, d_in)``.
        wk: key weights $W_K$, ``(d_k, d_in)``.
        scale: optional multiplier $s$: a scalar, or an array broadcasting against the
            score table ``(..., children, parents)`` (per head, per child or per parent).

    Raises:
        ValueError: if the weights do not match the features' size ``d_in``.
    """

    kind = "bilinear"

    def __init__(
        self,
        xc: ArrayLike,
        xp: ArrayLike,
        wq: ArrayLike,
        wk: ArrayLike,
        scale: ArrayLike | None = None,
    ):
        xc = _check_features(xc, "child features", "Bilinear")
        xp = _check_features(xp, "parent features", "Bilinear")
        wq = as_float_array(wq, "Bilinear: wq")
        wk = as_float_array(wk, "Bilinear: wk")
        if wq.shape[-1] != xc.shape[-1] or wk.shape[-1] != xp.shape[-1]:
            raise ValueError(
                f"Bilinear: wq {tuple(wq.shape)} / wk {tuple(wk.shape)} must be "
                f"(d_k, d_in) matching child features {tuple(xc.shape)} and parent "
                f"features {tuple(xp.shape)}"
            )
        self.xc, self.xp, self.wq, self.wk = xc, xp, wq, wk
        super().__init__(
            jnp.einsum("...id,kd->...ik", xc, wq), jnp.einsum("...jd,kd->...jk", xp, wk), scale
        )


class NegSqDist(_PairScore):
    r"""Gaussian / Mahalanobis log-potential (a Gaussian mixture component).

    $$
    \psi_{ij} = \log w_j - \tfrac12 (x_i - \mu_j)^\top \Lambda_j (x_i - \mu_j)
    \;\big[ + \tfrac12 \log|\Lambda_j| - \tfrac d2 \log 2\pi \big]_{\text{normalize}}
    $$

    With ``normalize=True`` this is $\log w_j + \log\mathcal N(x_i; \mu_j,
    \Lambda_j^{-1})$, so the collapsed energy is the GMM negative log-likelihood
    (Tschantz, log-sum-exp energies: "sim = ln π_k − ½ Mahalanobis").
    McCarter's $-\|q - k\|^2$ is ``precision=2``.

    Lowered (`structinfer.attention`), the score is expanded as a matmul plus a
    per-parent bias, $x_i^\top\Lambda\mu_j - \tfrac12\mu_j^\top\Lambda\mu_j$, after
    centring $x$ and $\mu$ on $c = \operatorname{mean}_j \mu_j$ (in float32 at least): a
    common offset of the features costs no precision. Their spread about $c$ still does,
    about $\epsilon\,\|x_i - c\|\,\|\mu_j - c\|$ per score for operands of precision
    $\epsilon$, which the exact engine's direct $\|x_i - \mu_j\|^2$ does not.

    Args:
        x: child features ``(..., children, d)``.
        mu: parent means $\mu_j$, ``(..., parents, d)``.
        precision: $\Lambda_j$: ``None`` (identity), a scalar, a diagonal ``(d,)`` /
            ``(parents, d)``, or full ``(d, d)`` / ``(parents, d, d)`` precision matrices.
        log_weights: optional log mixing weights $\log w_j$, ``(..., parents)``.
        normalize: add the Gaussian normalising constant.
        precision_kind: ``"scalar"``, ``"diag"``, ``"parent_diag"``, ``"full"`` or
            ``"parent_full"``; needed only when the shape alone is ambiguous (e.g. a
            ``(parents, d)`` diagonal with ``parents == d``).

    Raises:
        ValueError: if a shape does not fit, the precision's shape is ambiguous without
            ``precision_kind``, or a concrete precision is not positive (definite).
    """

    kind = "neg_sq_dist"

    def __init__(
        self,
        x: ArrayLike,
        mu: ArrayLike,
        precision: ArrayLike | None = None,
        log_weights: ArrayLike | None = None,
        normalize: bool = False,
        precision_kind: str | None = None,
    ):
        super().__init__(x, mu)
        self.precision = (
            None if precision is None else as_float_array(precision, "NegSqDist: precision")
        )
        self.log_weights = (
            None if log_weights is None else as_float_array(log_weights, "NegSqDist: log_weights")
        )
        self.normalize = normalize
        d, m = self.q.shape[-1], self.num_parents
        P = self.precision
        if self.log_weights is not None and self.log_weights.shape[-1] != m:
            raise ValueError(
                f"NegSqDist: log_weights has {self.log_weights.shape[-1]} entries, expected "
                f"one per parent ({m})"
            )
        # what each precision kind looks like: (kind, expected shape)
        shapes = {
            "scalar": (),
            "diag": (d,),
            "parent_diag": (m, d),
            "full": (d, d),
            "parent_full": (m, d, d),
        }
        #: the precision's form once its shape is read: ``"identity"``, ``"scalar"``,
        #: ``"diag"`` (``(d,)`` or ``(parents, d)``) or ``"full"`` (``(d, d)`` or
        #: ``(parents, d, d)``)
        self.precision_form: str
        if P is None:
            self.precision_form = "identity"
        else:
            fits = [k for k, shp in shapes.items() if tuple(P.shape) == shp]
            if precision_kind is not None:
                if precision_kind not in shapes:
                    raise ValueError(
                        f"NegSqDist: precision_kind must be one of {sorted(shapes)}, got "
                        f"{precision_kind!r}"
                    )
                if precision_kind not in fits:
                    raise ValueError(
                        f"NegSqDist: precision_kind={precision_kind!r} needs shape "
                        f"{shapes[precision_kind]}, got {tuple(P.shape)}"
                    )
                fits = [precision_kind]
            if not fits:
                raise ValueError(
                    f"NegSqDist: precision shape {tuple(P.shape)} does not fit {m} parents "
                    f"with feature size {d}; expected (), (d,), (parents, d), (d, d) or "
                    "(parents, d, d)"
                )
            if len(fits) > 1:
                raise ValueError(
                    f"NegSqDist: precision of shape {tuple(P.shape)} is ambiguous with {m} "
                    f"parents and feature size {d} (it fits {fits}); pass precision_kind"
                )
            kind = fits[0]
            self.precision_form = {"parent_diag": "diag", "parent_full": "full"}.get(kind, kind)
            def positive(xp, P):  # the quadratic form reads the symmetric part
                if self.precision_form == "full":  # to rounding, through the symmetric part
                    return positive_definite(xp, P)
                return (P > 0) & (P < xp.inf)

            self.precision = require(positive, "NegSqDist: precision must be positive "
                                     f"(definite) and finite; got a non-positive or "
                                     f"non-finite {kind} precision", P)

    def dense(self) -> jax.Array:
        diff = _pairwise_diff(*self._features())  # (..., n, m, d)
        d = self.q.shape[-1]
        P = self.precision
        if P is not None:  # a 16-bit precision: its table, and linear algebra, in float32
            P = float32_at_least(P)
        kind = self.precision_form
        if kind == "identity":
            maha = jnp.sum(diff * diff, -1)
        elif kind in ("scalar", "diag"):  # (), (d,) or (parents, d): broadcasts
            maha = jnp.sum(diff * diff * P, -1)
        elif P.ndim == 2:
            maha = jnp.einsum("...ijd,de,...ije->...ij", diff, P, diff)
        else:
            maha = jnp.einsum("...ijd,jde,...ije->...ij", diff, P, diff)
        s = -0.5 * maha
        if self.normalize:
            if kind == "identity":
                logdet = 0.0
            elif kind == "scalar":
                logdet = d * jnp.log(P)
            elif kind == "diag":
                logdet = jnp.sum(jnp.log(P), -1)
            else:  # the quadratic form reads the symmetric part only: so does the normaliser
                logdet = jnp.linalg.slogdet(0.5 * (P + jnp.swapaxes(P, -1, -2)))[1]
            s = s + 0.5 * logdet - 0.5 * d * math.log(2 * math.pi)
        if self.log_weights is not None:
            s = s + self.log_weights[..., None, :]
        return s


class NegLogDist(_PairScore):
    r"""IDW score, the negative log distance (McCarter eq. 4).

    $$
    \psi_{ij} = -\log\big(\epsilon + \|q_i - k_j\|_2^p\big)
    $$

    so that $\mathrm{softmax}_j \psi_{ij} \propto (\epsilon + d_{ij}^p)^{-1}$
    — Shepard's inverse distance weighting.

    Args:
        q: child features ``(..., children, d)``.
        k: parent features ``(..., parents, d)``.
        p: distance exponent $p > 0$; may be traced (``jax.jit``, ``jax.grad``).
        eps: offset $\epsilon > 0$; may be traced.

    Raises:
        ValueError: if a concrete ``p`` or ``eps`` is not positive.
    """

    kind = "neg_log_dist"

    def __init__(self, q: ArrayLike, k: ArrayLike, p: float = 2.0, eps: float = 1e-3):
        super().__init__(q, k)
        self.p, self.eps = _check_p_eps(p, eps, "NegLogDist")

    def dense(self) -> jax.Array:
        return -jnp.log(self.eps + safe_pow_dist(_sq_dist(*self._features()), self.p))


class InvDist(_PairScore):
    r"""Inverse-distance score (McCarter eq. 3): $\psi_{ij} = 1/(\epsilon + \|q_i-k_j\|^p)$.

    Args:
        q: child features ``(..., children, d)``.
        k: parent features ``(..., parents, d)``.
        p: distance exponent $p > 0$; may be traced.
        eps: offset $\epsilon > 0$; may be traced.

    Raises:
        ValueError: if a concrete ``p`` or ``eps`` is not positive.
    """

    kind = "inv_dist"

    def __init__(self, q: ArrayLike, k: ArrayLike, p: float = 2.0, eps: float = 1e-3):
        super().__init__(q, k)
        self.p, self.eps = _check_p_eps(p, eps, "InvDist")

    def dense(self) -> jax.Array:
        return 1.0 / (self.eps + safe_pow_dist(_sq_dist(*self._features()), self.p))


class GaussianKernel(_PairScore):
    r"""Gaussian-kernel score (McCarter eq. 2): $\psi_{ij} = \exp(-\|q_i-k_j\|^2/\sigma^2)$.

    Args:
        q: child features ``(..., children, d)``.
        k: parent features ``(..., parents, d)``.
        sigma: the kernel width $\sigma$.
    """

    kind = "gaussian_kernel"

    def __init__(self, q: ArrayLike, k: ArrayLike, sigma: float = 1.0):
        super().__init__(q, k)
        self.sigma = require(lambda xp, s: s > 0, "GaussianKernel: sigma must be > 0, got {}",
                             sigma)

    def dense(self) -> jax.Array:
        # a 16-bit sigma squared in float32, as the features are (its square rounds, and a
        # float16 one below 0.0078 is subnormal)
        sigma = float32_at_least(jnp.asarray(self.sigma))
        return jnp.exp(-_sq_dist(*self._features()) / (sigma**2))


class Cosine(_PairScore):
    r"""Cosine similarity $\psi_{ij} = s\,\frac{q_i^\top k_j}{\|q_i\|\|k_j\|}$.

    One more choice of the similarity inside the softmax (McCarter sec. 2: the
    score is a modelling choice); a dot product of normalised features.

    Args:
        q: child features ``(..., children, d)``.
        k: parent features ``(..., parents, d)``.
        scale: the multiplier $s$: a scalar, or an array broadcasting against the score
            table ``(..., children, parents)``.
        eps: added to the squared norms before the square root.
    """

    kind = "cosine"

    def __init__(self, q: ArrayLike, k: ArrayLike, scale: float = 1.0, eps: float = 1e-8):
        super().__init__(q, k)
        self.scale = scale
        self.eps = require(lambda xp, e: e >= 0, "Cosine: eps must be >= 0, got {}", eps)

    def dense(self) -> jax.Array:
        q, k = self._features()
        qn = q / jnp.sqrt(jnp.sum(q**2, -1, keepdims=True) + self.eps)
        kn = k / jnp.sqrt(jnp.sum(k**2, -1, keepdims=True) + self.eps)
        return self.scale * jnp.einsum("...id,...jd->...ij", qn, kn)


class LinearGaussian(Score):
    r"""Linear-Gaussian potential between a child and a parent's prediction.

    $$
    \psi_{ik} = -\tfrac12 \big(x_i - A_k z_k - b_k\big)^\top \Lambda \big(x_i - A_k z_k - b_k\big)
    \;\big[+\tfrac12\log|\Lambda| - \tfrac d2 \log 2\pi\big]_{\text{normalize}}
    $$

    the edge potential of a linear mixture / switching linear dynamical system and
    of a linear predictive-coding layer (Tschantz; Singh & Buckley sec. 4.4).

    Args:
        x: child features ``(..., children, d_x)``.
        z: parent states $z_k$, ``(..., parents, d_z)``.
        A: $A_k$: ``(d_x, d_z)`` shared or ``(parents, d_x, d_z)`` per parent.
        b: optional offset $b_k$, ``(d_x,)`` or ``(parents, d_x)`` (after any batch dims).
        precision: $\Lambda$, diagonal: ``None`` (identity), a scalar, ``(d_x,)``, or
            with batch dims broadcasting against ``(..., children, parents, d_x)``
            (per parent $\Lambda_k$: ``(parents, d_x)``; per head: ``(heads, 1, 1, d_x)``;
            per child: ``(children, 1, d_x)`` — a 2-d ``(n, d_x)`` is always per parent).
        normalize: add the Gaussian normalising constant.

    Raises:
        ValueError: if ``A`` does not map ``d_z`` to ``d_x``, ``b`` or ``precision`` has
            another shape (naming it and the shapes expected), or a concrete
            ``precision`` has an entry that is not positive.
    """

    kind = "linear_gaussian"

    def __init__(
        self,
        x: ArrayLike,
        z: ArrayLike,
        A: ArrayLike,
        b: ArrayLike | None = None,
        precision: ArrayLike | None = None,
        normalize: bool = False,
    ):
        self.x = _check_features(x, "child features", "LinearGaussian")
        self.z = _check_features(z, "parent states", "LinearGaussian")
        self.A = as_float_array(A, "LinearGaussian: A")
        if (
            self.A.ndim < 2
            or self.A.shape[-2] != self.x.shape[-1]
            or self.A.shape[-1] != self.z.shape[-1]
        ):
            raise ValueError(
                f"LinearGaussian: A has shape {tuple(self.A.shape)}, expected (..., d_x, d_z) "
                f"= (..., {self.x.shape[-1]}, {self.z.shape[-1]})"
            )
        dx, m = self.x.shape[-1], self.z.shape[-2]
        self.b = None if b is None else as_float_array(b, "LinearGaussian: b")
        if self.b is not None and not _broadcasts_to(self.b.shape[-2:], (m, dx)):
            raise ValueError(f"LinearGaussian: b has shape {tuple(self.b.shape)}, expected (d_x,) "
                             f"= ({dx},) or (parents, d_x) = ({m}, {dx}), after any batch dims")
        self.precision = (
            None if precision is None else as_float_array(precision, "LinearGaussian: precision")
        )
        n = self.x.shape[-2]
        if self.precision is not None and not (
                _broadcasts_to(self.precision.shape[-3:], (n, m, dx))):
            raise ValueError(
                f"LinearGaussian: precision has shape {tuple(self.precision.shape)}, expected "
                f"a scalar, a diagonal (d_x,) = ({dx},), or one broadcasting against "
                f"(children, parents, d_x) = ({n}, {m}, {dx}) after any batch dims (per "
                "parent: (parents, d_x); per head: (heads, 1, 1, d_x))")
        if self.precision is not None:
            self.precision = require(
                lambda xp, p: p > 0, "LinearGaussian: precision must be > 0 (a scalar or a "
                f"diagonal (..., d_x) with d_x = {dx}), got {{}}", self.precision)
        self.normalize = normalize

    @property
    def num_children(self) -> int:
        return int(self.x.shape[-2])

    @property
    def num_parents(self) -> int:
        return int(self.z.shape[-2])

    def predictions(self, cast=lambda a: a) -> jax.Array:
        """Parent predictions $A_k z_k + b_k$, shape ``(..., parents, d_x)``; ``cast``
        is applied to ``A``, ``z`` and ``b`` first."""
        A, z = cast(self.A), cast(self.z)
        pred = (
            jnp.einsum("...xz,...kz->...kx", A, z)
            if A.ndim == 2
            else jnp.einsum("...kxz,...kz->...kx", A, z)
        )
        if self.b is not None:
            pred = pred + cast(self.b)
        return pred

    def dense(self) -> jax.Array:
        # in float32 at least (16-bit inputs), as the kernels accumulate
        diff = _pairwise_diff(float32_at_least(self.x), self.predictions(float32_at_least))
        prec = 1.0 if self.precision is None else float32_at_least(self.precision)
        s = -0.5 * jnp.sum(diff * diff * prec, -1)
        if self.normalize:
            d = self.x.shape[-1]
            # d log(precision) for a scalar: a sum would make a Python number float64
            # (with batch dims: one log-determinant per child, parent and batch element)
            logdet = (0.0 if self.precision is None else d * jnp.log(prec) if prec.ndim == 0
                      else jnp.sum(jnp.log(jnp.broadcast_to(prec, prec.shape[:-1] + (d,))),
                                   -1))
            s = s + 0.5 * logdet - 0.5 * d * math.log(2 * math.pi)
        return s


class Sum(Score):
    r"""Several similarities added before the softmax: $\psi = \sum_r \psi^{(r)}$.

    Adding potentials multiplies the corresponding factors of $p(x, \phi)$, as in
    Tschantz's general log-sum-exp model with several energy terms over one node set
    (v2 sec. "general form"), or a content score plus a positional score (Table 1 row 5).

    Args:
        *scores: the terms $\psi^{(r)}$: scores or ``(..., children, parents)`` arrays
            whose ``(children, parents)`` sizes broadcast together (a ``(1, parents)``
            table adds the same bias to every child; a ``(children, 1)`` term, one
            constant per child, changes log Z but no posterior, and runs on the exact
            engine only: the lowering refuses it and ``"auto"`` falls back).

    Raises:
        ValueError: if no score is given or the scores' sizes do not broadcast.
    """

    kind = "sum"

    def __init__(self, *scores: Score | ArrayLike):
        if not scores:
            raise ValueError("Sum needs at least one score")
        self.scores = tuple(as_score(s, "Sum") for s in scores)
        shapes = [(s.num_children, s.num_parents) for s in self.scores]
        try:
            self._size = jnp.broadcast_shapes(*shapes)
        except ValueError:
            raise ValueError(f"Sum: the scores' (children, parents) sizes do not broadcast: "
                             f"{shapes}") from None

    @property
    def num_children(self) -> int:
        return self._size[0]

    @property
    def num_parents(self) -> int:
        return self._size[1]

    def dense(self) -> jax.Array:
        out = self.scores[0].dense()
        for s in self.scores[1:]:
            out = out + s.dense()
        return out

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "terms": [s.describe() for s in self.scores]}


class Custom(Score):
    r"""Any score table $\psi_{ij}$, given or computed on demand.

    ``Custom(table)`` holds the ``(..., children, parents)`` log-potentials;
    ``Custom(fn, *args)`` computes them as ``fn(*args)`` when
    [`dense`][structinfer.scores.Score.dense] is called. The general edge potential of a
    pairwise MRF (Singh & Buckley sec. 3.1); use it for potentials not in this module.

    Args:
        fn_or_table: the table, or a function returning it.
        *args: the function's arguments (none with a table).

    Raises:
        TypeError: if a table comes with extra arguments.
        ValueError: if the table has fewer than two dims.
    """

    kind = "custom"

    def __init__(self, fn_or_table: Callable[..., jax.Array] | ArrayLike, *args: Any):
        if callable(fn_or_table):
            self.fn, self.args = fn_or_table, args
            self._table = None
        else:
            if args:
                raise TypeError("Custom(table) takes no extra arguments")
            self._table = as_float_array(fn_or_table, "Custom score table")
            check_ndim(self._table, 2, "Custom score table", "(..., children, parents)")
            self.fn, self.args = None, ()

    def dense(self) -> jax.Array:
        if self._table is not None:
            return self._table
        out = as_float_array(self.fn(*self.args), "Custom score function output")
        check_ndim(out, 2, "Custom score function output", "(..., children, parents)")
        return out

    @property
    def num_children(self) -> int:
        return int(self.dense().shape[-2])

    @property
    def num_parents(self) -> int:
        return int(self.dense().shape[-1])


def as_score(score: Any, site: str) -> Score:
    """Coerce ``score`` (a [`Score`][structinfer.scores.Score] or an array) to a `Score`.

    Arrays become [`Custom`][structinfer.scores.Custom] tables.

    Args:
        score: a score, or a ``(..., children, parents)`` array of log-potentials.
        site: the edge site's name, for the error message.

    Returns:
        The score.

    Raises:
        TypeError: if ``score`` is neither, naming the edge site.
    """
    if isinstance(score, Score):
        return score
    if hasattr(score, "shape") or isinstance(score, (list, tuple)):
        return Custom(score)
    raise TypeError(
        f"edge site '{site}': score must be a structinfer.scores score or a "
        f"(..., children, parents) array, got {type(score).__name__}"
    )
