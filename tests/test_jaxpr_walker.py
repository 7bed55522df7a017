"""The one jaxpr walker (``structinfer._jaxpr``) and its four readers on every layout.

JAX 0.11 changed how loops and calls keep their bodies: ``scan`` lost ``num_consts`` /
``num_carry`` for ``ft_in`` / ``ft_out`` groups, and ``scan`` / ``while`` / ``jit`` hold a
``Jaxpr`` with its constants attached instead of a ``ClosedJaxpr``. That release is not
installable here, so the tests rewrite the jaxprs of the installed release into that
layout (`to_layout`: stand-in equations with the 0.11 params, built from the real
ones) and check that the walker splits them identically and that every reader — the
lowering's separability analysis, the bounds check, the view replay, the Laplace
dependence check — gives the same answer as on the real layout. A layout with no
counts at all (the split read from the body's types alone) is checked the same way.

Oracles: the real layout's split and each reader's answer on it; the exact engine for
the lowering's values.
"""

import enum
import types

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conftest import matrix
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import mlir

import structinfer as si
from structinfer import _jaxpr
from structinfer.exact import IndexOutOfBounds, bounds
from structinfer.infer import laplace, laplace_approx
from structinfer.lowering import _recognise, _views, attention, explain

pytestmark = pytest.mark.gpu  # the GPU subset: pytest -m gpu

LAYOUTS = ("jax-0.11", "jax-0.11-flattree", "types-only")


# --- the JAX 0.11 layout, built from the installed release's jaxprs ------------------


class Jaxpr011:
    """JAX 0.11's ``Jaxpr``: constants attached, ``.jaxpr`` is the jaxpr itself."""

    def __init__(self, jaxpr, consts, eqns):
        self.constvars = list(jaxpr.constvars)
        self.invars = list(jaxpr.invars)
        self.outvars = list(jaxpr.outvars)
        self.eqns = eqns
        self.effects = jaxpr.effects
        self.consts = list(consts)

    @property
    def jaxpr(self):
        return self

    @property
    def in_avals(self):
        return [v.aval for v in self.invars]

    @property
    def out_avals(self):
        return [v.aval for v in self.outvars]


class BareJaxpr:
    """A jaxpr with neither ``.jaxpr`` nor ``.consts`` (no constants)."""

    def __init__(self, jaxpr, eqns):
        assert not jaxpr.constvars
        self.constvars, self.invars, self.outvars = [], list(jaxpr.invars), list(jaxpr.outvars)
        self.eqns = eqns
        self.effects = jaxpr.effects


class FlatTree:
    """What matters of 0.11's ``FlatTree`` here: top-level groups, each with a length."""

    def __init__(self, *sizes):
        self.sizes = sizes

    def __len__(self):
        return sum(self.sizes)

    def unpack(self):
        return tuple(FlatTree(*([1] * n)) for n in self.sizes)


class Inline(enum.Enum):  # 0.11's ``jit`` ``inline`` param is an enum
    NEVER = 0


class RightsOnly:  # the picture of a filtered ``ft_out`` leaf
    def __init__(self, val):
        self.val = val


class Eqn:
    """A stand-in equation: the 0.11 params, the real operands and results."""

    def __init__(self, name, params, eqn):
        self.primitive = types.SimpleNamespace(name=name, multiple_results=True)
        self.params = params
        self.invars, self.outvars, self.effects = eqn.invars, eqn.outvars, eqn.effects


def to_layout(closed, layout):
    """``closed`` (a ``ClosedJaxpr`` or open ``Jaxpr``) with every body in ``layout``."""
    inner = getattr(closed, "jaxpr", closed)
    consts = getattr(closed, "consts", ())
    eqns = [_eqn_to_layout(e, layout) for e in inner.eqns]
    if layout == "types-only" and not consts and not inner.constvars:
        return BareJaxpr(inner, eqns)
    return Jaxpr011(inner, consts, eqns)


def _eqn_to_layout(eqn, layout):
    name, p = eqn.primitive.name, dict(eqn.params)
    if not any(
        hasattr(getattr(v, "jaxpr", v), "eqns")
        or isinstance(v, tuple)
        and any(hasattr(getattr(b, "jaxpr", b), "eqns") for b in v)
        for v in p.values()
    ):
        return eqn
    for k, v in p.items():
        if hasattr(getattr(v, "jaxpr", v), "eqns"):
            p[k] = to_layout(v, layout)
        elif isinstance(v, tuple) and v and all(hasattr(getattr(b, "jaxpr", b), "eqns") for b in v):
            p[k] = tuple(to_layout(b, layout) for b in v)
    if name == "scan":
        if "num_consts" in p:  # the installed JAX keeps counts (up to 0.10)
            nc, ncar = p.pop("num_consts"), p.pop("num_carry")
        else:  # the installed JAX is 0.11 or later: its own groups, read here by hand
            ft = p.pop("ft_in")
            groups = ft.unpack() if callable(getattr(ft, "unpack", None)) else ft
            nc, ncar = (_native_group_size(g) for g in tuple(groups)[:2])
            p.pop("ft_out", None)
        nxs, nys = len(eqn.invars) - nc - ncar, len(eqn.outvars) - ncar
        if layout == "jax-0.11":
            p["ft_in"] = ((None,) * nc, (None,) * ncar, (None,) * nxs)
            p["ft_out"] = ((None,) * ncar, (RightsOnly(None),) * nys)
        elif layout == "jax-0.11-flattree":
            p["ft_in"], p["ft_out"] = FlatTree(nc, ncar, nxs), FlatTree(ncar, nys)
    if name == "while" and layout == "types-only":
        del p["cond_nconsts"], p["body_nconsts"]
    if name in ("jit", "pjit"):
        name, p["inline"] = "jit", Inline.NEVER
    return Eqn(name, p, eqn)


def _native_group_size(group):
    """Leaves in one group of a real JAX 0.11 ``ft_in`` (nested tuples of leaves)."""
    if isinstance(group, (tuple, list)):
        return sum(_native_group_size(g) for g in group)
    return len(group) if hasattr(group, "unpack") else 1


class JaxOn:
    """``jax`` whose ``make_jaxpr`` returns jaxprs in ``layout`` (patched into a reader)."""

    def __init__(self, layout):
        self.layout = layout

    def __getattr__(self, name):
        return getattr(jax, name)

    def make_jaxpr(self, f, **kw):
        traced = jax.make_jaxpr(f, **kw)

        def run(*args, **kwargs):
            out = traced(*args, **kwargs)
            if kw.get("return_shape"):
                return to_layout(out[0], self.layout), out[1]
            return to_layout(out, self.layout)

        return run


# --- the split ----------------------------------------------------------------------


def _loops(a, b, xs):
    """A fori_loop (a scan with a const), a scan with xs / ys, a while, a jit, a cond."""
    fori = jax.lax.fori_loop(0, 3, lambda i, c: (c[0] + c[1], c[1]), (a, b))[0]
    carry, ys = jax.lax.scan(lambda c, x: (c * x, c + x), a, xs)
    wh = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * b), (0, a))[1]
    jit = jax.jit(lambda u: u * 2.0 + xs[0])(b)
    br = jax.lax.cond(a[0] > 0, lambda u, v: u + v, lambda u, v: u - v, a, b)
    return fori, carry, ys, wh, jit, br


def _args():
    return jnp.ones(2), jnp.full(2, 2.0), jnp.ones((5, 2))


def _summary(eqn):
    c = _jaxpr.classify(eqn)
    if c is None or isinstance(c, _jaxpr.Unknown):
        return c
    if isinstance(c, _jaxpr.Loop):
        return (
            c.name,
            c.consts,
            c.carry,
            c.xs,
            c.carry_out,
            c.ys,
            c.length,
            len(c.body.jaxpr.eqns),
            c.cond_consts,
        )
    if isinstance(c, _jaxpr.Call):
        return (c.kind, len(c.body.jaxpr.invars), len(c.body.jaxpr.eqns), len(c.body.consts))
    return (c.index, c.operands, len(c.branches))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_split_is_the_same_on_every_layout(layout):
    if jax.__version_info__ < (0, 7):
        pytest.skip("the emulated layouts are built from a newer JAX's trace (an older "
                    "fori_loop closes over its constants in the body's ClosedJaxpr)")
    closed = jax.make_jaxpr(_loops)(*_args())
    real = [_summary(e) for e in closed.jaxpr.eqns]
    other = [_summary(e) for e in to_layout(closed, layout).eqns]
    assert real == other
    loops = {s[0]: s for s in real if s and s[0] in ("scan", "while")}
    scans = [s for s in real if s and s[0] == "scan"]
    # fori_loop: b moved to a const, (i, a) carried; the scan: one carry, one xs, one ys
    assert [(len(s[1]), len(s[2]), len(s[3]), len(s[4]), len(s[5])) for s in scans] == [
        (1, 2, 0, 2, 0),
        (0, 1, 1, 1, 1),
    ]
    assert [len(x) for x in loops["while"][1:6]] == [1, 2, 0, 2, 0]
    assert any(s and s[0] == "call" for s in real)
    assert any(s and len(s) == 3 and s[2] == 2 for s in real)  # the cond's two branches


def test_a_layout_that_does_not_check_is_read_from_the_types():
    closed = jax.make_jaxpr(_loops)(*_args())
    fori = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")
    want = _summary(fori)
    lying = dict(fori.params, num_consts=0, num_carry=1)  # says (0, 1, 2): types disagree
    assert _summary(Eqn("scan", lying, fori)) == want
    groups = {k: v for k, v in fori.params.items() if k not in ("num_consts", "num_carry")}
    assert _summary(Eqn("scan", dict(groups, ft_in=((), (None,), (None, None))), fori)) == want


def test_bodies_that_cannot_be_read_are_unknown():
    closed = jax.make_jaxpr(_loops)(*_args())
    scan = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")
    other = jax.make_jaxpr(lambda u: (u,))(jnp.ones(2))  # a body of the wrong arity
    for eqn in (
        Eqn("scan", dict(scan.params, jaxpr=other), scan),
        Eqn("jit", {"jaxpr": other}, scan),
        Eqn("shard_map", {"jaxpr": scan.params["jaxpr"]}, scan),
        Eqn("while", {"body_jaxpr": other}, scan),
    ):
        assert isinstance(_jaxpr.classify(eqn), _jaxpr.Unknown), eqn.primitive.name
    add = jax.make_jaxpr(lambda u: u + 1.0)(jnp.ones(2)).jaxpr.eqns[0]
    assert _jaxpr.classify(add) is None


# --- the shared fixed point of a loop -------------------------------------------------


def _flat_deps(jaxpr, ins):
    """Data dependence through a body without nested bodies: every operand counts."""
    deps = dict(zip(jaxpr.invars, ins))

    def get(x):
        return frozenset() if _jaxpr.is_literal(x) else deps.get(x, frozenset())

    for eqn in jaxpr.eqns:
        assert _jaxpr.classify(eqn) is None, eqn.primitive.name
        deps.update((v, _jaxpr.union(get(x) for x in eqn.invars)) for v in eqn.outvars)
    return [get(x) for x in jaxpr.outvars]


def _two_step(a, b, c0, d0, lim):
    """A scan whose carry reaches ``b``'s and ``a``'s dependence only on its second trip
    (``c <- a``, then ``d <- d + c * b``), and a while whose trip count reads ``lim``."""
    (c, d), _ = jax.lax.scan(lambda cd, _: ((a, cd[1] + cd[0] * b), None), (c0, d0), None,
                             length=3)
    w = jax.lax.while_loop(lambda s: s[0][0] < lim, lambda s: (s[0] + 1.0, s[1] * b), (c0, d0))
    return c, d, w[1]


@pytest.mark.parametrize("layout", ("jax-0.10",) + LAYOUTS)
def test_loop_fixed_point_joins_the_carry_until_it_stops_growing(layout):
    args = [jnp.ones(2)] * 4 + [jnp.float32(3.0)]
    closed = jax.make_jaxpr(_two_step)(*args)
    jaxpr = closed.jaxpr if layout == "jax-0.10" else to_layout(closed, layout)
    deps = dict(zip(jaxpr.invars, [frozenset([k]) for k in range(5)]))
    get = lambda x: frozenset() if _jaxpr.is_literal(x) else deps.get(x, frozenset())  # noqa: E731
    scan, wh = (_jaxpr.classify(e) for e in jaxpr.eqns
                if e.primitive.name in ("scan", "while"))
    point = _jaxpr.loop_fixed_point(scan, get, _flat_deps, frozenset.union, rounds=10)
    assert point.carry == (frozenset({0, 2}), frozenset({0, 1, 2, 3}))
    assert point.outputs == (frozenset({0}), frozenset({0, 1, 2, 3}))
    assert point.cond is None
    # one round sees only the first trip: no fixed point yet, the caller is conservative
    assert _jaxpr.loop_fixed_point(scan, get, _flat_deps, frozenset.union, rounds=1) is None
    point = _jaxpr.loop_fixed_point(wh, get, _flat_deps, frozenset.union, rounds=10)
    assert point.carry == (frozenset({2}), frozenset({1, 3}))
    assert point.cond == (frozenset({2, 4}),)
    assert _jaxpr.union([]) == frozenset()


# --- the lowering's separability analysis --------------------------------------------


def _small(seed=0, n=3, m=4, d=2, dv=2):
    r = np.random.default_rng(seed)
    return (
        jnp.asarray(r.normal(size=(n, d))),
        jnp.asarray(r.normal(size=(m, d))),
        jnp.asarray(r.normal(size=(m, dv))),
    )


def _two_edges(value):
    def model(q, k, V):
        n, m = q.shape[0], k.shape[0]
        with numpyro.plate("c", n):
            a = si.edge("a", si.priors.Uniform(m), si.scores.Dot(q, k))
            b = si.edge("b", si.priors.Uniform(m), si.scores.Dot(-q, k))
            A, B = V[a], V[b]
            shp = jnp.broadcast_shapes(A.shape, B.shape)
            numpyro.deterministic("out", value(A + jnp.zeros(shp), B + jnp.zeros(shp)))

    return model


def _fori(body, trips=2):
    return lambda A, B: jax.lax.fori_loop(0, trips, body, (A, B, 0 * A, 0 * A))[3]


def _product(i, c):  # iteration 2 multiplies a copy of A (made in iteration 1) by B
    a_, b_, c_, d_ = c
    return (a_, b_, a_, d_ + c_ * b_)


def _summed(i, c):  # A + B accumulated: separable however many iterations
    a_, b_, c_, d_ = c
    return (a_, b_, a_, d_ + 0.5 * c_ + b_)


def _scanned(A, B):  # a scan with a scanned input: B read row by row, A[0] carried
    return jax.lax.scan(lambda c, row: (c + row, 2.0 * c), A[0], B)[1] + A


def _while(stop):  # A + B added until the counter (or, with stop, A's sum) says stop
    def value(A, B):
        def cond(c):
            return (c[0] < 2) & ((jnp.sum(c[2]) < 1e9) if stop else True)

        return jax.lax.while_loop(
            cond, lambda c: (c[0] + 1, c[1] + A + B, c[2] + A), (0, 0 * A, 0 * A)
        )[1]

    return value


LOOP_VALUES = {
    "product": (_fori(_product), "exact"),
    "summed": (_fori(_summed, 3), "lowered"),
    "while": (_while(False), "lowered"),
    "while_stops_on_edge": (_while(True), "exact"),
    "jit": (jax.jit(lambda A, B: 2.0 * A - B), "lowered"),
    "cond": (
        lambda A, B: jax.lax.cond(True, lambda u, v: u + v, lambda u, v: u * v, A, B),
        "exact",
    ),
}


@pytest.mark.parametrize("name, layout", matrix(  # every program on JAX 0.11's layout (the
    # regression), every layout on a loop and a stopping loop
    [(n, lay) for n in sorted(LOOP_VALUES) for lay in ("jax-0.10",) + LAYOUTS],
    keep=lambda name, layout: layout == "jax-0.11" or name in ("summed", "while_stops_on_edge")))
def test_lowering_reads_loops_and_calls_on_every_layout(x64, monkeypatch, layout, name):
    # Regression: JAX 0.11 dropped scan's num_consts, and the separability analysis
    # raised KeyError: 'num_consts' from inside si.attention.
    if layout != "jax-0.10":
        monkeypatch.setattr(_recognise, "jax", JaxOn(layout))
    value, path = LOOP_VALUES[name]
    model, args = _two_edges(value), _small()
    ex = explain(model, "out", *args)
    assert ex.path == path, str(ex)
    if path == "exact":
        assert (ex.fallback.site, ex.fallback.part) == ("out", "value")
    ref = si.expectation(model, "out", *args)
    np.testing.assert_allclose(attention(model, "out")(*args), ref, atol=1e-12)


def test_scan_fixed_point_is_the_same_on_every_layout(x64):
    probes = [np.arange(4).reshape(4, 1, 1), np.arange(4).reshape(1, 4, 1)]
    V = jnp.asarray(np.random.default_rng(0).normal(size=(4, 2)))

    def f(a, b):
        A, B = V[a] + jnp.zeros((4, 4, 3, 2)), V[b] + jnp.zeros((4, 4, 3, 2))
        return _fori(_product)(A, B), _fori(_summed, 3)(A, B), _scanned(A, B)

    closed = jax.make_jaxpr(f)(*probes)
    deps = [frozenset([0]), frozenset([1])]
    want = _recognise._analyse(closed.jaxpr, deps, [True, True])
    assert want[1] == [False, True, True]
    for layout in LAYOUTS:
        assert _recognise._analyse(to_layout(closed, layout), deps, [True, True]) == want


# --- the bounds check ---------------------------------------------------------------


@pytest.mark.parametrize("layout", ("jax-0.10",) + LAYOUTS)
def test_bounds_check_enters_calls_on_every_layout(monkeypatch, layout):
    if layout != "jax-0.10":
        monkeypatch.setattr(bounds, "jax", JaxOn(layout))
    v = jnp.ones((7, 2))
    probes = {"phi": np.arange(7, dtype=np.int32).reshape(7, 1)}
    short = jax.jit(lambda t, i: t[i])
    with pytest.raises(IndexOutOfBounds, match="takes values 0..6"):
        bounds.check_gather_bounds(lambda d: short(v[:6], d["phi"]), probes, "bad")
    bounds.check_gather_bounds(lambda d: short(v, d["phi"]), probes, "ok")
    # loops and conditionals are not followed: their reads are not checked (no error)
    looped = lambda d: jax.lax.fori_loop(
        0, 2, lambda i, c: c + v[:6][d["phi"]], jnp.zeros((7, 1, 2))
    )
    branched = lambda d: jax.lax.cond(True, lambda p: v[:6][p], lambda p: v[:6][0 * p], d["phi"])
    for f in (looped, branched):
        bounds.check_gather_bounds(f, probes, "unchecked")


# --- the view replay ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ("jax-0.10",) + LAYOUTS)
def test_view_replay_inlines_calls_on_every_layout(monkeypatch, layout):
    if layout != "jax-0.10":
        monkeypatch.setattr(_views, "jax", JaxOn(layout))
    v = jnp.asarray(np.random.default_rng(0).normal(size=(3, 7, 5)).astype(np.float32))
    f = lambda w: jax.jit(lambda u: jnp.take(u, np.arange(7), axis=1) * 2.0)(w)
    replay = lambda w: _views.eval_with_views(f, w)
    np.testing.assert_array_equal(np.asarray(jax.jit(replay)(v)), np.asarray(f(v)))
    assert "gather" not in jax.jit(replay).lower(v).as_text()


# --- the Laplace dependence check ---------------------------------------------------


@pytest.mark.parametrize("layout", ("jax-0.10",) + LAYOUTS)
def test_laplace_dependence_is_the_same_on_every_layout(layout):
    a, b, xs = _args()

    def f(a, b, xs):
        fori, carry, ys, wh, jit, br = _loops(a, b, xs)
        kept = jax.lax.fori_loop(0, 3, lambda i, c: (c[0] * 2.0, c[1] + c[0]), (a, b))[0]
        return fori, carry, ys, wh, jit, br, kept

    closed = jax.make_jaxpr(f)(a, b, xs)
    jaxpr = closed.jaxpr if layout == "jax-0.10" else to_layout(closed, layout)
    deps = laplace_approx._jaxpr_deps(jaxpr, [frozenset([k]) for k in range(3)])
    assert [sorted(d) for d in deps] == [[0, 1], [0, 2], [0, 2], [0, 1], [1, 2], [0, 1], [0]]


# --- a primitive with a body the walker does not know --------------------------------

opaque_p = Primitive("opaque_call")
opaque_p.multiple_results = True
opaque_p.def_impl(lambda *args, jaxpr: jaxpr_as_fun(jaxpr)(*args))
opaque_p.def_abstract_eval(lambda *avals, jaxpr: [v.aval for v in jaxpr.jaxpr.outvars])
mlir.register_lowering(
    opaque_p, mlir.lower_fun(lambda *args, jaxpr: jaxpr_as_fun(jaxpr)(*args), multiple_results=True)
)


def opaque(f, *args):
    """``f(*args)`` behind a primitive whose body no reader of the package knows."""
    return opaque_p.bind(*args, jaxpr=jax.make_jaxpr(f)(*args))[0]


def test_unknown_primitive_with_a_body_falls_back_to_the_exact_engine(x64):
    args = _small()
    for value in (lambda A, B: A + B, lambda A, B: A * B):
        model = _two_edges(lambda A, B, value=value: opaque(value, A, B))
        ex = explain(model, "out", *args)
        assert ex.path == "exact" and (ex.fallback.site, ex.fallback.part) == ("out", "value")
        assert "opaque_call" in ex.fallback.reason
        ref = si.expectation(model, "out", *args)
        np.testing.assert_allclose(attention(model, "out")(*args), ref, atol=1e-12)
        np.testing.assert_allclose(jax.jit(attention(model, "out"))(*args), ref, atol=1e-12)

    def one_edge(q, k, V):  # a single edge is read by probing: any f(phi) is lowered
        with numpyro.plate("c", q.shape[0]):
            j = si.edge("phi", si.priors.Uniform(k.shape[0]), si.scores.Dot(q, k))
            numpyro.deterministic("out", opaque(jnp.sin, V[j]))

    ref = si.expectation(one_edge, "out", *args)
    np.testing.assert_allclose(attention(one_edge, "out")(*args), ref, atol=1e-12)


@pytest.mark.exhaustive  # (~7 s of compiles)
def test_unknown_primitive_in_bounds_and_laplace_is_conservative(x64):
    v = jnp.ones((7, 2))
    probes = {"phi": np.arange(7, dtype=np.int32).reshape(7, 1)}
    bounds.check_gather_bounds(lambda d: opaque(lambda i: v[:6][i], d["phi"]), probes, "opaque")
    r = np.random.default_rng(11)
    X, mu = r.normal(size=(7, 5)), r.normal(size=(3, 5))

    def node_in_opaque(X, mu):  # no site reads an edge: the expansion goes ahead
        numpyro.factor("node", -0.5 * jnp.sum(mu**2))
        numpyro.factor("const", opaque(lambda x: -0.5 * jnp.sum(x**2), jnp.asarray(X)))
        with numpyro.plate("queries", mu.shape[0]):
            si.edge("memory", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X))

    def obs_in_opaque(X, mu):  # an observation read at the edge, behind the primitive
        numpyro.factor("node", -0.5 * jnp.sum(mu**2))
        with numpyro.plate("queries", mu.shape[0]):
            phi = si.edge("memory", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X))
            numpyro.sample(
                "y",
                dist.Normal(opaque(lambda p: jnp.asarray(X)[p, 0], phi), 1.0),
                obs=jnp.zeros(mu.shape[0]),
            )

    H = jax.hessian(lambda u: si.log_marginal(node_in_opaque, X, mu=u))(jnp.asarray(mu))
    lap = laplace(node_in_opaque, "mu", mu, X)
    np.testing.assert_allclose(lap.hessian, H.reshape(15, 15), atol=1e-10)
    with pytest.raises(ValueError, match="site 'y'.*depends on edge site 'memory'"):
        laplace(obs_in_opaque, "mu", mu, X)
