r"""The general log-sum-exp graphical model: several energy terms over one set of nodes
(Tschantz v1/v2 sec. 1, eqs. 1-4; slides "log-sum-exp graphical models")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro

from .. import priors, scores
from ..exact import energy
from ..primitives import edge
from ._common import features

__all__ = ["LSETerm", "lse_graphical_model", "child_parent_gradients"]


class LSETerm(NamedTuple):
    """One energy term $E_m$ of [`lse_graphical_model`][structinfer.mechanisms.lse_graphical_model].

    Attributes:
        name: the term's name (its edge site's name).
        children: child node indices $C_m$.
        parents: parent node indices $P_m$ (may overlap with the children).
    """

    name: str
    children: tuple[int, ...]
    parents: tuple[int, ...]


def _check_terms(terms: Sequence[LSETerm], num_nodes: int, weights, d: int) -> None:
    if len(weights) != len(terms):
        raise ValueError(
            f"lse_graphical_model: one weight matrix per term, got {len(weights)} for {len(terms)} terms"
        )
    for t, w in zip(terms, weights):
        idx = np.asarray(tuple(t.children) + tuple(t.parents))
        if len(t.children) == 0 or len(t.parents) == 0:
            raise ValueError(f"lse_graphical_model: term '{t.name}' needs children and parents")
        if idx.min() < 0 or idx.max() >= num_nodes:
            raise ValueError(
                f"lse_graphical_model: term '{t.name}' refers to nodes outside 0..{num_nodes - 1}"
            )
        if jnp.shape(w) != (d, d):
            raise ValueError(
                f"lse_graphical_model: weights for term '{t.name}' must be ({d}, {d}), got {jnp.shape(w)}"
            )


def lse_graphical_model(
    nodes: jax.Array,
    weights: Sequence[jax.Array],
    terms: Sequence[LSETerm],
    parent_nodes: jax.Array | None = None,
) -> None:
    r"""A sum of log-sum-exp energies over one node set.

    Graph:
        nodes $v_{1..N}$; term $m$ has children $C_m$ and parents
        $P_m$ (subsets that may overlap); one edge site per child of each term.

    Prior:
        uniform over $P_m$ for every child of term $m$.

    Potentials:
        $\mathrm{sim}_m(v_c, v_p) = v_c^\top W_m v_p$.

    Value:
        $E = \sum_m -\sum_{c \in C_m}\ln\sum_{p\in P_m} e^{\mathrm{sim}_m(v_c, v_p)}$
        (v2 eq. 2-3) and $-\partial E/\partial v_a$ = a child part (the terms where
        $a \in C_m$: $\sum_p \mathrm{softmax}_p\, \partial_{v_a}\mathrm{sim}$) plus a
        parent part (the terms where $a \in P_m$: $\sum_c \mathrm{softmax}_a\,
        \partial_{v_a}\mathrm{sim}$) — v2 eq. 4. Passing a separate ``parent_nodes`` copy
        makes the two parts separate gradients ([`child_parent_gradients`][structinfer.mechanisms.child_parent_gradients]).

    Args:
        nodes: the nodes $v$, ``(N, d)``.
        weights: one ``(d, d)`` matrix $W_m$ per term.
        terms: the [`LSETerm`][structinfer.mechanisms.LSETerm] list (concrete indices).
        parent_nodes: optional copy of ``nodes`` read on the parent side of every term.

    Sites:
        one edge per term, named ``term.name`` (children = $C_m$).

    Reference:
        Tschantz v2 sec. 1 (eqs. 1-4).
    """
    nodes = features(nodes, "nodes", "lse_graphical_model")
    pv = (
        nodes
        if parent_nodes is None
        else features(parent_nodes, "parent_nodes", "lse_graphical_model")
    )
    if pv.shape != nodes.shape:
        raise ValueError(
            f"lse_graphical_model: parent_nodes {tuple(pv.shape)} must match nodes {tuple(nodes.shape)}"
        )
    _check_terms(terms, nodes.shape[-2], weights, nodes.shape[-1])
    for t, w in zip(terms, weights):
        vc = nodes[np.asarray(t.children)]
        vp = pv[np.asarray(t.parents)]
        with numpyro.plate(f"{t.name}.children", len(t.children)):
            edge(t.name, priors.Uniform(len(t.parents)), scores.Dot(vc @ w, vp))


def child_parent_gradients(
    nodes: jax.Array, weights: Sequence[jax.Array], terms: Sequence[LSETerm]
) -> tuple[jax.Array, jax.Array]:
    r"""The two parts of $-\partial E/\partial v$ (v2 eq. 4), from the exact engine.

    The energy is evaluated with the parent side reading a copy of the nodes; the
    gradient with respect to the nodes is then the child part and the gradient with
    respect to the copy the parent part. Their sum is the full gradient.

    Args:
        nodes: the nodes $v$, ``(N, d)``.
        weights: one ``(d, d)`` matrix $W_m$ per term.
        terms: the [`LSETerm`][structinfer.mechanisms.LSETerm] list.

    Returns:
        ``(child_part, parent_part)``, each ``(N, d)``.
    """

    def neg_energy(v, v_parent):
        return -energy(lse_graphical_model, v, weights, terms, parent_nodes=v_parent)

    return jax.grad(neg_energy, argnums=(0, 1))(nodes, nodes)
