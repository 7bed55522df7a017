r"""One contraction: [`log_z`][structinfer.exact.log_z] sums the enumerated sites out of a model.

$$\log Z = \log \sum_\phi p(x, \phi)$$

is NumPyro's own funsor contraction (``numpyro.contrib.funsor.log_density`` under
``enum``: variable elimination, plates multiplied out). With ``keep_plates`` the
plates of the observations are *kept* instead, giving one term per element
$e$ (child, or batch element and child):

$$\ell_e = \log \sum_{\phi_e} \prod_{s \in e} p_s, \qquad
\textstyle\sum_e \ell_e = \log p(x \mid \theta),$$

the product running over the enumerated, observed and factor sites inside the kept
plates (plates nested inside them, e.g. heads, are multiplied out first); the prior
of the valued latent sites $\theta$ is left out (it is not per element). This
is the pointwise log-likelihood of Vehtari, Gelman & Gabry (2017) with the edges
collapsed; every other function of the engine is a gradient of the scalar form.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Literal, NamedTuple

import funsor
import funsor.cnf
import funsor.optimizer
import jax
import jax.numpy as jnp
from numpyro.contrib.funsor import enum, plate_to_enum_plate
from numpyro.contrib.funsor import log_density as funsor_log_density
from numpyro.contrib.funsor import trace as packed_trace
from numpyro.contrib.funsor.infer_util import compute_markov_factors

from .._checks import as_arrays, model_name
from ..handlers import contain, name_plate_dims, observe_given, require_values, tilt
from ..primitives import SCAN_RECORD_KEY, user_site_name
from ._log_einsum import zero_slope_at_log0
from .inspect import ModelInfo, inspect_model

__all__ = [
    "log_z",
    "safe_log_einsum",
    "chain_factors",
    "ChainFactors",
    "NotAChainError",
    "LikelihoodStructure",
    "EnergyOnlyModelError",
]

#: how potentials inside the kept plates are read (see `log_z`)
ScoreFactors = Literal["error", "normalize"]
#: the semiring of the scalar contraction (see `log_z`)
Semiring = Literal["sum", "max"]


class EnergyOnlyModelError(ValueError):
    r"""The model defines an energy, not a normalised density of observed data.

    Leave-one-out and every other predictive-density comparison need
    $p(x_i \mid \theta)$; a model made of factor potentials only (or whose
    observation term includes unnormalised potentials) does not define it.
    """


class LikelihoodStructure(NamedTuple):
    """What [`log_z`][structinfer.exact.log_z] with kept plates returns one entry for (static facts).

    Attributes:
        name: variable name in the ``log_likelihood`` group (the observed site, or the
            observed sites joined with ``"+"`` when several share the edges).
        observed: the observed sample sites whose densities are collapsed.
        plates: pointwise dims: the kept plates, outermost first.
        shape: sizes of those plates.
        conditional_factors: factor sites treated as conditional potentials
            (``score_factors="normalize"``).
    """

    name: str
    observed: tuple[str, ...]
    plates: tuple[str, ...]
    shape: tuple[int, ...]
    conditional_factors: tuple[str, ...]


def log_z(
    model: Callable,
    args: tuple = (),
    kwargs: Mapping | None = None,
    *,
    info: ModelInfo | None = None,
    tilts: Mapping[str, tuple[jax.Array, int]] | None = None,
    keep_plates: Sequence[str] | Literal["observed"] | None = None,
    score_factors: ScoreFactors = "error",
    return_structure: bool = False,
    semiring: Semiring = "sum",
) -> jax.Array | tuple[jax.Array, LikelihoodStructure | None]:
    r"""The engine's one contraction: $\log \sum_\phi p(x, \phi)$, or its terms per element.

    Args:
        model: a NumPyro model; its continuous latent sites must have values
            (``numpyro.handlers.substitute``).
        args: the model's positional arguments (NumPy arrays become JAX arrays).
        kwargs: the model's keyword arguments.
        info: the model's [`ModelInfo`][structinfer.exact.ModelInfo] when the caller has
            it (saves the inspection pass); read from the model otherwise.
        tilts: ``{site: (t, event_dim)}`` zero tilts ([`tilt`][structinfer.handlers.tilt]):
            the gradient of the result with respect to ``t`` is a marginal or an
            expectation. Scalar form only.
        keep_plates: ``None`` (default): the scalar $\log Z$, NumPyro's
            ``numpyro.contrib.funsor.log_density``. ``"observed"``: keep the plates every
            observed site shares (the pointwise log-likelihood); or a sequence of plate
            names to keep (each must hold every observed and enumerated site). The
            result then has one entry per element of the kept plates, outermost first:
            $\ell_e = \log\sum_{\phi_e}\prod_{s\in e} p_s$ over the enumerated, observed
            and factor sites (valued latent sites are left out).
        score_factors: with kept plates, what to do with factor potentials
            $\psi$ inside them (e.g. the ``"<edge>.score"`` normalisers of
            [`edge`][structinfer.edge]): ``"error"`` refuses them
            ([`EnergyOnlyModelError`][structinfer.exact.EnergyOnlyModelError]);
            ``"normalize"`` reads them as a conditional
            prior over the edges given the inputs,
            $\ell_e = \log\sum_{\phi_e} p(\phi_e)e^{\psi_e}p(x_e\mid\phi_e) - \log\sum_{\phi_e} p(\phi_e)e^{\psi_e}$.
        return_structure: also return the
            [`LikelihoodStructure`][structinfer.exact.LikelihoodStructure] of the kept
            terms (``None`` for the scalar form).
        semiring: ``"sum"`` (default): $\log\sum_\phi$; ``"max"``: the max-product
            contraction $\max_\phi \log p(x, \phi)$ (scalar form only), whose gradient
            with respect to zero tilts is the indicator of the most probable structure
            (Viterbi on a [`Markov`][structinfer.priors.Markov] chain).

    Returns:
        A scalar, or an array shaped like the kept plates (``(children,)``,
            ``(batch, children)``); ``(value, structure)`` with ``return_structure``.
            Jittable and differentiable, float32 and float64. The derivatives are exact
            with ``-inf`` priors, scores, factors and forbidden Markov moves too (a
            product of factors that leaves a pair of states unconnected is
            $\log 0 = -\infty$ with a zero derivative, not NaN). Where the result is
            $-\infty$ (no structure is possible: the model, or one kept element) its
            derivatives are NaN (a model with one edge site: in the rows of the children
            with no allowed parent), never a number.

    Raises:
        ValueError: a latent site has no value; a tensor dim is left over after the
            contraction (a factor mixing enumeration and plate dims); with kept plates,
            a site couples the kept elements (an enumerated site or a factor on the
            edges outside the kept plates, a ``markov`` dim), or no plate is shared.
        EnergyOnlyModelError: with kept plates, no normalised observed site, or
            unnormalised factors and ``score_factors="error"``.

    Reference:
        NumPyro's funsor ``log_density`` (``contrib/funsor/infer_util.py``); funsor's
        ``sum_product`` with the kept plates left free for the pointwise terms.
    """
    args, kwargs = as_arrays(args, dict(kwargs or {}))
    if info is None:
        info = inspect_model(model, *args, **kwargs)
    if semiring not in ("sum", "max"):
        raise ValueError(f"semiring must be 'sum' or 'max', got {semiring!r}")
    if keep_plates is None:
        lz = _scalar(model, args, kwargs, info, tilts, semiring).astype(info.float_dtype)
        return (lz, None) if return_structure else lz
    if semiring != "sum":
        raise ValueError("log_z: the max semiring has no pointwise form (keep_plates=None)")
    if tilts:
        raise ValueError(
            "log_z: tilts and keep_plates cannot be combined; take marginals from the "
            "scalar form"
        )
    if score_factors not in ("error", "normalize"):
        raise ValueError(f"score_factors must be 'error' or 'normalize', got {score_factors!r}")
    data, struct = _kept(model, args, kwargs, info, keep_plates, score_factors)
    data = data.astype(info.float_dtype)  # the model's dtype (see ModelInfo.float_dtype)
    return (data, struct) if return_structure else data


def _scalar(model, args, kwargs, info: ModelInfo, tilts, semiring: Semiring) -> jax.Array:
    m = require_values(observe_given(model))
    if tilts:
        m = tilt(m, tilts=dict(tilts), max_plate_nesting=info.max_plate_nesting)
    m = enum(m, first_available_dim=info.first_available_dim)
    try:
        if semiring == "sum":
            with contain(enumerates=model_name(model)), _einsum_for(info):
                lp, _ = funsor_log_density(name_plate_dims(m), args, kwargs, {})
            lp = _slope_for(info, lp)
        else:
            lp = _max_product(m, args, kwargs, model_name(model))
    except ValueError as e:
        if "joint log density is a scalar" not in str(e):
            raise
        raise ValueError(
            f"model '{model_name(model)}': after collapsing the edges a tensor dim was left "
            "over, so some factor or value mixes enumeration dims with plate dims. Typical "
            "causes: indexing one edge variable with another (follow a chain with "
            "si.edge(..., child=j) instead), summing over a plate dim inside the model, or "
            "indexing batched tables without Vindex/si.gather"
            + (", or a value or factor read off a scan's carry or stacked outputs after the "
               "scan (a Markov chain's edges: record the value inside the scan's step)"
               if info.markov_edges else "")
            + "".join(f"; {u}" for u in _unplated_sites(info))
            + f". (funsor: {str(e).splitlines()[0]})"
        ) from None
    return jnp.asarray(lp)  # a model with no factor at all: funsor's Python 0.0, log 1


def _unplated_sites(info: ModelInfo) -> list[str]:
    """A sentence for each sample or factor site with a batch dim (size > 1) that no plate
    around it declares: enumeration reads such a dim as left over (NumPyro's plain
    ``log_density`` would sum it silently). A site recorded by NumPyro's ``scan`` is not
    one: the scan gives it its time dim."""
    found = []
    for name, s in info.records.items():
        if s.role in ("deterministic", "param") or info.trace[name].get(SCAN_RECORD_KEY):
            continue
        batch = s.shape if s.role == "factor" else s.shape[:len(s.shape) - s.event_dim]
        dims = {info.plates[p][0] for p in s.plates if p in info.plates}
        free = [-i for i in range(1, len(batch) + 1) if batch[-i] > 1 and -i not in dims]
        if free:
            found.append(
                f"site '{name}' has batch shape {tuple(batch)} with no plate at dim "
                f"{', '.join(map(str, sorted(free)))} (declare a plate for each batch dim, "
                "or make them event dims with .to_event())")
    return found


#: the log-space einsum of the engine's sum-product (the module `_log_einsum.py` beside this one)
_LOG_EINSUM = __name__.rpartition(".")[0] + "._log_einsum"


@contextlib.contextmanager
def _log_space_einsum(zero_slope: bool) -> Iterator[None]:
    """funsor's log-space contractions by this package's einsum (`_log_einsum.py`: jointly
    shifted), differentiating log 0 to zero (``zero_slope``) or as funsor does, inside the
    block. funsor reads the einsum of a `logaddexp` / `add` contraction of two tensors by
    name from `funsor.cnf.BACKEND_TO_LOGSUMEXP_BACKEND` when the contraction is evaluated
    (for JAX: when it is traced), and offers no parameter for it on the path NumPyro's
    `log_density` takes (`sum_product`, then `apply_optimizer`): the entry is set for the
    block and restored after (nested blocks restore in order)."""
    table = funsor.cnf.BACKEND_TO_LOGSUMEXP_BACKEND
    saved = table["jax"]
    table["jax"] = _LOG_EINSUM
    try:
        with zero_slope_at_log0(zero_slope):
            yield
    finally:
        table["jax"] = saved


@contextlib.contextmanager
def safe_log_einsum() -> Iterator[None]:
    r"""funsor's log-space contractions inside the block, with $\log 0$ differentiated to 0.

    A sum with no non-zero term, $\log \sum_j e^{a_{ij} + b_{jk}} = \log 0$ (a pair of
    states that a product of factors leaves unconnected: the forbidden moves of a chain,
    two restricted hops that a later factor restricts again), is $-\infty$ with a zero
    derivative instead of NaN, so every gradient of $\log Z$ (marginals, expectations)
    stays exact with $-\infty$ priors, scores and factors. The zero derivative is the
    tangent times 0, so a NaN cotangent (that of a $\log Z = -\infty$, which `log_z`
    makes NaN) passes through. Where the factors' broadcast is small (an edge's score,
    prior and likelihood over (child, parent), at any size; a product of factors over
    several sites, such as a chain's steps, of at most 2^20 elements) their sum is
    shifted by its own maximum, so that factors which disagree by more than the dtype's
    exponent range about which value is likely do not underflow; elsewhere (a larger
    product) each factor is shifted by its own, as funsor does, and the sum can
    underflow (the einsum is in `_log_einsum.py`, this package's own module).

    This and the einsum of a model with one enumerated site (`log_z` selects) are the
    one place that set it: funsor reads the einsum by name from
    `funsor.cnf.BACKEND_TO_LOGSUMEXP_BACKEND` when a contraction is traced, so the
    entry is set for the block and restored after (nested blocks restore in order).
    Like funsor's own interpretation stack, the setting is process-wide for the block:
    contract in one thread at a time.

    Yields:
        Nothing: the block runs with the einsum in place. structinfer's contractions
            ([`log_z`][structinfer.exact.log_z], `structinfer.infer.NUTS`,
            [`svi`][structinfer.infer.svi]) enter it themselves; enter it around NumPyro's
            own objects (`mcmc.run`, `svi.run`) for their gradients.
    """
    with _log_space_einsum(zero_slope=True):
        yield


def _einsum_for(info: ModelInfo):
    r"""The log-space einsum of a model's contraction: this package's (jointly shifted
    where the factors' broadcast is small, see `_log_einsum.py`) for every model, with
    $\log 0$ differentiated to zero for a model whose contraction couples enumerated
    sites (`ModelInfo.couples_enumerated`, the safe einsum) and as funsor does ($1/0$)
    for one site, whose sums are the children's rows, so that a row with no allowed
    parent stays NaN in its own derivatives (funsor's 0 / 0) rather than reading as zeros.

    Why not the zero slope for every model: a derivative rule is linear in the
    cotangent (which is what lets ``jax.hessian`` of ``log_marginal`` run), so at an
    entry $\log 0$ it maps a zero cotangent and a non-zero one alike, $c \cdot g$: it
    cannot tell an inner sum that a finite $\log Z$ weighs by $e^{-\infty} = 0$ (derivative
    0) from a child's row whose $-\infty$ enters the plates' sum (derivative NaN, in that
    row only). The zero slope answers 0 for both, and its result's NaN derivatives
    (`_slope_for`) are the whole answer's; funsor's answers $0 \cdot \infty$ = NaN for
    both, which for one edge site is exactly the row's."""
    return _log_space_einsum(zero_slope=info.couples_enumerated)


@jax.custom_jvp
def _no_slope_at_neg_inf(x: jax.Array) -> jax.Array:
    r"""$x$, whose derivatives are NaN where $x = -\infty$ (elementwise).

    The safe einsum differentiates $\log 0$ to zero, which is exact where the sum feeds a
    finite $\log Z$ (its weight there is $e^{-\infty} = 0$) but would read as zero
    derivatives of a $\log Z = -\infty$ (no structure), whose derivatives are $0 \cdot
    \infty$: undefined. Applied to the contraction's result, this makes every derivative
    that flows through such an entry NaN, to any order (the factor is read off the value,
    so the rule is linear in the tangent: forward and reverse mode, ``jax.hessian``)."""
    return x


@_no_slope_at_neg_inf.defjvp
def _no_slope_at_neg_inf_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return x, t * jnp.where(jnp.isneginf(x), jnp.nan, 1.0).astype(t.dtype)


def _slope_for(info: ModelInfo, lp: jax.Array) -> jax.Array:
    r"""``lp`` (a contraction's result) with NaN derivatives where it is -inf, for a model
    whose contraction cannot show them itself; as it is otherwise. Those are a model
    contracted with the safe einsum (`_einsum_for`), and one with a site of a single
    value (an edge with one parent), which no sum reduces: a child whose one parent is
    forbidden enters $\log Z$ as a $-\infty$ term with slope 1, not funsor's 0 / 0. A
    16-bit result is left alone: its sum over many children can overflow to -inf while
    every child is possible."""
    wide = jnp.finfo(jnp.result_type(lp)).maxexp >= jnp.finfo(jnp.float32).maxexp
    unsummed = any(k == 1 for _, k in info.enumerated.values())
    mark = (info.couples_enumerated or unsummed) and wide
    return _no_slope_at_neg_inf(lp) if mark else lp


def _scaled_log_probs(tr):
    """Each sample site of a trace with its log-density times its scale."""
    for s in tr.values():
        if s["type"] == "sample":
            lp = s["fn"].log_prob(s["value"])
            yield s, (lp if s["scale"] is None else s["scale"] * lp)


def _max_product(m, args, kwargs, name: str) -> jax.Array:
    r"""$\max_\phi \log p(x, \phi)$ of an enumerated model: NumPyro's contraction of
    ``log_density`` with ``max`` for ``logaddexp``, a scan's time dims contracted by
    funsor's parallel-scan ``sequential_sum_product`` (``compute_markov_factors``)."""
    with contain(enumerates=name), plate_to_enum_plate():
        tr = packed_trace(name_plate_dims(m)).get_trace(*args, **kwargs)
    factors, by_time = [], defaultdict(list)
    init_vars: dict = defaultdict(frozenset)
    sum_vars, prod_vars = frozenset(), frozenset()
    for s, lp in _scaled_log_probs(tr):
        names = s["infer"]["dim_to_name"]
        if not names and all(d == 1 for d in jnp.shape(lp)):
            lp = jnp.squeeze(lp)
        f = funsor.to_funsor(lp, output=funsor.Real, dim_to_name=names)
        time = next(((d, n) for d, n in names.items() if n.startswith("_time")), None)
        if time is None:
            factors.append(f)
        else:
            var = funsor.Variable(time[1], funsor.Bint[jnp.shape(lp)[time[0]]])
            by_time[var].append(f)
            init_vars[var] |= frozenset(n for n in names.values() if n.startswith("_PREV_"))
        if not s["is_observed"]:
            sum_vars |= frozenset({s["name"]})
        prod_vars |= frozenset(f.name for f in s["cond_indep_stack"] if f.dim is not None)
    markov_dims: dict = defaultdict(frozenset)
    for var, prevs in init_vars.items():
        for prev in prevs:  # the dims of the site a _PREV_ variable is the previous step of
            names = tr[prev.replace("_PREV_", "")]["infer"]["dim_to_name"].values()
            if prev in names:
                markov_dims[var] |= frozenset(names)
    if by_time:
        factors += compute_markov_factors(by_time, init_vars, markov_dims, sum_vars,
                                          prod_vars, 1, funsor.ops.max, funsor.ops.add)
    with funsor.interpretations.lazy:
        lazy = funsor.sum_product.sum_product(funsor.ops.max, funsor.ops.add, factors,
                                              eliminate=sum_vars | prod_vars, plates=prod_vars)
    result = funsor.optimizer.apply_optimizer(lazy)
    if result.inputs:
        raise ValueError("joint log density is a scalar: the max-product left "
                         f"{sorted(result.inputs)} over")
    return result.data


class NotAChainError(ValueError):
    """The model is not one unbatched chain of a [`Markov`][structinfer.priors.Markov] edge.

    Raised by [`chain_factors`][structinfer.exact.chain_factors]; the message names the
    site and what does not fit.
    """


class ChainFactors(NamedTuple):
    r"""The log-factors of a chain of Markov edges, read off the enumerated model.

    $$\log p(x, \phi) = c + a(\phi_0) + \sum_{t=1}^{T-1} \psi_t(\phi_{t-1}, \phi_t)$$

    Attributes:
        site: the Markov edge site.
        initial: $a$, ``(K,)``: every factor of the first step (its prior row, score,
            likelihood and potentials on $\phi_0$).
        pair: $\psi_t$, ``(T - 1, K, K)`` (previous, next): every factor of step $t$.
        constant: $c$, the factors on no edge (a scalar).
        reads: site name -> the chain's variables its factor reads (``"previous"``,
            ``"next"``), for the sites of the scan's steps.
    """

    site: str
    initial: jax.Array
    pair: jax.Array
    constant: jax.Array
    reads: dict


def _place(lp, names: dict, target: tuple[str, ...], where: str):
    """``lp`` with its named dims moved to the order of ``target`` (size 1 where absent)."""
    lp = jnp.asarray(lp)
    nd = lp.ndim
    axes = {n: nd + d for d, n in names.items()}
    order = [axes[n] for n in target if n in axes]
    rest = [a for a in range(nd) if a not in order]
    if any(lp.shape[a] != 1 for a in rest):
        raise NotAChainError(f"{where}: its log-density has dims {tuple(lp.shape)} that are not "
                             "the chain's (a plate or a second variable)")
    x = jnp.transpose(lp, rest + order)
    return x.reshape(tuple(lp.shape[axes[n]] if n in axes else 1 for n in target))


def chain_factors(model: Callable, args: tuple = (), kwargs: Mapping | None = None, *,
                  info: ModelInfo | None = None) -> ChainFactors:
    r"""The log-factors of a model whose only edge is one chain of a Markov prior.

    The model is enumerated as [`log_z`][structinfer.exact.log_z] enumerates it (NumPyro's
    funsor trace of the ``scan``: the first step unrolled, the others stacked on a time
    dim) and every factor is read on the chain's variables, so that

    $$\log Z = c + \log \sum_{\phi} e^{a(\phi_0) + \sum_t \psi_t(\phi_{t-1}, \phi_t)},$$

    the sum a forward algorithm over $T$ steps of $K$ states computes in $O(T K^2)$.

    Args:
        model: a NumPyro model whose one enumerated site is an edge with a
            [`Markov`][structinfer.priors.Markov] prior inside a ``scan``, outside any
            plate.
        args: the model's positional arguments.
        kwargs: the model's keyword arguments.
        info: the model's [`ModelInfo`][structinfer.exact.ModelInfo] when the caller has it.

    Returns:
        The [`ChainFactors`][structinfer.exact.ChainFactors], in the model's dtype.

    Raises:
        NotAChainError: the model has another enumerated site, the chain lies under a
            plate, or a factor reads something else than the chain's variables (the
            message names the site).

    Reference:
        Obermeyer et al., "Tensor variable elimination for plated factor graphs" (2019):
        the enumerated factors NumPyro's funsor backend builds; Rabiner (1989) for the
        forward algorithm they feed.
    """
    args, kwargs = as_arrays(args, dict(kwargs or {}))
    if info is None:
        info = inspect_model(model, *args, **kwargs)
    names = list(info.enumerated)
    edge = info[names[0]].edge if len(names) == 1 else None
    if edge is None or not edge.markov:
        raise NotAChainError(f"model '{model_name(model)}': enumerated sites {names}: only a "
                             "model whose one enumerated site is a Markov edge is one chain")
    site = names[0]
    batch, k = info.enumerated[site]
    if len(batch) != 1:
        raise NotAChainError(f"edge site '{site}': the chain lies under a plate (shape "
                             f"{tuple(batch)}): only a single chain is read as one")
    steps = batch[0]
    m = enum(require_values(observe_given(model)), first_available_dim=info.first_available_dim)
    with contain(enumerates=model_name(model)), plate_to_enum_plate():
        tr = packed_trace(name_plate_dims(m)).get_trace(*args, **kwargs)
    prev = "_PREV_" + site
    dtype = info.float_dtype
    initial = jnp.zeros((k,), dtype)
    pair = jnp.zeros((steps - 1, k, k), dtype)
    constant = jnp.zeros((), dtype)
    reads: dict = {}
    for s, lp in _scaled_log_probs(tr):
        lp = jnp.asarray(lp).astype(dtype)
        dims = dict(s["infer"].get("dim_to_name", {}))
        where = f"site '{user_site_name(s['name'])}'"
        time = [n for n in dims.values() if n.startswith("_time")]
        chain = {n for n in dims.values() if n in (prev, site)}
        if set(dims.values()) - chain - set(time):
            raise NotAChainError(f"{where}: its factor reads "
                                 f"{sorted({user_site_name(n) for n in dims.values() if n not in time})}, not only "
                                 f"the chain of '{site}'")
        if not chain:
            constant = constant + jnp.sum(lp)
            continue
        # the scanned steps' sites carry the time dim, unless there is one such step (a
        # 2-step chain: NumPyro leaves a size-1 dim unnamed); the first step's are _PREV_
        if time or (steps == 2 and not s["name"].startswith("_PREV_")):
            reads[s["name"]] = tuple(r for n, r in ((prev, "previous"), (site, "next"))
                                     if n in chain)
            pair = pair + _place(lp, dims, (time[0] if time else "", prev, site), where)
        elif site in chain:  # pragma: no cover - the first step names its edge _PREV_
            raise NotAChainError(f"{where}: reads the chain outside its time steps")
        else:
            reads[s["name"]] = ("next",)
            initial = initial + _place(lp, dims, (prev,), where)
    return ChainFactors(site, initial, pair, constant, reads)


def _energy_only(model, reason: str) -> EnergyOnlyModelError:
    return EnergyOnlyModelError(
        f"model '{model_name(model)}' {reason}, so it defines an energy, not a normalised "
        "density p(x_i | theta) of observed data, and cannot be compared by predictive "
        "density (LOO)"
    )


def _frames(site) -> dict[str, tuple[int, int]]:
    """``{plate name: (dim, size)}`` of the plates around a site of the enumerated trace."""
    return {
        f.name: (f.dim, f.size) for f in site.get("cond_indep_stack", []) or [] if f.dim is not None
    }


def _kept(model, args, kwargs, info: ModelInfo, keep_plates, score_factors: ScoreFactors):
    """Per-element log-likelihood over the kept plates and its `LikelihoodStructure`."""
    em = enum(
        require_values(observe_given(model), what="the pointwise log-likelihood"),
        first_available_dim=info.first_available_dim,
    )
    with contain(enumerates=model_name(model)), plate_to_enum_plate():
        tr = packed_trace(name_plate_dims(em)).get_trace(*args, **kwargs)

    sites = [s for s in tr.values() if s["type"] == "sample"]
    for s in sites:
        if any(n.startswith("_time") for n in s["infer"].get("dim_to_name", {}).values()):
            raise ValueError(
                f"model '{model_name(model)}': site '{s['name']}' lies on a Markov chain "
                "(numpyro.contrib.control_flow.scan), which couples the observations of "
                "its time steps, so there is no pointwise log-likelihood (and no "
                "PSIS-LOO); compare such models by their evidence "
                "(structinfer.log_marginal), and read a fit's draws with "
                "arviz_base.from_numpyro"
            )
    role = {s["name"]: info[s["name"]].role for s in sites}
    observed = [s for s in sites if role[s["name"]] == "observed"]
    factors = [s for s in sites if role[s["name"]] == "factor"]
    enumerated = [s for s in sites if role[s["name"]] in ("edge", "enumerated")]
    factor_names = [s["name"] for s in factors]
    if not observed:
        raise _energy_only(
            model,
            f"has no observed sample site (factor sites: {factor_names or 'none'}); write "
            "each child's observation as numpyro.sample(name, distribution, obs=data) inside "
            "the children plate",
        )
    shared = set(_frames(observed[0]))
    for s in observed[1:]:
        shared &= set(_frames(s))
    if keep_plates == "observed":
        keep = shared
        if not keep:
            raise ValueError(
                f"model '{model_name(model)}': the observed site(s) "
                f"{[s['name'] for s in observed]} share no plate, so there is no pointwise "
                "log-likelihood; put each child's observation inside the children plate"
            )
    else:
        if isinstance(keep_plates, str):
            raise TypeError(
                f"keep_plates must be 'observed' or a sequence of plate names, got {keep_plates!r}"
            )
        keep = set(keep_plates)
        unknown = sorted(keep - set(info.plates))
        if unknown:
            raise ValueError(
                f"model '{model_name(model)}': keep_plates names {unknown}, which are not plates "
                f"of the model (plates: {sorted(info.plates)})"
            )
        if not keep:
            raise ValueError("keep_plates is empty; pass None for the scalar log Z")
        for s in observed:
            missing = keep - set(_frames(s))
            if missing:
                raise ValueError(
                    f"model '{model_name(model)}': observed site '{s['name']}' lies outside "
                    f"the kept plate(s) {sorted(missing)}, so its density is not one term per "
                    "kept element"
                )
    for s in enumerated:
        missing = keep - set(_frames(s))
        if missing:
            raise ValueError(
                f"model '{model_name(model)}': enumerated site '{s['name']}' lies outside "
                f"the plate(s) {sorted(missing)} of the observations, so it couples them "
                "and the log-likelihood does not split into one term per element"
            )
    enum_names = {s["name"] for s in enumerated}
    local_factors = []
    for s in factors:
        inside = keep <= set(_frames(s))
        touches_edges = bool(enum_names & set(s["infer"].get("dim_to_name", {}).values()))
        if inside:
            local_factors.append(s)
        elif touches_edges:
            raise ValueError(
                f"model '{model_name(model)}': factor site '{s['name']}' depends on "
                "enumerated sites but lies outside the observations' plates"
            )
    if local_factors and score_factors == "error":
        raise _energy_only(
            model,
            f"adds factor potentials {[s['name'] for s in local_factors]} to its "
            "observations' terms (if they are attention scores over given inputs, pass "
            "score_factors='normalize' to read them as the conditional prior "
            "p(phi_i | inputs) proportional to prior x exp(score))",
        )

    def to_funsor(s):
        lp = s["fn"].log_prob(s["value"])
        if s["scale"] is not None:
            lp = s["scale"] * lp
        return funsor.to_funsor(lp, output=funsor.Real, dim_to_name=s["infer"]["dim_to_name"])

    plate_dims: dict[str, tuple[int, int]] = {}
    for s in observed + enumerated + local_factors:
        plate_dims.update(_frames(s))
    prod_vars = frozenset(plate_dims)
    eliminate = frozenset(enum_names) | (prod_vars - keep)

    def contract(group):
        with funsor.interpretations.lazy:
            lazy = funsor.sum_product.sum_product(
                funsor.ops.logaddexp,
                funsor.ops.add,
                [to_funsor(s) for s in group],
                eliminate=eliminate,
                plates=prod_vars,
            )
        with _einsum_for(info):
            return funsor.optimizer.apply_optimizer(lazy)

    result = contract(enumerated + local_factors + observed)
    if local_factors:
        result = result - contract(enumerated + local_factors)
    keep_sorted = sorted(keep, key=lambda n: plate_dims[n][0])  # outermost (most negative) first
    name_to_dim = {n: plate_dims[n][0] for n in keep_sorted}
    extra = set(result.inputs) - set(keep_sorted)
    if extra:  # pragma: no cover - guarded by the checks above
        raise ValueError(f"pointwise log-likelihood left free variables {sorted(extra)}")
    data = _slope_for(info, funsor.to_data(result, name_to_dim=name_to_dim))
    nd = max(-d for d, _ in plate_dims.values())
    full = [1] * nd
    for n in keep_sorted:
        dim, size = plate_dims[n]
        full[dim] = size
    shape = tuple(plate_dims[n][1] for n in keep_sorted)
    data = jnp.broadcast_to(jnp.reshape(data, (1,) * (nd - jnp.ndim(data)) + jnp.shape(data)), full)
    data = jnp.reshape(data, shape)
    obs_names = tuple(s["name"] for s in observed)
    struct = LikelihoodStructure(
        name="+".join(obs_names),
        observed=obs_names,
        plates=tuple(keep_sorted),
        shape=shape,
        conditional_factors=tuple(s["name"] for s in local_factors),
    )
    return data, struct
