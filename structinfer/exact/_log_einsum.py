r"""The log-space einsum of the exact engine's sum-product (an ``opt_einsum`` backend).

funsor contracts log-factors as $\log \sum \prod e^{x - s} + s$ (``funsor.einsum.numpy_log``).
Where a sum has no non-zero term (a structural zero: two states a product of transition
matrices with forbidden moves leaves unconnected) its logarithm is $\log 0 = -\infty$,
whose reverse-mode derivative $1/0$ meets a zero cotangent (the term is used nowhere) and
gives $0 \cdot \infty = \mathrm{NaN}$, poisoning every gradient of $\log Z$: the marginals
and expectations, which are gradients. This einsum is funsor's with a logarithm whose
derivative is zero there, so a $-\infty$ entry is exact in values and derivatives of any
order; elsewhere it is funsor's, term for term.

[`log_z`][structinfer.exact.log_z] selects it (by module name, in
``contract.safe_log_einsum``) for every sum-product of a model that couples enumerated
sites: a chain of [`Markov`][structinfer.priors.Markov] edges, two hops a later factor
restricts, any product of factors with $-\infty$ entries over several sites. The zero
derivative is the tangent times 0, so a NaN cotangent passes through: where $\log Z$
itself is $-\infty$ (no structure is possible) ``log_z`` gives its result NaN derivatives
(`contract._no_slope_at_neg_inf`), and they reach every factor behind it, so that the
marginals, expectations and gradients of such a model are NaN, never zeros. The
cost is funsor's: one shift, one ``exp``, one ``einsum`` and one ``log`` per contraction,
plus a select.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from funsor.einsum.util import Tensordot
from jax import lax

__all__ = ["einsum", "tensordot", "transpose"]


@jax.custom_jvp
def log0(x):
    r"""$\log x$, $-\infty$ with a zero derivative where $x = 0$ (``jnp.log``'s is NaN
    in reverse mode: $0 \cdot \infty$).

    The derivative there is the tangent times 0, not a constant 0: a finite tangent or
    cotangent gives 0, a NaN one stays NaN, so the NaN derivatives of a $\log Z = -\infty$
    (``contract._no_slope_at_neg_inf``) reach every factor behind it."""
    zero = x == 0
    return jnp.where(zero, -jnp.inf, jnp.log(jnp.where(zero, 1.0, x)))


@log0.defjvp
def _log0_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    zero = x == 0
    return log0(x), jnp.where(zero, t * 0, t / jnp.where(zero, 1.0, x))


def einsum(equation: str, *operands):
    r"""``jnp.einsum`` in the log semiring: $\log \sum e^{\sum x}$ over the summed dims.

    Each operand is shifted by its maximum over the dims it sums (clamped to the dtype's
    smallest number, so that $-\infty - (-\infty)$ does not arise), as funsor does.
    """
    inputs, output = equation.split("->")
    if inputs == output:
        return operands[0][...]  # a new array, as funsor's
    shifts, terms = [], []
    for dims, x in zip(inputs.split(","), operands):
        summed = tuple(i for i, d in enumerate(dims) if d not in output)
        shift = lax.stop_gradient(jnp.max(x, axis=summed, keepdims=True) if summed else x)
        shift = jnp.maximum(shift, jnp.finfo(shift.dtype).min)
        terms.append(jnp.exp(x - shift))
        # the shift on the output's dims, in their order (size 1 where it has none)
        kept = [d for d in dims if d in output]
        order = sorted(kept, key=output.index)
        shift = jnp.transpose(jnp.squeeze(shift, summed), [kept.index(d) for d in order])
        shifts.append(shift.reshape([shift.shape[order.index(d)] if d in order else 1
                                     for d in output]))
    return sum(shifts) + log0(jnp.einsum(equation, *terms))


tensordot = Tensordot(einsum)
transpose = jnp.transpose
