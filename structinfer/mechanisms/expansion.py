r"""Bayesian model expansion: add a parent when a new child is poorly explained
(Tschantz slides "Bayesian model expansion")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro

from .. import priors, scores
from ..exact import energy
from ..primitives import edge
from ._common import features

__all__ = ["expandable_mixture", "expand_components"]


def expandable_mixture(
    x: jax.Array, components: jax.Array, active: jax.Array, precision: float = 1.0
) -> None:
    r"""A mixture over a fixed-capacity buffer of components, of which some are active.

    Graph:
        child data :math:`x_{1..N}`, parent components :math:`z_{1..K_{\max}}`, of which the
        ``active`` ones can be chosen.
    Prior:
        uniform restricted to the active components.
    Potentials:
        :math:`\mathrm{sim}(x_i, z_k) = -\tfrac\lambda2 \|x_i - z_k\|^2`.
    Value:
        the per-child energy :math:`E_i = -\ln\sum_{k\ \mathrm{active}} \exp(\mathrm{sim}(x_i,
        z_k)) + \ln K_{\mathrm{active}}`, which :func:`expand_components` compares with
        a threshold :math:`\tau`.

    Args:
        x: ``(N, d)``; components: ``(K_max, d)``; active: boolean ``(K_max,)`` (may be traced);
        precision: :math:`\lambda`.

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


def expand_components(
    x_new: jax.Array,
    components: jax.Array,
    active: jax.Array,
    tau: float,
    precision: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""One model-expansion step: if the new point's energy exceeds :math:`\tau`, activate the
    first free component at :math:`z_{K+1} = x_{N+1}`.

    .. math:: E_{N+1} = -\ln \sum_k p(\phi = k)\, e^{\mathrm{sim}(x_{N+1}, z_k)} > \tau
        \;\Rightarrow\; z_{K+1} \leftarrow x_{N+1}

    The energy is that of :func:`expandable_mixture` for the single point, computed by the
    exact engine (it includes the prior's :math:`\ln K_{\mathrm{active}}`). Jittable: the
    buffer has a fixed capacity; when it is full nothing is added.

    Args:
        x_new: the new point ``(d,)``; components ``(K_max, d)``; active: boolean ``(K_max,)``;
        tau: threshold; precision: :math:`\lambda`.

    Returns:
        ``(components, active, energy_new)`` after the step.
    """
    x_new = jnp.asarray(x_new)
    if x_new.ndim != 1:
        raise ValueError(f"expand_components: x_new must be one point (d,), got {x_new.shape}")
    e_new = energy(expandable_mixture, x_new[None], components, active, precision)
    free = ~active
    grow = (e_new > tau) & jnp.any(free)
    slot = jnp.argmax(free)
    components = jnp.where(grow, components.at[slot].set(x_new), components)
    active = jnp.where(grow, active.at[slot].set(True), active)
    return components, active, e_new
