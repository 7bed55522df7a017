r"""EM for a Gaussian mixture with the closed-form M-step (Tschantz, "log-sum-exp
expectation maximisation", sec. 2).

The model is the catalogue's `structinfer.mechanisms.gaussian_mixture` with the
Gaussian normaliser (`normalize=True`): point $i$ takes component $\phi_i$ with prior
$w$ and score $\log\mathcal N(x_i;\mu_k,\Sigma_k)$, so
$\log Z = \sum_i \log\sum_k w_k \mathcal N(x_i; \mu_k, \Sigma_k)$ is the log-likelihood.
The E-step is the exact engine on it (responsibilities = the edge marginals of
`component`); the M-step is closed form.

`init`, `step` and `run` (exported as `structinfer.infer.gmm_em`) are pure functions
of a `GMMState`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from .._checks import as_float_array, check_layout, check_nonempty, check_nonnegative, check_tol
from ..exact import log_marginal, marginals
from ..mechanisms.mixtures import gaussian_mixture
from ._common import (
    check_covariances,
    check_linalg_dtype,
    check_weights,
    rel_change_small,
    safe_log,
)
from ._loop import LoopInfo, check, iterate, neg_log_likelihood

__all__ = ["GMMState", "init", "step", "run"]


class GMMState(NamedTuple):
    r"""[`gmm_em`][structinfer.infer.gmm_em] state: parameters, responsibilities $r_{ik}$, log-likelihood.

    Attributes:
        means: `(K, d)` component means $\mu_k$.
        covariances: `(K, d, d)` component covariances $\Sigma_k$.
        weights: `(K,)` mixture weights $w_k$.
        responsibilities: `(points, K)` $r_{ik} = p(\phi_i = k \mid x)$.
        log_likelihood: $\log p(x) = \sum_i \log\sum_k w_k \mathcal N(x_i; \mu_k, \Sigma_k)$.
    """

    means: jax.Array
    covariances: jax.Array
    weights: jax.Array
    responsibilities: jax.Array
    log_likelihood: jax.Array


def _e_step(x, means, covs, weights):
    args = (x, means, jnp.linalg.inv(covs), safe_log(weights))
    ll = log_marginal(gaussian_mixture, *args, normalize=True)
    resp = marginals(gaussian_mixture, *args, normalize=True)["component"].astype(x.dtype)
    return ll, resp


def _m_step(x, resp, old_means, old_covs, reg):
    nk = jnp.sum(resp, 0)
    live = nk > 0
    safe = jnp.where(live, nk, 1.0)
    weights = nk / x.shape[0]
    means = jnp.where(live[:, None], resp.T @ x / safe[:, None], old_means)
    diff = x[None, :, :] - means[:, None, :]  # (K, N, d)
    covs = jnp.einsum("nk,kni,knj->kij", resp, diff, diff) / safe[:, None, None]
    covs = covs + reg * jnp.eye(x.shape[1], dtype=x.dtype)
    covs = jnp.where(live[:, None, None], covs, old_covs)
    return means, covs, weights


def _prepare(x, means, covariances, weights):
    x = as_float_array(x, "gmm_em: x")
    check_linalg_dtype(x, "gmm_em: x")
    check_layout(x, 2, "gmm_em: x", "(points, d)",
                 "; for a batch of data sets map gmm_em over it with jax.vmap")
    check_nonempty(x, "gmm_em: x", "(points, d)")
    means = jnp.asarray(means, x.dtype)
    covs = jnp.asarray(covariances, x.dtype)
    check_layout(means, 2, "gmm_em: means", "(K, d)")
    check_layout(covs, 3, "gmm_em: covariances", "(K, d, d)")
    k, d = means.shape
    if x.shape[-1] != d or covs.shape != (k, d, d):
        raise ValueError(
            f"gmm_em: x {tuple(x.shape)}, means {tuple(means.shape)} and covariances "
            f"{tuple(covs.shape)} must be (points, d), (K, d), (K, d, d)"
        )
    covs = check_covariances(covs, "gmm_em: covariances")
    return x, means, covs, check_weights(weights, k, x.dtype, "gmm_em: weights")


def _check_reg(reg):
    return check_nonnegative(reg, "gmm_em: reg", "the ridge added to every covariance")


def _init(x, means, covs, w) -> GMMState:
    ll, resp = _e_step(x, means, covs, w)
    return GMMState(means, covs, w, resp, ll)


def init(
    x: ArrayLike, means: ArrayLike, covariances: ArrayLike, weights: ArrayLike | None = None
) -> GMMState:
    r"""Check and cast the arguments and run the first E-step.

    The E-step gives the responsibilities $r_{ik} \propto w_k\mathcal N(x_i;\mu_k,\Sigma_k)$.

    Args:
        x: `(points, d)` data.
        means: `(K, d)`.
        covariances: `(K, d, d)`.
        weights: `(K,)` (default uniform).

    Returns:
        The `GMMState` at the initial parameters.

    Raises:
        TypeError: `x` is a 16-bit float (the linear algebra needs float32 or
            float64).
        ValueError: no points, shapes other than `(points, d)`, `(K, d)`, `(K, d, d)`,
            covariances that are not symmetric positive definite, or weights that are
            negative or do not sum to 1.
    """
    return _init(*_prepare(x, means, covariances, weights))


def step(
    x: jax.Array, state: GMMState, *, reg: float = 0.0, tol: float = 1e-8
) -> tuple[GMMState, jax.Array]:
    r"""One EM iteration: the closed-form M-step at `state.responsibilities`, then the E-step.

    The M-step is that of [`gmm_em`][structinfer.infer.gmm_em].

    Args:
        x: `(points, d)` data (as cast by `init`).
        state: the current `GMMState`.
        reg: ridge added to every covariance (non-negative).
        tol: the convergence tolerance (a non-negative number; anything else raises
            `ValueError`).

    Returns:
        `(new_state, converged)`: `converged` when the log-likelihood changed by at most
            `tol * max(1, |ll|)`.

    Raises:
        ValueError: a negative `reg` (a traced one makes the state NaN instead).
    """
    tol = check_tol(tol, "gmm_em: tol")
    reg = _check_reg(reg)
    mu, cov, wt = _m_step(x, state.responsibilities, state.means, state.covariances, reg)
    ll, resp = _e_step(x, mu, cov, wt)
    return GMMState(mu, cov, wt, resp, ll), rel_change_small(ll, state.log_likelihood, tol)


def run(
    x: ArrayLike,
    means: ArrayLike,
    covariances: ArrayLike,
    weights: ArrayLike | None = None,
    *,
    reg: float = 0.0,
    tol: float = 1e-8,
    max_iters: int = 100,
    raise_on_nonfinite: bool = True,
) -> tuple[GMMState, LoopInfo]:
    r"""EM for a Gaussian mixture with the closed-form M-step.

    E-step (exact engine on `structinfer.mechanisms.gaussian_mixture`):
    $r_{ik} = \mathrm{softmax}_k\big(\ln w_k + \ln\mathcal N(x_i;\mu_k,\Sigma_k)\big)$.
    M-step: $N_k = \sum_i r_{ik}$, $w_k = N_k/N$, $\mu_k = \sum_i r_{ik} x_i / N_k$,
    $\Sigma_k = \sum_i r_{ik}(x_i-\mu_k)(x_i-\mu_k)^\top / N_k + \text{reg}\, I$
    (Tschantz sec. 2: the M-step is the zero of $\partial E/\partial\mu_k$).
    With `reg = 0` the log-likelihood never decreases (Dempster et al.).
    Components with zero weight stay off.

    Args:
        x: `(points, d)` data.
        means: `(K, d)`.
        covariances: `(K, d, d)`.
        weights: `(K,)` (default uniform).
        reg: ridge added to every covariance (keeps them invertible); non-negative
            (under `jax.jit`, where it cannot be checked, a negative `reg` gives a NaN
            energy: `info.nonfinite`).
        tol: converged when the log-likelihood changes by at most `tol * max(1, |ll|)`.
        max_iters: the most EM iterations.
        raise_on_nonfinite: raise `NonFiniteEnergyError` on a non-finite log-likelihood
            when the result is concrete.

    Returns:
        `(GMMState, LoopInfo)`; `info.energy[t]` is $-\log p(x)$ after `t` iterations
            (non-increasing).

    Raises:
        TypeError: `x` is a 16-bit float (the linear algebra needs float32 or
            float64).
        ValueError: no points, shapes other than `(points, d)`, `(K, d)`, `(K, d, d)` (for a batch
            of data sets use `jax.vmap`), covariances that are not symmetric positive
            definite (under `jax.jit`: a NaN energy), weights that are negative or do not
            sum to 1, a negative `reg`, or a `tol` that is not a non-negative number.

    Reference:
        Tschantz, "log-sum-exp expectation maximisation", sec. 2; Dempster et al.
        (1977).
    """
    x, means, covs, w = _prepare(x, means, covariances, weights)
    state, info = iterate(_init, step, neg_log_likelihood, (x, means, covs, w), (x,),
                          {"reg": _check_reg(reg), "tol": check_tol(tol, "gmm_em: tol")},
                          max_iters, "gmm_em")
    if raise_on_nonfinite:
        check(info, "gmm_em", "'component' (a covariance became singular? set reg > 0)")
    return state, info
