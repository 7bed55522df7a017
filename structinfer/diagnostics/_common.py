"""What the diagnostics modules share: reading a fit, checking edge arrays (not user API)."""

from __future__ import annotations

import copy
import inspect
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import model_name
from ..exact import ModelInfo, inspect_model
from ..priors import StructuralPrior

__all__ = [
    "FitParts",
    "read_fit",
    "latent_sites",
    "posterior_draws",
    "svi_taking_model_args",
    "check_marginals",
    "check_true_edges",
    "offset_of",
    "var_name_list",
]


class FitParts(NamedTuple):
    """A fit taken apart.

    Attributes:
        model: the NumPyro model that was fitted.
        kind: `"nuts"` for an MCMC run, `"svi"` for an `(SVI, SVIRunResult)` pair.
        fit: the fit as given.
    """

    model: Callable
    kind: str
    fit: Any


def read_fit(fit: Any, what: str) -> FitParts:
    """The model and kind of a NumPyro `MCMC` (run) or an `(SVI, SVIRunResult)` pair."""
    from numpyro.infer import MCMC, SVI
    from numpyro.infer.svi import SVIRunResult

    if isinstance(fit, MCMC):
        model = getattr(fit.sampler, "model", None)
        if model is None:
            raise ValueError(
                f"{what}: the MCMC kernel has no model (it was built from a potential_fn); "
                "fit the model with structinfer.infer.nuts or NUTS(model)"
            )
        try:
            fit.get_samples()
        except Exception as e:  # noqa: BLE001 - NumPyro raises a bare error before run()
            raise ValueError(f"{what}: the MCMC has no draws; call mcmc.run first") from e
        return FitParts(model, "nuts", fit)
    if (isinstance(fit, tuple) and len(fit) == 2 and isinstance(fit[0], SVI)
            and isinstance(fit[1], SVIRunResult)):
        return FitParts(fit[0].model, "svi", fit)
    raise TypeError(
        f"{what}: expected a numpyro.infer.MCMC (e.g. from structinfer.infer.nuts) or an "
        f"(SVI, SVIRunResult) pair (from structinfer.infer.svi), got {type(fit).__name__}"
    )


def latent_sites(model: Callable, args: tuple, kwargs: dict, what: str) -> ModelInfo:
    """The model's inspection; refuses what a posterior over its latent sites cannot hold
    (`numpyro.param` sites, discrete latent sites that are not enumerated)."""
    info = inspect_model(model, *args, **kwargs)
    for name, site in info.items():
        if site.role == "param":
            raise ValueError(
                f"{what}: model '{model_name(model)}' has a numpyro.param site '{name}'; the "
                "diagnostics read posterior draws of sample sites only: give it a prior with "
                "numpyro.sample"
            )
        if site.role == "latent" and site.support.is_discrete:
            raise ValueError(
                f"{what}: model '{model_name(model)}': discrete latent site '{name}' is not "
                "enumerated; declare edges with structinfer.edge or mark the site with "
                "infer={'enumerate': 'parallel'}"
            )
    return info


def posterior_draws(parts: FitParts, args: tuple, kwargs: dict, num_draws: int,
                    names: list[str]) -> dict[str, np.ndarray]:
    """`{site: (chain, draw, ...)}` of the sites `names`: the MCMC's draws, or
    `num_draws` draws of the SVI guide with ArviZ's `from_numpyro_svi` key (`PRNGKey(0)`),
    so they are the draws of the InferenceData."""
    if parts.kind == "nuts":
        draws = parts.fit.get_samples(group_by_chain=True)
    else:
        from numpyro.infer import Predictive
        from numpyro.infer.autoguide import AutoGuide

        fitter, result = svi_taking_model_args(parts.fit[0]), parts.fit[1]
        key = jax.random.PRNGKey(0)
        if isinstance(fitter.guide, AutoGuide):
            flat = fitter.guide.sample_posterior(key, result.params, *args,
                                                 sample_shape=(num_draws,), **kwargs)
        else:
            flat = Predictive(fitter.guide, params=result.params, num_samples=num_draws)(
                key, *args, **kwargs)
        draws = {n: v[None] for n, v in flat.items()}
    missing = [n for n in names if n not in draws]
    if missing:
        raise ValueError(f"the fit has no draws of the latent site(s) {missing}")
    return {n: np.asarray(draws[n]) for n in names}


def svi_taking_model_args(svi: Any) -> Any:
    """``svi``, or a shallow copy of it whose autoguide's ``sample_posterior`` takes the
    model's arguments (and, not needing them, ignores them).

    The autoguides of older NumPyro releases (0.15: ``AutoNormal``, ``AutoDelta``, ...)
    take only ``(rng_key, params, *, sample_shape)``; newer ones, and ArviZ's
    ``from_numpyro_svi``, which calls them, pass the model's arguments too.
    """
    guide = getattr(svi, "guide", None)
    method = getattr(guide, "sample_posterior", None)
    if method is None:
        return svi
    kinds = {p.kind for p in inspect.signature(method).parameters.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return svi

    def sample_posterior(rng_key, params, *args, sample_shape=(), **kwargs):
        del args, kwargs  # this guide's draws do not depend on them
        return method(rng_key, params, sample_shape=sample_shape)

    guide = copy.copy(guide)
    guide.sample_posterior = sample_posterior
    svi = copy.copy(svi)
    svi.guide = guide
    return svi


def check_marginals(marginals: Any, what: str = "marginals") -> jax.Array:
    r"""`marginals` as a JAX array of shape `(..., children, parents)`, rows of probabilities.

    A row must be non-negative and sum to 1, to $\max(10^{-3}, 8\epsilon)$ of its dtype
    (rounding and autodiff error, never a log-probability table or unnormalised
    weights); a row holding NaN passes as it is (a child with no allowed parent under
    `jit`: its statistics are NaN).
    Concrete: another row raises. Traced: such a row becomes NaN, so its statistics are
    NaN, never finite wrong numbers.

    Args:
        marginals: the array.
        what: the argument's name, for the messages.

    Returns:
        The array (traced: NaN in the rows that are not probabilities).

    Raises:
        TypeError: an InferenceData, DataTree or Dataset (a group, not one site's array).
        ValueError: fewer than 2 dims, or (concrete) a row with a negative entry or not
            summing to 1, naming `what`, the row and its sum.
    """
    if hasattr(marginals, "data_vars"):  # an xarray Dataset or DataTree, not a DataArray
        raise TypeError(
            f"{what} must be an array (..., children, parents), got a "
            f"{type(marginals).__name__}; take one edge site's marginals, e.g. "
            "idata['edge_posterior']['<site>'], or use edge_summary(idata)"
        )
    a = jnp.asarray(marginals)
    if a.ndim < 2:
        raise ValueError(f"{what} must have shape (..., children, parents), got {tuple(a.shape)}")
    eps = float(jnp.finfo(a.dtype).eps) if jnp.issubdtype(a.dtype, jnp.floating) else 0.0
    tol = max(1e-3, 8 * eps)

    def bad_rows(xp, v, acc):
        v = v.astype(acc)
        total = xp.sum(v, -1)
        bad = xp.any(v < -tol, -1) | ~(xp.abs(total - 1) <= tol)
        return bad & ~xp.any(xp.isnan(v), -1), total

    if isinstance(a, jax.core.Tracer):
        bad, _ = bad_rows(jnp, a, jnp.promote_types(a.dtype, jnp.float32))
        return jnp.where(bad[..., None], jnp.nan, a)
    bad, total = bad_rows(np, np.asarray(a), np.float64)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        row = np.asarray(a, np.float64)[idx]
        where = f"child {idx[-1]}" + (f" (batch index {idx[:-1]})" if idx[:-1] else "")
        raise ValueError(
            f"{what}: the row of {where} sums to {total[idx]:.6g} (min entry "
            f"{row.min():.6g}); expected probabilities, each row non-negative and summing "
            f"to 1 (to {tol:g}): pass jnp.exp of log-marginals, normalise weights first"
        )
    return a


def check_true_edges(true_edges: Any, marginals: Any, site: str = "edges") -> Any:
    """Known parent indices: integers, one per child of `marginals`, inside `[0, parents)`.

    The dtype and shape are checked always (they are static); the range only on concrete
    values: traced indices are returned as they are, and the caller makes what it reads
    from an index outside the parents NaN.

    Returns:
        The indices, a NumPy array (concrete) or the tracer.
    """
    traced = isinstance(true_edges, jax.core.Tracer)
    t = true_edges if traced else np.asarray(true_edges)
    shape = tuple(np.shape(marginals)[:-1])
    m = np.shape(marginals)[-1]
    if not np.issubdtype(t.dtype, np.integer):
        raise TypeError(f"true structure for '{site}' must be integer parent indices, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(
            f"true structure for '{site}' has shape {tuple(t.shape)}; expected one parent index "
            f"per child, shape {shape}"
        )
    if not traced and t.size and (t.min() < 0 or t.max() >= m):
        raise ValueError(
            f"true structure for '{site}' has parent indices outside [0, {m}): "
            f"min {t.min()}, max {t.max()}"
        )
    return t


def offset_of(offset: Any) -> int:
    """The positional offset: an int, or the `offset` of a structural prior.

    Every prior of `structinfer.priors` carries its `offset` (0 unless it was built with
    one), so passing the prior itself is the way to get the convention it was built with.

    Raises:
        TypeError: for anything else (a float, a bool, None).
    """
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


def var_name_list(var_names: Any) -> list[str]:
    """Variable names as a list: one name given as a string is that variable (as in
    ArviZ), not its characters."""
    return [var_names] if isinstance(var_names, str) else list(var_names)
