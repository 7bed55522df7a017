r"""One model inspection: `inspect_model` reads every site of a model into one `ModelInfo`.

The model is run once, blocked and without enumeration
([`trace_model`][structinfer.exact.trace_model]): each
enumerated site holds zeros of its batch shape, each latent site without a value a
placeholder inside its support (no sampler is traced), so the pass costs one plain run
and, under ``jit``, is traced for its shapes only. Every site gets a *role*:

| role | site |
| --- | --- |
| ``edge`` | declared with [`edge`][structinfer.edge] (enumerated; its [`EdgeInfo`][structinfer.primitives.EdgeInfo] attached) |
| ``enumerated`` | another discrete site marked ``infer={"enumerate": "parallel"}`` |
| ``latent`` | any other unobserved sample site (continuous parameters): shape, dtype, support, whether it had a value |
| ``observed`` | a normalised observation (``obs=``, ``handlers.condition``) |
| ``factor`` | a potential: ``numpyro.factor`` / ``Unit``, including each edge's ``"<edge>.score"`` row normaliser |
| ``deterministic`` | ``numpyro.deterministic``: shape and event dims (value dims beyond its plates) |
| ``param`` | ``numpyro.param`` |

and its plates, outermost first. When the model has enumerated sites, the same call
stages the model once more, at the probes (each enumerated site's whole support on its
own dim): a [`ProbeProgram`][structinfer.exact.ProbeProgram], the model's site values as
a closed jaxpr of the probes. The bounds check reads it, and so does the lowering, which
re-evaluates it for its value tables instead of running the model again. These two
passes are the only runs of the model an inspection makes. The exact engine reads
enumeration dims from it
([`ModelInfo.first_available_dim`][structinfer.exact.ModelInfo.first_available_dim],
[`ModelInfo.probes`][structinfer.exact.ModelInfo.probes]), the pointwise
log-likelihood reads roles from it, and so do the fitting helpers and the lowering.

Reference:
    The plates and enumeration dims of NumPyro's funsor enumeration
    (``numpyro.contrib.funsor``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.tree_util import treedef_is_leaf
from numpyro.handlers import seed, substitute, trace

from .._checks import NotFoundError, as_arrays, check_real, is_concrete, model_name
from ..handlers import (
    PLACEHOLDER_KEY,
    contain,
    fill_discrete,
    fill_latent,
    name_plate_dims,
    observe_given,
    require_values,
)
from ..primitives import (
    EDGE_INFO_KEY,
    SCAN_RECORD_KEY,
    EdgeDistribution,
    EdgeInfo,
    Potential,
    is_enumerated,
    is_factor,
)
from .bounds import IndexOutOfBounds, check_jaxpr_bounds

__all__ = [
    "MAX_ENUM_DIMS",
    "SiteInfo",
    "ModelInfo",
    "ProbeProgram",
    "inspect_model",
    "stage_at_probes",
    "trace_model",
]

#: the most tensor dims (plates + one per enumerated site) the engine will build
MAX_ENUM_DIMS = 32

Role = Literal["edge", "enumerated", "latent", "observed", "factor", "deterministic", "param"]

_SITE_TYPE = {"deterministic": "deterministic", "param": "param"}


@dataclass(frozen=True)
class SiteInfo:
    """One site of a model, as [`inspect_model`][structinfer.exact.inspect_model] read it.

    Attributes:
        name: the site name.
        role: see the module docstring.
        shape: ``edge`` / ``enumerated``: the batch shape (one entry per child);
            ``factor``: the shape of the log-factor; otherwise the value's shape (``()``
            for a param whose value is a pytree, e.g. a module's parameters).
        dtype: the value's dtype (of the placeholder for an unvalued latent site;
            ``None`` for a param whose value is a pytree).
        plates: names of the plates around the site, outermost first.
        event_dim: event dims of the site's distribution; for a deterministic site the
            value dims beyond the plates around it.
        support: the distribution's support (a NumPyro constraint); ``None`` for
            deterministic and param sites.
        num_values: ``edge`` / ``enumerated``: the support size (parents); else 0.
        has_value: ``latent``: ``False`` when the site had no value and holds a
            placeholder (it is yet to be inferred); ``True`` for every other site.
        edge: the [`EdgeInfo`][structinfer.primitives.EdgeInfo] recorded by
            [`edge`][structinfer.edge] (also on an edge site given a value, role
            ``observed``); its prior and score belong to the trace the inspection ran in.
    """

    name: str
    role: Role
    shape: tuple[int, ...]
    dtype: Any
    plates: tuple[str, ...] = ()
    event_dim: int = 0
    support: Any = None
    num_values: int = 0
    has_value: bool = True
    edge: EdgeInfo | None = field(default=None, compare=False)

    @property
    def site_type(self) -> str:
        """NumPyro's site type: ``"sample"``, ``"deterministic"`` or ``"param"``."""
        return _SITE_TYPE.get(self.role, "sample")


@dataclass(eq=False)
class ModelInfo(Mapping[str, SiteInfo]):
    """Static facts about a model from one inspection pass: its sites and plates.

    A mapping ``name -> SiteInfo`` ([`SiteInfo`][structinfer.exact.SiteInfo]) in
    execution order, plus the model's plates.

    Attributes:
        records: ``{name: SiteInfo}`` of every sample, deterministic and param site.
        plates: ``{plate name: (dim, size)}`` (``size``: the subsample size).
        max_plate_nesting: the most plate dims around any site.
        site_types: ``{name: NumPyro site type}`` of every trace entry (plates included),
            for error messages.
        float_dtype: the floating dtype of the model's log-density (of its sample sites'
            log-probs): the dtype zero tilts take, so a float32 model answers in float32
            with x64 enabled.
        trace: the NumPyro trace of the inspection run (zeros at the enumerated sites,
            placeholders at unvalued latent sites): its site messages (``infer`` dicts,
            scales, masks, plates) and values, valid in the trace ``inspect_model`` ran in.
        at_probes: the model staged at the probes
            ([`ProbeProgram`][structinfer.exact.ProbeProgram]); ``None`` when the model
            has no enumerated site or could not be staged there.
    """

    records: dict[str, SiteInfo] = field(default_factory=dict)
    plates: dict[str, tuple[int, int]] = field(default_factory=dict)
    max_plate_nesting: int = 0
    site_types: dict[str, str] = field(default_factory=dict)
    #: the floating dtype of the model's log-density (of its sample sites' log-probs):
    #: the dtype zero tilts take, so a float32 model answers in float32 with x64 enabled
    float_dtype: Any = None
    trace: dict = field(default_factory=dict, repr=False)
    at_probes: ProbeProgram | None = field(default=None, repr=False)

    # -- the mapping ----------------------------------------------------------------
    def __getitem__(self, name: str) -> SiteInfo:
        return self.records[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def of_role(self, *roles: Role) -> dict[str, SiteInfo]:
        """The sites with one of ``roles``, in execution order.

        Args:
            *roles: role names (``"edge"``, ``"latent"``, ...; see the module docstring).

        Returns:
            ``{name: SiteInfo}`` of the sites with one of those roles.
        """
        return {n: s for n, s in self.records.items() if s.role in roles}

    # -- views --------------------------------------------------------------------
    @property
    def first_available_dim(self) -> int:
        """The first dim funsor's enumeration may use: ``-(max_plate_nesting + 1)``."""
        return -self.max_plate_nesting - 1

    @property
    def enumerated(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """Sites summed out by enumeration (edges first-class): ``name -> (batch_shape, k)``."""
        return {n: (s.shape, s.num_values) for n, s in self.of_role("edge", "enumerated").items()}

    @property
    def edges(self) -> list[str]:
        """The enumerated sites declared with [`edge`][structinfer.edge]."""
        return list(self.of_role("edge"))

    @property
    def markov_edges(self) -> list[str]:
        """The edge sites with a [`Markov`][structinfer.priors.Markov] prior (chains of
        edges in a ``scan``)."""
        return [n for n, s in self.of_role("edge").items() if s.edge is not None and s.edge.markov]

    @property
    def couples_enumerated(self) -> bool:
        r"""Whether the contraction sums enumerated sites against each other (several of
        them, or a chain of [`Markov`][structinfer.priors.Markov] edges), where an inner sum
        can be zero with $\log Z$ finite: `log_z` then contracts with the safe einsum
        ([`safe_log_einsum`][structinfer.exact.safe_log_einsum])."""
        return len(self.enumerated) > 1 or bool(self.markov_edges)

    @property
    def deterministic(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """``name -> (shape, event_dim)`` of each deterministic site."""
        return {n: (s.shape, s.event_dim) for n, s in self.of_role("deterministic").items()}

    def check_value_site(self, name: str, model: Any) -> None:
        """Refuse ``name`` as the value whose expectation is asked for, unless it is a
        real deterministic site.

        Args:
            name: the site's name.
            model: the model, for the message.

        Raises:
            KeyError: the model has no site ``name`` (the deterministic sites are listed).
            ValueError: the site is not a deterministic site.
            TypeError: its value is complex (the expectation of a real value is computed).
        """
        site = self.records.get(name)
        if site is None or site.role != "deterministic":
            kind = self.sites.get(name)
            if kind is None:
                raise NotFoundError(
                    f"model '{model_name(model)}' has no site '{name}'; deterministic sites: "
                    f"{sorted(self.deterministic)}"
                )
            raise ValueError(
                f"site '{name}' is a {kind} site, not a deterministic one"
                + ("; use structinfer.marginals for edge sites" if name in self.enumerated
                   else "")
            )
        check_real(site.dtype, f"value site '{name}'")

    @property
    def latent(self) -> dict[str, SiteInfo]:
        """The latent (non-enumerated, unobserved) sample sites."""
        return self.of_role("latent")

    @property
    def unvalued(self) -> list[str]:
        """Latent sites that had no value (they hold placeholders)."""
        return [n for n, s in self.latent.items() if not s.has_value]

    @property
    def observed(self) -> list[str]:
        """Observed sample sites that are not potentials."""
        return list(self.of_role("observed"))

    @property
    def factors(self) -> list[str]:
        """Potential (``Unit``) sites."""
        return list(self.of_role("factor"))

    @property
    def sites(self) -> dict[str, str]:
        """``{name: NumPyro site type}`` of every trace entry (plates included)."""
        return dict(self.site_types)

    def probes(self) -> dict[str, np.ndarray]:
        """Each enumerated site's whole support ``0..k-1`` on its own enumeration dim.

        Laid out as funsor's enumeration lays it out (site ``i`` at dim
        ``first_available_dim - i``): NumPy arrays, so they stay concrete under ``jit``.
        Substituting them runs the model on every structure at once.

        Returns:
            ``{site: int32 array}``, the support of each enumerated site.
        """
        return {
            name: np.arange(k, dtype=np.int32).reshape((k,) + (1,) * (self.max_plate_nesting + i))
            for i, (name, (_, k)) in enumerate(self.enumerated.items())
        }


@dataclass(frozen=True)
class ProbeProgram:
    r"""A model staged once at the probes: its site values as a closed jaxpr of the probes.

    ``jaxpr`` is ``jax.make_jaxpr`` of one run of the model (blocked, placeholders at
    unvalued latent sites) with every enumerated site given its probe
    ([`ModelInfo.probes`][structinfer.exact.ModelInfo.probes]): its inputs are the probes,
    in the order of ``probes``; its outputs are, per entry of ``sites``, a deterministic
    site's value or another sample site's log-density at the probes. The model's
    arguments are closed over (constants of the jaxpr: concrete arrays, or tracers of the
    ``jit`` the inspection ran in). Re-evaluating it (``jax.core.eval_jaxpr``, or a replay
    that reads its gathers as views) gives those values without running the model again.

    Attributes:
        jaxpr: the closed jaxpr.
        probes: ``{enumerated site: NumPy probe}``, the inputs in order.
        sites: the site of each output, in the model's order.
    """

    jaxpr: Any
    probes: dict[str, np.ndarray]
    sites: tuple[str, ...]

    def output(self, site: str) -> int:
        """The index of ``site``'s output.

        Args:
            site: a deterministic site, or a sample site without a probe.

        Returns:
            its position in the jaxpr's outputs.
        """
        return self.sites.index(site)

    def shape(self, site: str) -> tuple[int, ...]:
        """The shape of ``site``'s value (deterministic) or log-density at the probes.

        Args:
            site: a deterministic site, or a sample site without a probe.

        Returns:
            the shape, read from the jaxpr's output types (nothing is computed).
        """
        return tuple(self.jaxpr.out_avals[self.output(site)].shape)


def stage_at_probes(model: Callable, args: tuple, kwargs: Mapping, info: ModelInfo) -> ProbeProgram:
    """Stage ``model`` once at its probes (see [`ProbeProgram`][structinfer.exact.ProbeProgram]).

    Args:
        model: a NumPyro model.
        args: its positional arguments.
        kwargs: its keyword arguments.
        info: its [`ModelInfo`][structinfer.exact.ModelInfo] (the probes' layout).

    Returns:
        The [`ProbeProgram`][structinfer.exact.ProbeProgram].

    Raises:
        Exception: whatever the model raises when traced at the probes.
    """
    probes = info.probes()
    names = list(probes)
    sites: list[str] = []

    def run(*vals):
        values = dict(zip(names, vals))
        tr = trace_model(model, args, kwargs, values=values, placeholders=True)
        out = {
            name: s["value"] if s["type"] == "deterministic" else s["fn"].log_prob(s["value"])
            for name, s in tr.items()
            if s["type"] == "deterministic" or (s["type"] == "sample" and name not in values)
        }
        # one output per site: a site whose value is a container (a tuple, a dict, None)
        # is left out, so the outputs' positions stay those of ``sites``
        out = {k: v for k, v in out.items() if treedef_is_leaf(jax.tree.structure(v))}
        sites[:] = list(out)
        return list(out.values())

    closed = jax.make_jaxpr(run)(*[probes[n] for n in names])
    return ProbeProgram(closed, probes, tuple(sites))


def trace_model(
    model: Callable,
    args: tuple = (),
    kwargs: Mapping | None = None,
    *,
    values: Mapping[str, Any] | None = None,
    placeholders: bool = False,
    what: str = "the exact engine",
) -> dict:
    """Run ``model`` once, blocked and without enumeration, and return its trace.

    Sites in ``values`` take those values (edge probes, posterior draws); an enumerable
    site the model itself gives a value (``numpyro.handlers.substitute``) is observed at
    it ([`observe_given`][structinfer.handlers.observe_given]); every other
    enumerated site holds zeros of its batch shape; a latent site without a value gets
    a placeholder inside its support (``placeholders=True``, marked with
    [`PLACEHOLDER_KEY`][structinfer.handlers.PLACEHOLDER_KEY]) or raises the error of
    [`require_values`][structinfer.handlers.require_values] naming ``what``. Nothing is
    sampled (a ``seed`` only serves ``numpyro.prng_key`` and callable ``numpyro.param``
    inits).

    This is the one plain run of a model the engine makes:
    [`inspect_model`][structinfer.exact.inspect_model] reads its sites from it, and
    callers that need values at given edges (the Laplace expansion, the lowering's
    tables) run it with ``values``; at the probes it is staged once,
    [`stage_at_probes`][structinfer.exact.stage_at_probes], and the bounds check and
    the lowering share that program.

    Args:
        model: a NumPyro model.
        args: its positional arguments.
        kwargs: its keyword arguments.
        values: ``{site: value}`` to substitute (edge probes, posterior draws).
        placeholders: give latent sites without a value a placeholder instead of
            raising.
        what: what needs the values, named in the error of a missing value.

    Returns:
        The model's trace (NumPyro's ``OrderedDict`` of sites).

    Raises:
        ValueError: a latent site without a value, unless ``placeholders``.
    """
    m = observe_given(model)  # the model's own values only, not ``values``
    m = substitute(m, data=dict(values)) if values else m
    m = fill_latent(m) if placeholders else require_values(m, what=what)
    # name_plate_dims refuses a scope around an enumerated scan here, in every engine
    m = name_plate_dims(seed(fill_discrete(m), 0))
    with contain():
        return trace(m).get_trace(*args, **dict(kwargs or {}))


def _check_unscaled(site) -> None:
    """Refuse a scaled enumerated site: funsor would scale inside the log-sum-exp."""
    scale = site.get("scale")
    if scale is None:
        return
    if is_concrete(scale) and np.all(np.asarray(scale) == 1):
        return
    raise ValueError(
        f"edge site '{site['name']}' carries a scale (from numpyro.handlers.scale or a "
        "subsampled plate): the exact engine would multiply the log-potentials inside "
        "the log-sum-exp, i.e. temper the edge posterior instead of scaling each "
        "child's log-likelihood. Collapse the edges without the scale, then scale the "
        "per-child result (e.g. structinfer.exact.pointwise_log_likelihood)"
    )


def _site_info(name: str, site: dict, plates: tuple[str, ...], nesting: int) -> SiteInfo:
    kind = site["type"]
    value = site.get("value")
    if kind == "param" and isinstance(value, (dict, list, tuple)):
        # a pytree of arrays (a Flax / Haiku module's parameters through
        # numpyro.contrib.module): no one shape or dtype
        return SiteInfo(name, "param", (), None, plates)
    if isinstance(value, (list, tuple)):
        what = "observed value" if site.get("is_observed") else "value"
        raise TypeError(
            f"site '{name}': its {what} is a {type(value).__name__}, not an array; pass "
            f"jnp.asarray(...) (a {type(value).__name__} has no dtype for the engine to read)")
    vshape, vdtype = tuple(jnp.shape(value)), jnp.result_type(value)
    if kind == "param":
        return SiteInfo(name, "param", vshape, vdtype, plates)
    if kind == "deterministic":
        # a site recorded by numpyro's scan has the time steps as its leading dim
        time = 1 if site.get(SCAN_RECORD_KEY) else 0
        return SiteInfo(name, "deterministic", vshape, vdtype, plates,
                        event_dim=max(len(vshape) - nesting - time, 0))
    fn = site["fn"]
    edge = (site.get("infer") or {}).get(EDGE_INFO_KEY)
    common = dict(plates=plates, event_dim=int(fn.event_dim), support=fn.support, edge=edge)
    if is_factor(site):
        return SiteInfo(name, "factor", tuple(fn.batch_shape), vdtype, **common)
    if site["is_observed"]:
        return SiteInfo(name, "observed", vshape, vdtype, **common)
    if is_enumerated(site) and fn.has_enumerate_support:
        _check_unscaled(site)
        k = int(fn.enumerate_support(expand=False).shape[0])
        role = "edge" if edge is not None else "enumerated"
        return SiteInfo(name, role, tuple(fn.batch_shape), vdtype, num_values=k, **common)
    placeheld = bool((site.get("infer") or {}).get(PLACEHOLDER_KEY))
    return SiteInfo(name, "latent", vshape, vdtype, has_value=not placeheld, **common)


def _read(tr: dict) -> ModelInfo:
    info = ModelInfo()
    for name, site in tr.items():
        info.site_types[name] = site["type"]
        if site["type"] not in ("sample", "deterministic", "param"):
            continue
        frames = sorted(
            (f for f in site.get("cond_indep_stack", []) or [] if f.dim is not None),
            key=lambda f: f.dim,
        )
        for f in frames:
            info.plates[f.name] = (f.dim, f.size)
        nesting = max((-f.dim for f in frames), default=0)
        info.max_plate_nesting = max(info.max_plate_nesting, nesting)
        info.records[name] = _site_info(name, site, tuple(f.name for f in frames), nesting)
    # an edge whose table holds no parameter (a uniform or masked prior, no score) takes
    # the default float dtype: it says nothing about the model's own
    dtypes = [_log_prob_dtype(s) for s in tr.values()
              if s["type"] == "sample" and not _dtype_free_edge(s)]
    floats = [d for d in dtypes if d is not None and jnp.issubdtype(d, jnp.floating)]
    info.float_dtype = jnp.result_type(*floats) if floats else jnp.result_type(float)
    return info


def _dtype_free_edge(site: dict) -> bool:
    """An edge site with no score and a parameter-free prior (uniform, a mask)."""
    edge = (site.get("infer") or {}).get(EDGE_INFO_KEY)
    return edge is not None and edge.score is None and edge.prior.parameter_dtype is None


def _log_prob_dtype(site: dict) -> Any:
    """The dtype of a sample site's log-prob, read abstractly (nothing is computed)."""
    fn = site["fn"]
    # the two kinds of site every edge makes: their log-probs read a table or a factor
    if type(fn) is EdgeDistribution:
        return fn.logits.dtype
    if type(fn) in (dist.Unit, Potential):
        return jnp.result_type(fn.log_factor)
    try:
        return jax.eval_shape(site["fn"].log_prob, site["value"]).dtype
    except Exception:  # noqa: BLE001 - a site whose log-prob cannot be traced alone
        return None


def inspect_model(model: Callable, *args: Any, **kwargs: Any) -> ModelInfo:
    """Run ``model`` once without enumeration and read every site into a `ModelInfo`.

    Enumerable sites get zeros and latent sites without a value a placeholder inside
    their support ([`trace_model`][structinfer.exact.trace_model]), so nothing is
    enumerated or sampled; under ``jit`` this pass is traced only for its shapes and
    compiled away. Raises a clear error when the model would need more than
    `MAX_ENUM_DIMS` (32) tensor dims, when an
    enumerated site carries a scale, and when it reads a table with fewer rows than an
    edge has parents at that edge's value (a static check of the model's jaxpr, so under
    ``jit`` too). Latent sites without a value are recorded (``has_value=False``), not
    refused: the functions that contract the model refuse them.

    Args:
        model: a NumPyro model.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        The model's [`ModelInfo`][structinfer.exact.ModelInfo]. Its ``trace`` and
        ``at_probes`` hold the call's arrays, and under a ``jit`` its tracers: read them
        inside that trace, not after it.

    Raises:
        TypeError: ``model`` is not callable, or it indexes a NumPy array with an edge
            variable under a trace.
        ValueError: too many tensor dims, or a scaled edge site.
        IndexOutOfBounds: a table read at an edge value has too few rows.

    Reference:
        The plates and enumeration dims of NumPyro's funsor enumeration
        (``numpyro.contrib.funsor``); used by every exact-engine call.
    """
    if not callable(model):
        raise TypeError(f"model must be a callable NumPyro model, got {type(model).__name__}")
    args, kwargs = as_arrays(args, kwargs)
    try:
        tr = trace_model(model, args, kwargs, placeholders=True)
        info = _read(tr)
    except jax.errors.TracerArrayConversionError as e:
        raise TypeError(
            f"model '{model_name(model)}' indexes a NumPy array with an edge variable "
            "inside jit/grad/vmap; convert the array with jnp.asarray first"
        ) from e
    n_dims = info.max_plate_nesting + len(info.enumerated)
    if n_dims > MAX_ENUM_DIMS:
        raise ValueError(
            f"model '{model_name(model)}' needs {n_dims} tensor dims ({info.max_plate_nesting} "
            f"plate dims + {len(info.enumerated)} enumerated sites), more than the budget of "
            f"{MAX_ENUM_DIMS}: put repeated edge sites under a plate (one site per child "
            "set, not one per child)"
        )
    info.trace = tr
    if info.enumerated:
        _check_edge_reads(model, args, kwargs, info)
    return info


def _check_edge_reads(model, args, kwargs, info: ModelInfo) -> None:
    """Every table the model reads at an edge value has a row per parent (static check).

    The model is staged once with each enumerated site given its whole support in its
    own enumeration dim, as the engine will (`stage_at_probes`, kept in
    ``info.at_probes`` for the lowering); `check_jaxpr_bounds` then checks every
    clamping read indexed directly by an edge value, and raises `IndexOutOfBounds`
    naming the site and the array.
    """
    try:
        info.at_probes = stage_at_probes(model, args, kwargs, info)
        check_jaxpr_bounds(info.at_probes.jaxpr, info.at_probes.probes,
                           f"model '{model_name(model)}'")
    except IndexOutOfBounds:
        raise
    except Exception:  # best effort: the engine's own pass reports the model's errors
        pass
