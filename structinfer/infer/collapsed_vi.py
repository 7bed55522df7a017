r"""Collapsed variational inference for continuous latent nodes (Singh & Buckley sec. 4).

The model has observed nodes :math:`x`, latent nodes summarised by their
variational means :math:`\mu`, and edge sites :math:`\phi` that the exact engine
collapses. With a Laplace (delta) approximation the free energy is

.. math::

    F(\mu) = -\log \sum_\phi p(x, \mu, \phi)
           = -\sum_i \log \sum_{\phi_i} e^{f_i(x, \mu, \phi_i)} + C,
    \qquad
    \frac{\partial F}{\partial \mu} = -\sum_i \sum_{\phi_i}
        \mathrm{softmax}(f_i)\, \frac{\partial f_i}{\partial \mu}

(eqs. 4–7): the gradient is attention with the free-energy gradient as value.

Three algorithms:

* :func:`cccp` — the convex–concave fixed point (eq. 8) for quadratic node
  potentials :math:`\tfrac12 \mu^\top \Lambda \mu` and edge potentials whose
  log-sum-exp :math:`G(\mu) = \log\sum_\phi e^{\tilde f(\mu,\phi)}` is convex
  (bilinear / linear in :math:`\mu`, Lemma 7.2):
  :math:`\mu^{t+1} = \Lambda^{-1}\nabla G(\mu^t)
  = \Lambda^{-1}\sum_i\sum_{\phi_i}\mathrm{softmax}(\tilde f_i)\,\partial_\mu \tilde f_i`,
  which never increases :math:`F = \tfrac12\mu^\top\Lambda\mu - G(\mu)`
  (Yuille & Rangarajan). :math:`\nabla G` is one backward pass through the exact
  engine, so Hopfield, slot and block-slot updates all come from their models.
* :func:`gradient_descent` — :math:`\mu \leftarrow \mu - \eta \nabla F(\mu)` for
  any potentials (predictive coding, non-linear scores).
* :func:`laplace` — the second-order term (appendix 7.1, Lemma 7.1):
  :math:`\nabla^2_\mu \log p(x,\mu) = \mathrm{Var}_{\phi\mid\mu,x}[\partial_\mu E_\phi]
  + \mathbb E_{\phi\mid\mu,x}[\partial^2_\mu E_\phi]`,
  :math:`E_\phi = \log p(x, \mu, \phi)`; the Laplace covariance is the inverse of
  its negative.

Every loop is a :func:`jax.lax.while_loop` (jittable, vmappable) returning
``(state, info)`` with the free energy at every step (:class:`~structinfer.infer.LoopInfo`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.flatten_util import ravel_pytree
from numpyro.handlers import block, substitute, trace

from .._checks import as_arrays, is_concrete, is_masked
from ..exact import inspect_model, log_marginal
from ..handlers import fill_discrete, require_values
from ..primitives import EDGE_INFO_KEY, SCORE_SUFFIX
from ._loop import LoopInfo, check, run_loop
from ._model_fn import ModelFunction

__all__ = [
    "CCCPState",
    "cccp_init",
    "cccp_step",
    "cccp",
    "GradientState",
    "gradient_init",
    "gradient_step",
    "gradient_descent",
    "LaplaceResult",
    "laplace",
]


def _sum_tree(tree) -> jax.Array:
    return sum(jnp.sum(x) for x in jax.tree.leaves(tree))


def _max_abs(tree) -> jax.Array:
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree.leaves(tree)]))


def _as_tree_float(mu):
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=jnp.result_type(a, float)), mu)


def _precision_tree(precision, mu):
    if jax.tree.structure(precision) == jax.tree.structure(mu):
        return precision
    return jax.tree.map(lambda _: precision, mu)


def _check_precision(precision) -> None:
    for p in jax.tree.leaves(precision):
        if is_concrete(p) and bool(np.any(np.asarray(p) <= 0)):
            raise ValueError(
                "cccp: `precision` (the quadratic node potential 1/2 mu^T Lambda mu) must be "
                f"positive, got {p}"
            )


def _site_finder(fn, mu_of_failure):
    if isinstance(fn, ModelFunction):
        return lambda idx: fn.site(mu_of_failure(idx))
    return None


# --------------------------------------------------------------------------- CCCP


class CCCPState(NamedTuple):
    """State of :func:`cccp`: the means ``mu`` (any pytree) and ``F(mu)``."""

    mu: Any
    energy: jax.Array


def _cccp_energy(log_z_fn, mu, precision) -> jax.Array:
    quad = _sum_tree(jax.tree.map(lambda m, p: 0.5 * p * m * m, mu, precision))
    return quad - log_z_fn(mu)


def cccp_init(log_z_fn: Callable[[Any], jax.Array], mu0: Any, precision: Any = 1.0) -> CCCPState:
    r"""Initial :class:`CCCPState` with :math:`F(\mu_0) = \tfrac12\mu_0^\top\Lambda\mu_0 - G(\mu_0)`."""
    mu0 = _as_tree_float(mu0)
    prec = _precision_tree(precision, mu0)
    return CCCPState(mu0, _cccp_energy(log_z_fn, mu0, prec))


def cccp_step(
    log_z_fn: Callable[[Any], jax.Array], state: CCCPState, precision: Any = 1.0, tol: float = 1e-6
) -> tuple[CCCPState, jax.Array]:
    r"""One fixed-point step :math:`\mu \leftarrow \Lambda^{-1}\nabla_\mu G(\mu)` (eq. 8).

    Returns:
        ``(new_state, converged)`` with ``converged = max |Δμ| <= tol``.
    """
    prec = _precision_tree(precision, state.mu)
    g = jax.grad(log_z_fn)(state.mu)
    mu = jax.tree.map(lambda gi, p, m: (gi / p).astype(m.dtype), g, prec, state.mu)
    delta = _max_abs(jax.tree.map(lambda a, b: a - b, mu, state.mu))
    return CCCPState(mu, _cccp_energy(log_z_fn, mu, prec)), delta <= tol


def cccp(
    log_z_fn: Callable[[Any], jax.Array],
    mu0: Any,
    *,
    precision: Any = 1.0,
    tol: float = 1e-6,
    max_iters: int = 100,
    raise_on_nonfinite: bool = True,
) -> tuple[CCCPState, LoopInfo]:
    r"""Convex–concave fixed-point iteration on the collapsed free energy (Singh & Buckley eq. 8).

    .. math::

        F(\mu) = \tfrac12 \mu^\top \Lambda \mu - G(\mu), \quad
        G(\mu) = \log \sum_\phi \exp \tilde f(x, \mu, \phi), \qquad
        \mu^{t+1} = \Lambda^{-1} \nabla G(\mu^t)
                  = \Lambda^{-1} \sum_i \sum_{\phi_i} \mathrm{softmax}(\tilde f_i)\,
                    \frac{\partial \tilde f_i}{\partial \mu}.

    When :math:`G` is convex (edge potentials linear in :math:`\mu`, or bilinear
    :math:`\mu_i^\top W \mu_j` with :math:`W` p.s.d., appendix 7.1.1) every step
    satisfies :math:`F(\mu^{t+1}) \le F(\mu^t)`, with equality only at a
    stationary point. Examples: Hopfield (:math:`\tilde f = \beta\mu^\top x_j`,
    :math:`\Lambda = \beta`) gives :math:`\mu^* = \sum_j \mathrm{softmax}_j(\beta\mu^\top x_j) x_j`
    (sec. 4.2); slot attention (edges of the tokens over the slots) gives
    :math:`\mu_i^* = \sum_j \mathrm{softmax}_i(\mu_i^\top W_Q^\top W_K x_j) W_Q^\top W_K x_j` (sec. 4.3).

    Args:
        log_z_fn: :math:`G`, ``mu -> log Σ_φ exp f̃`` — usually
            :func:`structinfer.infer.model_log_z` of a model with the edge potentials
            only (no node potential).
        mu0: initial means (any pytree of arrays).
        precision: :math:`\Lambda`, positive; a scalar or a pytree like ``mu`` of
            arrays broadcasting against its leaves (diagonal precision).
        tol: converged when :math:`\max|\mu^{t+1} - \mu^t| \le` ``tol``.
        max_iters: the most steps; stopping there is reported in ``info.status``.
        raise_on_nonfinite: raise :class:`~structinfer.infer.NonFiniteEnergyError`
            (naming the step and site) when the result is concrete.

    Returns:
        ``(CCCPState, LoopInfo)``; ``info.energy[t]`` is :math:`F(\mu^t)`.

    Cost: one forward and backward pass of the exact engine per step.
    """
    _check_precision(precision)
    state = cccp_init(log_z_fn, mu0, precision)
    state, info = run_loop(
        lambda s: _cccp_body(log_z_fn, s, precision, tol), state, state.energy, max_iters
    )
    if raise_on_nonfinite:
        prec = _precision_tree(precision, state.mu)
        bad_mu = lambda idx: jax.tree.map(  # noqa: E731 - recompute the failing step eagerly
            lambda g, p: g / p, jax.grad(log_z_fn)(state.mu), prec
        )
        check(info, "cccp", _site_finder(log_z_fn, bad_mu))
    return state, info


def _cccp_body(log_z_fn, s, precision, tol):
    new, conv = cccp_step(log_z_fn, s, precision, tol)
    return new, new.energy, conv


# ----------------------------------------------------------------- gradient descent


class GradientState(NamedTuple):
    """State of :func:`gradient_descent`: ``mu``, ``F(mu)`` and ``∇F(mu)``."""

    mu: Any
    energy: jax.Array
    grad: Any


def gradient_init(energy_fn: Callable[[Any], jax.Array], mu0: Any) -> GradientState:
    """Initial :class:`GradientState` (one value-and-gradient evaluation)."""
    mu0 = _as_tree_float(mu0)
    e, g = jax.value_and_grad(energy_fn)(mu0)
    return GradientState(mu0, e, g)


def gradient_step(
    energy_fn: Callable[[Any], jax.Array], state: GradientState, step_size: Any, tol: float = 1e-6
) -> tuple[GradientState, jax.Array]:
    r"""One step :math:`\mu \leftarrow \mu - \eta\,\nabla F(\mu)`.

    Returns:
        ``(new_state, converged)`` with ``converged = max |∇F(new μ)| <= tol``.
    """
    lr = _precision_tree(step_size, state.mu)
    mu = jax.tree.map(lambda m, g, h: (m - h * g).astype(m.dtype), state.mu, state.grad, lr)
    e, g = jax.value_and_grad(energy_fn)(mu)
    return GradientState(mu, e, g), _max_abs(g) <= tol


def gradient_descent(
    energy_fn: Callable[[Any], jax.Array],
    mu0: Any,
    *,
    step_size: Any = 0.1,
    tol: float = 1e-5,
    max_iters: int = 1000,
    raise_on_nonfinite: bool = True,
) -> tuple[GradientState, LoopInfo]:
    r"""Gradient descent on the collapsed free energy for general potentials.

    .. math::

        \mu^{t+1} = \mu^t - \eta\, \nabla F(\mu^t), \qquad
        \nabla F(\mu) = -\sum_i \sum_{\phi_i} \mathrm{softmax}(f_i)\,\partial_\mu f_i

    (Singh & Buckley eq. 7; with squared prediction errors as edge potentials this is
    the attention-modulated predictive-coding dynamics of sec. 4.4 / appendix 7.2).
    The gradient is ``jax.grad`` of ``energy_fn``. :math:`F` decreases for
    :math:`\eta < 2/L` (:math:`L` the gradient's Lipschitz constant); a too-large step
    shows as a rising ``info.energy``.

    Args:
        energy_fn: ``mu -> F(mu)``, e.g. :func:`structinfer.infer.model_energy`.
        mu0: initial means (pytree).
        step_size: :math:`\eta`, a scalar or a pytree like ``mu``.
        tol: converged when :math:`\max|\nabla F| \le` ``tol``.
        max_iters: the most steps (reported in ``info.status`` when reached).
        raise_on_nonfinite: raise on a non-finite energy when the result is concrete.

    Returns:
        ``(GradientState, LoopInfo)``.
    """
    state = gradient_init(energy_fn, mu0)

    def body(s):
        new, conv = gradient_step(energy_fn, s, step_size, tol)
        return new, new.energy, conv

    state, info = run_loop(body, state, state.energy, max_iters)
    if raise_on_nonfinite:
        lr = _precision_tree(step_size, state.mu)
        bad_mu = lambda idx: jax.tree.map(  # noqa: E731
            lambda m, g, h: m - h * g, state.mu, state.grad, lr
        )
        check(info, "gradient_descent", _site_finder(energy_fn, bad_mu))
    return state, info


# -------------------------------------------------------------------------- Laplace


class LaplaceResult(NamedTuple):
    r"""Second-order (Laplace) approximation at :math:`\mu` (appendix 7.1).

    Matrices act on the flattened latent (``jax.flatten_util.ravel_pytree(mu)``).

    Attributes:
        mean: :math:`\mu`.
        var_term: :math:`\sum_i \mathrm{Var}_{\phi_i\mid\mu,x}[\partial_\mu f_i]`.
        expectation_term: :math:`\mathbb E_{\phi\mid\mu,x}[\partial^2_\mu E_\phi]`
            (node potentials included).
        hessian: ``var_term + expectation_term`` :math:`= \nabla^2_\mu \log p(x,\mu)`.
        precision: :math:`-\nabla^2_\mu \log p(x, \mu) = \nabla^2 F`.
        covariance: the inverse of ``precision`` (the Laplace covariance; NaN if
            ``precision`` is not positive definite, i.e. :math:`\mu` is not a minimum).
    """

    mean: Any
    var_term: jax.Array
    expectation_term: jax.Array
    hessian: jax.Array
    precision: jax.Array
    covariance: jax.Array


def _edge_terms(model, args, kwargs, edges):
    r"""Trace once: the per-edge logit tables :math:`f_{ij}` and the node term :math:`A`.

    .. math::

        \log p(x, \mu, \phi) = A(\mu) + \sum_i f_{i, \phi_i}(\mu), \qquad
        f_{ij} = \log p(\phi_i = j) + \psi_{ij}

    Args:
        model, args, kwargs: the model and its arguments.
        edges: the enumerated (collapsed) edge sites. An edge site given a value
            (``handlers.condition``) is not collapsed: its log-prob at the value and
            its ``".score"`` factor are part of :math:`A`, like any observed site.

    Returns:
        ``(tables, rest)``: ``{edge: (..., children, parents) table}`` and the sum of
        every other site's (scaled) log-density at the model's values.
    """
    with block():
        tr = trace(fill_discrete(require_values(model))).get_trace(*args, **kwargs)
    logits, rest = {}, 0.0
    for name, site in tr.items():
        if site["type"] != "sample":
            continue
        if name in edges:
            info = site["infer"][EDGE_INFO_KEY]
            table = info.prior.log_table(info.num_children)
            if info.score is not None:
                table = table + info.score.dense()
            logits[name] = table
            continue
        if name.endswith(SCORE_SUFFIX) and name[: -len(SCORE_SUFFIX)] in edges:
            continue
        lp = site["fn"].log_prob(site["value"])
        scale = site.get("scale")
        rest = rest + (jnp.sum(lp) if scale is None else scale * jnp.sum(lp))
    return logits, rest


#: loop primitives: one pass over their body misses the dependence carried between
#: iterations, so their outputs conservatively depend on all their inputs
_LOOPS = frozenset({"scan", "while"})


def _inner_jaxpr(eqn):
    for key in ("jaxpr", "call_jaxpr"):
        j = eqn.params.get(key)
        if j is not None:
            return getattr(j, "jaxpr", j)
    return None


def _jaxpr_deps(jaxpr, in_deps: list[frozenset]) -> list[frozenset]:
    r"""Data dependence of a jaxpr's outputs on its inputs.

    .. math:: \mathrm{deps}(y) = \bigcup_{x \,\in\, \mathrm{operands}(y)} \mathrm{deps}(x)

    propagated forwards through the equations; calls (``jit``, ``custom_jvp``, ...)
    are entered, loops and branches count every operand. It over-approximates: an
    output not listed as depending on an input is computed without reading it.
    """
    deps = dict(zip(jaxpr.invars, in_deps))

    def get(x):
        return frozenset() if isinstance(x, jex_core.Literal) else deps.get(x, frozenset())

    for eqn in jaxpr.eqns:
        ins = [get(x) for x in eqn.invars]
        inner = _inner_jaxpr(eqn)
        if (inner is not None and eqn.primitive.name not in _LOOPS
                and len(inner.invars) == len(ins) and len(inner.outvars) == len(eqn.outvars)):
            outs = _jaxpr_deps(inner, ins)
        else:
            outs = [frozenset().union(*ins)] * len(eqn.outvars)
        deps.update(zip(eqn.outvars, outs))
    return [get(x) for x in jaxpr.outvars]


def _check_separable(model, args, kwargs, info) -> None:
    r"""Raise unless :math:`\log p(x, \mu, \phi) = A(\mu) + \sum_i f_{i,\phi_i}(\mu)` structurally.

    The model is traced once (:func:`jax.make_jaxpr`, so the same under ``jit`` and
    eagerly) with edge :math:`k` set to a probe ``arange(m_k)`` on its own leading
    dim, where enumeration would put it. From the jaxpr's data dependence:

    * a site that is not a collapsed edge (observations, factors, node potentials,
      the edges' ``".score"`` normalisers) must not read any edge value;
    * edge site :math:`i` may read only its own value (no ``child=`` chain, no score
      or prior built from another edge);

    and edge / score sites must be unmasked plain edges (no ``child=``), so that
    their terms are exactly :math:`\mathrm{lse}_j f_{ij}` with :math:`f` the
    ``EdgeInfo`` tables :func:`_edge_terms` reads.

    Raises:
        ValueError: naming the first site that depends on an edge (or is masked).
    """
    names = list(info.edges)
    if not names:
        return
    layout = info.probes()
    probes = [layout[e] for e in names]
    sites: list = []

    def log_densities(*phis):
        with block():
            tr = trace(require_values(substitute(model, data=dict(zip(names, phis))))).get_trace(
                *args, **kwargs)
        sites[:] = [(n, s) for n, s in tr.items() if s["type"] == "sample"]
        out = []
        for _, s in sites:
            lp = jnp.asarray(s["fn"].log_prob(s["value"]))
            out.append(lp if s.get("scale") is None else lp * s["scale"])
        return out

    try:
        closed = jax.make_jaxpr(log_densities)(*probes)
    except jax.errors.TracerArrayConversionError as e:
        raise TypeError(
            "laplace: the model indexes a NumPy array with an edge variable; convert "
            "the array with jnp.asarray first"
        ) from e
    deps = _jaxpr_deps(closed.jaxpr, [frozenset([k]) for k in range(len(names))])
    hint = ("use jax.hessian of structinfer.log_marginal instead (it handles any "
            "dependence on the edges)")
    edges = set(names)
    for (name, site), d in zip(sites, deps):
        own = {names.index(name)} if name in edges else set()
        other = sorted(d - own)
        if other:
            raise ValueError(
                f"laplace: the log-density of site '{name}' depends on edge site "
                f"'{names[other[0]]}' (an observed value or factor read at an edge, a child= "
                "chain, a score built from another edge), so log Z does not split into "
                f"independent edge terms; {hint}"
            )
        base = name[: -len(SCORE_SUFFIX)] if name.endswith(SCORE_SUFFIX) else None
        if name in edges or base in edges:
            if is_masked(site["fn"]):
                raise ValueError(
                    f"laplace: site '{name}' is under numpyro.handlers.mask; a masked edge "
                    f"term is not the edge's log-sum-exp; {hint}"
                )
        if name in edges and site["infer"][EDGE_INFO_KEY].child is not None:
            raise ValueError(
                f"laplace: edge site '{name}' follows child=... (a hop of a chain), so its "
                f"distribution is not its own prior and score; {hint}"
            )


def laplace(model: Callable, argname: str, mu: Any, *args, rtol: float = 1e-4, **kwargs) -> LaplaceResult:
    r"""Laplace covariance of the latent means from the edge posterior (Lemma 7.1, app. 7.1).

    With :math:`E_\phi(\mu) = \log p(x, \mu, \phi) = A(\mu) + \sum_i f_{i,\phi_i}(\mu)`
    (:math:`A` the node potentials, :math:`f_{i,j}` = log-prior + score of edge
    :math:`\phi_i = j`):

    .. math::

        \nabla^2_\mu \log \sum_\phi e^{E_\phi}
        = \sum_i \mathrm{Var}_{\phi_i \mid \mu, x}\!\left[\partial_\mu f_{i,\phi_i}\right]
        + \mathbb E_{\phi \mid \mu, x}\!\left[\partial^2_\mu E_\phi\right],
        \qquad \Sigma = \big(-\nabla^2_\mu \log p(x, \mu)\big)^{-1}.

    The variance term is built from the Jacobian of the score tables and the edge
    posterior :math:`p_{ij} = \mathrm{softmax}_j f_{ij}`; the expectation term from
    the Hessian of :math:`A + \sum_{ij} p_{ij} f_{ij}` with :math:`p` held fixed —
    not from the Hessian of :math:`\log Z` (which the tests compare it with).

    The split of :math:`E_\phi` is decided from the model's structure — one trace
    with a probe on each edge's enumeration dim, read for data dependence — so it
    holds, or raises, identically eagerly and under ``jit``.

    Args:
        model: a model whose edge sites are independent given ``mu``: no site other
            than an edge reads an edge value (no observation or factor at an edge),
            and no edge reads another (no ``child=`` chains, no score built from
            another edge); no other enumerated sites. Edge sites given a value
            (``handlers.condition``) count as node potentials.
        argname: the keyword argument holding the latent means.
        mu: where to expand (usually a fixed point of :func:`cccp` or
            :func:`gradient_descent`).
        rtol: tolerance of the eager consistency assertion
            :math:`\log Z = A + \sum_i \mathrm{lse}_j f_{ij}` against the exact
            engine (redundant with the structural check; skipped under ``jit``).

    Returns:
        :class:`LaplaceResult`.

    Raises:
        ValueError: when a site's log-density depends on an edge (naming both), an
            edge or its score is masked or follows ``child=``, or the model has
            enumerated sites that are not edges — eagerly and under ``jit`` alike.

    Cost: a Jacobian of the ``(children, parents)`` score tables (``D`` forward
    passes, ``D`` = latent size) and a ``D × D`` Hessian.
    """
    args, kwargs = as_arrays(args, kwargs)
    mu = _as_tree_float(mu)
    flat, unravel = ravel_pytree(mu)
    call_kw = lambda u: {**kwargs, argname: unravel(u)}  # noqa: E731
    info = inspect_model(model, *args, **call_kw(flat))
    others = [n for n in info.enumerated if n not in info.edges]
    if others:
        raise ValueError(
            f"laplace: the model has enumerated sites that are not edge sites ({others}); "
            "only independent edge sites can be expanded — use jax.hessian of "
            "structinfer.log_marginal instead"
        )

    edges = frozenset(info.edges)
    _check_separable(model, args, call_kw(flat), info)

    def logits_of(u):
        return _edge_terms(model, args, call_kw(u), edges)[0]

    def rest_of(u):
        return _edge_terms(model, args, call_kw(u), edges)[1]

    tables = logits_of(flat)
    probs = {k: jax.nn.softmax(v, axis=-1) for k, v in tables.items()}
    decomposed = rest_of(flat) + sum(
        jnp.sum(jax.nn.logsumexp(v, axis=-1)) for v in tables.values()
    )
    if is_concrete(decomposed):
        # redundant with _check_separable (which decides, identically under jit):
        # an eager consistency assertion against the exact engine
        lz = log_marginal(model, *args, **call_kw(flat))
        if not bool(jnp.allclose(lz, decomposed, rtol=rtol, atol=rtol)):
            raise ValueError(  # pragma: no cover - a gap in _check_separable
                f"laplace: log Z = {float(lz):.6g} but the sum of independent edge terms "
                f"is {float(decomposed):.6g} although no site's log-density reads an edge; "
                "please report this model. Use jax.hessian of structinfer.log_marginal "
                "instead"
            )
    jac = jax.jacfwd(logits_of)(flat)  # site -> (..., n, m, D)
    dim = flat.shape[0]
    var = jnp.zeros((dim, dim), flat.dtype)
    for name, J in jac.items():
        p = probs[name][..., None]
        mean = jnp.sum(p * J, axis=-2)  # (..., n, D)
        second = jnp.einsum("...jd,...je->...de", p * J, J)
        var = var + jnp.sum(second - mean[..., :, None] * mean[..., None, :],
                            axis=tuple(range(J.ndim - 2)))

    def weighted(u):
        t = logits_of(u)
        edge = sum(jnp.sum(jax.lax.stop_gradient(probs[k]) * jnp.where(jnp.isfinite(v), v, 0.0))
                   for k, v in t.items())
        return rest_of(u) + edge

    expect = jax.hessian(weighted)(flat)
    hess = var + expect
    prec = -hess
    chol = jnp.linalg.cholesky(0.5 * (prec + prec.T))
    eye = jnp.eye(dim, dtype=flat.dtype)
    cov = jax.scipy.linalg.cho_solve((chol, True), eye)
    return LaplaceResult(mu, var, expect, hess, prec, cov)

