r"""Multi-hop attention: the value follows a chain of edges (Singh & Buckley sec. 5.1,
appendix 7.3, Algorithm 2, Table 1 row 11)."""

from __future__ import annotations

import jax
import numpyro

from .. import priors, scores
from .._checks import check_static_int
from ..primitives import edge
from ._common import check_matrix, features, project

__all__ = ["multihop_attention"]


def multihop_attention(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array | None = None,
    hops: int = 2,
) -> None:
    r"""Multi-hop attention written as a chain of edge sites.

    Graph:
        nodes $K = Q = (x_1..x_n)$, directed edges. Hop 1 is node $i$'s edge
        $\phi_i$; hop $h+1$ is the edge of the node hop $h$ reached,
        $\phi_{\phi_i}$ (``si.edge(..., child=previous)``).

    Prior:
        uniform.

    Potentials:
        $\psi(x_i, x_j) = x_i^\top W_Q^\top W_K x_j$.

    Value:
        $v_i = V x_{\phi_i} + V x_{\phi_{\phi_i}} + \dots$ (``hops`` terms), whose
        expectation is $(P + P^2 + \dots + P^{N}) V X$ with $P$ the attention
        matrix; two hops give $(P + P^2) V X$.

    Algorithm 2 of the paper writes $\sum_{k<N} A^k$; its sum starts at $k=1$
    (the two-hop case of sec. 5.1 is $P + P^2$).

    Args:
        x: nodes ``(n, d_in)``.
        wq: query projection $W_Q$, ``(d_k, d_in)``.
        wk: key projection $W_K$, ``(d_k, d_in)``.
        wv: value projection $V$, ``(d_v, d_in)``, or ``None`` for the nodes themselves.
        hops: number of hops $N \ge 1$.

    Sites:
        ``hop1 .. hop{N}`` (edges), ``out{h}`` (the value after ``h`` hops) and ``out``
        (all hops; deterministic).

    Reference:
        Singh & Buckley sec. 5.1 and appendix 7.3.
    """
    x = features(x, "x", "multihop_attention")
    check_static_int(hops, "hops", "multihop_attention")
    if hops < 1:
        raise ValueError(f"multihop_attention: hops must be >= 1, got {hops}")
    check_matrix(wq, "wq", "multihop_attention", x.shape[-1])
    check_matrix(wk, "wk", "multihop_attention", x.shape[-1])
    values = project(
        x, None if wv is None else check_matrix(wv, "wv", "multihop_attention", x.shape[-1])
    )
    n = x.shape[-2]
    prior, score = priors.Uniform(n), scores.Bilinear(x, x, wq, wk)
    with numpyro.plate("nodes", n):
        j = edge("hop1", prior, score)
        out = values[j]
        numpyro.deterministic("out1", out)
        for h in range(2, hops + 1):
            j = edge(f"hop{h}", prior, score, child=j)
            out = out + values[j]
            numpyro.deterministic(f"out{h}", out)
        numpyro.deterministic("out", out)
