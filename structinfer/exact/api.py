r"""The exact engine: collapse every edge site with funsor.

For a model :math:`p(x, \phi)` with discrete edge sites :math:`\phi` (and any
other sites observed or given values):

.. math::

    \log Z = \log \sum_\phi p(x, \phi), \qquad
    E = -\log Z, \qquad
    p(\phi_i = j \mid x) = \frac{\partial \log Z}{\partial t_{ij}}\Big|_{t=0}, \qquad
    \mathbb E[v] = \frac{\partial}{\partial t} \log \sum_\phi p(x,\phi)\, e^{t \cdot v(\phi)}\Big|_{t=0}.

``log Z`` is computed by ``numpyro.contrib.funsor`` (variable elimination over
the plates); marginals and expectations are one backward pass through it
(torch-struct's "marginals are gradients of the log-partition"); MAP and
posterior samples use funsor's max-product / forward-filter-backward-sample
(``numpyro.contrib.funsor.infer_discrete``).

All functions take the model and its arguments, are jittable (close over the
model) and differentiable, and work in float32 and float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import validation_enabled
from numpyro.contrib.funsor import enum, infer_discrete
from numpyro.contrib.funsor import log_density as _funsor_log_density
from numpyro.handlers import block, substitute, trace

from ._bounds import IndexOutOfBounds, check_gather_bounds
from ._checks import as_arrays, is_concrete, model_name
from .handlers import fill_discrete, pin, require_values, tilt
from .primitives import EDGE_INFO_KEY

__all__ = [
    "log_marginal",
    "energy",
    "marginals",
    "expectation",
    "map_edges",
    "sample_edges",
    "inspect_model",
    "ModelInfo",
    "MAX_ENUM_DIMS",
]

#: the most tensor dims (plates + one per enumerated site) the engine will build
MAX_ENUM_DIMS = 32


@dataclass
class ModelInfo:
    """Static facts about a model read from one shape-only pass (no enumeration)."""

    #: enumerated sites: name -> (batch_shape, support_size)
    enumerated: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    #: which enumerated sites were declared with structinfer.edge
    edges: list[str] = field(default_factory=list)
    #: deterministic sites: name -> (shape, event_dim)
    deterministic: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    #: all site names by type, for error messages
    sites: dict[str, str] = field(default_factory=dict)
    max_plate_nesting: int = 0

    @property
    def first_available_dim(self) -> int:
        return -self.max_plate_nesting - 1

    def probes(self) -> dict[str, np.ndarray]:
        """Each enumerated site's whole support ``0..k-1`` on its own enumeration dim,
        laid out as funsor's enumeration lays it out (site ``i`` at dim
        ``first_available_dim - i``): NumPy arrays, so they stay concrete under ``jit``.
        Substituting them runs the model on every structure at once."""
        return {
            name: np.arange(k, dtype=np.int32).reshape((k,) + (1,) * (self.max_plate_nesting + i))
            for i, (name, (_, k)) in enumerate(self.enumerated.items())
        }


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
        "per-child result (e.g. structinfer.diagnostics.pointwise_log_likelihood)"
    )


def inspect_model(model: Callable, *args, **kwargs) -> ModelInfo:
    """Run ``model`` once without enumeration and collect its sites and shapes.

    Enumerable sites get placeholder values (zeros), so nothing is enumerated or
    sampled; under ``jit`` this pass is traced only for its shapes and compiled away.
    Raises a clear error for latent continuous sites without a value, when the model
    would need more than :data:`MAX_ENUM_DIMS` tensor dims, and when it reads a table
    with fewer rows than an edge has parents at that edge's value (a static check of
    the model's jaxpr, so under ``jit`` too).

    Reference: the plates and enumeration dims of NumPyro's funsor enumeration (``numpyro.contrib.funsor``); used by every exact-engine call.
    """
    if not callable(model):
        raise TypeError(f"model must be a callable NumPyro model, got {type(model).__name__}")
    info = ModelInfo()

    def run():
        with block():
            tr = trace(fill_discrete(require_values(model))).get_trace(*args, **kwargs)
        nesting = 0
        for name, site in tr.items():
            info.sites[name] = site["type"]
            frames = site.get("cond_indep_stack", []) or []
            dims = [-f.dim for f in frames if f.dim is not None]
            site_nesting = max(dims) if dims else 0
            nesting = max(nesting, site_nesting)
            if (
                site["type"] == "sample"
                and site["infer"].get("enumerate") == "parallel"
                and (not site["is_observed"])
            ):
                _check_unscaled(site)
                fn = site["fn"]
                support = int(fn.enumerate_support(expand=False).shape[0])
                info.enumerated[name] = (tuple(fn.batch_shape), support)
                if EDGE_INFO_KEY in site["infer"]:
                    info.edges.append(name)
            elif site["type"] == "deterministic":
                shape = tuple(jnp.shape(site["value"]))
                info.deterministic[name] = (shape, max(len(shape) - site_nesting, 0))
        info.max_plate_nesting = nesting

    try:
        run()
    except jax.errors.TracerArrayConversionError as e:
        raise TypeError(
            f"model '{model_name(model)}' indexes a NumPy array with an edge variable "
            "inside jit/grad/vmap; convert the array with jnp.asarray first"
        ) from e
    n_dims = info.max_plate_nesting + len(info.enumerated)
    if info.enumerated and n_dims <= MAX_ENUM_DIMS:
        _check_edge_reads(model, args, kwargs, info)
    if n_dims > MAX_ENUM_DIMS:
        raise ValueError(
            f"model '{model_name(model)}' needs {n_dims} tensor dims ({info.max_plate_nesting} "
            f"plate dims + {len(info.enumerated)} enumerated sites), more than the budget of "
            f"{MAX_ENUM_DIMS}: put repeated edge sites under a plate (one site per child "
            "set, not one per child)"
        )
    return info


def _check_edge_reads(model, args, kwargs, info: ModelInfo) -> None:
    """Every table the model reads at an edge value has a row per parent (static check).

    The model is traced once with each enumerated site given its whole support in its
    own enumeration dim, as the engine will; :func:`structinfer._bounds.check_gather_bounds`
    then checks every clamping read indexed directly by an edge value, and raises
    :class:`~structinfer._bounds.IndexOutOfBounds` naming the site and the array.
    """
    probes = info.probes()

    def run(values):
        with block():
            tr = trace(require_values(substitute(model, data=values))).get_trace(*args, **kwargs)
        return [
            s["value"] if s["type"] == "deterministic" else s["fn"].log_prob(s["value"])
            for name, s in tr.items()
            if s["type"] == "deterministic" or (s["type"] == "sample" and name not in values)
        ]

    try:
        check_gather_bounds(run, probes, f"model '{model_name(model)}'")
    except IndexOutOfBounds:
        raise
    except Exception:  # best effort: the engine's own pass reports the model's errors
        pass


def _log_z(model, args, kwargs, info: ModelInfo, tilts: dict | None = None) -> jax.Array:
    m = require_values(model)
    if tilts:
        m = tilt(m, tilts=tilts, max_plate_nesting=info.max_plate_nesting)
    try:
        lp, _ = _funsor_log_density(
            enum(m, first_available_dim=info.first_available_dim), args, kwargs, {}
        )
    except ValueError as e:
        if "joint log density is a scalar" not in str(e):
            raise
        raise ValueError(
            f"model '{model_name(model)}': after collapsing the edges a tensor dim was left "
            "over, so some factor or value mixes enumeration dims with plate dims. Typical "
            "causes: indexing one edge variable with another (follow a chain with "
            "si.edge(..., child=j) instead), summing over a plate dim inside the model, or "
            "indexing batched tables without Vindex/si.gather. (funsor: "
            f"{str(e).splitlines()[0]})"
        ) from None
    return lp


def log_marginal(model: Callable, *args, **kwargs) -> jax.Array:
    r"""Log marginal likelihood with every edge collapsed, :math:`\log \sum_\phi p(x, \phi)`.

    For attention with a prior table :math:`\log\pi` and scores :math:`s` this is
    :math:`\sum_i \mathrm{logsumexp}_j (s_{ij} + \log \pi_{ij})` — the negative of
    the log-sum-exp energy (Tschantz; Singh & Buckley sec. 3).

    Args:
        model: a NumPyro model using :func:`structinfer.edge` (and/or discrete sites
            marked ``infer={"enumerate": "parallel"}``); continuous latent sites must
            be given values (``numpyro.handlers.substitute``).
        *args, **kwargs: the model's arguments.

    Returns:
        A scalar.
    """
    args, kwargs = as_arrays(args, kwargs)
    info = inspect_model(model, *args, **kwargs)
    return _log_z(model, args, kwargs, info)


def energy(model: Callable, *args, **kwargs) -> jax.Array:
    r"""The collapsed energy :math:`E(x) = -\log \sum_\phi p(x, \phi)` (see :func:`log_marginal`).

    For independent children this is the log-sum-exp energy
    :math:`-\sum_i \log \sum_j \exp(\psi_{ij} + \log p_{ij})` of Tschantz
    ("log-sum-exp energies", v2 eq. 1) and the collapsed free energy of Singh &
    Buckley sec. 4.1 (eq. 3).
    """
    return -log_marginal(model, *args, **kwargs)


def _float_dtype():
    return jnp.result_type(float)


def marginals(model: Callable, *args, **kwargs) -> dict[str, jax.Array]:
    r"""Exact posterior marginals of every enumerated site, by one backward pass.

    .. math:: p(\phi_i = j \mid x) = \partial \log Z / \partial t_{ij} \big|_{t=0}

    Returns:
        ``{site: array (..., children, parents)}`` for each edge site (and each other
        enumerated discrete site, shape ``batch + (support,)``). Rows sum to one.

    Reference: the attention matrix as the edge posterior, Singh & Buckley sec. 3.1
    (eq. 1); marginals as gradients of the log-partition (Lemma 7.1 (i), app. 7.1).
    """
    args, kwargs = as_arrays(args, kwargs)
    info = inspect_model(model, *args, **kwargs)
    if not info.enumerated:
        raise ValueError(
            f"model '{model_name(model)}' has no edge sites: nothing to compute marginals of"
        )
    dtype = _float_dtype()
    zeros = {name: jnp.zeros(batch + (k,), dtype) for name, (batch, k) in info.enumerated.items()}

    def f(t):
        return _log_z(model, args, kwargs, info, {n: (v, 0) for n, v in t.items()})

    return jax.grad(f)(zeros)


def expectation(model: Callable, site: str | Sequence[str], *args, **kwargs):
    r"""Exact posterior expectation of deterministic site(s), by one backward pass.

    .. math::

        \mathbb E_{\phi \mid x}[v(\phi)]
        = \frac{\partial}{\partial t} \log \sum_\phi p(x, \phi)\, e^{\langle t, v(\phi)\rangle}\Big|_{t=0}

    Works for any value of the edges, including ones that couple several edge
    sites (a two-hop chain :math:`V x_{\phi_{\phi_i}}`). The value must be
    recorded with ``numpyro.deterministic`` inside the plates of its children.

    Args:
        model: the model.
        site: a deterministic site name, or a sequence of names.
        *args, **kwargs: the model's arguments.

    Returns:
        The expectation, shaped like the site's value in a plain run (a dict of
        them when ``site`` is a sequence).

    Reference: attention output as :math:`\mathbb E_{\phi|x}[v(x,\phi)]`, Singh &
    Buckley eq. 1; multi-hop values, app. 7.3.
    """
    args, kwargs = as_arrays(args, kwargs)
    names = [site] if isinstance(site, str) else list(site)
    info = inspect_model(model, *args, **kwargs)
    for n in names:
        if n not in info.deterministic:
            kind = info.sites.get(n)
            if kind is None:
                raise KeyError(
                    f"model '{model_name(model)}' has no site '{n}'; deterministic sites: "
                    f"{sorted(info.deterministic)}"
                )
            raise ValueError(
                f"site '{n}' is a {kind} site, not a deterministic one"
                + ("; use structinfer.marginals for edge sites" if n in info.enumerated else "")
            )
    dtype = _float_dtype()
    zeros = {n: jnp.zeros(info.deterministic[n][0], dtype) for n in names}

    def f(t):
        return _log_z(
            model, args, kwargs, info, {n: (t[n], info.deterministic[n][1]) for n in names}
        )

    out = jax.grad(f)(zeros)
    return out[site] if isinstance(site, str) else out


def _discrete_posterior(model, args, kwargs, temperature: int, rng_key) -> dict[str, jax.Array]:
    args, kwargs = as_arrays(args, kwargs)
    info = inspect_model(model, *args, **kwargs)
    if not info.enumerated:
        raise ValueError(f"model '{model_name(model)}' has no edge sites")
    key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    # single-parent sites are deterministic; funsor cannot extract a point from a
    # size-1 enumeration dim, so fix them to 0 as observations (log-prob unchanged)
    trivial = {
        name: jnp.zeros(batch, jnp.int32) for name, (batch, k) in info.enumerated.items() if k == 1
    }
    if len(trivial) == len(info.enumerated):  # nothing left to infer
        return trivial
    m = infer_discrete(
        pin(require_values(model), data=trivial),
        first_available_dim=info.first_available_dim,
        temperature=temperature,
        rng_key=key,
    )
    # funsor draws through a NumPyro Categorical built from the posterior logits, whose
    # argument validation (on by default) rejects the -inf of forbidden parents
    with block(), validation_enabled(False):
        tr = trace(m).get_trace(*args, **kwargs)
    return {
        name: jnp.broadcast_to(tr[name]["value"], info.enumerated[name][0])
        for name in info.enumerated
    }


def map_edges(model: Callable, *args, **kwargs) -> dict[str, jax.Array]:
    r"""Jointly most probable structure :math:`\arg\max_\phi p(\phi \mid x)` (max-product).

    Returns:
        ``{site: int array of the site's batch shape (..., children)}``.

    Reference: hard attention as the MAP structure (Singh & Buckley sec. 3.1);
    computed with funsor's max-product adjoint (``numpyro.contrib.funsor.infer_discrete``).
    """
    return _discrete_posterior(model, args, kwargs, 0, None)


def sample_edges(rng_key: jax.Array, model: Callable, *args, **kwargs) -> dict[str, jax.Array]:
    r"""One exact joint draw :math:`\phi \sim p(\phi \mid x)` (forward-filter backward-sample).

    ``jax.vmap`` over keys for many draws.

    Returns:
        ``{site: int array of the site's batch shape (..., children)}``.

    Reference: stochastic (sampled) attention as a draw from the edge posterior
    (Singh & Buckley sec. 2, "latent alignment"); funsor forward-filter backward-sample.
    """
    return _discrete_posterior(model, args, kwargs, 1, rng_key)
