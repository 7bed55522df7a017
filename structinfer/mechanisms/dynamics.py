r"""Switching dynamics as log-sum-exp energies: the switching linear dynamical system,
dynamic mixture attention and the "Atari" model (Tschantz v2 secs. 7, 10; slides)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpyro

from .. import priors, scores
from ..primitives import edge
from ._common import check_matrix, features, latent_nodes

__all__ = ["switching_linear_dynamics", "dynamic_mixture_attention", "atari_model"]


def _transition_scores(x_prev, x_next, A, b, precisions, normalize: bool = False) -> jax.Array:
    r"""``-1/2 (x_{t+1} - A_k x_t - b_k)^T Lambda_k (...)``, shape ``(T-1, K)``; ``Lambda_k``
    diagonal ``(K, d)`` or full ``(K, d, d)``; ``normalize`` adds
    ``1/2 ln|Lambda_k| - d/2 ln 2 pi``."""
    resid = x_next[:, None, :] - jnp.einsum("kde,te->tkd", A, x_prev) - b
    full = jnp.ndim(precisions) == 3
    if full:
        s = -0.5 * jnp.einsum("tkd,kde,tke->tk", resid, precisions, resid)
    else:
        s = -0.5 * jnp.sum(resid * resid * precisions, -1)
    if normalize:
        logdet = jnp.linalg.slogdet(precisions)[1] if full else jnp.sum(jnp.log(precisions), -1)
        s = s + 0.5 * logdet - 0.5 * x_next.shape[-1] * math.log(2 * math.pi)
    return s


def _check_modes(A, b, d, name, d_in=None):
    d_in = d if d_in is None else d_in
    if A.ndim != 3 or A.shape[1:] != (d, d_in) or b.shape != (A.shape[0], d):
        raise ValueError(
            f"{name}: expected A (K, {d}, {d_in}) and b (K, {d}), got {tuple(A.shape)} and "
            f"{tuple(b.shape)}"
        )


def switching_linear_dynamics(
    x: jax.Array,
    A: jax.Array,
    b: jax.Array,
    precisions: jax.Array,
    log_weights: jax.Array,
    *,
    targets: jax.Array | None = None,
    normalize: bool = False,
) -> None:
    r"""Switching linear dynamical system: each transition takes one dynamical mode.

    Graph:
        a time series :math:`x_{1..T}`; child :math:`x_{t+1}`, parents the :math:`K` modes
        :math:`(A_k, b_k)` applied to :math:`x_t`; one edge site per transition.
    Prior:
        categorical, :math:`p(\phi_t = k) = \pi_k`.
    Potentials:
        :math:`-\tfrac12 r_{tk}^\top \Sigma_k^{-1} r_{tk}` with
        :math:`r_{tk} = x_{t+1} - A_k x_t - b_k` (diagonal :math:`\Sigma_k^{-1}`).
    Value:
        :math:`\alpha_{tk} = \mathrm{softmax}_k(\ln\pi_k - \tfrac12 r^\top\Sigma_k^{-1} r)`;
        :math:`-\partial E/\partial A_k = \sum_t \alpha_{tk}\Sigma_k^{-1} r_{tk} x_t^\top`,
        :math:`-\partial E/\partial b_k = \sum_t \alpha_{tk}\Sigma_k^{-1} r_{tk}`, and for the
        states :math:`-\partial E/\partial x_{t+1} \ni -\sum_k \alpha_{tk}\Sigma_k^{-1} r_{tk}`
        (as child), :math:`-\partial E/\partial x_t \ni +\sum_k \alpha_{tk} A_k^\top\Sigma_k^{-1}
        r_{tk}` (as parent). v1/v2 print both state terms with the opposite sign; a middle
        state receives both terms.

    With ``targets`` the transitions are given as pairs: ``x`` holds the inputs
    :math:`u_t` and ``targets`` the children :math:`y_t`, :math:`r_{tk} = y_t - A_k u_t - b_k`
    — a mixture of linear regressions (the time series is ``x[:-1]``, ``x[1:]``; this is
    the model :func:`structinfer.infer.linear_mixture_em` fits). ``normalize=True`` adds
    :math:`\tfrac12\ln|\Sigma_k^{-1}| - \tfrac d2\ln 2\pi`, so that the energy is
    :math:`-\ln p(y \mid u)`.

    Args:
        x: ``(T, d)``; with ``targets``, the inputs ``(T, d_u)``.
        A: ``(K, d, d)`` (with ``targets``: ``(K, d_y, d_u)``); b: ``(K, d)``.
        precisions: :math:`\Sigma_k^{-1}`, diagonal ``(K, d)`` or full ``(K, d, d)``.
        log_weights: ``(K,)`` log mixing weights (normalised; ``-inf`` switches a mode off).
        targets: optional ``(T, d_y)`` children paired with the rows of ``x``.
        normalize: include the Gaussian normaliser.

    Sites:
        ``mode`` (edge, children = transitions ``t = 1..T-1``, or the rows of ``targets``).

    Reference:
        Tschantz v2 sec. 10 (eq. 32) and appendix B.
    """
    x = features(x, "x", "switching_linear_dynamics")
    if targets is None:
        _check_modes(A, b, x.shape[-1], "switching_linear_dynamics")
        inputs, children = x[:-1], x[1:]
    else:
        children = features(targets, "targets", "switching_linear_dynamics")
        if children.shape[-2] != x.shape[-2]:
            raise ValueError(
                f"switching_linear_dynamics: x (inputs) has {x.shape[-2]} rows but targets "
                f"{children.shape[-2]}; they must pair up"
            )
        _check_modes(A, b, children.shape[-1], "switching_linear_dynamics", x.shape[-1])
        inputs = x
    k, dy = A.shape[0], children.shape[-1]
    if jnp.shape(precisions) not in ((k, dy), (k, dy, dy)):
        raise ValueError(
            f"switching_linear_dynamics: precisions must be diagonal ({k}, {dy}) or full "
            f"({k}, {dy}, {dy}), got {tuple(jnp.shape(precisions))}"
        )
    table = _transition_scores(inputs, children, A, b, precisions, normalize)
    with numpyro.plate("transitions", children.shape[-2]):
        edge("mode", priors.Categorical(log_weights), table)


def dynamic_mixture_attention(
    x: jax.Array,
    z: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    A: jax.Array,
    b: jax.Array,
) -> None:
    r"""Dynamic mixture attention: each transition picks a mode that both attends to a parent
    and explains the dynamics.

    Graph:
        time series :math:`x_{1..T}`, parents :math:`z_{1..K}`; mode :math:`k` pairs parent
        :math:`z_k` with dynamics :math:`(A_k, b_k)`; one edge site per transition.
    Prior:
        uniform over modes.
    Potentials:
        :math:`\mathrm{sim}_{\mathrm{parents}}(x_t, z_k) + \mathrm{sim}_{\mathrm{dynamics}} =
        (W^Q x_t)^\top (W^K z_k) - \tfrac12\|x_{t+1} - A_k x_t - b_k\|^2` (a ``Sum`` score).
    Value:
        :math:`\alpha_{tk}` and, with :math:`r_{tk} = x_{t+1} - A_k x_t - b_k`:
        :math:`-\partial E/\partial A_k = \sum_t \alpha_{tk} r_{tk} x_t^\top`,
        :math:`-\partial E/\partial b_k = \sum_t \alpha_{tk} r_{tk}`,
        :math:`-\partial E/\partial z_k = \sum_t \alpha_{tk} W^{K\top} W^Q x_t`; for the states
        :math:`-\sum_k\alpha_{tk} r_{tk}` (as child) and
        :math:`\sum_k \alpha_{tk}[W^{Q\top}W^K z_k + A_k^\top r_{tk}]` (as parent); v2 prints the
        two :math:`r` terms with the opposite sign.

    Args:
        x: ``(T, d)``; z: ``(K, d_z)``; wq: ``(d_k, d)``; wk: ``(d_k, d_z)``;
        A: ``(K, d, d)``; b: ``(K, d)``.

    Sites:
        ``mode`` (edge, children = transitions).

    Reference:
        Tschantz v2 sec. 7 (eq. 27).
    """
    x = features(x, "x", "dynamic_mixture_attention")
    z = features(z, "z", "dynamic_mixture_attention")
    _check_modes(A, b, x.shape[-1], "dynamic_mixture_attention")
    check_matrix(wq, "wq", "dynamic_mixture_attention", x.shape[-1])
    check_matrix(wk, "wk", "dynamic_mixture_attention", z.shape[-1])
    if z.shape[-2] != A.shape[0]:
        raise ValueError(
            f"dynamic_mixture_attention: {z.shape[-2]} parents but {A.shape[0]} modes; "
            "each mode pairs one parent with one dynamics"
        )
    ones = jnp.ones(x.shape[-1], x.dtype)
    score = scores.Sum(
        scores.Dot(x[:-1] @ wq.T, z @ wk.T),
        scores.Custom(_transition_scores(x[:-1], x[1:], A, b, ones)),
    )
    with numpyro.plate("transitions", x.shape[-2] - 1):
        edge("mode", priors.Uniform(A.shape[0]), score)


def atari_model(
    x: jax.Array,
    A: jax.Array,
    b: jax.Array,
    obs_precisions: jax.Array,
    dyn_precisions: jax.Array,
) -> None:
    r"""The "Atari" model: a Gaussian-mixture observation of latent states that follow a
    linear mixture (switching) dynamics.

    Graph:
        observations :math:`x_{1..T}`, latent states :math:`z_{1..T}` (site ``z``, no node
        potential); two energy terms: :math:`x_t` explained by :math:`z_t` under one of
        :math:`K` observation modes, :math:`z_t` explained by :math:`z_{t-1}` under one of
        :math:`K` dynamics.
    Prior:
        uniform over the modes of each term.
    Potentials:
        :math:`\mathrm{sim}_{\mathrm{GMM}}^k(x_t, z_t) = -\tfrac12 (x_t-z_t)^\top \Sigma_k^{-1}(x_t-z_t)`,
        :math:`\mathrm{sim}_{\mathrm{LM}}^k(z_t, z_{t-1}) = -\tfrac12 r_{tk}^\top \Gamma_k^{-1} r_{tk}`,
        :math:`r_{tk} = z_t - A_k z_{t-1} - b_k` (diagonal precisions).
    Value:
        :math:`-\partial E/\partial z_t = \sum_k \alpha_{tk}\Sigma_k^{-1}(x_t - z_t)
        - \sum_k \beta_{tk}\Gamma_k^{-1} r_{tk} + \sum_k \beta_{t+1,k} A_k^\top \Gamma_k^{-1} r_{t+1,k}`.
        The slides show the first two (child) terms, the second with a + sign; the third is
        :math:`z_t`'s parent part (v2 eq. 4).

    Args:
        x: ``(T, d)``; A: ``(K, d, d)``; b: ``(K, d)``;
        obs_precisions, dyn_precisions: diagonal precisions ``(K, d)``.

    Sites:
        ``z`` (latent ``(T, d)``), ``obs_mode`` (edge, children = frames),
        ``dyn_mode`` (edge, children = transitions).

    Reference:
        Tschantz slides "Atari Model".
    """
    x = features(x, "x", "atari_model")
    T, d = x.shape[-2:]
    _check_modes(A, b, d, "atari_model")
    K = A.shape[0]
    z = latent_nodes("z", (T, d), None, x.dtype)
    diff = x - z
    obs = -0.5 * jnp.einsum("td,kd->tk", diff * diff, obs_precisions)
    with numpyro.plate("frames", T):
        edge("obs_mode", priors.Uniform(K), obs)
    with numpyro.plate("transitions", T - 1):
        edge("dyn_mode", priors.Uniform(K), _transition_scores(z[:-1], z[1:], A, b, dyn_precisions))
