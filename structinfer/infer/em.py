r"""Expectation–maximisation on log-sum-exp energies (Tschantz, "log-sum-exp expectation
maximisation" and "coordinate ascent"; Singh & Buckley sec. 4).

For an energy :math:`E(\{x\}, \{\mu\}; \theta) = -\sum_i \log\sum_k \exp \mathrm{sim}_\theta(x_i, \mu_k)`
the E-step computes the responsibilities (the attention)
:math:`r_{ik} = \mathrm{softmax}_k\, \mathrm{sim}_\theta(x_i, \mu_k)` — here by the exact
engine on a structinfer model — and the M-step updates :math:`\theta` given them:

* :func:`gmm_em` — Gaussian mixture, closed form (means, covariances, weights);
  the log-likelihood never decreases.
* :func:`linear_mixture_em` — mixture of linear regressions / switching linear
  dynamics :math:`y_t \approx A_k u_t + b_k`, weighted least squares for
  :math:`A_k, b_k` and :math:`\Sigma_k`.
* :func:`slot_em` / :func:`slot_m_step` — slot attention's :math:`W_K, W_Q` by
  weighted least squares (whitened on the range, slots tied to the E-step's fixed
  point) with the E-step on the slots.
* :func:`energy_em` — the general scheme: E-step = gradient descent on the latents
  to a minimum of the energy, M-step = a gradient step on :math:`\theta`.
* :func:`expand` — Bayesian model expansion: a child whose energy exceeds
  :math:`\tau` becomes a new parent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpyro

from .._checks import as_float_array, check_ndim, is_concrete
from ..exact import log_marginal, marginals
from ..primitives import edge
from ..priors import Categorical, Uniform
from ..scores import Custom, Dot, NegSqDist
from ._loop import LoopInfo, check, run_loop
from .collapsed_vi import cccp, gradient_descent

__all__ = [
    "GMMState",
    "gmm_model",
    "gmm_em",
    "LinearMixtureState",
    "linear_mixture_model",
    "linear_mixture_em",
    "SlotState",
    "slot_model",
    "slot_m_step",
    "slot_em",
    "EMState",
    "energy_em",
    "ExpansionResult",
    "expand",
]


def _rel_change_small(new, old, tol):
    return jnp.abs(new - old) <= tol * jnp.maximum(1.0, jnp.abs(new))


def _safe_log(w):
    return jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)), -jnp.inf)


# ------------------------------------------------------------------------------ GMM


def gmm_model(x, means, precisions, weights):
    r"""A Gaussian mixture as a structinfer model: point :math:`i` takes component
    :math:`\phi_i` with prior :math:`w` and score :math:`\log\mathcal N(x_i;\mu_k,\Lambda_k^{-1})`,
    so :math:`\log Z = \sum_i \log\sum_k w_k \mathcal N(x_i; \mu_k, \Lambda_k^{-1})`.

    Args:
        x: ``(points, d)``; means ``(K, d)``; precisions ``(K, d, d)``; weights ``(K,)``
            (zero weights switch a component off).
    """
    with numpyro.plate("points", x.shape[-2]):
        edge("component", Categorical(_safe_log(weights)),
             NegSqDist(x, means, precision=precisions, normalize=True))


class GMMState(NamedTuple):
    """:func:`gmm_em` state: parameters, responsibilities ``(points, K)`` and log-likelihood."""

    means: jax.Array
    covariances: jax.Array
    weights: jax.Array
    responsibilities: jax.Array
    log_likelihood: jax.Array


def _gmm_e_step(x, means, covs, weights):
    prec = jnp.linalg.inv(covs)
    ll = log_marginal(gmm_model, x, means, prec, weights)
    resp = marginals(gmm_model, x, means, prec, weights)["component"]
    return ll, resp


def _gmm_m_step(x, resp, old_means, old_covs, reg):
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


def gmm_em(
    x,
    means,
    covariances,
    weights=None,
    *,
    reg: float = 0.0,
    tol: float = 1e-8,
    max_iters: int = 100,
    raise_on_nonfinite: bool = True,
) -> tuple[GMMState, LoopInfo]:
    r"""EM for a Gaussian mixture with the closed-form M-step.

    E-step (exact engine on :func:`gmm_model`):
    :math:`r_{ik} = \mathrm{softmax}_k\big(\ln w_k + \ln\mathcal N(x_i;\mu_k,\Sigma_k)\big)`.
    M-step: :math:`N_k = \sum_i r_{ik}`, :math:`w_k = N_k/N`,
    :math:`\mu_k = \sum_i r_{ik} x_i / N_k`,
    :math:`\Sigma_k = \sum_i r_{ik}(x_i-\mu_k)(x_i-\mu_k)^\top / N_k + \text{reg}\, I`
    (Tschantz sec. 2: the M-step is the zero of :math:`\partial E/\partial\mu_k`).
    With ``reg = 0`` the log-likelihood never decreases (Dempster et al.).
    Components with zero weight stay off.

    Args:
        x: ``(points, d)`` data.
        means: ``(K, d)``; covariances: ``(K, d, d)``; weights: ``(K,)`` (default uniform).
        reg: ridge added to every covariance (keeps them invertible).
        tol: converged when the log-likelihood changes by at most ``tol * max(1, |ll|)``.
        max_iters: the most EM iterations.

    Returns:
        ``(GMMState, LoopInfo)``; ``info.energy[t]`` is :math:`-\log p(x)` after ``t``
        iterations (non-increasing).
    """
    x = as_float_array(x, "gmm_em: x")
    check_ndim(x, 2, "gmm_em: x", "(points, d)")
    means = jnp.asarray(means, x.dtype)
    covs = jnp.asarray(covariances, x.dtype)
    k, d = means.shape
    if x.shape[-1] != d or covs.shape != (k, d, d):
        raise ValueError(
            f"gmm_em: x {tuple(x.shape)}, means {tuple(means.shape)} and covariances "
            f"{tuple(covs.shape)} must be (points, d), (K, d), (K, d, d)"
        )
    w = jnp.full((k,), 1.0 / k, x.dtype) if weights is None else jnp.asarray(weights, x.dtype)
    ll, resp = _gmm_e_step(x, means, covs, w)
    state = GMMState(means, covs, w, resp, ll)

    def step(st: GMMState):
        mu, cov, wt = _gmm_m_step(x, st.responsibilities, st.means, st.covariances, reg)
        ll_new, resp_new = _gmm_e_step(x, mu, cov, wt)
        new = GMMState(mu, cov, wt, resp_new, ll_new)
        return new, -ll_new, _rel_change_small(ll_new, st.log_likelihood, tol)

    state, info = run_loop(step, state, -ll, max_iters)
    if raise_on_nonfinite:
        check(info, "gmm_em", "'component' (a covariance became singular? set reg > 0)")
    return state, info


# ---------------------------------------------------------------- linear mixture / SLDS


def _gauss_logpdf_table(y, pred, covs):
    """``log N(y_t; pred_k,t, Σ_k)`` as ``(T, K)``; pred ``(K, T, d)``, covs ``(K, d, d)``."""
    chol = jnp.linalg.cholesky(covs)
    diff = y[None] - pred  # (K, T, d)
    sol = jax.scipy.linalg.solve_triangular(chol, jnp.swapaxes(diff, -1, -2), lower=True)
    maha = jnp.sum(sol * sol, axis=-2)  # (K, T)
    logdet = 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)), -1)
    d = y.shape[-1]
    return (-0.5 * (maha + logdet[:, None] + d * jnp.log(2 * jnp.pi))).T


def _predict(inputs, A, b):
    return jnp.einsum("kij,tj->kti", A, inputs) + b[:, None, :]


def linear_mixture_model(inputs, targets, A, b, covariances, weights):
    r"""Mixture of linear-Gaussian modes as a structinfer model: target :math:`y_t` takes a
    mode :math:`\phi_t` with prior :math:`w` and score
    :math:`\log\mathcal N(y_t; A_k u_t + b_k, \Sigma_k)` (Tschantz sec. 10, the SLDS energy
    with :math:`u_t = x_t`, :math:`y_t = x_{t+1}`)."""
    with numpyro.plate("targets", targets.shape[-2]):
        table = _gauss_logpdf_table(targets, _predict(inputs, A, b), covariances)
        edge("mode", Categorical(_safe_log(weights)), Custom(table))


class LinearMixtureState(NamedTuple):
    """:func:`linear_mixture_em` state: ``A (K, d_y, d_u)``, ``b (K, d_y)``,
    ``covariances (K, d_y, d_y)``, ``weights (K,)``, responsibilities ``(T, K)``, log-likelihood."""

    A: jax.Array
    b: jax.Array
    covariances: jax.Array
    weights: jax.Array
    responsibilities: jax.Array
    log_likelihood: jax.Array


def linear_mixture_em(
    inputs,
    targets,
    A,
    b,
    covariances,
    weights=None,
    *,
    reg: float = 0.0,
    tol: float = 1e-8,
    max_iters: int = 100,
    raise_on_nonfinite: bool = True,
) -> tuple[LinearMixtureState, LoopInfo]:
    r"""EM for a mixture of linear regressions / switching linear dynamics (iid modes).

    E-step: :math:`r_{tk} = \mathrm{softmax}_k(\ln w_k + \ln\mathcal N(y_t; A_k u_t + b_k, \Sigma_k))`
    (exact engine on :func:`linear_mixture_model`). M-step, weighted least squares with
    :math:`\tilde u_t = (u_t, 1)`:

    .. math::

        [A_k\; b_k] = \Big(\sum_t r_{tk} y_t \tilde u_t^\top\Big)\Big(\sum_t r_{tk}\tilde u_t\tilde u_t^\top\Big)^{-1},
        \quad
        \Sigma_k = \frac{\sum_t r_{tk} e_{tk} e_{tk}^\top}{\sum_t r_{tk}} + \text{reg}\,I,
        \quad w_k = \frac1T\sum_t r_{tk},

    :math:`e_{tk} = y_t - A_k u_t - b_k` (the zero of Tschantz's
    :math:`\partial E/\partial A_k`, :math:`\partial E/\partial b_k`). For a time series
    :math:`x`, pass ``inputs = x[:-1]``, ``targets = x[1:]``.

    Args:
        inputs: ``(T, d_u)``; targets: ``(T, d_y)``.
        A: ``(K, d_y, d_u)``; b: ``(K, d_y)``; covariances ``(K, d_y, d_y)``; weights ``(K,)``.

    Returns:
        ``(LinearMixtureState, LoopInfo)``; ``info.energy`` is :math:`-\log p(y \mid u)`
        (non-increasing for ``reg = 0``).
    """
    u = as_float_array(inputs, "linear_mixture_em: inputs")
    y = as_float_array(targets, "linear_mixture_em: targets")
    check_ndim(u, 2, "linear_mixture_em: inputs", "(T, d_u)")
    check_ndim(y, 2, "linear_mixture_em: targets", "(T, d_y)")
    A = jnp.asarray(A, y.dtype)
    b = jnp.asarray(b, y.dtype)
    covs = jnp.asarray(covariances, y.dtype)
    k = A.shape[0]
    if (u.shape[0] != y.shape[0] or A.shape[1:] != (y.shape[1], u.shape[1])
            or b.shape != (k, y.shape[1]) or covs.shape != (k, y.shape[1], y.shape[1])):
        raise ValueError(
            f"linear_mixture_em: inputs {tuple(u.shape)}, targets {tuple(y.shape)}, A "
            f"{tuple(A.shape)}, b {tuple(b.shape)}, covariances {tuple(covs.shape)} must be "
            "(T, d_u), (T, d_y), (K, d_y, d_u), (K, d_y), (K, d_y, d_y)"
        )
    w = jnp.full((k,), 1.0 / k, y.dtype) if weights is None else jnp.asarray(weights, y.dtype)
    ut = jnp.concatenate([u, jnp.ones((u.shape[0], 1), u.dtype)], -1)

    def e_step(A, b, covs, w):
        args = (u, y, A, b, covs, w)
        return log_marginal(linear_mixture_model, *args), marginals(
            linear_mixture_model, *args)["mode"]

    def m_step(st):
        r = st.responsibilities  # (T, K)
        gram = jnp.einsum("tk,ti,tj->kij", r, ut, ut)
        cross = jnp.einsum("tk,ti,tj->kij", r, y, ut)
        Ab = jnp.swapaxes(jnp.linalg.solve(gram, jnp.swapaxes(cross, -1, -2)), -1, -2)
        A_new, b_new = Ab[..., :-1], Ab[..., -1]
        err = y[None] - _predict(u, A_new, b_new)  # (K, T, d)
        nk = jnp.sum(r, 0)
        cov = jnp.einsum("tk,kti,ktj->kij", r, err, err) / nk[:, None, None]
        cov = cov + reg * jnp.eye(y.shape[1], dtype=y.dtype)
        return A_new, b_new, cov, nk / y.shape[0]

    ll, resp = e_step(A, b, covs, w)
    state = LinearMixtureState(A, b, covs, w, resp, ll)

    def step(st):
        A_new, b_new, cov, wt = m_step(st)
        ll_new, r_new = e_step(A_new, b_new, cov, wt)
        new = LinearMixtureState(A_new, b_new, cov, wt, r_new, ll_new)
        return new, -ll_new, _rel_change_small(ll_new, st.log_likelihood, tol)

    state, info = run_loop(step, state, -ll, max_iters)
    if raise_on_nonfinite:
        check(info, "linear_mixture_em", "'mode' (a mode lost its data? set reg > 0)")
    return state, info


# --------------------------------------------------------------------- slot attention


def slot_model(x, slots, wk, wq):
    r"""Slot attention as a structinfer model (Singh & Buckley sec. 4.3): every token
    :math:`x_j` takes a slot :math:`\phi_j` uniformly, score
    :math:`(W_K x_j)^\top (W_Q \mu_i)` — the softmax runs over the slots."""
    with numpyro.plate("tokens", x.shape[-2]):
        edge("slot", Uniform(slots.shape[-2]), Dot(x @ wk.T, slots @ wq.T))


def _default_rtol(dtype, *dims) -> float:
    """Relative eigenvalue cut-off ``10 * max(dims) * eps(dtype)`` (NumPy's ``pinv`` default)."""
    return 10.0 * max(dims) * float(jnp.finfo(dtype).eps)


def _slot_rank(x, slots, wk, wq) -> int:
    """Static bound on the rank of the fitted ``W_K``, ``W_Q``: ``min(d_k, S, d_mu, d_x)``."""
    return min(wk.shape[0], slots.shape[-2], wq.shape[-1], x.shape[-1])


def _pinv_sqrt_psd(c, rank: int, rtol: float):
    r""":math:`C^{+1/2} = \sum_{\lambda_a > \tau} \lambda_a^{-1/2} v_a v_a^\top` for p.s.d. :math:`C`.

    Only the ``rank`` largest eigenvalues (a static bound from the shapes) that exceed
    :math:`\tau = \mathrm{rtol}\cdot\lambda_{\max}` are inverted; the rest, exact zeros
    that rounding turned into :math:`\pm\varepsilon\lambda_{\max}`, are set to 0, so
    :math:`C^{+1/2} C\, C^{+1/2}` is the orthogonal projector onto the range of :math:`C`.
    """
    evals, evecs = jnp.linalg.eigh(0.5 * (c + jnp.swapaxes(c, -1, -2)))  # ascending
    d = c.shape[-1]
    keep = (jnp.arange(d) >= d - rank) & (evals > rtol * jnp.max(evals))
    inv = jnp.where(keep, jax.lax.rsqrt(jnp.where(keep, evals, 1.0)), 0.0)
    return (evecs * inv) @ evecs.T


def _polar(m):
    r"""Orthogonal polar factor :math:`U V^\top` of :math:`m = U \Sigma V^\top`: the
    :math:`O` with orthonormal rows (or columns) maximising :math:`\mathrm{tr}(O^\top m)`."""
    u, _, vt = jnp.linalg.svd(m, full_matrices=False)
    return u @ vt


def slot_m_step(x, slots, attention, wk, wq, *, whiten: bool = True, ridge: float = 0.0,
                rtol: float | None = None):
    r"""Weighted least squares for :math:`W_Q` then :math:`W_K` (Tschantz, "coordinate ascent"):

    .. math::

        \min \sum_{j,i} A_{ji} \|W_K x_j - W_Q \mu_i\|^2: \quad
        W_Q = \Big(\sum A_{ji} W_K x_j \mu_i^\top\Big)\Big(\sum A_{ji}\mu_i\mu_i^\top\Big)^{+},\quad
        W_K = \Big(\sum A_{ji} W_Q \mu_i x_j^\top\Big)\Big(\sum A_{ji} x_j x_j^\top\Big)^{+}.

    Gram matrices are pseudo-inverted (minimum-norm solutions when they are singular,
    e.g. fewer slots than slot dimensions). The objective is minimised jointly by
    :math:`W_K = W_Q = 0`, and alternating the two solves shrinks both towards it (each
    is a regression; their product has the squared canonical correlations as
    eigenvalues). ``whiten=True`` adds the scale constraint
    :math:`W_K C_{xx} W_K^\top = \Pi` (:math:`C_{xx} = \sum A x x^\top / \sum A`) after
    the :math:`W_K` solve, :math:`W_K \leftarrow (W_K C_{xx} W_K^\top)^{+1/2} W_K`,
    which turns the alternation into the power iteration of weighted canonical
    correlation analysis between tokens and their slots. :math:`\Pi` is the orthogonal
    projector onto the range of :math:`W_K C_{xx} W_K^\top`: :math:`I` when it has full
    rank, rank :math:`\le \min(S, d_\mu, d_x)` otherwise (e.g. more key dimensions than
    slots) — the whitening acts on that range only, so it is continuous in the data.

    This single step leaves the gauge :math:`(\mu, W_Q) \to (c\mu, W_Q/c)` free (it
    changes no score, but the E-step fixes :math:`|\mu| \propto |W_Q|`); :func:`slot_em`
    uses the well-posed variant described there.

    Args:
        x: ``(tokens, d_x)``.
        slots: ``(S, d_mu)``.
        attention: ``(tokens, S)``, rows sum to 1.
        wk: ``(d_k, d_x)``.
        wq: ``(d_k, d_mu)``.
        whiten: apply the scale constraint above.
        ridge: added to both Gram matrices.
        rtol: eigenvalue cut-off relative to the largest eigenvalue for the
            pseudo-inverses and the whitening; default ``10 * max(shape) * eps(dtype)``.

    Returns:
        ``(wk, wq)``.

    Reference: Singh & Buckley sec. 4.3 (the score :math:`\mu_i^\top W_Q^\top W_K x_j`);
    Tschantz, coordinate ascent for ``W_K, W_Q``.
    """
    A = attention
    rtol = _default_rtol(x.dtype, *wk.shape, *wq.shape, *slots.shape) if rtol is None else rtol
    cxx = jnp.einsum("js,ja,jb->ab", A, x, x) + ridge * jnp.eye(x.shape[-1], dtype=x.dtype)
    cmm = jnp.einsum("js,sa,sb->ab", A, slots, slots) + ridge * jnp.eye(
        slots.shape[-1], dtype=x.dtype)
    cxm = jnp.einsum("js,ja,sb->ab", A, x, slots)  # Σ A x μ^T
    # pseudo-inverses: with fewer slots than slot dims the slot Gram matrix is singular,
    # and the minimum-norm least-squares solution is the one we take
    wq_new = wk @ cxm @ jnp.linalg.pinv(cmm, rtol=rtol, hermitian=True)
    wk_new = wq_new @ cxm.T @ jnp.linalg.pinv(cxx, rtol=rtol, hermitian=True)
    if whiten:
        c = wk_new @ (cxx / jnp.sum(A)) @ wk_new.T
        wk_new = _pinv_sqrt_psd(c, _slot_rank(x, slots, wk, wq), rtol) @ wk_new
    return wk_new, wq_new


def _slot_em_m_step(x, slots, attention, wk, wq, *, whiten: bool, ridge: float, rtol: float):
    r"""The M-step of :func:`slot_em`: ``(wk, wq, slots)`` (see its docstring, steps 1–4)."""
    A = attention
    n = jnp.sum(A, 0)  # N_i, the slots' masses
    eye = jnp.eye(x.shape[-1], dtype=x.dtype)
    # 1. W_K by weighted least squares given the queries q_i = W_Q mu_i
    q = slots @ wq.T
    cxx = jnp.einsum("js,ja,jb->ab", A, x, x) + ridge * eye
    wk_new = jnp.einsum("js,sa,jb->ab", A, q, x) @ jnp.linalg.pinv(cxx, rtol=rtol, hermitian=True)
    if whiten:
        # 2. unit within-slot key covariance, on its range (centred in difference form:
        #    no cancellation when the slots are far apart relative to their spread)
        xbar = (A.T @ x) / jnp.where(n > 0, n, 1.0)[:, None]
        diff = x[:, None, :] - xbar[None, :, :]
        cw = (jnp.einsum("js,jsa,jsb->ab", A, diff, diff) + ridge * eye) / jnp.sum(A)
        wk_new = _pinv_sqrt_psd(wk_new @ cw @ wk_new.T, _slot_rank(x, slots, wk, wq),
                                rtol) @ wk_new
        # 3. the rotation left free by 2: the orthogonal R closest to the previous W_K
        wk_new = _polar(wk @ wk_new.T) @ wk_new
    # 4. W_Q with the slots tied to their E-step fixed point mu_i = W_Q^T m_i:
    #    min_P sum_i [N_i m_i^T P^2 m_i - 2 m_i^T P m_i], P = W_Q W_Q^T  <=>  PD + DP = 2B
    m = A.T @ (x @ wk_new.T)  # (S, d_k), m_i = sum_j A_ji k_j
    big_d = jnp.einsum("s,sa,sb->ab", n, m, m)
    big_b = m.T @ m
    d, v = jnp.linalg.eigh(0.5 * (big_d + big_d.T))
    den = d[:, None] + d[None, :]
    ok = den > rtol * jnp.max(d)
    p_tilde = jnp.where(ok, 2.0 * (v.T @ big_b @ v) / jnp.where(ok, den, 1.0), 0.0)
    p_mat = v @ p_tilde @ v.T
    # W_Q W_Q^T = P (its d_mu largest eigenvalues when rank P > d_mu), W_Q the closest
    # such factor to the previous W_Q (fixes the gauge mu -> O mu, W_Q -> W_Q O^T)
    dk = wk.shape[0]
    r = min(dk, wq.shape[-1])
    p, u = jnp.linalg.eigh(0.5 * (p_mat + p_mat.T))
    p, u = p[dk - r:], u[:, dk - r:]
    p = jnp.where(p > rtol * jnp.max(p), p, 0.0)
    factor = u * jnp.sqrt(p)  # (d_k, r), factor factor^T = P
    wq_new = factor @ _polar(factor.T @ wq)
    return wk_new, wq_new, m @ wq_new


def _rel_change_small_tree(new, old, tol):
    """``||new - old|| <= tol * ||new||`` (Frobenius) for every leaf."""
    small = [jnp.sqrt(jnp.sum((a - b) ** 2)) <= tol * jnp.sqrt(jnp.sum(a**2))
             for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old))]
    return jnp.all(jnp.stack(small))


class SlotState(NamedTuple):
    """:func:`slot_em` state: slots ``(S, d_mu)``, ``wk``, ``wq``, attention ``(tokens, S)``."""

    slots: jax.Array
    wk: jax.Array
    wq: jax.Array
    attention: jax.Array
    energy: jax.Array


def slot_em(
    x,
    slots,
    wk,
    wq,
    *,
    e_iters: int = 20,
    whiten: bool = True,
    ridge: float = 0.0,
    tol: float = 1e-6,
    max_iters: int = 50,
    raise_on_nonfinite: bool = True,
    rtol: float | None = None,
) -> tuple[SlotState, LoopInfo]:
    r"""Slot attention with learned :math:`W_K, W_Q`: E-step on the slots, WLS M-step.

    E-step: ``e_iters`` CCCP steps on the slots of :func:`slot_model`,

    .. math::

        \mu_i \leftarrow W_Q^\top m_i,\qquad m_i = \sum_j A_{ji} k_j,\quad
        A_{ji} = \mathrm{softmax}_i(k_j^\top W_Q \mu_i),\quad k_j = W_K x_j

    (Singh & Buckley eq. 8, node potential :math:`\tfrac12\|\mu\|^2`), and the attention
    :math:`A` at the result. M-step, at that attention, with :math:`N_i = \sum_j A_{ji}`:

    1. :math:`W_K` by weighted least squares given the queries :math:`q_i = W_Q\mu_i`,
       :math:`W_K = (\sum A_{ji} q_i x_j^\top)(\sum A_{ji} x_j x_j^\top)^{+}`.
    2. (``whiten``) :math:`W_K \leftarrow (W_K \Sigma_w W_K^\top)^{+1/2} W_K`,
       :math:`\Sigma_w = \sum_{ji} A_{ji}(x_j-\bar x_i)(x_j-\bar x_i)^\top / \sum A`,
       :math:`\bar x_i = \sum_j A_{ji}x_j / N_i`: unit within-slot key covariance, i.e.
       the residual covariance of :math:`\sum A\|k_j - q_i\|^2` read as a Gaussian
       likelihood, at its best :math:`q_i = \bar k_i`, absorbed into :math:`W_K` (this
       sets the scale of the scores, hence how sharp the attention is). The
       pseudo-inverse square root acts on the range only: :math:`W_K` has rank
       :math:`\le \min(S, d_\mu, d_x)`, which can be below :math:`d_k`.
    3. (``whiten``) :math:`W_K \leftarrow R W_K` with :math:`R` the orthogonal matrix
       closest to the previous :math:`W_K` (Procrustes): 2. leaves a rotation of the key
       space free, which changes no score.
    4. :math:`W_Q` with the slots tied to the E-step's fixed point
       :math:`\mu_i = W_Q^\top m_i`: the weighted least squares
       :math:`\sum A_{ji}\|k_j - W_Q\mu_i\|^2` then depends on :math:`W_Q` only through
       :math:`P = W_Q W_Q^\top`,

       .. math::

          \min_P \sum_i N_i m_i^\top P^2 m_i - 2\, m_i^\top P m_i
          \iff PD + DP = 2B,\quad D = \textstyle\sum_i N_i m_i m_i^\top,\
          B = \textstyle\sum_i m_i m_i^\top,

       a strictly convex quadratic on the range of :math:`D`, solved in :math:`D`'s
       eigenbasis (:math:`\tilde P_{ab} = 2\tilde B_{ab}/(d_a + d_b)`; :math:`P \succeq 0`).
       :math:`W_Q` is the factor :math:`W_Q W_Q^\top = P` closest to the previous
       :math:`W_Q` (exact when :math:`\mathrm{rank}\,P \le d_\mu`, else the
       :math:`d_\mu` largest eigenvalues of :math:`P`), and the next E-step starts from
       :math:`\mu_i = W_Q^\top m_i`.

    Solving :math:`W_Q` against the previous E-step's slots instead (as
    :func:`slot_m_step` does) is ill-posed: the WLS :math:`W_Q` scales as
    :math:`1/|\mu|` and the E-step's :math:`\mu` as :math:`|W_Q|`, so :math:`|W_Q|`
    alternates between two values forever; step 4 removes that gauge
    (:math:`|W_Q|^2 \approx 1/N_i`, queries :math:`q_i \approx \bar k_i`).

    Converged when the energy, :math:`W_K`, :math:`W_Q` and the slots all changed by at
    most ``tol`` relatively in the last iteration
    (:math:`|\Delta F| \le \mathrm{tol}\max(1,|F|)`,
    :math:`\|\Delta\theta\|_F \le \mathrm{tol}\,\|\theta\|_F`). ``info.energy`` is the
    collapsed free energy :math:`F = \tfrac12\|\mu\|^2 - \log Z(\mu; W)` after each
    iteration; the WLS M-step is a surrogate (:math:`F` is unbounded below in the scale
    of :math:`W`), so :math:`F` is reported, not guaranteed to decrease.

    The dot-product score prefers the slot with the largest projection, not the nearest
    one: clusters must differ in direction (after :math:`W_K`), and slots that lose all
    their tokens in the first E-step (eq. 8 sums over a slot's tokens, so attention is
    rich-get-richer) stay empty — initialise the slots near distinct tokens.

    Args:
        x: ``(tokens, d_x)``.
        slots: ``(S, d_mu)`` initial slots.
        wk: ``(d_k, d_x)``; any ``d_k`` (also ``d_k > S``).
        wq: ``(d_k, d_mu)``.
        e_iters: CCCP steps per E-step.
        whiten: steps 2–3; without them the scale of :math:`W_K` is not fixed (the WLS
            objective is minimised by :math:`W = 0`).
        ridge: added to :math:`\sum A x x^\top` and to the within-slot scatter
            :math:`\sum A (x-\bar x)(x-\bar x)^\top`; use it when a slot's tokens can
            coincide (zero within-slot spread makes the attention arbitrarily sharp).
        tol: relative tolerance for the convergence test above.
        max_iters: the most EM iterations; stopping there is reported in ``info.status``.
        raise_on_nonfinite: raise :class:`~structinfer.infer.NonFiniteEnergyError` when
            the result is concrete and an energy was not finite.
        rtol: eigenvalue cut-off relative to the largest eigenvalue (pseudo-inverses,
            whitening, :math:`P`); default ``10 * max(shape) * eps(dtype)``.

    Returns:
        ``(SlotState, LoopInfo)``.

    Reference: Singh & Buckley sec. 4.3 and Table 1 (slot attention, eq. 8 E-step);
    Tschantz, coordinate ascent for ``W_K, W_Q``.
    """
    x = as_float_array(x, "slot_em: x")
    slots = jnp.asarray(slots, x.dtype)
    wk, wq = jnp.asarray(wk, x.dtype), jnp.asarray(wq, x.dtype)
    if wk.shape[-1] != x.shape[-1] or wq.shape[-1] != slots.shape[-1] or wk.shape[0] != wq.shape[0]:
        raise ValueError(
            f"slot_em: wk {tuple(wk.shape)} must be (d_k, d_x={x.shape[-1]}) and wq "
            f"{tuple(wq.shape)} (d_k, d_mu={slots.shape[-1]})"
        )
    rtol = _default_rtol(x.dtype, *wk.shape, *wq.shape, *slots.shape) if rtol is None else rtol

    def e_step(slots, wk, wq):
        log_z = lambda mu: log_marginal(slot_model, x, mu, wk, wq)  # noqa: E731
        st, _ = cccp(log_z, slots, max_iters=e_iters, raise_on_nonfinite=False)
        att = marginals(slot_model, x, st.mu, wk, wq)["slot"]
        return st.mu, att, st.energy

    mu, att, e = e_step(slots, wk, wq)
    state = SlotState(mu, wk, wq, att, e)

    def step(st):
        wk_new, wq_new, mu0 = _slot_em_m_step(x, st.slots, st.attention, st.wk, st.wq,
                                              whiten=whiten, ridge=ridge, rtol=rtol)
        mu, att, e = e_step(mu0, wk_new, wq_new)
        conv = _rel_change_small(e, st.energy, tol) & _rel_change_small_tree(
            (wk_new, wq_new, mu), (st.wk, st.wq, st.slots), tol)
        return SlotState(mu, wk_new, wq_new, att, e), e, conv

    state, info = run_loop(step, state, e, max_iters)
    if raise_on_nonfinite:
        check(info, "slot_em", "'slot'")
    return state, info


# ------------------------------------------------------------------ general scheme


class EMState(NamedTuple):
    """:func:`energy_em` state: ``latents`` and ``params`` (pytrees) and the energy."""

    latents: Any
    params: Any
    energy: jax.Array


def energy_em(
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
    r"""The general log-sum-exp EM (Tschantz): E-step = gradient descent on the latents
    to a minimum of the energy, M-step = one gradient step on the parameters.

    .. math::

        v^* = \arg\min_v E(v; \theta) \;\;(\text{gradient descent from the previous } v),
        \qquad \theta \leftarrow \theta - \eta_\theta\, \partial_\theta E(v^*; \theta).

    Args:
        energy_fn: ``(latents, params) -> E``, e.g. built from ``structinfer.energy``.
        latents, params: initial pytrees.
        e_step_size, e_iters, e_tol: the inner :func:`~structinfer.infer.gradient_descent`.
        m_step_size: :math:`\eta_\theta` (scalar or pytree like ``params``).
        tol: converged when :math:`E` changes by at most ``tol * max(1, |E|)``.
        max_iters: the most outer iterations.

    Returns:
        ``(EMState, LoopInfo)``; ``info.energy[t]`` is :math:`E(v^*_t; \theta_t)` after the
        E-step of iteration ``t`` at the parameters of iteration ``t``.
    """

    def e_step(v, th):
        st, _ = gradient_descent(lambda z: energy_fn(z, th), v, step_size=e_step_size,
                                 tol=e_tol, max_iters=e_iters, raise_on_nonfinite=False)
        return st.mu, st.energy

    lr = m_step_size

    def step(s: EMState):
        g = jax.grad(energy_fn, argnums=1)(s.latents, s.params)
        lr_tree = lr if jax.tree.structure(lr) == jax.tree.structure(g) else jax.tree.map(
            lambda _: lr, g)
        th = jax.tree.map(lambda p, gi, h: (p - h * gi).astype(jnp.result_type(p)),
                          s.params, g, lr_tree)
        v, e = e_step(s.latents, th)
        return EMState(v, th, e), e, _rel_change_small(e, s.energy, tol)

    v0, e0 = e_step(latents, params)
    state = EMState(v0, params, e0)
    state, info = run_loop(step, state, e0, max_iters)
    if raise_on_nonfinite:
        check(info, "energy_em", None)
    return state, info


# ------------------------------------------------------------------ model expansion


class ExpansionResult(NamedTuple):
    r"""What :func:`expand` returns.

    Attributes:
        parents: ``(K_max, ...)`` parent states (new ones initialised from children).
        active: ``(K_max,)`` bool, the parents in the model.
        energies: ``(children,)`` :math:`E_n = -\log\sum_{k\ \mathrm{active}} e^{\mathrm{sim}(x_n, z_k)}`
            of each child when it arrived (before any parent it caused was added).
        added: ``(children,)`` bool, children that became a new parent.
        overflow: True if some child exceeded :math:`\tau` with no free slot left.
    """

    parents: Any
    active: jax.Array
    energies: jax.Array
    added: jax.Array
    overflow: jax.Array


def expand(
    children: jax.Array,
    parents: Any,
    active: jax.Array,
    sim_fn: Callable[[jax.Array, Any], jax.Array],
    tau: float,
    init_fn: Callable[[jax.Array], Any] | None = None,
) -> ExpansionResult:
    r"""Bayesian model expansion (Tschantz): add a parent when a child is not explained.

    For children in order, with the current active parents :math:`\{z_k\}`,

    .. math::

        E_n = -\log \sum_{k\ \mathrm{active}} \exp \mathrm{sim}(x_n, z_k);
        \qquad E_n > \tau \;\Rightarrow\; z_{K+1} \leftarrow \mathrm{init}(x_n).

    Pure :func:`jax.lax.scan` over the children with a fixed capacity ``K_max``
    (the parents' leading dim); inactive slots are masked out of the log-sum-exp.

    Args:
        children: ``(N, ...)``.
        parents: pytree of ``(K_max, ...)`` arrays (inactive rows are placeholders).
        active: ``(K_max,)`` bool.
        sim_fn: ``(child, parents) -> (K_max,)`` similarities (log-potentials).
        tau: energy threshold.
        init_fn: child -> a parent row (pytree like one row of ``parents``); default identity.

    Returns:
        :class:`ExpansionResult`.
    """
    active = jnp.asarray(active, bool)
    init = init_fn or (lambda c: c)
    if is_concrete(active) and active.ndim != 1:
        raise ValueError(f"expand: active must be (K_max,), got shape {active.shape}")
    tau = jnp.asarray(tau)

    def body(carry, child):
        par, act, overflow = carry
        sim = jnp.where(act, sim_fn(child, par), -jnp.inf)
        e = -jax.nn.logsumexp(sim)
        free = ~act
        slot = jnp.argmax(free)
        want = e > tau
        add = want & jnp.any(free)
        row = init(child)
        par = jax.tree.map(
            lambda p, r: jnp.where(add, p.at[slot].set(jnp.asarray(r, p.dtype)), p), par, row)
        act = jnp.where(add, act.at[slot].set(True), act)
        return (par, act, overflow | (want & ~add)), (e, add)

    (par, act, overflow), (energies, added) = jax.lax.scan(
        body, (parents, active, jnp.asarray(False)), children)
    return ExpansionResult(par, act, energies, added, overflow)


