"""Small helpers shared by the mechanism models (not part of the public API)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist


def features(x, name: str, mechanism: str, ndim: int = 2) -> jax.Array:
    """``x`` as a floating array with at least ``ndim`` dims, or a clear error."""
    arr = jnp.asarray(x)
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        arr = arr.astype(jnp.result_type(float))
    if arr.ndim < ndim:
        raise ValueError(
            f"{mechanism}: `{name}` must have {ndim} dims laid out as "
            f"{'(nodes, features)' if ndim == 2 else f'{ndim} axes'}, got shape {tuple(arr.shape)}"
        )
    return arr


def check_matrix(w, name: str, mechanism: str, cols: int) -> jax.Array:
    """A ``(rows, cols)`` projection matrix (applied as ``x @ w.T``)."""
    arr = jnp.asarray(w)
    if arr.ndim != 2 or arr.shape[-1] != cols:
        raise ValueError(
            f"{mechanism}: `{name}` must be a (out, {cols}) matrix applied as x @ {name}.T, "
            f"got shape {tuple(arr.shape)}"
        )
    return arr


def latent_nodes(name: str, shape: tuple[int, ...], precision=None, dtype=None) -> jax.Array:
    r"""A latent node array with the quadratic node potential of Singh & Buckley sec. 4.1.

    $$
    \log p(z) = -\tfrac{\lambda}{2}\|z\|^2 + \text{const}
    $$

    ``precision=None`` gives a flat (improper) node potential, i.e. the pure
    log-sum-exp energy of Tschantz. Under the exact engine the site must be given
    a value (``numpyro.handlers.substitute``): its gradient is then the collapsed
    free-energy gradient of the paper.
    """
    if precision is None:
        fn = dist.ImproperUniform(dist.constraints.real, (), tuple(shape))
    else:
        scale = jnp.asarray(precision, dtype=dtype or jnp.result_type(float)) ** -0.5
        fn = dist.Normal(jnp.zeros(shape, scale.dtype), scale).to_event(len(shape))
    return numpyro.sample(name, fn)


def project(x: jax.Array, w: jax.Array | None) -> jax.Array:
    """``x @ w.T`` (``w=None`` is the identity)."""
    return x if w is None else x @ w.T
