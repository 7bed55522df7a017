r"""The classification layer as attention over class nodes (Singh & Buckley Table 1 row 6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro

from .. import priors, scores
from ..primitives import edge
from ._common import features

__all__ = ["classification_layer", "mlp_features"]


def mlp_features(
    x: jax.Array, w1: jax.Array, b1: jax.Array, w2: jax.Array, b2: jax.Array
) -> jax.Array:
    r"""The network $f_\theta(x) = W_2 \tanh(W_1 x + b_1) + b_2$, rows of ``x`` at once.

    Args:
        x: inputs ``(n, d_in)``.
        w1: first layer $W_1$, ``(h, d_in)``.
        b1: first bias $b_1$, ``(h,)``.
        w2: second layer $W_2$, ``(d_y, h)``.
        b2: second bias $b_2$, ``(d_y,)``.

    Returns:
        $f_\theta(x)$, ``(n, d_y)``.
    """
    return jnp.tanh(x @ w1.T + b1) @ w2.T + b2


def classification_layer(
    x: jax.Array,
    w1: jax.Array,
    b1: jax.Array,
    w2: jax.Array,
    b2: jax.Array,
    classes: jax.Array,
) -> None:
    r"""A softmax classifier: each input takes one class node as its parent.

    Graph:
        network outputs $f_\theta(X)_i$ (children) and class nodes $y_1..y_C$ (parents).

    Prior:
        uniform over the $C$ classes.

    Potentials:
        $\psi_{ij} = f_\theta(X)_i^\top y_j$ with $f_\theta$ the network [`mlp_features`][structinfer.mechanisms.mlp_features].

    Value:
        $v_i = y_{\phi_i}$; with one-hot class nodes $\mathbb E[v_i]$ is the vector
        of class probabilities $\mathrm{softmax}_j(f_\theta(X)_i^\top y_j)$.

    Args:
        x: inputs ``(n, d_in)``.
        w1: first layer $W_1$ of [`mlp_features`][structinfer.mechanisms.mlp_features],
            ``(h, d_in)``.
        b1: first bias $b_1$, ``(h,)``.
        w2: second layer $W_2$, ``(d_y, h)``.
        b2: second bias $b_2$, ``(d_y,)``.
        classes: class nodes ``(C, d_y)`` (the identity for one-hot classes).

    Sites:
        ``class`` (edge, children = inputs), ``out`` (deterministic value).

    Reference:
        Singh & Buckley Table 1 row 6 ("Classification Layer").
    """
    x = features(x, "x", "classification_layer")
    classes = features(classes, "classes", "classification_layer")
    if (
        w1.shape[-1] != x.shape[-1]
        or w2.shape[-1] != w1.shape[0]
        or w2.shape[0] != classes.shape[-1]
    ):
        raise ValueError(
            "classification_layer: expected w1 (h, d_in), w2 (d_y, h) and classes (C, d_y); got "
            f"w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}, classes {tuple(classes.shape)} "
            f"for x {tuple(x.shape)}"
        )
    f = mlp_features(x, w1, b1, w2, b2)
    with numpyro.plate("inputs", x.shape[-2]):
        j = edge("class", priors.Uniform(classes.shape[-2]), scores.Dot(f, classes))
        numpyro.deterministic("out", classes[j])
