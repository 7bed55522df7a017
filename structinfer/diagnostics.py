r"""Diagnostics for structural models: compare priors by predictive density, read edge posteriors.

**Pointwise log-likelihood with the edges collapsed.** For a model whose child
:math:`i` takes one parent :math:`\phi_i` under a structural prior and whose
observation :math:`x_i` depends on that parent,

.. math::

    \log p(x_i \mid \theta) = \log \sum_{j} p(\phi_i = j \mid \theta)\,
        p(x_i \mid \phi_i = j, \theta),
    \qquad
    \log p(x \mid \theta) = \sum_i \log p(x_i \mid \theta),

one term per element of the plates around the observed site (children, and
batch elements when there is a batch plate). The terms are computed with funsor
by variable elimination that sums out the enumerated sites but does *not*
multiply out the plates of the observation. ArviZ's ``from_numpyro`` cannot do
this for enumerated models, so :func:`to_inference_data` builds the
InferenceData (an ``xarray.DataTree``) itself: ``posterior``,
``log_likelihood``, ``observed_data``, ``prior`` and ``edge_posterior`` (the
posterior edge marginals :math:`p(\phi_i = j \mid x) = \mathbb E_{\theta \mid x}[p(\phi_i = j \mid x, \theta)]`).

**Comparing priors.** :func:`compare_priors` runs Pareto-smoothed importance
sampling LOO (Vehtari, Gelman & Gabry 2017) for each fitted model, warns with
:class:`ParetoKWarning` naming the children whose Pareto :math:`\hat k` is too
large, and returns ArviZ's comparison table. A model that is only an energy
(factor potentials, no normalised observation) has no predictive density and is
refused with :class:`EnergyOnlyModelError`.

**Edge-posterior diagnostics.** Entropy per child
:math:`H_i = -\sum_j A_{ij}\log A_{ij}`, effective number of parents
:math:`e^{H_i}`, expected distance :math:`\sum_j A_{ij} d_{ij}` with
:math:`d_{ij} = i + \text{offset} - j` and the effective window (smallest
:math:`w` with :math:`\sum_{|d_{ij}| \le w} A_{ij} \ge` mass), agreement of the
MAP edges with a known structure, and the posterior of the prior's
hyper-parameters (e.g. the geometric :math:`q` of Singh & Buckley sec. 5.2).

Plots use ``arviz_plots`` and matplotlib; ArviZ and matplotlib are imported
only when a function needs them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.distributions.transforms import biject_to
from numpyro.handlers import block, seed, substitute, trace

from . import exact
from ._checks import as_arrays, model_name
from .exact import (
    EnergyOnlyModelError,
    LikelihoodStructure,
    ScoreFactors,
    likelihood_structure,
    pointwise_log_likelihood,
)
from .primitives import is_enumerated

__all__ = [
    "Fit",
    "fit_nuts",
    "fit_svi",
    "LikelihoodStructure",
    "pointwise_log_likelihood",
    "likelihood_structure",
    "log_likelihood_draws",
    "edge_marginal_draws",
    "edge_prior_draws",
    "to_inference_data",
    "loo",
    "compare_priors",
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

class ParetoKWarning(UserWarning):
    """PSIS-LOO is unreliable for some observations (Pareto :math:`\\hat k` above the threshold)."""


# --------------------------------------------------------------------------------------
# the model's sites (read once, by the exact engine's inspection)
# --------------------------------------------------------------------------------------


def _plain_trace(model, args, kwargs, rng_key=0, params: dict | None = None):
    m = model if params is None else substitute(model, data=params)
    with block():
        return trace(seed(m, rng_key)).get_trace(*args, **kwargs)


def _prior_offset(prior) -> int:
    """The child-to-parent position offset of a structural prior (0 when it has none)."""
    return int(prior.describe().get("offset", 0) or 0)


def _fit_info(model, args, kwargs) -> exact.ModelInfo:
    """The model's :class:`~structinfer.exact.ModelInfo`, refusing what the fitting
    helpers cannot infer (``numpyro.param`` sites, discrete latent sites that are not
    enumerated). Its ``latent`` sites are the parameters to infer."""
    info = exact.inspect_model(model, *args, **kwargs)
    for name, site in info.items():
        if site.role == "param":
            raise ValueError(
                f"model '{model_name(model)}' has a numpyro.param site '{name}'; the "
                "fitting helpers infer sample sites only: give it a prior with "
                "numpyro.sample"
            )
        if site.role == "latent" and site.support.is_discrete:
            raise ValueError(
                f"model '{model_name(model)}': discrete latent site '{name}' is not "
                "enumerated; declare edges with structinfer.edge or mark the site with "
                "infer={'enumerate': 'parallel'}"
            )
    return info


# --------------------------------------------------------------------------------------
# fitting: NUTS over the continuous sites with the edges collapsed, or SVI
# --------------------------------------------------------------------------------------


class Fit(NamedTuple):
    """A fitted model: posterior draws of its continuous latent sites.

    Attributes:
        model: the NumPyro model.
        samples: ``{site: array (chains, draws, ...)}`` in the constrained space.
        args, kwargs: the model's arguments (the data).
        method: ``"nuts"`` or ``"svi"``.
        info: sampler facts (``diverging`` for NUTS, ``losses`` for SVI).
    """

    model: Callable
    samples: dict[str, jax.Array]
    args: tuple
    kwargs: dict
    method: str
    info: dict

    @classmethod
    def from_mcmc(cls, mcmc, model: Callable, *args, **kwargs) -> Fit:
        """Wrap a finished :class:`numpyro.infer.MCMC` run (e.g. from
        ``structinfer.infer.run_nuts``) of ``model`` on ``*args, **kwargs``."""
        args, kwargs = as_arrays(args, kwargs)
        latent = _fit_info(model, args, kwargs).latent
        draws = mcmc.get_samples(group_by_chain=True)
        missing = set(latent) - set(draws)
        if missing:
            raise ValueError(f"Fit.from_mcmc: the MCMC run has no draws of {sorted(missing)}")
        return cls(model, {n: draws[n] for n in latent}, args, kwargs, "nuts", {})

    @classmethod
    def from_guide(
        cls, guide: Callable, params: Mapping, model: Callable, *args, num_draws: int = 1000,
        seed: int = 0, **kwargs
    ) -> Fit:
        """Draws from a fitted SVI guide (``params`` from ``svi.get_params`` or
        ``structinfer.infer.fit_svi``) as a one-chain posterior of ``model``."""
        from numpyro.infer import Predictive

        args, kwargs = as_arrays(args, kwargs)
        latent = _fit_info(model, args, kwargs).latent
        num_draws = _check_positive(num_draws, "Fit.from_guide: num_draws")
        draws = Predictive(guide, params=dict(params), num_samples=num_draws)(
            jax.random.PRNGKey(seed), *args, **kwargs
        )
        missing = set(latent) - set(draws)
        if missing:
            raise ValueError(f"Fit.from_guide: the guide does not sample {sorted(missing)}")
        return cls(model, {n: draws[n][None] for n in latent}, args, kwargs, "svi", {})


def _check_positive(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return int(value)


def fit_nuts(
    model: Callable,
    *args,
    num_warmup: int = 500,
    num_samples: int = 500,
    num_chains: int = 1,
    seed: int = 0,
    target_accept_prob: float = 0.8,
    progress_bar: bool = True,
    **kwargs,
) -> Fit:
    r"""NUTS over the continuous latent sites with every edge collapsed exactly.

    The target is :math:`\log p(\theta) + \log \sum_\phi p(x, \phi \mid \theta)`
    (:func:`structinfer.log_marginal`) in the unconstrained space, plus the
    log-Jacobian of each site's bijection to its support. The potential is built
    directly from the exact engine and jitted once, so no eager funsor pass runs
    during initialisation (NumPyro's ``NUTS(model)`` validates its start eagerly,
    which is slow for enumerated models).

    Args:
        model: the model; every discrete latent site must be an edge (enumerated).
        *args, **kwargs: the model's arguments (the data).
        num_warmup, num_samples, num_chains: as :class:`numpyro.infer.MCMC`; several
            chains run vectorized (one compilation).
        seed: PRNG seed.
        target_accept_prob: NUTS step-size adaptation target.
        progress_bar: show NumPyro's progress bar.

    Returns:
        A :class:`Fit` with ``samples[site]`` of shape ``(chains, draws, ...)``.
    """
    from numpyro.infer import MCMC, NUTS

    num_warmup = _check_positive(num_warmup, "fit_nuts: num_warmup")
    num_samples = _check_positive(num_samples, "fit_nuts: num_samples")
    num_chains = _check_positive(num_chains, "fit_nuts: num_chains")
    args, kwargs = as_arrays(args, kwargs)
    latent = _fit_info(model, args, kwargs).latent
    if not latent:
        raise ValueError(
            f"model '{model_name(model)}' has no continuous latent site to sample; "
            "use structinfer.marginals / log_marginal directly"
        )
    transforms = {n: biject_to(s.support) for n, s in latent.items()}
    shapes = {
        n: jax.eval_shape(transforms[n].inv, jax.ShapeDtypeStruct(s.shape, s.dtype)).shape
        for n, s in latent.items()
    }

    def constrain(z):
        return {n: transforms[n](z[n]) for n in z}

    def neg_log_density(z):
        params = constrain(z)
        ladj = sum(
            jnp.sum(transforms[n].log_abs_det_jacobian(z[n], params[n])) for n in z
        )
        lp = exact.log_marginal(substitute(model, data=params), *args, **kwargs)
        return -(lp + ladj)

    # one compiled value-and-gradient, used by the initial-point search, NumPyro's
    # (eager) initialisation and, inlined, inside the sampler
    value_and_grad = jax.jit(jax.value_and_grad(neg_log_density))

    @jax.custom_vjp
    def potential(z):
        return value_and_grad(z)[0]

    def potential_fwd(z):
        return value_and_grad(z)

    def potential_bwd(grad, ct):
        return (jax.tree.map(lambda g: ct * g, grad),)

    potential.defvjp(potential_fwd, potential_bwd)

    key = jax.random.PRNGKey(seed)
    rng = np.random.default_rng(seed)
    num_tries = 16
    inits = []
    for chain in range(num_chains):
        # uniform(-2, 2) in the unconstrained space (NumPyro's init_to_uniform)
        for _ in range(num_tries):
            z = {
                n: jnp.asarray(rng.uniform(-2.0, 2.0, shapes[n]), dtype=latent[n].dtype)
                for n in sorted(shapes)
            }
            v, g = value_and_grad(z)
            if np.isfinite(float(v)) and all(
                bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g)
            ):
                inits.append(z)
                break
        else:
            raise RuntimeError(
                f"model '{model_name(model)}': no finite log density and gradient at "
                f"{num_tries} random initial points (chain {chain}); check the data and "
                "the priors' supports"
            )
    if num_chains == 1:
        init = inits[0]
    else:
        init = {n: jnp.stack([z[n] for z in inits]) for n in inits[0]}
    mcmc = MCMC(
        NUTS(potential_fn=potential, target_accept_prob=target_accept_prob),
        num_warmup=num_warmup,
        num_samples=num_samples,
        num_chains=num_chains,
        chain_method="vectorized" if num_chains > 1 else "sequential",
        progress_bar=progress_bar,
    )
    mcmc.run(key, init_params=init, extra_fields=("diverging",))
    z = mcmc.get_samples(group_by_chain=True)
    flat = {n: v.reshape((-1,) + v.shape[2:]) for n, v in z.items()}
    samples = jax.jit(jax.vmap(constrain))(flat)
    samples = {n: v.reshape((num_chains, num_samples) + v.shape[1:]) for n, v in samples.items()}
    div = mcmc.get_extra_fields(group_by_chain=True)["diverging"]
    return Fit(model, samples, args, kwargs, "nuts", {"diverging": np.asarray(div)})


def fit_svi(
    model: Callable,
    *args,
    guide: Callable | None = None,
    num_steps: int = 2000,
    learning_rate: float = 0.02,
    num_draws: int = 1000,
    seed: int = 0,
    progress_bar: bool = True,
    **kwargs,
) -> Fit:
    r"""Stochastic variational inference with the edges enumerated (``TraceEnum_ELBO``).

    Maximises :math:`\mathbb E_{q(\theta)}[\log p(\theta) + \log \sum_\phi p(x, \phi \mid \theta)
    - \log q(\theta)]`; the default guide is ``AutoNormal`` over the continuous
    sites (edge sites hidden from it, since they are summed out exactly). The
    posterior draws are draws from the fitted guide.

    Args:
        model: the model.
        *args, **kwargs: the model's arguments (the data).
        guide: a guide over the continuous latent sites (default ``AutoNormal``).
        num_steps: optimisation steps (Adam).
        learning_rate: Adam step size.
        num_draws: draws from the guide kept as the posterior.
        seed: PRNG seed.
        progress_bar: show NumPyro's progress bar.

    Returns:
        A :class:`Fit` with one chain (``samples[site]`` of shape ``(1, num_draws, ...)``)
        and ``info["losses"]`` (the negative ELBO per step).
    """
    from numpyro.infer import SVI, TraceEnum_ELBO
    from numpyro.infer.autoguide import AutoNormal

    num_steps = _check_positive(num_steps, "fit_svi: num_steps")
    num_draws = _check_positive(num_draws, "fit_svi: num_draws")
    args, kwargs = as_arrays(args, kwargs)
    nesting = _fit_info(model, args, kwargs).max_plate_nesting
    if guide is None:
        guide = AutoNormal(block(model, hide_fn=is_enumerated))
    svi = SVI(
        model,
        guide,
        numpyro.optim.Adam(learning_rate),
        TraceEnum_ELBO(max_plate_nesting=nesting),
    )
    res = svi.run(jax.random.PRNGKey(seed), num_steps, *args, progress_bar=progress_bar, **kwargs)
    fit = Fit.from_guide(guide, res.params, model, *args, num_draws=num_draws, seed=seed + 1,
                         **kwargs)
    return fit._replace(info={"losses": np.asarray(res.losses)})


# --------------------------------------------------------------------------------------
# quantities over posterior draws
# --------------------------------------------------------------------------------------


def _map_draws(f, samples: Mapping[str, jax.Array], batch_size: int | None):
    lead = next(iter(samples.values())).shape[:2]
    flat = {n: v.reshape((-1,) + v.shape[2:]) for n, v in samples.items()}
    out = jax.jit(lambda s: jax.lax.map(f, s, batch_size=batch_size))(flat)
    return jax.tree.map(lambda a: a.reshape(lead + a.shape[1:]), out)


def _as_fit(fit) -> Fit:
    if not isinstance(fit, Fit):
        raise TypeError(
            f"expected a structinfer.diagnostics.Fit (from fit_nuts / fit_svi), got "
            f"{type(fit).__name__}"
        )
    for n, v in fit.samples.items():
        if jnp.ndim(v) < 2:
            raise ValueError(
                f"Fit.samples['{n}'] has shape {jnp.shape(v)}; expected (chains, draws, ...)"
            )
    return fit


def _draw_quantities(
    fit: Fit, what: Sequence[str], score_factors: ScoreFactors, batch_size: int | None
) -> dict[str, Any]:
    """Per-draw log-likelihood (``"ll"``), edge marginals (``"marg"``) and prior tables
    (``"prior"``) in one jitted pass over the draws (one compilation)."""
    fit = _as_fit(fit)
    first = {n: v[0, 0] for n, v in fit.samples.items()}
    out: dict[str, Any] = {}
    if "ll" in what:
        out["struct"] = likelihood_structure(
            fit.model, first, *fit.args, score_factors=score_factors, **fit.kwargs
        )
    edges = exact.inspect_model(substitute(fit.model, data=first), *fit.args, **fit.kwargs).edges

    def f(p):
        res = {}
        if "ll" in what:
            res["ll"] = pointwise_log_likelihood(
                fit.model, p, *fit.args, score_factors=score_factors, **fit.kwargs
            )
        if "marg" in what and edges:
            marg = exact.marginals(substitute(fit.model, data=p), *fit.args, **fit.kwargs)
            res["marg"] = {n: marg[n] for n in edges}
        if "prior" in what and edges:
            info = exact.inspect_model(substitute(fit.model, data=p), *fit.args, **fit.kwargs)
            res["prior"] = {
                n: jnp.exp(s.edge.prior.log_table(s.edge.num_children))
                for n, s in info.items()
                if s.edge is not None
            }
        return res

    res = _map_draws(f, fit.samples, batch_size)
    out.update(jax.tree.map(np.asarray, res))
    out.setdefault("marg", {})
    out.setdefault("prior", {})
    return out


def log_likelihood_draws(
    fit: Fit, *, score_factors: ScoreFactors = "error", batch_size: int | None = 64
) -> tuple[np.ndarray, LikelihoodStructure]:
    """:func:`pointwise_log_likelihood` at every posterior draw of ``fit``.

    Returns:
        ``(values, structure)`` with ``values`` of shape ``(chains, draws) + structure.shape``.
    """
    q = _draw_quantities(fit, ["ll"], score_factors, batch_size)
    return q["ll"], q["struct"]


def edge_marginal_draws(fit: Fit, *, batch_size: int | None = 64) -> dict[str, np.ndarray]:
    r"""Posterior edge marginals :math:`p(\phi_i = j \mid x, \theta^{(s)})` at every draw.

    Returns:
        ``{edge site: array (chains, draws, ..., children, parents)}``.
    """
    return _draw_quantities(fit, ["marg"], "error", batch_size)["marg"]


def edge_prior_draws(fit: Fit, *, batch_size: int | None = 64) -> dict[str, np.ndarray]:
    r"""The structural prior tables :math:`p(\phi_i = j \mid \theta^{(s)})` at every draw.

    Returns:
        ``{edge site: array (chains, draws, ..., children, parents)}`` of probabilities.
    """
    return _draw_quantities(fit, ["prior"], "error", batch_size)["prior"]


def _observed_values(fit: Fit, struct: LikelihoodStructure) -> dict[str, np.ndarray]:
    first = {n: v[0, 0] for n, v in fit.samples.items()}

    def f(p):
        tr = _plain_trace(fit.model, fit.args, fit.kwargs, params=p)
        return {n: tr[n]["value"] for n in struct.observed}

    return {n: np.asarray(v) for n, v in jax.jit(f)(first).items()}


def _prior_draws(model, args, kwargs, names, num: int, rng_seed: int) -> dict[str, np.ndarray]:
    def one(key):
        with block():
            tr = trace(seed(model, key)).get_trace(*args, **kwargs)
        return {n: tr[n]["value"] for n in names}

    keys = jax.random.split(jax.random.PRNGKey(rng_seed), num)
    return {n: np.asarray(v) for n, v in jax.jit(jax.vmap(one))(keys).items()}


def to_inference_data(
    fit: Fit,
    *,
    score_factors: ScoreFactors = "error",
    num_prior_draws: int = 0,
    true_edges: Mapping[str, Any] | None = None,
    batch_size: int | None = 64,
    seed: int = 0,
):
    r"""Build ArviZ's InferenceData (an ``xarray.DataTree``) for a fitted structural model.

    Groups:

    * ``posterior`` — the draws of the continuous sites, dims ``(chain, draw, ...)``;
    * ``log_likelihood`` — :func:`pointwise_log_likelihood` per draw (edges collapsed),
      one variable named after the observed site, dims ``(chain, draw, <plates>)``;
    * ``observed_data`` — the observed values;
    * ``prior`` (when ``num_prior_draws > 0``) — draws of the continuous sites from
      the prior, for ``arviz_plots.plot_prior_posterior`` (off by default: compiling
      samplers such as Beta's takes seconds; :func:`plot_hyperparameter` draws the
      prior density instead);
    * ``edge_posterior`` — per edge site ``<site>``: the posterior marginals
      :math:`p(\phi_i=j\mid x) = \frac1S\sum_s p(\phi_i=j\mid x,\theta^{(s)})`,
      ``<site>_prior`` (the prior table averaged over the posterior draws) and, when
      given, ``<site>_true`` (the known parents); the attribute ``<site>.offset``
      holds the child-to-parent position offset used for distances.

    Raises:
        EnergyOnlyModelError: the model has no normalised observation.
    """
    import arviz_base as azb
    import xarray as xr

    fit = _as_fit(fit)
    q = _draw_quantities(fit, ["ll", "marg", "prior"], score_factors, batch_size)
    ll, struct, marg, prior_tables = q["ll"], q["struct"], q["marg"], q["prior"]
    obs = _observed_values(fit, struct)
    first = {n: v[0, 0] for n, v in fit.samples.items()}
    model_info = exact.inspect_model(substitute(fit.model, data=first), *fit.args, **fit.kwargs)
    infos = {n: s.edge for n, s in model_info.items() if s.edge is not None}
    latent = sorted(fit.samples)

    data: dict[str, dict[str, Any]] = {
        "posterior": {n: np.asarray(v) for n, v in fit.samples.items()},
        "log_likelihood": {struct.name: ll},
        "observed_data": obs,
    }
    dims: dict[str, list[str]] = {struct.name: list(struct.plates)}
    for n, v in obs.items():
        extra = v.ndim - len(struct.plates)
        if extra >= 0 and tuple(v.shape[: len(struct.plates)]) == struct.shape:
            dims[n] = list(struct.plates) + [f"{n}_dim_{k}" for k in range(extra)]
    if num_prior_draws:
        prior = _prior_draws(fit.model, fit.args, fit.kwargs, latent, int(num_prior_draws), seed)
        data["prior"] = {n: v[None] for n, v in prior.items()}
    dt = azb.from_dict(data, dims=dims, attrs={"/": {"model": model_name(fit.model)}})
    dt.attrs["inference_method"] = fit.method

    edge_vars, attrs = {}, {}
    for n, m in marg.items():
        mean = m.mean(axis=(0, 1))
        info = infos.get(n)
        child_dim = info.children_plate if info is not None else f"{n}_child"
        bdims = [f"{n}_dim_{k}" for k in range(mean.ndim - 2)] + [child_dim, f"{n}_parent"]
        edge_vars[n] = (bdims, mean)
        if n in prior_tables:
            edge_vars[f"{n}_prior"] = (bdims, prior_tables[n].mean(axis=(0, 1)))
        if true_edges is not None and n in true_edges:
            t = _check_true_edges(true_edges[n], mean, n)
            edge_vars[f"{n}_true"] = (bdims[:-1], t)
        attrs[f"{n}.offset"] = _prior_offset(info.prior) if info is not None else 0
    dt["edge_posterior"] = xr.DataTree(xr.Dataset(edge_vars, attrs=attrs))
    return dt


# --------------------------------------------------------------------------------------
# LOO and comparison
# --------------------------------------------------------------------------------------


def _format_index(k_da, idx: tuple[int, ...]) -> str:
    if len(idx) == 1:
        return f"{k_da.dims[0]} {idx[0]}"
    return "(" + ", ".join(f"{d}={i}" for d, i in zip(k_da.dims, idx)) + ")"


def _warn_pareto(res, name: str, threshold: float | None) -> None:
    k_da = res.pareto_k
    if k_da is None:
        return
    thr = float(res.good_k if threshold is None else threshold)
    k = np.asarray(k_da)
    bad = np.argwhere(k > thr)
    if len(bad) == 0:
        return
    shown = ", ".join(
        f"{_format_index(k_da, tuple(int(i) for i in b))} (k={k[tuple(b)]:.2f})" for b in bad[:8]
    )
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    warnings.warn(
        f"model '{name}': PSIS-LOO is unreliable for {len(bad)} of {k.size} observations "
        f"(Pareto k > {thr:.2f}): {shown}{more}. These children are badly approximated "
        "by importance sampling (highly influential); use more draws, K-fold "
        "cross-validation, or a more robust model before trusting the comparison.",
        ParetoKWarning,
        stacklevel=3,
    )


def loo(idata, *, name: str = "model", var_name: str | None = None,
        pareto_k_threshold: float | None = None):
    r"""PSIS-LOO of a structural model's InferenceData, with Pareto-:math:`\hat k` warnings.

    .. math::

        \widehat{\mathrm{elpd}}_{\mathrm{loo}} = \sum_i \log
        \frac{\sum_s w_i^{(s)} p(x_i \mid \theta^{(s)})}{\sum_s w_i^{(s)}},
        \qquad w_i^{(s)} \propto 1 / p(x_i \mid \theta^{(s)}) \text{ (Pareto smoothed)}

    with :math:`p(x_i\mid\theta)` the collapsed per-child likelihood (Vehtari, Gelman
    & Gabry 2017). Children with :math:`\hat k` above ``pareto_k_threshold``
    (default ArviZ's sample-size dependent ``good_k``, at most 0.7) are named in a
    :class:`ParetoKWarning`.

    Returns:
        ArviZ's ``ELPDData`` (pointwise).
    """
    import arviz_stats as azs

    if "log_likelihood" not in getattr(idata, "children", {}):
        raise ValueError(
            f"model '{name}': the InferenceData has no log_likelihood group; build it with "
            "structinfer.diagnostics.to_inference_data"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Estimated shape parameter of Pareto")
        warnings.filterwarnings("ignore", category=RuntimeWarning)
        res = azs.loo(idata, pointwise=True, var_name=var_name, **_constant_terms(idata, var_name))
    _warn_pareto(res, name, pareto_k_threshold)
    return res


def _constant_terms(idata, var_name: str | None) -> dict:
    r"""PSIS weights when some observations' log-likelihood is the same at every draw.

    Such an observation does not depend on the sampled parameters (e.g. a first child
    with a single possible parent and fixed weights): its leave-one-out predictive
    density is exactly its likelihood, the importance weights are uniform and Pareto
    :math:`\hat k` is not defined (ArviZ's tail fit raises). We pass uniform weights
    and :math:`\hat k = 0` for them and ArviZ's PSIS weights for the rest.
    """
    import xarray as xr

    ll_group = idata["log_likelihood"].to_dataset()
    names = list(ll_group.data_vars)
    var = var_name if var_name is not None else (names[0] if len(names) == 1 else None)
    if var is None or var not in ll_group:
        return {}
    ll = ll_group[var]
    sample_dims = [d for d in ("chain", "draw") if d in ll.dims]
    if len(sample_dims) != 2 or ll.ndim == 2:
        return {}
    spread = ll.max(sample_dims) - ll.min(sample_dims)
    const = spread <= 1e-9 * (1.0 + np.abs(ll).max(sample_dims))
    if not bool(const.any()):
        return {}
    n_chains, n_draws = ll.sizes["chain"], ll.sizes["draw"]
    n_samples = n_chains * n_draws
    reff = _relative_efficiency(idata, n_samples)
    ramp = xr.DataArray(
        np.arange(n_samples, dtype=float).reshape(n_chains, n_draws) / n_samples,
        dims=("chain", "draw"),
    )
    placeholder = xr.where(const, ramp, ll)  # any non-constant values: overwritten below
    log_weights, pareto_k = placeholder.azstats.psislw(r_eff=reff, dim=sample_dims)
    log_weights = xr.where(const, -np.log(n_samples), log_weights)
    pareto_k = xr.where(const, 0.0, pareto_k)
    return {"reff": reff, "log_weights": log_weights, "pareto_k": pareto_k}


def _relative_efficiency(idata, n_samples: int) -> float:
    r"""PSIS's relative efficiency $r_\mathrm{eff} = \overline{\mathrm{ESS}} / S$: the mean
    over every element of every posterior variable of its (mean) effective sample size,
    over the number of draws $S$; 1 for a single chain. This is the ``reff`` ArviZ's
    ``loo`` uses by default (Vehtari, Gelman & Gabry 2017, sec. 3.1)."""
    posterior = idata["posterior"]
    if posterior.sizes["chain"] == 1:
        return 1.0
    ess = posterior.to_dataset().azstats.ess(method="mean")
    return float(np.hstack([np.ravel(ess[v].values) for v in ess.data_vars]).mean() / n_samples)


def check_comparable(model: Callable, args: tuple, kwargs: dict,
                     score_factors: ScoreFactors = "error") -> None:
    """Refuse, before any fitting, a model that :func:`compare_priors` cannot compare.

    Shape-only: the model is inspected once and its pointwise log-likelihood structure
    read with placeholders for the parameters (:func:`likelihood_structure`).

    Raises:
        EnergyOnlyModelError: the model defines an energy, not a density of its data.
        ValueError: a ``numpyro.param`` site or a discrete latent site that is not
            enumerated (the fitting helpers cannot infer them).
    """
    args, kwargs = as_arrays(args, kwargs)
    _fit_info(model, args, kwargs)
    likelihood_structure(model, None, *args, score_factors=score_factors, **kwargs)


def compare_priors(
    models: Mapping[str, Any],
    *args,
    method: str = "stacking",
    fit: Literal["nuts", "svi"] = "nuts",
    fit_kwargs: Mapping[str, Any] | None = None,
    score_factors: ScoreFactors = "error",
    pareto_k_threshold: float | None = None,
    **kwargs,
):
    r"""Compare models (typically one model under several structural priors) by PSIS-LOO.

    Each entry of ``models`` is a fitted :class:`Fit`, an InferenceData from
    :func:`to_inference_data`, or a model callable that is fitted here with
    :func:`fit_nuts` (or :func:`fit_svi`) on ``*args, **kwargs``. The expected log
    pointwise predictive density uses the per-child likelihood with the edges
    collapsed (:func:`pointwise_log_likelihood`), so the comparison asks which prior
    over structures predicts each held-out child best.

    Args:
        models: ``{name: Fit | DataTree | model}``.
        *args, **kwargs: data for the models that are fitted here.
        method: ArviZ's weighting method (``"stacking"``, ``"BB-pseudo-BMA"``, ``"pseudo-BMA"``).
        fit: ``"nuts"`` or ``"svi"`` for the models fitted here.
        fit_kwargs: extra arguments for the fitting function (e.g. ``num_samples``).
        score_factors: see :func:`pointwise_log_likelihood`.
        pareto_k_threshold: threshold for :class:`ParetoKWarning` (default ArviZ's ``good_k``).

    Returns:
        ArviZ's comparison table (a ``pandas.DataFrame`` ranked best first: ``elpd``,
        ``p``, ``elpd_diff``, ``weight``, ``se``, ``dse``, ``warning``).

    Raises:
        EnergyOnlyModelError: for a model with no normalised observation (before fitting).
    """
    import arviz_stats as azs

    if not isinstance(models, Mapping) or len(models) < 2:
        raise ValueError("compare_priors: pass a mapping {name: model or fit} of at least two models")
    if fit not in ("nuts", "svi"):
        raise ValueError(f"compare_priors: fit must be 'nuts' or 'svi', got {fit!r}")
    for item in models.values():
        if callable(item) and not isinstance(item, Fit):
            check_comparable(item, args, kwargs, score_factors)
    fitter = fit_nuts if fit == "nuts" else fit_svi
    elpds = {}
    for name, item in models.items():
        if isinstance(item, Fit):
            dt = to_inference_data(item, score_factors=score_factors, num_prior_draws=0)
        elif callable(item):
            f = fitter(item, *args, **dict(fit_kwargs or {}), **kwargs)
            dt = to_inference_data(f, score_factors=score_factors, num_prior_draws=0)
        else:
            dt = item
        elpds[name] = loo(dt, name=name, pareto_k_threshold=pareto_k_threshold)
    sizes = {n: int(e.n_data_points) for n, e in elpds.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"compare_priors: the models have different numbers of observations {sizes}; "
            "compare models of the same data"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Estimated shape parameter of Pareto")
        return azs.compare(elpds, method=method)


# --------------------------------------------------------------------------------------
# edge-posterior diagnostics (pure jnp, jittable)
# --------------------------------------------------------------------------------------


def _offset_of(offset) -> int:
    """The positional offset: an int, or the ``offset`` of a structural prior.

    Every prior of :mod:`structinfer.priors` carries its ``offset`` (0 unless it was
    built with one), so passing the prior itself is the way to get the convention
    it was built with.

    Raises:
        TypeError: for anything else (a float, a bool, None).
    """
    import operator

    from .priors import StructuralPrior

    if isinstance(offset, StructuralPrior):
        offset = offset.offset
    if not isinstance(offset, (bool, np.bool_)):
        try:
            return operator.index(offset)
        except TypeError:
            pass
    raise TypeError(
        "offset must be an int (child i sits at parent position i + offset) or a "
        f"structural prior carrying one, got {offset!r}"
    )


def _distances(marginals, offset: int) -> jax.Array:
    """``d[i, j] = i + offset - j`` for the ``(children, parents)`` grid of ``marginals``."""
    n, m = marginals.shape[-2:]
    return jnp.arange(n)[:, None] + _offset_of(offset) - jnp.arange(m)[None, :]


def _check_marginals(marginals, what: str = "marginals") -> jax.Array:
    a = jnp.asarray(marginals)
    if a.ndim < 2:
        raise ValueError(
            f"{what} must have shape (..., children, parents), got {tuple(a.shape)}"
        )
    return a


def edge_entropy(marginals: jax.Array) -> jax.Array:
    r"""Entropy of each child's edge posterior, :math:`H_i = -\sum_j A_{ij}\log A_{ij}` (nats).

    Args:
        marginals: ``(..., children, parents)``, rows summing to one.

    Returns:
        ``(..., children)``; 0 for a certain edge, :math:`\log m` for a uniform one.
    """
    a = _check_marginals(marginals)
    return jnp.sum(jax.scipy.special.entr(a), axis=-1)


def effective_parents(marginals: jax.Array) -> jax.Array:
    r"""Effective number of parents :math:`e^{H_i}` (1 = one parent, :math:`m` = uniform)."""
    return jnp.exp(edge_entropy(marginals))


def expected_distance(marginals: jax.Array, offset=0) -> jax.Array:
    r"""Posterior expected distance to the parent, :math:`\sum_j A_{ij}(i + \text{offset} - j)`.

    Child :math:`i` sits at parent position :math:`i + \text{offset}` (the convention of
    :mod:`structinfer.priors`).

    Args:
        marginals: ``(..., children, parents)``, rows summing to one.
        offset: an int, or the structural prior of the edge site (its ``offset`` is used).

    Returns:
        ``(..., children)``.
    """
    a = _check_marginals(marginals)
    return jnp.sum(a * _distances(a, offset).astype(a.dtype), axis=-1)


def effective_window(marginals: jax.Array, offset=0, mass: float = 0.9) -> jax.Array:
    r"""Smallest window :math:`w` holding ``mass`` of each child's edge posterior.

    .. math:: w_i = \min\{w \ge 0 : \textstyle\sum_{j : |d_{ij}| \le w} A_{ij} \ge \text{mass}\}

    Args:
        marginals: ``(..., children, parents)``, rows summing to one.
        offset: an int, or the structural prior of the edge site (its ``offset`` is used).
        mass: the posterior mass the window must hold, in ``(0, 1]``.

    Returns:
        An int array ``(..., children)``.
    """
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"effective_window: mass must lie in (0, 1], got {mass}")
    offset = _offset_of(offset)
    a = _check_marginals(marginals)
    d = jnp.abs(_distances(a, offset))
    wmax = int(a.shape[-2] + a.shape[-1] + abs(offset))
    ws = jnp.arange(wmax + 1)
    inside = (d[..., None] <= ws).astype(a.dtype)  # (n, m, W)
    cum = jnp.einsum("...ij,ijw->...iw", a, inside)
    tol = 1e-6 if a.dtype == jnp.float32 else 1e-12
    return jnp.argmax(cum >= mass - tol, axis=-1)


def distance_posterior(marginals: jax.Array, offset=0) -> tuple[np.ndarray, jax.Array]:
    r"""Edge mass by distance, averaged over children: :math:`p(d) = \frac1n\sum_i\sum_j A_{ij}[d_{ij}=d]`.

    Works for prior tables too (pass probabilities). Returns ``(distances, probs)`` with
    ``distances`` all values of :math:`d_{ij}` in the grid (ascending) and ``probs``
    of shape ``(..., len(distances))``. ``offset`` is an int or the edge site's prior.
    """
    offset = _offset_of(offset)
    a = _check_marginals(marginals)
    n, m = a.shape[-2:]
    dmin, dmax = -(m - 1) + offset, n - 1 + offset
    ds = np.arange(dmin, dmax + 1)
    onehot = (_distances(a, offset)[..., None] == jnp.asarray(ds)).astype(a.dtype)
    return ds, jnp.einsum("...ij,ijd->...d", a, onehot) / n


class EdgeAgreement(NamedTuple):
    """Agreement of the posterior edges with a known structure.

    Attributes:
        accuracy: fraction of children whose MAP parent (argmax of the marginals) is the true one.
        true_parent_prob: mean posterior probability of the true parent.
        correct: ``(..., children)`` bool, MAP parent equals the true one.
    """

    accuracy: jax.Array
    true_parent_prob: jax.Array
    correct: jax.Array


def _check_true_edges(true_edges, marginals, site: str = "edges") -> np.ndarray:
    t = np.asarray(true_edges)
    shape = tuple(np.shape(marginals)[:-1])
    m = np.shape(marginals)[-1]
    if not np.issubdtype(t.dtype, np.integer):
        raise TypeError(f"true structure for '{site}' must be integer parent indices, got {t.dtype}")
    if t.shape != shape:
        raise ValueError(
            f"true structure for '{site}' has shape {t.shape}; expected one parent index per "
            f"child, shape {shape}"
        )
    if t.size and (t.min() < 0 or t.max() >= m):
        raise ValueError(
            f"true structure for '{site}' has parent indices outside [0, {m}): "
            f"min {t.min()}, max {t.max()}"
        )
    return t


def edge_agreement(marginals: jax.Array, true_edges) -> EdgeAgreement:
    r"""Compare the MAP edges :math:`\hat\phi_i = \arg\max_j A_{ij}` with the true parents.

    For a model whose children are independent given the parameters, the joint MAP
    structure is the per-child argmax, so this is the MAP-structure agreement.

    Args:
        marginals: ``(..., children, parents)``.
        true_edges: int ``(..., children)``, the true parent of each child.
    """
    a = _check_marginals(marginals)
    if not isinstance(true_edges, jax.core.Tracer):
        true_edges = _check_true_edges(true_edges, a)
    t = jnp.asarray(true_edges)
    correct = jnp.argmax(a, axis=-1) == t
    p_true = jnp.take_along_axis(a, t[..., None], axis=-1)[..., 0]
    return EdgeAgreement(jnp.mean(correct), jnp.mean(p_true), correct)


def edge_summary(idata, site: str | None = None, true_edges=None, mass: float = 0.9) -> dict:
    """Scalar summaries of one edge site's posterior in an InferenceData.

    Returns a dict: mean entropy (nats), mean effective number of parents, mean
    expected distance, mean effective window (``mass``), and with a true structure
    (argument, or ``<site>_true`` stored in the data) the MAP accuracy and the mean
    probability of the true parent.
    """
    if "edge_posterior" not in getattr(idata, "children", {}):
        raise ValueError("edge_summary: the InferenceData has no edge_posterior group")
    ds = idata["edge_posterior"].to_dataset()
    sites = [v for v in ds.data_vars if not v.endswith(("_prior", "_true"))]
    if site is None:
        if len(sites) != 1:
            raise ValueError(f"edge_summary: several edge sites {sites}; pass site=")
        site = sites[0]
    if site not in sites:
        raise KeyError(f"edge_summary: no edge site '{site}'; edge sites: {sites}")
    a = jnp.asarray(ds[site].values)
    offset = int(ds.attrs.get(f"{site}.offset", 0))
    out = {
        "entropy": float(jnp.mean(edge_entropy(a))),
        "effective_parents": float(jnp.mean(effective_parents(a))),
        "expected_distance": float(jnp.mean(expected_distance(a, offset))),
        "effective_window": float(jnp.mean(effective_window(a, offset, mass))),
    }
    if true_edges is None and f"{site}_true" in ds:
        true_edges = ds[f"{site}_true"].values
    if true_edges is not None:
        agr = edge_agreement(a, true_edges)
        out["map_accuracy"] = float(agr.accuracy)
        out["true_parent_prob"] = float(agr.true_parent_prob)
    return out


def compare_edges(idatas: Mapping[str, Any], site: str | None = None, true_edges=None):
    """:func:`edge_summary` of several models as a ``pandas.DataFrame`` (one row per model),
    sorted by MAP accuracy when a true structure is known."""
    import pandas as pd

    rows = {n: edge_summary(dt, site=site, true_edges=true_edges) for n, dt in idatas.items()}
    df = pd.DataFrame.from_dict(rows, orient="index")
    if "map_accuracy" in df:
        df = df.sort_values(["map_accuracy", "true_parent_prob"], ascending=False)
    return df


def hyperparameter_summary(idata, var_names: Sequence[str], round_to: int | str = "none"):
    r"""Posterior summary (mean, sd, interval, ESS, :math:`\hat R`) of the prior's
    hyper-parameters, e.g. the geometric ``q`` under a Beta hyperprior. Wraps
    ``arviz_stats.summary`` (``round_to`` decimals, ``"none"`` for raw numbers)."""
    import arviz_stats as azs

    post = idata["posterior"].to_dataset()
    missing = [v for v in var_names if v not in post]
    if missing:
        raise KeyError(
            f"hyperparameter_summary: {missing} not in the posterior; variables: {list(post.data_vars)}"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=RuntimeWarning)
        return azs.summary(idata, var_names=list(var_names), round_to=round_to)


class ConvergenceReport(NamedTuple):
    """Facts about an iterative algorithm's objective trace (free energy, loss).

    Attributes:
        num_iterations: length of the trace.
        initial, final: first and last values.
        monotone: the trace never increased by more than ``tol`` (CCCP, EM and
            conjugate mean-field updates must be monotone in the free energy).
        max_increase: largest single-step increase.
        first_increase: index of the first step that increased by more than ``tol`` (-1 if none).
    """

    num_iterations: int
    initial: float
    final: float
    monotone: bool
    max_increase: float
    first_increase: int


def _as_trace(trace) -> np.ndarray:
    if hasattr(trace, "_fields"):
        for f in ("free_energy", "energy", "loss", "losses", "elbo", "objective"):
            if f in trace._fields:
                trace = getattr(trace, f)
                break
        else:
            raise ValueError(
                f"convergence trace: {type(trace).__name__} has no free_energy/energy/loss "
                f"field (fields: {trace._fields})"
            )
    t = np.asarray(trace, dtype=float)
    if t.ndim != 1 or t.size == 0:
        raise ValueError(f"convergence trace must be a non-empty 1-d array, got shape {t.shape}")
    return t


def convergence_report(trace, tol: float = 1e-6) -> ConvergenceReport:
    r"""Check an objective trace :math:`F_0, F_1, \dots` (to be minimised) for monotone descent.

    Args:
        trace: a 1-d array, or an ``info`` NamedTuple with a ``free_energy`` / ``energy``
            / ``loss`` field (as returned by the iterative algorithms' ``run``).
        tol: relative tolerance: a step counts as an increase when
            :math:`F_{t+1} - F_t > \text{tol}\,(1 + |F_t|)`.
    """
    t = _as_trace(trace)
    t = t[np.isfinite(t)] if np.isfinite(t).any() else t
    inc = np.diff(t)
    bad = np.nonzero(inc > tol * (1 + np.abs(t[:-1])))[0]
    return ConvergenceReport(
        num_iterations=int(t.size),
        initial=float(t[0]),
        final=float(t[-1]),
        monotone=bool(bad.size == 0),
        max_increase=float(inc.max()) if inc.size else 0.0,
        first_increase=int(bad[0]) if bad.size else -1,
    )


# --------------------------------------------------------------------------------------
# plots (matplotlib / arviz_plots)
# --------------------------------------------------------------------------------------


def _axes(ax):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4))
    return ax


def plot_attention(marginals, *, true_edges=None, ax=None, title: str | None = None):
    r"""Heatmap of the edge posterior (the attention matrix) :math:`A_{ij} = p(\phi_i=j\mid x)`,
    children down, parents across; true parents (if given) marked with circles."""
    a = np.asarray(_check_marginals(marginals))
    if a.ndim != 2:
        raise ValueError(f"plot_attention: pass one (children, parents) matrix, got {a.shape}")
    ax = _axes(ax)
    im = ax.imshow(a, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.figure.colorbar(im, ax=ax, label=r"$p(\phi_i = j \mid x)$")
    if true_edges is not None:
        t = _check_true_edges(true_edges, a)
        ax.scatter(t, np.arange(a.shape[0]), s=12, facecolors="none", edgecolors="red",
                   label="true parent")
        ax.legend(loc="upper right", fontsize="small")
    ax.set_xlabel("parent j")
    ax.set_ylabel("child i")
    if title:
        ax.set_title(title)
    return ax


def plot_distance(
    marginals,
    prior=None,
    *,
    offset=0,
    true_edges=None,
    ax=None,
    label: str = "posterior",
    max_distance: int | None = None,
    title: str | None = None,
):
    r"""Prior vs posterior edge mass by distance :math:`d = i + \text{offset} - j`
    (:func:`distance_posterior`), with the histogram of true distances when known.
    ``offset`` is an int or the edge site's structural prior."""
    offset = _offset_of(offset)
    a = _check_marginals(marginals)
    ax = _axes(ax)
    ds, post = distance_posterior(a, offset)
    keep = ds >= 0 if np.asarray(post)[ds < 0].sum() < 1e-9 else np.ones_like(ds, bool)
    if max_distance is not None:
        keep &= ds <= max_distance
    ax.plot(ds[keep], np.asarray(post)[keep], "o-", label=label)
    if prior is not None:
        _, pp = distance_posterior(_check_marginals(prior, "prior"), offset)
        ax.plot(ds[keep], np.asarray(pp)[keep], "s--", alpha=0.7, label="prior")
    if true_edges is not None:
        t = _check_true_edges(true_edges, a)
        d_true = np.arange(a.shape[-2]) + offset - t
        hist = np.array([(d_true == d).mean() for d in ds])
        ax.bar(ds[keep], hist[keep], alpha=0.25, color="gray", label="true")
    ax.set_xlabel("distance to parent d")
    ax.set_ylabel("edge mass")
    ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    return ax


def plot_compare(comparison, path: str | None = None):
    """ArviZ's comparison plot (ELPD with standard errors) of a :func:`compare_priors` table.
    Returns the ``arviz_plots.PlotCollection``; saves it when ``path`` is given."""
    import arviz_plots as azp

    pc = azp.plot_compare(comparison, backend="matplotlib")
    if path is not None:
        pc.savefig(path)
    return pc


def plot_trace(idata, var_names: Sequence[str] | None = None, path: str | None = None):
    """Convergence traces and marginal densities of posterior draws (``arviz_plots.plot_trace_dist``)."""
    import arviz_plots as azp

    pc = azp.plot_trace_dist(idata, var_names=None if var_names is None else list(var_names),
                             backend="matplotlib")
    if path is not None:
        pc.savefig(path)
    return pc


def plot_prior_posterior(idata, var_names: Sequence[str], path: str | None = None):
    """Prior vs posterior of hyper-parameters (``arviz_plots.plot_prior_posterior``); needs
    the ``prior`` group that :func:`to_inference_data` writes."""
    import arviz_plots as azp

    if "prior" not in getattr(idata, "children", {}):
        raise ValueError("plot_prior_posterior: the InferenceData has no prior group")
    pc = azp.plot_prior_posterior(idata, var_names=list(var_names), backend="matplotlib")
    if path is not None:
        pc.savefig(path)
    return pc


def prior_log_density(fit: Fit, site: str, grid) -> np.ndarray:
    """Log prior density of a scalar latent site (e.g. the geometric ``q``) on a grid,
    read from the model (the site's distribution given the first posterior draw of its
    parents in the model)."""
    fit = _as_fit(fit)
    if site not in fit.samples:
        raise KeyError(f"prior_log_density: no latent site '{site}'; sites: {sorted(fit.samples)}")
    if fit.samples[site].ndim != 2:
        raise ValueError(
            f"prior_log_density: site '{site}' is not scalar (draws of shape "
            f"{fit.samples[site].shape[2:]})"
        )
    first = {n: v[0, 0] for n, v in fit.samples.items()}

    def f(g):
        tr = _plain_trace(fit.model, fit.args, fit.kwargs, params=first)
        return tr[site]["fn"].log_prob(g)

    return np.asarray(jax.jit(f)(jnp.asarray(grid)))


def plot_hyperparameter(
    fit: Fit, site: str, *, ax=None, true_value: float | None = None, bins: int = 30
):
    r"""Posterior histogram of a scalar hyper-parameter against its prior density
    (e.g. :math:`q` of a geometric prior with a Beta hyperprior)."""
    fit = _as_fit(fit)
    ax = _axes(ax)
    draws = np.asarray(fit.samples[site]).ravel()
    lo, hi = float(draws.min()), float(draws.max())
    pad = 0.25 * (hi - lo + 1e-6)
    grid = np.linspace(lo - pad, hi + pad, 200)
    dens = np.exp(prior_log_density(fit, site, grid))
    ax.hist(draws, bins=bins, density=True, alpha=0.5, label="posterior")
    ax.plot(grid, np.where(np.isfinite(dens), dens, 0.0), "k--", label="prior")
    if true_value is not None:
        ax.axvline(true_value, color="red", lw=1, label="true")
    ax.set_xlabel(site)
    ax.set_ylabel("density")
    ax.legend(fontsize="small")
    return ax


def plot_convergence(traces, *, ax=None, ylabel: str = "free energy", log_gap: bool = False):
    r"""Objective traces of iterative algorithms (mean-field, EM, CCCP, SVI) against iteration.

    Args:
        traces: a 1-d array / info NamedTuple, or ``{label: trace}`` for several.
        log_gap: plot :math:`F_t - \min F + \epsilon` on a log axis (shows the rate).

    Non-monotone traces (see :func:`convergence_report`) are marked in the legend.
    """
    ax = _axes(ax)
    items = traces.items() if isinstance(traces, Mapping) else [("trace", traces)]
    for label, tr in items:
        t = _as_trace(tr)
        rep = convergence_report(t)
        y = t - np.nanmin(t) + 1e-12 if log_gap else t
        ax.plot(np.arange(t.size), y, label=label + ("" if rep.monotone else " (non-monotone)"))
    if log_gap:
        ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel + (" - min" if log_gap else ""))
    ax.legend(fontsize="small")
    return ax
