r"""Expanding attention: a geometric recency prior with a Beta hyperprior
(Singh & Buckley sec. 5.2, appendix 7.3, Algorithm 3, Table 1 row 12)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from .. import priors, scores
from ..primitives import edge
from ._common import check_matrix, features, project

__all__ = ["expanding_attention"]


def expanding_attention(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array | None,
    alpha: float,
    beta: float,
) -> None:
    r"""Expanding attention: attend to earlier nodes with a geometric prior on the distance.

    Graph:
        nodes $x_1..x_n$, edges to earlier nodes (and the node itself); one edge
        site per node.

    Prior:
        geometric × Beta: $q \sim \mathrm{Beta}(\alpha, \beta)$ (site ``q``),
        $p(\phi_i = j \mid q) \propto q (1-q)^{i-j}$ for $j \le i$ (truncated to the
        available nodes and renormalised).

    Potentials:
        $\psi(x_i, x_j) = x_i^\top W_Q^\top W_K x_j$.

    Value:
        $v_i = W_V x_{\phi_i}$; also the distance $d_i = i - \phi_i$, whose posterior
        mean drives the conjugate mean-field update
        $\beta \leftarrow \beta + \mathbb E[d]$, $\alpha \leftarrow \alpha + 1$.

    Given a value for ``q`` the engine returns $p(\phi \mid x, q)$ (step 2 of the
    paper's update), $\mathbb E[d]$ (step 3) and the exact collapsed
    $\log p(x, q)$; the mean-field loop itself lives in ``structinfer.infer``.

    Args:
        x: nodes ``(n, d_in)``.
        wq: query projection $W_Q$, ``(d_k, d_in)``.
        wk: key projection $W_K$, ``(d_k, d_in)``.
        wv: value projection $W_V$, ``(d_v, d_in)``, or ``None`` for the nodes themselves.
        alpha: Beta hyperprior parameter $\alpha > 0$.
        beta: Beta hyperprior parameter $\beta > 0$.

    Sites:
        ``q`` (latent in (0, 1): give it a value), ``phi`` (edge), ``out`` and
        ``distance`` (deterministic).

    Reference:
        Singh & Buckley sec. 5.2 and appendix 7.3 ("Expanding Derivation").
    """
    x = features(x, "x", "expanding_attention")
    check_matrix(wq, "wq", "expanding_attention", x.shape[-1])
    check_matrix(wk, "wk", "expanding_attention", x.shape[-1])
    values = project(
        x, None if wv is None else check_matrix(wv, "wv", "expanding_attention", x.shape[-1])
    )
    n = x.shape[-2]
    q = numpyro.sample("q", dist.Beta(alpha, beta))
    with numpyro.plate("nodes", n):
        phi = edge("phi", priors.Geometric(q, n), scores.Bilinear(x, x, wq, wk))
        numpyro.deterministic("out", values[phi])
        numpyro.deterministic("distance", (jnp.arange(n) - phi).astype(x.dtype))
