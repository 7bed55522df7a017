r"""Flax NNX layers built from a mechanism: write the model, get the layer.

A *mechanism* is an ordinary structinfer model of one attention head stack: given
per-head projected queries, keys and values ``q, k, v`` of shapes
``(heads, n, d)``, ``(heads, m, d)``, ``(heads, m, d)`` it declares an edge site per
query under a structural prior and a score, and a deterministic value site
(``"out"``, shape ``(heads, n, d)``) read at the edge. Its learnable hyperparameters
(a geometric $q$, a relative-position bias, a temperature) are ``numpyro.param``
sites. [`Attention`][structinfer.nn.Attention] wraps it as a multi-head attention layer with the
arguments of ``flax.nnx.MultiHeadAttention``:

$$
y_i = W_O \big[\,\mathbb E_{p(\phi^h_i \mid x)}[v^h_{\phi^h_i}]\,\big]_{h=1}^{H},\qquad
p(\phi^h_i = j \mid x) = \mathrm{softmax}_j\big(\psi(q^h_i, k^h_j) + \log p_\theta(\phi^h_i = j)\big),
$$

run through [`attention`][structinfer.attention] (a lowered, memory-light kernel when the
model is recognised, the exact engine otherwise). `structinfer.nn.heads` holds
ready-made mechanisms ([`uniform`][structinfer.nn.uniform], [`causal`][structinfer.nn.causal],
[`window`][structinfer.nn.window], [`relative_position`][structinfer.nn.relative_position],
[`geometric`][structinfer.nn.geometric], [`geometric_beta`][structinfer.nn.geometric_beta]).

Reference:
    Singh & Buckley, "Attention as implicit structural inference" (sec. 3, Table 1;
    sec. 5.2 for the geometric prior).
"""

from __future__ import annotations

try:
    import flax.nnx  # noqa: F401
except ModuleNotFoundError as e:  # Flax, or its NNX, is not installed
    if e.name is None or e.name.split(".")[0] != "flax":
        raise  # a module Flax itself imports is missing: that error as it is
    # a ModuleNotFoundError (an ImportError) so that pytest.importorskip and a caller's
    # `except ModuleNotFoundError` treat the layers as the optional extra they are
    try:
        import flax  # noqa: F401
    except ImportError:
        missing = "which is not installed"
    else:
        missing = "and the installed Flax has no NNX (an older release)"
    raise ModuleNotFoundError(
        f"structinfer.nn needs Flax NNX (flax>=0.12), {missing}: "
        'pip install "structinfer[nn]" (or pip install -U flax)',
        name="flax",
    ) from e

from .heads import causal, geometric, geometric_beta, relative_position, uniform, window
from .layer import Attention, Hyperparameter, MechanismInfo, describe_mechanism

__all__ = [
    "Attention",
    "Hyperparameter",
    "MechanismInfo",
    "describe_mechanism",
    "uniform",
    "causal",
    "window",
    "relative_position",
    "geometric",
    "geometric_beta",
]
