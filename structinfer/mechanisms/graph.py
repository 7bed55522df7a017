r"""Graph and sparse attention: a uniform prior restricted to allowed edges
(Singh & Buckley appendix 8.2, Table 1 row 3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro

from .. import priors, scores
from .._checks import check_static_int
from ..primitives import edge
from ._common import check_matrix, features, project

__all__ = ["graph_attention", "sparse_attention"]


def graph_attention(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array | None,
    adjacency: jax.Array,
    self_loops: bool = False,
) -> None:
    r"""Graph attention: each node takes one parent among its neighbours in a given graph.

    Graph:
        nodes $x_1..x_n$ with a given adjacency $A$ (``adjacency[i, j] != 0``
        when $j \to i$ is an edge); one edge site per node.

    Prior:
        uniform restricted to the graph, $p(\phi_i = j) = A_{ij} / \sum_{j'} A_{ij'}$.

    Potentials:
        $\psi(x_i, x_j) = x_i^\top W_Q^\top W_K x_j$.

    Value:
        $v_i = W_V x_{\phi_i}$; $\mathbb E[v_i] = \sum_{j \in N(i)} \mathrm{softmax}_{j \in N(i)}(\psi_{ij}) W_V x_j$.

    Args:
        x: nodes ``(n, d_in)``.
        wq: query projection $W_Q$, ``(d_k, d_in)``.
        wk: key projection $W_K$, ``(d_k, d_in)``.
        wv: value projection $W_V$, ``(d_v, d_in)``, or ``None`` for the nodes themselves.
        adjacency: ``(n, n)`` array $A$ (bool or 0/1 weights).
        self_loops: also allow $\phi_i = i$.

    Sites:
        ``phi`` (edge), ``out`` (deterministic value).

    Reference:
        Singh & Buckley appendix 8.2 ("graph and sparse attention ... the uniform prior
        is restricted to edges in the provided graph").
    """
    x = features(x, "x", "graph_attention")
    adj = jnp.asarray(adjacency) != 0  # may arrive as a (constant) JAX array under jit
    n = x.shape[-2]
    if adj.shape != (n, n):
        raise ValueError(
            f"graph_attention: adjacency must be ({n}, {n}) for {n} nodes, got {adj.shape}"
        )
    check_matrix(wq, "wq", "graph_attention", x.shape[-1])
    check_matrix(wk, "wk", "graph_attention", x.shape[-1])
    values = project(
        x, None if wv is None else check_matrix(wv, "wv", "graph_attention", x.shape[-1])
    )
    with numpyro.plate("nodes", n):
        if self_loops:
            adj = adj | jnp.eye(n, dtype=bool)
        prior = priors.Restricted(adj, pattern=priors.Graph())
        phi = edge("phi", prior, scores.Bilinear(x, x, wq, wk))
        numpyro.deterministic("out", values[phi])


def sparse_attention(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array | None,
    window: int | None = None,
    block_mask: jax.Array | None = None,
    block_size: int | None = None,
    causal: bool = True,
) -> None:
    r"""Sparse attention: the uniform prior restricted to a fixed sparsity pattern.

    Graph:
        nodes $x_1..x_n$, directed edges allowed by a pattern: a sliding window
        ($0 \le i - j < w$, or $|i-j| < w$ when not causal) or a block mask.

    Prior:
        uniform over the allowed parents (``Restricted.window`` / ``Restricted.block_sparse``,
        which keep the pattern for the lowered engine).

    Potentials:
        $\psi(x_i, x_j) = x_i^\top W_Q^\top W_K x_j$.

    Value:
        $v_i = W_V x_{\phi_i}$.

    Args:
        x: nodes ``(n, d_in)``.
        wq: query projection $W_Q$, ``(d_k, d_in)``.
        wk: key projection $W_K$, ``(d_k, d_in)``.
        wv: value projection $W_V$, ``(d_v, d_in)``, or ``None`` for the nodes themselves.
        window: window size $w$ (give either ``window`` or ``block_mask``).
        block_mask: ``(n / b, n / b)`` boolean block pattern.
        block_size: the block size $b$ (with ``block_mask``).
        causal: window only over earlier nodes (and itself).

    Sites:
        ``phi`` (edge), ``out`` (deterministic value).

    Reference:
        Singh & Buckley appendix 8.2, Table 1 row 3 ("Uniform (restricted)").
    """
    x = features(x, "x", "sparse_attention")
    n = x.shape[-2]
    if (window is None) == (block_mask is None):
        raise ValueError("sparse_attention: give exactly one of `window` or `block_mask`")
    if window is not None:
        check_static_int(window, "window", "sparse_attention")
        prior = priors.Restricted.window(n, window, causal=causal)
    else:
        if block_size is None:
            raise ValueError("sparse_attention: `block_mask` needs `block_size`")
        check_static_int(block_size, "block_size", "sparse_attention")
        prior = priors.Restricted.block_sparse(block_mask, block_size)
        shape = tuple(block_size * s for s in prior.blocks.shape)
        if shape != (n, n):
            raise ValueError(
                f"sparse_attention: block_mask {tuple(prior.blocks.shape)} x block_size "
                f"{block_size} gives a {shape} pattern, expected ({n}, {n})"
            )
    check_matrix(wq, "wq", "sparse_attention", x.shape[-1])
    check_matrix(wk, "wk", "sparse_attention", x.shape[-1])
    values = project(
        x, None if wv is None else check_matrix(wv, "wv", "sparse_attention", x.shape[-1])
    )
    with numpyro.plate("nodes", n):
        phi = edge("phi", prior, scores.Bilinear(x, x, wq, wk))
        numpyro.deterministic("out", values[phi])
