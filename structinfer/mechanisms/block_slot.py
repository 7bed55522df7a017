r"""Block-slot attention: slot attention combined with an associative memory
(Singh & Buckley appendix 8.2.1, Table 1 row 9; Tschantz slides "Block-slot attention")."""

from __future__ import annotations

import jax
import numpyro

from .. import priors, scores
from .._checks import check_static_int
from ..primitives import edge
from ._common import check_matrix, features, latent_nodes

__all__ = ["block_slot_attention", "block_slot_energy"]


def block_slot_attention(
    x: jax.Array,
    memories: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    num_slots: int,
    node_potential: bool = True,
) -> None:
    r"""Block-slot attention (Singh & Buckley): tokens choose slots, slot blocks choose memories.

    Graph:
        observed tokens $X = x_{1..N}$, latent slots $Z = z_{1..S}$ (site ``slots``),
        memory nodes $M$; each slot is cut into $B$ blocks $z_i^{(b)}$ and
        block $b$ reaches only its own memories $m^{(b)}_{1..L}$
        (``memories`` of shape ``(B, L, d/B)``; ``(L, d)`` means one block).

    Prior:
        uniform over the latent nodes for each token ($E_j$, softmax over slots) and
        uniform over the block's memories for each slot block ($\tilde E_{i,b}$).

    Potentials:
        $\psi(x_j, z_i) = z_i^\top W_Q^\top W_K x_j$, $\psi(z_i^{(b)}, m^{(b)}_k) =
        z_i^{(b)} \cdot m^{(b)}_k$; node $-\tfrac12\|z_i\|^2$ (``node_potential=True``).

    Value:
        $\partial F/\partial z$; the fixed point (eq. 8) is
        $\mu_i^* = \sum_j \mathrm{softmax}_i(\mu_i^\top W_Q^\top W_K x_j) W_Q^\top W_K x_j
        + \sum_{k,b} \mathrm{softmax}_k(\mu_i^{(b)} \cdot m_k^{(b)})\, m_k^{(b)}$.

    The appendix writes the memory prior as one edge per memory node over slots, but
    the update it derives (a softmax over memories $k$ for each slot) is that of
    one edge per slot (block) over memories; the model follows the update.

    Args:
        x: tokens ``(N, d)``.
        memories: memory blocks ``(B, L, d/B)``, or ``(L, d)`` for one block.
        wq: slot projection $W_Q$, ``(d_k, d)``.
        wk: token projection $W_K$, ``(d_k, d)``.
        num_slots: the number of slots $S$.
        node_potential: add the unit quadratic node potential on slots.

    Sites:
        ``slots`` (latent ``(S, d)``), ``token_slot`` (edge, children = tokens),
        ``slot_memory`` (edge, children = (block, slot) pairs).

    Reference:
        Singh & Buckley appendix 8.2.1; G. Singh et al. "Neural block-slot representations".
    """
    x = features(x, "x", "block_slot_attention")
    memories = features(memories, "memories", "block_slot_attention")
    if memories.ndim == 2:
        memories = memories[None]
    d = x.shape[-1]
    nb, nl, db = memories.shape
    if nb * db != d:
        raise ValueError(
            f"block_slot_attention: memories {tuple(memories.shape)} = (blocks, memories, "
            f"block size) must tile the slot size {d} (blocks * block size == {d})"
        )
    check_static_int(num_slots, "num_slots", "block_slot_attention")
    check_matrix(wq, "wq", "block_slot_attention", d)
    check_matrix(wk, "wk", "block_slot_attention", d)
    slots = latent_nodes("slots", (num_slots, d), 1.0 if node_potential else None, x.dtype)
    with numpyro.plate("tokens", x.shape[-2]):
        edge("token_slot", priors.Uniform(num_slots), scores.Dot(x @ wk.T, slots @ wq.T))
    blocks = slots.reshape(num_slots, nb, db).swapaxes(0, 1)  # (B, S, db)
    with numpyro.plate("blocks", nb, dim=-2), numpyro.plate("slots_", num_slots, dim=-1):
        edge("slot_memory", priors.Uniform(nl), scores.Dot(blocks, memories))


def block_slot_energy(
    x: jax.Array,
    memories: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    num_slots: int,
) -> None:
    r"""Block-slot attention as a sum of two log-sum-exp energies (Tschantz's slides).

    Graph:
        child tokens $x_{1..N}$, two parent sets: slots $z_{1..K}$ (latent site
        ``slots``, no node potential) and memories $m_{1..M}$.

    Prior:
        two edge sites per token, uniform over slots and uniform over memories.

    Potentials:
        $\mathrm{sim}_z(x_i, z_k) = (W_K x_i)^\top (W_Q z_k)$,
        $\mathrm{sim}_m(x_i, m_\mu) = x_i^\top m_\mu$.

    Value:
        the energy $E = -\sum_i \mathrm{lse}_k\,\mathrm{sim}_z - \sum_i \mathrm{lse}_\mu\,
        \mathrm{sim}_m$ and its gradients: $-\partial E/\partial x_i = \sum_k \alpha_{ik}
        W_K^\top W_Q z_k + \sum_\mu \beta_{i\mu} m_\mu$, $-\partial E/\partial z_k = \sum_i
        \alpha_{ik} W_Q^\top W_K x_i$, $-\partial E/\partial m_\mu = \sum_i \beta_{i\mu} x_i$.

    Args:
        x: tokens ``(N, d)``.
        memories: memory nodes $m_\mu$, ``(M, d)``.
        wq: slot projection $W_Q$, ``(d_k, d)``.
        wk: token projection $W_K$, ``(d_k, d)``.
        num_slots: the number of slots $K$.

    Sites:
        ``slots`` (latent ``(K, d)``), ``slot`` and ``memory`` (edges, children = tokens).

    Reference:
        Tschantz, "Attention via log-sum-exp energy", slides: "Block-slot Attention".
    """
    x = features(x, "x", "block_slot_energy")
    memories = features(memories, "memories", "block_slot_energy")
    d = x.shape[-1]
    if memories.shape[-1] != d:
        raise ValueError(
            f"block_slot_energy: memories {tuple(memories.shape)} must have feature size {d}"
        )
    check_static_int(num_slots, "num_slots", "block_slot_energy")
    check_matrix(wq, "wq", "block_slot_energy", d)
    check_matrix(wk, "wk", "block_slot_energy", d)
    slots = latent_nodes("slots", (num_slots, d), None, x.dtype)
    with numpyro.plate("tokens", x.shape[-2]):
        edge("slot", priors.Uniform(num_slots), scores.Dot(x @ wk.T, slots @ wq.T))
        edge("memory", priors.Uniform(memories.shape[-2]), scores.Dot(x, memories))
