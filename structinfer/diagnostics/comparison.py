r"""PSIS-LOO of structural models with the edges collapsed, and their comparison.

$$\widehat{\mathrm{elpd}}_{\mathrm{loo}} = \sum_i \log
\frac{\sum_s w_i^{(s)} p(x_i \mid \theta^{(s)})}{\sum_s w_i^{(s)}},
\qquad w_i^{(s)} \propto 1 / p(x_i \mid \theta^{(s)}) \text{ (Pareto smoothed)},$$

with $p(x_i \mid \theta) = \sum_j p(\phi_i = j \mid \theta)\, p(x_i \mid \phi_i = j, \theta)$
the per-child likelihood with the edges summed out (the `log_likelihood` group of
[`to_inference_data`][structinfer.diagnostics.to_inference_data]); Vehtari, Gelman &
Gabry (2017). Observations whose Pareto $\hat k$ is too large are named in a
[`ParetoKWarning`][structinfer.diagnostics.ParetoKWarning]. Nothing here fits a model:
fit with `structinfer.infer.nuts` / `svi`, build the InferenceData, then compare.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .._checks import as_arrays
from .._psis import MIN_DRAWS
from ..exact import ScoreFactors, likelihood_structure
from ._common import latent_sites

if TYPE_CHECKING:
    import pandas as pd
    import xarray as xr
    from arviz_stats.utils import ELPDData

__all__ = ["ParetoKWarning", "loo", "compare", "check_comparable"]


class ParetoKWarning(UserWarning):
    r"""PSIS-LOO is unreliable for some observations (Pareto $\hat k$ above the threshold)."""


def _format_index(k_da: Any, idx: tuple[int, ...]) -> str:
    if len(idx) == 1:
        return f"{k_da.dims[0]} {idx[0]}"
    return "(" + ", ".join(f"{d}={i}" for d, i in zip(k_da.dims, idx)) + ")"


def _warn_pareto(res: Any, name: str, threshold: float | None) -> None:
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


def loo(
    idata: xr.DataTree,
    *,
    name: str = "model",
    var_name: str | None = None,
    pareto_k_threshold: float | None = None,
) -> ELPDData:
    r"""PSIS-LOO of a structural model's InferenceData, with Pareto-$\hat k$ warnings.

    `arviz_stats.loo` on the collapsed per-child log-likelihood. An observation whose
    log-likelihood is the same at every draw (it depends on no sampled parameter) gets
    uniform importance weights and $\hat k = 0$: its leave-one-out density is exactly
    its likelihood, where ArviZ's tail fit would fail. One whose values tie where Pareto
    smoothing fits its tail (ArviZ then gives NaN weights or raises) gets truncated
    importance sampling (Ionides 2008) and $\hat k$ NaN, with a `ParetoKWarning` naming
    it: never a NaN elpd. For an SVI fit the draws are the
    guide's, used as posterior draws without an importance correction for $q \ne p$:
    an approximation as good as the guide; a point estimate (every draw the same) is
    refused.

    Args:
        idata: a DataTree with `posterior` and `log_likelihood` groups.
        name: the model's name in warnings.
        var_name: the log-likelihood variable (default: the only one).
        pareto_k_threshold: warn above this $\hat k$ (default ArviZ's sample-size
            dependent `good_k`, at most 0.7).

    Returns:
        ArviZ's `ELPDData` (pointwise).

    Raises:
        ValueError: the InferenceData has no `log_likelihood` group, its posterior
            is a single point, it has fewer than 25 draws (chains x draws), or its
            log-likelihood is not finite (-inf or NaN) at some draw.
    """
    import arviz_stats as azs

    if "log_likelihood" not in getattr(idata, "children", {}):
        raise ValueError(
            f"model '{name}': the InferenceData has no log_likelihood group; build it with "
            "structinfer.diagnostics.to_inference_data"
        )
    if "posterior" in idata.children:
        post = idata["posterior"].to_dataset()
        if post.data_vars and all(
            float(post[v].max()) == float(post[v].min()) for v in post.data_vars
        ):
            raise ValueError(
                f"model '{name}': every posterior draw is the same point (a point estimate, "
                "e.g. an SVI fit with guide='delta'): leave-one-out needs draws from a "
                "posterior; fit with structinfer.infer.nuts or an SVI guide with spread"
            )
    ll_sizes = idata["log_likelihood"].sizes
    n_samples = int(ll_sizes.get("chain", 1)) * int(ll_sizes.get("draw", 1))
    if n_samples < MIN_DRAWS:
        raise ValueError(
            f"model '{name}': PSIS-LOO needs at least {MIN_DRAWS} posterior draws (chains x "
            f"draws; it fits a Pareto tail to the largest fifth of them and needs 5), got "
            f"{n_samples}; draw more"
        )
    _check_finite(idata, var_name, name)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Estimated shape parameter of Pareto")
        warnings.filterwarnings("ignore", category=RuntimeWarning)
        terms, truncated = _psis_terms(idata, var_name)
        res = azs.loo(idata, pointwise=True, var_name=var_name, **terms)
    if truncated:
        shown = ", ".join(truncated[:8]) + (f" and {len(truncated) - 8} more"
                                            if len(truncated) > 8 else "")
        warnings.warn(
            f"model '{name}': Pareto smoothing failed for {len(truncated)} observations "
            f"({shown}: ties in their log-likelihood over the draws); their leave-one-out "
            "densities use truncated importance sampling (Ionides 2008) instead, with "
            "Pareto k not estimated (NaN). Use more draws before trusting the comparison.",
            ParetoKWarning,
            stacklevel=2,
        )
    _warn_pareto(res, name, pareto_k_threshold)
    return res


def _check_finite(idata: Any, var_name: str | None, name: str) -> None:
    r"""Refuse a log-likelihood that is not finite at some draw: an observation with
    $p(x_i \mid \theta^{(s)}) = 0$ (or NaN) has an infinite importance weight
    $1 / p(x_i \mid \theta^{(s)})$, and no leave-one-out estimate."""
    ll_group = idata["log_likelihood"].to_dataset()
    names = [var_name] if var_name is not None else list(ll_group.data_vars)
    for var in names:
        if var not in ll_group:
            continue  # ArviZ names a missing variable
        ll = ll_group[var]
        sample_dims = [d for d in ("chain", "draw") if d in ll.dims]
        obs_dims = [d for d in ll.dims if d not in sample_dims]
        bad = ~np.isfinite(ll).all(sample_dims)
        if not bool(bad.any()):
            continue
        where = np.argwhere(np.atleast_1d(np.asarray(bad)))
        at = ""
        if obs_dims:
            shown = ", ".join(_format_index(bad, tuple(int(i) for i in b)) for b in where[:8])
            more = f" and {len(where) - 8} more" if len(where) > 8 else ""
            at = f" for {shown}{more}"
        raise ValueError(
            f"model '{name}': the log-likelihood '{var}' is not finite (-inf: zero density, "
            f"or NaN) at some draws{at}; PSIS-LOO cannot estimate a leave-one-out density "
            "there (the importance weight 1/p is infinite, or undefined). Check the data "
            "(NaN, values outside the observation's support) or the model"
        )


def _psis_terms(idata: Any, var_name: str | None) -> tuple[dict, list[str]]:
    r"""PSIS weights for `arviz_stats.loo` where ArviZ's own would fail, and the
    observations given truncated importance sampling.

    An observation whose log-likelihood is the same at every draw does not depend on the
    sampled parameters (e.g. a first child with a single possible parent and fixed
    weights): its leave-one-out predictive density is exactly its likelihood, the
    importance weights are uniform and Pareto $\hat k$ is not defined (ArviZ's tail fit
    raises); it gets uniform weights and $\hat k = 0$. An observation whose values tie
    at the tail Pareto smoothing fits (NaN weights, or an error when the whole tail ties)
    gets truncated importance sampling instead (Ionides 2008): raw weights
    $w_s \propto 1 / p(y_i \mid \theta_s)$ capped at $\sqrt{S}\,\bar w$, and
    $\hat k$ NaN. The rest keep ArviZ's PSIS weights.

    Returns:
        ``(keyword arguments for arviz_stats.loo, names of the truncated observations)``;
        ``({}, [])`` for a log-likelihood without both sample dims (ArviZ then weighs).
    """
    import xarray as xr
    from scipy.special import logsumexp

    ll_group = idata["log_likelihood"].to_dataset()
    names = list(ll_group.data_vars)
    var = var_name if var_name is not None else (names[0] if len(names) == 1 else None)
    if var is None or var not in ll_group:
        return {}, []
    ll = ll_group[var]
    sample_dims = [d for d in ("chain", "draw") if d in ll.dims]
    if len(sample_dims) != 2 or ll.ndim == 2:
        return {}, []
    obs_dims = [d for d in ll.dims if d not in sample_dims]
    spread = ll.max(sample_dims) - ll.min(sample_dims)
    const = spread <= 1e-9 * (1.0 + np.abs(ll).max(sample_dims))
    n_chains, n_draws = ll.sizes["chain"], ll.sizes["draw"]
    n_samples = n_chains * n_draws
    reff = _relative_efficiency(idata, n_samples)
    ramp = xr.DataArray(
        np.arange(n_samples, dtype=float).reshape(n_chains, n_draws) / n_samples,
        dims=("chain", "draw"),
    )
    placeholder = xr.where(const, ramp, ll)  # any non-constant values: overwritten below
    try:
        log_weights, pareto_k = placeholder.azstats.psislw(r_eff=reff, dim=sample_dims)
    except ValueError:  # some observation's whole tail ties: smooth each one alone
        log_weights, pareto_k = _psislw_each(placeholder, reff, sample_dims, obs_dims)
    failed = ~(np.isfinite(log_weights).all(sample_dims) | const)
    terms = {"reff": reff, "log_weights": log_weights, "pareto_k": pareto_k}
    if not bool(const.any()) and not bool(failed.any()):
        return terms, []  # ArviZ's own weights (computed once, here)
    raw = -ll.transpose(*sample_dims, *obs_dims).values.reshape(n_samples, -1)
    raw = raw - logsumexp(raw, axis=0)
    raw = np.minimum(raw, 0.5 * np.log(n_samples) - np.log(n_samples))  # sqrt(S) mean(w)
    raw = raw - logsumexp(raw, axis=0)
    tis = xr.DataArray(raw.reshape((n_chains, n_draws) + tuple(ll.sizes[d] for d in obs_dims)),
                       dims=(*sample_dims, *obs_dims), coords=ll.coords)
    log_weights = xr.where(failed, tis, log_weights)
    log_weights = xr.where(const, -np.log(n_samples), log_weights)
    pareto_k = xr.where(const, 0.0, xr.where(failed, np.nan, pareto_k))
    truncated = [_format_index(failed, tuple(int(i) for i in b))
                 for b in np.argwhere(np.asarray(failed))]
    return {"reff": reff, "log_weights": log_weights, "pareto_k": pareto_k}, truncated


def _psislw_each(ll: Any, reff: float, sample_dims: list[str], obs_dims: list[str]):
    """`psislw` observation by observation: NaN weights where ArviZ raises."""
    import xarray as xr

    obs = "_".join(["stacked", *ll.dims])  # a name no dim of `ll` has (e.g. "obs")
    stacked = ll.stack({obs: obs_dims})
    weights, ks = [], []
    for i in range(stacked.sizes[obs]):
        one = stacked.isel({obs: [i]})
        try:
            w, k = one.azstats.psislw(r_eff=reff, dim=sample_dims)
        except ValueError:
            w, k = xr.full_like(one, np.nan), xr.full_like(one.isel({d: 0 for d in sample_dims}),
                                                          np.nan)
        weights.append(w.transpose(*sample_dims, obs))
        ks.append(k)
    log_weights = xr.concat(weights, obs).unstack(obs)
    pareto_k = xr.concat(ks, obs).unstack(obs)
    return log_weights, pareto_k


def _relative_efficiency(idata: Any, n_samples: int) -> float:
    r"""PSIS's relative efficiency $r_\mathrm{eff} = \overline{\mathrm{ESS}} / S$: the mean
    over every element of every posterior variable of its (mean) effective sample size,
    over the number of draws $S$; 1 for a single chain. This is the `reff` ArviZ's
    `loo` uses by default (Vehtari, Gelman & Gabry 2017, sec. 3.1)."""
    posterior = idata["posterior"]
    if posterior.sizes["chain"] == 1:
        return 1.0
    ess = posterior.to_dataset().azstats.ess(method="mean")
    return float(np.hstack([np.ravel(ess[v].values) for v in ess.data_vars]).mean() / n_samples)


def check_comparable(
    model: Callable, *model_args: Any, score_factors: ScoreFactors = "error", **model_kwargs: Any
) -> None:
    """Refuse, before any fitting, a model whose InferenceData could not be compared.

    Shape-only: the model is inspected once and its pointwise log-likelihood structure
    read with placeholders for the parameters (`structinfer.exact.likelihood_structure`).

    Args:
        model: the model.
        *model_args: its positional arguments (the data).
        score_factors: `"error"` or `"normalize"`, as for
            `structinfer.exact.pointwise_log_likelihood`.
        **model_kwargs: its keyword arguments.

    Raises:
        EnergyOnlyModelError: the model defines an energy, not a density of its data.
        ValueError: a `numpyro.param` site or a discrete latent site that is not
            enumerated.
    """
    args, kwargs = as_arrays(model_args, model_kwargs)
    latent_sites(model, args, kwargs, "check_comparable")
    likelihood_structure(model, None, *args, score_factors=score_factors, **kwargs)


def compare(
    idatas: Mapping[str, xr.DataTree],
    *,
    method: str = "stacking",
    pareto_k_threshold: float | None = None,
) -> pd.DataFrame:
    r"""Compare fitted models (typically one model under several structural priors) by PSIS-LOO.

    The expected log pointwise predictive density uses the per-child likelihood with
    the edges collapsed, so the comparison asks which prior over structures predicts
    each held-out child best. Each model's [`loo`][structinfer.diagnostics.loo] warns
    with a [`ParetoKWarning`][structinfer.diagnostics.ParetoKWarning] naming its badly
    approximated children.

    Args:
        idatas: `{name: DataTree}` from
            [`to_inference_data`][structinfer.diagnostics.to_inference_data], at least two.
        method: ArviZ's weighting method (`"stacking"`, `"BB-pseudo-BMA"`, `"pseudo-BMA"`).
        pareto_k_threshold: the threshold of the warnings (default ArviZ's `good_k`).

    Returns:
        ArviZ's comparison table (a `pandas.DataFrame` ranked best first: `elpd`, `p`,
        `elpd_diff`, `weight`, `se`, `dse`, `warning`).

    Raises:
        ValueError: fewer than two models, models of different numbers or shapes of
            observations, or `loo`'s error for one model, naming it.
    """
    import arviz_stats as azs

    if not isinstance(idatas, Mapping) or len(idatas) < 2:
        raise ValueError("compare: pass a mapping {name: InferenceData} of at least two models")
    elpds = {name: loo(dt, name=name, pareto_k_threshold=pareto_k_threshold)
             for name, dt in idatas.items()}
    sizes = {n: int(e.n_data_points) for n, e in elpds.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"compare: the models have different numbers of observations {sizes}; compare "
            "models of the same data"
        )
    shapes = {n: tuple(np.shape(e.elpd_i)) for n, e in elpds.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(
            f"compare: the models have different observation shapes {shapes}; compare "
            "models of the same data, with the same plates around the observed site"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Estimated shape parameter of Pareto")
        return azs.compare(elpds, method=method)
