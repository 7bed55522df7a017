r"""NUTS and SVI on NumPyro's own `MCMC` and `SVI`, with the edges summed out exactly.

Every `structinfer.edge` site is marked for parallel enumeration, so NumPyro's samplers
see the collapsed target

$$\log p(\theta, x) = \log p(\theta) + \log \sum_\phi p(x, \phi \mid \theta)$$

over the continuous sites $\theta$ (a geometric rate $q$, a temperature, $W_Q$, ...):
NUTS differentiates it (funsor sums the edges inside the potential) and SVI maximises
`TraceEnum_ELBO`, $\mathbb E_{q_\lambda(\theta)}[\log p(\theta, x) - \log q_\lambda(\theta)]$,
with a guide over $\theta$ only. Both functions return NumPyro's objects (an `MCMC`, an
`SVI` and its `SVIRunResult`), which `structinfer.diagnostics.to_inference_data` turns
into ArviZ's InferenceData.

[`NUTS`][structinfer.infer.NUTS] is NumPyro's kernel with one change: a single chain
finds its initial point on NumPyro's compiled path (the one it takes for vectorized
chains) instead of evaluating the funsor potential op by op.

[`conditional_edge`][structinfer.infer.conditional_edge] declares attention as a
conditional model of outputs given inputs (learning $W_Q, W_K, W_V$ by SVI).

Reference: NumPyro's `MCMC`/`NUTS` and `SVI` with `TraceEnum_ELBO`; the collapsed
evidence of Singh & Buckley sec. 3 (edges summed out), the geometric rate of
expanding attention (sec. 5.2).
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.handlers import block, seed, substitute, trace
from numpyro.infer import ELBO, MCMC, SVI, TraceEnum_ELBO
from numpyro.infer import NUTS as NumPyroNUTS
from numpyro.infer.autoguide import AutoDelta, AutoNormal
from numpyro.infer.svi import SVIRunResult
from numpyro.infer.util import log_density
from numpyro.util import is_prng_key

from .._checks import as_arrays, check_count, check_key, is_concrete, model_name
from ..exact import (
    ModelInfo,
    inspect_model,
    log_marginal,
    safe_log_einsum,
    sample_edges,
    trace_model,
)
from ..handlers import name_plate_dims
from ..primitives import SCAN_INDEX_KEY, SCORE_SUFFIX, edge, is_enumerated
from ._diagnose import bad_leaf, nonfinite_site, start_failure
from ._loop import NonFiniteEnergyError

__all__ = [
    "NUTS",
    "nuts",
    "svi",
    "hide_edges",
    "conditional_edge",
    "EXTRA_FIELDS",
]

#: the sampler statistics `nuts` collects (ArviZ's `sample_stats`: `lp`, `energy`,
#: `diverging`, `acceptance_rate`, `n_steps`, `step_size`)
EXTRA_FIELDS = (
    "potential_energy",
    "energy",
    "diverging",
    "accept_prob",
    "num_steps",
    "adapt_state.step_size",
)


class NUTS(NumPyroNUTS):
    r"""NumPyro's NUTS kernel whose single-chain initial point is found compiled.

    NumPyro's `initialize_model` looks for a start with a finite potential
    $U(z) = -\log p(\theta(z), x) - \log|\det J(z)|$ and gradient. For one chain it
    evaluates $U$ and $\nabla U$ eagerly first (to skip compiling its search loop); for
    an enumerated model that runs funsor's contraction op by op, hundreds of small XLA
    compilations. Given a batch of keys it runs the search under `jax.lax.map` instead
    (compiled once). This kernel hands it a batch of one key and takes the one start
    out, so the draws are those of `numpyro.infer.NUTS` for the same key (the search
    consumes the same random numbers). Its potential is contracted with the exact engine's
    log-space einsum ([`safe_log_einsum`][structinfer.exact.safe_log_einsum]), so its
    gradient is exact where a product of factors leaves pairs of states unconnected
    ($-\infty$ priors, scores or factors), and each enumerated plate's dim is named as
    the plate its sites record (a layer under ``numpyro.handlers.scope``, which renames
    its plates); everything else is NumPyro's.

    Use it wherever `numpyro.infer.NUTS(model, ...)` is used, e.g.
    `MCMC(structinfer.infer.NUTS(model), num_warmup=..., num_samples=...)`.

    Reference: Hoffman & Gelman (2014), the No-U-Turn sampler, as implemented by NumPyro.
    """

    def __init__(self, model: Callable | None = None, *args: Any, **kwargs: Any):
        # each enumerated plate's dim named as its sites record it (a layer under
        # numpyro.handlers.scope renames its plates)
        super().__init__(None if model is None else name_plate_dims(model), *args, **kwargs)

    def init(self, *args: Any, **kwargs: Any):
        with safe_log_einsum():  # the potential is traced here and in `sample`
            return super().init(*args, **kwargs)

    def sample(self, *args: Any, **kwargs: Any):
        with safe_log_einsum():
            return super().sample(*args, **kwargs)

    def _init_state(self, rng_key, model_args, model_kwargs, init_params):
        if self.model is None or not is_prng_key(rng_key):
            return super()._init_state(rng_key, model_args, model_kwargs, init_params)
        found = super()._init_state(rng_key[None], model_args, model_kwargs, init_params)
        return found if init_params is not None else jax.tree.map(lambda a: a[0], found)


class _ELBO(TraceEnum_ELBO):
    """NumPyro's `TraceEnum_ELBO` whose contraction is traced with the exact engine's
    log-space einsum (`safe_log_einsum`): exact gradients with structural zeros."""

    def loss(self, *args: Any, **kwargs: Any):
        with safe_log_einsum():
            return super().loss(*args, **kwargs)

    def loss_with_mutable_state(self, *args: Any, **kwargs: Any):
        with safe_log_einsum():
            return super().loss_with_mutable_state(*args, **kwargs)


class _CollapsedELBO(ELBO):
    r"""The ELBO $\mathbb E_q[\log p(\theta, x) - \log q(\theta)]$ with
    $\log p(\theta, x) = \log \sum_\phi p(x, \phi, \theta)$ from the exact engine
    ([`log_marginal`][structinfer.exact.log_marginal], at the guide's draw and the
    parameters): for a model with a [`Markov`][structinfer.priors.Markov] edge, whose
    chain in a ``scan`` `TraceEnum_ELBO` does not contract exactly (it sums the time dim
    like a plate) while NumPyro's ``log_density`` under enumeration, which the engine
    runs, does; and for every model where NumPyro's `TraceEnum_ELBO` cannot trace a
    model's dependencies on the installed JAX (`_numpyro_traces_dependencies`). The
    gradient flows through the guide's draws, so every guide site must be reparameterized
    (no score-function term)."""

    can_infer_discrete = True  # the engine sums the edges out

    def loss_with_mutable_state(self, rng_key, param_map, model, guide, *args, **kwargs):
        def particle(key: jax.Array) -> jax.Array:
            g_lp, g_tr = log_density(seed(substitute(guide, data=param_map), key),
                                     args, kwargs, {})
            draw = {n: s["value"] for n, s in g_tr.items()
                    if s["type"] == "sample" and not s.get("is_observed")}
            for n in draw:
                if not g_tr[n]["fn"].has_rsample:
                    raise ValueError(
                        f"svi: guide site '{n}' ({type(g_tr[n]['fn']).__name__}) has no "
                        "reparameterized sampler; the exact engine's ELBO (used for a Markov "
                        "edge or any site in a scan step, and where NumPyro's TraceEnum_ELBO cannot trace dependencies: "
                        "NumPyro 0.15.0-0.15.1 on JAX >= 0.4.31, NumPyro <= 0.21 on JAX >= "
                        "0.11.1) differentiates through the guide's draws: give the site a "
                        "reparameterizable distribution (AutoNormal, AutoDelta)")
            at = substitute(model, data={**param_map, **draw})
            return g_lp - log_marginal(at, *args, **kwargs)

        keys = jax.random.split(rng_key, self.num_particles)
        if self.vectorize_particles:
            losses = jax.vmap(particle)(keys)
        else:
            losses = jnp.stack([particle(k) for k in keys])
        return {"loss": jnp.mean(losses), "mutable_state": None}


class _EdgeDrawMCMC(MCMC):
    r"""NumPyro's `MCMC` whose draws of a deterministic site that reads an edge are the
    site's value at edges drawn from their posterior.

    NumPyro records a deterministic site of an enumerated model as the model computes it
    under enumeration: one value per parent (a broadcast over the enumeration dims), the
    same at every draw, not a draw. After each `run` this object takes, at every draw
    $\theta^{(s)}$, one joint draw $\phi^{(s)} \sim p(\phi \mid x, \theta^{(s)})$
    ([`sample_edges`][structinfer.exact.sample_edges]) and evaluates those sites there, so
    `get_samples()` holds draws $f(\phi^{(s)}, \theta^{(s)})$ of the joint posterior, of
    the site's own shape (their mean estimates the posterior mean; for its exact value at a
    draw, use [`expectation`][structinfer.expectation] on the model substituted at it).
    Deterministic sites that read no edge are NumPyro's; in a model with a ``scan``, where
    the edges cannot be drawn so, those that read one are left out (with a warning)."""

    _edge_model: Callable | None = None
    _edge_sites: tuple[str, ...] = ()
    _at_edge_draws: dict | None = None  # {site: (chains, draws, ...)} of the last run
    _left_out: tuple[str, ...] = ()  # such sites it cannot draw (a model with a scan)

    def run(self, rng_key, *args, **kwargs):
        self._at_edge_draws = None
        super().run(rng_key, *args, **kwargs)
        if self._edge_sites:
            model_kwargs = {k: v for k, v in kwargs.items()
                            if k not in ("extra_fields", "init_params")}
            key = rng_key if is_prng_key(rng_key) else rng_key[0]  # one key per chain
            self._at_edge_draws = _deterministic_at_edge_draws(
                self._edge_model, self._edge_sites, super().get_samples(group_by_chain=True),
                jax.random.fold_in(key, 1), args, model_kwargs)

    def get_samples(self, group_by_chain: bool = False):
        samples = super().get_samples(group_by_chain=group_by_chain)
        if self._left_out:
            samples = {n: v for n, v in samples.items() if n not in self._left_out}
        if not self._at_edge_draws:
            return samples
        fixed = self._at_edge_draws if group_by_chain else {
            n: v.reshape((-1,) + v.shape[2:]) for n, v in self._at_edge_draws.items()}
        return {**samples, **fixed}


def _edge_deterministic(info: ModelInfo, model: Callable, args: tuple, kwargs: dict) -> list[str]:
    """The deterministic sites whose value reads an enumerated site: under NumPyro's
    enumeration (as its `MCMC` records them) they take the enumeration dims, so their
    shape differs from the inspection's (edges held at one value)."""
    if not info.enumerated or not info.deterministic:
        return []
    from numpyro.contrib.funsor import enum

    at = substitute(model, data={n: info.trace[n]["value"] for n in info.latent})
    with block():  # (NumPyro's funsor trace records no deterministic site)
        tr = trace(enum(name_plate_dims(at), first_available_dim=info.first_available_dim)
                   ).get_trace(*args, **kwargs)
    return [n for n, (shape, _) in info.deterministic.items()
            if n in tr and tuple(jnp.shape(tr[n]["value"])) != tuple(shape)]


def _deterministic_at_edge_draws(model: Callable, sites: tuple[str, ...], samples: dict,
                                 rng_key: jax.Array, args: tuple, kwargs: dict) -> dict:
    """``{site: (chains, draws, ...)}``: each deterministic site in ``sites`` at one joint
    posterior draw of the edges per draw of ``samples`` (one compilation)."""
    latent = {n: v for n, v in samples.items() if n not in sites}
    lead = next(iter(latent.values())).shape[:2]
    flat = {n: v.reshape((-1,) + v.shape[2:]) for n, v in latent.items()}
    keys = jax.random.split(rng_key, int(np.prod(lead)))

    def one(key_draw):
        key, draw = key_draw
        at = substitute(model, data=draw)
        edges = sample_edges(key, at, *args, **kwargs)
        tr = trace_model(at, args, kwargs, values=edges, what="nuts")
        return {n: tr[n]["value"] for n in sites}

    out = jax.jit(lambda k, d: jax.lax.map(one, (k, d)))(keys, flat)
    return {n: v.reshape(lead + v.shape[1:]) for n, v in out.items()}


def _sampled_sites(model: Callable, args: tuple, kwargs: dict, what: str) -> ModelInfo:
    """The model's inspection, refusing what a sampler over its latent sites cannot do."""
    if not callable(model):
        raise TypeError(f"{what}: model must be a callable NumPyro model, got {type(model).__name__}")
    info = inspect_model(model, *args, **kwargs)
    for name, site in info.items():
        if site.role == "latent" and site.support.is_discrete:
            raise ValueError(
                f"{what}: model '{model_name(model)}' has a discrete latent site '{name}' that "
                "is not enumerated; declare edges with structinfer.edge or mark the site with "
                "infer={'enumerate': 'parallel'}"
            )
    return info


def nuts(
    rng_key: jax.Array,
    model: Callable,
    *model_args: Any,
    num_warmup: int = 500,
    num_samples: int = 500,
    num_chains: int = 1,
    target_accept_prob: float = 0.8,
    progress_bar: bool = True,
    **model_kwargs: Any,
) -> MCMC:
    r"""NUTS over a model's continuous latent sites, every edge summed out exactly.

    Samples $p(\theta \mid x) \propto p(\theta)\sum_\phi p(x, \phi \mid \theta)$ with
    NumPyro's `MCMC` and this module's [`NUTS`][structinfer.infer.NUTS] kernel; several
    chains run vectorized (one compilation). The sampler statistics ArviZ reads
    (`structinfer.infer.fit.EXTRA_FIELDS`: energy, potential energy,
    divergences, acceptance probability, tree size, step size) are collected.

    Args:
        rng_key: one PRNG key (`jax.random.key(seed)`), as for `MCMC.run`.
        model: the model; its discrete latent sites must be edges (enumerated), its
            parameters sample sites with priors.
        *model_args: the model's positional arguments (the data).
        num_warmup: warm-up (adaptation) steps per chain.
        num_samples: draws kept per chain.
        num_chains: chains (run vectorized when more than one).
        target_accept_prob: the step-size adaptation's target acceptance probability, in
            (0, 1) (a 0-d array too).
        progress_bar: show NumPyro's progress bar.
        **model_kwargs: the model's keyword arguments.

    Returns:
        The finished `numpyro.infer.MCMC` (`get_samples()`, `get_extra_fields()`,
        `print_summary()`). A deterministic site that reads an edge is drawn at the
        edges: at each draw $\theta^{(s)}$, at one joint draw of the edges from
        $p(\phi \mid x, \theta^{(s)})$ (NumPyro alone records its value at every
        parent, the same at every draw).

    Raises:
        TypeError: `rng_key` is not one PRNG key, or `model` is not callable.
        ValueError: a bad count or `target_accept_prob` (outside (0, 1)), a
            `numpyro.param` site (NUTS would hold it fixed),
            a discrete latent site that is not enumerated, or no continuous latent
            site to sample.
        FloatingPointError: a draw of a latent site is not finite (naming the site;
            deterministic sites are not checked).
        NonFiniteEnergyError: (a `FloatingPointError`) NumPyro found no initial point with
            a finite log density, and the argument or site responsible (NaN data, say)
            was found, with the continuous latents at a starting point in their
            supports; it is named. Where the model itself raises there, its own
            exception (NumPyro's error as its cause); NumPyro's own RuntimeError where
            nothing was found.

    Examples:
        ```python
        import jax, numpyro, numpyro.distributions as dist
        import structinfer as si

        def model(y):
            s = numpyro.sample("s", dist.HalfNormal(1.0))
            with numpyro.plate("children", 3):
                phi = si.edge("phi", si.priors.Uniform(2))
                numpyro.sample("y", dist.Normal(jax.numpy.array([-1.0, 1.0])[phi], s), obs=y)

        mcmc = si.infer.nuts(jax.random.key(0), model, jax.numpy.array([-1.0, 0.9, 1.1]),
                             num_warmup=20, num_samples=20, progress_bar=False)
        assert mcmc.get_samples()["s"].shape == (20,)
        ```

    Reference: Hoffman & Gelman (2014); NUTS over the hyper-parameters of a structural
    prior with the edges enumerated, e.g. the geometric $q$ of expanding attention
    (Singh & Buckley sec. 5.2).
    """
    rng_key = check_key(rng_key, "nuts")
    num_warmup = check_count(num_warmup, "nuts: num_warmup", minimum=0)
    num_samples = check_count(num_samples, "nuts: num_samples")
    num_chains = check_count(num_chains, "nuts: num_chains")
    tap = target_accept_prob
    if (isinstance(tap, (jax.Array, np.ndarray)) and np.ndim(tap) == 0 and is_concrete(tap)
            and jnp.issubdtype(tap.dtype, jnp.floating)):
        target_accept_prob = float(tap)  # a 0-d array, as a tolerance may be
    if isinstance(target_accept_prob, bool) or not (
            isinstance(target_accept_prob, numbers.Real) and 0 < target_accept_prob < 1):
        raise ValueError(f"nuts: target_accept_prob must be a number in (0, 1), got "
                         f"{target_accept_prob!r}")
    args, kwargs = as_arrays(model_args, model_kwargs)
    info = _sampled_sites(model, args, kwargs, "nuts")
    params = list(info.of_role("param"))
    if params:
        raise ValueError(
            f"nuts: model '{model_name(model)}' has numpyro.param site(s) {params}; NUTS "
            "samples sample sites only: give each a prior with numpyro.sample (or fit it "
            "with structinfer.infer.svi)"
        )
    if not info.latent:
        raise ValueError(
            f"nuts: model '{model_name(model)}' has no continuous latent site to sample; "
            "use structinfer.marginals / structinfer.log_marginal directly"
        )
    mcmc = _EdgeDrawMCMC(
        NUTS(model, target_accept_prob=target_accept_prob),
        num_warmup=num_warmup,
        num_samples=num_samples,
        num_chains=num_chains,
        chain_method="vectorized" if num_chains > 1 else "sequential",
        progress_bar=progress_bar,
    )
    # deterministic sites that read an edge: drawn at posterior edge draws, not NumPyro's
    # broadcast over the parents
    mcmc._edge_model = model
    sites = tuple(_edge_deterministic(info, model, args, kwargs))
    if sites and _in_scan(info):
        # `sample_edges` cannot draw them there (NumPyro's infer_discrete does not support
        # a scan; beside a Markov chain it refuses the other edges): left out, not kept at
        # NumPyro's broadcast values
        warnings.warn(
            f"nuts: deterministic site(s) {list(sites)} read an edge in a model with a "
            "scan, where their values cannot be drawn at posterior edge draws: they are "
            "left out of the samples (for their posterior mean at a draw, use "
            "structinfer.expectation on the model substituted at it)", stacklevel=2)
        mcmc._left_out = sites
    else:
        mcmc._edge_sites = sites
    with _init_failure("nuts", model, args, kwargs):
        mcmc.run(rng_key, *args, extra_fields=EXTRA_FIELDS, **kwargs)
    samples = mcmc.get_samples()
    # the latent sites only: a deterministic site may hold -inf by design (a causal
    # prior's log-table)
    for name in info.latent:
        draws = samples.get(name)
        if draws is not None and not bool(jnp.all(jnp.isfinite(draws))):
            raise FloatingPointError(
                f"nuts: site '{name}' has non-finite draws; check the priors' supports and "
                "the data for NaN/inf"
            )
    return mcmc


def hide_edges(model: Callable) -> Callable:
    """The model with its enumerated (edge) sites hidden, for an autoguide of the rest.

    `AutoNormal(hide_edges(model))` is a guide over the continuous latent sites only:
    the edges stay in the model, where `TraceEnum_ELBO` sums them out.

    Args:
        model: a NumPyro model.

    Returns:
        `numpyro.handlers.block(model)` hiding every enumerated site (and the observed
        sites of a ``scan``'s steps, whose plates NumPyro 0.15's autoguides could not
        read); a hidden edge is
        drawn with a key from the enclosing `seed` handler (as newer NumPyro's `block`
        does itself; NumPyro 0.15's drew it with no key, an `AssertionError` when an
        autoguide traced the model). The sites of a ``scan`` under
        ``numpyro.handlers.scope`` take the values the guide's handlers give them under
        their scoped names ([`name_plate_dims`][structinfer.handlers.name_plate_dims]).
    """
    return _HideEdges(name_plate_dims(model), hide_fn=_hidden_from_guide)


def _hidden_from_guide(msg: dict) -> bool:
    """An enumerated site, or an observed site of a ``scan``'s steps: NumPyro 0.15's
    autoguides read the plates of observed sites too, and a plate inside a step (which
    the scan does not send on) failed their setup with ``KeyError`` naming the plate; the
    guide has nothing to do with an observation."""
    return is_enumerated(msg) or bool(
        msg["type"] == "sample" and msg.get("is_observed")
        and SCAN_INDEX_KEY in (msg.get("infer") or {}))


class _HideEdges(block):
    """`block` that gives a hidden sample site with no value a PRNG key before hiding it,
    and a ``scan`` with no key one too (its steps draw the hidden edges: they run hidden
    from this handler). The key comes from the `seed` handler above, or is key 0 where there
    is none, as newer NumPyro does itself (its `block` draws the key, its `log_density`
    supplies key 0); NumPyro 0.15 did neither, and the edge was drawn with no key."""

    def process_message(self, msg: dict) -> None:
        wants_key = (msg["type"] == "control_flow"
                     or msg["type"] == "sample" and self.hide_fn(msg))
        if (wants_key and msg["value"] is None and "rng_key" in msg["kwargs"]
                and msg["kwargs"]["rng_key"] is None):
            key = numpyro.prng_key()  # this handler is on the stack: no warning
            msg["kwargs"]["rng_key"] = jax.random.PRNGKey(0) if key is None else key
        super().process_message(msg)


def _no_guide(*args: Any, **kwargs: Any) -> None:
    """The guide of a model without latent sample sites (only `numpyro.param`)."""
    return None


def _guide(guide: str | Callable, model: Callable, info: ModelInfo) -> Callable:
    if callable(guide):
        return guide
    if guide not in ("normal", "delta"):
        raise ValueError(f"svi: guide must be 'normal', 'delta' or a callable, got {guide!r}")
    if not info.latent:
        return _no_guide
    return (AutoNormal if guide == "normal" else AutoDelta)(hide_edges(model))


def svi(
    rng_key: jax.Array,
    model: Callable,
    *model_args: Any,
    guide: str | Callable = "normal",
    optim: Any = None,
    num_steps: int = 1000,
    progress_bar: bool = True,
    **model_kwargs: Any,
) -> tuple[SVI, SVIRunResult]:
    r"""SVI with the edges collapsed: NumPyro's `SVI`, with `TraceEnum_ELBO` where it is exact.

    Maximises
    $\mathcal L(\lambda) = \mathbb E_{q_\lambda(\theta)}\big[\log p(\theta)
    + \log \sum_\phi p(x, \phi \mid \theta) - \log q_\lambda(\theta)\big]$;
    with a point-mass guide (`"delta"`) or only `numpyro.param` sites this is MAP /
    maximum likelihood of the parameters with the edges collapsed. A model with a
    [`Markov`][structinfer.priors.Markov] edge (a chain in a ``scan``), which
    `TraceEnum_ELBO` does not contract exactly (it sums the scan's time dim like a
    plate), or any other site in a ``scan`` step (an edge there gave a wrong ELBO, a
    latent site NumPyro's ``KeyError``), takes $\log \sum_\phi p(x, \phi, \theta)$ from the exact engine
    ([`log_marginal`][structinfer.exact.log_marginal]) at each draw of the guide instead,
    as does every model where the installed NumPyro's `TraceEnum_ELBO` cannot trace a
    model's dependencies on the installed JAX (NumPyro 0.15.0 and 0.15.1 on JAX 0.4.31 and
    newer, NumPyro 0.21 and older on JAX 0.11.1 and newer): the same ELBO, for guides
    whose sites are all reparameterized.

    Args:
        rng_key: one PRNG key (`jax.random.key(seed)`), as for `SVI.run`.
        model: the model; parameters as `numpyro.param` or sample sites.
        *model_args: the model's positional arguments (the data).
        guide: `"normal"` (`AutoNormal`), `"delta"` (`AutoDelta`), both built on
            [`hide_edges`][structinfer.infer.hide_edges]`(model)`, or a guide callable
            that does not sample the edge sites. A model with no latent sample site
            gets an empty guide.
        optim: a `numpyro.optim` optimiser or an optax transformation (default
            `numpyro.optim.Adam(0.01)`).
        num_steps: optimisation steps.
        progress_bar: show NumPyro's progress bar.
        **model_kwargs: the model's keyword arguments.

    Returns:
        `(svi, result)`: the `numpyro.infer.SVI` object (its `guide`, `get_params`) and
        its `SVIRunResult` (`params`, `state`, `losses`: the negative ELBO at each step).

    Raises:
        NonFiniteEnergyError: the loss became NaN or infinite, or NumPyro found no
            initial point with a finite loss (NaN data, say); the message names the
            step and the parameter, argument or site responsible (NumPyro's own
            RuntimeError where no initial point was found and none is responsible; the
            model's own exception where it raises at a starting point).
        TypeError: `rng_key` is not one PRNG key, `model` is not callable, or a
            bfloat16 parameter under NumPyro's `Adam` / `ClippedAdam` (which cannot move
            it: its ``b2 = 0.999`` rounds to 1).
        ValueError: an unknown guide name, a bad `num_steps`, a discrete latent site
            that is not enumerated, or (where the ELBO comes from the exact engine, above)
            a guide site without a reparameterized sampler.

    Reference: NumPyro's `SVI` with `TraceEnum_ELBO` (edges summed out exactly);
    learning $W_Q, W_K, W_V$ of Singh & Buckley Table 1 by maximising the collapsed
    evidence.
    """
    rng_key = check_key(rng_key, "svi")
    num_steps = check_count(num_steps, "svi: num_steps")
    args, kwargs = as_arrays(model_args, model_kwargs)
    info = _sampled_sites(model, args, kwargs, "svi")
    guide = _guide(guide, model, info)
    optim = numpyro.optim.Adam(0.01) if optim is None else optim
    # the exact engine's log p(theta, x) for a chain in a scan and for any other site in a
    # scan's steps (TraceEnum_ELBO's is wrong there, or it fails), and where NumPyro's
    # TraceEnum_ELBO cannot trace dependencies on this JAX
    if info.markov_edges or _in_scan(info) or not _numpyro_traces_dependencies():
        elbo = _CollapsedELBO()
    else:
        elbo = _ELBO(max_plate_nesting=info.max_plate_nesting)
    fitter = SVI(model, guide, optim, elbo)
    with _init_failure("svi", model, args, kwargs):
        state = fitter.init(rng_key, *args, **kwargs)
        _check_adam_dtypes(optim, fitter.optim.get_params(state.optim_state))
        result = fitter.run(rng_key, num_steps, *args, progress_bar=progress_bar,
                            init_state=state, **kwargs)
    losses = np.asarray(result.losses)
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
        _raise_nonfinite(fitter, rng_key, int(bad[0]), args, kwargs)
    return fitter, result


def _in_scan(info: ModelInfo) -> bool:
    """Whether a sample site of the model is in the steps of a
    ``numpyro.contrib.control_flow.scan``: NumPyro's `TraceEnum_ELBO` does not handle such
    a model (on NumPyro 0.22: an edge in the step gave a finite wrong ELBO; a latent site
    there a ``KeyError`` naming a plate of the step, or a broadcasting error between the
    time steps and the step's own shape)."""
    return any(site["type"] == "sample" and SCAN_INDEX_KEY in (site.get("infer") or {})
               for site in info.trace.values())


def _check_adam_dtypes(optim: Any, params: dict) -> None:
    """Refuse a bfloat16 parameter under NumPyro's ``Adam`` / ``ClippedAdam`` (JAX's
    ``example_libraries`` Adam): it casts ``b2 = 0.999`` to the parameter's dtype, 1 in
    bfloat16, so its bias correction divides by 0 and the parameter never moves."""
    if not isinstance(optim, (numpyro.optim.Adam, numpyro.optim.ClippedAdam)):
        return
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        if jnp.asarray(p).dtype == jnp.bfloat16:
            # 'mu', or 'nn$params'['w'] in a module's parameters
            name = f"'{path[0].key}'{jax.tree_util.keystr(path[1:])}"
            raise TypeError(
                f"svi: parameter {name} is bfloat16, which NumPyro's {type(optim).__name__} "
                "cannot update (it rounds b2 = 0.999 to 1 in bfloat16: every step is 0); "
                "keep the parameters in float32 (compute in bfloat16 inside the model), or "
                "pass another optimiser (an optax one, numpyro.optim.SGD)")


@contextlib.contextmanager
def _init_failure(what: str, model: Callable, args: tuple, kwargs: dict):
    """Name the argument or site behind NumPyro's "Cannot find valid initial parameters"
    (NaN data, say), where one is found (the continuous latents at a starting point in
    their supports); the model's own exception where it raises there (an error in the
    model, not in the data); NumPyro's error otherwise."""
    try:
        yield
    except RuntimeError as err:
        if "Cannot find valid initial parameters" not in str(err):
            raise
        try:
            site = start_failure(model, args, kwargs)
        except Exception as model_err:  # noqa: BLE001 - the model's own error is the cause
            raise model_err from err
        if site is None:
            raise
        raise NonFiniteEnergyError(
            f"{what}: no initial point has a finite log density (NumPyro: {err}); "
            f"responsible: {site}. Check the data for NaN/inf, or give forbidden edges a "
            "Restricted prior instead of -inf scores.", 0, site, ()) from err


def _numpyro_traces_dependencies() -> bool:
    """Whether NumPyro's `eval_provenance`, which `TraceEnum_ELBO` runs on every model to
    find each site's dependencies, traces a function that closes over an array on the
    installed JAX. Two pairings fail: NumPyro 0.15.0 and 0.15.1 on JAX 0.4.31 and newer
    (``KeyError: 'provenance'``: it reads the named shapes JAX removed) and NumPyro 0.21 and
    older on JAX 0.11.1 and newer (``AssertionError: length mismatch``: JAX moved closed-over
    constants into the jaxpr's inputs). `svi` then takes its ELBO from the exact engine."""
    from numpyro.ops import provenance

    closed_over = jnp.arange(2.0)
    try:
        provenance.eval_provenance(lambda z: jnp.sum(closed_over * z), z=jnp.ones(()))
    except (AssertionError, KeyError):  # the two failures above
        return False
    return True


def _raise_nonfinite(fitter: SVI, rng_key: jax.Array, step: int, args: tuple,
                     kwargs: dict) -> None:
    """Name the parameter or site whose loss became non-finite after `step` updates
    (the run is replayed, compiled, up to that step; then the model runs eagerly)."""
    if step == 0:
        state = fitter.init(rng_key, *args, **kwargs)
    else:
        state = fitter.run(rng_key, step, *args, progress_bar=False, **kwargs).state
    params = fitter.get_params(state)
    site = bad_leaf(params)
    if site:
        site = f"parameter {site}"
    else:
        values = dict(params)
        if hasattr(fitter.guide, "median"):
            values.update(fitter.guide.median(params))
        site = nonfinite_site(substitute(fitter.model, data=values), *args, **kwargs)
    where = "at the initial parameters" if step == 0 else f"at step {step}"
    msg = f"svi: the loss (negative ELBO) became non-finite {where}"
    if site:
        msg += f"; responsible site: {site}"
    msg += (
        ". Lower the step size, check the data for NaN/inf, or give forbidden edges a "
        "Restricted prior instead of -inf scores."
    )
    raise NonFiniteEnergyError(msg, step, site, ())


def conditional_edge(name: str, prior: Any, score: Any, **kwargs: Any) -> jax.Array:
    r"""An edge distributed as its posterior given the scores (attention as a conditional model).

    $$\log p(\phi_i = j \mid x) = \log p(\phi_i = j) + s_{ij}
        - \log \sum_{j'} p(\phi_i = j') e^{s_{ij'}}.$$

    It is `structinfer.edge` without the row-normaliser factor
    `name + ".score"` ($\mathrm{logsumexp}_j(\log p + s)$, which `edge` adds beside its
    normalised distribution; `numpyro.handlers.block` hides it), so the exact engine and
    `TraceEnum_ELBO` see the edge's normalised posterior table, computed once by `edge`
    for every prior, plate and `child=` form. Use it when the edge feeds an
    observed site ($y \sim \mathcal N(v_\phi, \sigma)$) and $W_Q, W_K$ are learned:
    without the normaliser the unnormalised scores make the likelihood unbounded in
    $W_Q, W_K$.

    Args:
        name: the edge site's name.
        prior: the structural prior, as in `structinfer.edge`.
        score: the score (required), as in `structinfer.edge`.
        **kwargs: passed to `structinfer.edge`.

    Returns:
        The edge's value (enumerated under the exact engine and `TraceEnum_ELBO`).

    Raises:
        ValueError: `score` is None.

    Reference: the edge posterior as attention, Singh & Buckley sec. 3.1 eq. 1:
    $p(\phi_i = j \mid x) = \mathrm{softmax}_j(\psi_{ij} + \log p_{ij})$.
    """
    if score is None:
        raise ValueError(f"conditional_edge('{name}'): a score is required")
    with block(hide=[name + SCORE_SUFFIX]):
        return edge(name, prior, score, **kwargs)
