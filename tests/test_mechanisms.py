"""Contract test of the mechanism catalogue: one registry, one test.

Every row of ``structinfer.testing.registry.REGISTRY`` is run through the exact
engine (``registry.evaluate``: marginals, expectations, energy and ``jax.grad`` of it)
and compared with an independent implementation of the paper's closed form (the
row's reference, written beside it with ``structinfer.testing.oracles``: explicit
softmaxes and the similarity derivatives of Tschantz appendix B / Singh & Buckley eq. 8):

* float64 under ``jax.jit(jax.vmap(...))`` over a batch of perturbed inputs at tight
  tolerance (the paper check), with the gradient of a scalar function of the quantities
  with respect to every float input, which must be finite and match central
  differences;
* float32 inputs give float32 outputs of the right shapes.

Every public model of ``structinfer.mechanisms`` must have a row, and no reference may
reach the engine. Sizes in the examples are distinct primes, so a swapped axis fails.
The catalogue page generated from the rows is tested in ``tests/test_catalogue.py``.
"""

import ast
import dis
import inspect
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import matrix

import structinfer as si
from structinfer import mechanisms as mech
from structinfer.testing import oracles, registry

ROWS = registry.REGISTRY
IDS = [m.name for m in ROWS]

#: public names of ``structinfer.mechanisms`` that are functions but not models (so they
#: need no row of their own); every other public function is a model and needs a row
HELPERS = {
    "self_prior": "the structural prior of self attention, used by its models",
    "sinusoidal_encoding": "positions for absolute_position_attention",
    "mlp_features": "the network f_theta of classification_layer",
    "tanh_network": "the non-linearity of nonlinear_mixture / predictive coding",
    "expand_components": "the model-expansion step (the model_expansion row's custom quantity)",
    "child_parent_gradients": "the split of lse_graphical_model's gradient (its row's custom quantity)",
    "special_case_eta": "McCarter sec. 2.2 (the idw_special_case row's custom quantity)",
    "augment_special_case": "McCarter sec. 2.2 (the idw_special_case row's custom quantity)",
}


def _is_float(v):
    return all(jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) for a in jax.tree.leaves(v))


def _close(actual, expected, tol, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=what)


def _scalar(out, keys):
    return sum(jnp.sum(jnp.sin(out[k])) for k in keys)


#: the rows whose float64 check compiles longest (each 3-7 s on a two-core machine): in
#: the exhaustive tier; every row keeps its float32 test in the default run, and these
#: rows' engine paths (chains, scans, several edge sites) have default tests of their own
SLOW_ROWS = {"spatiotemporal", "monotonic_alignment", "markov_slds", "renormalised_mixture",
             "predictive_coding", "lse_graphical_model", "multihop", "block_slot"}


@pytest.mark.parametrize("row", matrix(ROWS, lambda r: r.name not in SLOW_ROWS, IDS))
def test_float64_jit_vmap_gradients_match_paper(row, x64):
    """One compiled function per row, ``jit(vmap(quantities, gradients))`` in float64.

    The batch holds the example, two perturbations of its batch input, and the example
    moved by ``+-h v`` along a random direction ``v`` of all float inputs. Every item is
    compared with the reference at tight tolerance (the paper check); the gradient of a
    scalar function of the row's non-gradient quantities (attention, output, energy, ...)
    must be finite and match the central difference along ``v``. (Quantities that are
    gradients, -dE/dx and fixed points, are compared with the paper directly.)
    """
    ex = row.example(np.random.default_rng(2), np.float64)
    rng = np.random.default_rng(3)
    diff_keys = [k for k, v in ex.inputs.items() if _is_float(v)]
    assert ex.batch in diff_keys
    fixed = {k: v for k, v in ex.inputs.items() if k not in diff_keys}
    # the batch is built in NumPy (float64, the same arithmetic): eager jax ops here would
    # only compile tiny programs; the engine and the reference run in one jitted program
    base = jax.tree.map(np.asarray, {k: ex.inputs[k] for k in diff_keys})
    assert all(a.dtype == np.float64 for a in jax.tree.leaves(base))
    v = jax.tree.map(lambda a: rng.normal(size=np.shape(a)), base)
    norm = math.sqrt(sum(float(np.sum(u * u)) for u in jax.tree.leaves(v)))
    v = jax.tree.map(lambda u: u / norm, v)  # a unit direction
    h = 1e-5
    noisy = [
        {
            **base,
            ex.batch: jax.tree.map(
                lambda a: a + 0.1 * rng.normal(size=np.shape(a)), base[ex.batch]
            ),
        }
        for _ in range(2)
    ]
    items = [
        base,
        *noisy,
        jax.tree.map(lambda a, u: a + h * u, base, v),
        jax.tree.map(lambda a, u: a - h * u, base, v),
    ]
    batch = jax.tree.map(lambda *xs: np.stack(xs), *items)
    keys = [q for q in row.quantities if not q.is_gradient]
    keys = [k for q in keys for k in (q.keys if q.kind == "custom" else (q.key,))]

    def run(d):
        def loss(d):
            out = registry.evaluate(row, {**fixed, **d}, ex.static)
            return _scalar(out, keys), out

        (s, out), g = jax.value_and_grad(loss, has_aux=True)(d)
        return s, out, g

    def reference(d):
        return row.reference(**fixed, **d, **ex.static)

    (s, out, grads), ref = jax.tree.map(  # to NumPy: no eager slicing below
        np.asarray, jax.jit(jax.vmap(lambda d: (run(d), reference(d))))(batch))
    for k in row.keys:
        assert out[k].dtype == jnp.float64, f"{row.name} {k}: dtype {out[k].dtype}"
        for i in range(len(items)):
            _close(out[k][i], ref[k][i], 1e-9, f"{row.name} {k} (batch item {i})")
    g0 = jax.tree.map(lambda g: g[0], grads)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(g0)), (
        f"{row.name}: non-finite gradient"
    )
    directional = sum(
        float(np.sum(np.asarray(g) * u)) for g, u in zip(jax.tree.leaves(g0), jax.tree.leaves(v))
    )
    central = float(s[3] - s[4]) / (2 * h)
    assert math.isclose(directional, central, rel_tol=1e-6, abs_tol=1e-6), (
        row.name,
        directional,
        central,
    )


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_float32_in_float32_out(row):
    """Float32 inputs give float32 quantities of the reference's shapes (traced, not compiled:
    the numbers are checked in float64 above)."""
    ex = row.example(np.random.default_rng(0), np.float32)
    out = jax.eval_shape(lambda inp: registry.evaluate(row, inp, ex.static), ex.inputs)
    ref = jax.eval_shape(lambda inp: row.reference(**inp, **ex.static), ex.inputs)
    for k in row.keys:
        assert out[k].dtype == jnp.float32, f"{row.name} {k}: dtype {out[k].dtype}"
        assert out[k].shape == ref[k].shape, (
            f"{row.name} {k}: shape {out[k].shape} != {ref[k].shape}"
        )


# ------------------------------------------------------------------ registry and docs


def test_registry_rows_are_well_formed():
    assert len(set(IDS)) == len(IDS), "duplicate row names"
    assert registry.names() == tuple(IDS)
    assert registry.get("hopfield").name == "hopfield"
    with pytest.raises(KeyError, match="no mechanism named 'nope'"):
        registry.get("nope")
    models = {m.model for m in ROWS}
    for name in mech.__all__:
        obj = getattr(mech, name)
        assert obj.__doc__, f"structinfer.mechanisms.{name} has no docstring"
    for model in models:
        assert "Reference:" in model.__doc__, f"{model.__name__}: no paper reference"
    for m in ROWS:  # the keys a row compares all come from the engine and the reference
        assert m.paper in registry.PAPER_KEYS, (m.name, m.paper)
        ex = m.example(np.random.default_rng(0), np.float32)
        assert ex.batch in ex.inputs, m.name
        ref = jax.eval_shape(lambda inp: m.reference(**inp, **ex.static), ex.inputs)  # noqa: B023
        assert set(m.keys) <= set(ref), m.name


def test_every_public_mechanism_has_a_row():
    """The recipe "one model file + one row" (docs/architecture.md) is enforced: a public
    model of ``structinfer.mechanisms`` without a registry row fails here."""
    models = {id(m.model) for m in ROWS}
    missing = [
        name
        for name in mech.__all__
        if inspect.isfunction(getattr(mech, name))
        and id(getattr(mech, name)) not in models
        and name not in HELPERS
    ]
    assert not missing, (
        f"public mechanism(s) {missing} of structinfer.mechanisms have no row in "
        "structinfer/testing/registry.py: add one (example factory, reference formula and "
        "row; docs/architecture.md, 'Adding a mechanism'), or, if a name is a helper and "
        "not a model, list it in HELPERS in tests/test_mechanisms.py"
    )
    stale = sorted(set(HELPERS) - set(mech.__all__))
    assert not stale, f"HELPERS names that structinfer.mechanisms no longer exports: {stale}"
    rows_of_helpers = sorted(n for n in HELPERS if id(getattr(mech, n)) in models)
    assert not rows_of_helpers, f"models listed as HELPERS: {rows_of_helpers}"


def _loaded_globals(fn) -> set[str]:
    """The global names ``fn`` loads, in its own code and in any function nested in it."""
    codes, names = [fn.__code__], set()
    while codes:
        code = codes.pop()
        names |= {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def _engine_uses(fn, seen=None) -> list[str]:
    """Names from ``structinfer`` that ``fn`` reaches other than the oracles and the
    registry's other references (``_ref_*``), following those transitively."""
    seen = set() if seen is None else seen
    if fn in seen:
        return []
    seen.add(fn)
    found = []
    for name in sorted(_loaded_globals(fn)):
        if name not in fn.__globals__:
            continue  # a builtin
        obj = fn.__globals__[name]
        where = (
            obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
        )
        where = where or type(obj).__module__
        if not where.startswith("structinfer"):
            continue
        own_ref = where == registry.__name__ and getattr(obj, "__name__", "").startswith("_ref")
        if where == oracles.__name__ or own_ref:
            if inspect.isfunction(obj):
                found += _engine_uses(obj, seen)
        else:
            found.append(f"{fn.__qualname__} uses {name} ({where})")
    return found


def test_references_never_reach_the_engine():
    """A reference is an independent oracle: it may use jax, numpy and
    ``structinfer.testing.oracles`` (which imports nothing from structinfer), never the
    models, the engine or ``evaluate`` — else an engine bug could hide in its own check."""
    for node in ast.walk(ast.parse(inspect.getsource(oracles))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not node.module.startswith("structinfer"), ast.dump(node)
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("structinfer") for a in node.names), ast.dump(node)
    uses = sorted({u for m in ROWS for u in _engine_uses(m.reference)})
    assert not uses, f"references that reach structinfer outside the oracles: {uses}"


def test_every_table1_row_and_paper_is_covered():
    papers = {m.paper for m in ROWS}
    assert papers == {"SB", "T", "M"}
    table1 = {int(r) for m in ROWS for r in _table_rows(m.section)}
    assert table1 == set(range(1, 13)), f"Singh & Buckley Table 1 rows covered: {sorted(table1)}"


def _table_rows(section):
    import re

    return re.findall(r"Table 1 row (\d+)", section)


# --------------------------------------------------------------- behaviour beyond rows


def _idw_predict(q, keys, values, eps, p=2.0):
    w = 1.0 / (eps + np.sum((keys - q) ** 2, -1) ** (p / 2))
    return (w / w.sum()) @ values


def test_idw_special_case_flips_with_the_smallest_eta(x64):
    """McCarter sec. 2.2: with eta from eq. 7 the prediction flips to c for any larger eta
    and not for a smaller one; a bisection over eta on a plain IDW implementation finds
    the same threshold."""
    r = np.random.default_rng(3)
    keys, values = r.normal(size=(7, 2)), r.normal(size=(7, 3))
    q, eps = r.normal(size=2), 1e-2
    before = _idw_predict(q, keys, values, eps)
    c = int(np.argmin(before))  # a class that is not predicted
    eta = float(mech.special_case_eta(jnp.asarray(q), keys, values, c, 2.0, eps))
    assert eta > 0

    predict = jax.jit(
        lambda k2, v2: si.expectation(
            mech.idw_attention, "out", jnp.asarray(q)[None], k2, v2, "idw", 2.0, eps
        )[0]
    )
    for factor, flips in ((1 + 1e-6, True), (1 - 1e-6, False)):
        k2, v2 = mech.augment_special_case(keys, values, jnp.asarray(q), c, eta * factor)
        out = np.asarray(predict(k2, v2))
        assert (int(np.argmax(out)) == c) is flips, (factor, out)
        np.testing.assert_allclose(
            out, _idw_predict(q, np.asarray(k2), np.asarray(v2), eps), atol=1e-12
        )

    lo, hi = 0.0, 1.0
    while (
        int(
            np.argmax(
                _idw_predict(
                    q,
                    *map(
                        np.asarray, mech.augment_special_case(keys, values, jnp.asarray(q), c, hi)
                    ),
                    eps,
                )
            )
        )
        != c
    ):
        hi *= 2
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        k2, v2 = mech.augment_special_case(keys, values, jnp.asarray(q), c, mid)
        if int(np.argmax(_idw_predict(q, np.asarray(k2), np.asarray(v2), eps))) == c:
            hi = mid
        else:
            lo = mid
    assert math.isclose(hi, eta, rel_tol=1e-9)


def test_model_expansion_keeps_explained_points_and_full_buffers(x64):
    r = np.random.default_rng(4)
    comps = np.concatenate([r.normal(size=(3, 2)), np.zeros((2, 2))])
    active = np.array([True, True, True, False, False])
    step = jax.jit(mech.expand_components, static_argnums=(3, 4))
    c1, a1, e1 = step(jnp.asarray(comps[1] + 0.01), comps, active, 5.0, 1.0)
    assert float(e1) < 5.0
    np.testing.assert_array_equal(a1, active)
    np.testing.assert_array_equal(c1, comps)
    far = jnp.asarray([9.0, -9.0])
    c2, a2, e2 = step(far, comps, active, 5.0, 1.0)
    assert float(e2) > 5.0 and bool(a2[3]) and not bool(a2[4])
    np.testing.assert_array_equal(c2[3], far)
    full = np.ones(5, bool)
    c3, a3, _ = step(far, comps, full, 5.0, 1.0)
    np.testing.assert_array_equal(a3, full)
    np.testing.assert_array_equal(c3, comps)


def test_gmm_stationary_point_is_the_m_step(x64):
    """Tschantz v2 sec. 2: -dE/dmu_k = 0 at mu_k = sum_i alpha_ik x_i / sum_i alpha_ik."""
    r = np.random.default_rng(5)
    x, means = r.normal(size=(7, 3)), r.normal(size=(5, 3))
    prec = np.broadcast_to(np.eye(3), (5, 3, 3)) * 1.7
    logw = r.normal(size=5)
    alpha = jax.jit(lambda *a: si.marginals(mech.gaussian_mixture, *a)["component"])(
        x, means, prec, logw
    )
    m_step = (np.asarray(alpha).T @ x) / np.asarray(alpha).sum(0)[:, None]
    # with the responsibilities held fixed, the gradient vanishes at the M-step means
    g = np.einsum("nk,kde,nke->kd", alpha, prec, x[:, None] - m_step[None])
    np.testing.assert_allclose(g, 0.0, atol=1e-12)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: mech.block_slot_attention(
                np.ones((7, 5)), np.ones((2, 3, 2)), np.ones((2, 5)), np.ones((2, 5)), 2
            ),
            "must tile the slot size 5",
        ),
        (
            lambda: mech.relative_position_attention(
                np.ones((7, 3)), np.ones((2, 3)), np.ones((2, 3)), None, np.ones(7), "fourier"
            ),
            "unknown parameterisation 'fourier'",
        ),
        (lambda: mech.hopfield(np.ones((7, 3)), 5, beta=0.0), "beta must be > 0"),
        (lambda: mech.tensor_attention(np.ones(7), np.ones((3, 5, 2))), "1-d integer array"),
        (
            lambda: mech.layer_norm_energy(np.ones((5, 7)), np.ones(7), np.ones(7)),
            "gamma must be a scalar",
        ),
        (
            lambda: mech.cross_attention(
                np.ones((5, 3)), np.ones((7, 3)), np.ones((2, 4)), np.ones((2, 3))
            ),
            r"`wq` must be a \(out, 3\) matrix",
        ),
        (
            lambda: mech.graph_attention(
                np.ones((7, 3)), np.ones((2, 3)), np.ones((2, 3)), None, np.ones((5, 5))
            ),
            r"adjacency must be \(7, 7\)",
        ),
        (
            lambda: mech.idw_attention(
                np.ones((5, 3)), np.ones((7, 3)), np.ones((7, 2)), score="cosine"
            ),
            "unknown score 'cosine'",
        ),
        (
            lambda: mech.lse_graphical_model(
                np.ones((7, 3)), (np.eye(3),), (mech.LSETerm("a", (0,), (9,)),)
            ),
            "outside 0..6",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("name", ["slds", "dynamic_mixture", "atari"])
def test_switching_dynamics_score_16_bit_inputs_in_float32(name):
    """Regression: the switching models' transition scores (a quadratic form in the
    residuals) were computed in bfloat16 for bfloat16 inputs, so the modes' posterior was
    1% off a float32 run on the same rounded inputs; the table is now summed in float32,
    as every `si.scores` table of 16-bit features is."""
    row = next(r for r in ROWS if r.name == name)
    ex = row.example(np.random.default_rng(0), jnp.bfloat16)
    up = jax.tree.map(lambda a: a.astype(jnp.float32)
                      if jnp.issubdtype(a.dtype, jnp.floating) else a, ex.inputs)
    run = jax.jit(lambda i: {k: v for k, v in registry.evaluate(row, i, ex.static).items()
                             if k.startswith("attention:")})
    got, want = run(ex.inputs), run(up)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
