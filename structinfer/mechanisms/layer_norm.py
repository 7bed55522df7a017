r"""Layer normalisation as the gradient of an energy (Tschantz v1 sec. 9 / v2 sec. 11)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro

from ._common import features

__all__ = ["layer_norm_energy"]


def layer_norm_energy(x: jax.Array, gamma: jax.Array, delta: jax.Array, eps: float = 1e-5) -> None:
    r"""The layer-norm energy, whose gradient is the LayerNorm output.

    Graph:
        nodes $x_{1..B} \in \mathbb R^D$, no edges (a node potential only).

    Prior:
        none (no edge sites).

    Potentials:
        $E^{\mathrm{LN}}(x) = \sum_i \big[D\gamma\sqrt{\tfrac1D\sum_j (x_{ij}-\bar x_i)^2
        + \epsilon} + \sum_j \delta_j x_{ij}\big]$, added as ``numpyro.factor`` $-E$.

    Value:
        $\partial E/\partial x_{ij} = \gamma \frac{x_{ij} - \bar x_i}{\sqrt{\frac1D\sum_k
        (x_{ik}-\bar x_i)^2 + \epsilon}} + \delta_j$, the LayerNorm output.

    The papers print the energy without the factor $D$ and with a vector
    $\gamma$; the gradient they state needs the factor $D$, and only a scalar
    $\gamma$ makes it a gradient field (as in Hoover et al.'s Energy Transformer).

    Args:
        x: nodes ``(B, D)``.
        gamma: the scalar scale $\gamma$.
        delta: the bias $\delta$, ``(D,)``.
        eps: the variance offset $\epsilon$.

    Sites:
        ``layer_norm`` (factor).

    Reference:
        Tschantz v2 sec. 11.
    """
    x = features(x, "x", "layer_norm_energy")
    gamma = jnp.asarray(gamma)
    if gamma.ndim != 0:
        raise ValueError(
            f"layer_norm_energy: gamma must be a scalar (a vector gamma has no energy), got shape {gamma.shape}"
        )
    if jnp.shape(delta) != (x.shape[-1],):
        raise ValueError(
            f"layer_norm_energy: delta must be ({x.shape[-1]},), got {tuple(jnp.shape(delta))}"
        )
    D = x.shape[-1]
    centred = x - jnp.mean(x, -1, keepdims=True)
    sd = jnp.sqrt(jnp.mean(centred * centred, -1) + eps)
    numpyro.factor("layer_norm", -(jnp.sum(D * gamma * sd) + jnp.sum(x * delta)))
