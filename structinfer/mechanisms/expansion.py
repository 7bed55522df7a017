r"""Bayesian model expansion: add a parent when a new child is poorly explained
(Tschantz slides "Bayesian model expansion")."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpyro

from .. import priors, scores
from .._checks import as_float_array, require
from ..exact import energy
from ..primitives import edge
from ._common import features

__all__ = ["expandable_mixture", "expand_components", "add_component"]


def expandable_mixture(
    x: jax.Array, components: jax.Array, active: jax.Array, precision: float = 1.0
) -> None:
    r"""A mixture over a fixed-capacity buffer of components, of which some are active.

    Graph:
        child data $x_{1..N}$, parent components $z_{1..K_{\max}}$, of which the
        ``active`` ones can be chosen.

    Prior:
        uniform restricted to the active components.

    Potentials:
        $\mathrm{sim}(x_i, z_k) = -\tfrac\lambda2 \|x_i - z_k\|^2$.

    Value:
        the per-child energy $E_i = -\ln\sum_{k\ \mathrm{active}} \exp(\mathrm{sim}(x_i,
        z_k)) + \ln K_{\mathrm{active}}$, which [`expand_components`][structinfer.mechanisms.expand_components] compares with
        a threshold $\tau$.

    Args:
        x: data ``(N, d)``.
        components: the component buffer $z_k$, ``(K_max, d)``.
        active: boolean ``(K_max,)`` mask of the active components (may be traced).
        precision: $\lambda$.

    Sites:
        ``component`` (edge, children = data).

    Reference:
        Tschantz slides "Bayesian model expansion".
    """
    x = features(x, "x", "expandable_mixture")
    components = features(components, "components", "expandable_mixture")
    active = jnp.asarray(active)
    if active.dtype != jnp.bool_ or active.shape != (components.shape[-2],):
        raise ValueError(
            f"expandable_mixture: active must be a boolean ({components.shape[-2]},) mask, "
            f"got {active.dtype} {active.shape}"
        )
    with numpyro.plate("data", x.shape[-2]):
        edge(
            "component",
            priors.Restricted(active[None, :], pattern=priors.Mask("active_components")),
            scores.NegSqDist(x, components, precision=precision),
        )


def add_component(
    components: Any, active: jax.Array, row: Any, grow: jax.Array
) -> tuple[Any, jax.Array, jax.Array]:
    r"""The expansion step on a fixed-capacity buffer: when `grow` and a slot is free,
    the first free slot becomes `row` and active.

    $$\text{grow} \wedge \exists k: \neg\,\text{active}_k \;\Rightarrow\;
    z_{k^*} \leftarrow \text{row},\ \text{active}_{k^*} \leftarrow \text{True},
    \quad k^* = \min\{k : \neg\,\text{active}_k\}.$$

    The one implementation of model expansion: `expand_components` (this mixture's
    energy) and `structinfer.infer.expand` (any similarity, a scan over children) both
    call it. Jittable; nothing changes when the buffer is full.

    Args:
        components: a pytree of `(K_max, ...)` arrays.
        active: boolean `(K_max,)`.
        row: a pytree like one row of `components`.
        grow: boolean scalar, whether a component is wanted.

    Returns:
        `(components, active, added)`; `added` is False when `grow` is False or the
        buffer is full.
    """
    active = jnp.asarray(active)
    free = ~active
    added = grow & jnp.any(free)
    slot = jnp.argmax(free)
    components = jax.tree.map(
        lambda c, r: jnp.where(added, jnp.asarray(c).at[slot].set(jnp.asarray(r, c.dtype)), c),
        components, row)
    active = jnp.where(added, active.at[slot].set(True), active)
    return components, active, added


def check_tau(tau: Any, who: str) -> jax.Array:
    r"""The energy threshold $\tau$ of model expansion, checked: a number, not NaN.

    A NaN $\tau$ compares False with every energy $E > \tau$, so nothing would ever be
    added (Tschantz, slides "Bayesian model expansion").

    Args:
        tau: the threshold ($\pm\infty$ allowed: always / never expand).
        who: the function, for the error message.

    Returns:
        ``tau`` as a floating array (traced and NaN: NaN, which the caller passes on to
        the energies it returns).

    Raises:
        TypeError: ``tau`` is not a number, naming it.
        ValueError: ``tau`` is not a scalar, or a concrete NaN ``tau``, naming it.
    """
    t = as_float_array(tau, f"{who}: tau")
    if t.ndim:
        raise ValueError(f"{who}: tau must be a scalar (one energy threshold), got shape "
                         f"{tuple(t.shape)}")
    return require(lambda xp, t: ~xp.isnan(t), f"{who}: tau must not be NaN (the energy "
                   "threshold), got {}", t)


def nan_factor(tau: jax.Array) -> jax.Array:
    """1, or NaN for a NaN ``tau`` (checked by `check_tau`, so only a traced one): the
    factor that makes expansion's outputs and their gradients NaN, not a finite answer."""
    return jnp.where(jnp.isnan(tau), jnp.nan, 1.0)


def expand_components(
    x_new: jax.Array,
    components: jax.Array,
    active: jax.Array,
    tau: float,
    precision: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""One model-expansion step: add a component at a new point whose energy exceeds $\tau$.

    The first free component of the buffer becomes $z_{K+1} = x_{N+1}$.

    $$
    E_{N+1} = -\ln \sum_k p(\phi = k)\, e^{\mathrm{sim}(x_{N+1}, z_k)} > \tau
    \;\Rightarrow\; z_{K+1} \leftarrow x_{N+1}
    $$

    The energy is that of [`expandable_mixture`][structinfer.mechanisms.expandable_mixture] for the single point, computed by the
    exact engine (it includes the prior's $\ln K_{\mathrm{active}}$); the step is
    `structinfer.mechanisms.expansion.add_component`. Jittable: the
    buffer has a fixed capacity; when it is full nothing is added.

    Args:
        x_new: the new point $x_{N+1}$, ``(d,)``.
        components: the component buffer ``(K_max, d)``.
        active: boolean ``(K_max,)`` mask of the active components.
        tau: the energy threshold $\tau$.
        precision: $\lambda$.

    Returns:
        ``(components, active, energy_new)`` after the step.

    Raises:
        ValueError: if ``x_new`` is not one point ``(d,)``, ``tau`` is not a scalar, or
            ``tau`` is NaN (traced: the energy, the components and their gradients are
            NaN).
        TypeError: ``tau`` is not a number.
    """
    x_new = jnp.asarray(x_new)
    if x_new.ndim != 1:
        raise ValueError(f"expand_components: x_new must be one point (d,), got {x_new.shape}")
    components, active = jnp.asarray(components), jnp.asarray(active)
    tau = check_tau(tau, "expand_components")
    e_new = energy(expandable_mixture, x_new[None], components, active, precision)
    poison = nan_factor(tau)
    e_new = e_new * poison
    components, active, _ = add_component(components, active, x_new, e_new > tau)
    if jnp.issubdtype(components.dtype, jnp.floating):
        components = components * poison
    return components, active, e_new
