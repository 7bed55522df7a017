"""Test harness for the mechanism catalogue — not API for modelling.

Nothing in `structinfer` imports this package; it ships with it so the project's tests,
the docs generator (`docs/gen_catalogue.py`) and users' own tests can check a mechanism
the way the catalogue does. To build models, use `structinfer.mechanisms`.

* `registry`: one row (`Mechanism`) per catalogue entry: the model, an example with
  distinct prime sizes, the quantities the engine computes from it, the paper's closed
  form as an independent reference and the citation; `evaluate` computes a row's
  quantities with the exact engine. The contract test (`tests/test_mechanisms.py`)
  runs every row through jit, vmap, float32/float64 and gradients against its reference.
* `oracles`: plain `jax.numpy` building blocks (softmax, log-sum-exp, the bilinear
  child/parent gradients) of the references; it never imports `structinfer`.
"""

from . import oracles, registry
from .registry import REGISTRY, Example, Mechanism, Quantity, evaluate, get, names

__all__ = [
    "registry",
    "oracles",
    "REGISTRY",
    "Mechanism",
    "Example",
    "Quantity",
    "evaluate",
    "get",
    "names",
]
