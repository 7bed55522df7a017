r"""The lowered engine: the same NumPyro model as a fused, memory-light JAX kernel.

* :func:`attention` / :func:`explain` — recognise a model's structure and run it
  through a kernel (or the exact engine when not recognised); :data:`BACKENDS`,
  :class:`Explanation`, :class:`NotLowerableError`.
* Extending it: :func:`register_prior_rule`, :func:`register_score_rule` and
  :func:`register_pattern_rule` add the lowering of a prior / score / restriction-pattern
  type (your own included); a rule adds the terms of
  $\ell_{ij} = \psi_{ij} + \log\tilde p(\phi_i = j)$ to a :class:`TermBuilder`, a pattern
  rule returns a :class:`DistanceBand`, and a rule raises :class:`NotLowered` to decline.
  See ``docs/performance.md``.
* Windowed kernels on plain arrays, for expanding attention's mean-field loop:
  :func:`windowed_scores`, :func:`geometric_band_log_prior`, :func:`windowed_posterior`,
  :func:`windowed_values` and :func:`windowed_attention` (all four in one).

The block kernels themselves (``blocked``, ``dense``, ``windowed_kernel``), the GPU
kernels and their dispatch rules (:mod:`.accel`: cuDNN, Pallas) and the multi-device
wrappers (:mod:`.sharded`) read the lowered form of an edge site; they are reached
through :func:`attention` (``backend=``, ``mesh=``).
"""

from . import _rules  # noqa: F401  (registers the built-in rules)
from ._lower import (
    DistanceBand,
    NotLowered,
    TermBuilder,
    register_pattern_rule,
    register_prior_rule,
    register_score_rule,
)
from .api import BACKENDS, Explanation, NotLowerableError, attention, explain
from .windowed import (
    geometric_band_log_prior,
    windowed_attention,
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
    "register_prior_rule",
    "register_score_rule",
    "register_pattern_rule",
    "TermBuilder",
    "DistanceBand",
    "NotLowered",
    "windowed_scores",
    "geometric_band_log_prior",
    "windowed_posterior",
    "windowed_values",
    "windowed_attention",
]
