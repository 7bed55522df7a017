"""structinfer — attention as explicit structural inference in NumPyro.

Write an attention mechanism as a NumPyro model with discrete edge sites
([`edge`][structinfer.edge]), a structural prior ([`structinfer.priors`][structinfer.priors]) and a score
([`structinfer.scores`][structinfer.scores]); the exact engine collapses the edges with funsor
and returns the energy, the attention (posterior edge marginals) and the output
(posterior expectations); [`attention`][structinfer.attention] runs recognised dense patterns
through fused kernels. See Singh & Buckley, "Attention as implicit structural
inference", and Tschantz, "log-sum-exp energies".

Submodules and the functions re-exported here are imported on first use (PEP 562),
so ``import structinfer`` and the ``structinfer`` command start without loading JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: re-exported functions: public name -> the submodule that defines it
_FUNCTIONS: dict[str, str] = {
    "edge": "primitives",
    "gather": "primitives",
    "log_marginal": "exact",
    "energy": "exact",
    "marginals": "exact",
    "expectation": "exact",
    "map_edges": "exact",
    "sample_edges": "exact",
    "inspect_model": "exact",
    "attention": "lowering",
    "explain": "lowering",
}

#: submodules reachable as attributes (``structinfer.priors``) without importing them first
_SUBMODULES: frozenset[str] = frozenset({
    "priors", "scores", "primitives", "handlers", "exact", "lowering", "infer",
    "mechanisms", "diagnostics", "reproductions", "demo", "cli",
    "nn",  # Flax NNX layers: imports flax (the `nn` extra) only when first used
})

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


def __getattr__(name: str) -> Any:
    """Import a submodule or a re-exported function the first time it is asked for."""
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # the import binds it here
    if name in _FUNCTIONS:
        value = getattr(importlib.import_module(f".{_FUNCTIONS[name]}", __name__), name)
        globals()[name] = value  # later lookups do not come back here
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names and submodules, loaded or not."""
    return sorted(set(__all__) | _SUBMODULES)


if TYPE_CHECKING:  # what the names above resolve to, for type checkers and IDEs
    from . import cli as cli
    from . import demo as demo
    from . import diagnostics as diagnostics
    from . import exact as exact
    from . import handlers as handlers
    from . import infer as infer
    from . import lowering as lowering
    from . import mechanisms as mechanisms
    from . import primitives as primitives
    from . import priors as priors
    from . import reproductions as reproductions
    from . import scores as scores
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
