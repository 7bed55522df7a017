"""structinfer — attention as explicit structural inference in NumPyro.

Write an attention mechanism as a NumPyro model with discrete edge sites
(:func:`edge`), a structural prior (:mod:`structinfer.priors`) and a score
(:mod:`structinfer.scores`); the exact engine collapses the edges with funsor
and returns the energy, the attention (posterior edge marginals) and the output
(posterior expectations); :func:`attention` runs recognised dense patterns
through fused kernels. See Singh & Buckley, "Attention as implicit structural
inference", and Tschantz, "log-sum-exp energies".
"""

from . import diagnostics, handlers, infer, mechanisms, priors, scores
from .exact import (
    energy,
    expectation,
    inspect_model,
    log_marginal,
    map_edges,
    marginals,
    sample_edges,
)
from .lowering import attention, explain
from .primitives import edge, gather

__version__ = "0.1.0"

__all__ = [
    "edge",
    "gather",
    "priors",
    "scores",
    "handlers",
    "infer",
    "mechanisms",
    "diagnostics",
    "log_marginal",
    "energy",
    "marginals",
    "expectation",
    "map_edges",
    "sample_edges",
    "inspect_model",
    "attention",
    "explain",
    "__version__",
]
