r"""Self attention over a directed graph (Singh & Buckley appendix 8.1, Table 1 row 2)."""

from __future__ import annotations

import jax
import numpy as np
import numpyro

from .. import priors, scores
from ..primitives import edge
from ._common import check_matrix, features, project

__all__ = ["self_attention", "self_prior"]


def self_prior(n: int, include_self: bool = True, causal: bool = False) -> priors.StructuralPrior:
    """The structural prior of self attention on ``n`` nodes.

    Uniform over all nodes; without the self-edge a ``Restricted`` prior that forbids
    :math:`\\phi_i = i`; ``causal`` also forbids later nodes.
    """
    if causal:
        return priors.Restricted.causal(n, include_self=include_self)
    if include_self:
        return priors.Uniform(n)
    if n < 2:
        raise ValueError("self_attention: without the self-edge it needs at least 2 nodes")
    return priors.Restricted(~np.eye(n, dtype=bool), pattern=priors.Mask("no_self"))


def self_attention(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array | None = None,
    include_self: bool = True,
    causal: bool = False,
    scale: float | None = None,
) -> None:
    r"""Self attention: every node takes one parent among the same nodes (directed edges).

    Graph:
        nodes :math:`K = Q = (x_1, \dots, x_n)`, directed edges; one edge site
        :math:`\phi_i` per node.
    Prior:
        uniform over :math:`\{1..n\}` (``include_self=False``: over :math:`j \ne i`;
        ``causal=True``: over :math:`j \le i`, or :math:`j < i`).
    Potentials:
        :math:`\psi(x_i, x_j) = s\, x_i^\top W_Q^\top W_K x_j`.
    Value:
        :math:`v_i = W_V x_{\phi_i}`; :math:`\mathbb E[v_i] = \sum_j \mathrm{softmax}_j(\psi_{ij} + \log p(\phi_i=j)) W_V x_j`.

    As an energy (Tschantz v2 sec. 5) every node is both a child and a parent, so
    :math:`-\partial E/\partial x_i` is the sum of a child part and a parent part
    (v2 eq. 13).

    Args:
        x: nodes ``(n, d_in)``.
        wq, wk: projections ``(d_k, d_in)``; wv: value projection ``(d_v, d_in)`` or ``None``.
        include_self: allow the self-edge :math:`\phi_i = i`.
        causal: only earlier nodes (and itself when ``include_self``) are parents;
            without the self-edge the first node has no parent and is an error.
        scale: optional score multiplier.

    Sites:
        ``phi`` (edge), ``out`` (deterministic value).

    Reference:
        Singh & Buckley appendix 8.1; Tschantz v2 sec. 5 (eqs. 12-13).
    """
    x = features(x, "x", "self_attention")
    check_matrix(wq, "wq", "self_attention", x.shape[-1])
    check_matrix(wk, "wk", "self_attention", x.shape[-1])
    values = project(
        x, None if wv is None else check_matrix(wv, "wv", "self_attention", x.shape[-1])
    )
    n = x.shape[-2]
    with numpyro.plate("nodes", n):
        phi = edge(
            "phi", self_prior(n, include_self, causal), scores.Bilinear(x, x, wq, wk, scale=scale)
        )
        numpyro.deterministic("out", values[phi])
