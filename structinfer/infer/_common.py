"""Small helpers shared by the algorithms of `structinfer.infer` (not user API)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import check_value, is_concrete, positive_definite
from ._model_fn import ModelFunction

__all__ = [
    "rel_change_small",
    "rel_change_small_tree",
    "safe_log",
    "sum_tree",
    "max_abs",
    "as_float_tree",
    "like_tree",
    "site_finder",
    "check_weights",
    "check_covariances",
    "check_linalg_dtype",
    "weighted_affine_fit",
]


def rel_change_small(new: jax.Array, old: jax.Array, tol: float) -> jax.Array:
    r"""$|new - old| \le tol \cdot \max(1, |new|)$, the EM algorithms' energy test."""
    return jnp.abs(new - old) <= tol * jnp.maximum(1.0, jnp.abs(new))


def rel_change_small_tree(new: Any, old: Any, tol: float) -> jax.Array:
    r"""$\|new - old\|_F \le tol \cdot \|new\|_F$ for every leaf."""
    small = [jnp.sqrt(jnp.sum((a - b) ** 2)) <= tol * jnp.sqrt(jnp.sum(a**2))
             for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old))]
    return jnp.all(jnp.stack(small))


def safe_log(w: jax.Array) -> jax.Array:
    r"""$\log w$ with $\log 0 = -\infty$ and no NaN in its gradient; a negative or NaN $w$
    gives NaN."""
    return jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)),
                     jnp.where(w == 0, -jnp.inf, jnp.nan))


def sum_tree(tree: Any) -> jax.Array:
    """The sum of every element of every leaf."""
    return sum(jnp.sum(x) for x in jax.tree.leaves(tree))


def max_abs(tree: Any) -> jax.Array:
    r"""$\max |x|$ over every element of every leaf."""
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree.leaves(tree)]))


def as_float_tree(mu: Any) -> Any:
    """Every leaf as a floating array (integers promoted to the default float)."""
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=jnp.result_type(a, float)), mu)


def like_tree(value: Any, mu: Any, what: str | None = None, of: str = "the means",
              hint: str = "a scalar, or an array or pytree like them") -> Any:
    """`value` as a pytree like `mu`.

    Itself if it has `mu`'s structure, else repeated at every leaf (a scalar step size
    or precision).

    With ``what``, each leaf must broadcast to its mean's shape: one that would broadcast
    the mean to another shape (or not at all) is a ``ValueError`` naming ``what``, not a
    failure inside JAX's loop.
    """
    tree = value if jax.tree.structure(value) == jax.tree.structure(mu) else jax.tree.map(
        lambda _: value, mu)
    if what is not None:
        for v, m in zip(jax.tree.leaves(tree), jax.tree.leaves(mu)):
            v_shape, m_shape = tuple(jnp.shape(v)), tuple(jnp.shape(m))
            try:
                fits = jnp.broadcast_shapes(v_shape, m_shape) == m_shape
            except ValueError:
                fits = False
            if not fits:
                raise ValueError(f"{what} of shape {v_shape} must broadcast to the shape of "
                                 f"{of} {m_shape} ({hint})")
    return tree


def site_finder(fn: Any, mu_of_failure: Any) -> Any:
    """A function of the failing batch index that names the responsible site, or None.

    Only for a model-based energy (`model_energy` / `model_log_z`); None otherwise.
    """
    if isinstance(fn, ModelFunction):
        return lambda idx: fn.site(mu_of_failure(idx))
    return None


def check_weights(weights: Any, k: int, dtype: Any, what: str) -> jax.Array:
    """Mixture weights: ``(k,)``, non-negative and summing to 1 (`check_value`: NaN when
    traced).

    The sum is compared with 1 to ``max(1e-4, k * eps)`` of ``dtype``.

    Args:
        weights: the weights, or None for uniform ones.
        k: the number of components.
        dtype: their dtype.
        what: ``"<function>: weights"``, for the messages.

    Returns:
        The weights as a ``(k,)`` array (traced: NaN unless they pass).

    Raises:
        ValueError: another shape, or (concrete) a negative weight or a sum other than 1.
    """
    if weights is None:
        return jnp.full((k,), 1.0 / k, dtype)
    w = jnp.asarray(weights, dtype)
    if w.shape != (k,):
        raise ValueError(f"{what} of shape {tuple(w.shape)}, expected ({k},) (one per "
                         "component)")
    tol = max(1e-4, k * float(jnp.finfo(w.dtype).eps))

    def ok(xp, v):
        total = xp.sum(v.astype(xp.float32) if v.dtype.itemsize < 4 else v)
        return xp.all(v >= 0) & (xp.abs(total - 1.0) <= tol)

    if is_concrete(w):
        if not bool(ok(np, np.asarray(w))):
            raise ValueError(f"{what} {np.asarray(w, np.float64).round(4).tolist()} must be "
                             "non-negative and sum to 1")
        return w
    return check_value(w, ok, what, "must be non-negative and sum to 1")


def check_covariances(covs: jax.Array, what: str, diagonal: bool = False) -> jax.Array:
    r"""Initial covariances (or diagonal precisions): each symmetric to rounding and
    positive definite (`positive_definite`); diagonal: each entry positive and finite.

    Symmetric to rounding: $|C - C^\top| \le \sqrt{\epsilon} \max |C|$ entrywise, for
    the dtype's $\epsilon$ (float32 at least; a float32 inverse is symmetric only to
    rounding); the symmetric part is what the run reads.

    Concrete: a ``ValueError`` naming ``what``, the first component that fails and why
    (a non-finite entry, its asymmetry or its smallest eigenvalue: an indefinite
    covariance is no Gaussian, and the E-step would compute responsibilities from it).
    Traced: NaN unless they pass (`check_value`), so the run stops on a NaN energy.

    Args:
        covs: ``(K, d, d)`` (or ``(K, d)`` with ``diagonal``).
        what: ``"<function>: <argument>"``, for the messages.
        diagonal: ``covs`` holds the diagonals.

    Returns:
        ``covs``; full ones as their symmetric part, traced: NaN unless they pass.

    Raises:
        ValueError: a concrete component that fails.
    """
    if diagonal:
        def ok(xp, c):
            return xp.all((c > 0) & (c < xp.inf), -1)

        rule = "positive and finite"
    else:
        tol = float(np.sqrt(np.finfo(np.result_type(covs.dtype, np.float32)).eps))

        def symmetric(xp, c):
            scale = xp.max(xp.abs(c), (-2, -1), keepdims=True)
            return xp.all(xp.abs(c - xp.swapaxes(c, -1, -2)) <= tol * scale, (-2, -1))

        def ok(xp, c):
            return symmetric(xp, c) & positive_definite(xp, c)

        rule = "symmetric and positive definite"
    if is_concrete(covs):
        c = np.asarray(covs)
        with np.errstate(invalid="ignore"):  # an infinite entry: inf - inf
            good = np.asarray(ok(np, c))
        if not good.all():
            i = int(np.argmin(good))
            if not np.isfinite(c[i]).all():
                why = "it has a non-finite entry"
            elif diagonal:
                why = f"got {c[i]}"
            elif not symmetric(np, c[i]):
                why = f"|C - C^T| reaches {np.abs(c[i] - c[i].T).max():.3g}"
            else:
                lam = np.linalg.eigvalsh(c[i].astype(np.float64))[0]
                why = f"its smallest eigenvalue is {lam:.3g}"
            raise ValueError(f"{what} must be {rule}; component {i} is not: {why}")
    else:
        covs = check_value(covs, ok, what, f"must be {rule}")
    return covs if diagonal else (covs + jnp.swapaxes(covs, -1, -2)) / 2


def check_linalg_dtype(x: jax.Array, what: str) -> None:
    """Refuse a 16-bit float array where an EM algorithm solves linear systems.

    Its dtype is static: this runs under ``jit`` too. (XLA has no 16-bit inverse, solve
    or eigendecomposition; NumPy's error would name neither the function nor the
    argument.)

    Args:
        x: the data array that sets the algorithm's dtype.
        what: ``"<function>: <argument>"``, for the message.

    Raises:
        TypeError: ``x`` is a float of fewer than 32 bits, naming ``what``.
    """
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        raise TypeError(
            f"{what} is {jnp.dtype(x.dtype).name}: this EM algorithm solves linear systems "
            "(inverse, solve, eigendecomposition), which need float32 or float64; pass it "
            "as .astype(jnp.float32) and cast the result back"
        )


def weighted_affine_fit(u: jax.Array, y: jax.Array, r: jax.Array, A: jax.Array,
                        b: jax.Array, reg: Any) -> tuple[jax.Array, ...]:
    r"""The M-step of a mixture of affine maps $y \approx A_k u + b_k$: per mode $k$,
    least squares weighted by the responsibilities $r_{tk}$, with ridge ``reg`` on the
    Gram matrix.

    A mode without data ($\sum_t r_{tk} = 0$) keeps its ``A``, ``b`` (weight 0, as
    `gmm_em` keeps a dead component); NaN is not "no data", so it is never hidden.

    Args:
        u: inputs ``(T, d_in)``.
        y: targets ``(T, d)``.
        r: responsibilities ``(T, K)``.
        A: the modes' current maps ``(K, d, d_in)``.
        b: their current offsets ``(K, d)``.
        reg: the ridge added to each Gram matrix (``>= 0``).

    Returns:
        ``(A, b, err, nk, live)``: the new maps and offsets, the residuals ``(K, T, d)``,
        the modes' counts ``(K,)`` and whether each has data.
    """
    ut = jnp.concatenate([u, jnp.ones((u.shape[0], 1), u.dtype)], -1)
    nk = jnp.sum(r, 0)
    live = ~(nk <= 0)
    eye = jnp.eye(ut.shape[1], dtype=y.dtype)
    gram = jnp.einsum("tk,ti,tj->kij", r, ut, ut) + reg * eye
    gram = jnp.where(live[:, None, None], gram, eye)
    cross = jnp.einsum("tk,ti,tj->kij", r, y, ut)
    Ab = jnp.swapaxes(jnp.linalg.solve(gram, jnp.swapaxes(cross, -1, -2)), -1, -2)
    A_new = jnp.where(live[:, None, None], Ab[..., :-1], A)
    b_new = jnp.where(live[:, None], Ab[..., -1], b)
    err = y[None] - (jnp.einsum("kij,tj->kti", A_new, u) + b_new[:, None, :])
    return A_new, b_new, err, nk, live


def check_step_size(step_size: Any, what: str) -> Any:
    """Every leaf of a step size non-negative (`check_value`: an error naming ``what``,
    NaN when traced): a negative step climbs the energy; a zero leaf holds its mean or
    parameter where it is."""
    return jax.tree.map(
        lambda h: check_value(h, lambda xp, v: v >= 0, what, "must be non-negative"),
        step_size)
