r"""Iterative inference on the collapsed energy (Singh & Buckley sec. 4, 5.2, app. 7.1, 7.3;
Tschantz, log-sum-exp EM and coordinate ascent).

One algorithm per module, each with pure functions over a `NamedTuple` state: `init`,
`step` (`(state, converged)`) and `run`, which iterates `step` from `init` under
`jax.lax.while_loop` (jittable, vmappable) until its convergence rule holds or
`max_iters`, and returns `(state, info)`; `info` is a `LoopInfo`: the free energy at
every step, the number of steps and why each element stopped (`info.converged`,
`info.max_iters_reached`, `info.nonfinite`).

| module | algorithm (`run` exported as) |
| --- | --- |
| `convex_concave` | CCCP fixed point for latent nodes (`cccp`, `cccp_init`, `cccp_step`) |
| `gradient` | gradient descent on the free energy (`gradient_descent`, `gradient_init`, `gradient_step`) |
| `laplace_approx` | Laplace covariance from the edge posterior (`laplace`; not iterative) |
| `mean_field` | geometric × Beta mean field, expanding attention (`geometric_beta`) |
| `em_gmm` | Gaussian-mixture EM (`gmm_em`) |
| `em_linear_mixture` | linear-mixture / switching-dynamics EM (`linear_mixture_em`) |
| `em_markov_switching` | switching dynamics with Markov modes, Baum-Welch EM (`markov_switching_em`) |
| `em_slot` | slot-attention EM (`slot_em`; `slot_m_step`) |
| `em_energy` | the general log-sum-exp EM (`energy_em`) |
| `expansion` | Bayesian model expansion (`expand`; a scan, not iterative) |
| `fit` | NumPyro's NUTS (`nuts`, kernel `NUTS`) and SVI (`svi`) with the edges enumerated, returning NumPyro's `MCMC` / `SVI` objects; `conditional_edge`, `hide_edges` |

The EM algorithms run their E-steps on the catalogue's models
(`structinfer.mechanisms.gaussian_mixture`, `switching_linear_dynamics`,
`slot_attention`) through the exact engine.
"""

from .._checks import moved_names
from ._loop import LoopInfo, NonFiniteEnergyError
from ._model_fn import model_energy, model_log_z
from .convex_concave import CCCPState
from .convex_concave import init as cccp_init
from .convex_concave import run as cccp
from .convex_concave import step as cccp_step
from .em_energy import EMState
from .em_energy import run as energy_em
from .em_gmm import GMMState
from .em_gmm import run as gmm_em
from .em_linear_mixture import LinearMixtureState
from .em_linear_mixture import run as linear_mixture_em
from .em_markov_switching import MarkovSwitchingState
from .em_markov_switching import run as markov_switching_em
from .em_slot import SlotState
from .em_slot import m_step as slot_m_step
from .em_slot import run as slot_em
from .expansion import ExpansionResult, expand
from .fit import NUTS, conditional_edge, hide_edges, nuts, svi
from .gradient import GradientState
from .gradient import init as gradient_init
from .gradient import run as gradient_descent
from .gradient import step as gradient_step
from .laplace_approx import LaplaceResult, laplace
from .mean_field import GeoBetaState, geometric_beta_free_energy, horizon
from .mean_field import run as geometric_beta

__all__ = [
    "LoopInfo",
    "NonFiniteEnergyError",
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
    "gmm_em",
    "LinearMixtureState",
    "linear_mixture_em",
    "markov_switching_em",
    "MarkovSwitchingState",
    "SlotState",
    "slot_m_step",
    "slot_em",
    "EMState",
    "energy_em",
    "ExpansionResult",
    "expand",
    "nuts",
    "NUTS",
    "svi",
    "hide_edges",
    "conditional_edge",
]


#: names of the first release that moved: where each went (an AttributeError says so)
_MOVED = {
    "fit_svi": "structinfer.infer.svi(rng_key, model, *data) (returns (SVI, SVIRunResult))",
    "run_nuts": "structinfer.infer.nuts(rng_key, model, *data) (returns NumPyro's MCMC)",
    "posterior_marginals": "the edge_posterior group of structinfer.diagnostics.to_inference_data",
}


__getattr__ = moved_names("structinfer.infer", _MOVED)
