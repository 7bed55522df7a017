"""Find which site of a model makes its collapsed energy non-finite (eager, on failure only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from numpyro.contrib.funsor import enum
from numpyro.handlers import block, trace

from .._checks import as_arrays
from ..exact import inspect_model
from ..handlers import fill_latent, observe_given, require_values


def bad_leaf(tree: Any) -> str | None:
    """The path and kind (`NaN` / `inf`) of the first floating leaf of `tree` that is not finite.

    Args:
        tree: any pytree.

    Returns:
        ``"<path> contains NaN"`` (or ``inf``), or ``None`` when every leaf is finite.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in leaves:
        try:
            arr = np.asarray(leaf)
        except Exception:  # noqa: BLE001 - non-array leaves are skipped
            continue
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            kind = "NaN" if np.isnan(arr).any() else "inf"
            return f"{jax.tree_util.keystr(path) or 'value'} contains {kind}"
    return None


def nonfinite_site(model: Callable, *args: Any, **kwargs: Any) -> str | None:
    r"""Name the first argument or site that makes $\log Z$ non-finite.

    That is the first argument or site whose value / log-density is NaN or +inf, or
    whose log-density is -inf under every structure (so that $\log Z = -\infty$).
    Runs the model eagerly under funsor enumeration; meant for error messages only. A
    continuous latent site without a value is read at a starting point in its support,
    $T(0)$ with $T$ = `biject_to(support)` (the placeholder of
    [`fill_latent`][structinfer.handlers.fill_latent]).

    Args:
        model: a NumPyro model with edge sites.
        *args: the model's positional arguments.
        **kwargs: the model's keyword arguments.

    Returns:
        A description of the argument or site, or ``None`` when none was found; where
        the model itself raises, ``"(the model raised <its error>)"``.
    """
    try:
        return start_failure(model, args, kwargs)
    except Exception as e:  # noqa: BLE001 - report, don't mask the original failure
        return f"(the model raised {type(e).__name__}: {e})"


def start_failure(model: Callable, args: tuple, kwargs: dict) -> str | None:
    """`nonfinite_site`, letting the model's own exception propagate (for a fit that
    found no starting point: the model's error
    is the cause to report).

    Args:
        model: a NumPyro model with edge sites.
        args: the model's positional arguments.
        kwargs: the model's keyword arguments.

    Returns:
        As `nonfinite_site`.

    Raises:
        Exception: whatever the model raises when run at the starting point.
    """
    for i, a in enumerate(args):
        bad = bad_leaf(a)
        if bad:
            return f"model argument {i} ({bad})"
    for k, a in kwargs.items():
        bad = bad_leaf(a)
        if bad:
            return f"model argument '{k}' ({bad})"
    args, kwargs = as_arrays(args, kwargs)
    info = inspect_model(model, *args, **kwargs)
    with block():
        m = enum(require_values(fill_latent(observe_given(model))),
                 first_available_dim=info.first_available_dim)
        tr = trace(m).get_trace(*args, **kwargs)
    nest = info.max_plate_nesting
    for name, site in tr.items():
        if site["type"] != "sample":
            continue
        value = site["value"]
        if not site["is_observed"] and name not in info.enumerated:
            bad = bad_leaf(value)
            if bad:
                return f"'{name}' (its value {bad})"
        lp = np.asarray(site["fn"].log_prob(value))
        if np.isnan(lp).any():
            return f"'{name}' (log-density is NaN)"
        if np.isposinf(lp).any():
            return f"'{name}' (log-density is +inf)"
        n_enum = lp.ndim - nest
        if n_enum > 0:
            all_neg = np.all(np.isneginf(lp), axis=tuple(range(n_enum)))
        else:
            all_neg = np.isneginf(lp)
        if np.any(all_neg):
            idx = tuple(int(i) for i in np.argwhere(np.atleast_1d(all_neg))[0])
            return f"'{name}' (log-density is -inf for every structure at index {idx})"
    return None
