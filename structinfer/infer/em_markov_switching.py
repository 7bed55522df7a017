r"""EM for switching linear dynamics whose mode is a hidden Markov chain (Baum-Welch with
linear-Gaussian emissions; Tschantz v2 sec. 7).

The model is the catalogue's `structinfer.mechanisms.markov_switching_dynamics`. The
E-step is the exact engine on it: the smoothed modes $\gamma_{tk}$ are the marginals of
`mode`, and the expected transition counts come from one more gradient of
$\log Z$: with row-normalised $L = \log P$,
$\partial\log Z/\partial L_{ij} = N_{ij} - N_i P_{ij}$, so
$N_{ij} = \partial_{L_{ij}}\log Z + N_i P_{ij}$ with $N_i = \sum_{t < T-1}\gamma_{ti}$.
The M-step is weighted least squares (as
[`linear_mixture_em`][structinfer.infer.linear_mixture_em], with diagonal precisions)
plus $P_{ij} = N_{ij} / N_i$ and $\pi = \gamma_1$.

`init`, `step` and `run` (exported as `structinfer.infer.markov_switching_em`) are pure
functions of a `MarkovSwitchingState`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from .._checks import (
    as_float_array,
    check_layout,
    check_nonempty,
    check_nonnegative,
    check_tol,
    check_value,
)
from ..exact import log_marginal, marginals
from ..mechanisms.markov import markov_switching_dynamics
from ._common import (
    check_covariances,
    check_linalg_dtype,
    rel_change_small,
    safe_log,
    weighted_affine_fit,
)
from ._loop import LoopInfo, check, iterate, neg_log_likelihood

__all__ = ["MarkovSwitchingState", "init", "step", "run"]


class MarkovSwitchingState(NamedTuple):
    r"""State of [`markov_switching_em`][structinfer.infer.markov_switching_em].

    Attributes:
        A: `(K, d, d)` the modes' linear maps $A_k$.
        b: `(K, d)` their offsets $b_k$.
        precisions: `(K, d)` their diagonal noise precisions $\Lambda_k$.
        log_transition: `(K, K)` row-normalised $\log P$ (rows: the previous mode).
        log_initial: `(K,)` normalised $\log\pi$.
        responsibilities: `(T-1, K)` $\gamma_{tk} = p(\phi_t = k \mid x)$.
        transitions: `(K, K)` expected transition counts $N_{ij}$.
        log_likelihood: $\log p(x_{2..T} \mid x_1)$.
    """

    A: jax.Array
    b: jax.Array
    precisions: jax.Array
    log_transition: jax.Array
    log_initial: jax.Array
    responsibilities: jax.Array
    transitions: jax.Array
    log_likelihood: jax.Array


def _prepare(x, A, b, precisions, log_transition, log_initial):
    x = as_float_array(x, "markov_switching_em: x")
    check_linalg_dtype(x, "markov_switching_em: x")
    check_layout(x, 2, "markov_switching_em: x", "(T, d)",
                 "; for a batch of time series map markov_switching_em over it with jax.vmap")
    check_nonempty(x, "markov_switching_em: x", "(T, d)")
    A, b, prec = (jnp.asarray(a, x.dtype) for a in (A, b, precisions))
    check_layout(A, 3, "markov_switching_em: A", "(K, d, d)")
    k, d = A.shape[0], x.shape[1]
    lt = jnp.zeros((k, k), x.dtype) if log_transition is None else jnp.asarray(log_transition, x.dtype)
    li = jnp.zeros((k,), x.dtype) if log_initial is None else jnp.asarray(log_initial, x.dtype)
    if (A.shape != (k, d, d) or b.shape != (k, d) or prec.shape != (k, d)
            or lt.shape != (k, k) or li.shape != (k,)):
        raise ValueError(
            f"markov_switching_em: x {tuple(x.shape)}, A {tuple(A.shape)}, b {tuple(b.shape)}, "
            f"precisions {tuple(prec.shape)}, log_transition {tuple(lt.shape)}, log_initial "
            f"{tuple(li.shape)} must be (T, d), (K, d, d), (K, d), (K, d), (K, K), (K,)"
        )
    prec = check_covariances(prec, "markov_switching_em: precisions", diagonal=True)
    lt = _check_log_weights(lt, "markov_switching_em: log_transition", "each row needs")
    li = _check_log_weights(li, "markov_switching_em: log_initial", "it needs")
    return x, A, b, prec, jax.nn.log_softmax(lt, -1), jax.nn.log_softmax(li)


def _check_log_weights(lw, what: str, needs: str):
    """Unnormalised log-weights: no NaN or +inf, and a finite entry in every row (a row of
    -inf allows no mode; `check_value`: NaN when traced)."""
    return check_value(
        lw, lambda xp, v: ~xp.isnan(v) & (v < xp.inf) & xp.any(v > -xp.inf, -1, keepdims=True),
        what, f"(unnormalised log-weights) must hold no NaN or +inf, and {needs} a finite "
        "entry")


def _check_reg(reg):
    return check_nonnegative(reg, "markov_switching_em: reg",
                             "the ridge added to every variance and Gram matrix")


def _e_step(x, A, b, prec, lt, li):
    ll, g = jax.value_and_grad(
        lambda lt: log_marginal(markov_switching_dynamics, x, A, b, prec, lt, li))(lt)
    gamma = marginals(markov_switching_dynamics, x, A, b, prec, lt, li)["mode"].astype(x.dtype)
    n_from = jnp.sum(gamma[:-1], 0)
    counts = g + n_from[:, None] * jnp.exp(lt)  # expected transitions N_ij
    return gamma, jnp.clip(counts, 0.0, None), ll


def _init(x, A, b, prec, lt, li) -> MarkovSwitchingState:
    return MarkovSwitchingState(A, b, prec, lt, li, *_e_step(x, A, b, prec, lt, li))


def init(
    x: ArrayLike,
    A: ArrayLike,
    b: ArrayLike,
    precisions: ArrayLike,
    log_transition: ArrayLike | None = None,
    log_initial: ArrayLike | None = None,
) -> MarkovSwitchingState:
    r"""Check and cast the arguments and run the first E-step.

    Args:
        x: the time series `(T, d)`.
        A: `(K, d, d)`.
        b: `(K, d)`.
        precisions: `(K, d)` diagonal precisions.
        log_transition: `(K, K)` unnormalised log-weights (default uniform).
        log_initial: `(K,)` unnormalised log-weights (default uniform).

    Returns:
        The `MarkovSwitchingState` at the initial parameters.

    Raises:
        TypeError: `x` is a 16-bit float (the linear algebra needs float32 or
            float64).
        ValueError: no data (`T = 0`), shapes other than those above, precisions that
            are not positive and finite, or log-weights with a NaN, a +inf or a row without a finite
            entry.
    """
    return _init(*_prepare(x, A, b, precisions, log_transition, log_initial))


def _m_step(x, st: MarkovSwitchingState, reg):
    r = st.responsibilities
    A_new, b_new, err, nk, live = weighted_affine_fit(x[:-1], x[1:], r, st.A, st.b, reg)
    var = jnp.einsum("tk,kti->ki", r, err * err) / jnp.where(live, nk, 1.0)[:, None] + reg
    return A_new, b_new, jnp.where(live[:, None], 1.0 / var, st.precisions)


def _transition(counts, old):
    """Row-normalised log counts.

    A row without counts (a mode never left) keeps ``old``. A zero count is a log-weight
    of -inf: a move EM found no use for stays forbidden (the exact engine's marginals are
    exact with forbidden moves).
    """
    total = jnp.sum(counts, -1, keepdims=True)
    empty = total <= 0
    p = counts / jnp.where(empty, 1.0, total)
    return jnp.where(empty, old, safe_log(p))


def step(
    x: jax.Array,
    state: MarkovSwitchingState,
    *,
    reg: float = 1e-6,
    tol: float = 1e-8,
) -> tuple[MarkovSwitchingState, jax.Array]:
    r"""One EM iteration: the M-step at `state`'s expected statistics, then the E-step.

    Args:
        x: the time series `(T, d)` (as cast by `init`).
        state: the current `MarkovSwitchingState`.
        reg: ridge added to every variance and Gram matrix (non-negative).
        tol: the convergence tolerance (a non-negative number; anything else raises
            `ValueError`).

    Returns:
        `(new_state, converged)`: `converged` when the log-likelihood changed by at most
            `tol * max(1, |ll|)`.

    Raises:
        ValueError: a negative `reg` (a traced one makes the state NaN instead).
    """
    tol = check_tol(tol, "markov_switching_em: tol")
    A, b, prec = _m_step(x, state, _check_reg(reg))
    lt = _transition(state.transitions, state.log_transition)
    li = safe_log(state.responsibilities[0])
    new = MarkovSwitchingState(A, b, prec, lt, li, *_e_step(x, A, b, prec, lt, li))
    return new, rel_change_small(new.log_likelihood, state.log_likelihood, tol)


def run(
    x: ArrayLike,
    A: ArrayLike,
    b: ArrayLike,
    precisions: ArrayLike,
    log_transition: ArrayLike | None = None,
    log_initial: ArrayLike | None = None,
    *,
    reg: float = 1e-6,
    tol: float = 1e-8,
    max_iters: int = 100,
    raise_on_nonfinite: bool = True,
) -> tuple[MarkovSwitchingState, LoopInfo]:
    r"""EM (Baum-Welch) for switching linear dynamics with Markov modes.

    E-step (exact engine on `structinfer.mechanisms.markov_switching_dynamics`): the
    smoothed modes $\gamma_{tk}$ and expected transitions $N_{ij}$ (both gradients of
    $\log Z$). M-step, with $u_t = x_t$, $y_t = x_{t+1}$, $\tilde u_t = (u_t, 1)$ and
    $e_{tk} = y_t - A_k u_t - b_k$:

    $$[A_k\; b_k] = \Big(\sum_t \gamma_{tk} y_t \tilde u_t^\top\Big)
    \Big(\sum_t \gamma_{tk}\tilde u_t\tilde u_t^\top\Big)^{-1}, \quad
    \Lambda_{k}^{-1} = \frac{\sum_t \gamma_{tk}\, e_{tk}^{2}}{\sum_t \gamma_{tk}}, \quad
    P_{ij} = \frac{N_{ij}}{\sum_{j'} N_{ij'}}, \quad \pi = \gamma_1.$$

    A mode with no data ($\sum_t \gamma_{tk} = 0$) keeps its $A_k$, $b_k$, precisions
    and row of $P$, so it stays off. A zero count gives $\log P_{ij} = -\infty$: a move
    forbidden in `log_transition`, or one EM finds no use for, stays forbidden, as in
    Baum-Welch.

    Args:
        x: the time series `(T, d)`.
        A: `(K, d, d)` initial linear maps.
        b: `(K, d)` initial offsets.
        precisions: `(K, d)` initial diagonal precisions.
        log_transition: `(K, K)` initial log-weights (default uniform).
        log_initial: `(K,)` initial log-weights (default uniform).
        reg: ridge added to every variance and Gram matrix: keeps them invertible when a
            mode has fewer points than $d + 1$ or fits them exactly. Non-negative (under
            `jax.jit`, where it cannot be checked, a negative `reg` gives a NaN energy:
            `info.nonfinite`).
        tol: converged when the log-likelihood changes by at most `tol * max(1, |ll|)`.
        max_iters: the most EM iterations.
        raise_on_nonfinite: raise `NonFiniteEnergyError` on a non-finite log-likelihood
            when the result is concrete.

    Returns:
        `(MarkovSwitchingState, LoopInfo)`; `info.energy` is $-\log p(x_{2..T} \mid x_1)$
            (non-increasing up to the ridge).

    Raises:
        TypeError: `x` is a 16-bit float (the linear algebra needs float32 or
            float64).
        ValueError: no data (`T = 0`), shapes other than those above (for a batch of time series use
            `jax.vmap`), precisions that are not positive and finite or log-weights with a NaN, a
            +inf or a row without a finite entry (under `jax.jit`: a NaN energy), a
            negative `reg`, or a `tol` that is not a non-negative number.

    Reference:
        Tschantz, "Attention via log-sum-exp energy" v2 sec. 7 (switching systems with a
        Markov mode); Baum-Welch's transition update.
    """
    x, A, b, prec, lt, li = _prepare(x, A, b, precisions, log_transition, log_initial)
    state, info = iterate(_init, step, neg_log_likelihood, (x, A, b, prec, lt, li), (x,),
                          {"reg": _check_reg(reg), "tol": check_tol(tol, "markov_switching_em: tol")},
                          max_iters, "markov_switching_em")
    if raise_on_nonfinite:
        check(info, "markov_switching_em", "'mode' (a mode with too few points to fit its A, "
              "b and precisions? raise reg)")
    return state, info
