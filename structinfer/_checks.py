"""Small input checks shared by priors, scores and the engine.

Checks only run on concrete arrays: under ``jax.jit`` the values are tracers and
the checks that need values are skipped (shape checks still run, since shapes
are static).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist


def as_arrays(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """NumPy arrays among a model's arguments become JAX arrays, so the model may index
    them with (traced or enumerated) edge variables; other leaves pass through."""
    conv = lambda a: jnp.asarray(a) if isinstance(a, np.ndarray) else a  # noqa: E731
    return jax.tree.map(conv, tuple(args)), jax.tree.map(conv, dict(kwargs))


def model_name(model) -> str:
    """The name error messages use for a model (its ``__name__``, else its type's)."""
    return getattr(model, "__name__", type(model).__name__)


def is_concrete(x) -> bool:
    """True when ``x`` holds actual values (not a tracer inside jit/grad/vmap)."""
    return not isinstance(x, jax.core.Tracer)


def as_float_array(x, what: str) -> jax.Array:
    """Convert to a floating JAX array, keeping float64 when x64 is on."""
    try:
        arr = jnp.asarray(x)
    except TypeError as e:  # pragma: no cover - message improvement only
        raise TypeError(f"{what}: expected an array, got {type(x).__name__}") from e
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        arr = arr.astype(jnp.result_type(float))
    return arr


def check_finite(x, what: str, allow_neg_inf: bool = False) -> None:
    """Raise ``ValueError`` naming ``what`` if ``x`` has NaN (or inf) entries."""
    if not is_concrete(x):
        return
    arr = np.asarray(x)
    bad = np.isnan(arr) | (np.isposinf(arr))
    if not allow_neg_inf:
        bad |= np.isneginf(arr)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        kind = "NaN" if np.isnan(arr[idx]) else "inf"
        raise ValueError(
            f"{what} contains {kind} at index {idx} (shape {arr.shape}); "
            "scores and log-priors must be finite (use a Restricted prior to forbid edges)"
        )


def check_ndim(x, min_ndim: int, what: str, layout: str) -> None:
    if jnp.ndim(x) < min_ndim:
        raise ValueError(
            f"{what} must have at least {min_ndim} dimension(s) laid out as {layout}, "
            f"got shape {tuple(jnp.shape(x))}"
        )


def all_positive(x) -> bool:
    """False when ``x`` is concrete and has an entry that is not ``> 0`` (NaN included).

    A traced ``x`` (a hyperparameter under ``jax.jit`` / ``jax.grad`` / ``jax.vmap``) passes:
    value checks run eagerly and are skipped under tracing.
    """
    if not is_concrete(x):
        return True
    return bool(np.all(np.asarray(x) > 0))


def check_static_int(x, name: str, what: str):
    """Refuse a traced structural int (a size, window or offset that sets a shape).

    Returns ``x`` unchanged; raises ``TypeError`` naming ``name`` when ``x`` is a tracer.
    """
    if not is_concrete(x):
        raise TypeError(
            f"{what}: `{name}` must be a static Python int (it sets a shape or a sparsity "
            "pattern), got a traced value; pass it as a Python int (under jax.jit: close "
            "over it or mark it with static_argnums / static_argnames)"
        )
    return x


def is_masked(fn) -> bool:
    """True when the distribution ``fn`` is (or wraps) a ``MaskedDistribution``
    (``numpyro.handlers.mask`` does that)."""
    for _ in range(32):
        if fn is None:
            return False
        if isinstance(fn, dist.MaskedDistribution):
            return True
        fn = getattr(fn, "base_dist", None)
    return True  # pragma: no cover - absurdly deep wrapping: be conservative
