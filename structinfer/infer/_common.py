"""Small helpers shared by the algorithms of `structinfer.infer` (not user API)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

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
    r"""$\log w$ with $\log 0 = -\infty$ and no NaN in its gradient."""
    return jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)), -jnp.inf)


def sum_tree(tree: Any) -> jax.Array:
    """The sum of every element of every leaf."""
    return sum(jnp.sum(x) for x in jax.tree.leaves(tree))


def max_abs(tree: Any) -> jax.Array:
    r"""$\max |x|$ over every element of every leaf."""
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree.leaves(tree)]))


def as_float_tree(mu: Any) -> Any:
    """Every leaf as a floating array (integers promoted to the default float)."""
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=jnp.result_type(a, float)), mu)


def like_tree(value: Any, mu: Any) -> Any:
    """`value` as a pytree like `mu`.

    Itself if it has `mu`'s structure, else repeated at every leaf (a scalar step size
    or precision).
    """
    if jax.tree.structure(value) == jax.tree.structure(mu):
        return value
    return jax.tree.map(lambda _: value, mu)


def site_finder(fn: Any, mu_of_failure: Any) -> Any:
    """A function of the failing batch index that names the responsible site, or None.

    Only for a model-based energy (`model_energy` / `model_log_z`); None otherwise.
    """
    if isinstance(fn, ModelFunction):
        return lambda idx: fn.site(mu_of_failure(idx))
    return None
