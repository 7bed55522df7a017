r"""The mechanism catalogue: every attention and energy model of the papers as a NumPyro model.

Each mechanism is an ordinary model written with [`structinfer.edge`][structinfer.edge]; its docstring
states the graph, prior, potentials and value (the four columns of Singh & Buckley
Table 1) and the paper section. Nothing is hand-derived in a mechanism: its attention,
output, energy and gradients come out of the exact engine (``si.marginals``,
``si.expectation``, ``si.energy`` and ``jax.grad`` of it). Latent node sites (Hopfield
states, slots, predictive-coding layers) must be given values with
``numpyro.handlers.substitute``.

This package holds only models. The test harness that checks each of them against an
independent implementation of its paper's closed form (one row per mechanism, with
example arguments) is `structinfer.testing`; the catalogue page is generated from it
by `docs/gen_catalogue.py`. Adding a mechanism is one model file here, its export
below, and one row in `structinfer/testing/registry.py` (`docs/architecture.md`).

Papers: Singh & Buckley, "Attention as implicit structural inference"; Tschantz,
"Attention via log-sum-exp energy" (v1, v2, slides); McCarter, "Inverse distance
weighting attention".
"""

from .block_slot import block_slot_attention, block_slot_energy
from .classification import classification_layer, mlp_features
from .cross import cross_attention
from .dynamics import atari_model, dynamic_mixture_attention, switching_linear_dynamics
from .energy_transformer import energy_transformer
from .expanding import expanding_attention
from .expansion import expand_components, expandable_mixture
from .graph import graph_attention, sparse_attention
from .hierarchy import spatiotemporal_hierarchy
from .hopfield import hopfield
from .idw import DISTANCE_SCORES, augment_special_case, idw_attention, special_case_eta
from .kronecker import kronecker_attention, multi_lse, tensor_attention
from .layer_norm import layer_norm_energy
from .lse_graph import LSETerm, child_parent_gradients, lse_graphical_model
from .markov import markov_switching_dynamics, monotonic_alignment
from .mixtures import gaussian_mixture, linear_mixture
from .multihop import multihop_attention
from .positional import (
    RELATIVE_PARAMETERISATIONS,
    absolute_position_attention,
    relative_position_attention,
    sinusoidal_encoding,
)
from .predictive_coding import nonlinear_mixture, predictive_coding_network, tanh_network
from .self_attention import self_attention, self_prior
from .slot import slot_attention

__all__ = [
    # Singh & Buckley, Table 1
    "cross_attention",
    "self_attention",
    "self_prior",
    "graph_attention",
    "sparse_attention",
    "relative_position_attention",
    "absolute_position_attention",
    "sinusoidal_encoding",
    "RELATIVE_PARAMETERISATIONS",
    "classification_layer",
    "mlp_features",
    "hopfield",
    "slot_attention",
    "block_slot_attention",
    "predictive_coding_network",
    "multihop_attention",
    "expanding_attention",
    "monotonic_alignment",
    # Tschantz
    "gaussian_mixture",
    "linear_mixture",
    "nonlinear_mixture",
    "tanh_network",
    "switching_linear_dynamics",
    "markov_switching_dynamics",
    "dynamic_mixture_attention",
    "atari_model",
    "layer_norm_energy",
    "kronecker_attention",
    "tensor_attention",
    "multi_lse",
    "block_slot_energy",
    "energy_transformer",
    "spatiotemporal_hierarchy",
    "expandable_mixture",
    "expand_components",
    "LSETerm",
    "lse_graphical_model",
    "child_parent_gradients",
    # McCarter
    "idw_attention",
    "special_case_eta",
    "augment_special_case",
    "DISTANCE_SCORES",
]
