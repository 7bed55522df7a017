r"""The exact engine's user functions: collapse every edge site with funsor.

For a model $p(x, \phi)$ with discrete edge sites $\phi$ (and any
other sites observed or given values):

$$
\log Z = \log \sum_\phi p(x, \phi), \qquad
E = -\log Z, \qquad
p(\phi_i = j \mid x) = \frac{\partial \log Z}{\partial t_{ij}}\Big|_{t=0}, \qquad
\mathbb E[v] = \frac{\partial}{\partial t} \log \sum_\phi p(x,\phi)\, e^{t \cdot v(\phi)}\Big|_{t=0}.
$$

$\log Z$ is the engine's one contraction ([`log_z`][structinfer.exact.log_z], NumPyro's
``numpyro.contrib.funsor`` variable elimination over the plates); marginals and
expectations are one backward pass through it
(torch-struct's "marginals are gradients of the log-partition"); MAP and
posterior samples use funsor's max-product / forward-filter-backward-sample
(``numpyro.contrib.funsor.infer_discrete``).

All functions take the model and its arguments, are jittable (close over the
model) and differentiable, and work in float32 and float64.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import validation_enabled
from numpyro.contrib.funsor import infer_discrete
from numpyro.handlers import substitute, trace

from .._checks import as_arrays, check_key, is_concrete, model_name
from ..handlers import contain, observe_given, pin, replay_outside, require_values
from ..primitives import SCAN_RECORD_KEY
from ._log_einsum import JOINT_MAX_ELEMENTS, JOINT_MAX_RATIO
from .contract import LikelihoodStructure, ScoreFactors, log_z
from .inspect import inspect_model

__all__ = [
    "log_marginal",
    "energy",
    "marginals",
    "expectation",
    "map_edges",
    "sample_edges",
    "pointwise_log_likelihood",
    "likelihood_structure",
]


def log_marginal(model: Callable, *args: Any, **kwargs: Any) -> jax.Array:
    r"""Log marginal likelihood with every edge collapsed, $\log \sum_\phi p(x, \phi)$.

    For attention with a prior table $\log\pi$ and scores $s$ this is
    $\sum_i \mathrm{logsumexp}_j (s_{ij} + \log \pi_{ij})$ — the negative of
    the log-sum-exp energy.

    Args:
        model: a NumPyro model using [`edge`][structinfer.edge] (and/or discrete sites
            marked ``infer={"enumerate": "parallel"}``); continuous latent sites must
            be given values (``numpyro.handlers.substitute``).
        *args: the model's positional arguments.
        **kwargs: the model's keyword arguments.

    Returns:
        The scalar $\log Z$; jittable and differentiable, in the model's dtype.

    Raises:
        ValueError: a latent site has no value, or a tensor dim is left over after the
            contraction (see [`log_z`][structinfer.exact.log_z]); or, on concrete
            inputs, the log-space sum underflowed to $-\infty$ while a structure is
            possible (factors multiplied over several sites that disagree by more than
            the dtype's exponent range, in a product too large to shift jointly: the
            steps of a long Markov chain of many states, about $K^3 B (T-1)/2$ elements
            past $2^{20}$ for $B$ chains of $T$ steps of $K > 4$ states; factors over one
            site, and smaller products, are shifted jointly and do not underflow; the
            message gives the most probable structure's log-weight). Such a product can
            also lose only some of its terms, and then $\log Z$ is finite and too low
            with no error: run those in float64. A model with no possible structure
            answers $-\infty$.

    Reference:
        Tschantz, "Attention via log-sum-exp energy"; Singh & Buckley sec. 3.
    """
    args, kwargs = as_arrays(args, kwargs)
    lz = log_z(model, args, kwargs)
    if is_concrete(lz) and jnp.ndim(lz) == 0 and _wide(lz) and float(lz) == -np.inf:
        _check_underflow(model, args, kwargs, None, lz)
    return lz


def energy(model: Callable, *args: Any, **kwargs: Any) -> jax.Array:
    r"""The collapsed energy $E(x) = -\log \sum_\phi p(x, \phi)$.

    The negative of [`log_marginal`][structinfer.exact.log_marginal]. For independent
    children this is the log-sum-exp energy
    $-\sum_i \log \sum_j \exp(\psi_{ij} + \log p_{ij})$.

    Args:
        model: a NumPyro model with edge sites (as for
            [`log_marginal`][structinfer.exact.log_marginal]).
        *args: the model's positional arguments.
        **kwargs: the model's keyword arguments.

    Returns:
        The scalar $E = -\log Z$.

    Reference:
        Tschantz, "log-sum-exp energies" (v2 eq. 1); the collapsed free energy of
        Singh & Buckley sec. 4.1 (eq. 3).
    """
    return -log_marginal(model, *args, **kwargs)


def marginals(model: Callable, *args: Any, **kwargs: Any) -> dict[str, jax.Array]:
    r"""Exact posterior marginals of every enumerated site, by one backward pass.

    $$p(\phi_i = j \mid x) = \frac{\partial \log Z}{\partial t_{ij}}\Big|_{t=0}$$

    Args:
        model: a NumPyro model with edge sites (as for
            [`log_marginal`][structinfer.exact.log_marginal]).
        *args: the model's positional arguments.
        **kwargs: the model's keyword arguments.

    Returns:
        ``{site: array (..., children, parents)}`` for each edge site (and each other
            enumerated discrete site, shape ``batch + (support,)``). Rows sum to one.

    Raises:
        ValueError: the model has no edge sites; or, on concrete inputs, it gives every
            structure zero probability ($\log Z = -\infty$; or its log-space sum
            underflowed to $-\infty$ while a structure is possible, which the message
            says), or its $\log Z$ is NaN (a NaN or infinite score, factor or input
            inside a ``scan``; the message names the edge sites). Under ``jit`` the
            marginals are NaN instead.

    Reference:
        The attention matrix as the edge posterior, Singh & Buckley sec. 3.1 (eq. 1);
        marginals as gradients of the log-partition (Lemma 7.1 (i), app. 7.1).
    """
    args, kwargs = as_arrays(args, kwargs)
    info = inspect_model(model, *args, **kwargs)
    if not info.enumerated:
        raise ValueError(
            f"model '{model_name(model)}' has no edge sites: nothing to compute marginals of"
        )
    total, grads = _edge_gradients(model, args, kwargs, info, "sum")
    # a Markov edge's tilt is pairwise (previous, next): its marginal sums the previous out
    return _check_possible(model, info, total, {
        n: g.sum(-2) if n in info.markov_edges else g for n, g in grads.items()}, args, kwargs)


def _edge_gradients(model, args, kwargs, info, semiring) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The sum- or max-product log Z and its gradients at zero tilts on every enumerated
    site.

    ``batch + (k,)`` per site; ``(T,) + batch + (k + 1, k)`` (the pair previous, next;
    row ``k``: the chain's start) for an edge with a Markov prior.
    """
    zeros = {name: jnp.zeros(batch + ((k + 1, k) if name in info.markov_edges else (k,)),
                             info.float_dtype)
             for name, (batch, k) in info.enumerated.items()}

    def f(t):
        return log_z(model, args, kwargs, info=info, tilts={n: (v, 0) for n, v in t.items()},
                     semiring=semiring)

    return jax.value_and_grad(f)(zeros)


def _backtrack(pairs: jax.Array, rng_key) -> jax.Array:
    r"""A Markov chain's edges from its pairwise posterior $\xi_t(i, j)$, last to first.

    ``pairs``: ``(T,) + batch + (k + 1, k)``, the posterior (``rng_key`` given: the
    sum-product gradients) or the indicator of the best path (``None``: max-product
    gradients). $\phi_{T-1}$ is drawn from (or the argmax of) $\sum_i \xi_{T-1}(i, \cdot)$,
    then $\phi_{t-1}$ from $\xi_t(\cdot, \phi_t)$: backward sampling, or Viterbi's
    backtrace, exact because the chain is Markov given the data.
    """
    k = pairs.shape[-1]

    def choose(w, key):
        if key is None:
            return jnp.argmax(w, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, jnp.log(jnp.clip(w, 0.0, None)), axis=-1).astype(
            jnp.int32)

    n = pairs.shape[0]
    keys = (None,) * n if rng_key is None else tuple(jax.random.split(rng_key, n))
    last = choose(pairs[-1].sum(-2), keys[-1])
    if n == 1:
        return last[None]
    rest = pairs[1:, ..., :k, :][::-1]  # xi_t for t = T-1 .. 1

    def step(nxt, xs):
        xi, key = xs
        w = (xi * jax.nn.one_hot(nxt, k, dtype=xi.dtype)[..., None, :]).sum(-1)  # xi[:, nxt]
        z = choose(w, key)
        return z, z

    if rng_key is None:
        _, zs = jax.lax.scan(lambda c, xi: step(c, (xi, None)), last, rest)
    else:
        _, zs = jax.lax.scan(step, last, (rest, jnp.stack(keys[:-1])[::-1]))
    return jnp.concatenate([zs[::-1], last[None]], axis=0)


def _markov_posterior(model, args, kwargs, info, temperature: int, rng_key):
    """MAP (Viterbi) or one draw (forward filtering, backward sampling) of a model with
    Markov edges, from the gradients of its (max-)sum-product log Z."""
    others = [n for n in info.enumerated if n not in info.markov_edges]
    if temperature == 1 and others:
        raise NotImplementedError(
            f"model '{model_name(model)}': sample_edges draws Markov chains from their "
            f"pairwise posterior, which does not cover the other enumerated sites {others} "
            "of the same model; draw those with a model without the chain"
        )
    best, grads = _edge_gradients(model, args, kwargs, info,
                                  "max" if temperature == 0 else "sum")
    out = {}
    keys = dict(zip(info.enumerated, jax.random.split(rng_key, len(info.enumerated))))
    for name, g in grads.items():
        if name in info.markov_edges:
            out[name] = _backtrack(g, None if temperature == 0 else keys[name])
        else:
            out[name] = jnp.argmax(g, axis=-1).astype(jnp.int32)
    return _possible(model, best, out)


def _check_possible(model, info, log_marginal: jax.Array, out: dict[str, jax.Array],
                    args, kwargs) -> dict[str, jax.Array]:
    r"""``out`` (marginals or expectations: gradients of $\log Z$ at ``args``), or the
    error of a model with no posterior. On concrete values: a model that gives every
    structure zero probability ($\log Z = -\infty$) is an error, and so is a NaN
    $\log Z$ of the model itself (a NaN or infinite score, factor or input the value
    checks did not see: inside a ``scan``), naming the edge sites; a NaN that only the
    value of an expectation brings (its tilt is $0 \cdot v$) gives NaN. Under a trace
    ``out`` is returned as it is where $\log Z$ is a number: `log_z`'s derivatives are NaN
    where it is $-\infty$ (a child with no allowed parent in its own rows; a model that
    couples enumerated sites, several or a Markov chain, everywhere), so the answer is
    NaN, never a finite number, and so are its own derivatives. A NaN $\log Z$, and a
    $-\infty$ that no entry of ``out`` shows as NaN, make all of ``out`` NaN: a NaN or
    $-\infty$ that does not depend on the tilts (an edge conditioned outside its
    support, or on a parent its prior forbids) leaves their derivatives finite (and so
    would the derivatives of the answer), while a child with no allowed parent makes its
    own row NaN and leaves the rows of independent children as they are. A float16
    $\log Z$ is not read for $-\infty$: its sum over many children can overflow while
    every child is possible."""
    if not is_concrete(log_marginal):
        bad = jnp.isnan(log_marginal)
        leaves = jax.tree.leaves(out)
        if _wide(log_marginal) and leaves:
            shown = jnp.any(jnp.stack([jnp.isnan(x).any() for x in leaves]))
            bad = bad | ((log_marginal == -jnp.inf) & ~shown)
        # a product, not a where: the derivatives through the answer are NaN too, not 0
        return jax.tree.map(lambda x: x * jnp.where(bad, jnp.nan, 1).astype(x.dtype), out)
    lz = float(log_marginal)
    if np.isnan(lz) and np.isnan(float(log_z(model, args, kwargs, info=info))):
        sites = info.edges
        raise ValueError(
            f"edge site{'s' if len(sites) > 1 else ''} {', '.join(repr(s) for s in sites)}: "
            "the model's log-marginal is NaN: a score, prior, factor or value is NaN or "
            "infinite (inside a scan, where they are not checked one by one; under jit the "
            "answer is NaN)")
    if lz == -np.inf and _wide(log_marginal):
        _check_underflow(model, args, kwargs, info, log_marginal)
        raise ValueError(
            f"model '{model_name(model)}' gives every structure of its edge sites zero "
            "probability (log Z = -inf: forbidden edges, -inf factors or observations no "
            "structure explains): it has no posterior (under jit the answer is NaN)")
    return out


def _check_underflow(model, args, kwargs, info,
                     log_marginal: jax.Array) -> None:
    """Raise if a concrete ``log_marginal`` of ``-inf`` is the log-space contraction's
    underflow rather than a model without a possible structure: its max-product (the
    log-weight of the most probable structure) is finite. Factors over one site, and
    products whose broadcast is within `JOINT_MAX_ELEMENTS`, are shifted jointly and do
    not underflow (`_log_einsum.py`); a larger product of factors over several sites
    keeps a shift per factor and can."""
    try:
        best = float(log_z(model, args, kwargs, info=info, semiring="max"))
    except ValueError:  # a model the max-product does not read: no finding
        return
    if np.isfinite(best):  # a possible structure: the sum of its terms underflowed
        raise ValueError(
            f"model '{model_name(model)}': log Z underflowed to -inf in the log-space "
            f"contraction, although the most probable structure has log-weight {best:.6g}:"
            " factors that the contraction multiplies as a product over several enumerated "
            "sites (e.g. the steps of a Markov chain of more than "
            f"{JOINT_MAX_RATIO} states: a score, likelihood or potential at one step and "
            "the factors of the next) disagree by more than "
            f"{log_marginal.dtype}'s exponent range about which value is likely, in a "
            "product too large to shift jointly (its broadcast has more than "
            f"{JOINT_MAX_ELEMENTS} elements: for B chains of T steps of K states, about "
            "K^3 B (T - 1) / 2). Where only some of its terms underflow, log Z is finite "
            "and too low, with no error. Run in float64 (jax_enable_x64), or bring the "
            "disagreeing factors closer (e.g. a likelihood's scale)")


def _wide(x: jax.Array) -> bool:
    """Whether ``x``'s dtype has float32's exponent range (bfloat16 has; float16's
    overflows at 65504)."""
    return jnp.finfo(jnp.result_type(x)).maxexp >= jnp.finfo(jnp.float32).maxexp


#: every edge of `map_edges` and `sample_edges` under ``jit`` when the model has no
#: structure to return (every structure has zero probability, or a NaN): no parent
_NO_STRUCTURE = -1


def _possible(model, log_weight: jax.Array, out: dict[str, jax.Array]) -> dict[str, jax.Array]:
    r"""``out`` (a MAP or a drawn structure) when ``log_weight`` is finite: the model's
    log-weight $\log p(x, \phi)$ at ``out``, or its largest (MAP) or summed (draws) value
    over structures. Otherwise there is no structure to return: an error on concrete
    values, every edge -1 under a trace; never a structure the model forbids."""
    if not _wide(log_weight):  # see _check_possible
        return out
    if is_concrete(log_weight):
        w = float(log_weight)
        if not np.isfinite(w):
            why = ("every structure has zero probability (forbidden edges, -inf factors or "
                   "observations no structure explains)" if w == -np.inf else
                   "its log-weight is not a number (a NaN or +inf score, factor or input)")
            raise ValueError(
                f"model '{model_name(model)}' has no structure of its edge sites "
                f"{sorted(out)} to return: {why} (log-weight {w})")
        return out
    ok = jnp.isfinite(log_weight)
    return {n: jnp.where(ok, v, _NO_STRUCTURE).astype(v.dtype) for n, v in out.items()}


def expectation(
    model: Callable, site: str | Sequence[str], *args: Any, **kwargs: Any
) -> jax.Array | dict[str, jax.Array]:
    r"""Exact posterior expectation of deterministic site(s), by one backward pass.

    $$
    \mathbb E_{\phi \mid x}[v(\phi)]
    = \frac{\partial}{\partial t} \log \sum_\phi p(x, \phi)\, e^{\langle t, v(\phi)\rangle}\Big|_{t=0}
    $$

    Works for any value of the edges, including ones that couple several edge
    sites (a two-hop chain $V x_{\phi_{\phi_i}}$). The value must be
    recorded with ``numpyro.deterministic`` inside the plates of its children.

    Args:
        model: the model.
        site: a deterministic site name, or a sequence of names.
        *args: the model's positional arguments.
        **kwargs: the model's keyword arguments.

    Returns:
        The expectation, shaped like the site's value in a plain run and in its dtype
            when that is floating (otherwise the model's floating dtype, at least
            float32); a dict of them when ``site`` is a sequence.

    Raises:
        KeyError: the model has no site of that name.
        ValueError: the site is not a deterministic site; or, on concrete inputs, the
            model gives every structure zero probability ($\log Z = -\infty$), or its
            $\log Z$ is NaN (a NaN or infinite score, factor or input inside a ``scan``;
            the message names the edge sites). Under ``jit`` the expectation is NaN
            instead; a NaN value gives a NaN expectation.
        TypeError: the site's value is complex (a real value is expected).

    Reference:
        Attention output as $\mathbb E_{\phi|x}[v(x,\phi)]$, Singh & Buckley eq. 1;
        multi-hop values, app. 7.3.
    """
    args, kwargs = as_arrays(args, kwargs)
    names = [site] if isinstance(site, str) else list(site)
    info = inspect_model(model, *args, **kwargs)
    for n in names:
        info.check_value_site(n, model)
    # the tilts (and so the value contraction) in float32 at least, as the kernels
    # accumulate: a 16-bit one would sum p v in 16 bits
    tilt_dtype = jnp.promote_types(info.float_dtype, jnp.float32)
    zeros = {n: jnp.zeros(info.deterministic[n][0], tilt_dtype) for n in names}

    def f(t):
        return log_z(
            model, args, kwargs, info=info,
            tilts={n: (t[n], info.deterministic[n][1]) for n in names},
        )

    total, out = jax.value_and_grad(f)(zeros)
    out = _check_possible(model, info, total, out, args, kwargs)
    # in the value's dtype (a bfloat16 value of a model with float32 parameters is
    # contracted in float32 and answered in bfloat16); integer values in the model's
    out = {n: x.astype(info[n].dtype) if jnp.issubdtype(info[n].dtype, jnp.floating) else x
           for n, x in out.items()}
    return out[site] if isinstance(site, str) else out


def _discrete_posterior(model, args, kwargs, temperature: int, rng_key) -> dict[str, jax.Array]:
    args, kwargs = as_arrays(args, kwargs)
    outside = contain()  # NumPyro's infer_discrete enumerates under a block: its runs get
    with outside:  # the parameters and parent masks of the handlers around from this one
        info = inspect_model(model, *args, **kwargs)
    if not info.enumerated:
        raise ValueError(f"model '{model_name(model)}' has no edge sites")
    key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    if any(n in info.markov_edges for n in info.enumerated):
        return _markov_posterior(model, args, kwargs, info, temperature, key)
    # single-parent sites are deterministic; funsor cannot extract a point from a
    # size-1 enumeration dim, so fix them to 0 as observations (log-prob unchanged)
    trivial = {
        name: jnp.zeros(batch, jnp.int32) for name, (batch, k) in info.enumerated.items() if k == 1
    }
    m = pin(require_values(observe_given(replay_outside(model, outside=outside))), data=trivial)
    if len(trivial) < len(info.enumerated):  # else nothing is left to infer
        m = infer_discrete(m, first_available_dim=info.first_available_dim,
                           temperature=temperature, rng_key=key)
    # funsor draws through a NumPyro Categorical built from the posterior logits, whose
    # argument validation (on by default) rejects the -inf of forbidden parents
    with contain(enumerates=model_name(model)), validation_enabled(False):
        tr = trace(m).get_trace(*args, **kwargs)
    # funsor's MAP and draws read a structure off any table, -inf or NaN everywhere too:
    # the model's log-weight at the structure read says whether it is one
    return _possible(model, _log_joint(tr), {
        name: jnp.broadcast_to(tr[name]["value"], info.enumerated[name][0])
        for name in info.enumerated
    })


def _log_joint(tr: dict) -> jax.Array:
    r"""$\log p(x, \phi)$ at a trace's values: the sum of its sample sites' log-probs
    (masked entries left out; a scale does not change whether it is finite)."""
    total = jnp.zeros(())
    for site in tr.values():
        if site["type"] == "sample":
            lp = site["fn"].log_prob(site["value"])
            if site.get("mask") is not None:
                lp = jnp.where(site["mask"], lp, 0.0)
            total = total + jnp.sum(lp)
    return total


def map_edges(model: Callable, *args: Any, **kwargs: Any) -> dict[str, jax.Array]:
    r"""Jointly most probable structure $\arg\max_\phi p(\phi \mid x)$ (max-product).

    Args:
        model: a NumPyro model with edge sites (as for
            [`log_marginal`][structinfer.exact.log_marginal]).
        *args: the model's positional arguments.
        **kwargs: the model's keyword arguments.

    Returns:
        ``{site: int array of the site's batch shape (..., children)}``. Under ``jit``
            every entry of every site is -1 when there is no structure to return (see
            Raises): the joint structure has zero probability when one child has none
            (under ``vmap``, per mapped element).

    Raises:
        ValueError: the model has no edge sites; or, on concrete inputs, it gives every
            structure zero probability (forbidden edges, $-\infty$ factors) or a NaN
            log-weight: there is no most probable structure, never a forbidden one.

    Reference:
        Hard attention as the MAP structure (Singh & Buckley sec. 3.1); computed with
        funsor's max-product adjoint (``numpyro.contrib.funsor.infer_discrete``).
    """
    return _discrete_posterior(model, args, kwargs, 0, None)


def sample_edges(
    rng_key: jax.Array, model: Callable, *args: Any, **kwargs: Any
) -> dict[str, jax.Array]:
    r"""One exact joint draw $\phi \sim p(\phi \mid x)$ (forward-filter backward-sample).

    ``jax.vmap`` over keys for many draws.

    Args:
        rng_key: a JAX PRNG key.
        model: a NumPyro model with edge sites (as for
            [`log_marginal`][structinfer.exact.log_marginal]).
        *args: the model's positional arguments.
        **kwargs: the model's keyword arguments.

    Returns:
        ``{site: int array of the site's batch shape (..., children)}``. Under ``jit``
            every entry of every site is -1 when there is nothing to draw (see Raises;
            under ``vmap``, per mapped element).

    Raises:
        TypeError: ``rng_key`` is not one PRNG key (a seed, or a batch of keys).
        ValueError: the model has no edge sites; or, on concrete inputs, it gives every
            structure zero probability (forbidden edges, $-\infty$ factors) or a NaN
            log-weight: there is no posterior to draw from, never a forbidden structure.

    Reference:
        Stochastic (sampled) attention as a draw from the edge posterior (Singh &
        Buckley sec. 2, "latent alignment"); funsor forward-filter backward-sample.
    """
    return _discrete_posterior(model, args, kwargs, 1, check_key(rng_key, "sample_edges"))


def _check_params(params, caller: str) -> None:
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(
            f"{caller}: params must be a mapping {{site: value}} of the model's continuous "
            f"latent sites, or None, got {type(params).__name__}; the model's own arguments "
            f"follow it: {caller}(model, params, *args)"
        )


def pointwise_log_likelihood(
    model: Callable,
    params: Mapping[str, jax.Array] | None,
    *args: Any,
    score_factors: ScoreFactors = "error",
    **kwargs: Any,
) -> jax.Array:
    r"""Log-likelihood of each observed element with the edge sites summed out.

    $$\ell_i(\theta) = \log \sum_{\phi_i} p(\phi_i \mid \theta)\, p(x_i \mid \phi_i, \theta)$$

    (all enumerated sites local to element $i$ are summed out; plates nested inside the
    observations' plates, e.g. heads, are multiplied out first). It is
    [`log_z`][structinfer.exact.log_z] with ``keep_plates="observed"``. With
    ``score_factors="normalize"`` factor potentials $\psi$ inside the observations'
    plates (such as the scores of [`edge`][structinfer.edge]) are read as a conditional
    prior over the edges given the inputs,
    $\ell_i = \log\sum_{\phi_i} p(\phi_i)e^{\psi_i}p(x_i\mid\phi_i) - \log\sum_{\phi_i} p(\phi_i)e^{\psi_i}$.

    Args:
        model: a NumPyro model with edge sites and an observed sample site per child.
        params: values of the model's continuous latent sites (one posterior draw).
        *args: the model's positional arguments.
        score_factors: ``"error"`` (default) refuses factor potentials in the
            observations' terms; ``"normalize"`` normalises them as above.
        **kwargs: the model's keyword arguments.

    Returns:
        An array shaped like the plates around the observed site(s), outermost first
            (e.g. ``(children,)`` or ``(batch, children)``); its sum is
            $\log p(x \mid \theta)$. Jittable and differentiable.

    Raises:
        EnergyOnlyModelError: no normalised observed site, or unnormalised factors.
        TypeError: ``params`` is neither a mapping nor ``None``.

    Reference:
        The pointwise log-likelihood of PSIS-LOO (Vehtari, Gelman & Gabry 2017) with
        the edges of Singh & Buckley (sec. 3.1) collapsed.
    """
    _check_params(params, "pointwise_log_likelihood")
    args, kwargs = as_arrays(args, kwargs)
    m = substitute(model, data=dict(params)) if params else model
    return log_z(m, args, kwargs, keep_plates="observed", score_factors=score_factors)


def likelihood_structure(
    model: Callable,
    params: Mapping[str, jax.Array] | None,
    *args: Any,
    score_factors: ScoreFactors = "error",
    **kwargs: Any,
) -> LikelihoodStructure:
    r"""The static facts of the pointwise log-likelihood $\ell_i$ (names, plates, shape).

    Those of [`pointwise_log_likelihood`][structinfer.exact.pointwise_log_likelihood],
    shape-only: nothing is computed (``jax.eval_shape``). Latent sites missing from
    ``params`` (all of them with ``params=None``) are given placeholders of their shape:
    the structure does not depend on their values, so a model can be checked before it
    is fitted.

    Args:
        model: a NumPyro model with edge sites and an observed sample site per child.
        params: values of (some of) the model's continuous latent sites, or ``None``.
        *args: the model's positional arguments.
        score_factors: ``"error"`` or ``"normalize"``, as for
            [`pointwise_log_likelihood`][structinfer.exact.pointwise_log_likelihood].
        **kwargs: the model's keyword arguments.

    Returns:
        The [`LikelihoodStructure`][structinfer.exact.LikelihoodStructure] of the
            pointwise terms.

    Raises:
        EnergyOnlyModelError: as
            [`pointwise_log_likelihood`][structinfer.exact.pointwise_log_likelihood].
        TypeError: ``params`` is neither a mapping nor ``None``.
    """
    _check_params(params, "likelihood_structure")
    args, kwargs = as_arrays(args, kwargs)
    box = []

    def f(p):
        m = substitute(model, data=p) if p else model
        info = inspect_model(m, *args, **kwargs)
        # every latent site without a given value (one in a scan's steps too: the
        # inspection draws it there, as no placeholder reaches inside a step)
        fill = {n: jnp.zeros(info[n].shape, info[n].dtype) for n in info.latent
                if n not in p and (n in info.unvalued or info.trace[n].get(SCAN_RECORD_KEY))}
        if fill:
            m = substitute(m, data=fill)  # the roles and shapes stay those of `info`
        data, struct = log_z(m, args, kwargs, info=info, keep_plates="observed",
                             score_factors=score_factors, return_structure=True)
        box.append(struct)
        return data

    jax.eval_shape(f, dict(params or {}))
    return box[0]
