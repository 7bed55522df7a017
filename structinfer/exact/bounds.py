r"""Static index-bounds check: no table is read past its end at an edge value.

An edge site takes values $\phi_i \in \{0, \dots, m-1\}$. A model that reads a
table with fewer than $m$ rows at $\phi_i$ (``V[phi]`` with ``V`` of
``k < m`` rows) gets a *clamped* row from JAX's indexing — a finite wrong number in
every engine. This module checks, at trace time, every gather of the model's jaxpr
whose index *is* an edge value (up to broadcasting, reshaping, concatenation into an
index vector and JAX's negative-index wrap): each integer array derived from the edge
values carries a range $[lo, hi]$ (one per component of the last axis), and a
clamping read whose edge component can leave the operand's bounds is an error.

Reads the model shaped on purpose are left alone: an index computed with arithmetic
(``where(phi < k, phi, 0)``, ``clip``, an offset; not a ``maximum`` / ``minimum`` with
a bound the edge's range never reaches, which leaves the value as it is),
``jnp.take(..., mode="clip")`` (explicit clipping) and a ``"fill"`` read of a floating table (NaN past the end; an
integer or boolean table fills with a number, the most negative integer, which is no
safer than a clamped entry, so such a read is checked). Calls (``jit``, ``custom_jvp``,
``checkpoint``) are entered; the bodies it does not follow — loops, conditionals (whose
branch may be the model's own guard) and primitives it does not know — cannot be proved
in bounds and are left unchecked, as are their results. So is a read inside a
``jax.vmap`` over the edge values (``vmap(lambda j: v[j])(phi)``): JAX writes the
mapped scalar read as a clipping gather, which this check cannot tell from
``mode="clip"``. Shapes are static, so eager and ``jit`` agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .._jaxpr import Call, classify, is_literal, open_jaxpr

__all__ = ["IndexOutOfBounds", "check_gather_bounds", "check_jaxpr_bounds"]


class IndexOutOfBounds(ValueError):
    """An edge value indexes an array past its end."""


@dataclass(frozen=True)
class _Range:
    """Integer range per component of the last axis, or one for all.

    ``direct[k]``: component ``k`` *is* an edge value (up to broadcasting, reshaping,
    JAX's negative-index wrap): only such reads are checked. Any arithmetic on the
    index (``where``, ``clip``, an offset) is the model's own business.
    """

    lo: tuple[int, ...]
    hi: tuple[int, ...]
    sites: frozenset[str]
    direct: tuple[bool, ...] = (False,)

    @staticmethod
    def of(lo, hi, sites=frozenset(), direct=False):
        return _Range((int(lo),), (int(hi),), frozenset(sites), (bool(direct),))

    def union(self) -> _Range:
        return _Range((min(self.lo),), (max(self.hi),), self.sites, (all(self.direct),))

    def derived(self) -> _Range:
        """The same range, no longer an edge value itself."""
        return _Range(self.lo, self.hi, self.sites, (False,) * len(self.direct))

    def comp(self, k: int) -> tuple[int, int, bool]:
        if len(self.lo) > 1:
            return self.lo[k], self.hi[k], self.direct[k]
        return self.lo[0], self.hi[0], self.direct[0]


def _is_int(aval) -> bool:
    dt = getattr(aval, "dtype", None)
    try:
        return dt is not None and (np.issubdtype(dt, np.integer) or np.issubdtype(dt, np.bool_))
    except TypeError:  # extended dtypes (PRNG keys) are not NumPy dtypes
        return False


def _const_range(x) -> _Range | None:
    if isinstance(x, jax.core.Tracer):
        return None
    dt = getattr(x, "dtype", None)
    if dt is not None and not _is_int(x):
        return None
    try:
        a = np.asarray(x)
    except Exception:  # pragma: no cover - exotic constants
        return None
    if a.size == 0 or not (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
        return None
    return _Range.of(a.min(), a.max())


def _binop(name, a: _Range, b: _Range) -> _Range | None:
    a, b = a.union(), b.union()
    (alo,), (ahi,), (blo,), (bhi,) = a.lo, a.hi, b.lo, b.hi
    sites = a.sites | b.sites
    if name == "add":
        return _Range.of(alo + blo, ahi + bhi, sites)
    if name == "sub":
        return _Range.of(alo - bhi, ahi - blo, sites)
    if name == "mul":
        c = [alo * blo, alo * bhi, ahi * blo, ahi * bhi]
        return _Range.of(min(c), max(c), sites)
    if name == "max":
        return _Range.of(max(alo, blo), max(ahi, bhi), sites)
    if name == "min":
        return _Range.of(min(alo, blo), min(ahi, bhi), sites)
    cmp = {
        "lt": (ahi < blo, alo >= bhi),
        "le": (ahi <= blo, alo > bhi),
        "gt": (alo > bhi, ahi <= blo),
        "ge": (alo >= bhi, ahi < blo),
    }.get(name)
    if cmp is not None:
        always, never = cmp
        return _Range.of(1 if always else 0, 0 if never else 1, sites)
    return None


_SHAPE_OPS = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
              "convert_element_type", "copy", "copy_p", "slice", "rev"}


def _keeps_last_axis(eqn, r: _Range) -> bool:
    if len(r.lo) == 1:
        return True
    ins, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    if not ins or not out or ins[-1] != out[-1]:
        return False
    if eqn.primitive.name == "broadcast_in_dim":
        return eqn.params["broadcast_dimensions"][-1] == len(out) - 1
    if eqn.primitive.name == "transpose":
        return eqn.params["permutation"][-1] == len(ins) - 1
    return eqn.primitive.name in ("convert_element_type", "copy", "copy_p")


def _walk(jaxpr, env: dict, where: str) -> None:
    def read(v):
        if is_literal(v):
            return _const_range(v.val)
        return env.get(v)

    defs = {}
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            defs[v] = eqn
        name = eqn.primitive.name
        ins = [read(v) for v in eqn.invars]
        if name == "gather" and len(ins) > 1 and ins[1] is not None and ins[1].sites:
            _check_gather(eqn, ins[1], where)
            continue
        kind = classify(eqn)
        if isinstance(kind, Call):  # jit, custom_jvp, checkpoint: the body runs once
            inner = kind.body.jaxpr
            sub_env = {v: _const_range(c) for v, c in zip(inner.constvars, kind.body.consts)}
            sub_env.update({v: r for v, r in zip(inner.invars, ins) if r is not None})
            _walk(inner, sub_env, where)
            for o, io in zip(eqn.outvars, inner.outvars):
                r = _const_range(io.val) if is_literal(io) else sub_env.get(io)
                if r is not None:
                    env[o] = r
            continue
        if kind is not None:  # loops, conditionals, unknown bodies: not followed
            continue
        if not eqn.outvars or not _is_int(eqn.outvars[0].aval):
            continue
        out = None
        if name == "iota":
            size = eqn.params["shape"][eqn.params["dimension"]]
            out = _Range.of(0, size - 1)
        elif name in _SHAPE_OPS and ins and ins[0] is not None:
            out = ins[0] if _keeps_last_axis(eqn, ins[0]) else ins[0].union()
        elif name == "neg" and ins[0] is not None:
            u = ins[0].union()
            out = _Range.of(-u.hi[0], -u.lo[0], u.sites)
        elif name in ("max", "min") and None not in ins and _bound_is_identity(name, ins):
            out = next(r for r in ins if r.sites)  # max(phi, 0), min(phi, big): phi itself
        elif name in ("add", "sub", "mul", "max", "min", "lt", "le", "gt", "ge") and None not in ins:
            out = _binop(name, ins[0], ins[1])
        elif name == "clamp" and None not in ins:
            lo, x, hi = (r.union() for r in ins)
            out = _Range.of(max(lo.lo[0], min(x.lo[0], hi.hi[0])),
                            min(hi.hi[0], max(x.hi[0], lo.lo[0])), x.sites)
        elif name == "select_n" and None not in ins:
            pred, cases = ins[0].union(), ins[1:]
            wrapped = _negative_index_wrap(eqn, defs)
            if pred.lo[0] == pred.hi[0] and pred.lo[0] < len(cases):
                out = cases[pred.lo[0]]
            elif wrapped is not None:
                # select_n(x < 0, x, x + k): x where x >= 0, x + k where x < 0
                u = cases[0].union()
                lo, hi = u.lo[0], u.hi[0]
                parts = [(max(lo, 0), hi)] if hi >= 0 else []
                parts += [(lo + wrapped, min(hi, -1) + wrapped)] if lo < 0 else []
                out = _Range.of(min(a for a, _ in parts), max(b for _, b in parts), u.sites,
                                u.direct[0])
            else:
                us = [c.union() for c in cases]
                out = _Range.of(min(u.lo[0] for u in us), max(u.hi[0] for u in us),
                                frozenset().union(*(u.sites for u in us)))
        elif name == "concatenate" and None not in ins:
            dim = eqn.params["dimension"]
            if dim == eqn.outvars[0].aval.ndim - 1:
                lo, hi, direct = [], [], []
                for v, r in zip(eqn.invars, ins):
                    k = v.aval.shape[-1]
                    for c in range(k):
                        a, b, dr = r.comp(c) if len(r.lo) == k else r.union().comp(0)
                        lo.append(a)
                        hi.append(b)
                        direct.append(dr)
                out = _Range(tuple(lo), tuple(hi), frozenset().union(*(r.sites for r in ins)),
                             tuple(direct))
            else:
                us = [r.union() for r in ins]
                out = _Range.of(min(u.lo[0] for u in us), max(u.hi[0] for u in us),
                                frozenset().union(*(u.sites for u in us)))
        if out is not None:
            env[eqn.outvars[0]] = out


def _bound_is_identity(name: str, ins: list[_Range]) -> bool:
    """Whether ``max`` / ``min`` of an edge-derived operand and a constant bound leaves the
    operand as it is at every value of its range (a guard the range never reaches)."""
    edge = [r for r in ins if r.sites]
    if len(edge) != 1:
        return False
    x, c = edge[0].union(), next(r for r in ins if not r.sites).union()
    if name == "max":
        return c.hi[0] <= x.lo[0]
    return c.lo[0] >= x.hi[0]


def _literal(v):
    return v.val if is_literal(v) else None


def _negative_index_wrap(eqn, defs) -> int | None:
    """``k`` when ``eqn`` is JAX's negative-index normalisation ``select_n(x < 0, x, x + k)``."""
    if len(eqn.invars) != 3:
        return None
    p, x, y = eqn.invars
    pe, ye = defs.get(p), defs.get(y)
    if pe is None or ye is None or pe.primitive.name != "lt" or ye.primitive.name != "add":
        return None
    if pe.invars[0] is not x or _literal(pe.invars[1]) is None or int(_literal(pe.invars[1])) != 0:
        return None
    if ye.invars[0] is not x or _literal(ye.invars[1]) is None:
        return None
    return int(_literal(ye.invars[1]))


def _default_integer_fill(eqn) -> bool:
    """A fill-mode gather of an integer or boolean table with JAX's default fill (the most
    negative integer, True): a number a later read turns into a wrong finite row, unlike a
    float table's NaN or a ``fill_value`` the model gave (``jnp.take(..., fill_value=-1)``
    and a guard on it)."""
    dtype = np.dtype(eqn.invars[0].aval.dtype)
    if np.issubdtype(dtype, np.inexact):
        return False
    fill = eqn.params.get("fill_value")
    default = True if dtype == np.bool_ else np.iinfo(dtype).min
    return fill is None or fill == default


def _check_gather(eqn, idx: _Range, where: str) -> None:
    mode = str(eqn.params.get("mode", "")).upper()
    if "CLIP" in mode:  # asked for clipping
        return
    if "FILL" in mode and not _default_integer_fill(eqn):
        return  # NaN past the end, or a fill value the model chose (and can test for)
    dn = eqn.params["dimension_numbers"]
    operand = eqn.invars[0].aval.shape
    sizes = eqn.params["slice_sizes"]
    for k, d in enumerate(dn.start_index_map):
        lo, hi, direct = idx.comp(k)
        limit = operand[d] - sizes[d]
        if direct and (lo < 0 or hi > limit):
            sites = ", ".join(f"'{s}'" for s in sorted(idx.sites))
            raise IndexOutOfBounds(
                f"{where}: an index computed from edge site(s) {sites} takes values "
                f"{lo}..{hi} but reads axis {d} of an array of shape {tuple(operand)} "
                f"(valid: 0..{limit}); JAX would clamp it to a wrong finite row. Each "
                "table read at an edge needs one entry per parent (check the number of "
                "rows of the value / likelihood table; to read a shorter table on purpose, "
                "clip or mask the index, or use jnp.take(..., mode='fill'))"
            )


def check_gather_bounds(
    fn: Callable[[dict], Any], probes: dict[str, np.ndarray], where: str
) -> None:
    r"""Check that no read of ``fn(probes)`` at an edge value $\phi_i$ passes an array's end.

    Raises [`IndexOutOfBounds`][structinfer.exact.IndexOutOfBounds] if ``fn(probes)``
    reads past an array's end, with clamping, at an index that is a probe value (see
    the module docstring).

    Args:
        fn: ``fn(values: dict) -> pytree`` (e.g. a model run with the edge values given).
        probes: edge site -> NumPy int array of its values (any layout); its range
            ``0..m-1`` is what is checked.
        where: prefix of the error message (the model's name).

    Raises:
        IndexOutOfBounds: a clamping read whose index, computed directly from a probe,
            can leave the array's bounds; the message names the sites and the shape.
    """
    names = list(probes)
    closed = jax.make_jaxpr(lambda *vals: fn(dict(zip(names, vals))))(
        *[probes[n] for n in names])
    check_jaxpr_bounds(closed, probes, where)


def check_jaxpr_bounds(closed: Any, probes: dict[str, np.ndarray], where: str) -> None:
    r"""`check_gather_bounds` on a program already staged at the probes.

    Args:
        closed: a closed jaxpr (``jax.make_jaxpr``'s result) whose inputs are the probes,
            in the order of ``probes``; the values of its constants are read as known
            ranges (concrete integer arrays) or unknown (tracers).
        probes: edge site -> NumPy int array of its values, in the order of the inputs.
        where: prefix of the error message (the model's name).

    Raises:
        IndexOutOfBounds: as `check_gather_bounds`.
    """
    top = open_jaxpr(closed)
    if top is None:  # pragma: no cover - make_jaxpr always gives its constants' values
        return
    env = {v: _const_range(c) for v, c in zip(top.jaxpr.constvars, top.consts)}
    for v, n in zip(top.jaxpr.invars, probes):
        p = probes[n]
        env[v] = _Range.of(p.min(), p.max(), {n}, direct=True)
    _walk(top.jaxpr, {k: r for k, r in env.items() if r is not None}, where)
