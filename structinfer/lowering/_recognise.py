r"""Read a lowerable structure off a NumPyro model by *probing* it.

The model is traced (never enumerated) with every edge site replaced by a
probe: edge ``k`` gets ``arange(m_k)`` placed on its own dimension left of the
plates, exactly where funsor's enumeration would put it. That run is not made here:
`inspect_model` stages it once (``ModelInfo.at_probes``, a closed jaxpr of the probes)
beside its own run at zeros (``ModelInfo.trace``), and everything below reads those two:

* each edge's structured ``prior`` and ``score`` are read from the
  ``EdgeInfo`` recorded at the site in the inspection run (``edge`` refuses a prior or
  score with another edge's enumeration dim, so they are those of the probe run);
* a chained edge (``child=``) is recognised when its ``child`` *is* another
  edge's value in that run;
* every other sample / factor site must have a log-density that does not vary
  along any probe dimension (read off the program's output types; otherwise it is a
  likelihood term on the edge, which the kernels do not model);
* the value site, the program's output replayed with its gathers read as views, is the
  table
  $F[j] = f(\phi_i = j)$. The rule for "linear in the parent": the probe
  output must not vary along the children dimension — then $f$ depends on
  the child only through the parent it picks, and
  $\mathbb E[f(\phi_i)] = \sum_j p(\phi_i = j\mid x)\,F[j]$ exactly, for *any*
  $f$ (a gather ``V[\phi_i]``, ``sin(V[\phi_i])``, the index itself).

With several edge sites (multi-hop chains, independent heads) the value must be
a sum of per-edge terms $f = c + \sum_k g_k(\phi_k)$; this is checked on the
program's jaxpr (every path from two different edges meets only at
``add``/``sub`` or through linear maps with edge-independent operands; calls and
conditionals are entered and loops iterated to a fixed point, and a body that
``structinfer._jaxpr`` cannot read makes the model fall back). Then
$G_0 = F(j, 0, \dots)$, $G_k = F(0, \dots, j, \dots) - F(0, \dots, 0)$ (one staged run
of the model per edge, its probe beside the other edges' zeros) and
a chain $\phi_1 \leftarrow \phi_0$ gives
$\mathbb E[f] = P_0 (G_0 + P_1 G_1)$: one kernel per edge.

A model whose one edge has a [`Markov`][structinfer.priors.Markov] prior (a chain in a
``scan``) is read differently: its log-factors come from the exact engine's
enumeration (`structinfer.exact.chain_factors`: the first step's $a(\phi_0)$ and each
step's $\psi_t(\phi_{t-1}, \phi_t)$), the value must be recorded inside the scan and
read only the step's own edge (checked on the enumerated factors of a zero tilt), and its
table $F_t(j)$ is the value along the constant path $\phi_t = j$. The chain then runs
through the forward-backward kernel (`structinfer.lowering.markov`).

Anything else is reported as a `Fallback` naming the site and the part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.handlers import substitute, trace
from numpyro.primitives import Messenger

from .._checks import is_concrete, is_masked
from .._jaxpr import (
    Branch,
    Call,
    Loop,
    Unknown,
    classify,
    is_literal,
    loop_fixed_point,
    open_jaxpr,
    union,
)
from ..exact import NotAChainError, chain_factors, inspect_model, stage_at_probes
from ..handlers import TILT_PREFIX, contain, missing_value_error, require_values, tilt
from ..primitives import EDGE_INFO_KEY, SCAN_RECORD_KEY, SCORE_SUFFIX
from ._lower import Lowered, NotLowered, lower_edge
from ._views import eval_with_views, replay_with_views

__all__ = ["Plan", "Fallback", "recognise"]


@dataclass
class Fallback:
    """Why a model is not lowered: the site and the part that was not recognised."""

    site: str
    part: str
    reason: str

    def __str__(self) -> str:
        return f"site '{self.site}': {self.part}: {self.reason}"


@dataclass
class EdgePlan:
    name: str
    lowered: Lowered
    parent: str | None
    table: jax.Array  # G_k, (..., m_k, dv)


@dataclass
class MarkovPlan:
    """A recognised chain of Markov edges: its log-factors and value table."""

    name: str
    initial: jax.Array  # a, (K,)
    pair: jax.Array  # psi_t, (T - 1, K, K)
    table: jax.Array  # F_t(j), (T, K, dv)
    notes: tuple[str, ...]


@dataclass
class Plan:
    """A recognised model: one lowered edge per site, in trace order (or one chain)."""

    value: str
    edges: list[EdgePlan] = field(default_factory=list)
    markov: MarkovPlan | None = None
    out_shape: tuple[int, ...] = ()
    event_shape: tuple[int, ...] = ()
    fallback: Fallback | None = None

    @property
    def ok(self) -> bool:
        return self.fallback is None


class _Fail(Exception):
    def __init__(self, site, part, reason):
        self.fb = Fallback(site, part, reason)
        super().__init__(str(self.fb))


def _run(model, args, kwargs, values: dict):
    with contain():
        return trace(require_values(substitute(model, data=values))).get_trace(*args, **kwargs)


def _staged(model, args, kwargs, info, value):
    """The probe program when the inspection could not stage the model (its bounds check
    is best effort): stage it again; if that fails, a plain run at the probes raises the
    model's own error, and otherwise the model is not lowered."""
    try:
        return stage_at_probes(model, args, kwargs, info)
    except Exception as err:  # noqa: BLE001 - reported below
        probes = {e: jnp.asarray(p) for e, p in info.probes().items()}
        _run(model, args, kwargs, probes)
        raise _Fail(value, "model", "could not be traced with the edges at their probes "
                    f"({_first_line(err)})") from None


def _value_at(model, args, kwargs, values: dict, value: str):
    """The value site with the edges at ``values`` (NumPy arrays), from one staged run.

    The run is replayed through `eval_with_views`, which turns the constant-index
    gathers the probe drives (``Vindex(v)[..., phi, :]``) into views of the value matrix
    under a trace (concrete values come out as a plain run gives them). ``values`` must
    be NumPy arrays: a ``jnp.arange`` made under jit is a tracer, and the gather indices
    it produces would not fold at trace time. A model that cannot be staged is run.
    """
    try:
        return eval_with_views(
            lambda a, kw: _run(model, a, kw, values)[value]["value"], args, kwargs)
    except Exception:  # the plain run is always correct (or raises the model's error)
        return _run(model, args, kwargs, {e: jnp.asarray(v) for e, v in values.items()}
                    )[value]["value"]


def _probe_value(prog, value: str):
    """The value site at the probes, replayed from the model's staged probe program.

    The probe inputs are known constants, so the gathers they drive fold into views of
    the value matrix under a trace, as in `_value_at`.
    """
    vals = [prog.probes[e] for e in prog.probes]
    return replay_with_views(prog.jaxpr, vals, known=range(len(vals)),
                             outputs=[prog.output(value)])[0]


# --- separability of the value in the edges (jaxpr analysis) -------------------------

_UNARY_LINEAR = {
    "neg", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
    "copy", "copy_p", "reduce_sum", "reduce_precision", "real", "slice", "rev",
}


def _is_float(x) -> bool:
    aval = getattr(x, "aval", None)
    dt = getattr(aval, "dtype", None)
    return dt is not None and jnp.issubdtype(dt, jnp.inexact)


def _cast_is_linear(eqn) -> bool:
    """``convert_element_type`` is linear only float -> float (a cast to int / bool
    rounds or thresholds: ``(a + b).astype(int)`` is not ``a.astype(int) + b.astype(int)``)."""
    new = eqn.params.get("new_dtype")
    return (new is not None and jnp.issubdtype(new, jnp.inexact)
            and _is_float(eqn.invars[0]))


class _NotFollowed(Exception):
    """The value is computed by a primitive whose body the analysis cannot read."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason
        super().__init__(f"{name}: {reason}")


def _analyse_pairs(jaxpr, ins):
    """`_analyse` on ``(deps, separable)`` pairs, one per input and per output."""
    deps, sep = _analyse(jaxpr, [d for d, _ in ins], [s for _, s in ins])
    return list(zip(deps, sep))


def _join(a, b):
    """Join of two ``(deps, separable)`` values: deps union, separability conjunction."""
    return a[0] | b[0], a[1] and b[1]


def _loop_fixed_point(loop: Loop, get):
    """Deps / separability of a loop's results by iterating its body to a fixed point.

    The body's carry outputs are fed back into its carry inputs (deps union, separability
    conjunction) until nothing changes (`structinfer._jaxpr.loop_fixed_point`).
    A ``while`` whose condition reads an edge runs a number of times that depends on it:
    every result then depends on that edge too.
    """
    ncar = len(loop.carry)
    everything = union(get(x)[0] for x in loop.consts + loop.carry + loop.xs)
    point = loop_fixed_point(loop, get, _analyse_pairs, _join,
                             rounds=4 * (len(everything) + 1) * (ncar + 1))
    if point is None:  # pragma: no cover - no fixed point: be conservative
        n = ncar + len(loop.ys)
        return [everything] * n, [len(everything) <= 1] * n
    outs = list(point.outputs)
    if loop.length is None or loop.length < 1:  # may run zero times: the carry as given
        outs[:ncar] = point.carry
    odeps, osep = [d for d, _ in outs], [s for _, s in outs]
    if point.cond is not None:
        trips = union(d for d, _ in point.cond)
        if trips:
            odeps = [d | trips for d in odeps]
            osep = [s and len(d) <= 1 for s, d in zip(osep, odeps)]
    return odeps, osep


def _branch(branch: Branch, get):
    """Deps / separability of a conditional's results: each branch analysed; an edge that
    picks the branch joins every result."""
    index = get(branch.index)[0]
    ins = [get(x) for x in branch.operands]
    outs = [_analyse(b.jaxpr, [d for d, _ in ins], [s for _, s in ins]) for b in branch.branches]
    odeps = [union(ds) | index for ds in zip(*(d for d, _ in outs))]
    osep = [all(ss) and (not index or len(d) <= 1)
            for ss, d in zip(zip(*(s for _, s in outs)), odeps)]
    return odeps, osep


def _analyse(jaxpr, in_deps, in_sep):
    deps, sep = {}, {}
    for v, d, s in zip(jaxpr.invars, in_deps, in_sep):
        deps[v], sep[v] = d, s

    def get(x):
        if is_literal(x):
            return frozenset(), True
        return deps.get(x, frozenset()), sep.get(x, True)

    for eqn in jaxpr.eqns:
        ins = [get(x) for x in eqn.invars]
        ideps = [a for a, _ in ins]
        isep = [b for _, b in ins]
        name = eqn.primitive.name
        kind = classify(eqn)
        if isinstance(kind, Call):
            odeps, osep = _analyse(kind.body.jaxpr, ideps, isep)
        elif isinstance(kind, Loop):
            odeps, osep = _loop_fixed_point(kind, get)
        elif isinstance(kind, Branch):
            odeps, osep = _branch(kind, get)
        elif isinstance(kind, Unknown):
            if union(ideps):
                raise _NotFollowed(kind.name, kind.reason)
            odeps, osep = [frozenset()] * len(eqn.outvars), [True] * len(eqn.outvars)
        else:
            d = union(ideps)
            if len(d) <= 1:
                s = True
            elif name in ("add", "sub", "add_any", "concatenate"):
                s = all(isep)
            elif name in _UNARY_LINEAR:
                s = isep[0]
            elif name == "convert_element_type":
                s = isep[0] and _cast_is_linear(eqn)
            elif name in ("mul", "dot_general"):
                s = (not ideps[0] and isep[1]) or (not ideps[1] and isep[0])
            elif name == "div":  # integer division truncates: not linear
                s = not ideps[1] and isep[0] and _is_float(eqn.outvars[0])
            else:
                s = False
            odeps, osep = [d] * len(eqn.outvars), [s] * len(eqn.outvars)
        for v, d, s in zip(eqn.outvars, odeps, osep):
            deps[v], sep[v] = d, s
    outs = [get(x) for x in jaxpr.outvars]
    return [a for a, _ in outs], [b for _, b in outs]


def _is_separable(prog, value) -> bool:
    """Whether the value is a sum of per-edge terms, read off the staged probe program."""
    top = open_jaxpr(prog.jaxpr)
    if top is None:  # pragma: no cover - make_jaxpr always gives its constants' values
        return False
    n = len(prog.probes)
    in_deps = [frozenset([k]) for k in range(n)]
    try:
        _, sep = _analyse(top.jaxpr, in_deps, [True] * n)
    except _NotFollowed as err:
        raise _Fail(value, "value", f"is computed inside '{err.name}' ({err.reason}), so "
                    "whether it is a sum of per-edge terms is not known") from None
    return sep[prog.output(value)]


# --- value tables --------------------------------------------------------------------


def _extract(F, k: int, nesting: int, K: int, ev: int, m_k: int, value: str, float_dtype):
    """Probe output -> (plate batch without children, m_k, dv) table.

    A value that is not floating (integer token ids, counts, booleans) is averaged in the
    model's floating dtype ``float_dtype``, the dtype the exact engine answers it in."""
    F = jnp.asarray(F)
    shape = F.shape
    nb = len(shape) - ev
    R = nesting + K
    if nb > R:
        raise _Fail(value, "value", f"probe output has shape {shape}, more batch dims than "
                    f"plates + edges ({R})")
    F = F.reshape((1,) * (R - nb) + shape)
    probe_ax = K - 1 - k
    for a in range(K):
        if a != probe_ax and F.shape[a] != 1:
            raise _Fail(value, "value", "couples several edges in a way the probe cannot "
                        "separate")
    child_ax = R - 1
    if F.shape[child_ax] != 1:
        raise _Fail(
            value, "value",
            "depends on the child index itself, not only on the parent an edge picks "
            "(probe output varies along the children plate); lowered values are "
            "f(parent), e.g. V[phi] gathered with structinfer.gather",
        )
    keep = [a for a in range(R) if a == probe_ax or K <= a < child_ax]
    F = F.reshape(tuple(F.shape[a] for a in keep) + F.shape[R:])
    F = jnp.moveaxis(F, 0, nesting - 1)  # (*B', m|1, *E)
    lead = F.shape[: nesting - 1]
    ev_shape = F.shape[nesting:]
    dv = int(np.prod(ev_shape)) if ev_shape else 1
    F = F.reshape(lead + (F.shape[nesting - 1], dv))
    F = jnp.broadcast_to(F, lead + (m_k, dv))
    if not jnp.issubdtype(F.dtype, jnp.floating):
        F = F.astype(float_dtype)
    return F, ev_shape


def _diagonal_table(tables, model, args, kwargs, value, e, inf, nesting, ev) -> None:
    """Re-read a single edge's value table with the *diagonal* probe ``phi_i = i``.

    Once the enumeration-style probe has shown that the value does not vary with the
    child index, ``f(phi_i = i)`` at child ``i`` is ``F[i]`` — the same table, but
    produced in its natural ``(..., m, dv)`` layout (no transpose of the probe axis),
    so the compiled program equals a direct kernel call. Only when ``m == n`` and the
    table is concrete (it is checked equal to the probe's, which a traced table cannot
    be: then the model is not run again).
    """
    n, m = inf.num_children, inf.num_parents
    if n != m or not is_concrete(tables[e]):
        return
    diag = jnp.arange(n, dtype=jnp.int32).reshape((1,) * (nesting - 1) + (n,))
    F = jnp.asarray(_run(model, args, kwargs, {e: diag})[value]["value"])
    nb = F.ndim - ev
    old = tables[e]
    if nb < 1 or nb > nesting or F.shape[nb - 1] != n:
        return
    dv = old.shape[-1]
    F = F.reshape(F.shape[:nb] + (dv,))
    lead = F.shape[: nb - 1]
    try:
        jnp.broadcast_shapes(lead, old.shape[:-2])
    except ValueError:
        return
    F = F.astype(old.dtype)
    # A value that mixes children (``Vj - Vj.mean(axis=-2)``) gives a different table
    # under the diagonal probe: use it only when it is checked equal to the enumeration
    # probe's table (so never on traced values, where it cannot be checked).
    if not (is_concrete(F) and is_concrete(old)):
        return
    Fn, On = np.asarray(F), np.asarray(old)
    if Fn.shape != np.broadcast_shapes(Fn.shape, On.shape) or not np.array_equal(
        np.broadcast_to(Fn, np.broadcast_shapes(Fn.shape, On.shape)), On, equal_nan=True
    ):
        return
    tables[e] = F


def _check_unscaled(name: str, site: dict) -> None:
    """Edge and score sites must carry their log-density unscaled and unmasked.

    ``numpyro.handlers.scale`` tempers the exact posterior (``scale * (prior + score)``)
    and ``numpyro.handlers.mask`` makes a masked-out child's edge uniform (over the
    parents it allows); the kernels model neither, so any scale that is not identically
    1 and any mask fall back.
    """
    if site.get("mask") is not None or is_masked(site.get("fn")):
        raise _Fail(name, "mask", "is under numpyro.handlers.mask (a masked edge / score "
                    "term); the kernels do not model masked terms")
    sc = site.get("scale")
    if sc is None:
        return
    if not is_concrete(sc):
        raise _Fail(name, "scale", "is under numpyro.handlers.scale with a traced scale "
                    "(a tempered posterior); the kernels do not model scaled terms")
    if not np.all(np.asarray(sc) == 1):
        raise _Fail(name, "scale", f"is under numpyro.handlers.scale (scale={sc!r}: a "
                    "tempered posterior); the kernels do not model scaled terms")


def recognise(model, value: str, args: tuple, kwargs: dict) -> Plan:
    """Probe ``model`` and build a `Plan` (or one with a ``fallback``).

    Raises the exact engine's errors for a missing / non-deterministic ``value``
    site and for latent continuous sites without a value.
    """
    info = inspect_model(model, *args, **kwargs)
    info.check_value_site(value, model)
    plan = Plan(value)
    try:
        _build(plan, model, value, args, kwargs, info)
    except _Fail as e:
        plan.fallback = e.fb
        plan.edges = []
    return plan


def _build(plan: Plan, model, value, args, kwargs, info) -> None:
    names = list(info.edges)
    if not names:
        raise _Fail(value, "model", "has no structinfer.edge sites")
    for s in info.enumerated:
        if s not in names:
            raise _Fail(s, "site", "is an enumerated discrete site that is not a "
                        "structinfer.edge (no structured prior / score to lower)")
    for e in names:
        if info[e].edge is not None and info[e].edge.markov:
            _build_markov(plan, model, value, args, kwargs, info, e)
            return
    for e in names:
        if info.trace[e].get(SCAN_RECORD_KEY):
            raise _Fail(e, "scan", "is inside a numpyro scan (an attention per time step); "
                        "in a scan only a Markov chain of edges is lowered")
    N = info.max_plate_nesting
    K = len(names)
    sizes = {e: info.enumerated[e][1] for e in names}
    np_probes = info.probes()  # every enumerated site is an edge (checked above)
    np_zeros = {e: np.zeros((1,) * (N + 1 + k), np.int32) for k, e in enumerate(names)}
    if info.unvalued:  # the probe run needs every latent site's value
        raise missing_value_error(info.unvalued[0])
    prog = info.at_probes or _staged(model, args, kwargs, info, value)
    # Site messages (EdgeInfo, scales, masks, plates) come from the inspection run: an
    # edge's prior and score cannot hold another edge's enumeration dim (`edge` checks
    # their batch shape), so they are the same objects the probe run would record.
    tr = info.trace
    infos = {}
    for e in names:
        inf = tr[e]["infer"].get(EDGE_INFO_KEY)
        if inf is None:  # pragma: no cover - inspect_model already filtered
            raise _Fail(e, "site", "is not a structinfer.edge")
        infos[e] = inf
    for e in names:
        for name in (e, e + SCORE_SUFFIX):
            if name in tr:
                _check_unscaled(name, tr[name])
    parent: dict[str, str | None] = {}
    for e in names:
        c = infos[e].child
        if c is None:
            parent[e] = None
            continue
        match = [p for p in names if tr[p]["value"] is c]
        if not match:
            raise _Fail(e, "child", "follows a child index that is not the value of another "
                        "edge site (only chains child=<edge value> are lowered)")
        p = match[0]
        if infos[e].num_children != infos[p].num_parents:
            raise _Fail(e, "child", f"its table has {infos[e].num_children} children but "
                        f"edge '{p}' has {infos[p].num_parents} parents")
        parent[e] = p
    # other sites must not depend on the edges (their log-densities at the probes)
    for name, site in tr.items():
        if site["type"] != "sample" or name in infos:
            continue
        if name.endswith(SCORE_SUFFIX) and name[: -len(SCORE_SUFFIX)] in infos:
            continue
        shape = prog.shape(name)
        for k, e in enumerate(names):
            ax = N + 1 + k
            if len(shape) >= ax and shape[-ax] != 1:
                raise _Fail(
                    name, "likelihood",
                    f"its log-density depends on edge '{e}' (a likelihood term on the edge); "
                    "the kernels only model the prior and the score",
                )
    # the value must sit inside the children plate of the root edges
    vsite = tr[value]
    frames = {f.name for f in vsite.get("cond_indep_stack", []) or []}
    for e in names:
        if parent[e] is None and infos[e].children_plate not in frames:
            raise _Fail(value, "value", f"is recorded outside the children plate "
                        f"'{infos[e].children_plate}' of edge '{e}'")
    plain_shape, ev = info.deterministic[value]
    if K == 1:
        F = {names[0]: _probe_value(prog, value)}
    else:
        if not _is_separable(prog, value):
            raise _Fail(value, "value", "is not a sum of per-edge terms "
                        "f = c + sum_k g_k(phi_k) (checked on its jaxpr)")
        F = {e: _value_at(model, args, kwargs, {**np_zeros, e: np_probes[e]}, value)
             for e in names}
    tables = {}
    ev_shape = None
    depends = False
    for k, e in enumerate(names):
        Fe = jnp.asarray(F[e])
        nb = Fe.ndim - ev
        ax = N + 1 + k
        # the value has the edge's axis, and varies along it (with one parent it cannot:
        # having the axis is the dependence, as in the exact engine)
        if nb >= ax and (Fe.shape[nb - ax] != 1 or sizes[e] == 1):
            depends = True
        tables[e], ev_shape = _extract(Fe, k, N, K, ev, sizes[e], value, info.float_dtype)
    if not depends:
        raise _Fail(value, "value", "does not depend on any edge site")
    if K == 1:
        _diagonal_table(tables, model, args, kwargs, value, names[0], infos[names[0]], N, ev)
    if K > 1:
        base = tables[names[0]][..., 0:1, :]
        for e in names[1:]:
            tables[e] = tables[e] - base
    for e in names:
        inf = infos[e]
        plate_batch = tuple(info.enumerated[e][0][:-1])
        try:
            low = lower_edge(inf.prior, inf.score, tables[e], inf.num_children, plate_batch,
                             site=e)
        except NotLowered as err:
            raise _Fail(e, err.part, err.reason) from None
        plan.edges.append(EdgePlan(e, low, parent[e], tables[e]))
    plan.out_shape = tuple(plain_shape)
    plan.event_shape = tuple(ev_shape)


class _ScanCalls(Messenger):
    """Record the direction (``reverse``) of every ``numpyro.contrib.control_flow.scan``
    the model runs (``None`` where the message's layout is not the one known)."""

    def __init__(self):
        self.reverse: list = []
        super().__init__()

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "control_flow":
            args = msg.get("args") or ()
            rev = args[4] if len(args) == 5 else None
            self.reverse.append(bool(rev) if isinstance(rev, (bool, np.bool_)) else None)


def _first_line(err: Exception) -> str:
    """An exception as ``Type: its message's first line`` (for a fallback reason)."""
    msg = str(err)
    return f"{type(err).__name__}: {msg.splitlines()[0] if msg else ''}"


def _build_markov(plan: Plan, model, value, args, kwargs, info, e: str) -> None:
    """A chain of Markov edges: its factors, the value's table, and the checks between."""
    if len(info.edges) != 1:
        raise _Fail(e, "prior", f"has a Markov prior next to other edge sites "
                    f"{sorted(n for n in info.edges if n != e)}: only a single chain is "
                    "fused")
    batch, k = info.enumerated[e]
    if len(batch) != 1:
        raise _Fail(e, "prior", f"has a Markov prior under a plate (shape {tuple(batch)}, "
                    "several chains at once): only a single chain is fused (vmap the "
                    "attention function over the chains instead)")
    steps = batch[0]
    shape, ev = info.deterministic[value]
    if len(shape) != ev + 1 or shape[0] != steps:
        raise _Fail(value, "value", f"has shape {tuple(shape)}: a lowered chain's value is "
                    f"recorded inside the scan, one per step ({steps}, ...)")
    tilted = tilt(model, tilts={value: (jnp.zeros(shape, info.float_dtype), ev)},
                  max_plate_nesting=info.max_plate_nesting)
    try:
        # the tilted model says which chain variables the value reads (its arrays are
        # dropped under jit); the factors come from the model itself
        reads = chain_factors(tilted, args, kwargs, info=info).reads
        cf = chain_factors(model, args, kwargs, info=info)
    except NotAChainError as err:
        raise _Fail(e, "chain", str(err)) from None
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as err:
        raise _Fail(e, "chain", "its enumerated factors could not be read "
                    f"({_first_line(err)})") from None
    for name, r in reads.items():
        if name.endswith(TILT_PREFIX + value) and "previous" in r:
            raise _Fail(value, "value", f"reads the previous edge of '{e}' (through the "
                        "scan's carry): lowered values are f(phi_t) of the step's own edge")
    dtype = jnp.asarray(-1).dtype  # the integer dtype of the scan's carry

    # one run (vmapped over the paths) reads the table and the direction of every scan
    scans = _ScanCalls()

    def along(j):
        path = jnp.full((steps,), j, dtype)
        with contain(), scans:
            tr = trace(require_values(substitute(model, data={e: path}))
                       ).get_trace(*args, **kwargs)
        return jnp.asarray(tr[value]["value"])

    failed = None
    try:
        F = jax.vmap(along)(jnp.arange(k, dtype=dtype))  # (K, T, *ev)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as err:
        failed = err
    if any(r is not False for r in scans.reverse):
        raise _Fail(e, "chain", "runs in a scan with reverse=True (or one whose direction "
                    "is not known): only forward scans are fused")
    if failed is not None:
        raise _Fail(value, "value", "could not be read along a path of the chain "
                    f"({_first_line(failed)})") from None
    F = jnp.moveaxis(F.reshape((k, steps, -1)), 0, 1)  # (T, K, dv)
    if not jnp.issubdtype(F.dtype, jnp.floating):
        F = F.astype(info.float_dtype)
    plan.markov = MarkovPlan(e, cf.initial, cf.pair, F, (
        f"Markov prior: a chain of {steps} edge{'' if steps == 1 else 's'} over {k} states, "
        "run as a forward-backward scan over the chain (log-space, O(T K^2) time)",
        f"factors of {len(cf.reads)} sites read off the "
        "enumerated scan; value "
        f"f(phi_t) table ({steps}, {k}, {F.shape[-1]})",
    ))
    plan.out_shape = tuple(shape)
    plan.event_shape = tuple(shape[1:])
