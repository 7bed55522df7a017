"""Every float hyperparameter of every mechanism, prior and score is traceable.

Value checks on hyperparameters (``p > 0``, ``beta > 0``, ...) run only on concrete
values, and special cases (the ``p == 2`` fast path of the distance scores) give the same
number as the general, traced path. So a hyperparameter can be a ``jax.jit`` argument and
can be differentiated:

* for every row of :data:`structinfer.testing.registry.REGISTRY` and every float
  hyperparameter of its model (found from the model's signature and the example's static
  values), ``jax.jit`` over it gives the quantities of the concrete value (a Python float
  closed over, so its value checks and fast paths run, compiled too), and ``jax.grad`` of
  a scalar of
  the quantities with respect to it is finite and matches a central difference (float64);
* the same for the float arguments of every score and prior constructor, through
  :func:`structinfer.log_marginal` of a one-edge model;
* structural ints (sizes, windows, offsets) stay static and say so when traced.

Issue "Trust at every size", item 6.
"""

import contextlib
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import float64, matrix
from numpyro.handlers import substitute

import structinfer as si
from structinfer import mechanisms as mech
from structinfer.testing import registry

ROWS = registry.REGISTRY

#: test values for float hyperparameters that a row's example leaves unset and that have
#: no float default (``scale: float | None = None``)
EXTRA_VALUES = {"scale": 0.7}


def _is_float_param(p: inspect.Parameter) -> bool:
    ann = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
    default_is_float = isinstance(p.default, float) and not isinstance(p.default, bool)
    return "float" in str(ann) or default_is_float


def _row_hyperparameters(row) -> list[tuple[str, float]]:
    """``(name, value)`` of every float hyperparameter of a row.

    The float-annotated or float-defaulted parameters of the model, plus the Python floats
    among the example's static values (they may feed a row's custom quantities). A
    parameter without a value to test with fails the test: add one to ``EXTRA_VALUES``.
    """
    static = row.example(np.random.default_rng(0), np.float32).static
    params = inspect.signature(row.model).parameters
    names = [k for k, p in params.items() if _is_float_param(p)]
    names += [
        k
        for k, v in static.items()
        if isinstance(v, float) and not isinstance(v, bool) and k not in names
    ]
    out = []
    for k in names:
        v = static.get(k)
        if v is None and k in params and isinstance(params[k].default, float):
            v = params[k].default
        if v is None:
            v = EXTRA_VALUES.get(k)
        if not isinstance(v, float):
            raise AssertionError(
                f"registry row '{row.name}': float hyperparameter '{k}' has no value to test "
                "traceability with; give it one in the example's static values or EXTRA_VALUES"
            )
        out.append((k, v))
    return out


ROW_CASES = [(row, name, value) for row in ROWS for name, value in _row_hyperparameters(row)]
ROW_IDS = [f"{row.name}-{name}" for row, name, _ in ROW_CASES]


def test_hyperparameter_discovery_finds_the_known_ones():
    """Guard the automatic discovery: it must see these (and, by construction, any new
    float-annotated or float-defaulted model parameter)."""
    found = {(row.name, name) for row, name, _ in ROW_CASES}
    known = {
        ("cross_attention", "scale"),
        ("self_attention", "scale"),
        ("hopfield", "beta"),
        ("hopfield_energy", "beta"),
        ("expanding", "alpha"),
        ("expanding", "beta"),
        ("layer_norm", "eps"),
        ("multi_lse", "precision"),
        ("model_expansion", "precision"),
        ("model_expansion", "tau"),
        ("idw", "p"),
        ("idw", "eps"),
        ("idw", "sigma"),
        ("gaussian_kernel_attention", "sigma"),
        ("inverse_distance_attention", "p"),
        ("inverse_distance_attention", "eps"),
        ("idw_special_case", "p"),
        ("idw_special_case", "eps"),
    }
    assert known <= found, sorted(known - found)


def _close(actual, expected, tol, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=what)


def _scalar(out):
    return sum(jnp.sum(jnp.sin(v)) for v in out.values())


def _check_row(row, name, h0, dtype):
    """jit over the hyperparameter gives the eager quantities; its gradient is finite.

    Returns the jitted ``h -> (scalar, (quantities, d scalar / dh))``.
    """
    ex = row.example(np.random.default_rng(2), dtype)

    def quantities(h):
        return registry.evaluate(row, ex.inputs, {**ex.static, name: h})

    def scalar(h):
        out = quantities(h)
        return _scalar(out), out

    @jax.jit
    def traced(h):
        (s, out), g = jax.value_and_grad(scalar, has_aux=True)(h)
        return s, (out, g)

    _, (jitted, g) = traced(h0)
    if dtype == np.float64:  # compare once, in float64
        # h0 a Python float closed over: the concrete path (value checks, fast paths), as
        # eagerly, but one compiled program instead of hundreds of op-by-op compiles; both
        # compiled, so only the concrete / traced hyperparameter differs (as in
        # test_distance_score_p2_fast_path_equals_traced_path)
        eager = jax.jit(lambda: quantities(h0))()
        for k in row.keys:
            assert jitted[k].dtype == eager[k].dtype == dtype, (k, jitted[k].dtype, eager[k].dtype)
            _close(jitted[k], eager[k], 1e-10, f"{row.name} {k}: jit over {name}")
    for k in row.keys:
        assert jitted[k].dtype == dtype and np.isfinite(np.asarray(jitted[k])).all(), (row.name, k)
    assert np.isfinite(g), f"{row.name}: d/d{name} = {g}"
    return traced, g


#: by default every (row, hyperparameter) runs once: a row's first hyperparameter in
#: float64 (the eager value and a central difference: every row is checked so), its others
#: in float32 (jit and a finite gradient); ``-m exhaustive`` runs both dtypes of each
FIRST_HYPERPARAMETER = {row.name: name for row, name, _ in reversed(ROW_CASES)}


@pytest.mark.parametrize("row, name, h0", matrix(
    ROW_CASES, keep=lambda row, name, h0: name == FIRST_HYPERPARAMETER[row.name], ids=ROW_IDS))
def test_row_hyperparameter_jit_and_grad_float64(row, name, h0, x64):
    traced, g = _check_row(row, name, h0, np.float64)
    e = 1e-6 * max(1.0, abs(h0))
    central = float(traced(h0 + e)[0] - traced(h0 - e)[0]) / (2 * e)
    assert math.isclose(float(g), central, rel_tol=1e-5, abs_tol=1e-6), (
        row.name,
        name,
        float(g),
        central,
    )


@pytest.mark.parametrize("row, name, h0", matrix(
    ROW_CASES, keep=lambda row, name, h0: name != FIRST_HYPERPARAMETER[row.name], ids=ROW_IDS))
def test_row_hyperparameter_jit_and_grad_float32(row, name, h0):
    _check_row(row, name, h0, np.float32)


# ------------------------------------------------------------------- scores and priors

N, M, D = 5, 7, 3


def _data(dtype):
    r = np.random.default_rng(5)
    q, k = r.normal(size=(N, D)), r.normal(size=(M, D))
    q[1] = k[2]  # an exact match: zero distance (the p-gradient of d^p must stay finite)
    z, A = r.normal(size=(M, 2)), r.normal(size=(M, D, 2)) * 0.5
    w = r.normal(size=(2, D))
    return {
        k_: jnp.asarray(v, dtype) for k_, v in dict(q=q, k=k, z=z, A=A, wq=w, wk=w[::-1]).items()
    }


S, P = si.scores, si.priors


def _uniform(h, x):
    return P.Uniform(M)


def _dot(h, x):
    return S.Dot(x["q"], x["k"])


# name -> (prior(h, data), score(h, data), value of h); h is the traced hyperparameter
CONSTRUCTOR_CASES = {
    "Dot.scale": (_uniform, lambda h, x: S.Dot(x["q"], x["k"], scale=h), 0.7),
    "Bilinear.scale": (
        _uniform,
        lambda h, x: S.Bilinear(x["q"], x["k"], x["wq"], x["wk"], scale=h),
        0.7,
    ),
    "NegSqDist.precision": (_uniform, lambda h, x: S.NegSqDist(x["q"], x["k"], precision=h), 0.8),
    "NegSqDist.precision(diag)": (
        _uniform,
        lambda h, x: S.NegSqDist(x["q"], x["k"], precision=h, normalize=True),
        np.array([0.5, 1.0, 2.0]),
    ),
    "NegSqDist.log_weights": (
        _uniform,
        lambda h, x: S.NegSqDist(x["q"], x["k"], log_weights=h),
        np.linspace(-1.0, 1.0, M),
    ),
    "NegLogDist.p": (_uniform, lambda h, x: S.NegLogDist(x["q"], x["k"], p=h), 2.0),
    "NegLogDist.p(1.3)": (_uniform, lambda h, x: S.NegLogDist(x["q"], x["k"], p=h), 1.3),
    "NegLogDist.eps": (_uniform, lambda h, x: S.NegLogDist(x["q"], x["k"], eps=h), 1e-2),
    "InvDist.p": (_uniform, lambda h, x: S.InvDist(x["q"], x["k"], p=h, eps=0.5), 2.0),
    "InvDist.p(0.7)": (_uniform, lambda h, x: S.InvDist(x["q"], x["k"], p=h, eps=0.5), 0.7),
    "InvDist.eps": (_uniform, lambda h, x: S.InvDist(x["q"], x["k"], eps=h), 0.5),
    "GaussianKernel.sigma": (
        _uniform,
        lambda h, x: S.GaussianKernel(x["q"], x["k"], sigma=h),
        1.3,
    ),
    "Cosine.scale": (_uniform, lambda h, x: S.Cosine(x["q"], x["k"], scale=h), 2.0),
    "Cosine.eps": (_uniform, lambda h, x: S.Cosine(x["q"], x["k"], eps=h), 1e-2),
    "LinearGaussian.precision": (
        _uniform,
        lambda h, x: S.LinearGaussian(x["q"], x["z"], x["A"], precision=h, normalize=True),
        0.8,
    ),
    "LinearGaussian.b": (
        _uniform,
        lambda h, x: S.LinearGaussian(x["q"], x["z"], x["A"], b=h),
        np.linspace(-0.5, 0.5, D),
    ),
    "Custom.table": (_uniform, lambda h, x: S.Custom(h * jnp.ones((N, M))), 0.4),
    "Categorical.logits": (
        lambda h, x: P.Categorical(h),
        _dot,
        np.linspace(-1.0, 1.0, M),
    ),
    "RelativePosition.bias": (
        lambda h, x: P.RelativePosition(h, M, offset=M - N),
        _dot,
        np.linspace(-1.0, 1.0, N + M - 1 + (M - N)),
    ),
    "RelativePosition.circulant": (
        lambda h, x: P.RelativePosition.circulant(h),
        _dot,
        np.linspace(-1.0, 1.0, M),
    ),
    "RelativePosition.hartley": (
        lambda h, x: P.RelativePosition.hartley(h, M),
        _dot,
        np.array([0.3, -0.2, 0.5]),
    ),
    "Geometric.q": (lambda h, x: P.Geometric(h, M, offset=M - N), _dot, 0.3),
    "Geometric.q(per child)": (
        lambda h, x: P.Geometric(h, M, offset=M - N, include_self=False),
        _dot,
        np.linspace(0.2, 0.7, N),
    ),
}


def _constructors():
    """Every score / prior class constructor (``__init__`` and alternative classmethods)."""
    out = []
    for mod, base in ((S, S.Score), (P, P.StructuralPrior)):
        for cname in mod.__all__:
            cls = getattr(mod, cname)
            if not (isinstance(cls, type) and issubclass(cls, base)) or cls in (base,):
                continue
            out.append((f"{cname}", cls.__init__))
            for mname, member in vars(cls).items():
                if isinstance(member, classmethod):
                    out.append((f"{cname}.{mname}", getattr(cls, mname)))
    return out


def test_every_float_constructor_argument_is_covered():
    """A new float argument of a score or prior constructor needs a case above."""
    covered = {k.split("(")[0] for k in CONSTRUCTOR_CASES}  # "Class.arg" or "Class.method"
    covered_classes = {k.split(".")[0] for k in covered}
    missing = [
        f"{where}({pname})"
        for where, fn in _constructors()  # where: "Class" (__init__) or "Class.method"
        for pname, p in inspect.signature(fn).parameters.items()
        if _is_float_param(p) and f"{where}.{pname}" not in covered and where not in covered
    ]
    assert not missing, f"float constructor arguments without a traceability case: {missing}"
    # and the ones the issue names
    assert {"NegLogDist.p", "NegLogDist.eps", "InvDist.p", "InvDist.eps", "Geometric.q"} <= covered
    assert {"Dot", "Cosine", "GaussianKernel", "NegSqDist", "RelativePosition"} <= covered_classes


def _edge_model(prior_fn, score_fn, x):
    def model(h):
        with numpyro.plate("children", N):
            si.edge("phi", prior_fn(h, x), score_fn(h, x))

    return model


#: by default every constructor case runs once: these in float32, the others in float64
#: (which also checks a central difference); ``-m exhaustive`` runs both dtypes of each
FLOAT32_CONSTRUCTORS = list(CONSTRUCTOR_CASES)[1::2]


@pytest.mark.parametrize("dtype, case", matrix(
    [(dt, c) for dt in (np.float32, np.float64) for c in CONSTRUCTOR_CASES],
    keep=lambda dtype, case: (dtype == np.float32) == (case in FLOAT32_CONSTRUCTORS),
    ids=[f"{dt}-{c}" for dt in ("f32", "f64") for c in CONSTRUCTOR_CASES]))
def test_constructor_argument_jit_and_grad(dtype, case):
    prior_fn, score_fn, h0 = CONSTRUCTOR_CASES[case]
    with float64() if dtype == np.float64 else contextlib.nullcontext():
        x = _data(dtype)
        model = _edge_model(prior_fn, score_fn, x)
        hc = h0 if isinstance(h0, float) else jnp.asarray(h0, dtype)  # concrete (eager) value
        eager = si.log_marginal(model, hc)
        # the value and the gradient under one jit (one compiled program)
        value_and_grad = jax.jit(jax.value_and_grad(lambda h: si.log_marginal(model, h)))
        jitted, gj = value_and_grad(hc)
        assert jitted.dtype == eager.dtype == dtype, (jitted.dtype, eager.dtype)
        tol = 1e-11 if dtype == np.float64 else 2e-6
        _close(jitted, eager, tol, f"{case}: jit")
        g = jax.grad(lambda h: si.log_marginal(model, h))(hc)
        assert np.all(np.isfinite(g)) and np.all(np.isfinite(gj)), (case, g, gj)
        _close(gj, g, tol * 10, f"{case}: jitted grad")
        assert float(np.max(np.abs(np.asarray(g)))) > 0, f"{case}: zero gradient"
        if dtype == np.float64:
            v = np.random.default_rng(7).normal(size=np.shape(h0))
            e = 1e-6 * max(1.0, float(np.max(np.abs(h0))))
            # in NumPy, then as hc is (a Python float or an array): the same compiled program
            hp, hm = np.asarray(h0) + e * v, np.asarray(h0) - e * v
            hp, hm = ((float(hp), float(hm)) if isinstance(h0, float)
                      else (jnp.asarray(hp, dtype), jnp.asarray(hm, dtype)))
            # the compiled log-marginal (checked against the eager one above) at h0 +- e v
            central = float(value_and_grad(hp)[0] - value_and_grad(hm)[0]) / (2 * e)
            directional = float(np.sum(np.asarray(g) * v))
            assert math.isclose(directional, central, rel_tol=1e-5, abs_tol=1e-7), (
                case,
                directional,
                central,
            )


@pytest.mark.parametrize("cls", [S.NegLogDist, S.InvDist])
def test_distance_score_p2_fast_path_equals_traced_path(cls, x64):
    """The concrete ``p == 2`` fast path and the traced path give the same table."""
    for dtype in (np.float64, np.float32):
        x = _data(dtype)
        # both compiled, so only the p == 2 shortcut differs (not eager vs fused rounding)
        fast = jax.jit(lambda: cls(x["q"], x["k"], p=2.0).dense())()  # noqa: B023
        traced = jax.jit(lambda p: cls(x["q"], x["k"], p=p).dense())(dtype(2.0))  # noqa: B023
        assert traced.dtype == fast.dtype == dtype
        np.testing.assert_array_equal(np.asarray(traced), np.asarray(fast))
        eager = cls(x["q"], x["k"], p=2.0).dense()
        _close(traced, eager, 1e-13 if dtype == np.float64 else 1e-6, "traced vs eager")


@pytest.mark.parametrize("cls", [S.NegLogDist, S.InvDist])
@pytest.mark.parametrize("p", [0.7, 2.0, 3.0])
def test_distance_score_gradients_finite_at_zero_distance(cls, p, x64):
    """Gradients in the features and in a traced ``p`` stay finite where a child sits on a
    parent (``q[1] == k[2]``): the double-``where`` keeps ``d^{p-2}`` and ``log d`` out."""
    x = _data(np.float64)

    def f(q, k, p):
        return jnp.sum(jnp.sin(cls(q, k, p=p, eps=0.1).dense()))

    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x["q"], x["k"], p)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g))), (cls.__name__, p, grads)


# ----------------------------------------------------------------- eager checks still run


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda x: S.NegLogDist(x["q"], x["k"], p=-1.0), "need p > 0 and eps > 0"),
        (lambda x: S.NegLogDist(x["q"], x["k"], eps=0.0), "need p > 0 and eps > 0"),
        (lambda x: S.InvDist(x["q"], x["k"], p=0.0), "need p > 0 and eps > 0"),
        (lambda x: S.InvDist(x["q"], x["k"], eps=jnp.asarray(-1.0)), "need p > 0 and eps > 0"),
        (lambda x: S.NegLogDist(x["q"], x["k"], p=float("nan")), "need p > 0 and eps > 0"),
        (lambda x: mech.hopfield(x["k"], 5, beta=-1.0), "beta must be > 0"),
        (lambda x: mech.hopfield(x["k"], 5, beta=np.float32(0.0)), "beta must be > 0"),
    ],
)
def test_concrete_value_checks_still_raise(make, match):
    x = _data(np.float32)
    with pytest.raises(ValueError, match=match):
        with numpyro.handlers.seed(rng_seed=0):
            make(x)


# ------------------------------------------------------------- structural ints stay static


def _traced(fn, value):
    return jax.jit(fn)(value)


@pytest.mark.parametrize(
    "fn, value, match",
    [
        (lambda s: P.Restricted.window(N, s), 3, "`size` must be a static Python int"),
        (lambda n: P.Restricted.causal(n), 5, "`num_children` must be a static Python int"),
        (lambda m: P.Uniform(m), 5, "`num_parents` must be a static Python int"),
        (lambda o: P.Geometric(0.3, M, offset=o), 2, "`offset` must be a static Python int"),
        (
            lambda o: P.RelativePosition(jnp.zeros(N + M - 1), M, offset=o),
            0,
            "`offset` must be a static Python int",
        ),
        (
            lambda n: P.RelativePosition.hartley(jnp.ones(3), n),
            7,
            "`num_nodes` must be a static Python int",
        ),
    ],
)
def test_traced_structural_int_gets_a_clear_error(fn, value, match):
    with pytest.raises(TypeError, match=match):
        _traced(fn, value)


def test_traced_mechanism_sizes_get_a_clear_error():
    r = np.random.default_rng(0)
    x, w = r.normal(size=(7, 3)), r.normal(size=(2, 3))
    with pytest.raises(TypeError, match="multihop_attention: `hops` must be a static Python int"):
        jax.jit(lambda h: si.log_marginal(mech.multihop_attention, x, w, w, None, hops=h))(2)
    with pytest.raises(TypeError, match="sparse_attention: `window` must be a static Python int"):
        jax.jit(lambda s: si.log_marginal(mech.sparse_attention, x, w, w, None, window=s))(3)
    model = substitute(mech.hopfield, data={"state": jnp.zeros((5, 3))})
    with pytest.raises(TypeError, match="hopfield: `num_states` must be a static Python int"):
        jax.jit(lambda s: si.log_marginal(model, x, s))(5)


# ------------------------------------------------------------------- the issue's examples


def _idw_data():
    r = np.random.default_rng(1)
    return r.normal(size=(5, 3)), r.normal(size=(7, 3)), r.normal(size=(7, 2))


def test_issue_example_attention_over_idw_with_float_p():
    """``si.attention`` traces float arguments: ``p=1.0`` reaches the score as a tracer."""
    X, K, V = _idw_data()
    out = si.attention(mech.idw_attention, "out")(X, K, V, p=1.0)
    ref = si.expectation(mech.idw_attention, "out", X, K, V, p=1.0)
    _close(out, ref, 1e-5, "attention(idw_attention)(p=1.0)")


def test_issue_example_exact_backend_and_jit_over_p():
    X, K, V = _idw_data()
    ref = si.expectation(mech.idw_attention, "out", X, K, V, p=1.0)
    out = si.attention(mech.idw_attention, "out", backend="exact")(X, K, V, p=1.0)
    _close(out, ref, 1e-5, "attention(idw_attention, backend='exact')(p=1.0)")
    jitted = jax.jit(lambda p: si.expectation(mech.idw_attention, "out", X, K, V, p=p))(1.0)
    _close(jitted, ref, 1e-5, "jit over p")


def test_issue_example_jit_over_hopfield_beta():
    r = np.random.default_rng(2)
    memories, state = r.normal(size=(7, 3)), 0.5 * r.normal(size=(5, 3))
    model = substitute(mech.hopfield, data={"state": jnp.asarray(state, jnp.float32)})

    def energy(beta):
        return si.energy(model, memories, 5, beta=beta)

    _close(jax.jit(energy)(1.3), energy(1.3), 1e-5, "jit over beta")
    assert np.isfinite(jax.grad(energy)(1.3))


def test_traced_geometric_truncation_is_a_mask_and_attention_falls_back():
    """A Geometric window inferred under jit (structinfer.reproductions.expanding) truncates
    the table; si.attention cannot band a traced window and takes the exact engine."""
    r = np.random.default_rng(0)
    q, k, v = r.normal(size=(N, D)), r.normal(size=(M, D)), r.normal(size=(M, 2))

    def model(q, k, v, window):
        with numpyro.plate("queries", N):
            j = si.edge("phi", P.Geometric(0.3, M, offset=M - N, max_distance=window),
                        si.scores.Dot(q, k))
            numpyro.deterministic("out", jnp.asarray(v)[j])

    want = si.expectation(model, "out", q, k, v, 3)
    np.testing.assert_allclose(jax.jit(lambda w: si.expectation(model, "out", q, k, v, w))(3),
                               want, rtol=1e-5)
    np.testing.assert_allclose(si.attention(model, "out")(q, k, v, jnp.asarray(3)), want,
                               rtol=1e-5)
