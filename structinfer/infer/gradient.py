r"""Gradient descent on the collapsed free energy, for any potentials (Singh & Buckley
sec. 4, eq. 7; sec. 4.4 and appendix 7.2 for predictive coding).

$$F(\mu) = -\log \sum_\phi p(x, \mu, \phi), \qquad
\nabla F(\mu) = -\sum_i \sum_{\phi_i} \mathrm{softmax}(f_i)\,\partial_\mu f_i,
\qquad \mu^{t+1} = \mu^t - \eta\,\nabla F(\mu^t):$$

the gradient is attention with the free-energy gradient as value.

`init`, `step` and `run` (exported as `structinfer.infer.gradient_init`,
`gradient_step` and `gradient_descent`) are pure functions of a `GradientState`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._checks import check_tol
from ._common import as_float_tree, check_step_size, like_tree, max_abs, site_finder
from ._loop import LoopInfo, check, run_loop

__all__ = ["GradientState", "init", "step", "run"]


class GradientState(NamedTuple):
    r"""State of [`gradient_descent`][structinfer.infer.gradient_descent]: $\mu$, $F(\mu)$, $\nabla F(\mu)$."""

    mu: Any
    energy: jax.Array
    grad: Any


def init(energy_fn: Callable[[Any], jax.Array], mu0: Any) -> GradientState:
    r"""Initial `GradientState`: $F(\mu_0)$ and $\nabla F(\mu_0)$ (one value-and-gradient evaluation).

    Args:
        energy_fn: `mu -> F(mu)`.
        mu0: initial means (pytree).

    Returns:
        The `GradientState` at `mu0`.
    """
    mu0 = as_float_tree(mu0)
    e, g = jax.value_and_grad(energy_fn)(mu0)
    return GradientState(mu0, e, g)


def step(
    energy_fn: Callable[[Any], jax.Array], state: GradientState, step_size: Any, tol: float = 1e-6
) -> tuple[GradientState, jax.Array]:
    r"""One step $\mu \leftarrow \mu - \eta\,\nabla F(\mu)$.

    Args:
        energy_fn: `mu -> F(mu)`.
        state: the current `GradientState`.
        step_size: $\eta$, a scalar or a pytree like `mu`.
        tol: the convergence tolerance (a non-negative number; anything else raises
            `ValueError`).

    Returns:
        `(new_state, converged)` with `converged = max |∇F(new μ)| <= tol`.
    """
    tol = check_tol(tol, "gradient_descent: tol")
    what = "gradient_descent: `step_size`"
    lr = like_tree(check_step_size(step_size, what), state.mu, what)
    mu = jax.tree.map(lambda m, g, h: (m - h * g).astype(m.dtype), state.mu, state.grad, lr)
    e, g = jax.value_and_grad(energy_fn)(mu)
    return GradientState(mu, e, g), max_abs(g) <= tol


def run(
    energy_fn: Callable[[Any], jax.Array],
    mu0: Any,
    *,
    step_size: Any = 0.1,
    tol: float = 1e-5,
    max_iters: int = 1000,
    raise_on_nonfinite: bool = True,
) -> tuple[GradientState, LoopInfo]:
    r"""Gradient descent on the collapsed free energy for general potentials.

    $$\mu^{t+1} = \mu^t - \eta\, \nabla F(\mu^t), \qquad
    \nabla F(\mu) = -\sum_i \sum_{\phi_i} \mathrm{softmax}(f_i)\,\partial_\mu f_i$$

    (Singh & Buckley eq. 7; with squared prediction errors as edge potentials this is
    the attention-modulated predictive-coding dynamics of sec. 4.4 / appendix 7.2).
    The gradient is `jax.grad` of `energy_fn`. $F$ decreases for $\eta < 2/L$ ($L$ the
    gradient's Lipschitz constant); a too-large step shows as a rising `info.energy`.

    Args:
        energy_fn: `mu -> F(mu)`, e.g. `structinfer.infer.model_energy`.
        mu0: initial means (pytree).
        step_size: $\eta \ge 0$, a scalar or a pytree like `mu`.
        tol: converged when $\max|\nabla F| \le$ `tol` (the rule of `step`).
        max_iters: the most steps (reported in `info.max_iters_reached` when reached).
        raise_on_nonfinite: raise `NonFiniteEnergyError` on a non-finite energy when the
            result is concrete.

    Returns:
        `(GradientState, LoopInfo)`.

    Raises:
        ValueError: a negative `step_size` or one that does not broadcast to the shape of
            the means (leaf by leaf), or a `tol` that is not a non-negative number.
    """
    step_size = check_step_size(step_size, "gradient_descent: `step_size`")
    check_tol(tol, "gradient_descent: tol")
    state = init(energy_fn, mu0)

    def body(s):
        new, conv = step(energy_fn, s, step_size, tol)
        return new, new.energy, conv

    state, info = run_loop(body, state, state.energy, max_iters, "gradient_descent")
    if raise_on_nonfinite:
        lr = like_tree(step_size, state.mu)
        bad_mu = lambda idx: jax.tree.map(  # noqa: E731
            lambda m, g, h: m - h * g, state.mu, state.grad, lr
        )
        check(info, "gradient_descent", site_finder(energy_fn, bad_mu))
    return state, info
