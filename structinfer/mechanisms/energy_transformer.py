r"""The energy transformer: self attention plus a Hopfield memory over the same tokens
(Tschantz slides "Energy Transformer")."""

from __future__ import annotations

import jax
import numpyro

from .. import priors, scores
from ..primitives import edge
from ._common import check_matrix, features

__all__ = ["energy_transformer"]


def energy_transformer(x: jax.Array, memories: jax.Array, wq: jax.Array, wk: jax.Array) -> None:
    r"""Energy transformer: every token attends to all tokens and to a memory.

    Graph:
        token nodes $x_{1..N}$ (each a child and a parent of the self term) and memory
        nodes $m_{1..M}$; two edge sites per token.

    Prior:
        uniform over tokens (self term) and uniform over memories (memory term).

    Potentials:
        $\mathrm{sim}_{\mathrm{self}}(x_i, x_j) = (W^Q x_i)^\top (W^K x_j)$,
        $\mathrm{sim}_{\mathrm{memory}}(x_i, m_\mu) = x_i^\top m_\mu$.

    Value:
        $-\partial E/\partial x_i = \sum_j a_{ij} W^{Q\top}W^K x_j + \sum_c a_{ci}
        W^{K\top}W^Q x_c + \sum_\mu h_{i\mu} m_\mu$ — the self term's child and parent parts
        (v2 eq. 13) plus the Hopfield term.

    Args:
        x: tokens ``(N, d)``.
        memories: memory nodes $m_\mu$, ``(M, d)``.
        wq: query projection $W^Q$, ``(d_k, d)``.
        wk: key projection $W^K$, ``(d_k, d)``.

    Sites:
        ``self`` and ``memory`` (edges, children = tokens).

    Reference:
        Tschantz slides "Energy Transformer"; Hoover et al. "Energy transformer".
    """
    x = features(x, "x", "energy_transformer")
    memories = features(memories, "memories", "energy_transformer")
    check_matrix(wq, "wq", "energy_transformer", x.shape[-1])
    check_matrix(wk, "wk", "energy_transformer", x.shape[-1])
    n = x.shape[-2]
    with numpyro.plate("tokens", n):
        edge("self", priors.Uniform(n), scores.Dot(x @ wq.T, x @ wk.T))
        edge("memory", priors.Uniform(memories.shape[-2]), scores.Dot(x, memories))
