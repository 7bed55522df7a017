r"""Plots of edge posteriors, prior comparisons, hyper-parameters and convergence traces.

The attention matrix $A_{ij} = p(\phi_i = j \mid x)$ as a heatmap, the edge mass by
distance $d = i + \text{offset} - j$ (prior against posterior), ArviZ's comparison and
trace plots (`arviz_plots`), a hyper-parameter's posterior against its prior density,
and the objective traces of the iterative algorithms. matplotlib and `arviz_plots` are
imported when a function needs them; each function takes an `ax` or returns ArviZ's
`PlotCollection`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.handlers import block, seed, substitute, trace

from .._checks import NotFoundError, as_arrays
from ..priors import StructuralPrior
from ._common import (
    check_marginals,
    check_true_edges,
    latent_sites,
    offset_of,
    posterior_draws,
    read_fit,
    var_name_list,
)
from .convergence import as_trace, convergence_report
from .edges import distance_posterior

if TYPE_CHECKING:
    import pandas as pd
    import xarray as xr
    from arviz_plots import PlotCollection
    from matplotlib.axes import Axes

__all__ = [
    "plot_attention",
    "plot_distance",
    "plot_compare",
    "plot_trace",
    "plot_prior_posterior",
    "prior_log_density",
    "plot_hyperparameter",
    "plot_convergence",
]


def _axes(ax: Axes | None) -> Axes:
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4))
    return ax


def plot_attention(
    marginals: Any, *, true_edges: Any = None, ax: Axes | None = None, title: str | None = None
) -> Axes:
    r"""Heatmap of the edge posterior (the attention matrix) $A_{ij} = p(\phi_i=j\mid x)$.

    Children down, parents across; the true parents, when given, are circled.

    Args:
        marginals: one `(children, parents)` matrix.
        true_edges: the true parent of each child.
        ax: the axes to draw on (default a new figure).
        title: the axes' title.

    Returns:
        The axes.

    Raises:
        ValueError: `marginals` is not one matrix, or a bad `true_edges`.
    """
    a = np.asarray(check_marginals(marginals))
    if a.ndim != 2:
        raise ValueError(f"plot_attention: pass one (children, parents) matrix, got {a.shape}")
    ax = _axes(ax)
    im = ax.imshow(a, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.figure.colorbar(im, ax=ax, label=r"$p(\phi_i = j \mid x)$")
    if true_edges is not None:
        t = check_true_edges(true_edges, a)
        ax.scatter(t, np.arange(a.shape[0]), s=12, facecolors="none", edgecolors="red",
                   label="true parent")
        ax.legend(loc="upper right", fontsize="small")
    ax.set_xlabel("parent j")
    ax.set_ylabel("child i")
    if title:
        ax.set_title(title)
    return ax


def plot_distance(
    marginals: Any,
    prior: Any = None,
    *,
    offset: int | StructuralPrior = 0,
    true_edges: Any = None,
    ax: Axes | None = None,
    label: str = "posterior",
    max_distance: int | None = None,
    title: str | None = None,
) -> Axes:
    r"""Prior against posterior edge mass by distance $d = i + \text{offset} - j$.

    The masses are [`distance_posterior`][structinfer.diagnostics.distance_posterior],
    over every child of every batch element (head, sequence) of batched marginals;
    the histogram of the true distances is drawn as bars when known.

    Args:
        marginals: `(..., children, parents)` posterior marginals.
        prior: the prior table of the same shape (e.g. `edge_posterior["<site>_prior"]`).
        offset: an int, or the edge site's structural prior.
        true_edges: the true parent of each child.
        ax: the axes to draw on (default a new figure).
        label: the legend label of the posterior.
        max_distance: the largest distance shown.
        title: the axes' title.

    Returns:
        The axes.

    Raises:
        ValueError: `marginals` or `prior` are not rows of probabilities, or `prior`
            has other `(children, parents)` than `marginals`.
    """
    offset = offset_of(offset)
    a = check_marginals(marginals)
    ax = _axes(ax)
    ds, post = distance_posterior(a, offset)
    # batch dims (heads, sequences): the mass over every child of every element
    post = np.asarray(post).reshape(-1, ds.size).mean(0)
    keep = ds >= 0 if post[ds < 0].sum() < 1e-9 else np.ones_like(ds, bool)
    if max_distance is not None:
        keep &= ds <= max_distance
    ax.plot(ds[keep], np.asarray(post)[keep], "o-", label=label)
    if prior is not None:
        pr = check_marginals(prior, "prior")
        if pr.shape[-2:] != a.shape[-2:]:
            raise ValueError(
                f"plot_distance: prior has (children, parents) {tuple(pr.shape[-2:])}; "
                f"expected those of the marginals, {tuple(a.shape[-2:])}"
            )
        _, pp = distance_posterior(pr, offset)
        pp = np.asarray(pp).reshape(-1, ds.size).mean(0)
        ax.plot(ds[keep], pp[keep], "s--", alpha=0.7, label="prior")
    if true_edges is not None:
        t = check_true_edges(true_edges, a)
        d_true = np.arange(a.shape[-2]) + offset - t
        hist = np.array([(d_true == d).mean() for d in ds])
        ax.bar(ds[keep], hist[keep], alpha=0.25, color="gray", label="true")
    ax.set_xlabel("distance to parent d")
    ax.set_ylabel("edge mass")
    ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    return ax


def plot_compare(comparison: pd.DataFrame, path: str | None = None) -> PlotCollection:
    """ArviZ's comparison plot (ELPD with standard errors) of a comparison table.

    Args:
        comparison: the table of [`compare`][structinfer.diagnostics.compare].
        path: save the figure there.

    Returns:
        The `arviz_plots.PlotCollection`.
    """
    import arviz_plots as azp

    pc = azp.plot_compare(comparison, backend="matplotlib")
    if path is not None:
        pc.savefig(path)
    return pc


def plot_trace(
    idata: xr.DataTree, var_names: Sequence[str] | None = None, path: str | None = None
) -> PlotCollection:
    """Traces and marginal densities of posterior draws (`arviz_plots.plot_trace_dist`).

    Args:
        idata: a DataTree with a `posterior` group.
        var_names: the variables (one name, or a list; default all).
        path: save the figure there.

    Returns:
        The `arviz_plots.PlotCollection`.
    """
    import arviz_plots as azp

    pc = azp.plot_trace_dist(idata, var_names=None if var_names is None
                             else var_name_list(var_names),
                             backend="matplotlib")
    if path is not None:
        pc.savefig(path)
    return pc


def plot_prior_posterior(
    idata: xr.DataTree, var_names: Sequence[str], path: str | None = None
) -> PlotCollection:
    """Prior against posterior of hyper-parameters (`arviz_plots.plot_prior_posterior`).

    Needs the `prior` group that
    [`to_inference_data`][structinfer.diagnostics.to_inference_data] writes with
    `num_prior_draws > 0`.

    Args:
        idata: a DataTree with `prior` and `posterior` groups.
        var_names: the variables (one name, or a list).
        path: save the figure there.

    Returns:
        The `arviz_plots.PlotCollection`.

    Raises:
        ValueError: no `prior` group.
    """
    import arviz_plots as azp

    if "prior" not in getattr(idata, "children", {}):
        raise ValueError("plot_prior_posterior: the InferenceData has no prior group")
    pc = azp.plot_prior_posterior(idata, var_names=var_name_list(var_names),
                                  backend="matplotlib")
    if path is not None:
        pc.savefig(path)
    return pc


def _draws_of(fit: Any, site: str, args: tuple, kwargs: dict, what: str) -> tuple:
    parts = read_fit(fit, what)
    info = latent_sites(parts.model, args, kwargs, what)
    if site not in info.latent:
        raise NotFoundError(f"{what}: no latent site '{site}'; latent sites: {sorted(info.latent)}")
    if info[site].shape:
        raise ValueError(f"{what}: site '{site}' is not scalar (shape {info[site].shape})")
    return parts.model, posterior_draws(parts, args, kwargs, 1000, list(info.latent))


def prior_log_density(fit: Any, site: str, grid: Any, *model_args: Any,
                      **model_kwargs: Any) -> np.ndarray:
    r"""Log prior density $\log p(\theta_k)$ of a scalar latent site on a grid.

    Read from the model: the site's distribution given the first posterior draw of the
    sites it depends on (e.g. the geometric $q$ under a Beta hyperprior).

    Args:
        fit: a finished `numpyro.infer.MCMC` or an `(SVI, SVIRunResult)` pair.
        site: the scalar latent site.
        grid: the values at which to evaluate the density.
        *model_args: the model's positional arguments, as given to the fit.
        **model_kwargs: the model's keyword arguments, as given to the fit.

    Returns:
        The log density at each grid value.

    Raises:
        KeyError: no latent site `site`.
        ValueError: the site is not scalar.
    """
    args, kwargs = as_arrays(model_args, model_kwargs)
    model, draws = _draws_of(fit, site, args, kwargs, "prior_log_density")
    first = {n: v[0, 0] for n, v in draws.items()}

    def f(g):
        with block():
            tr = trace(seed(substitute(model, data=first), 0)).get_trace(*args, **kwargs)
        return tr[site]["fn"].log_prob(g)

    return np.asarray(jax.jit(f)(jnp.asarray(grid)))


def plot_hyperparameter(
    fit: Any,
    site: str,
    *model_args: Any,
    ax: Axes | None = None,
    true_value: float | None = None,
    bins: int = 30,
    **model_kwargs: Any,
) -> Axes:
    r"""Posterior histogram of a scalar hyper-parameter against its prior density.

    E.g. $q$ of a geometric prior with a Beta hyperprior (Singh & Buckley sec. 5.2); the
    density is [`prior_log_density`][structinfer.diagnostics.prior_log_density].

    Args:
        fit: a finished `numpyro.infer.MCMC` or an `(SVI, SVIRunResult)` pair.
        site: the scalar latent site.
        *model_args: the model's positional arguments, as given to the fit.
        ax: the axes to draw on (default a new figure).
        true_value: marked with a vertical line when given.
        bins: histogram bins.
        **model_kwargs: the model's keyword arguments, as given to the fit.

    Returns:
        The axes.
    """
    args, kwargs = as_arrays(model_args, model_kwargs)
    _, draws = _draws_of(fit, site, args, kwargs, "plot_hyperparameter")
    ax = _axes(ax)
    values = np.asarray(draws[site]).ravel()
    lo, hi = float(values.min()), float(values.max())
    pad = 0.25 * (hi - lo + 1e-6)
    grid = np.linspace(lo - pad, hi + pad, 200)
    dens = np.exp(prior_log_density(fit, site, grid, *args, **kwargs))
    ax.hist(values, bins=bins, density=True, alpha=0.5, label="posterior")
    ax.plot(grid, np.where(np.isfinite(dens), dens, 0.0), "k--", label="prior")
    if true_value is not None:
        ax.axvline(true_value, color="red", lw=1, label="true")
    ax.set_xlabel(site)
    ax.set_ylabel("density")
    ax.legend(fontsize="small")
    return ax


def plot_convergence(
    traces: Any, *, ax: Axes | None = None, ylabel: str = "free energy", log_gap: bool = False
) -> Axes:
    r"""Objective traces of iterative algorithms (mean-field, EM, CCCP, SVI) by iteration.

    Non-monotone traces (see
    [`convergence_report`][structinfer.diagnostics.convergence_report]) are marked in the
    legend.

    Args:
        traces: a 1-d array or an `info` NamedTuple, or `{label: trace}` for several.
        ax: the axes to draw on (default a new figure).
        ylabel: the y-axis label.
        log_gap: plot $F_t - \min F + \epsilon$ on a log axis (shows the rate).

    Returns:
        The axes.
    """
    ax = _axes(ax)
    items = traces.items() if isinstance(traces, Mapping) else [("trace", traces)]
    for label, tr in items:
        t = as_trace(tr)
        rep = convergence_report(tr)  # an info: its steps taken, a non-finite stop too
        y = t - np.nanmin(t) + 1e-12 if log_gap else t
        ax.plot(np.arange(t.size), y, label=label + ("" if rep.monotone else " (non-monotone)"))
    if log_gap:
        ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel + (" - min" if log_gap else ""))
    ax.legend(fontsize="small")
    return ax
