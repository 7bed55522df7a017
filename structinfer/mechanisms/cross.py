r"""Cross attention as structural inference (Singh & Buckley sec. 3.2, Table 1 row 1)."""

from __future__ import annotations

import jax
import numpyro

from .. import priors, scores
from ..primitives import edge
from ._common import check_matrix, features, project

__all__ = ["cross_attention"]


def cross_attention(
    xq: jax.Array,
    xk: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array | None = None,
    scale: float | None = None,
) -> None:
    r"""Cross attention: each query node takes one key node as its parent.

    Graph:
        key nodes $K = (x_1, \dots, x_m)$, query nodes $Q = (x'_1, \dots, x'_n)$;
        one edge site $\phi_i$ per query, from a key to the query.

    Prior:
        uniform, $p(\phi_i = j) = 1/m$.

    Potentials:
        $\psi(x'_i, x_j) = s\, x_i'^\top W_Q^\top W_K x_j$.

    Value:
        $v_i = W_V x_{\phi_i}$, so that
        $\mathbb E[v_i] = \sum_j \mathrm{softmax}_j(s\, x_i'^\top W_Q^\top W_K x_j)\, W_V x_j$.

    The collapsed energy is Tschantz's cross-attention energy (v2 eq. 29) plus the
    constant $n \log m$ of the uniform prior.

    Args:
        xq: query nodes ``(n, d_in)``.
        xk: key nodes ``(m, d_in)``.
        wq: query projection $W_Q$, ``(d_k, d_in)`` (applied as ``x @ w.T``).
        wk: key projection $W_K$, ``(d_k, d_in)``.
        wv: value projection $W_V$, ``(d_v, d_in)``; ``None`` uses the keys themselves.
        scale: optional score multiplier $s$ (``1/sqrt(d_k)`` for a transformer).

    Sites:
        ``phi`` (edge, children = queries), ``out`` (deterministic value).

    Reference:
        Singh & Buckley, "Attention as implicit structural inference", sec. 3.2;
        Tschantz, "Attention via log-sum-exp energy" v2 sec. 9.
    """
    xq = features(xq, "xq", "cross_attention")
    xk = features(xk, "xk", "cross_attention")
    check_matrix(wq, "wq", "cross_attention", xq.shape[-1])
    check_matrix(wk, "wk", "cross_attention", xk.shape[-1])
    values = project(
        xk, None if wv is None else check_matrix(wv, "wv", "cross_attention", xk.shape[-1])
    )
    with numpyro.plate("queries", xq.shape[-2]):
        phi = edge(
            "phi", priors.Uniform(xk.shape[-2]), scores.Bilinear(xq, xk, wq, wk, scale=scale)
        )
        numpyro.deterministic("out", values[phi])
