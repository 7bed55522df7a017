r"""The Markov kernel: forward-backward over a chain of edges as two ``lax.scan`` passes.

$$
\alpha_0 = a, \quad
\alpha_t(j) = \log \sum_i e^{\alpha_{t-1}(i) + \psi_t(i, j)}, \qquad
\beta_{T-1} = 0, \quad
\beta_t(i) = \log \sum_j e^{\psi_{t+1}(i, j) + \beta_{t+1}(j)},
$$

$$
\log Z = \log \sum_j e^{\alpha_{T-1}(j)}, \qquad
p(\phi_t = j \mid x) = e^{\alpha_t(j) + \beta_t(j) - \log Z}, \qquad
y_t = \sum_j p(\phi_t = j \mid x)\, F_t(j).
$$

The forward scan keeps $\alpha$ ``(T, K)``; the backward scan computes $\beta$ and each
step's output on the fly (no ``(T, K)`` marginals unless asked for). Cost
$O(T K^2)$ time, $O(T K)$ memory besides the factors. Log-space throughout, with a
``logsumexp`` whose gradient is zero (not NaN) where every term is $-\infty$: a forbidden
move ($\psi = -\infty$) is exact, and a chain with no allowed path gives $\log Z = -\infty$
and NaN marginals (as the exact engine does), never a finite number.

Reached through [`attention`][structinfer.lowering.attention] (kernel ``"markov_scan"``)
for a model whose edge has a [`Markov`][structinfer.priors.Markov] prior; the factors
come from [`structinfer.exact.chain_factors`][structinfer.exact.chain_factors].

Reference: Rabiner (1989), the forward-backward algorithm in log space; torch-struct's
``LinearChain`` computes the same marginals as the gradient of $\log Z$.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._spec import accum_dtype

__all__ = ["markov_scan", "logsumexp0"]


def logsumexp0(x: jax.Array, axis: int) -> jax.Array:
    r"""$\log \sum e^{x}$ over ``axis``: $-\infty$ with a zero gradient where every term is
    $-\infty$ (``jax.nn.logsumexp`` differentiates $\log 0$ to NaN there).

    Args:
        x: log-terms; ``-inf`` allowed.
        axis: the axis summed over.

    Returns:
        ``x`` reduced over ``axis``.
    """
    m = jnp.max(x, axis=axis, keepdims=True)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    s = jnp.sum(jnp.exp(x - m), axis=axis)
    pos = s > 0
    out = jnp.log(jnp.where(pos, s, 1.0)) + jnp.squeeze(m, axis)
    return jnp.where(pos, out, -jnp.inf)


def markov_scan(
    initial: jax.Array,
    pair: jax.Array,
    table: jax.Array | None = None,
    *,
    precision: jax.lax.PrecisionLike = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Forward-backward over one chain: the expected value per step (or the marginals) and $\log Z$.

    Args:
        initial: $a$, ``(K,)``, log-factor of the first state.
        pair: $\psi_t$, ``(T - 1, K, K)`` (previous, next), log-factor of step $t$;
            ``-inf`` forbids a move.
        table: $F_t(j)$, ``(T, K, dv)``, the value at step $t$ when the edge takes state
            $j$; ``None`` returns the marginals.
        precision: the precision of the $p \cdot F$ product (``jax.lax.dot_general``'s).

    Returns:
        ``(y, log_z)``: $y$ ``(T, dv)`` in the accumulation dtype (or the marginals
            ``(T, K)``), $\log Z$ a scalar (without the chain's constant factors). NaN
            rows where $\log Z$ is not finite. Jittable, vmappable, differentiable
            (reverse mode through both scans).
    """
    dtype = accum_dtype(jnp.result_type(initial, pair))
    if table is not None:
        dtype = jnp.promote_types(dtype, accum_dtype(table.dtype))
    a0 = jnp.asarray(initial, dtype)
    pair = jnp.asarray(pair, dtype)

    def forward(alpha, psi):
        alpha = logsumexp0(alpha[:, None] + psi, 0)
        return alpha, alpha

    last, alphas = lax.scan(forward, a0, pair)
    log_z = logsumexp0(last, 0)
    alphas = jnp.concatenate([a0[None], alphas], 0)  # (T, K)

    def read(alpha, beta, f):
        p = jnp.exp(alpha + beta - log_z)
        return p if f is None else jnp.dot(p, f, precision=precision)

    ft = None if table is None else jnp.asarray(table, dtype)

    def backward(beta, xs):
        psi, alpha, f = xs  # psi: from step t to t + 1
        beta = logsumexp0(psi + beta[None, :], 1)
        return beta, read(alpha, beta, f)

    zero = jnp.zeros_like(a0)
    last_y = read(alphas[-1], zero, None if ft is None else ft[-1])
    _, ys = lax.scan(backward, zero, (pair, alphas[:-1], None if ft is None else ft[:-1]),
                     reverse=True)
    return jnp.concatenate([ys, last_y[None]], 0), log_z
