r"""The modern continuous Hopfield network (Singh & Buckley sec. 4.2, Table 1 row 7;
Tschantz v2 sec. 3)."""

from __future__ import annotations

import jax
import numpyro

from .. import priors, scores
from .._checks import check_static_int, require
from ..primitives import edge
from ._common import features, latent_nodes

__all__ = ["hopfield"]


def hopfield(
    memories: jax.Array,
    num_states: int,
    beta: float = 1.0,
    node_potential: bool = True,
) -> None:
    r"""Hopfield retrieval: each latent state takes one stored pattern as its parent.

    Graph:
        observed memory nodes $x_1..x_N$ (``memories``), latent state nodes
        $z_1..z_S$ (site ``state``); one edge site per state.

    Prior:
        uniform over the observed nodes, $\phi_i \sim \mathrm{Uniform}\{x_1..x_N\}$.

    Potentials:
        edge $\psi(x_j, z_i) = \beta\, z_i^\top x_j$; node
        $-\tfrac\beta2 \|z_i\|^2$ (``node_potential=True``) or none.

    Value:
        $\partial F / \partial z$: with the quadratic node potential the collapsed
        free energy is $\beta$ times Ramsauer's energy,
        $F(\xi) = \tfrac\beta2\|\xi\|^2 - \mathrm{lse}(\beta X^\top \xi) + c$, and the CCCP
        fixed point (Singh & Buckley eq. 8) $\xi - \beta^{-1}\partial F/\partial \xi
        = X\,\mathrm{softmax}(\beta X^\top \xi)$ is the Hopfield update. Without it,
        $-\partial E/\partial z_i = \beta \sum_\mu \mathrm{softmax}_\mu(\beta z_i^\top x_\mu) x_\mu$
        and $-\partial E/\partial x_\mu = \beta\sum_i \mathrm{softmax}_\mu(\cdot)\, z_i$
        (Tschantz v2 eqs. 7-8).

    Args:
        memories: stored patterns ``(N, d)``.
        num_states: number of latent states (queries) ``S``.
        beta: inverse temperature $\beta > 0$ (may be traced: ``jax.jit`` / ``jax.grad``).
        node_potential: add the quadratic node potential (Singh & Buckley sec. 4.1).

    Sites:
        ``state`` (latent ``(S, d)``: give it a value), ``phi`` (edge, children = states).

    Reference:
        Singh & Buckley sec. 4.2; Ramsauer et al. "Hopfield networks is all you need";
        Tschantz v2 sec. 3.
    """
    memories = features(memories, "memories", "hopfield")
    check_static_int(num_states, "num_states", "hopfield")
    beta = require(lambda xp, b: b > 0, "hopfield: beta must be > 0, got {}", beta)
    d = memories.shape[-1]
    state = latent_nodes("state", (num_states, d), beta if node_potential else None, memories.dtype)
    with numpyro.plate("states", num_states):
        edge("phi", priors.Uniform(memories.shape[-2]), scores.Dot(state, memories, scale=beta))
