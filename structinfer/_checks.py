"""Small input checks and array helpers shared by priors, scores and the engine.

Shape checks run everywhere (shapes are static). A check of values raises on concrete
arrays; on traced ones (under ``jax.jit``, ``jax.grad``, ``jax.vmap``) it either is
skipped or, for the arguments of scores and priors (``require``), turns them into
NaN, so that a bad value never gives a finite answer.
"""

from __future__ import annotations

import contextvars
import numbers
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.typing import ArrayLike
from numpyro.util import is_prng_key


def as_arrays(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """NumPy arrays among a model's arguments become JAX arrays; other leaves pass through.

    So the model may index them with (traced or enumerated) edge variables.

    Args:
        args: the model's positional arguments.
        kwargs: the model's keyword arguments.

    Returns:
        ``(args, kwargs)`` with every NumPy leaf converted.
    """
    conv = lambda a: jnp.asarray(a) if isinstance(a, np.ndarray) else a  # noqa: E731
    return jax.tree.map(conv, tuple(args)), jax.tree.map(conv, dict(kwargs))


def model_name(model: Any) -> str:
    """The name error messages use for a model (its ``__name__``, else its type's).

    Args:
        model: a model (any callable).

    Returns:
        The name.
    """
    return getattr(model, "__name__", type(model).__name__)


def is_concrete(x: Any) -> bool:
    """True when ``x`` holds actual values (not a tracer inside jit/grad/vmap).

    Args:
        x: an array or any value.

    Returns:
        ``False`` for a JAX tracer, ``True`` otherwise.
    """
    return not isinstance(x, jax.core.Tracer)


def as_float_array(x: ArrayLike, what: str) -> jax.Array:
    """Convert to a floating JAX array, keeping float64 when x64 is on.

    A Python number stays weakly typed (as in JAX): it takes the dtype of the arrays it
    meets, so ``2`` or ``0.5`` does not make a float32 model float64 under x64.

    Args:
        x: an array-like; integers become the default float (a Python int a weakly
            typed one).
        what: the argument's name, for the error message.

    Returns:
        ``x`` as a floating JAX array.

    Raises:
        TypeError: ``x`` is not array-like, or is complex (its imaginary part would be
            lost), naming ``what``.
    """
    try:
        arr = jnp.asarray(x)
    except TypeError as e:  # pragma: no cover - message improvement only
        raise TypeError(f"{what}: expected an array, got {type(x).__name__}") from e
    check_real(arr, what)
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        # astype would make a weakly typed int a strongly typed float; adding 0.0 does not
        arr = arr + 0.0 if arr.weak_type else arr.astype(jnp.result_type(float))
    return arr


def check_real(x: Any, what: str) -> None:
    """Refuse a complex array (its dtype is static: this runs under ``jit`` too).

    Args:
        x: an array, or its dtype.
        what: the argument's name, for the error message.

    Raises:
        TypeError: ``x`` is complex, naming ``what`` (a real array is expected: its
            imaginary part would otherwise be dropped).
    """
    if jnp.issubdtype(jnp.result_type(x), jnp.complexfloating):
        raise TypeError(
            f"{what} is {jnp.result_type(x)}: expected a real array (its imaginary part "
            "would be lost); pass jnp.real(x), jnp.abs(x) or the two parts as features"
        )


def check_finite(x: ArrayLike, what: str, allow_neg_inf: bool = False) -> None:
    """Raise ``ValueError`` naming ``what`` if ``x`` has NaN (or inf) entries.

    Skipped when ``x`` is traced.

    Args:
        x: the array to check.
        what: the argument's name, for the error message.
        allow_neg_inf: accept ``-inf`` entries (forbidden edges in a log-table).

    Raises:
        ValueError: at the first NaN or infinite entry, naming its index.
    """
    if not is_concrete(x):
        return
    arr = np.asarray(x)
    bad = np.isnan(arr) | (np.isposinf(arr))
    if not allow_neg_inf:
        bad |= np.isneginf(arr)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        kind = "NaN" if np.isnan(arr[idx]) else "inf"
        rule = ("a log-potential may be -inf (a forbidden edge), not NaN or +inf"
                if allow_neg_inf else
                "scores and log-priors must be finite (use a Restricted prior to forbid "
                "edges)")
        raise ValueError(f"{what} contains {kind} at index {idx} (shape {arr.shape}); {rule}")


#: ``False`` while an edge site re-reads its prior's table for children that
#: ``numpyro.handlers.mask`` masks out: the priors' own checks of empty rows are skipped
#: then, and the edge checks the kept children instead (`first_empty_row`).
ROWS_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("rows_checked",
                                                                    default=True)


def first_empty_row(allowed: np.ndarray, rows_per_entry: int = 1) -> str | None:
    """Where the first child with no allowed parent is, or ``None`` when every one has one.

    The one rule for a child left no parent (an empty prior row, a row of ``-inf``
    scores): on concrete values the priors and [`edge`][structinfer.edge] raise naming
    it; under a trace the row is NaN (a model coupling several edge sites: all of it).

    Args:
        allowed: booleans ``(..., children, parents)``, ``True`` on an allowed edge.
        rows_per_entry: children per row of ``allowed`` (a block mask's block height).

    Returns:
        ``"child i"``, with ``" (batch index (b, ...))"`` under batch dims, or ``None``.
    """
    empty = ~np.asarray(allowed).any(axis=-1)
    if not empty.any():
        return None
    idx = tuple(int(i) for i in np.argwhere(empty)[0])
    batch = idx[:-1]
    return f"child {idx[-1] * rows_per_entry}" + (f" (batch index {batch})" if batch else "")


def check_ndim(x: ArrayLike, min_ndim: int, what: str, layout: str) -> None:
    """Raise ``ValueError`` if ``x`` has fewer than ``min_ndim`` dimensions.

    Args:
        x: the array to check (its shape is static, so this runs under ``jit`` too).
        min_ndim: the fewest dimensions ``x`` may have.
        what: the argument's name, for the error message.
        layout: the expected layout, e.g. ``"(..., children, parents)"``.

    Raises:
        ValueError: naming ``what``, the layout and the shape.
    """
    if jnp.ndim(x) < min_ndim:
        raise ValueError(
            f"{what} must have at least {min_ndim} dimension(s) laid out as {layout}, "
            f"got shape {tuple(jnp.shape(x))}"
        )


def check_layout(x: jax.Array, ndim: int, what: str, layout: str, hint: str = "") -> None:
    """Raise ``ValueError`` unless ``x`` has exactly ``ndim`` dimensions.

    Args:
        x: the array (its shape is static: this runs under ``jit`` too).
        ndim: the number of dimensions expected.
        what: ``"<function>: <argument>"``, for the message.
        layout: the expected layout, e.g. ``"(K, d)"``.
        hint: appended to the message.
    """
    if jnp.ndim(x) != ndim:
        raise ValueError(f"{what} must be {layout}, got shape {tuple(jnp.shape(x))}{hint}")


def check_nonempty(x: jax.Array, what: str, layout: str) -> None:
    """Raise ``ValueError`` when ``x`` has no rows (its leading dim is 0).

    Args:
        x: the array (its shape is static: this runs under ``jit`` too).
        what: ``"<function>: <argument>"``, for the message.
        layout: the expected layout, e.g. ``"(points, d)"``.
    """
    if jnp.shape(x)[0] == 0:
        raise ValueError(f"{what} must be {layout} with at least one row, "
                         f"got shape {tuple(jnp.shape(x))}")


def require(ok: Callable[..., Any], message: str, *values: Any) -> Any:
    """Check the arguments of a score or prior: an error on concrete values, NaN on traced ones.

    ``ok(xp, *values)`` returns booleans (any shape; every entry must hold), computed with
    ``xp`` = ``numpy`` when every value is concrete and ``jax.numpy`` when one is traced.

    * Every value concrete (run eagerly, or a constant inside ``jit``): raises
      ``ValueError(message.format(*values))`` unless every entry holds.
    * A traced value (under ``jax.jit``, ``jax.grad`` or ``jax.vmap``, and inside
      `structinfer.attention`, which traces the model under its own ``jit``): unless every
      entry holds, each traced value becomes NaN, so that what is computed from it is NaN,
      never a finite wrong number. `structinfer.attention` called on concrete arguments
      then raises this error (a NaN answer re-runs the model eagerly).

    Args:
        ok: the condition, ``ok(xp, *values) -> booleans``.
        message: the error, a ``str.format`` template of the values (as NumPy arrays).
        *values: the arguments checked (arrays or Python numbers).

    Returns:
        The values, the concrete ones unchanged: one value, or a tuple of several.

    Raises:
        ValueError: the values are concrete and a condition fails.
    """
    if all(is_concrete(v) for v in values):
        shown = [np.asarray(v) for v in values]
        if not bool(np.all(ok(np, *shown))):
            raise ValueError(message.format(*shown))
        out = values
    else:
        good = jnp.all(ok(jnp, *values))
        # added, not selected: the NaN reaches the parameter's gradient too (a select's
        # would be a finite 0 for it)
        # (a weakly typed NaN or 0: the value keeps its dtype and weak type)
        out = tuple(v if is_concrete(v) else v + jnp.where(good, 0.0, jnp.nan)
                    for v in values)
    return out[0] if len(out) == 1 else out


class NotFoundError(KeyError):
    """A ``KeyError`` whose message is a sentence, printed as written (``KeyError``'s own
    ``str()`` shows the repr of its argument, in quotes)."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


def check_key(rng_key: Any, what: str) -> jax.Array:
    """``rng_key`` if it is one PRNG key (new-style, or raw ``uint32[2]`` as a JAX or NumPy
    array, as `jax.random` takes it), else a TypeError.

    Args:
        rng_key: the argument.
        what: the function, for the message.

    Returns:
        ``rng_key``.

    Raises:
        TypeError: a seed, a batch of keys or anything else, naming ``what``.
    """
    if isinstance(rng_key, np.ndarray) and rng_key.dtype == np.uint32 and rng_key.shape == (2,):
        rng_key = jnp.asarray(rng_key)  # a raw key saved with np.asarray
    if not (isinstance(rng_key, jax.Array) and is_prng_key(rng_key)):
        raise TypeError(
            f"{what}: rng_key must be one PRNG key (jax.random.key(seed) or "
            f"jax.random.PRNGKey(seed)), got {type(rng_key).__name__} "
            f"{getattr(rng_key, 'shape', '')}"
        )
    return rng_key


def check_count(value: Any, what: str, minimum: int = 1, *, none_ok: bool = False,
                role: str = "") -> int | None:
    """A count argument (steps, draws, a size) as a Python int (a NumPy integer too).

    Args:
        value: the argument.
        what: ``"<function>: <argument>"``, for the message.
        minimum: the smallest value allowed.
        none_ok: ``None`` is allowed (and returned).
        role: what the count is, for the message.

    Returns:
        ``int(value)``, or ``None`` where allowed.

    Raises:
        ValueError: not an int (a bool neither) of at least ``minimum``, naming ``what``.
    """
    if none_ok and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        kind = {1: "a positive int", 0: "a non-negative int"}.get(minimum,
                                                                  f"an int >= {minimum}")
        raise ValueError(f"{what} must be {kind}{' or None' if none_ok else ''}"
                         f"{f' ({role})' if role else ''}, got {value!r}")
    return int(value)


def float32_at_least(x: jax.Array) -> jax.Array:
    """``x`` in float32 if it is a 16-bit float, else as it is (an integer array too): the
    dtype the exact engine builds and contracts its tables in (as the kernels accumulate),
    so that a bfloat16 model's scores are not rounded to 16 bits."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        return x.astype(jnp.float32)
    return x


def positive_definite(xp: Any, P: Any) -> Any:
    r"""Whether each matrix ``(..., d, d)`` is positive definite, read through its
    symmetric part $S = (P + P^\top)/2$ (a quadratic form reads only that).

    Concrete (``xp`` is NumPy): every entry finite and every eigenvalue of $S$ positive,
    computed in float64, so exactly the matrix as stored. Traced (``xp`` is
    ``jax.numpy``, float32 unless the input is float64): the eigenvalues
    $\lambda_1 \le \dots \le \lambda_d$ must have $\lambda_d > 0$ and
    $\lambda_1 > -d\,\epsilon\,\lambda_d$, the eigensolver's rounding error at the
    input's precision $\epsilon$ (float32's for 16-bit input): a float32 eigenvalue of an
    ill-conditioned positive definite matrix can come out slightly negative, and a
    quadratic form with such a matrix is then right to its own rounding. NaN or infinite
    entries fail.

    Args:
        xp: ``numpy`` or ``jax.numpy`` (as `require` calls it).
        P: the matrices.

    Returns:
        Booleans of shape ``P.shape[:-2]``.
    """
    P = xp.asarray(P)
    finite = xp.all(xp.isfinite(P), (-2, -1))
    dt = np.float64 if xp is np else np.result_type(P.dtype, np.float32)
    P = xp.where(finite[..., None, None], P, 0.0).astype(dt)
    lam = xp.linalg.eigvalsh((P + xp.swapaxes(P, -1, -2)) / 2)
    top = lam[..., -1]
    slack = 0.0 if xp is np else P.shape[-1] * float(np.finfo(dt).eps) * top
    return finite & (top > 0) & (lam[..., 0] > -slack)


def check_int(value: Any, what: str) -> int:
    """An int argument that is a position or offset, as a Python int (a NumPy integer too):
    floats and bools are refused (they are never meant).

    Args:
        value: the argument.
        what: ``"<object>: <argument>"``, for the message.

    Returns:
        ``operator.index(value)``.

    Raises:
        TypeError: ``value`` is not an int, naming ``what``.
    """
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what} must be an int, got {value!r}")


def check_static_int(x: Any, name: str, what: str) -> Any:
    """Refuse a traced structural int (a size, window or offset that sets a shape).

    Args:
        x: the value to check.
        name: the argument's name.
        what: the object it belongs to, for the error message.

    Returns:
        ``x`` unchanged.

    Raises:
        TypeError: ``x`` is a tracer, naming ``name``.
    """
    if not is_concrete(x):
        raise TypeError(
            f"{what}: `{name}` must be a static Python int (it sets a shape or a sparsity "
            "pattern), got a traced value; pass it as a Python int (under jax.jit: close "
            "over it or mark it with static_argnums / static_argnames)"
        )
    return x


def is_masked(fn: dist.Distribution | None) -> bool:
    """True when the distribution ``fn`` is (or wraps) a ``MaskedDistribution``.

    ``numpyro.handlers.mask`` does that.

    Args:
        fn: a site's distribution.

    Returns:
        Whether some layer of ``fn`` (through ``base_dist``) is masked.
    """
    for _ in range(32):
        if fn is None:
            return False
        if isinstance(fn, dist.MaskedDistribution):
            return True
        fn = getattr(fn, "base_dist", None)
    return True  # pragma: no cover - absurdly deep wrapping: be conservative


def moved_names(module: str, moved: dict[str, str]) -> Any:
    """A module `__getattr__` for names that moved: each raises an AttributeError saying
    where it went (`moved`: name -> its replacement, in words).

    Args:
        module: the module's dotted name, for the messages.
        moved: `{old name: what to use instead}`.

    Returns:
        The `__getattr__(name)` function to assign in the module.
    """

    def __getattr__(name: str) -> Any:
        if name in moved:
            raise AttributeError(f"{module}.{name} was removed: use {moved[name]}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


@jax.jit
def normalise_log_weights(
    logits: jax.Array, log_normalizer: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    r"""Log-weights normalised over the last (parent) axis, and their log-normaliser.

    $$
    \log p_{ij} = \ell_{ij} - L_i, \qquad L_i = \log \textstyle\sum_j e^{\ell_{ij}}
    $$

    A non-finite $L_i$ is not subtracted: a row of all $-\infty$ (no allowed parent)
    stays $-\infty$, and its $L_i = -\infty$ has gradient 0 (a padded child masked out
    reads no NaN gradient through the mask). ``log_normalizer`` is $L$ when the caller
    has it already (it is returned as given).

    One compiled program: run eagerly (a model called outside ``jit``), it is one
    dispatch instead of the dozen small programs of ``logsumexp`` and the subtraction.

    Returns:
        ``(log_p, L)``: the normalised table and $L$ (computed: the table's shape
            without the last axis).
    """
    if log_normalizer is None:
        # a row of all -inf is summed as a row of zeros, then set to -inf: its gradient is
        # 0, not logsumexp's NaN (which a mask's where would pass on as 0 * NaN = NaN)
        empty = jnp.all(logits == -jnp.inf, axis=-1)
        lse = jax.nn.logsumexp(jnp.where(empty[..., None], 0.0, logits), axis=-1)
        log_normalizer = jnp.where(empty, -jnp.inf, lse)
    safe = jnp.where(jnp.isfinite(log_normalizer), log_normalizer, 0.0)
    return logits - safe[..., None], log_normalizer


def check_value(value: Any, ok: Any, what: str, rule: str) -> Any:
    """The one rule for an algorithm's checked argument (a ridge, a precision, weights).

    Concrete: raise ``ValueError`` naming ``what`` unless every entry of
    ``ok(xp, value)`` holds (``xp`` is ``numpy``). Traced (under ``jit``, ``grad`` or
    ``vmap``, where it cannot be checked): unless it holds (``xp`` is ``jax.numpy``),
    the value becomes NaN, so the algorithm stops on a non-finite energy instead of
    returning a finite wrong result. The policy of the scores' and priors' checks.

    Args:
        value: the argument (an array or a Python number).
        ok: ``ok(xp, value) -> booleans``; NaN must fail it.
        what: ``"<function>: <argument>"``, for the message.
        rule: what it must be, for the message (``"must be ..."``).

    Returns:
        ``value`` (concrete: unchanged; traced: NaN unless it passes), in its dtype.

    Raises:
        ValueError: a concrete value that fails, naming ``what``.
    """
    return require(ok, f"{_braces(what)} {_braces(rule)}, got {{}}", value)


def _braces(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def check_nonnegative(value: Any, what: str, role: str) -> Any:
    """A ridge or other amount that must be ``>= 0`` (`check_value`: NaN when traced).

    Args:
        value: the amount (a scalar).
        what: ``"<function>: <argument>"``, for the message.
        role: what the amount does, for the message.

    Returns:
        ``value``, or (traced) NaN where it is negative.

    Raises:
        ValueError: a concrete value that is negative or NaN.
    """
    return check_value(value, lambda xp, v: v >= 0, what,
                       f"must be a non-negative number ({role})")


def check_tol(tol: Any, what: str, role: str = "a convergence tolerance") -> Any:
    """A tolerance: one non-negative real number (a 0-d array too).

    Concrete: a negative or NaN tolerance can never be met (the loop would run to
    ``max_iters``), and a string, a bool or an array with dims fails inside JAX; each
    raises here, naming ``what``. Traced (``jit``, ``vmap``), only its type and shape are
    checked: a negative one then stops at ``max_iters``, reported in
    ``info.max_iters_reached``.

    Args:
        tol: the tolerance.
        what: ``"<function>: <argument>"``, for the message.
        role: what the tolerance is for, for the message.

    Returns:
        ``tol``, unchanged.

    Raises:
        ValueError: anything else, naming ``what``.
    """
    number = isinstance(tol, numbers.Real) and not isinstance(tol, (bool, np.bool_))
    array = (isinstance(tol, (jax.Array, np.ndarray)) and np.ndim(tol) == 0
             and (jnp.issubdtype(tol.dtype, jnp.floating)
                  or jnp.issubdtype(tol.dtype, jnp.integer)))
    if not (number or array):
        raise ValueError(f"{what} must be a non-negative number ({role}), got {tol!r}")
    if is_concrete(tol):  # the value rule of `check_nonnegative`; ``tol`` stays as given
        check_nonnegative(tol, what, role)
    return tol
