r"""Hierarchical log-sum-exp models over space and time: the spatiotemporal hierarchy and
the renormalised mixture with local receptive fields (Tschantz v2 sec. 6; slides
"spatio-temporal model", "Renormalised mixture models")."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import numpyro

from .. import priors, scores
from .._checks import check_static_int
from ..primitives import edge
from ._common import features, latent_nodes

__all__ = ["spatiotemporal_hierarchy"]


def _pair(w, name: str, layer: int, d_in: tuple[int, int]):
    if len(w) != 2:
        raise ValueError(f"spatiotemporal_hierarchy: {name}[{layer}] must be a pair (W_a, W_b)")
    wa, wb = w
    if (
        wa.ndim != 2
        or wb.ndim != 2
        or wa.shape[0] != wb.shape[0]
        or (wa.shape[1], wb.shape[1]) != d_in
    ):
        raise ValueError(
            f"spatiotemporal_hierarchy: {name}[{layer}] must be two (d, D) matrices with "
            f"D = {d_in}, got {tuple(wa.shape)} and {tuple(wb.shape)}"
        )
    return wa, wb


def spatiotemporal_hierarchy(
    x: jax.Array,
    layer_sizes: Sequence[tuple[int, int]],
    w_inter: Sequence[tuple[jax.Array, jax.Array]],
    w_intra: Sequence[tuple[jax.Array, jax.Array]],
    w_temporal: Sequence[tuple[jax.Array, jax.Array]],
    receptive_fields: Sequence[np.ndarray] | None = None,
) -> None:
    r"""A hierarchy of slots coupled across layers, within a layer and across time.

    Graph:
        layers :math:`l = 1..L`; layer 1 is observed (``x``, ``(T, K_1, D_1)``), layers
        :math:`l \ge 2` are latent (sites ``layer{l}``, ``(T, K_l, D_l)``, no node potential).
        Three edge families: inter-layer (``inter{l}``), intra-layer (``intra{l}``) and
        temporal (``temporal{l}``).
    Prior:
        inter-layer: each unit :math:`c` of layer :math:`l-1` takes one slot :math:`k` of layer
        :math:`l` (uniform; slot attention); with ``receptive_fields`` (the renormalised
        mixture) each unit :math:`k` of layer :math:`l` takes one unit :math:`c \in \mathcal R_k`
        of layer :math:`l-1` (uniform restricted to its receptive field).
        Intra-layer: uniform over the other slots :math:`k' \ne k` at the same time.
        Temporal: uniform over the same slot's past :math:`t' < t` (causal, no self-edge;
        :math:`t = 1` has no parent and no term).
    Potentials:
        :math:`\mathrm{sim}_v^{(l)}(x, x') = (W_v^{K,(l)} x)^\top (W_v^{Q,(l)} x')` (lower, upper),
        :math:`\mathrm{sim}_c^{(l)}(x, x') = (W_c^{Q,(l)} x)^\top (W_c^{K,(l)} x')`,
        :math:`\mathrm{sim}_t^{(l)}(x, x') = (W_t^{Q,(l)} x)^\top (W_t^{K,(l)} x')`.
    Value:
        :math:`-\partial E/\partial x_{k,t}^{(l)}` = bottom-up + top-down + intra-layer +
        temporal parts (v2 eq. 18-26), each a softmax-weighted sum; the temporal part has a
        child term (eq. 26) and a parent term (the slot explaining its own future, which
        v2 eq. 26 leaves out).

    Args:
        x: observed layer 1, ``(T, K_1, D_1)``.
        layer_sizes: ``(K_l, D_l)`` for the latent layers :math:`l = 2..L`.
        w_inter: for :math:`l = 2..L` the pair :math:`(W_v^{K,(l)}, W_v^{Q,(l)})` of shapes
            ``(d, D_{l-1})`` and ``(d, D_l)``.
        w_intra, w_temporal: for :math:`l = 1..L` the pairs :math:`(W^Q, W^K)`, both ``(d, D_l)``.
        receptive_fields: optional boolean masks ``(K_l, K_{l-1})`` for :math:`l = 2..L`;
            given, the inter-layer term takes the renormalised form.

    Sites:
        ``layer{l}`` (latent), ``inter{l}``, ``intra{l}``, ``temporal{l}`` (edges).

    Reference:
        Tschantz v2 sec. 6 (eqs. 14-26); slides "Renormalised mixture models" (local
        receptive fields; intra-layer and temporal terms unchanged).
    """
    x = features(x, "x", "spatiotemporal_hierarchy", ndim=3)
    T = x.shape[0]
    L = len(layer_sizes) + 1
    if len(w_inter) != L - 1 or len(w_intra) != L or len(w_temporal) != L:
        raise ValueError(
            f"spatiotemporal_hierarchy: {L} layers need {L - 1} w_inter pairs and {L} w_intra / "
            f"w_temporal pairs, got {len(w_inter)}, {len(w_intra)}, {len(w_temporal)}"
        )
    if receptive_fields is not None and len(receptive_fields) != L - 1:
        raise ValueError(
            f"spatiotemporal_hierarchy: need {L - 1} receptive-field masks, got {len(receptive_fields)}"
        )
    if T < 2:
        raise ValueError("spatiotemporal_hierarchy: the temporal term needs T >= 2 time steps")
    for i, size in enumerate(layer_sizes):  # (K_l, D_l) set the latent layers' shapes
        for v in size:
            check_static_int(v, f"layer_sizes[{i}]", "spatiotemporal_hierarchy")
    layers = [x]
    for lv, (k, d) in enumerate(layer_sizes, start=2):
        if k < 2:
            raise ValueError(
                f"spatiotemporal_hierarchy: layer {lv} needs >= 2 slots for the intra term"
            )
        layers.append(latent_nodes(f"layer{lv}", (T, k, d), None, x.dtype))
    dims = [a.shape[-1] for a in layers]
    for lv in range(2, L + 1):  # inter-layer energies
        lower, upper = layers[lv - 2], layers[lv - 1]
        wk_, wq_ = _pair(w_inter[lv - 2], "w_inter", lv - 2, (dims[lv - 2], dims[lv - 1]))
        lk, uq = lower @ wk_.T, upper @ wq_.T
        if receptive_fields is None:
            with (
                numpyro.plate(f"time_inter{lv}", T, dim=-2),
                numpyro.plate(f"units_inter{lv}", lower.shape[1], dim=-1),
            ):
                edge(f"inter{lv}", priors.Uniform(upper.shape[1]), scores.Dot(lk, uq))
        else:
            field = jnp.asarray(receptive_fields[lv - 2]).astype(bool)
            if field.shape != (upper.shape[1], lower.shape[1]):
                raise ValueError(
                    f"spatiotemporal_hierarchy: receptive_fields[{lv - 2}] must be "
                    f"({upper.shape[1]}, {lower.shape[1]}) = (K_{lv}, K_{lv - 1}), got {field.shape}"
                )
            with (
                numpyro.plate(f"time_inter{lv}", T, dim=-2),
                numpyro.plate(f"units_inter{lv}", upper.shape[1], dim=-1),
            ):
                edge(
                    f"inter{lv}",
                    priors.Restricted(field, pattern=priors.Mask("receptive_field")),
                    scores.Dot(uq, lk),
                )
    for lv in range(1, L + 1):  # intra-layer and temporal energies
        h = layers[lv - 1]
        k = h.shape[1]
        wq_, wk_ = _pair(w_intra[lv - 1], "w_intra", lv - 1, (dims[lv - 1], dims[lv - 1]))
        with (
            numpyro.plate(f"time_intra{lv}", T, dim=-2),
            numpyro.plate(f"units_intra{lv}", k, dim=-1),
        ):
            edge(
                f"intra{lv}",
                priors.Restricted(~np.eye(k, dtype=bool), pattern=priors.Mask("no_self")),
                scores.Dot(h @ wq_.T, h @ wk_.T),
            )
        wq_, wk_ = _pair(w_temporal[lv - 1], "w_temporal", lv - 1, (dims[lv - 1], dims[lv - 1]))
        ht = h.swapaxes(0, 1)  # (K_l, T, D_l)
        with (
            numpyro.plate(f"units_temporal{lv}", k, dim=-2),
            numpyro.plate(f"times_temporal{lv}", T - 1, dim=-1),
        ):
            edge(
                f"temporal{lv}",
                priors.Restricted.causal(T - 1, T, include_self=False, offset=1),
                scores.Dot(ht[:, 1:] @ wq_.T, ht @ wk_.T),
            )
