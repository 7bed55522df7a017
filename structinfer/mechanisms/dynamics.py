r"""Switching dynamics as log-sum-exp energies: the switching linear dynamical system,
dynamic mixture attention and the "Atari" model (Tschantz v2 secs. 7, 10; slides)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpyro

from .. import priors, scores
from .._checks import float32_at_least, positive_definite, require
from ..primitives import edge
from ._common import check_matrix, features, latent_nodes

__all__ = ["switching_linear_dynamics", "dynamic_mixture_attention", "atari_model"]


def _float32_at_least(*arrays) -> list[jax.Array]:
    """16-bit float arrays in float32 (a score table summed and kept in float32, as
    `structinfer.scores` keeps those of 16-bit features); others as they are."""
    return [float32_at_least(jnp.asarray(a)) for a in arrays]


def _transition_scores(x_prev, x_next, A, b, precisions, normalize: bool = False) -> jax.Array:
    r"""``-1/2 (x_{t+1} - A_k x_t - b_k)^T Lambda_k (...)``, shape ``(T-1, K)``; ``Lambda_k``
    diagonal ``(K, d)`` or full ``(K, d, d)``; ``normalize`` adds
    ``1/2 ln|Lambda_k| - d/2 ln 2 pi``. In float32 for 16-bit inputs."""
    x_prev, x_next, A, b, precisions = _float32_at_least(x_prev, x_next, A, b, precisions)
    full = jnp.ndim(precisions) == 3

    def positive(xp, p):  # the quadratic form reads the symmetric part
        return positive_definite(xp, p) if full else (p > 0) & (p < xp.inf)

    # slogdet's magnitude of an indefinite precision would be a finite wrong normaliser
    precisions = require(positive, "switching_linear_dynamics: precisions must be positive "
                         "(definite) and finite, got {}", precisions)
    resid = x_next[:, None, :] - jnp.einsum("kde,te->tkd", A, x_prev) - b
    if full:
        s = -0.5 * jnp.einsum("tkd,kde,tke->tk", resid, precisions, resid)
    else:
        s = -0.5 * jnp.sum(resid * resid * precisions, -1)
    if normalize:
        sym = 0.5 * (precisions + jnp.swapaxes(precisions, -1, -2)) if full else None
        logdet = jnp.linalg.slogdet(sym)[1] if full else jnp.sum(jnp.log(precisions), -1)
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
        a time series $x_{1..T}$; child $x_{t+1}$, parents the $K$ modes
        $(A_k, b_k)$ applied to $x_t$; one edge site per transition.

    Prior:
        categorical, $p(\phi_t = k) = \pi_k$.

    Potentials:
        $-\tfrac12 r_{tk}^\top \Sigma_k^{-1} r_{tk}$ with
        $r_{tk} = x_{t+1} - A_k x_t - b_k$ (diagonal or full $\Sigma_k^{-1}$).

    Value:
        $\alpha_{tk} = \mathrm{softmax}_k(\ln\pi_k - \tfrac12 r^\top\Sigma_k^{-1} r)$;
        $-\partial E/\partial A_k = \sum_t \alpha_{tk}\Sigma_k^{-1} r_{tk} x_t^\top$,
        $-\partial E/\partial b_k = \sum_t \alpha_{tk}\Sigma_k^{-1} r_{tk}$, and for the
        states $-\partial E/\partial x_{t+1} \ni -\sum_k \alpha_{tk}\Sigma_k^{-1} r_{tk}$
        (as child), $-\partial E/\partial x_t \ni +\sum_k \alpha_{tk} A_k^\top\Sigma_k^{-1}
        r_{tk}$ (as parent). v1/v2 print both state terms with the opposite sign; a middle
        state receives both terms.

    With ``targets`` the transitions are given as pairs: ``x`` holds the inputs
    $u_t$ and ``targets`` the children $y_t$, $r_{tk} = y_t - A_k u_t - b_k$
    — a mixture of linear regressions (the time series is ``x[:-1]``, ``x[1:]``; this is
    the model [`linear_mixture_em`][structinfer.infer.linear_mixture_em] fits). ``normalize=True`` adds
    $\tfrac12\ln|\Sigma_k^{-1}| - \tfrac d2\ln 2\pi$, so that the energy is
    $-\ln p(y \mid u)$.

    Args:
        x: the time series ``(T, d)``; with ``targets``, the inputs ``(T, d_u)``.
        A: mode dynamics $A_k$, ``(K, d, d)`` (with ``targets``: ``(K, d_y, d_u)``).
        b: mode offsets $b_k$, ``(K, d)``.
        precisions: precisions $\Sigma_k^{-1}$, diagonal ``(K, d)`` or full ``(K, d, d)``;
            positive (definite, to rounding; a full one is read through its symmetric
            part) and finite. Checked on concrete values; traced, a bad one makes the
            scores NaN.
        log_weights: mode log-weights $\ln \pi_k$, ``(K,)`` (normalised; ``-inf`` switches
            a mode off).
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
    r"""Dynamic mixture attention: each transition picks a mode for attention and dynamics.

    The mode both attends to a parent and explains the transition.

    Graph:
        time series $x_{1..T}$, parents $z_{1..K}$; mode $k$ pairs parent
        $z_k$ with dynamics $(A_k, b_k)$; one edge site per transition.

    Prior:
        uniform over modes.

    Potentials:
        $\mathrm{sim}_{\mathrm{parents}}(x_t, z_k) + \mathrm{sim}_{\mathrm{dynamics}} =
        (W^Q x_t)^\top (W^K z_k) - \tfrac12\|x_{t+1} - A_k x_t - b_k\|^2$ (a ``Sum`` score).

    Value:
        $\alpha_{tk}$ and, with $r_{tk} = x_{t+1} - A_k x_t - b_k$:
        $-\partial E/\partial A_k = \sum_t \alpha_{tk} r_{tk} x_t^\top$,
        $-\partial E/\partial b_k = \sum_t \alpha_{tk} r_{tk}$,
        $-\partial E/\partial z_k = \sum_t \alpha_{tk} W^{K\top} W^Q x_t$; for the states
        $-\sum_k\alpha_{tk} r_{tk}$ (as child) and
        $\sum_k \alpha_{tk}[W^{Q\top}W^K z_k + A_k^\top r_{tk}]$ (as parent); v2 prints the
        two $r$ terms with the opposite sign.

    Args:
        x: the time series ``(T, d)``.
        z: parents $z_k$, ``(K, d_z)``.
        wq: query projection $W^Q$, ``(d_k, d)``.
        wk: key projection $W^K$, ``(d_k, d_z)``.
        A: mode dynamics $A_k$, ``(K, d, d)``.
        b: mode offsets $b_k$, ``(K, d)``.

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
    r"""The "Atari" model: Gaussian-mixture observations of switching linear latent dynamics.

    The latent states follow a linear mixture (switching) dynamics and are observed
    through a Gaussian mixture.

    Graph:
        observations $x_{1..T}$, latent states $z_{1..T}$ (site ``z``, no node
        potential); two energy terms: $x_t$ explained by $z_t$ under one of
        $K$ observation modes, $z_t$ explained by $z_{t-1}$ under one of
        $K$ dynamics.

    Prior:
        uniform over the modes of each term.

    Potentials:
        $\mathrm{sim}_{\mathrm{GMM}}^k(x_t, z_t) = -\tfrac12 (x_t-z_t)^\top \Sigma_k^{-1}(x_t-z_t)$,
        $\mathrm{sim}_{\mathrm{LM}}^k(z_t, z_{t-1}) = -\tfrac12 r_{tk}^\top \Gamma_k^{-1} r_{tk}$,
        $r_{tk} = z_t - A_k z_{t-1} - b_k$ (diagonal precisions).

    Value:
        $-\partial E/\partial z_t = \sum_k \alpha_{tk}\Sigma_k^{-1}(x_t - z_t)
        - \sum_k \beta_{tk}\Gamma_k^{-1} r_{tk} + \sum_k \beta_{t+1,k} A_k^\top \Gamma_k^{-1} r_{t+1,k}$.
        The slides show the first two (child) terms, the second with a + sign; the third is
        $z_t$'s parent part (v2 eq. 4).

    Args:
        x: observations ``(T, d)``.
        A: mode dynamics $A_k$, ``(K, d, d)``.
        b: mode offsets $b_k$, ``(K, d)``.
        obs_precisions: diagonal observation precisions $\Sigma_k^{-1}$, ``(K, d)``.
        dyn_precisions: diagonal dynamics precisions $\Gamma_k^{-1}$, ``(K, d)``.

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
    xf, zf, obs_prec = _float32_at_least(x, z, obs_precisions)  # a float32 table at least
    diff = xf - zf
    obs = -0.5 * jnp.einsum("td,kd->tk", diff * diff, obs_prec)
    with numpyro.plate("frames", T):
        edge("obs_mode", priors.Uniform(K), obs)
    with numpyro.plate("transitions", T - 1):
        edge("dyn_mode", priors.Uniform(K), _transition_scores(z[:-1], z[1:], A, b, dyn_precisions))
