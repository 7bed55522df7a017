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

The two scans carry one ``(K,)`` vector each and keep $\hat\alpha$, $\hat\beta$
``(T, K)``; the marginals and the output are then one vectorised softmax and product.
Both recursions are shifted by their maximum at every step (the scaled forward-backward:
$\log Z$ is the sum of the shifts plus the last step's log-sum, each marginal a softmax of
$\hat\alpha_t + \hat\beta_t$), so float32 keeps its precision on long chains, where
$\alpha_t + \beta_t - \log Z$ would cancel terms of size $O(T)$. Cost
$O(T K^2)$ time, $O(T K)$ memory besides the factors in the forward (reverse mode
through the scans keeps per-step residuals of the factors' order, $O(T K^2)$). Log-space throughout, with a
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
    m = lax.stop_gradient(jnp.where(jnp.isneginf(m), 0.0, m))
    s = jnp.sum(jnp.exp(x - m), axis=axis)
    none = s == 0  # every term -inf; a NaN or +inf term gives NaN, never -inf
    out = jnp.log(jnp.where(none, 1.0, s)) + jnp.squeeze(m, axis)
    return jnp.where(none, -jnp.inf, out)


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

    Raises:
        ValueError: ``initial``, ``pair`` or ``table`` has a shape other than the above.

    Reference:
        Rabiner, "A tutorial on hidden Markov models" (1989), sec. III-A (the
        forward-backward procedure), here in log space with per-step scaling.
    """
    k = jnp.shape(initial)[0] if jnp.ndim(initial) == 1 else None
    if k is None or jnp.ndim(pair) != 3 or jnp.shape(pair)[1:] != (k, k):
        raise ValueError(f"markov_scan: expected initial (K,) and pair (T - 1, K, K), got "
                         f"initial {jnp.shape(initial)} and pair {jnp.shape(pair)}")
    if table is not None and (jnp.ndim(table) != 3 or
                              jnp.shape(table)[:2] != (jnp.shape(pair)[0] + 1, k)):
        raise ValueError(f"markov_scan: expected table (T, K, dv) = ({jnp.shape(pair)[0] + 1}, "
                         f"{k}, dv) for pair {jnp.shape(pair)}, got {jnp.shape(table)}")
    dtype = accum_dtype(jnp.result_type(initial, pair))
    if table is not None:
        dtype = jnp.promote_types(dtype, accum_dtype(table.dtype))
    pair = jnp.asarray(pair, dtype)

    def shift(x):  # x - max x (left alone where every entry is -inf), and max x
        c = jnp.max(x)
        return x - jnp.where(jnp.isneginf(c), 0.0, c), c

    def forward(alpha, psi):
        alpha, c = shift(logsumexp0(alpha[:, None] + psi, 0))
        # one (K + 1,) row per step: a scalar output of its own is slow in a CPU loop
        return alpha, jnp.concatenate([alpha, c[None]])

    def backward(beta, psi):  # psi: from step t to t + 1
        beta, _ = shift(logsumexp0(psi + beta[None, :], 1))
        return beta, beta

    a0, c0 = shift(jnp.asarray(initial, dtype))
    last, rows = lax.scan(forward, a0, pair)
    alphas, cs = rows[:, :-1], rows[:, -1]
    log_z = c0 + jnp.sum(cs) + logsumexp0(last, 0)
    zero = jnp.zeros_like(a0)
    _, betas = lax.scan(backward, zero, pair, reverse=True)
    s = jnp.concatenate([a0[None], alphas], 0) + jnp.concatenate([betas, zero[None]], 0)
    p = jnp.exp(s - logsumexp0(s, 1)[:, None])  # (T, K): each step's softmax
    ys = p if table is None else jnp.einsum("tk,tkd->td", p, jnp.asarray(table, dtype),
                                            precision=precision)
    # no allowed path: alpha_t + beta_t is -inf at every state of every step (their sum
    # over states is Z = 0), so each step's softmax is NaN, never a number
    return ys, log_z
