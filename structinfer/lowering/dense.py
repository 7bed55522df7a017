r"""Dense kernel: materialise the ``(..., n, m)`` logits once, softmax, contract.

$$
y = \mathrm{softmax}(\ell)\, V, \qquad \ell_{ij} = \psi_{ij} + \log\tilde p(\phi_i = j)
$$

This is the naive twin of `structinfer.lowering.blocked` (same logits,
from `block_logits` over the whole index
range) and the fastest path for small ``n m``. Gradients are plain autodiff
(memory $O(n m)$).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._spec import Problem, Terms, block_logits

__all__ = ["dense_attention", "dense_logits"]


def dense_logits(terms: Terms, prob: Problem, batch_shape: tuple[int, ...]) -> jax.Array:
    """The full ``batch + (n, m)`` table of logits, ``-inf`` on forbidden edges."""
    n, m = terms.num_children, terms.num_parents
    s, ok = block_logits(
        terms, prob.row, prob.col, prob.pair, prob.glob, prob.const,
        jnp.arange(n), jnp.arange(m), prob.v.dtype,
    )
    if ok is not None:
        s = jnp.where(ok, s, -jnp.inf)
    return jnp.broadcast_to(s, tuple(batch_shape) + (n, m))


def dense_attention(
    terms: Terms, prob: Problem, batch_shape: tuple[int, ...]
) -> tuple[jax.Array, jax.Array]:
    r"""Posterior expectation ``y = softmax(l) V`` and row log-partition ``L`` (dense).

    Returns:
        ``(y, L)``: ``batch + (n, dv)`` and ``batch + (n,)``.

    Cost: $O(n m (d + d_v))$ time, $O(n m)$ memory.
    """
    logits = dense_logits(terms, prob, batch_shape)
    lse = jax.nn.logsumexp(logits, axis=-1)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    probs = jnp.exp(logits - safe[..., None])
    out = jnp.einsum("...ij,...jd->...id", probs, prob.v)
    return out, lse
