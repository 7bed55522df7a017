r"""Predictive coding with structural inference over incoming synapses (Singh & Buckley
sec. 4.4, appendix 7.2, Table 1 row 10) and the non-linear mixture / predictive-coding
energy of Tschantz (v2 sec. 8)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from .. import priors, scores
from ..primitives import edge, gather
from ._common import features

__all__ = ["predictive_coding_network", "nonlinear_mixture", "tanh_network"]


def predictive_coding_network(
    y: jax.Array,
    weights: Sequence[jax.Array],
    precisions: Sequence[jax.Array],
    prior_mean: jax.Array,
    prior_precision: jax.Array,
) -> None:
    r"""A hierarchical predictive coding network where every unit takes one incoming synapse.

    Graph:
        layers of scalar units $z_0 \to z_1 \to \dots \to z_L = y$; the top layers
        are latent (sites ``z0 .. z{L-1}``), the bottom layer ``y`` is observed. Unit
        $i$ of layer $l+1$ has one edge site $\phi_l^i$ over the units of
        layer $l$.

    Prior:
        uniform over incoming synapses, $\phi_l^i \sim \mathrm{Uniform}\{z_l^0, z_l^1, \dots\}$.

    Potentials:
        $z_{l+1}^i \mid z_l, \phi_l^i = j \sim \mathcal N(w_l^{ij} z_l^j, 1/k_l^i)$
        (a Gaussian prediction error per synapse) and
        $z_0 \sim \mathcal N(\hat\mu_0, 1/k_0)$.

    Value:
        $\partial F/\partial \mu$: with $\epsilon_l^{ij} = \mu_{l+1}^i - w_l^{ij}\mu_l^j$
        and $\alpha_l^{ij} = \mathrm{softmax}_j(-\tfrac12 k_l^i (\epsilon_l^{ij})^2)$,
        $\partial F/\partial \mu_l^j = \sum_i \alpha_{l-1}^{ji} k_{l-1}^j \epsilon_{l-1}^{ji}
        - \sum_{i} \alpha_l^{ij} k_l^i \epsilon_l^{ij} w_l^{ij}$ (plus the prior term on
        layer 0): incoming errors compete through the softmax, outgoing errors compete
        with the other units of the same layer.

    The signs follow the paper's eq. 10 ($\epsilon$ = value minus prediction); its
    unit-wise restatement in sec. 4.4 writes the same sum with $\epsilon$ as
    prediction minus value.

    Args:
        y: observed bottom layer ``(n_L,)``.
        weights: ``L`` synapse matrices, ``weights[l]`` of shape ``(n_{l+1}, n_l)``.
        precisions: ``L`` vectors, ``precisions[l]`` of shape ``(n_{l+1},)`` ($k_l^i > 0$).
        prior_mean: mean $\hat\mu_0$ of the top layer's prior, ``(n_0,)``.
        prior_precision: precision $k_0$ of the top layer's prior, ``(n_0,)``.

    Sites:
        ``z0 .. z{L-1}`` (latent layers: give them values), ``phi1 .. phiL`` (edges).

    Reference:
        Singh & Buckley sec. 4.4 and appendix 7.2.
    """
    y = jnp.asarray(y)
    if len(weights) != len(precisions) or not weights:
        raise ValueError(
            "predictive_coding_network: need one precision vector per weight matrix, got "
            f"{len(weights)} weights and {len(precisions)} precisions"
        )
    sizes = [weights[0].shape[1]] + [w.shape[0] for w in weights]
    for lv, (w, k) in enumerate(zip(weights, precisions)):
        if w.shape != (sizes[lv + 1], sizes[lv]) or jnp.shape(k) != (sizes[lv + 1],):
            raise ValueError(
                f"predictive_coding_network: layer {lv}: weights {tuple(w.shape)} and precisions "
                f"{tuple(jnp.shape(k))} do not chain (expected ({sizes[lv + 1]}, {sizes[lv]}) and "
                f"({sizes[lv + 1]},))"
            )
    if y.shape != (sizes[-1],):
        raise ValueError(
            f"predictive_coding_network: y must be ({sizes[-1]},) for the last weights, got {y.shape}"
        )
    z = numpyro.sample(
        "z0", dist.Normal(prior_mean, jnp.asarray(prior_precision) ** -0.5).to_event(1)
    )
    for lv, (w, k) in enumerate(zip(weights, precisions)):
        last = lv == len(weights) - 1
        with numpyro.plate(f"layer{lv + 1}", w.shape[0]):
            phi = edge(f"phi{lv + 1}", priors.Uniform(w.shape[1]))
            prediction = gather(w, phi) * gather(z, phi)
            z = numpyro.sample(
                f"z{lv + 1}", dist.Normal(prediction, k**-0.5), obs=y if last else None
            )


def tanh_network(mu: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    r"""The generative network $f(\mu) = \tanh(A\mu + b)$, rows of ``mu`` at once.

    Args:
        mu: causes ``(K, d_mu)``.
        a: the weight $A$, ``(d_x, d_mu)``.
        b: the bias $b$, ``(d_x,)``.

    Returns:
        $f(\mu_k)$ as rows, ``(K, d_x)``.
    """
    return jnp.tanh(mu @ a.T + b)


def nonlinear_mixture(
    x: jax.Array,
    mu: jax.Array,
    a: jax.Array,
    b: jax.Array,
    network: Callable[..., jax.Array] = tanh_network,
) -> None:
    r"""Non-linear mixture: data explained by one of $K$ causes through a network $f$.

    The predictive-coding energy of Tschantz.

    Graph:
        child data $x_{1..N}$, parent causes $\mu_{1..K}$ predicting through
        $f$ (``network(mu, a, b)``; default [`tanh_network`][structinfer.mechanisms.tanh_network]).

    Prior:
        uniform over causes.

    Potentials:
        $\mathrm{sim}(x_i, \mu_k) = -\tfrac12 \|x_i - f(\mu_k)\|^2$.

    Value:
        the energy and its gradients: with $\alpha_{ik} = \mathrm{softmax}_k\,\mathrm{sim}$,
        $-\partial E/\partial \mu_k = \sum_i \alpha_{ik} J_f(\mu_k)^\top (x_i - f(\mu_k))$
        (prediction errors weighted by attention) and
        $-\partial E/\partial x_i = -\sum_k \alpha_{ik} (x_i - f(\mu_k))$. (v1/v2 print
        the latter with a + sign; $\partial\,\mathrm{sim}/\partial x_i = -(x_i - f(\mu_k))$.)

    Args:
        x: data ``(N, d_x)``.
        mu: causes $\mu_k$, ``(K, d_mu)``.
        a: first network parameter (the weight ``(d_x, d_mu)`` of
            [`tanh_network`][structinfer.mechanisms.tanh_network]).
        b: second network parameter (the bias ``(d_x,)`` of ``tanh_network``).
        network: ``network(mu, a, b) -> (K, d_x)`` predictions.

    Sites:
        ``cause`` (edge, children = data).

    Reference:
        Tschantz v2 sec. 8 ("Predictive coding"); slides "Non-Linear Mixture Model".
    """
    x = features(x, "x", "nonlinear_mixture")
    mu = features(mu, "mu", "nonlinear_mixture")
    pred = network(mu, a, b)
    if pred.shape != (mu.shape[-2], x.shape[-1]):
        raise ValueError(
            f"nonlinear_mixture: network(mu, a, b) must return (K, d_x) = "
            f"({mu.shape[-2]}, {x.shape[-1]}), got {tuple(pred.shape)}"
        )
    with numpyro.plate("data", x.shape[-2]):
        edge("cause", priors.Uniform(mu.shape[-2]), scores.NegSqDist(x, pred))
