r"""Iterative inference on the collapsed energy (Singh & Buckley sec. 4, 5.2, app. 7.1, 7.3;
Tschantz, log-sum-exp EM and coordinate ascent).

One algorithm per module, each a pure :func:`jax.lax.while_loop` (jittable,
vmappable) returning ``(state, info)`` where ``info`` is a :class:`LoopInfo`: the
free energy at every step, the number of steps, a converged flag and a status
(converged / stopped at ``max_iters`` / non-finite energy).

* :mod:`~structinfer.infer.collapsed_vi` — :func:`cccp`, :func:`gradient_descent`,
  :func:`laplace` for latent nodes (Hopfield, slot, block-slot, predictive coding).
* :mod:`~structinfer.infer.mean_field` — :func:`geometric_beta`, expanding attention.
* :mod:`~structinfer.infer.em` — :func:`gmm_em`, :func:`linear_mixture_em`,
  :func:`slot_em`, :func:`energy_em`, :func:`expand`.
* :mod:`~structinfer.infer.svi`, :mod:`~structinfer.infer.mcmc` — NumPyro SVI
  (:func:`fit_svi`) and NUTS (:func:`run_nuts`) with the edges enumerated.
"""

from ._loop import (
    CONVERGED,
    MAX_ITERS,
    NONFINITE,
    LoopInfo,
    NonFiniteEnergyError,
    check,
    run_loop,
)
from ._model_fn import ModelFunction, model_energy, model_log_z
from .collapsed_vi import (
    CCCPState,
    GradientState,
    LaplaceResult,
    cccp,
    cccp_init,
    cccp_step,
    gradient_descent,
    gradient_init,
    gradient_step,
    laplace,
)
from .em import (
    EMState,
    ExpansionResult,
    GMMState,
    LinearMixtureState,
    SlotState,
    energy_em,
    expand,
    gmm_em,
    gmm_model,
    linear_mixture_em,
    linear_mixture_model,
    slot_em,
    slot_m_step,
    slot_model,
)
from .mcmc import posterior_marginals, run_nuts
from .mean_field import GeoBetaState, geometric_beta, geometric_beta_free_energy, horizon
from .svi import SVIFit, conditional_edge, fit_svi, hide_edges

__all__ = [
    "LoopInfo",
    "NonFiniteEnergyError",
    "CONVERGED",
    "MAX_ITERS",
    "NONFINITE",
    "check",
    "run_loop",
    "ModelFunction",
    "model_energy",
    "model_log_z",
    "CCCPState",
    "cccp_init",
    "cccp_step",
    "cccp",
    "GradientState",
    "gradient_init",
    "gradient_step",
    "gradient_descent",
    "LaplaceResult",
    "laplace",
    "GeoBetaState",
    "geometric_beta",
    "geometric_beta_free_energy",
    "horizon",
    "GMMState",
    "gmm_model",
    "gmm_em",
    "LinearMixtureState",
    "linear_mixture_model",
    "linear_mixture_em",
    "SlotState",
    "slot_model",
    "slot_m_step",
    "slot_em",
    "EMState",
    "energy_em",
    "ExpansionResult",
    "expand",
    "conditional_edge",
    "hide_edges",
    "SVIFit",
    "fit_svi",
    "run_nuts",
    "posterior_marginals",
]
