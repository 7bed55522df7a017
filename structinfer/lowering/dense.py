r"""Dense kernel: materialise the ``(..., n, m)`` logits once, softmax, contract.

$$
y = \mathrm{softmax}(\ell)\, V, \qquad \ell_{ij} = \psi_{ij} + \log\tilde p(\phi_i = j)
$$

This is the naive twin of `structinfer.lowering.blocked` (same logits,
from `block_logits` over the whole index
range) and the fastest path for small ``n m``. Gradients are plain autodiff
(memory $O(n m)$). The matmuls multiply in the operands' dtype and accumulate in
float32 (`lowering.accum_dtype`), the softmax is computed in float32, and the output is in
the value table's dtype, as flash-attention kernels do; the probabilities' cotangent
$\mathrm{d}y\,V^\top$ is float32 too (`_softmax.weighted_values`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._softmax import weighted_values
from ._spec import Problem, Terms, accum_dtype, block_logits

__all__ = ["dense_attention", "dense_logits"]


def dense_logits(terms: Terms, prob: Problem, batch_shape: tuple[int, ...],
                 precision=None) -> jax.Array:
    """The full ``batch + (n, m)`` table of logits, ``-inf`` on forbidden edges, in the
    accumulation dtype (float32, or float64 for float64 operands)."""
    n, m = terms.num_children, terms.num_parents
    s, ok = block_logits(
        terms, prob.row, prob.col, prob.pair, prob.glob, prob.const,
        jnp.arange(n), jnp.arange(m), accum_dtype(prob.v.dtype), precision=precision,
    )
    if ok is not None:
        s = jnp.where(ok, s, -jnp.inf)
    return jnp.broadcast_to(s, tuple(batch_shape) + (n, m))


def dense_attention(
    terms: Terms, prob: Problem, batch_shape: tuple[int, ...],
    precision: jax.lax.PrecisionLike = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Posterior expectation ``y = softmax(l) V`` and row log-partition ``L`` (dense).

    Args:
        terms, prob: a lowered edge site (`structinfer.lowering._spec`).
        batch_shape: the broadcast batch shape (heads, batch) of the result.
        precision: the matmuls' ``precision`` (``None``: JAX's default, which follows
            ``jax.default_matmul_precision``).

    Returns:
        ``(y, L)``: ``batch + (n, dv)`` in the value table's dtype and ``batch + (n,)``
        in the accumulation dtype.

    Cost: $O(n m (d + d_v))$ time, $O(n m)$ memory.
    """
    v = prob.v
    logits = dense_logits(terms, prob, batch_shape, precision)
    # weights e^{l - max} / sum e^{l - max}, normalised by their own sum: not e^{l - L},
    # whose L = max + log(sum) is rounded to the ulp of |max| (at |l| ~ 1e5 in float32
    # the weights would sum to 1 +- 0.5%, at ~3e7 to anything)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(logits - top)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)
    lse = (top + jnp.log(total))[..., 0]
    out = weighted_values("...ij,...jd->...id", probs, v, precision)
    return out.astype(v.dtype), lse
