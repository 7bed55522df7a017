r"""The log-space einsum of the exact engine's sum-product (an ``opt_einsum`` backend).

funsor contracts log-factors $x_k$ as $\log \sum \prod_k e^{x_k - s_k} + \sum_k s_k$
(``funsor.einsum.numpy_log``), each factor shifted by its own maximum $s_k$ over the
summed dims. Where the factors disagree about which term is large (an edge's score
favours one parent by 101 nats, the likelihood another), every product
$\prod_k e^{x_k - s_k}$ is tiny although the largest term of the sum is not: below
about $e^{-87}$ it underflows in float32 (XLA flushes subnormals), and $\log Z = -\infty$
while a structure is possible; where only some of the sums underflow (those of some
pairs of states), $\log Z$ is finite and too low, and nothing shows it. This einsum
shifts *jointly* where that is affordable: when the operands broadcast over all their
dims to an array of at most `JOINT_MAX_ELEMENTS` ($2^{20}$) elements, or at most
`JOINT_MAX_RATIO` times the largest operand (the attention case: a child's score, prior,
likelihood and tilts over (child, parent), or broadcastable to it, at any size), it sums
the broadcast operands to one array $x = \sum_k x_k$ and returns

$$\log \sum e^{x - m} + m, \qquad m = \max x \text{ over the summed dims},$$

one shift, one ``exp``, one reduction: its largest term is 1, so the sum cannot underflow
while any term is within the dtype's range of the largest.

Otherwise (a large real product) it shifts each operand by its own maximum, as funsor
does, and factors that disagree there by more than the dtype's exponent range can still
underflow, to $\log Z = -\infty$ (concrete ``log_marginal`` and friends then say so:
``api._check_underflow``) or, where only some terms underflow, to a finite $\log Z$ that
is too low, which nothing detects. The large products models meet are those of a chain
of [`Markov`][structinfer.priors.Markov] edges with more than 4 states: funsor's parallel
scan multiplies neighbouring steps pairwise, $\lfloor (T-1)/2 \rfloor$ products of $K
\times K$ step factors for each of the $B$ chains of a plate at its first level (half
as many at each next), a broadcast of about $K^3 B (T-1)/2$ elements. Within the budget
are, e.g., $K = 8$ with $B\,T$ up to 4,096 steps, $K = 16$ up to 512, $K = 32$ up to
64, $K = 64$ up to 8; past it, the first levels keep the per-operand shifts (the later,
smaller ones are joint). The joint shift materialises its broadcast for the derivatives
(4 MiB in float32 at the budget), and costs an ``exp`` per element of it where the
per-operand shifts have one per element of the operands and a matrix product.

The logarithm's derivative at a sum with no non-zero term, $\log 0 = -\infty$, comes in
two kinds, selected by `zero_slope_at_log0` (``contract.safe_log_einsum`` and
``contract._einsum_for`` choose, in one place):

* funsor's (the default): $1/0$, which meets the cotangent; a child's row with no
  allowed parent gets NaN derivatives (its $-\infty$ enters the plates' sum with
  weight 1: $0 \cdot \infty$), the other rows stay exact. For a model with one
  enumerated site.
* zero (``zero_slope_at_log0(True)``): for every sum-product that couples enumerated
  sites (a chain of [`Markov`][structinfer.priors.Markov] edges, two hops a later
  factor restricts, any product of factors with $-\infty$ entries over several sites).
  A structural zero (two states a product of transition matrices with forbidden moves
  leaves unconnected) is then $-\infty$ with derivative the tangent times 0, exact in
  values and derivatives of any order, instead of $0 \cdot \infty = \mathrm{NaN}$
  poisoning every gradient (marginals, expectations). A NaN cotangent passes through:
  where $\log Z$ itself is $-\infty$ (no structure is possible) ``log_z`` gives its
  result NaN derivatives (``contract._no_slope_at_neg_inf``), and they reach every
  factor behind it, so that the marginals, expectations and gradients of such a model
  are NaN, never zeros.

The shifts are constants to differentiation (``stop_gradient``), so the values and
derivatives of any order are those of $\log \sum e^{x}$ in both forms.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from funsor.einsum.util import Tensordot
from jax import lax

__all__ = ["einsum", "tensordot", "transpose", "zero_slope_at_log0", "JOINT_MAX_RATIO",
           "JOINT_MAX_ELEMENTS"]

#: the joint shift is taken when the operands' broadcast over all their dims has at most
#: this many times the elements of the largest operand (1 for attention; a batched
#: product of K x K transition matrices has K)
JOINT_MAX_RATIO = 4

#: ... or at most this many elements, whatever the ratio (the products of a chain's K x K
#: steps, about K^3 (T - 1) / 2 elements per chain at the first level of funsor's scan)
JOINT_MAX_ELEMENTS = 2**20

#: the derivative of log 0 of the einsums traced now: True (zero) or False (funsor's
#: NaN); the last entry rules (`zero_slope_at_log0` pushes and pops)
_ZERO_SLOPE = [False]


@contextlib.contextmanager
def zero_slope_at_log0(zero: bool) -> Iterator[None]:
    r"""Inside the block, the einsums traced differentiate $\log 0$ as ``zero`` says.

    ``True``: to zero (`log0`); ``False``: as funsor does, $1/0$. Read when a contraction
    is traced; nested blocks restore in order; process-wide, like funsor's interpretation
    stack."""
    _ZERO_SLOPE.append(bool(zero))
    try:
        yield
    finally:
        _ZERO_SLOPE.pop()


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
    r"""``jnp.einsum`` in the log semiring: $\log \sum e^{\sum_k x_k}$ over the summed dims.

    Shifted jointly (one maximum of the summed operands) when their broadcast has at most
    `JOINT_MAX_ELEMENTS` elements or at most `JOINT_MAX_RATIO` times those of the largest
    operand, else each operand by its own maximum over the dims it sums, as funsor does.
    A shift is clamped to the dtype's smallest number, so that $-\infty - (-\infty)$ does
    not arise.
    """
    inputs, output = equation.split("->")
    if inputs == output:
        return operands[0][...]  # a new array, as funsor's
    inputs = inputs.split(",")
    log = log0 if _ZERO_SLOPE[-1] else jnp.log
    sizes = _sizes(inputs, operands)
    if sizes is not None and math.prod(sizes.values()) <= max(
            JOINT_MAX_RATIO * max(math.prod(jnp.shape(x)) for x in operands),
            JOINT_MAX_ELEMENTS):
        return _joint(inputs, output, operands, sizes, log)
    return _per_operand(equation, inputs, output, operands, log)


def _sizes(inputs: list[str], operands) -> dict[str, int] | None:
    """Each dim's size (the largest over the operands: einsum broadcasts size 1); None
    when an operand repeats a dim (a diagonal, which funsor's contractions never send:
    the per-operand path, as funsor's own, does not take one either)."""
    sizes: dict[str, int] = {}
    for dims, x in zip(inputs, operands):
        if len(set(dims)) != len(dims) or len(dims) != jnp.ndim(x):
            return None
        for d, n in zip(dims, jnp.shape(x)):
            sizes[d] = max(sizes.get(d, 1), n)
    return sizes


def _joint(inputs: list[str], output: str, operands, sizes: dict[str, int], log):
    """The operands summed on their broadcast, log-sum-exp'd over the summed dims with
    one shift, the sum's own maximum. The broadcast keeps the dim order of the operand
    with the most dims (no transpose of the largest array), the others after it."""
    first = max(inputs, key=len)
    order = list(first) + sorted(set(sizes) - set(first))
    x = None
    for dims, op in zip(inputs, operands):
        present = [d for d in order if d in dims]
        if present != list(dims):
            op = jnp.transpose(op, [dims.index(d) for d in present])
        op = op.reshape([op.shape[present.index(d)] if d in dims else 1 for d in order])
        x = op if x is None else x + op
    summed = tuple(i for i, d in enumerate(order) if d not in output)
    shift = lax.stop_gradient(jnp.max(x, axis=summed, keepdims=True) if summed else x)
    shift = jnp.maximum(shift, jnp.finfo(shift.dtype).min)
    # a 16-bit sum accumulates in float32 (as XLA's dot of funsor's einsum does)
    wide = jnp.promote_types(x.dtype, jnp.float32)
    total = jnp.sum(jnp.exp(x - shift), axis=summed, dtype=wide)
    out = jnp.squeeze(shift, summed) + log(total).astype(x.dtype)
    kept = [d for d in order if d in output]
    return out if kept == list(output) else jnp.transpose(out, [kept.index(d) for d in output])


def _per_operand(equation: str, inputs: list[str], output: str, operands, log):
    """funsor's contraction: each operand shifted by its maximum over the dims it sums."""
    shifts, terms = [], []
    for dims, x in zip(inputs, operands):
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
    return sum(shifts) + log(jnp.einsum(equation, *terms))


tensordot = Tensordot(einsum)
transpose = jnp.transpose
