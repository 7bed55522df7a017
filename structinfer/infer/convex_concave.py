r"""CCCP: the convex–concave fixed point on the collapsed free energy (Singh & Buckley
sec. 4, eq. 8).

With quadratic node potentials $\tfrac12\mu^\top\Lambda\mu$ and edge potentials whose
log-sum-exp $G(\mu) = \log\sum_\phi e^{\tilde f(\mu,\phi)}$ is convex (linear or bilinear
in $\mu$, Lemma 7.2), the free energy $F = \tfrac12\mu^\top\Lambda\mu - G(\mu)$ is a
difference of convex functions and

$$\mu^{t+1} = \Lambda^{-1}\nabla G(\mu^t)
  = \Lambda^{-1}\sum_i\sum_{\phi_i}\mathrm{softmax}(\tilde f_i)\,\partial_\mu \tilde f_i$$

never increases it (Yuille & Rangarajan). $\nabla G$ is one backward pass through the
exact engine, so the Hopfield, slot and block-slot updates all come from their models.

`init`, `step` and `run` (exported as `structinfer.infer.cccp_init`, `cccp_step` and
`cccp`) are pure functions of a `CCCPState`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._checks import check_tol, check_value
from ._common import as_float_tree, like_tree, max_abs, site_finder, sum_tree
from ._loop import LoopInfo, check, run_loop

__all__ = ["CCCPState", "init", "step", "run"]


class CCCPState(NamedTuple):
    r"""State of [`cccp`][structinfer.infer.cccp]: the means $\mu$ (`mu`, any pytree) and $F(\mu)$."""

    mu: Any
    energy: jax.Array


def _check_precision(precision) -> Any:
    """Every leaf of ``precision`` positive (`check_value`: NaN when traced)."""
    return jax.tree.map(
        lambda p: check_value(p, lambda xp, v: v > 0, "cccp: `precision`",
                              "(the quadratic node potential 1/2 mu^T Lambda mu) must be "
                              "positive"),
        precision)


def _precision_like(precision, mu) -> Any:
    """`precision` checked (`_check_precision`) as a pytree like `mu`, each leaf
    broadcasting to its mean's shape (a precision of another shape would broadcast `mu`
    to it in the update)."""
    return like_tree(_check_precision(precision), mu, "cccp: `precision`",
                     hint="a diagonal precision: a scalar or an array like mu")


def _energy(log_z_fn, mu, precision) -> jax.Array:
    quad = sum_tree(jax.tree.map(lambda m, p: 0.5 * p * m * m, mu, precision))
    return quad - log_z_fn(mu)


def init(log_z_fn: Callable[[Any], jax.Array], mu0: Any, precision: Any = 1.0) -> CCCPState:
    r"""Initial `CCCPState` with $F(\mu_0) = \tfrac12\mu_0^\top\Lambda\mu_0 - G(\mu_0)$.

    Args:
        log_z_fn: $G$, `mu -> log Σ_φ exp f̃`.
        mu0: initial means (any pytree of arrays).
        precision: $\Lambda$, a scalar or a pytree like `mu0`.

    Returns:
        The `CCCPState` at `mu0`.
    """
    mu0 = as_float_tree(mu0)
    prec = _precision_like(precision, mu0)
    return CCCPState(mu0, _energy(log_z_fn, mu0, prec))


def step(
    log_z_fn: Callable[[Any], jax.Array], state: CCCPState, precision: Any = 1.0, tol: float = 1e-6
) -> tuple[CCCPState, jax.Array]:
    r"""One fixed-point step $\mu \leftarrow \Lambda^{-1}\nabla_\mu G(\mu)$ (eq. 8).

    Args:
        log_z_fn: $G$.
        state: the current `CCCPState`.
        precision: $\Lambda$.
        tol: the convergence tolerance (a non-negative number; anything else raises
            `ValueError`).

    Returns:
        `(new_state, converged)` with `converged = max |Δμ| <= tol`.
    """
    tol = check_tol(tol, "cccp: tol")
    prec = _precision_like(precision, state.mu)
    g = jax.grad(log_z_fn)(state.mu)
    mu = jax.tree.map(lambda gi, p, m: (gi / p).astype(m.dtype), g, prec, state.mu)
    delta = max_abs(jax.tree.map(lambda a, b: a - b, mu, state.mu))
    return CCCPState(mu, _energy(log_z_fn, mu, prec)), delta <= tol


def run(
    log_z_fn: Callable[[Any], jax.Array],
    mu0: Any,
    *,
    precision: Any = 1.0,
    tol: float = 1e-6,
    max_iters: int = 100,
    raise_on_nonfinite: bool = True,
) -> tuple[CCCPState, LoopInfo]:
    r"""Convex–concave fixed-point iteration on the collapsed free energy (Singh & Buckley eq. 8).

    $$F(\mu) = \tfrac12 \mu^\top \Lambda \mu - G(\mu), \quad
    G(\mu) = \log \sum_\phi \exp \tilde f(x, \mu, \phi), \qquad
    \mu^{t+1} = \Lambda^{-1} \nabla G(\mu^t)
              = \Lambda^{-1} \sum_i \sum_{\phi_i} \mathrm{softmax}(\tilde f_i)\,
                \frac{\partial \tilde f_i}{\partial \mu}.$$

    When $G$ is convex (edge potentials linear in $\mu$, or bilinear
    $\mu_i^\top W \mu_j$ with $W$ p.s.d., appendix 7.1.1) every step satisfies
    $F(\mu^{t+1}) \le F(\mu^t)$, with equality only at a stationary point. Examples:
    Hopfield ($\tilde f = \beta\mu^\top x_j$, $\Lambda = \beta$) gives
    $\mu^* = \sum_j \mathrm{softmax}_j(\beta\mu^\top x_j) x_j$ (sec. 4.2); slot attention
    (edges of the tokens over the slots) gives
    $\mu_i^* = \sum_j \mathrm{softmax}_i(\mu_i^\top W_Q^\top W_K x_j) W_Q^\top W_K x_j$ (sec. 4.3).

    Args:
        log_z_fn: $G$, `mu -> log Σ_φ exp f̃` — usually `structinfer.infer.model_log_z`
            of a model with the edge potentials only (no node potential).
        mu0: initial means (any pytree of arrays).
        precision: $\Lambda$, positive; a scalar or a pytree like `mu` of arrays
            broadcasting against its leaves (diagonal precision).
        tol: converged when $\max|\mu^{t+1} - \mu^t| \le$ `tol` (the rule of `step`).
        max_iters: the most steps; stopping there is reported in `info.max_iters_reached`.
        raise_on_nonfinite: raise `NonFiniteEnergyError` (naming the step and site) when
            the result is concrete.

    Returns:
        `(CCCPState, LoopInfo)`; `info.energy[t]` is $F(\mu^t)$.

    Raises:
        ValueError: a non-positive `precision` (concrete values; traced, it makes the
            energy NaN, and the run stops on it), or one that does not broadcast to the
            shape of `mu0`; a `tol` that is not a non-negative number (a negative or
            NaN one could never be met).
        NonFiniteEnergyError: see `raise_on_nonfinite`.

    Cost: one forward and backward pass of the exact engine per step.
    """
    check_tol(tol, "cccp: tol")
    precision = _check_precision(precision)
    state = init(log_z_fn, mu0, precision)

    def body(s):
        new, conv = step(log_z_fn, s, precision, tol)
        return new, new.energy, conv

    state, info = run_loop(body, state, state.energy, max_iters, "cccp")
    if raise_on_nonfinite:
        prec = like_tree(precision, state.mu)
        bad_mu = lambda idx: jax.tree.map(  # noqa: E731 - recompute the failing step eagerly
            lambda g, p: g / p, jax.grad(log_z_fn)(state.mu), prec
        )
        check(info, "cccp", site_finder(log_z_fn, bad_mu))
    return state, info
