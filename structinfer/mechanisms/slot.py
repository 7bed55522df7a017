r"""Slot attention: the softmax is over latent slots (Singh & Buckley sec. 4.3,
Table 1 row 8; Tschantz v2 sec. 4)."""

from __future__ import annotations

import jax
import numpyro

from .. import priors, scores
from .._checks import check_static_int
from ..primitives import edge
from ._common import check_matrix, features, latent_nodes

__all__ = ["slot_attention"]


def slot_attention(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    num_slots: int,
    node_potential: bool = True,
    slot_dim: int | None = None,
) -> None:
    r"""Slot attention: each observed token takes one latent slot as its parent.

    Graph:
        observed tokens $x_1..x_N$, latent slots $z_1..z_S$ (site ``slots``);
        one edge site per token.

    Prior:
        uniform over the latent nodes, $\phi_j \sim \mathrm{Uniform}\{z_1..z_S\}$ —
        the prior of the Hopfield network with its roles swapped, so the softmax runs
        over slots.

    Potentials:
        edge $\psi(x_j, z_i) = z_i^\top W_Q^\top W_K x_j = (W_K x_j)^\top (W_Q z_i)$;
        node $-\tfrac12\|z_i\|^2$ (``node_potential=True``) or none.

    Value:
        $\partial F/\partial z$; the CCCP fixed point (Singh & Buckley eq. 8) is
        $\mu_i^* = \sum_j \mathrm{softmax}_i(\mu_i^\top W_Q^\top W_K x_j) W_Q^\top W_K x_j$.

    Args:
        x: tokens ``(N, d)``.
        wq: slot projection $W_Q$, ``(d_k, d_z)``.
        wk: token projection $W_K$, ``(d_k, d)``.
        num_slots: the number of slots $S$.
        node_potential: add the unit quadratic node potential on slots.
        slot_dim: ``d_z``, the slots' feature size (default ``d``, the tokens').

    Sites:
        ``slots`` (latent ``(S, d_z)``: give it a value), ``phi`` (edge, children = tokens).

    Reference:
        Singh & Buckley sec. 4.3; Locatello et al. "Object-centric learning with slot
        attention"; Tschantz v2 sec. 4 (eqs. 9-11).
    """
    x = features(x, "x", "slot_attention")
    d = x.shape[-1]
    check_static_int(num_slots, "num_slots", "slot_attention")
    dz = d if slot_dim is None else check_static_int(slot_dim, "slot_dim", "slot_attention")
    check_matrix(wq, "wq", "slot_attention", dz)
    check_matrix(wk, "wk", "slot_attention", d)
    slots = latent_nodes("slots", (num_slots, dz), 1.0 if node_potential else None, x.dtype)
    with numpyro.plate("tokens", x.shape[-2]):
        edge("phi", priors.Uniform(num_slots), scores.Dot(x @ wk.T, slots @ wq.T))
