r"""EM for a mixture of linear regressions / switching linear dynamics with i.i.d. modes
(Tschantz v2 sec. 10 and the slides' linear mixture: the SLDS energy with
$u_t = x_t$, $y_t = x_{t+1}$).

The model is the catalogue's `structinfer.mechanisms.switching_linear_dynamics` with
the transitions given as pairs (`targets=`) and the Gaussian normaliser: target $y_t$
takes a mode $\phi_t$ with prior $w$ and score $\log\mathcal N(y_t; A_k u_t + b_k,
\Sigma_k)$. The E-step is the exact engine on it (responsibilities = the edge marginals
of `mode`); the M-step is weighted least squares.

`init`, `step` and `run` (exported as `structinfer.infer.linear_mixture_em`) are pure
functions of a `LinearMixtureState`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from .._checks import as_float_array, check_layout, check_nonempty, check_nonnegative, check_tol
from ..exact import log_marginal, marginals
from ..mechanisms.dynamics import switching_linear_dynamics
from ._common import (
    check_covariances,
    check_linalg_dtype,
    check_weights,
    rel_change_small,
    safe_log,
    weighted_affine_fit,
)
from ._loop import LoopInfo, check, iterate, neg_log_likelihood

__all__ = ["LinearMixtureState", "init", "step", "run"]


class LinearMixtureState(NamedTuple):
    r"""State of [`linear_mixture_em`][structinfer.infer.linear_mixture_em]: modes and responsibilities.

    Attributes:
        A: `(K, d_y, d_u)` the modes' linear maps $A_k$.
        b: `(K, d_y)` their offsets $b_k$.
        covariances: `(K, d_y, d_y)` their noise covariances $\Sigma_k$.
        weights: `(K,)` mode weights $w_k$.
        responsibilities: `(T, K)` $r_{tk} = p(\phi_t = k \mid u, y)$.
        log_likelihood: $\log p(y \mid u)$.
    """

    A: jax.Array
    b: jax.Array
    covariances: jax.Array
    weights: jax.Array
    responsibilities: jax.Array
    log_likelihood: jax.Array


def _prepare(inputs, targets, A, b, covariances, weights):
    u = as_float_array(inputs, "linear_mixture_em: inputs")
    y = as_float_array(targets, "linear_mixture_em: targets")
    check_linalg_dtype(u, "linear_mixture_em: inputs")
    check_linalg_dtype(y, "linear_mixture_em: targets")
    vmap = "; for a batch of data sets map linear_mixture_em over it with jax.vmap"
    check_layout(u, 2, "linear_mixture_em: inputs", "(T, d_u)", vmap)
    check_layout(y, 2, "linear_mixture_em: targets", "(T, d_y)", vmap)
    check_nonempty(u, "linear_mixture_em: inputs", "(T, d_u)")
    A = jnp.asarray(A, y.dtype)
    b = jnp.asarray(b, y.dtype)
    covs = jnp.asarray(covariances, y.dtype)
    check_layout(A, 3, "linear_mixture_em: A", "(K, d_y, d_u)")
    check_layout(b, 2, "linear_mixture_em: b", "(K, d_y)")
    check_layout(covs, 3, "linear_mixture_em: covariances", "(K, d_y, d_y)")
    k = A.shape[0]
    if (u.shape[0] != y.shape[0] or A.shape[1:] != (y.shape[1], u.shape[1])
            or b.shape != (k, y.shape[1]) or covs.shape != (k, y.shape[1], y.shape[1])):
        raise ValueError(
            f"linear_mixture_em: inputs {tuple(u.shape)}, targets {tuple(y.shape)}, A "
            f"{tuple(A.shape)}, b {tuple(b.shape)}, covariances {tuple(covs.shape)} must be "
            "(T, d_u), (T, d_y), (K, d_y, d_u), (K, d_y), (K, d_y, d_y)"
        )
    covs = check_covariances(covs, "linear_mixture_em: covariances")
    w = check_weights(weights, k, y.dtype, "linear_mixture_em: weights")
    return u, y, A, b, covs, w


def _check_reg(reg):
    return check_nonnegative(reg, "linear_mixture_em: reg",
                             "the ridge added to every covariance and least-squares Gram matrix")


def _e_step(u, y, A, b, covs, w):
    args = (u, A, b, jnp.linalg.inv(covs), safe_log(w))
    kw = dict(targets=y, normalize=True)
    ll = log_marginal(switching_linear_dynamics, *args, **kw)
    return ll, marginals(switching_linear_dynamics, *args, **kw)["mode"].astype(y.dtype)


def _init(u, y, A, b, covs, w) -> LinearMixtureState:
    ll, resp = _e_step(u, y, A, b, covs, w)
    return LinearMixtureState(A, b, covs, w, resp, ll)


def init(
    inputs: ArrayLike,
    targets: ArrayLike,
    A: ArrayLike,
    b: ArrayLike,
    covariances: ArrayLike,
    weights: ArrayLike | None = None,
) -> LinearMixtureState:
    r"""Check and cast the arguments and run the first E-step.

    The E-step gives the responsibilities
    $r_{tk} \propto w_k \mathcal N(y_t; A_k u_t + b_k, \Sigma_k)$.

    Args:
        inputs: `(T, d_u)`.
        targets: `(T, d_y)`.
        A: `(K, d_y, d_u)`.
        b: `(K, d_y)`.
        covariances: `(K, d_y, d_y)`.
        weights: `(K,)` (default uniform).

    Returns:
        The `LinearMixtureState` at the initial parameters.

    Raises:
        TypeError: `inputs` or `targets` is a 16-bit float (the linear algebra needs float32 or
            float64).
        ValueError: no data (`T = 0`), shapes other than those above, covariances that are
            not symmetric positive definite, or weights that are negative or do not sum
            to 1.
    """
    return _init(*_prepare(inputs, targets, A, b, covariances, weights))


def _m_step(u, y, st: LinearMixtureState, reg):
    r = st.responsibilities  # (T, K)
    A_new, b_new, err, nk, live = weighted_affine_fit(u, y, r, st.A, st.b, reg)
    cov = jnp.einsum("tk,kti,ktj->kij", r, err, err) / jnp.where(live, nk, 1.0)[:, None, None]
    cov = cov + reg * jnp.eye(y.shape[1], dtype=y.dtype)
    cov = jnp.where(live[:, None, None], cov, st.covariances)
    return A_new, b_new, cov, nk / y.shape[0]


def step(
    inputs: jax.Array,
    targets: jax.Array,
    state: LinearMixtureState,
    *,
    reg: float = 0.0,
    tol: float = 1e-8,
) -> tuple[LinearMixtureState, jax.Array]:
    r"""One EM iteration: weighted least squares at `state.responsibilities`, then the E-step.

    The M-step is that of [`linear_mixture_em`][structinfer.infer.linear_mixture_em].

    Args:
        inputs: `(T, d_u)` (as cast by `init`).
        targets: `(T, d_y)` (as cast by `init`).
        state: the current `LinearMixtureState`.
        reg: ridge added to every covariance and least-squares Gram matrix
            (non-negative).
        tol: the convergence tolerance (a non-negative number; anything else raises
            `ValueError`).

    Returns:
        `(new_state, converged)`: `converged` when the log-likelihood changed by at most
            `tol * max(1, |ll|)`.

    Raises:
        ValueError: a negative `reg` (a traced one makes the state NaN instead).
    """
    tol = check_tol(tol, "linear_mixture_em: tol")
    A, b, cov, w = _m_step(inputs, targets, state, _check_reg(reg))
    ll, resp = _e_step(inputs, targets, A, b, cov, w)
    new = LinearMixtureState(A, b, cov, w, resp, ll)
    return new, rel_change_small(ll, state.log_likelihood, tol)


def run(
    inputs: ArrayLike,
    targets: ArrayLike,
    A: ArrayLike,
    b: ArrayLike,
    covariances: ArrayLike,
    weights: ArrayLike | None = None,
    *,
    reg: float = 0.0,
    tol: float = 1e-8,
    max_iters: int = 100,
    raise_on_nonfinite: bool = True,
) -> tuple[LinearMixtureState, LoopInfo]:
    r"""EM for a mixture of linear regressions / switching linear dynamics (iid modes).

    E-step: $r_{tk} = \mathrm{softmax}_k(\ln w_k + \ln\mathcal N(y_t; A_k u_t + b_k, \Sigma_k))$
    (exact engine on `structinfer.mechanisms.switching_linear_dynamics` with
    `targets=y, normalize=True`). M-step, weighted least squares with
    $\tilde u_t = (u_t, 1)$:

    $$[A_k\; b_k] = \Big(\sum_t r_{tk} y_t \tilde u_t^\top\Big)
    \Big(\sum_t r_{tk}\tilde u_t\tilde u_t^\top + \text{reg}\,I\Big)^{-1},
    \quad
    \Sigma_k = \frac{\sum_t r_{tk} e_{tk} e_{tk}^\top}{\sum_t r_{tk}} + \text{reg}\,I,
    \quad w_k = \frac1T\sum_t r_{tk},$$

    $e_{tk} = y_t - A_k u_t - b_k$ (the zero of Tschantz's $\partial E/\partial A_k$,
    $\partial E/\partial b_k$; with `reg > 0` a ridge regression). A mode with no data
    ($\sum_t r_{tk} = 0$) keeps its parameters at weight 0, so it stays off (as in
    [`gmm_em`][structinfer.infer.gmm_em]). For a time series $x$, pass
    `inputs = x[:-1]`, `targets = x[1:]`.

    Args:
        inputs: `(T, d_u)`.
        targets: `(T, d_y)`.
        A: `(K, d_y, d_u)`.
        b: `(K, d_y)`.
        covariances: `(K, d_y, d_y)`.
        weights: `(K,)` (default uniform): non-negative, summing to 1.
        reg: ridge added to every covariance and to every mode's least-squares Gram
            matrix: keeps both invertible when a mode has fewer points than $d_u + 1$
            or fits them exactly. Non-negative (under `jax.jit`, where it cannot be
            checked, a negative `reg` gives a NaN energy: `info.nonfinite`).
        tol: converged when the log-likelihood changes by at most `tol * max(1, |ll|)`.
        max_iters: the most EM iterations.
        raise_on_nonfinite: raise `NonFiniteEnergyError` on a non-finite log-likelihood
            when the result is concrete.

    Returns:
        `(LinearMixtureState, LoopInfo)`; `info.energy` is $-\log p(y \mid u)$
            (non-increasing for `reg = 0`).

    Raises:
        TypeError: `inputs` or `targets` is a 16-bit float (the linear algebra needs float32 or
            float64).
        ValueError: no data (`T = 0`), shapes other than those above (for a batch of data sets use
            `jax.vmap`), covariances that are not symmetric positive definite (under
            `jax.jit`: a NaN energy), weights that are negative or do not sum to 1, a
            negative `reg`, or a `tol` that is not a non-negative number.

    Reference:
        Tschantz, "Attention via log-sum-exp energy" v2 sec. 10 and the slides' linear
        mixture.
    """
    u, y, A, b, covs, w = _prepare(inputs, targets, A, b, covariances, weights)
    state, info = iterate(_init, step, neg_log_likelihood, (u, y, A, b, covs, w), (u, y),
                          {"reg": _check_reg(reg), "tol": check_tol(tol, "linear_mixture_em: tol")},
                          max_iters, "linear_mixture_em")
    if raise_on_nonfinite:
        check(info, "linear_mixture_em", "'mode' (a mode with too few points to fit its A, b "
              "and covariance? set reg > 0)")
    return state, info
