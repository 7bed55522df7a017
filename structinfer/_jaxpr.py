r"""One way into a jaxpr's nested bodies, the same on every JAX release.

The package reads jaxprs in four places: the index-bounds check (``exact/bounds.py``),
the lowering's separability analysis and its view-rewriting replay
(``lowering/_recognise.py``, ``lowering/_views.py``) and the Laplace expansion's
dependence check (``infer/laplace_approx.py``). Each of them walks a jaxpr equation by
equation, and the equations that hold a body — a call, a loop, a conditional — are read
here, through `classify`, never by indexing an equation's params directly.

JAX changes that layout between releases: up to 0.10 a ``scan`` carries
``num_consts`` / ``num_carry`` and a ``ClosedJaxpr`` body; from 0.11 it carries
``ft_in`` / ``ft_out`` groups and the body is a ``Jaxpr`` with its constants attached
(``ClosedJaxpr`` became an alias of ``Jaxpr``). `classify` reads either, and when
neither is there it derives the split from the body's types alone: for a scan, the
body's inputs are $(c, h, x)$ and its outputs $(h', y)$ with

$$
\mathrm{type}(h'_i) = \mathrm{type}(h_i), \qquad
\mathrm{shape}(\text{operand } x_j) = (L,) + \mathrm{shape}(x_j), \qquad
\mathrm{shape}(\text{result } y_j) = (L,) + \mathrm{shape}(y_j),
$$

($L$ the trip count), which fixes the number of carries from the outputs and then the
number of constants from the inputs. A split, wherever it comes from, is checked
against those types before it is used.

What `classify` does not understand — a primitive with a body it does not know, or a
known one whose layout does not check — is reported as `Unknown`, so that each caller
can be conservative (the lowering falls back to the exact engine, the bounds check
leaves the read unchecked, the Laplace check counts every operand as a dependence)
instead of failing inside its analysis.

The analyses that follow values through a loop share its iteration to a fixed point
(`loop_fixed_point`) and the join of dependence sets (`union`); each keeps its own
abstract values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from jax.extend import core as jex_core

__all__ = [
    "Body",
    "Branch",
    "Call",
    "Loop",
    "LoopFixedPoint",
    "Unknown",
    "classify",
    "is_literal",
    "loop_fixed_point",
    "open_jaxpr",
    "union",
]

#: plain function calls: the body runs once on the operands, nothing else attached
_PLAIN_CALLS = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "eval_jaxpr", "xla_call", "named_call"}
)
#: calls whose body gives the values but that carry their own derivative rule
_CUSTOM_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
#: calls whose body gives the values and that are rematerialised when differentiated
_REMAT_CALLS = frozenset({"checkpoint", "remat", "remat2"})
#: where a call keeps its body, most likely first
_BODY_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def is_literal(atom: Any) -> bool:
    """Whether an equation operand is a literal (its value in ``atom.val``), not a variable."""
    return isinstance(atom, jex_core.Literal)


@dataclass(frozen=True)
class Body:
    """A sub-jaxpr, opened: the equations to walk and the values of its constants.

    Attributes:
        jaxpr: the open jaxpr (``constvars``, ``invars``, ``outvars``, ``eqns``).
        consts: one value per ``jaxpr.constvars``.
    """

    jaxpr: Any
    consts: tuple


def _is_jaxpr_like(x: Any) -> bool:
    inner = getattr(x, "jaxpr", x)
    return all(hasattr(inner, a) for a in ("eqns", "invars", "outvars"))


def open_jaxpr(j: Any) -> Body | None:
    """A `Body` from a ``ClosedJaxpr``, a ``Jaxpr`` with attached constants (JAX 0.11) or a
    bare ``Jaxpr`` without constants; None for anything else (constants without values).
    """
    if j is None or not _is_jaxpr_like(j):
        return None
    inner = getattr(j, "jaxpr", j)  # ClosedJaxpr -> Jaxpr; on 0.11 ``Jaxpr.jaxpr`` is itself
    constvars = list(getattr(inner, "constvars", ()))
    consts = tuple(getattr(j, "consts", None) or ())
    if len(consts) != len(constvars):
        return None
    return Body(inner, consts)


@dataclass(frozen=True)
class Call:
    """A call: ``body`` runs once, operand ``i`` is its input ``i``, result ``k`` its output ``k``.

    Attributes:
        name: the primitive's name.
        kind: ``"call"`` for a plain function call (``jit``, ``closed_call``), ``"custom"``
            for ``custom_jvp`` / ``custom_vjp`` (the body gives the values, the derivative
            is the user's), ``"remat"`` for ``jax.checkpoint``.
        body: the body.
    """

    name: str
    kind: str
    body: Body


@dataclass(frozen=True)
class Loop:
    r"""A loop: ``body`` runs a number of times, carrying state from one run to the next.

    The body's inputs are ``consts + carry + xs`` and its outputs ``carry + ys``: the
    equation's operands split into ``consts`` (the same every iteration), ``carry`` (the
    initial state) and ``xs`` (scanned, one slice per iteration), its results into
    ``carry_out`` (the final state) and ``ys`` (stacked, one slice per iteration).

    Attributes:
        name: ``"scan"`` or ``"while"``.
        body: the body.
        consts: the operands read unchanged every iteration.
        carry: the operands that initialise the state.
        xs: the scanned operands (none for ``while``).
        carry_out: the results that hold the final state.
        ys: the stacked results (none for ``while``).
        length: the trip count of a ``scan``; None for ``while``.
        cond: a ``while``'s condition, on ``cond_consts + carry``; None for ``scan``.
        cond_consts: the operands only the condition reads.
    """

    name: str
    body: Body
    consts: tuple
    carry: tuple
    xs: tuple
    carry_out: tuple
    ys: tuple
    length: int | None = None
    cond: Body | None = None
    cond_consts: tuple = ()


@dataclass(frozen=True)
class Branch:
    """A conditional (``lax.cond`` / ``lax.switch``): ``branches[index]`` runs on ``operands``.

    Attributes:
        index: the operand that picks the branch.
        operands: the operands every branch reads (branch input ``i`` is ``operands[i]``).
        branches: the branches; result ``k`` is output ``k`` of the one that ran.
    """

    index: Any
    operands: tuple
    branches: tuple[Body, ...]


@dataclass(frozen=True)
class Unknown:
    """An equation with a body that this module does not understand.

    Attributes:
        name: the primitive's name.
        reason: what was not understood.
    """

    name: str
    reason: str


def union(sets: Iterable[frozenset]) -> frozenset:
    """The union of some sets, as a frozenset (empty for none): the join of dependences."""
    return frozenset().union(*sets)


@dataclass(frozen=True)
class LoopFixedPoint:
    """A loop's body analysed at the fixed point of its carried values.

    Attributes:
        carry: each carry's abstract value at the fixed point: the initial carry joined
            with everything the body makes of it (what the final state can be, after any
            number of iterations, none included).
        outputs: the body's outputs (``carry_out + ys``) analysed at ``carry`` (what one
            more iteration gives).
        cond: a ``while`` condition's outputs analysed at ``cond_consts + carry``; None
            for a ``scan``.
    """

    carry: tuple
    outputs: tuple
    cond: tuple | None


def loop_fixed_point(
    loop: Loop,
    get: Callable[[Any], Any],
    analyse: Callable[[Any, list], list],
    join: Callable[[Any, Any], Any],
    rounds: int,
) -> LoopFixedPoint | None:
    r"""Iterate an abstract interpretation of a loop's body until its carry stops changing.

    With $a$ the abstract values of the body's inputs (``get`` of the loop's operands),
    the carry is updated as

    $$h^{(t+1)} = h^{(t)} \sqcup \mathrm{body}(c, h^{(t)}, x)_{\text{carry}}$$

    (``join`` is $\sqcup$) until $h^{(t+1)} = h^{(t)}$, so effects that take several
    iterations to appear (``c <- a`` then ``d <- d + c * b``) are seen. The values form
    a finite lattice, so a monotone analysis stops; ``rounds`` bounds the iterations.

    Args:
        loop: the loop (from `classify`).
        get: an operand's abstract value (literals included) in the enclosing jaxpr.
        analyse: ``analyse(jaxpr, inputs) -> outputs``, the caller's analysis of an open
            jaxpr, one abstract value per input and per output.
        join: the join of two abstract values of one carry.
        rounds: the most iterations to run.

    Returns:
        A `LoopFixedPoint`, or None when ``rounds`` iterations did not reach one (the
        caller is then conservative).
    """
    consts, xs = [get(x) for x in loop.consts], [get(x) for x in loop.xs]
    carry = [get(x) for x in loop.carry]
    for _ in range(rounds):
        outs = analyse(loop.body.jaxpr, consts + carry + xs)
        grown = [join(c, o) for c, o in zip(carry, outs)]
        if grown == carry:
            break
        carry = grown
    else:
        return None
    cond = None
    if loop.cond is not None:
        cond = tuple(analyse(loop.cond.jaxpr, [get(x) for x in loop.cond_consts] + carry))
    return LoopFixedPoint(tuple(carry), tuple(outs), cond)


def classify(eqn: Any) -> Call | Loop | Branch | Unknown | None:
    """Read an equation's nested bodies, whatever the JAX release's layout.

    Args:
        eqn: a jaxpr equation (anything with ``primitive.name``, ``params``, ``invars``,
            ``outvars``).

    Returns:
        None for a first-order primitive (no jaxpr among its params); a `Call`, `Loop`
        or `Branch`; or `Unknown` for a body this module cannot read. Never raises.
    """
    try:
        name = str(eqn.primitive.name)
        params = dict(eqn.params)
    except Exception:  # not an equation we can read at all
        return Unknown(
            str(getattr(getattr(eqn, "primitive", None), "name", eqn)), "not a jaxpr equation"
        )
    if not any(_is_jaxpr_like(v) for v in _param_values(params)):
        return None
    try:
        if name in _PLAIN_CALLS or name in _CUSTOM_CALLS or name in _REMAT_CALLS:
            return _call(eqn, name, params)
        if name == "scan":
            return _scan(eqn, params)
        if name == "while":
            return _while(eqn, params)
        if name == "cond":
            return _cond(eqn, params)
    except Exception as err:  # a layout we do not know: be conservative, never crash
        return Unknown(name, f"could not read its params ({type(err).__name__}: {err})")
    return Unknown(name, "a primitive with a body that the analysis does not follow")


def _param_values(params: dict) -> list:
    out = []
    for v in params.values():
        out.extend(v if isinstance(v, (tuple, list)) else (v,))
    return out


def _body_param(params: dict, keys: Sequence[str]) -> Body | None:
    """The body under the first of ``keys`` present, else the only jaxpr among the params."""
    for key in keys:
        if key in params and params[key] is not None:
            return open_jaxpr(params[key])
    found = [v for v in params.values() if _is_jaxpr_like(v)]
    return open_jaxpr(found[0]) if len(found) == 1 else None


def _call(eqn, name: str, params: dict) -> Call | Unknown:
    body = _body_param(params, _BODY_KEYS)
    if body is None:
        return Unknown(name, "its body has constants without values")
    if len(body.jaxpr.invars) != len(eqn.invars) or len(body.jaxpr.outvars) != len(eqn.outvars):
        return Unknown(name, "its body's inputs / outputs do not match its operands / results")
    kind = "call" if name in _PLAIN_CALLS else "custom" if name in _CUSTOM_CALLS else "remat"
    return Call(name, kind, body)


def _aval(atom):
    return getattr(atom, "aval", None)


def _shape(atom) -> tuple | None:
    shape = getattr(_aval(atom), "shape", None)
    return None if shape is None else tuple(shape)


def _same_type(a, b) -> bool:
    """Same shape and dtype (weak types aside)."""
    sa, sb = _shape(a), _shape(b)
    if sa is None or sb is None or sa != sb:
        return False
    return getattr(_aval(a), "dtype", None) == getattr(_aval(b), "dtype", None)


def _stacked(outer, inner, length: int | None) -> bool:
    """``outer`` is ``inner`` stacked along a new leading axis (of size ``length``)."""
    so, si = _shape(outer), _shape(inner)
    if so is None or si is None or len(so) != len(si) + 1 or so[1:] != si:
        return False
    if length is not None and so[0] != length:
        return False
    return getattr(_aval(outer), "dtype", None) == getattr(_aval(inner), "dtype", None)


def _group_sizes(tree) -> tuple[int, ...] | None:
    """Leaves per top-level group of a JAX 0.11 ``ft_in`` / ``ft_out`` (a ``FlatTree``,
    or its nested-tuple picture ``((), (None,), (None,))``)."""
    if tree is None:
        return None
    unpack = getattr(tree, "unpack", None)
    if callable(unpack):
        return tuple(len(g) for g in unpack())
    if isinstance(tree, (tuple, list)):
        return tuple(_count_leaves(g) for g in tree)
    return None


def _count_leaves(g) -> int:
    if isinstance(g, (tuple, list)):
        return sum(_count_leaves(x) for x in g)
    if callable(getattr(g, "unpack", None)):
        return len(g)
    return 1


def _scan_split_ok(eqn, body: Body, nc: int, ncar: int, length) -> bool:
    ins, outs = list(eqn.invars), list(eqn.outvars)
    bins, bouts = list(body.jaxpr.invars), list(body.jaxpr.outvars)
    if min(nc, ncar) < 0 or nc + ncar > len(ins) or ncar > len(outs):
        return False
    if len(bins) != len(ins) or len(bouts) != len(outs):
        return False
    if not all(_same_type(o, i) for o, i in zip(ins[: nc + ncar], bins[: nc + ncar])):
        return False
    if not all(
        _same_type(bouts[i], bins[nc + i]) and _same_type(outs[i], ins[nc + i]) for i in range(ncar)
    ):
        return False
    if not all(_stacked(o, i, length) for o, i in zip(ins[nc + ncar :], bins[nc + ncar :])):
        return False
    return all(_stacked(o, i, length) for o, i in zip(outs[ncar:], bouts[ncar:]))


def _scan_split_from_types(eqn, body: Body, length) -> tuple[int, int] | None:
    """The only ``(num_consts, num_carry)`` the types allow, or None."""
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    found = [
        (nc, ncar)
        for ncar in range(n_out + 1)
        for nc in range(n_in - ncar + 1)
        if _scan_split_ok(eqn, body, nc, ncar, length)
    ]
    return found[0] if len(found) == 1 else None


def _scan(eqn, params: dict) -> Loop | Unknown:
    body = _body_param(params, ("jaxpr",))
    if body is None:
        return Unknown("scan", "its body has constants without values")
    length = params.get("length")
    length = length if isinstance(length, int) else None
    n_in = len(eqn.invars)
    split = None
    if isinstance(params.get("num_consts"), int) and isinstance(params.get("num_carry"), int):
        split = (params["num_consts"], params["num_carry"])  # JAX up to 0.10
    else:
        groups = _group_sizes(params.get("ft_in"))  # JAX 0.11: (consts, carry, xs)
        if groups is not None and len(groups) == 3 and sum(groups) == n_in:
            split = (groups[0], groups[1])
    if split is None or not _scan_split_ok(eqn, body, *split, length):
        split = _scan_split_from_types(eqn, body, length)
    if split is None:
        return Unknown("scan", "its operands do not split into consts, carry and xs")
    nc, ncar = split
    ins, outs = tuple(eqn.invars), tuple(eqn.outvars)
    return Loop(
        "scan",
        body,
        ins[:nc],
        ins[nc : nc + ncar],
        ins[nc + ncar :],
        outs[:ncar],
        outs[ncar:],
        length=length,
    )


def _while(eqn, params: dict) -> Loop | Unknown:
    body = open_jaxpr(params.get("body_jaxpr"))
    cond = open_jaxpr(params.get("cond_jaxpr"))
    if body is None or cond is None:
        return Unknown("while", "its body or condition could not be read")
    ins, outs = tuple(eqn.invars), tuple(eqn.outvars)
    ncar = len(outs)
    nb, ncc = params.get("body_nconsts"), params.get("cond_nconsts")
    if not (isinstance(nb, int) and isinstance(ncc, int)):
        nb, ncc = len(body.jaxpr.invars) - ncar, len(cond.jaxpr.invars) - ncar
    bins, cins = list(body.jaxpr.invars), list(cond.jaxpr.invars)
    ok = (
        min(nb, ncc) >= 0
        and ncc + nb + ncar == len(ins)
        and len(bins) == nb + ncar
        and len(cins) == ncc + ncar
        and len(body.jaxpr.outvars) == ncar
        and len(cond.jaxpr.outvars) == 1
        and all(_same_type(a, b) for a, b in zip(ins[ncc:], bins))
        and all(_same_type(a, b) for a, b in zip(ins[:ncc], cins[:ncc]))
        and all(_same_type(a, b) for a, b in zip(ins[ncc + nb :], cins[ncc:]))
        and all(_same_type(a, b) for a, b in zip(body.jaxpr.outvars, bins[nb:]))
        and all(_same_type(a, b) for a, b in zip(outs, bins[nb:]))
    )
    if not ok:
        return Unknown("while", "its operands do not split into consts and carry")
    return Loop(
        "while",
        body,
        ins[ncc : ncc + nb],
        ins[ncc + nb :],
        (),
        outs,
        (),
        cond=cond,
        cond_consts=ins[:ncc],
    )


def _cond(eqn, params: dict) -> Branch | Unknown:
    raw = params.get("branches")
    if not isinstance(raw, (tuple, list)) or not raw:
        return Unknown("cond", "its branches could not be read")
    branches = tuple(open_jaxpr(b) for b in raw)
    ops = tuple(eqn.invars[1:])
    if any(
        b is None or len(b.jaxpr.invars) != len(ops) or len(b.jaxpr.outvars) != len(eqn.outvars)
        for b in branches
    ):
        return Unknown("cond", "its branches do not match its operands / results")
    return Branch(eqn.invars[0], ops, branches)
