r"""Mixture models as log-sum-exp energies: the Gaussian mixture and the linear mixture
(Tschantz v2 sec. 2, slides "Linear Mixture Model")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro

from .. import priors, scores
from ..primitives import edge
from ._common import features

__all__ = ["gaussian_mixture", "linear_mixture"]


def gaussian_mixture(
    x: jax.Array,
    means: jax.Array,
    precisions: jax.Array,
    log_weights: jax.Array,
    normalize: bool = False,
) -> None:
    r"""Gaussian mixture: each data point takes one component as its parent.

    Graph:
        child data $x_{1..N}$, parent components $\mu_{1..K}$.

    Prior:
        categorical, $p(\phi_i = k) = \pi_k$ (``log_weights``, normalised).

    Potentials:
        $-\tfrac12 (x_i - \mu_k)^\top \Sigma_k^{-1} (x_i - \mu_k)$, so that with the prior
        $\mathrm{sim}(x_i, \mu_k) = \ln\pi_k - \tfrac12 \mathrm{Mahalanobis}$;
        ``normalize=True`` adds $\tfrac12\ln|\Sigma_k^{-1}| - \tfrac d2 \ln 2\pi$ and the
        energy becomes the GMM negative log-likelihood.

    Value:
        responsibilities $\alpha_{ik} = \mathrm{softmax}_k\,\mathrm{sim}(x_i, \mu_k)$ and
        $-\partial E/\partial \mu_k = \sum_i \alpha_{ik} \Sigma_k^{-1}(x_i - \mu_k)$, whose
        zero is the M-step $\mu_k = \sum_i \alpha_{ik} x_i / \sum_i \alpha_{ik}$.

    Args:
        x: data ``(N, d)``.
        means: component means $\mu_k$, ``(K, d)``.
        precisions: $\Sigma_k^{-1}$, ``(K, d, d)``, ``(K, d)`` (diagonal), ``(d, d)`` or scalar.
        log_weights: ``(K,)`` log mixing weights.
        normalize: include the Gaussian normaliser.

    Sites:
        ``component`` (edge, children = data).

    Reference:
        Tschantz v2 sec. 2 (eq. 5) and appendix B.
    """
    x = features(x, "x", "gaussian_mixture")
    means = features(means, "means", "gaussian_mixture")
    log_weights = jnp.asarray(log_weights)
    if log_weights.shape != (means.shape[-2],):
        raise ValueError(
            f"gaussian_mixture: log_weights must be ({means.shape[-2]},), got {log_weights.shape}"
        )
    with numpyro.plate("data", x.shape[-2]):
        edge(
            "component",
            priors.Categorical(log_weights),
            scores.NegSqDist(x, means, precision=precisions, normalize=normalize),
        )


def linear_mixture(
    x: jax.Array,
    z: jax.Array,
    A: jax.Array,
    b: jax.Array,
    precisions: jax.Array,
) -> None:
    r"""Linear mixture: each child is a noisy linear map of one parent.

    Graph:
        child nodes $x_{1..N}$, parent nodes $z_{1..K}$, parent $k$ predicting
        $A_k z_k + b_k$.

    Prior:
        uniform over parents.

    Potentials:
        $\mathrm{sim}_k(x_i, z_k) = -\tfrac12 (x_i - A_k z_k - b_k)^\top \Sigma_k^{-1}
        (x_i - A_k z_k - b_k)$ (diagonal $\Sigma_k^{-1}$).

    Value:
        with $r_{ik} = x_i - A_k z_k - b_k$: $-\partial E/\partial x_i = -\sum_k
        \alpha_{ik}\Sigma_k^{-1} r_{ik}$ (the slides print it with a + sign), whose zero for a
        shared $\Sigma$ is the fixed point $x_i^* = \sum_k \alpha_{ik}(A_k z_k + b_k)$;
        $-\partial E/\partial z_k = \sum_i \alpha_{ik} A_k^\top \Sigma_k^{-1} r_{ik}$.

    Args:
        x: child nodes ``(N, d_x)``.
        z: parent nodes $z_k$, ``(K, d_z)``.
        A: the linear maps $A_k$, ``(K, d_x, d_z)``.
        b: the offsets $b_k$, ``(K, d_x)``.
        precisions: diagonal precisions $\Sigma_k^{-1}$, ``(K, d_x)``.

    Sites:
        ``mode`` (edge, children = x).

    Reference:
        Tschantz slides "Linear Mixture Model" (the energy shared with the SLDS).
    """
    x = features(x, "x", "linear_mixture")
    z = features(z, "z", "linear_mixture")
    k, dx, dz = z.shape[-2], x.shape[-1], z.shape[-1]
    if A.shape != (k, dx, dz) or b.shape != (k, dx) or jnp.shape(precisions) != (k, dx):
        raise ValueError(
            f"linear_mixture: expected A ({k}, {dx}, {dz}), b ({k}, {dx}), precisions ({k}, {dx}); "
            f"got {tuple(A.shape)}, {tuple(b.shape)}, {tuple(jnp.shape(precisions))}"
        )
    predictions = jnp.einsum("kxz,kz->kx", A, z) + b
    with numpyro.plate("data", x.shape[-2]):
        edge("mode", priors.Uniform(k), scores.NegSqDist(x, predictions, precision=precisions))
