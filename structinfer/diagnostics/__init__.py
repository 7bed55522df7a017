r"""Diagnostics of fitted structural models: InferenceData, PSIS-LOO, edge statistics, plots.

The diagnostics take a fit and never fit: fit with `structinfer.infer.nuts` (a NumPyro
`MCMC`) or `structinfer.infer.svi` (an `(SVI, SVIRunResult)` pair), then

* `data` — [`to_inference_data`][structinfer.diagnostics.to_inference_data]: ArviZ's
  groups (`arviz_base.from_numpyro`) plus the per-child log-likelihood with the edges
  collapsed,
  $\log p(x_i \mid \theta) = \log \sum_j p(\phi_i = j \mid \theta)\, p(x_i \mid \phi_i = j, \theta)$,
  a posterior predictive, the model's constant data and the posterior edge marginals;
  ArviZ's own `loo`, `compare`, `loo_pit`, `plot_energy`, `plot_ppc_dist` and
  `plot_khat` work on it;
* `comparison` — [`loo`][structinfer.diagnostics.loo] with Pareto-$\hat k$ warnings
  naming the badly approximated children, [`compare`][structinfer.diagnostics.compare]
  (which structural prior predicts held-out children best; Vehtari, Gelman & Gabry 2017),
  [`check_comparable`][structinfer.diagnostics.check_comparable] (refuses energy-only
  models before fitting);
* `edges` — entropy $H_i = -\sum_j A_{ij}\log A_{ij}$, effective number of parents
  $e^{H_i}$, expected distance, effective window, agreement with a known structure and
  summaries, for the attention matrix $A_{ij} = p(\phi_i = j \mid x)$;
* `convergence` — monotone descent of an iterative algorithm's free-energy trace;
* `plots` — matplotlib / `arviz_plots` figures of the above.
"""

from .._checks import moved_names
from ..exact import EnergyOnlyModelError
from .comparison import ParetoKWarning, check_comparable, compare, loo
from .convergence import ConvergenceReport, convergence_report
from .data import to_inference_data, xarray_name
from .edges import (
    EdgeAgreement,
    compare_edges,
    distance_posterior,
    edge_agreement,
    edge_entropy,
    edge_summary,
    effective_parents,
    effective_window,
    expected_distance,
    hyperparameter_summary,
)
from .plots import (
    plot_attention,
    plot_compare,
    plot_convergence,
    plot_distance,
    plot_hyperparameter,
    plot_prior_posterior,
    plot_trace,
    prior_log_density,
)

__all__ = [
    "to_inference_data",
    "xarray_name",
    "loo",
    "compare",
    "check_comparable",
    "EnergyOnlyModelError",
    "ParetoKWarning",
    "edge_entropy",
    "effective_parents",
    "expected_distance",
    "effective_window",
    "distance_posterior",
    "EdgeAgreement",
    "edge_agreement",
    "edge_summary",
    "compare_edges",
    "hyperparameter_summary",
    "ConvergenceReport",
    "convergence_report",
    "plot_attention",
    "plot_distance",
    "plot_compare",
    "plot_trace",
    "plot_prior_posterior",
    "prior_log_density",
    "plot_hyperparameter",
    "plot_convergence",
]


#: names of the first release that moved: where each went (an AttributeError says so)
_MOVED = {
    "fit_nuts": "structinfer.infer.nuts(rng_key, model, *data) (returns NumPyro's MCMC)",
    "fit_svi": "structinfer.infer.svi(rng_key, model, *data) (returns (SVI, SVIRunResult))",
    "Fit": "the MCMC or (SVI, SVIRunResult) that structinfer.infer.nuts / svi return",
    "compare_priors": "structinfer.diagnostics.compare",
    "pointwise_log_likelihood": "structinfer.exact.pointwise_log_likelihood",
    "likelihood_structure": "structinfer.exact.likelihood_structure",
    "LikelihoodStructure": "structinfer.exact.LikelihoodStructure",
    "log_likelihood_draws": "the log_likelihood group of structinfer.diagnostics.to_inference_data",
    "edge_marginal_draws": "the edge_posterior group of structinfer.diagnostics.to_inference_data",
    "edge_prior_draws": "the edge_posterior group of structinfer.diagnostics.to_inference_data",
}


__getattr__ = moved_names("structinfer.diagnostics", _MOVED)
