r"""ArviZ's InferenceData of a fitted structural model, with the edges collapsed.

For a model whose child $i$ takes one parent $\phi_i$ under a structural prior and whose
observation $x_i$ depends on that parent,

$$\log p(x_i \mid \theta) = \log \sum_j p(\phi_i = j \mid \theta)\,
    p(x_i \mid \phi_i = j, \theta),$$

one term per element of the plates around the observed site
(`structinfer.exact.pointwise_log_likelihood`). NumPyro's `log_likelihood` (and with it
ArviZ's `from_numpyro`) neither marginalises nor seeds enumerated sites, so
[`to_inference_data`][structinfer.diagnostics.to_inference_data] takes ArviZ's groups
from `arviz_base.from_numpyro` / `from_numpyro_svi` and adds the collapsed
`log_likelihood`, a `posterior_predictive` with the edges drawn from their posterior,
the model's `constant_data` and an `edge_posterior` group, the posterior edge marginals
$p(\phi_i = j \mid x) = \mathbb E_{\theta \mid x}[p(\phi_i = j \mid x, \theta)]$.

xarray refuses a variable or dimension name holding `/`, the divider of NumPyro's
`scope` (`scope(model, "l1")` names a site `l1/x`): every site and plate is stored under
[`xarray_name`][structinfer.diagnostics.xarray_name] of its name (`l1::x`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from numpyro.handlers import block, seed, substitute, trace
from numpyro.primitives import CondIndepStackFrame, Messenger

try:
    from numpyro.handlers import uncondition
except ImportError:  # NumPyro < 0.20 (the releases for JAX < 0.7) has no uncondition

    class uncondition(Messenger):  # noqa: N801
        """Forget the observations: an observed site is drawn from its distribution.

        Innermost under ``Predictive``'s ``seed``, which then sees an unobserved site
        and gives it a key.
        """

        def process_message(self, msg):
            if msg["type"] == "sample" and msg["is_observed"]:
                msg["is_observed"], msg["value"] = False, None

from .. import exact
from .._checks import as_arrays, check_count, check_key, model_name
from ..exact import LikelihoodStructure, ScoreFactors
from ._common import (
    check_true_edges,
    latent_sites,
    offset_of,
    read_fit,
    svi_taking_model_args,
)

if TYPE_CHECKING:
    import xarray as xr

__all__ = ["to_inference_data", "xarray_name"]

#: what `xarray_name` writes for each `/` of a name (PyMC's divider of nested models)
XARRAY_DIVIDER = "::"


def xarray_name(name: str) -> str:
    """The name a site or plate is stored under: `name` with each `/` written `::`.

    [`to_inference_data`][structinfer.diagnostics.to_inference_data] stores every site
    and plate under it. xarray refuses a variable, coordinate or dimension name holding
    `/` (a `DataTree` reads it as a path), and `/` is the divider of NumPyro's `scope`
    (`numpyro.handlers.scope(model, "l1")` names a site `l1/x`). ArviZ's own
    `from_numpyro` fails on such a model. A name without `/` is stored as it is.

    Args:
        name: a site or plate name, as the model's trace holds it (`"l1/x"`).

    Returns:
        The stored name (`"l1::x"`): `dt["posterior"][xarray_name("l1/tau")]`.

    Raises:
        TypeError: `name` is not a string.
    """
    if not isinstance(name, str):
        raise TypeError(f"xarray_name: name must be a str, got {type(name).__name__}")
    return name.replace("/", XARRAY_DIVIDER)


class _xarray_names(Messenger):  # noqa: N801 - a handler, named like NumPyro's
    """Every site and plate of the model under `xarray_name` of its name (outermost, so
    after a `scope` inside the model has named them): what ArviZ's converter traces.

    A `numpyro.param` (or `mutable`) site keeps its name: ArviZ's `Predictive` of a
    guide function substitutes the fitted params by their names around this handler, so
    a renamed param would be drawn at its initial value."""

    def process_message(self, msg):
        if msg.get("name") and msg.get("type") not in ("param", "mutable"):
            msg["name"] = xarray_name(msg["name"])
        if msg.get("cond_indep_stack"):
            msg["cond_indep_stack"] = [CondIndepStackFrame(xarray_name(f.name), f.dim, f.size)
                                       for f in msg["cond_indep_stack"]]


def _renamed(samples: Mapping[str, Any]) -> dict[str, Any]:
    return {xarray_name(n): v for n, v in samples.items()}


class _XarrayNamedMCMC:
    """A finished MCMC as ArviZ's `from_numpyro` reads it, its names `xarray_name`'s:
    the draws renamed, the model traced under `_xarray_names`; the rest is the MCMC's."""

    def __init__(self, mcmc: Any):
        self._mcmc = mcmc
        self.sampler = _Sampler(_xarray_names(mcmc.sampler.model))

    def get_samples(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return _renamed(self._mcmc.get_samples(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:  # num_chains, _args, get_extra_fields, ...
        return getattr(self._mcmc, name)


class _Sampler:
    def __init__(self, model: Callable):
        self.model = model


def _xarray_named_svi(svi: Any) -> Any:
    """A shallow copy of `svi` whose model and guide name their sites `xarray_name`'s
    (an autoguide: its `sample_posterior`'s draws renamed), for `from_numpyro_svi`."""
    import copy

    svi = copy.copy(svi)
    guide = svi.guide
    method = getattr(guide, "sample_posterior", None)
    if method is None:  # a guide function: Predictive traces it
        svi.guide = _xarray_names(guide)
    else:
        guide = copy.copy(guide)
        guide.sample_posterior = lambda *a, **k: _renamed(method(*a, **k))
        if getattr(guide, "model", None) is not None:
            guide.model = _xarray_names(guide.model)
        svi.guide = guide
    svi.model = _xarray_names(svi.model)
    return svi


def _check_xarray_names(info: Any, model: Callable) -> None:
    """Refuse two sites or plates that `xarray_name` stores under one name."""
    names = list(dict.fromkeys([*info, *info.plates]))
    stored: dict[str, str] = {}
    for n in names:
        other = stored.setdefault(xarray_name(n), n)
        if other != n:
            raise ValueError(
                f"to_inference_data: model '{model_name(model)}' has the sites or plates "
                f"'{other}' and '{n}', both stored as '{xarray_name(n)}' (xarray_name writes "
                "'/' as '::'); rename one of them"
            )


def _map_draws(f: Callable, samples: Mapping[str, np.ndarray], batch_size: int | None) -> Any:
    """`f` at every draw of `samples` (`(chain, draw, ...)` leaves), one compilation."""
    lead = next(iter(samples.values())).shape[:2]
    flat = {n: v.reshape((-1,) + v.shape[2:]) for n, v in samples.items()}
    out = jax.jit(lambda s: jax.lax.map(f, s, batch_size=batch_size))(flat)
    return jax.tree.map(lambda a: np.asarray(a).reshape(lead + a.shape[1:]), out)


def _draw_quantities(
    model: Callable,
    samples: Mapping[str, np.ndarray],
    args: tuple,
    kwargs: dict,
    edges: Sequence[str],
    score_factors: ScoreFactors,
    batch_size: int | None,
) -> tuple[np.ndarray, LikelihoodStructure, dict, dict]:
    """Per-draw log-likelihood, edge marginals and prior tables in one jitted pass."""
    first = {n: v[0, 0] for n, v in samples.items()}
    struct = exact.likelihood_structure(model, first, *args, score_factors=score_factors,
                                        **kwargs)

    def f(p):
        at = substitute(model, data=p)
        res = {"ll": exact.pointwise_log_likelihood(model, p, *args, score_factors=score_factors,
                                                    **kwargs)}
        if edges:
            marg = exact.marginals(at, *args, **kwargs)
            res["marg"] = {n: marg[n] for n in edges}
            info = exact.inspect_model(at, *args, **kwargs)
            res["prior"] = {n: jax.numpy.exp(info[n].edge.prior.log_table(info[n].edge.num_children))
                            for n in edges}
        return res

    out = _map_draws(f, samples, batch_size)
    return out["ll"], struct, out.get("marg", {}), out.get("prior", {})


def _posterior_predictive(
    model: Callable, samples: Mapping[str, np.ndarray], args: tuple, kwargs: dict,
    enumerated: list[str], observed: list[str], rng_key: jax.Array,
) -> dict[str, np.ndarray]:
    r"""Replicated observations $x^{rep} \sim p(x \mid \phi, \theta)$ with
    $\phi \sim p(\phi \mid x, \theta)$ (NumPyro's `infer_discrete`) at every draw of
    $\theta$: the posterior predictive of the same children."""
    from numpyro.infer import Predictive

    lead = next(iter(samples.values())).shape[:2]
    flat = {n: v.reshape((-1,) + v.shape[2:]) for n, v in samples.items()}

    def run(key, draws):
        k_edges, k_obs = jax.random.split(key)
        if enumerated:  # the edges from their posterior given x and the draw
            draws = {**draws, **Predictive(model, posterior_samples=draws, infer_discrete=True,
                                           return_sites=enumerated)(k_edges, *args, **kwargs)}
        return Predictive(uncondition(model), posterior_samples=draws,
                          return_sites=observed)(k_obs, *args, **kwargs)

    # under jit: funsor's sampler fails eagerly on forbidden parents (-inf log-weights)
    out = jax.jit(run)(rng_key, flat)
    return {n: np.asarray(v).reshape(lead + v.shape[1:]) for n, v in out.items()}


def _prior_draws(model: Callable, args: tuple, kwargs: dict, names: list[str], num: int,
                 rng_key: jax.Array) -> dict[str, np.ndarray]:
    def one(key):
        with block():
            tr = trace(seed(model, key)).get_trace(*args, **kwargs)
        return {n: tr[n]["value"] for n in names}

    keys = jax.random.split(rng_key, num)
    return {n: np.asarray(v)[None] for n, v in jax.jit(jax.vmap(one))(keys).items()}


def _named_arguments(model: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The model's arguments, named as in its signature (`arg<i>` when unnamed), its
    defaults filled in."""
    try:
        sig = inspect.signature(model)
        bound_args = sig.bind(*args, **kwargs)
        bound_args.apply_defaults()
        bound, params = dict(bound_args.arguments), sig.parameters
    except (TypeError, ValueError):
        bound, params = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}, {}
    named: dict[str, Any] = {}
    for name, value in bound.items():
        kind = params[name].kind if name in params else None
        if kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"{name}{i}": v for i, v in enumerate(value)})
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def _constant_data(model: Callable, args: tuple, kwargs: dict) -> dict[str, np.ndarray]:
    """The model's array arguments, named as in its signature (`arg<i>` when unnamed)."""
    out = {}
    for name, value in _named_arguments(model, args, kwargs).items():
        if isinstance(value, (np.ndarray, jax.Array)) and value.dtype.kind in "biuf":
            out[name] = np.asarray(value)
    return out


def _as_one_chain(dt: xr.DataTree) -> xr.DataTree:
    """ArviZ's SVI groups have a `sample` dim; ArviZ's LOO reads `(chain, draw)`: one chain."""
    import xarray as xr

    groups = {}
    for name, node in dt.children.items():
        ds = node.to_dataset()
        if "sample" in ds.dims:
            ds = ds.rename({"sample": "draw"}).expand_dims(chain=[0])
        groups[name] = ds
    out = xr.DataTree.from_dict(groups)
    out.attrs.update(dt.attrs)
    return out


def _same_argument(a: Any, b: Any) -> bool:
    """Whether two values of one model argument are the same data: equal arrays and
    numbers (NaN equal to NaN) in the same pytree structure; other leaves (functions,
    objects) are not compared, nor a container holding tracers (a list the model
    appends its traced values to, which the run has filled)."""
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    if any(isinstance(x, jax.core.Tracer) for x in leaves_a + leaves_b):
        return True  # a container the model appended its traced values to: not data
    if tree_a != tree_b:
        return False
    data = (np.ndarray, np.generic, jax.Array, int, float, complex)
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, data) or isinstance(y, data):
            if not (isinstance(x, data) and isinstance(y, data)):
                return False
            x, y = np.asarray(x), np.asarray(y)
            if x.shape != y.shape or not np.array_equal(
                    x, y, equal_nan=x.dtype.kind in "fc" and y.dtype.kind in "fc"):
                return False
    return True


def _check_same_data(dt: Any, model: Callable, args: tuple, kwargs: dict, fit: Any) -> None:
    """Refuse data other than the fit's: `observed_data` (ArviZ's, from the fit) and the
    groups computed here must describe one dataset, and the other arguments (the
    covariates) must be those the MCMC ran on (NumPyro's `MCMC` keeps them, as ArviZ's
    `from_numpyro` reads them)."""
    if "observed_data" in dt.children:
        obs = dt["observed_data"].to_dataset()
        tr = trace(seed(model, 0)).get_trace(*args, **kwargs)
        differ = [
            n for n, site in tr.items()
            if site["type"] == "sample" and site.get("is_observed") and xarray_name(n) in obs
            and not np.array_equal(np.asarray(site["value"]), obs[xarray_name(n)].values,
                                   equal_nan=True)
        ]
        if differ:
            raise ValueError(
                f"to_inference_data: the observed site(s) {differ} given here differ from the "
                "data the fit ran on; pass the fit's own data"
            )
    ran_args, ran_kwargs = getattr(fit, "_args", None), getattr(fit, "_kwargs", None)
    if ran_args is None or ran_kwargs is None:  # not recorded (another NumPyro release)
        return
    given = _named_arguments(model, args, kwargs)
    ran = _named_arguments(model, *as_arrays(ran_args, ran_kwargs))
    missing = object()
    differ = [n for n in dict.fromkeys([*ran, *given])
              if not _same_argument(given.get(n, missing), ran.get(n, missing))]
    if differ:
        raise ValueError(
            f"to_inference_data: the model argument(s) {differ} given here differ from "
            "those the MCMC ran on; pass the fit's own arguments (the log-likelihood and "
            "edge posterior would describe another model and data)"
        )


def _observed_elements(model: Callable, args: tuple, kwargs: dict,
                       struct: LikelihoodStructure) -> np.ndarray | None:
    """Which elements of the pointwise log-likelihood hold an observation: those where
    some observed site is not masked out (`numpyro.handlers.mask`, `Distribution.mask`;
    a masked element's term is 0, not an observation). A masked element is one whose
    log-density is 0 where its unmasked distribution's is not (read from the site's
    values: an element whose unmasked log-density is exactly 0 counts as observed).
    ``None`` when all are."""
    tr = trace(seed(model, 0)).get_trace(*args, **kwargs)
    seen = np.zeros(struct.shape, bool)
    for name in struct.observed:
        site = tr[name]
        fn = site["fn"]
        base = _unmasked(fn)
        if base is fn:
            mask = np.ones(tuple(fn.batch_shape), bool)
        else:  # masked out: log-density exactly 0 where the unmasked one is not (or NaN)
            with warnings.catch_warnings():  # missing values (NaN) are out of support
                warnings.simplefilter("ignore")
                lp = np.asarray(fn.log_prob(site["value"]))
                unmasked = np.asarray(base.log_prob(site["value"]))
            mask = ~((lp == 0) & (unmasked != 0))
            mask = np.broadcast_to(mask, tuple(fn.batch_shape))
        frames = {f.name: f.dim for f in site["cond_indep_stack"] if f.dim is not None}
        axes = [mask.ndim + frames[p] for p in struct.plates]
        other = tuple(a for a in range(mask.ndim) if a not in axes)
        mask = np.moveaxis(mask.any(axis=other, keepdims=True), axes, range(len(axes)))
        seen |= mask.reshape(mask.shape[:len(axes)])
    return None if seen.all() else seen


def _unmasked(fn: Any) -> Any:
    """``fn`` without its masks (`Distribution.mask`, the mask handler's), through the
    wrappers that keep a mask inside them (`Independent`, an expanded distribution);
    ``fn`` itself when it has none."""
    from numpyro.distributions import ExpandedDistribution, Independent, MaskedDistribution

    if isinstance(fn, MaskedDistribution):
        return _unmasked(fn.base_dist)
    if isinstance(fn, Independent):
        inner = _unmasked(fn.base_dist)
        return fn if inner is fn.base_dist else Independent(inner,
                                                            fn.reinterpreted_batch_ndims)
    if isinstance(fn, ExpandedDistribution):
        inner = _unmasked(fn.base_dist)
        return fn if inner is fn.base_dist else inner.expand(fn.batch_shape)
    return fn


def _log_likelihood_group(ll: np.ndarray, struct: LikelihoodStructure,
                          seen: np.ndarray | None) -> xr.Dataset:
    """The `log_likelihood` dataset: one term per element of the kept plates, or only
    the observed ones (``seen``): along the one plate (its coordinate the elements'
    positions), or on one ``<name>_observed`` dim with a position coordinate per plate."""
    import arviz_base as azb

    name, plates = xarray_name(struct.name), [xarray_name(p) for p in struct.plates]
    if seen is None:
        return azb.dict_to_dataset({name: ll}, dims={name: plates})
    at = np.nonzero(seen)
    kept = ll[(slice(None), slice(None), *at)]
    if len(plates) == 1:
        (plate,) = plates
        return azb.dict_to_dataset({name: kept}, dims={name: [plate]}, coords={plate: at[0]})
    dim = f"{name}_observed"
    ds = azb.dict_to_dataset({name: kept}, dims={name: [dim]})
    return ds.assign_coords({p: (dim, i) for p, i in zip(plates, at)})


def to_inference_data(
    fit: Any,
    *model_args: Any,
    score_factors: ScoreFactors = "error",
    true_edges: Mapping[str, Any] | None = None,
    posterior_predictive: bool = True,
    num_prior_draws: int = 0,
    num_draws: int = 1000,
    batch_size: int | None = 64,
    rng_key: jax.Array | None = None,
    **model_kwargs: Any,
) -> xr.DataTree:
    r"""ArviZ's InferenceData (an `xarray.DataTree`) of a fitted structural model.

    Groups:

    * `posterior`, `sample_stats` (NUTS: `energy`, `lp`, `diverging`, `acceptance_rate`,
      `n_steps`, `tree_depth`, `step_size`) and `observed_data` — ArviZ's own
      (`arviz_base.from_numpyro`; for SVI `from_numpyro_svi`, its `num_draws` guide
      draws kept as one chain, since ArviZ's LOO reads `(chain, draw)`);
    * `log_likelihood` — the collapsed per-child terms
      $\log p(x_i \mid \theta^{(s)})$ at every draw (edges summed out), one variable
      named after the observed site, dims `(chain, draw, <plates>)`. Elements masked
      out at every observed site (`numpyro.handlers.mask`, `Distribution.mask`: missing
      data) are not observations and are left out: kept along the one plate (its
      coordinate their positions), or, with several plates, on one `<site>_observed`
      dim with a position coordinate per plate;
    * `posterior_predictive` — replicated observations: at each draw the edges are drawn
      from $p(\phi \mid x, \theta^{(s)})$ (`Predictive(..., infer_discrete=True)`) and
      the observed sites from $p(x \mid \phi, \theta^{(s)})$;
    * `constant_data` — the model's array arguments, named as in its signature;
    * `prior` (with `num_prior_draws > 0`) — prior draws of the latent sites;
    * `edge_posterior` — per edge site `<site>`: the posterior marginals
      $p(\phi_i=j\mid x) = \frac1S\sum_s p(\phi_i=j\mid x,\theta^{(s)})$,
      `<site>_prior` (the prior table averaged over the draws, broadcast to the
      marginals' dims when the prior is shared across batch plates) and, when given,
      `<site>_true` (the known parents), their dims named after the plates (the
      children's, a batch plate's, as in `log_likelihood`) and `<site>_parent`; the
      attribute `<site>.offset` holds the child-to-parent position offset used for
      distances.

    Every site and plate is stored under [`xarray_name`][structinfer.diagnostics.xarray_name]
    of its name: a `/` (NumPyro's `scope` divider: `scope(model, "l1")` names a site
    `l1/x`), which xarray refuses, is written `::` (`l1::x`, dims `l1::children`). The
    arguments (`true_edges`) name sites as the model does (`"l1/phi"`).

    Args:
        fit: a finished `numpyro.infer.MCMC` (`structinfer.infer.nuts`) or an
            `(SVI, SVIRunResult)` pair (`structinfer.infer.svi`).
        *model_args: the model's positional arguments, as given to the fit. For an MCMC
            every array (and number) argument is checked against those it ran on
            (NumPyro's `MCMC` records them). An `(SVI, SVIRunResult)` pair keeps no
            record of them, so for SVI nothing is checked: pass the arguments the guide
            was fitted on, or the groups describe another model and data.
        score_factors: `"error"` or `"normalize"`: score factors in the likelihood
            (see `structinfer.exact.pointwise_log_likelihood`).
        true_edges: `{edge site: the true parent of each child}`, stored as `<site>_true`.
        posterior_predictive: add the `posterior_predictive` group (one compiled pass of
            NumPyro's `infer_discrete` over the draws).
        num_prior_draws: prior draws for the `prior` group (a non-negative int; 0: no
            group).
        num_draws: draws of an SVI guide (a positive int; not used for MCMC).
        batch_size: draws per step of the per-draw passes (`jax.lax.map`; a positive
            int, or None for all draws at once).
        rng_key: key of the posterior predictive and prior draws (default `PRNGKey(0)`).
        **model_kwargs: the model's keyword arguments, as given to the fit.

    Returns:
        The DataTree; `attrs["model"]` names the model, `attrs["inference_method"]` is
        `"nuts"` or `"svi"`.

    Raises:
        EnergyOnlyModelError: the model has no normalised observation.
        TypeError: `fit` is neither an MCMC nor an `(SVI, SVIRunResult)` pair, or
            `rng_key` is not one PRNG key.
        ValueError: a `numpyro.param` site, a discrete latent site that is not
            enumerated, no latent site, two sites or plates with one `xarray_name`, a
            bad `true_edges`, observations or other array arguments than those the MCMC
            ran on, or a count (`num_draws`, `num_prior_draws`, `batch_size`) that is
            not an int in its range.
    """
    import arviz_base as azb
    import xarray as xr

    num_draws = check_count(num_draws, "to_inference_data: num_draws")
    num_prior_draws = check_count(num_prior_draws, "to_inference_data: num_prior_draws", 0)
    batch_size = check_count(batch_size, "to_inference_data: batch_size", none_ok=True)
    if rng_key is not None:
        rng_key = check_key(rng_key, "to_inference_data")

    parts = read_fit(fit, "to_inference_data")
    model = parts.model
    args, kwargs = as_arrays(model_args, model_kwargs)
    info = latent_sites(model, args, kwargs, "to_inference_data")
    _check_xarray_names(info, model)
    latent = list(info.latent)
    if not latent:
        raise ValueError(
            f"to_inference_data: model '{model_name(model)}' has no latent sample site; "
            "there is no posterior to describe"
        )
    exact.likelihood_structure(model, None, *args, score_factors=score_factors, **kwargs)
    key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    key_pp, key_prior = jax.random.split(key)

    if parts.kind == "nuts":
        dt = azb.from_numpyro(_XarrayNamedMCMC(fit), log_likelihood=False)
        _check_same_data(dt, model, args, kwargs, fit)
        extra = fit.get_extra_fields(group_by_chain=True)
        if "potential_energy" in extra and "sample_stats" in dt.children:
            # `lp` is the log density of each draw, -U (ArviZ stored U itself)
            ss = dt["sample_stats"].to_dataset()
            ss["lp"] = (("chain", "draw"), -np.asarray(extra["potential_energy"]))
            dt["sample_stats"] = xr.DataTree(ss)
    else:
        dt = _as_one_chain(azb.from_numpyro_svi(
            _xarray_named_svi(svi_taking_model_args(fit[0])), svi_result=fit[1], model_args=args,
            model_kwargs=kwargs, num_samples=num_draws))
    post = dt["posterior"].to_dataset()
    missing = [n for n in latent if xarray_name(n) not in post]
    if missing:
        raise ValueError(f"to_inference_data: the fit has no draws of {missing}")
    samples = {n: post[xarray_name(n)].values for n in latent}  # the model's own names
    dims = {xarray_name(n): list(post[xarray_name(n)].dims[2:]) for n in latent}
    edges = info.edges
    unknown = sorted(set(true_edges or {}) - set(edges))
    if unknown:
        raise ValueError(
            f"to_inference_data: true_edges names {unknown}, which are not edge sites of "
            f"model '{model_name(model)}'; its edge sites are {sorted(edges)}"
        )
    ll, struct, marg, prior_tables = _draw_quantities(
        model, samples, args, kwargs, edges, score_factors, batch_size)

    seen = _observed_elements(model, args, kwargs, struct)
    dt["log_likelihood"] = xr.DataTree(_log_likelihood_group(ll, struct, seen))
    obs = dt["observed_data"].to_dataset() if "observed_data" in dt.children else None
    if posterior_predictive:
        pp = _renamed(_posterior_predictive(model, samples, args, kwargs,
                                            list(info.enumerated), info.observed, key_pp))
        pp_dims = {n: list(obs[n].dims) for n in pp if obs is not None and n in obs}
        dt["posterior_predictive"] = xr.DataTree(azb.dict_to_dataset(pp, dims=pp_dims))
    const = _renamed(_constant_data(model, args, kwargs))
    if const:
        dt["constant_data"] = xr.DataTree(azb.dict_to_dataset(const, sample_dims=[]))
    if num_prior_draws:
        prior = _renamed(_prior_draws(model, args, kwargs, latent, num_prior_draws, key_prior))
        dt["prior"] = xr.DataTree(azb.dict_to_dataset(prior, dims=dims))

    edge_vars, attrs = {}, {}
    for n in marg:
        mean = marg[n].mean(axis=(0, 1))
        edge = info[n].edge
        xn = xarray_name(n)
        # a batch dim takes the name of the plate at its dim (as in `log_likelihood`)
        by_dim = {info.plates[p][0]: xarray_name(p) for p in info[n].plates
                  if p in info.plates}
        batch = mean.ndim - 2
        bdims = [by_dim.get(k - batch - 1, f"{xn}_dim_{k}") for k in range(batch)] + [
            xarray_name(edge.children_plate), f"{xn}_parent"]
        edge_vars[xn] = (bdims, mean)
        # a prior shared across batch plates has fewer dims than the marginals: stored
        # broadcast, so `<site>_prior` and `<site>` share their dims
        edge_vars[f"{xn}_prior"] = (bdims, np.broadcast_to(prior_tables[n].mean(axis=(0, 1)),
                                                           mean.shape))
        if true_edges is not None and n in true_edges:
            edge_vars[f"{xn}_true"] = (bdims[:-1], check_true_edges(true_edges[n], mean, n))
        attrs[f"{xn}.offset"] = offset_of(edge.prior)
    dt["edge_posterior"] = xr.DataTree(xr.Dataset(edge_vars, attrs=attrs))
    dt.attrs["model"] = model_name(model)
    dt.attrs["inference_method"] = parts.kind
    return dt
