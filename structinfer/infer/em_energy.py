r"""The general log-sum-exp EM (Tschantz, "log-sum-exp expectation maximisation"): the
E-step is gradient descent on the latents to a minimum of the energy, the M-step one
gradient step on the parameters,

$$v^* = \arg\min_v E(v; \theta), \qquad
\theta \leftarrow \theta - \eta_\theta\, \partial_\theta E(v^*; \theta).$$

For energies with a closed-form M-step use `structinfer.infer.gmm_em`,
`linear_mixture_em` or `slot_em`.

`init`, `step` and `run` (exported as `structinfer.infer.energy_em`) are pure functions
of an `EMState`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._checks import check_count, check_tol
from . import gradient
from ._common import as_float_tree, check_step_size, like_tree, rel_change_small
from ._loop import LoopInfo, check, run_loop

__all__ = ["EMState", "init", "step", "run"]


class EMState(NamedTuple):
    r"""State of [`energy_em`][structinfer.infer.energy_em]: latents $v$, params $\theta$, $E(v; \theta)$."""

    latents: Any
    params: Any
    energy: jax.Array


def _e_step(energy_fn, v, th, e_step_size, e_iters, e_tol):
    """Gradient descent on the latents: ``(v*, E)``, ``E`` not finite if it diverged.

    The descent stops at its last finite point when its energy is not finite; that
    point is no minimum, so its non-finite energy is passed on for the outer loop to
    stop on.
    """
    e_iters = check_count(e_iters, "energy_em: e_iters",
                          role="the most gradient steps of each E-step")
    what = "energy_em: `e_step_size`"
    e_step_size = like_tree(check_step_size(e_step_size, what), v, what, of="the latents")
    st, info = gradient.run(lambda z: energy_fn(z, th), v, step_size=e_step_size, tol=e_tol,
                            max_iters=e_iters, raise_on_nonfinite=False)
    return st.mu, jnp.where(info.nonfinite, info.final_energy(), st.energy)


def _m_step(energy_fn, state, m_step_size):
    g = jax.grad(energy_fn, argnums=1)(state.latents, state.params)
    what = "energy_em: `m_step_size`"
    lr = like_tree(check_step_size(m_step_size, what), g, what, of="the params")
    return jax.tree.map(lambda p, gi, h: (p - h * gi).astype(jnp.result_type(p)),
                        state.params, g, lr)


def _failing_phase(energy_fn, state, m_step_size, step):
    """Which half of the failing step (or of the first E-step) left E non-finite."""
    th = state.params if step == 0 else _m_step(energy_fn, state, m_step_size)
    if not bool(jnp.isfinite(energy_fn(state.latents, th))):
        if step == 0:
            return "E is not finite at the initial latents and params"
        return ("the M-step: E is not finite at its new params and the current latents "
                "(lower m_step_size)")
    return ("the E-step: its gradient descent on the latents diverged (lower "
            "e_step_size)")


def init(
    energy_fn: Callable[[Any, Any], jax.Array],
    latents: Any,
    params: Any,
    *,
    e_step_size: Any = 0.1,
    e_iters: int = 100,
    e_tol: float = 1e-6,
) -> EMState:
    r"""The first E-step $v^*_0 = \arg\min_v E(v; \theta_0)$, by gradient descent on the latents.

    Args:
        energy_fn: `(latents, params) -> E`.
        latents: initial latents (pytree).
        params: initial parameters (pytree; integer leaves are promoted to floats).
        e_step_size: step size of the inner gradient descent.
        e_iters: its most steps (a positive int).
        e_tol: its gradient tolerance.

    Returns:
        The `EMState` with $v^*_0$, `params` and $E(v^*_0; \theta_0)$; the energy is
            not finite when the gradient descent diverged (the latents are then its last
            finite point).

    Raises:
        ValueError: `e_iters` is not a positive int.
    """
    params = as_float_tree(params)  # integers promoted, as the latents are
    v0, e0 = _e_step(energy_fn, latents, params, e_step_size, e_iters, e_tol)
    return EMState(v0, params, e0)


def step(
    energy_fn: Callable[[Any, Any], jax.Array],
    state: EMState,
    *,
    e_step_size: Any = 0.1,
    e_iters: int = 100,
    e_tol: float = 1e-6,
    m_step_size: Any = 0.01,
    tol: float = 1e-8,
) -> tuple[EMState, jax.Array]:
    r"""One iteration: $\theta \leftarrow \theta - \eta_\theta\,\partial_\theta E$, then the E-step.

    The gradient step on the parameters is taken at the current latents; the E-step
    starts from them.

    Args:
        energy_fn: `(latents, params) -> E`.
        state: the current `EMState`.
        e_step_size: step size of the inner gradient descent.
        e_iters: its most steps.
        e_tol: its gradient tolerance (a non-negative number; anything else raises
            `ValueError`).
        m_step_size: $\eta_\theta$ (scalar or pytree like `params`).
        tol: the convergence tolerance (a non-negative number; anything else raises
            `ValueError`).

    Returns:
        `(new_state, converged)`: $E$ changed by at most `tol * max(1, |E|)`. The new
            energy is not finite when the E-step's gradient descent diverged.

    Raises:
        ValueError: `e_iters` is not a positive int.
    """
    e_tol = check_tol(e_tol, "energy_em: e_tol")
    tol = check_tol(tol, "energy_em: tol")
    th = _m_step(energy_fn, state, m_step_size)
    v, e = _e_step(energy_fn, state.latents, th, e_step_size, e_iters, e_tol)
    return EMState(v, th, e), rel_change_small(e, state.energy, tol)


def run(
    energy_fn: Callable[[Any, Any], jax.Array],
    latents: Any,
    params: Any,
    *,
    e_step_size: Any = 0.1,
    e_iters: int = 100,
    e_tol: float = 1e-6,
    m_step_size: Any = 0.01,
    tol: float = 1e-8,
    max_iters: int = 200,
    raise_on_nonfinite: bool = True,
) -> tuple[EMState, LoopInfo]:
    r"""The general log-sum-exp EM (Tschantz): gradient E-step on the latents, gradient M-step.

    The E-step is gradient descent on the latents to a minimum of the energy, the M-step
    one gradient step on the parameters:

    $$v^* = \arg\min_v E(v; \theta) \;\;(\text{gradient descent from the previous } v),
    \qquad \theta \leftarrow \theta - \eta_\theta\, \partial_\theta E(v^*; \theta).$$

    Args:
        energy_fn: `(latents, params) -> E`, e.g. built from `structinfer.energy`.
        latents: initial latents (pytree).
        params: initial parameters (pytree).
        e_step_size: step size of the inner `structinfer.infer.gradient_descent`.
        e_iters: its most steps (a positive int).
        e_tol: its gradient tolerance.
        m_step_size: $\eta_\theta$ (scalar or pytree like `params`).
        tol: converged when $E$ changes by at most `tol * max(1, |E|)`.
        max_iters: the most outer iterations.
        raise_on_nonfinite: raise `NonFiniteEnergyError` on a non-finite energy when the
            result is concrete.

    Returns:
        `(EMState, LoopInfo)`; `info.energy[t]` is $E(v^*_t; \theta_t)$ after the E-step
            of iteration `t` at the parameters of iteration `t`. An E-step whose gradient
            descent diverged counts as a non-finite energy at that iteration
            (`info.nonfinite`; the state is the last one with a finite energy).

    Raises:
        ValueError: `e_iters` is not a positive int, `tol` or `e_tol` is not a
            non-negative number, or a step size is negative or does not broadcast to the
            shape of its latents / params (leaf by leaf).
        NonFiniteEnergyError: see `raise_on_nonfinite`; the message says whether the
            E-step or the M-step left $E$ non-finite.

    Reference:
        Tschantz, "log-sum-exp expectation maximisation".
    """
    check_tol(tol, "energy_em: tol")
    check_tol(e_tol, "energy_em: e_tol")
    kw = dict(e_step_size=e_step_size, e_iters=e_iters, e_tol=e_tol)
    state = init(energy_fn, latents, params, **kw)

    def body(s: EMState):
        new, conv = step(energy_fn, s, m_step_size=m_step_size, tol=tol, **kw)
        return new, new.energy, conv

    state, info = run_loop(body, state, state.energy, max_iters, "energy_em")
    if raise_on_nonfinite:
        def phase(_):  # evaluated only on a concrete failure
            return _failing_phase(energy_fn, state, m_step_size, int(info.num_steps))

        check(info, "energy_em", phase)
    return state, info
