r"""The lowered engine: the same NumPyro model as a fused, memory-light JAX kernel.

* :func:`attention` / :func:`explain` — recognise a model's structure and run it
  through a kernel (or the exact engine when not recognised).
* Kernels: :func:`blocked_attention` (online softmax over blocks, custom VJP),
  :func:`dense_attention` (its naive twin), the windowed kernel for distance
  bands (:func:`windowed_attention` and its parts, used by expanding attention's
  mean-field loop), and multi-device wrappers in :mod:`.sharded`.
* :func:`lower_edge` turns a ``(prior, score, value table)`` into the block terms
  the kernels read (:class:`Terms`, :class:`Problem`).
"""

from ._lower import Lowered, NotLowered, lower_edge
from ._recognise import Fallback, Plan, recognise
from ._spec import Problem, RelPos, Terms, block_logits
from .api import BACKENDS, Explanation, NotLowerableError, attention, explain
from .blocked import Schedule, band_blocks, blocked_attention, make_schedule
from .dense import dense_attention, dense_logits
from .windowed import (
    band_logits,
    geometric_band_log_prior,
    windowed_attention,
    windowed_kernel,
    windowed_posterior,
    windowed_scores,
    windowed_values,
)

__all__ = [
    "attention",
    "explain",
    "Explanation",
    "NotLowerableError",
    "BACKENDS",
    "Fallback",
    "Plan",
    "recognise",
    "lower_edge",
    "Lowered",
    "NotLowered",
    "Terms",
    "RelPos",
    "Problem",
    "block_logits",
    "Schedule",
    "make_schedule",
    "band_blocks",
    "blocked_attention",
    "dense_attention",
    "dense_logits",
    "band_logits",
    "windowed_kernel",
    "windowed_scores",
    "geometric_band_log_prior",
    "windowed_posterior",
    "windowed_values",
    "windowed_attention",
]
