r"""The exact engine's public seam: one inspection, one contraction, the user functions.

$$\log Z = \log \sum_\phi p(x, \phi), \qquad
p(\phi_i = j \mid x) = \frac{\partial \log Z}{\partial t_{ij}}\Big|_{t=0}$$

* `structinfer.exact.inspect` — [`inspect_model`][structinfer.exact.inspect_model] reads
  every site of a model once into a [`ModelInfo`][structinfer.exact.ModelInfo] (roles,
  shapes, plates, supports, each edge's prior and score);
* `structinfer.exact.contract` — [`log_z`][structinfer.exact.log_z], the one contraction
  (NumPyro's funsor ``log_density``; with ``keep_plates`` the per-element
  log-likelihood), [`chain_factors`][structinfer.exact.chain_factors] (the log-factors
  of one chain of a Markov edge, for the lowering's forward-backward scan);
* `structinfer.exact.api` — [`log_marginal`][structinfer.exact.log_marginal],
  [`energy`][structinfer.exact.energy], [`marginals`][structinfer.exact.marginals],
  [`expectation`][structinfer.exact.expectation], [`map_edges`][structinfer.exact.map_edges],
  [`sample_edges`][structinfer.exact.sample_edges],
  [`pointwise_log_likelihood`][structinfer.exact.pointwise_log_likelihood],
  [`likelihood_structure`][structinfer.exact.likelihood_structure];
* `structinfer.exact.bounds` — the static index-bounds check
  ([`IndexOutOfBounds`][structinfer.exact.IndexOutOfBounds]).

Everything above the engine (lowering, inference, diagnostics, the catalogue) uses
these names only.
"""

from .api import (
    energy,
    expectation,
    likelihood_structure,
    log_marginal,
    map_edges,
    marginals,
    pointwise_log_likelihood,
    sample_edges,
)
from .bounds import IndexOutOfBounds, check_gather_bounds, check_jaxpr_bounds
from .contract import (
    ChainFactors,
    EnergyOnlyModelError,
    LikelihoodStructure,
    NotAChainError,
    chain_factors,
    log_z,
    safe_log_einsum,
)
from .contract import ScoreFactors as ScoreFactors  # a type alias (no docstring, not in __all__)
from .inspect import (
    MAX_ENUM_DIMS,
    ModelInfo,
    ProbeProgram,
    SiteInfo,
    inspect_model,
    stage_at_probes,
    trace_model,
)
from .inspect import Role as Role  # a type alias (no docstring, not in __all__)

__all__ = [
    "log_marginal",
    "energy",
    "marginals",
    "expectation",
    "map_edges",
    "sample_edges",
    "pointwise_log_likelihood",
    "likelihood_structure",
    "LikelihoodStructure",
    "EnergyOnlyModelError",
    "log_z",
    "safe_log_einsum",
    "chain_factors",
    "ChainFactors",
    "NotAChainError",
    "inspect_model",
    "trace_model",
    "stage_at_probes",
    "ProbeProgram",
    "ModelInfo",
    "SiteInfo",
    "MAX_ENUM_DIMS",
    "IndexOutOfBounds",
    "check_gather_bounds",
    "check_jaxpr_bounds",
]
