r"""The lowered engine: the same NumPyro model as a fused, memory-light JAX kernel.

* [`attention`][structinfer.lowering.attention] /
  [`explain`][structinfer.lowering.explain] — recognise a model's structure and run it
  through a kernel (or the exact engine when not recognised); `BACKENDS`,
  [`check_rows`][structinfer.lowering.check_rows] (the eager check of rows with no
  finite log-normaliser, for callers that map the function themselves),
  [`Explanation`][structinfer.lowering.Explanation],
  [`NotLowerableError`][structinfer.lowering.NotLowerableError],
  [`MeshFallbackWarning`][structinfer.lowering.MeshFallbackWarning] (a ``mesh=`` the
  exact engine does not use, warned at call time).
* Extending it: [`register_prior_rule`][structinfer.lowering.register_prior_rule],
  [`register_score_rule`][structinfer.lowering.register_score_rule] and
  [`register_pattern_rule`][structinfer.lowering.register_pattern_rule] add the lowering
  of a prior / score / restriction-pattern type (your own included); a rule adds the
  terms of $\ell_{ij} = \psi_{ij} + \log\tilde p(\phi_i = j)$ to a
  [`TermBuilder`][structinfer.lowering.TermBuilder], a pattern rule returns a
  [`DistanceBand`][structinfer.lowering.DistanceBand], a rule may give a per-edge
  mask's value per block as a [`BlockMask`][structinfer.lowering.BlockMask], and a rule
  raises [`NotLowered`][structinfer.lowering.NotLowered] to decline. See
  ``docs/performance.md``.
* Windowed kernels on plain arrays, for expanding attention's mean-field loop:
  [`windowed_scores`][structinfer.lowering.windowed_scores],
  [`geometric_band_log_prior`][structinfer.lowering.geometric_band_log_prior],
  [`windowed_posterior`][structinfer.lowering.windowed_posterior],
  [`windowed_values`][structinfer.lowering.windowed_values] and
  [`windowed_attention`][structinfer.lowering.windowed_attention] (all four in one).
* Dtypes: [`accum_dtype`][structinfer.lowering.accum_dtype], the dtype every kernel
  accumulates in (and adds the prior's terms in) for inputs of a given dtype.
* The kernel table: [`KERNELS`][structinfer.lowering.KERNELS] (a read-only
  [`KernelTable`][structinfer.lowering.KernelTable]), one
  [`Kernel`][structinfer.lowering.Kernel] entry per kernel (``"dense"``, ``"blocked"``,
  ``"windowed"``, ``"cudnn"``, ``"pallas"``, ``"mosaic"``): what it cannot run, how it
  runs (with a
  [`KernelConfig`][structinfer.lowering.KernelConfig]), whether it writes the NaN rows,
  what runs when it refuses when traced. `attention` (a forced ``backend``, the
  ``"auto"`` rule, ``mesh=``) and `explain` read it.

A model whose edge has a [`Markov`][structinfer.priors.Markov] prior (a chain in a
``scan``) runs through [`markov`][structinfer.lowering.markov]'s forward-backward scan.

The block kernels themselves (``blocked``, ``dense``, ``windowed_kernel``), the GPU
kernels and their static checks ([`accel`][structinfer.lowering.accel]: cuDNN, Pallas;
[`mosaic`][structinfer.lowering.mosaic]: the Mosaic GPU kernels for Hopper)
and the multi-device wrappers (`structinfer.lowering.sharded`, whose shards run the
table's kernels) read the lowered form of an edge site; they are reached through
[`attention`][structinfer.lowering.attention] (``backend=``, ``mesh=``).
"""

from . import rules  # noqa: F401  (registers the built-in rules)
from ._lower import (
    DistanceBand,
    NotLowered,
    TermBuilder,
    register_pattern_rule,
    register_prior_rule,
    register_score_rule,
)
from ._masks import BlockMask
from ._spec import accum_dtype
from .api import (
    BACKENDS,
    Explanation,
    MeshFallbackWarning,
    NotLowerableError,
    attention,
    check_rows,
    explain,
)
from .kernels import KERNELS, Kernel, KernelConfig, KernelTable
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
    "check_rows",
    "Explanation",
    "NotLowerableError",
    "MeshFallbackWarning",
    "BACKENDS",
    "KERNELS",
    "Kernel",
    "KernelConfig",
    "KernelTable",
    "register_prior_rule",
    "register_score_rule",
    "register_pattern_rule",
    "TermBuilder",
    "DistanceBand",
    "BlockMask",
    "NotLowered",
    "windowed_scores",
    "geometric_band_log_prior",
    "windowed_posterior",
    "windowed_values",
    "windowed_attention",
    "accum_dtype",
]
