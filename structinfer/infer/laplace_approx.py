r"""The Laplace approximation of the latent means from the edge posterior (Singh &
Buckley appendix 7.1, Lemma 7.1).

With $E_\phi(\mu) = \log p(x, \mu, \phi)$,

$$\nabla^2_\mu \log p(x,\mu) = \mathrm{Var}_{\phi\mid\mu,x}[\partial_\mu E_\phi]
  + \mathbb E_{\phi\mid\mu,x}[\partial^2_\mu E_\phi],$$

and the Laplace covariance is the inverse of its negative. Not iterative: `laplace`
expands at a point, usually the fixed point of `structinfer.infer.cccp` or
`gradient_descent`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from .._checks import as_arrays, check_tol, float32_at_least, is_concrete, is_masked
from .._jaxpr import Branch, Call, Loop, classify, is_literal, loop_fixed_point, open_jaxpr, union
from ..exact import inspect_model, log_marginal, trace_model
from ..primitives import EDGE_INFO_KEY, SCORE_SUFFIX
from ._common import as_float_tree

__all__ = ["LaplaceResult", "laplace"]


class LaplaceResult(NamedTuple):
    r"""Second-order (Laplace) approximation at $\mu$ (appendix 7.1).

    Matrices act on the flattened latent (``jax.flatten_util.ravel_pytree(mu)``), in the
    model's dtype: float32 at least (a 16-bit ``mu`` is expanded in float32).

    Attributes:
        mean: $\mu$.
        var_term: $\sum_i \mathrm{Var}_{\phi_i\mid\mu,x}[\partial_\mu f_i]$.
        expectation_term: $\mathbb E_{\phi\mid\mu,x}[\partial^2_\mu E_\phi]$
            (node potentials included).
        hessian: ``var_term + expectation_term`` $= \nabla^2_\mu \log p(x,\mu)$.
        precision: $-\nabla^2_\mu \log p(x, \mu) = \nabla^2 F$.
        covariance: the inverse of ``precision`` (the Laplace covariance; NaN if
            ``precision`` is not positive definite, i.e. $\mu$ is not a minimum).
    """

    mean: Any
    var_term: jax.Array
    expectation_term: jax.Array
    hessian: jax.Array
    precision: jax.Array
    covariance: jax.Array


def _edge_terms(model, args, kwargs, edges, dtype):
    r"""Trace once: the per-edge logit tables $f_{ij}$ and the node term $A$.

    $$
    \log p(x, \mu, \phi) = A(\mu) + \sum_i f_{i, \phi_i}(\mu), \qquad
    f_{ij} = \log p(\phi_i = j) + \psi_{ij}
    $$

    Args:
        model: the model.
        args: its positional arguments.
        kwargs: its keyword arguments.
        edges: the enumerated (collapsed) edge sites. An edge site given a value
            (``handlers.condition``) is not collapsed: its log-prob at the value and
            its ``".score"`` factor are part of $A$, like any observed site.
        dtype: the tables' dtype, promoted with the score's: a prior's log-table (float64
            under ``jax_enable_x64`` when it has no parameter) never promotes the model.

    Returns:
        ``(tables, rest)``: ``{edge: (..., children, parents) table}`` and the sum of
            every other site's (scaled) log-density at the model's values.
    """
    tr = trace_model(model, args, kwargs)
    logits, rest = {}, 0.0
    for name, site in tr.items():
        if site["type"] != "sample":
            continue
        if name in edges:
            info = site["infer"][EDGE_INFO_KEY]
            table = info.prior.log_table(info.num_children)
            score = None if info.score is None else info.score.dense()
            dt = dtype if score is None else jnp.result_type(dtype, score)
            logits[name] = table.astype(dt) if score is None else table.astype(dt) + score
            continue
        if name.endswith(SCORE_SUFFIX) and name[: -len(SCORE_SUFFIX)] in edges:
            continue
        lp = site["fn"].log_prob(site["value"])
        scale = site.get("scale")
        rest = rest + (jnp.sum(lp) if scale is None else scale * jnp.sum(lp))
    return logits, rest


def _loop_deps(loop: Loop, get) -> list[frozenset]:
    """Dependence of a loop's results: its body iterated until the carried dependence stops
    growing (`structinfer._jaxpr.loop_fixed_point`); a ``while`` condition's dependence
    (the trip count) joins every result."""
    everything = union(get(x) for x in loop.consts + loop.carry + loop.xs)
    point = loop_fixed_point(loop, get, _jaxpr_deps, frozenset.union,
                             rounds=len(loop.carry) * (len(everything) + 1) + 1)
    if point is None:  # pragma: no cover - cannot happen: every round grows a finite set
        return [everything] * (len(loop.carry) + len(loop.ys))
    trips = union(point.cond) if point.cond is not None else frozenset()
    return [d | trips for d in point.carry + point.outputs[len(point.carry):]]


def _jaxpr_deps(jaxpr, in_deps: list[frozenset]) -> list[frozenset]:
    r"""Data dependence of a jaxpr's outputs on its inputs.

    $$\mathrm{deps}(y) = \bigcup_{x \,\in\, \mathrm{operands}(y)} \mathrm{deps}(x)$$

    propagated forwards through the equations; calls (``jit``, ``custom_jvp``, ...) and
    the branches of a conditional are entered, loops are iterated to a fixed point, and
    any other primitive — a body the jaxpr walker does not know included — counts every
    operand. It over-approximates: an output not listed as depending on an input is
    computed without reading it.
    """
    deps = dict(zip(jaxpr.invars, in_deps))

    def get(x):
        return frozenset() if is_literal(x) else deps.get(x, frozenset())

    for eqn in jaxpr.eqns:
        ins = [get(x) for x in eqn.invars]
        kind = classify(eqn)
        if isinstance(kind, Call):
            outs = _jaxpr_deps(kind.body.jaxpr, ins)
        elif isinstance(kind, Loop):
            outs = _loop_deps(kind, get)
        elif isinstance(kind, Branch):
            picked = get(kind.index)
            operands = [get(x) for x in kind.operands]
            per_branch = [_jaxpr_deps(b.jaxpr, operands) for b in kind.branches]
            outs = [union(ds) | picked for ds in zip(*per_branch)]
        else:
            outs = [union(ins)] * len(eqn.outvars)
        deps.update(zip(eqn.outvars, outs))
    return [get(x) for x in jaxpr.outvars]


def _check_separable(model, args, kwargs, info) -> None:
    r"""Raise unless $\log p(x, \mu, \phi) = A(\mu) + \sum_i f_{i,\phi_i}(\mu)$ structurally.

    The model is traced once (`jax.make_jaxpr`, so the same under ``jit`` and
    eagerly) with edge $k$ set to a probe ``arange(m_k)`` on its own leading
    dim, where enumeration would put it. From the jaxpr's data dependence:

    * a site that is not a collapsed edge (observations, factors, node potentials,
      the edges' ``".score"`` normalisers) must not read any edge value;
    * edge site $i$ may read only its own value (no ``child=`` chain, no score
      or prior built from another edge);

    and edge / score sites must be unmasked plain edges (no ``child=``), so that
    their terms are exactly $\mathrm{lse}_j f_{ij}$ with $f$ the
    ``EdgeInfo`` tables `_edge_terms` reads.

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
        tr = trace_model(model, args, kwargs, values=dict(zip(names, phis)))
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
    top = open_jaxpr(closed)
    if top is None:  # pragma: no cover - make_jaxpr always gives its constants' values
        deps = [frozenset(range(len(names)))] * len(sites)
    else:
        deps = _jaxpr_deps(top.jaxpr, [frozenset([k]) for k in range(len(names))])
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


def laplace(
    model: Callable,
    argname: str,
    mu: Any,
    *args: Any,
    rtol: float = 1e-4,
    **kwargs: Any,
) -> LaplaceResult:
    r"""Laplace covariance of the latent means from the edge posterior (Lemma 7.1, app. 7.1).

    With $E_\phi(\mu) = \log p(x, \mu, \phi) = A(\mu) + \sum_i f_{i,\phi_i}(\mu)$
    ($A$ the node potentials, $f_{i,j}$ = log-prior + score of edge
    $\phi_i = j$):

    $$
    \nabla^2_\mu \log \sum_\phi e^{E_\phi}
    = \sum_i \mathrm{Var}_{\phi_i \mid \mu, x}\!\left[\partial_\mu f_{i,\phi_i}\right]
    + \mathbb E_{\phi \mid \mu, x}\!\left[\partial^2_\mu E_\phi\right],
    \qquad \Sigma = \big(-\nabla^2_\mu \log p(x, \mu)\big)^{-1}.
    $$

    The variance term is built from the Jacobian of the score tables and the edge
    posterior $p_{ij} = \mathrm{softmax}_j f_{ij}$; the expectation term from
    the Hessian of $A + \sum_{ij} p_{ij} f_{ij}$ with $p$ held fixed —
    not from the Hessian of $\log Z$ (which the tests compare it with).

    The split of $E_\phi$ is decided from the model's structure — one trace
    with a probe on each edge's enumeration dim, read for data dependence — so it
    holds, or raises, identically eagerly and under ``jit``.

    Args:
        model: a model whose edge sites are independent given ``mu``: no site other
            than an edge reads an edge value (no observation or factor at an edge),
            and no edge reads another (no ``child=`` chains, no score built from
            another edge); no other enumerated sites. Edge sites given a value
            (``handlers.condition``) count as node potentials.
        argname: the keyword argument holding the latent means.
        mu: where to expand (usually a fixed point of [`cccp`][structinfer.infer.cccp] or
            [`gradient_descent`][structinfer.infer.gradient_descent]).
        *args: the model's positional arguments.
        rtol: tolerance of the eager consistency assertion
            $\log Z = A + \sum_i \mathrm{lse}_j f_{ij}$ against the exact
            engine (redundant with the structural check; skipped under ``jit``).
        **kwargs: the model's other keyword arguments.

    Returns:
        The [`LaplaceResult`][structinfer.infer.LaplaceResult] at ``mu``.

    Raises:
        ValueError: when a site's log-density depends on an edge (naming both), an
            edge or its score is masked or follows ``child=``, or the model has
            enumerated sites that are not edges — eagerly and under ``jit`` alike; an
            ``rtol`` that is not a non-negative number.
        TypeError: the model indexes a NumPy array with an edge variable.

    Cost: a Jacobian of the ``(children, parents)`` score tables (``D`` forward
    passes, ``D`` = latent size) and a ``D × D`` Hessian.
    """
    check_tol(rtol, "laplace: rtol", "the tolerance of the consistency check")
    args, kwargs = as_arrays(args, kwargs)
    mu = as_float_tree(mu)
    # expanded in float32 at least, as the exact engine's tables: the Hessian in a 16-bit
    # mu would come back rounded to 16 bits
    flat, unravel = ravel_pytree(jax.tree.map(float32_at_least, mu))
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

    dtype = flat.dtype  # the model's (float32 at least)

    def logits_of(u):
        return _edge_terms(model, args, call_kw(u), edges, dtype)[0]

    def rest_of(u):
        return _edge_terms(model, args, call_kw(u), edges, dtype)[1]

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

