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
  weighted least squares with the E-step on the slots.
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


def slot_m_step(x, slots, attention, wk, wq, *, whiten: bool = True, ridge: float = 0.0):
    r"""Weighted least squares for :math:`W_Q` then :math:`W_K` (Tschantz, "coordinate ascent"):

    .. math::

        \min \sum_{j,i} A_{ji} \|W_K x_j - W_Q \mu_i\|^2: \quad
        W_Q = \Big(\sum A_{ji} W_K x_j \mu_i^\top\Big)\Big(\sum A_{ji}\mu_i\mu_i^\top\Big)^{-1},\quad
        W_K = \Big(\sum A_{ji} W_Q \mu_i x_j^\top\Big)\Big(\sum A_{ji} x_j x_j^\top\Big)^{-1}.

    Gram matrices are pseudo-inverted (minimum-norm solutions when they are singular,
    e.g. fewer slots than slot dimensions). The objective is minimised jointly by :math:`W_K = W_Q = 0`, and alternating the two
    solves shrinks both towards it (each is a regression; their product has the squared
    canonical correlations as eigenvalues). ``whiten=True`` adds the scale constraint
    :math:`W_K C_{xx} W_K^\top = I` (:math:`C_{xx} = \sum A x x^\top / \sum A`) after the
    :math:`W_K` solve, which turns the alternation into the power iteration of weighted
    canonical correlation analysis between tokens and their slots.

    Args:
        x: ``(tokens, d_x)``; slots: ``(S, d_mu)``; attention ``(tokens, S)`` (rows sum to 1);
        wk: ``(d_k, d_x)``; wq: ``(d_k, d_mu)``. ridge: added to both Gram matrices.

    Returns:
        ``(wk, wq)``.
    """
    A = attention
    cxx = jnp.einsum("js,ja,jb->ab", A, x, x) + ridge * jnp.eye(x.shape[-1], dtype=x.dtype)
    cmm = jnp.einsum("js,sa,sb->ab", A, slots, slots) + ridge * jnp.eye(
        slots.shape[-1], dtype=x.dtype)
    cxm = jnp.einsum("js,ja,sb->ab", A, x, slots)  # Σ A x μ^T
    # pseudo-inverses: with fewer slots than slot dims the slot Gram matrix is singular,
    # and the minimum-norm least-squares solution is the one we take
    wq = wk @ cxm @ jnp.linalg.pinv(cmm, hermitian=True)
    wk = wq @ cxm.T @ jnp.linalg.pinv(cxx, hermitian=True)
    if whiten:
        c = wk @ (cxx / jnp.sum(A)) @ wk.T
        evals, evecs = jnp.linalg.eigh(0.5 * (c + c.T))
        inv_sqrt = (evecs / jnp.sqrt(jnp.maximum(evals, 1e-30))) @ evecs.T
        wk = inv_sqrt @ wk
    return wk, wq


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
) -> tuple[SlotState, LoopInfo]:
    r"""Slot attention with learned :math:`W_K, W_Q`: E-step on the slots, WLS M-step.

    E-step: ``e_iters`` CCCP steps on the slots of :func:`slot_model`
    (:math:`\mu_i \leftarrow \sum_j \mathrm{softmax}_i(\mu_i^\top W_Q^\top W_K x_j)\, W_Q^\top W_K x_j`,
    node potential :math:`\tfrac12\|\mu\|^2`). M-step: :func:`slot_m_step` at the new
    attention. ``info.energy`` is the collapsed free energy
    :math:`F = \tfrac12\|\mu\|^2 - \log Z(\mu; W)` after each iteration; with the WLS
    surrogate M-step it is reported, not guaranteed to decrease.

    Returns:
        ``(SlotState, LoopInfo)``.

    Reference: Singh & Buckley sec. 4 and Table 1 (slot attention, eq. 8 E-step); Tschantz, coordinate ascent for ``W_K, W_Q``.
    """
    x = as_float_array(x, "slot_em: x")
    slots = jnp.asarray(slots, x.dtype)
    wk, wq = jnp.asarray(wk, x.dtype), jnp.asarray(wq, x.dtype)
    if wk.shape[-1] != x.shape[-1] or wq.shape[-1] != slots.shape[-1] or wk.shape[0] != wq.shape[0]:
        raise ValueError(
            f"slot_em: wk {tuple(wk.shape)} must be (d_k, d_x={x.shape[-1]}) and wq "
            f"{tuple(wq.shape)} (d_k, d_mu={slots.shape[-1]})"
        )

    def e_step(slots, wk, wq):
        log_z = lambda mu: log_marginal(slot_model, x, mu, wk, wq)  # noqa: E731
        st, _ = cccp(log_z, slots, max_iters=e_iters, raise_on_nonfinite=False)
        att = marginals(slot_model, x, st.mu, wk, wq)["slot"]
        return st.mu, att, st.energy

    mu, att, e = e_step(slots, wk, wq)
    state = SlotState(mu, wk, wq, att, e)

    def step(st):
        wk_new, wq_new = slot_m_step(x, st.slots, st.attention, st.wk, st.wq,
                                     whiten=whiten, ridge=ridge)
        mu, att, e = e_step(st.slots, wk_new, wq_new)
        conv = jnp.max(jnp.abs(att - st.attention)) <= tol
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


