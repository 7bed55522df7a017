"""Trust at every size: regressions for silent wrong answers and size-limited failures.

Every engine function, on every structural prior, eagerly and under ``jit``, in
float32 and float64, with a heads plate, against a plain NumPy reference written
here; the engine's memory (largest intermediate of the traced program) in
children x parents; ``child=`` chains inside batch plates against brute force;
NumPyro's own tools on an ``si.edge`` model with a forbidden parent scoring far
above the allowed ones; ``si.attention`` rows with no allowed parent.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conftest import float64, matrix, numpyro_provenance_works
from numpyro.contrib.funsor import enum, infer_discrete
from numpyro.contrib.funsor import log_density as funsor_log_density
from numpyro.handlers import substitute, trace
from numpyro.infer import MCMC, NUTS, SVI, Predictive, TraceEnum_ELBO
from numpyro.infer.util import initialize_model
from numpyro.ops.indexing import Vindex

import structinfer as si
from structinfer import priors as P

pytestmark = pytest.mark.gpu  # the GPU subset: pytest -m gpu

N, M, H, D = 5, 7, 3, 2  # children, parents, heads, value dim (distinct primes)
OFF = M - N  # children are the last N of M positions


def _mask(r):
    mask = r.random((N, M)) < 0.5
    mask[np.arange(N), r.integers(0, M, N)] = True
    return mask


def _prior_cases():
    r = np.random.default_rng(0)
    cat = r.normal(size=(N, M))
    cat[r.random((N, M)) < 0.3] = -np.inf
    cat[np.arange(N), r.integers(0, M, N)] = 0.0
    blocks = np.array([[True, False, True, False], [False, True, True, True], [True, True, False, True]])
    return {
        "uniform": (lambda: P.Uniform(M), N, M),
        "mask": (lambda: P.Restricted(_mask(np.random.default_rng(1))), N, M),
        "causal": (lambda: P.Restricted.causal(N, M, offset=OFF), N, M),
        "causal_noself": (lambda: P.Restricted.causal(N, M, include_self=False, offset=OFF), N, M),
        "window": (lambda: P.Restricted.window(N, 3, M, offset=OFF), N, M),
        "window_2sided": (lambda: P.Restricted.window(N, 2, M, causal=False, offset=OFF), N, M),
        "graph": (lambda: P.Restricted.from_graph(_mask(np.random.default_rng(2))), N, M),
        "block_sparse": (lambda: P.Restricted.block_sparse(blocks, 2), 6, 8),
        "categorical": (lambda: P.Categorical(cat), N, M),
        "relpos": (lambda: P.RelativePosition(
            np.random.default_rng(3).normal(size=N + OFF + M - 1), M, offset=OFF), N, M),
        "relpos_causal_clipped": (lambda: P.RelativePosition(
            np.random.default_rng(4).normal(size=5), M, offset=OFF, max_distance=2,
            causal=True), N, M),
        "circulant": (lambda: P.RelativePosition.circulant(
            np.random.default_rng(5).normal(size=M)), M, M),
        "hartley": (lambda: P.RelativePosition.hartley(
            np.random.default_rng(6).normal(size=3), M, causal=True), M, M),
        "geometric": (lambda: P.Geometric(0.3, M, offset=OFF), N, M),
        "geometric_noself_capped": (lambda: P.Geometric(
            0.6, M, include_self=False, offset=OFF, max_distance=3), N, M),
    }


PRIORS = _prior_cases()


def heads_model(prior, score, v):
    """``H`` heads over ``n`` children: one edge site per (head, child)."""
    with numpyro.plate("heads", score.shape[0], dim=-2):
        with numpyro.plate("children", score.shape[1], dim=-1):
            j = si.edge("phi", prior, score)
            numpyro.deterministic("out", Vindex(v)[jnp.arange(v.shape[0])[:, None], j])


def _inputs(name, dtype):
    make, n, m = PRIORS[name]
    r = np.random.default_rng(7)
    score = (3 * r.normal(size=(H, n, m))).astype(dtype)
    v = r.normal(size=(H, m, D)).astype(dtype)
    return make, n, m, score, v


def _reference(prior, score, v):
    logits = np.asarray(prior.log_table(score.shape[1]), np.float64) + np.asarray(score, np.float64)
    lse = np.logaddexp.reduce(logits, axis=-1)
    p = np.exp(logits - lse[..., None])
    return lse.sum(), p, np.einsum("hij,hjd->hid", p, np.asarray(v, np.float64)), logits.argmax(-1)


def _engine(fn_name):
    def call(model, *args):
        if fn_name == "sample_edges":
            return si.sample_edges(jax.random.PRNGKey(0), model, *args)
        if fn_name == "expectation":
            return si.expectation(model, "out", *args)
        return getattr(si, fn_name)(model, *args)

    return call


#: the default run's float64 cases; every other prior runs in float32 (every prior once,
#: each dtype on several priors; ``-m exhaustive`` runs the rest of the matrix). The two
#: square (m x m) priors share a dtype, so their eager runs share the op-by-op compiles
FLOAT64_PRIORS = ("mask", "causal", "categorical", "relpos_causal_clipped", "circulant",
                  "hartley", "geometric_noself_capped")


@pytest.mark.parametrize("prior_name, dtype", matrix(
    itertools.product(PRIORS, ["float32", "float64"]),
    keep=lambda prior, dtype: (dtype == "float64") == (prior in FLOAT64_PRIORS)))
def test_every_engine_every_prior_eager_and_jit(prior_name, dtype):
    with float64() if dtype == "float64" else _nullcontext():
        make, n, m, score, v = _inputs(prior_name, dtype)
        prior = make()
        logz, p, out, amax = _reference(prior, score, v)
        allowed = np.isfinite(np.asarray(prior.log_table(n)))
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=1e-10, atol=1e-10)
        names = ("log_marginal", "marginals", "expectation", "map_edges", "sample_edges")

        def every_engine(s, vv):
            return tuple(_engine(name)(heads_model, make(), s, vv) for name in names)

        # eagerly (each engine on concrete arrays), then the five engines under one jit
        # (one compiled program, not five: each engine is still traced and staged alone)
        for run in (every_engine, jax.jit(every_engine)):
            got_logz, got_p, got_out, got_amax, got_draw = run(jnp.asarray(score), jnp.asarray(v))
            np.testing.assert_allclose(got_logz, logz, **tol)
            np.testing.assert_allclose(got_p["phi"], p, **tol)
            np.testing.assert_allclose(got_out, out, **tol)
            np.testing.assert_array_equal(got_amax["phi"], amax)
            draw = np.asarray(got_draw["phi"])
            assert draw.shape == (H, n)
            assert allowed[np.broadcast_to(np.arange(n), (H, n)), draw].all(), "drew a forbidden parent"


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("prior_name", ["causal", "categorical", "geometric_noself_capped", "mask"])
def test_sample_edges_frequencies_match_marginals(prior_name):
    make, n, m, score, v = _inputs(prior_name, "float32")
    prior = make()
    _, p, _, _ = _reference(prior, score, v)
    num = 4000
    keys = jax.random.split(jax.random.PRNGKey(1), num)
    # under jit: one program, not an eager vmap's hundreds of primitive compiles
    draws = jax.jit(jax.vmap(lambda k: si.sample_edges(k, heads_model, prior, score, v)["phi"]))(keys)
    freq = np.stack([(np.asarray(draws) == j).mean(0) for j in range(m)], -1)
    sd = np.sqrt(p * (1 - p) / num) + 1e-3
    assert np.all(np.abs(freq - p) < 5 * sd)
    assert np.all(freq[p == 0] == 0)


# ---------------------------------------------------------------------------- memory

def _max_intermediate(jaxpr) -> int:
    """Largest array (elements) produced anywhere in a closed jaxpr, sub-jaxprs included."""
    best = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = getattr(var.aval, "shape", ())
            best = max(best, int(np.prod(shape)) if shape else 1)
        for p in eqn.params.values():
            subs = p if isinstance(p, (list, tuple)) else [p]
            for sub in subs:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    best = max(best, _max_intermediate(inner))
                elif hasattr(sub, "eqns"):
                    best = max(best, _max_intermediate(sub))
    return best


def causal_attention(q, k, v):
    n = q.shape[0]
    with numpyro.plate("queries", n):
        j = si.edge("phi", si.priors.Restricted.window(n, 17, k.shape[0], offset=k.shape[0] - n),
                    si.scores.Dot(q, k))
        numpyro.deterministic("out", Vindex(v)[j])


@pytest.mark.parametrize("fn", ["log_marginal", "energy", "marginals", "expectation",
                                "map_edges", "sample_edges"])
def test_exact_engine_memory_is_children_times_parents(fn):
    """Regression: the edge log-prob broadcast the (n, m) table against the enumerated
    value, an (m, n, m) array (4.7 GB at n = 1024)."""
    n, m, d = 89, 97, 5
    r = np.random.default_rng(0)
    q, k, v = r.normal(size=(n, d)), r.normal(size=(m, d)), r.normal(size=(m, d))
    jx = jax.make_jaxpr(lambda *a: _engine(fn)(causal_attention, *a))(q, k, v)
    assert _max_intermediate(jx.jaxpr) <= 4 * n * m, _max_intermediate(jx.jaxpr) / (n * m)


def test_gather_matches_vindex_on_every_layout():
    r = np.random.default_rng(0)
    cases = [((5, 7), (11, 1, 1)), ((3, 1, 5, 7), (11, 1, 1, 1, 1)), ((4, 5, 7), (11, 1, 1, 1)),
             ((5, 7), (7,)), ((5, 7), (5, 7)), ((2, 5, 7), (11, 1, 5, 7)), ((1, 5, 7), (11, 1, 1, 1))]
    ts_is = [(jnp.asarray(r.normal(size=ts + (13,))), jnp.asarray(r.integers(0, 13, size=ix)))
             for ts, ix in cases]
    # the layouts are shape logic: one jitted program checks them all (the eager gather
    # runs below, on the enumerated layouts)
    pairs = jax.jit(lambda ti: [(si.gather(t, i), Vindex(t)[..., i]) for t, i in ti])(ts_is)
    for got, want in pairs:
        np.testing.assert_array_equal(got, want)
    # the enumerated value 0..m-1 (a transpose) and a permutation of it (the gather)
    for index in (np.arange(13), r.permutation(13)):
        for ts, lead in (((5, 7), (13, 1, 1)), ((2, 1, 7), (13, 1, 1, 1)), ((3, 5, 7), (1, 13, 1, 1, 1))):
            t = jnp.asarray(r.normal(size=ts + (13,)))
            i = jnp.asarray(index.reshape(lead))
            np.testing.assert_array_equal(si.gather(t, i), Vindex(t)[..., i])
            np.testing.assert_array_equal(jax.jit(si.gather)(t, i), Vindex(t)[..., i])
    # out of range reads are NaN, never a clamped finite number
    assert np.isnan(si.gather(jnp.zeros((2, 3)), jnp.full((4, 1), 3))).all()


def test_gather_reads_a_negative_index_as_nan_not_a_wrapped_row():
    """A parent index is never negative: -1 is the sentinel `map_edges` and
    `sample_edges` return under jit where no structure is possible, so
    `si.gather(V, path)` must not read the last parent there (NumPy's wrap), on either
    of gather's layouts (a column take, a broadcast Vindex), eagerly and under jit."""
    table = jnp.arange(12.0).reshape(3, 4) + 1.0
    for index in (jnp.array([0, -1, 2]),  # one index per row: the broadcast layout
                  jnp.array([[0], [-1], [-4], [3]])):  # an enumerated-like column
        for run in (si.gather, jax.jit(si.gather)):
            got = np.asarray(run(table, index))
            bad = np.broadcast_to(np.asarray(index) < 0, got.shape)
            assert np.isnan(got[bad]).all(), got
            assert np.isfinite(got[~bad]).all(), got


def test_gather_reads_an_integer_table_out_of_range_alike_on_both_layouts():
    """Regression: an integer table read past its last parent (or at -1) filled with the
    dtype's most negative value on the column-take layout but returned a clamped row's
    value, a finite wrong number, on the broadcast (Vindex) layout."""
    table = jnp.arange(12, dtype=jnp.int32).reshape(3, 4) + 1
    fill = np.iinfo(np.int32).min
    for index in (jnp.array([0, 4, -1]),  # one index per row: the broadcast layout
                  jnp.array([[0], [4], [-1], [3]])):  # an enumerated-like column
        for run in (si.gather, jax.jit(si.gather)):
            got = np.asarray(run(table, index))
            bad = np.broadcast_to((np.asarray(index) < 0) | (np.asarray(index) > 3), got.shape)
            assert (got[bad] == fill).all(), got
            assert (got[~bad] > 0).all(), got


# ----------------------------------------------------------------- child= in batch plates

def two_hop(score, v):
    b, n, _ = score.shape
    with numpyro.plate("batch", b, dim=-2), numpyro.plate("nodes", n, dim=-1):
        j = si.edge("hop1", si.priors.Uniform(n), score)
        k = si.edge("hop2", si.priors.Uniform(n), score, child=j)
        numpyro.deterministic("out", Vindex(v)[jnp.arange(b)[:, None], k])


def _two_hop_brute(score, v):
    """Enumerate (hop1, hop2) per (batch, child) by hand."""
    b, n, _ = score.shape
    logp = score - np.log(n)
    cond = logp - np.logaddexp.reduce(logp, -1, keepdims=True)
    logz, out = 0.0, np.zeros((b, n, v.shape[-1]))
    for bb, i in itertools.product(range(b), range(n)):
        terms = {(j, k): logp[bb, i, j] + cond[bb, j, k] for j in range(n) for k in range(n)}
        lz = np.logaddexp.reduce(list(terms.values()))
        logz += lz
        out[bb, i] = sum(np.exp(t - lz) * v[bb, k] for (j, k), t in terms.items())
    return logz, out


def _two_hop_both(s, vv):
    return si.log_marginal(two_hop, s, vv), si.expectation(two_hop, "out", s, vv)


@pytest.mark.parametrize("b", [5, 3])  # batch == n aligned the batch dim with the children dim
def test_child_chain_inside_batch_plate(b):
    """Both engines under one jit for each batch size; eagerly too at the regression's
    batch == n (b = 3 eagerly is the same code on other shapes: op-by-op compiles only)."""
    with float64():
        n = 5
        r = np.random.default_rng(b)
        score, v = r.normal(size=(b, n, n)), r.normal(size=(b, n, 2))
        logz, out = _two_hop_brute(score, v)
        for run in ((_two_hop_both, jax.jit(_two_hop_both)) if b == n else (jax.jit(_two_hop_both),)):
            got_logz, got_out = run(score, v)
            np.testing.assert_allclose(got_logz, logz, rtol=1e-10)
            np.testing.assert_allclose(got_out, out, atol=1e-10)


# ----------------------------------------------------- NumPyro's own tools, float32-safe

def far_forbidden(scale_loc, y):
    """Causal attention whose forbidden (future) parents score ~120 above the allowed ones."""
    n = y.shape[0]
    w = numpyro.sample("w", dist.Normal(scale_loc, 1.0))
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    score = jnp.where(d < 0, 120.0, 0.0) + w * jnp.asarray(-np.abs(d), jnp.float32)
    with numpyro.plate("nodes", n):
        j = si.edge("phi", si.priors.Restricted.causal(n), score)
        numpyro.sample("y", dist.Normal(jnp.asarray(y)[j], 1.0), obs=y)


Y = np.linspace(-1.0, 1.0, 6).astype(np.float32)


def _exact(w):
    return si.log_marginal(substitute(far_forbidden, data={"w": w}), 0.0, Y)


def test_numpyro_log_density_under_enum_is_float32_safe():
    want = _exact(jnp.float32(0.5))
    assert np.isfinite(want)
    lp, _ = funsor_log_density(enum(substitute(far_forbidden, data={"w": 0.5}), -2),
                               (0.0, Y), {}, {})
    np.testing.assert_allclose(lp, want, rtol=1e-5)


def test_trace_enum_elbo_is_float32_safe():
    if not numpyro_provenance_works():
        pytest.skip("NumPyro <= 0.21 on JAX >= 0.11.1 or NumPyro 0.15.0/0.15.1 on JAX >= "
                    "0.4.31: TraceEnum_ELBO fails on any model with array arguments (upstream)")

    def guide(scale_loc, y):
        numpyro.sample("w", dist.Delta(jnp.float32(0.5)))

    loss = TraceEnum_ELBO().loss(jax.random.PRNGKey(0), {}, far_forbidden, guide, 0.0, Y)
    np.testing.assert_allclose(-loss, _exact(jnp.float32(0.5)), rtol=1e-5)
    svi = SVI(far_forbidden, guide, numpyro.optim.Adam(0.1), TraceEnum_ELBO())
    state = svi.init(jax.random.PRNGKey(0), 0.0, Y)
    assert np.isfinite(svi.evaluate(state, 0.0, Y))


def test_nuts_potential_is_float32_safe():
    info = initialize_model(jax.random.PRNGKey(0), far_forbidden, model_args=(0.0, Y))
    z = {"w": jnp.float32(0.5)}
    np.testing.assert_allclose(-info.potential_fn(z), _exact(z["w"]), rtol=1e-5)
    mcmc = MCMC(NUTS(far_forbidden), num_warmup=20, num_samples=20, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), 0.0, Y, extra_fields=("potential_energy",))
    assert np.isfinite(mcmc.get_extra_fields()["potential_energy"]).all()


def test_infer_discrete_and_predictive_on_edge_model():
    """NumPyro's ``infer_discrete`` on an ``si.edge`` model: MAP eagerly, draws under jit.

    (Eager draws with NumPyro's default validation raise inside funsor, which builds a
    validated ``Categorical`` from logits holding the forbidden parents' ``-inf``;
    ``si.sample_edges`` turns that validation off around its own call.)
    """
    n = Y.shape[0]
    model = substitute(far_forbidden, data={"w": 0.5})

    def draw(temperature):
        tr = trace(infer_discrete(model, first_available_dim=-2, temperature=temperature,
                                  rng_key=jax.random.PRNGKey(0))).get_trace(0.0, Y)
        return tr["phi"]["value"]

    np.testing.assert_array_equal(draw(0), si.map_edges(model, 0.0, Y)["phi"])
    for phi in (jax.jit(lambda: draw(1))(), _eager_without_validation(lambda: draw(1))):
        assert (np.asarray(phi) <= np.arange(n)).all(), "a future (forbidden) parent was drawn"
    pred = Predictive(far_forbidden, posterior_samples={"w": jnp.full((4,), 0.5, jnp.float32)},
                      infer_discrete=True)(jax.random.PRNGKey(0), 0.0, Y)
    assert (np.asarray(pred["phi"]) <= np.arange(n)).all()


def _eager_without_validation(f):
    with numpyro.validation_enabled(False):
        return f()


# -------------------------------------------------------------- si.attention never lies

def masked_attention(q, k, v, mask):
    with numpyro.plate("queries", q.shape[0]):
        j = si.edge("phi", si.priors.Restricted(mask), si.scores.Dot(q, k))
        numpyro.deterministic("out", Vindex(v)[j])


def categorical_attention(q, k, v, logits):
    with numpyro.plate("queries", q.shape[0]):
        j = si.edge("phi", si.priors.Categorical(logits), si.scores.Dot(q, k))
        numpyro.deterministic("out", Vindex(v)[j])


@functools.cache
def _qkv():
    r = np.random.default_rng(0)
    return (r.normal(size=(N, 4)).astype(np.float32), r.normal(size=(M, 4)).astype(np.float32),
            r.normal(size=(M, 3)).astype(np.float32))


@pytest.mark.parametrize("backend", ["auto", "dense", "blocked", "exact"])
def test_attention_row_with_no_allowed_parent(backend):
    q, k, v = _qkv()
    logits = np.zeros((N, M), np.float32)
    logits[2] = -np.inf  # child 2 has no allowed parent
    f = si.attention(categorical_attention, "out", backend=backend, block_q=2, block_k=4)
    with pytest.raises(ValueError, match=r"no parent for child 2"):
        f(q, k, v, logits)
    out = np.asarray(jax.jit(f)(q, k, v, logits))
    assert np.isnan(out[2]).all()
    ok = [0, 1, 3, 4]
    want = si.expectation(categorical_attention, "out", q, k, v, np.where(np.isinf(logits), 0.0, logits))
    np.testing.assert_allclose(out[ok], np.asarray(want)[ok], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "dense", "exact"])
def test_attention_with_one_parent_and_a_child_it_does_not_allow(backend):
    """One key (m = 1): the edge has no sum over parents, so funsor's 0 / 0 of an empty
    row never happens and the row's value once read as the key's value, finite. Eagerly
    the row is refused; under jit the answer is NaN (its marginals and expectation too)."""
    q, k, v = _qkv()[0], _qkv()[1][:1], _qkv()[2][:1]
    logits = np.zeros((N, 1), np.float32)
    logits[2] = -np.inf  # child 2 has no allowed parent
    f = si.attention(categorical_attention, "out", backend=backend)
    with pytest.raises(ValueError, match=r"no parent for child 2"):
        f(q, k, v, logits)
    assert np.isnan(np.asarray(jax.jit(f)(q, k, v, logits))[2]).all()
    def marg(*a):
        return si.marginals(categorical_attention, *a)["phi"]
    assert np.isnan(np.asarray(jax.jit(marg)(q, k, v, logits))[2]).all()
    def expect(*a):
        return si.expectation(categorical_attention, "out", *a)
    assert np.isnan(np.asarray(jax.jit(expect)(q, k, v, logits))[2]).all()
    ok = np.zeros((N, 1), np.float32)  # every child allowed: the one parent, exactly
    np.testing.assert_allclose(np.asarray(jax.jit(f)(q, k, v, ok)),
                               np.broadcast_to(v, (N, v.shape[1])), rtol=1e-6)


def two_masked_edges(q, k, v, good, bad):
    with numpyro.plate("queries", q.shape[0]):
        a = si.edge("a", si.priors.Restricted(good), si.scores.Dot(q, k))
        b = si.edge("b", si.priors.Restricted(bad), si.scores.Dot(q, k))
        numpyro.deterministic("out", Vindex(v)[a] + Vindex(v)[b])


@pytest.mark.parametrize("backend", ["auto", "dense", "blocked", "pallas"])
def test_attention_empty_mask_row_names_the_edge_site(backend):
    """A Restricted mask (an argument: traced inside attention's jit) with an empty row:
    the eager error names the edge site, as the exact engine's own checks do."""
    q, k, v = _qkv()
    good = np.ones((N, M), bool)
    bad = good.copy()
    bad[4] = False
    f = si.attention(masked_attention, "out", backend=backend, block_q=2, block_k=4)
    with pytest.raises(ValueError, match=r"^edge site 'phi': Restricted prior allows no "
                                         r"parent for child 4"):
        f(q, k, v, bad)
    assert np.isnan(np.asarray(jax.jit(f)(q, k, v, bad))[4]).all()
    g = si.attention(two_masked_edges, "out", backend=backend, block_q=2, block_k=4)
    with pytest.raises(ValueError, match=r"^edge site 'b': Restricted prior allows no "
                                         r"parent for child 4"):
        g(q, k, v, good, bad)


def test_check_rows_after_a_vmapped_call():
    """f.with_log_normalisers under jax.vmap, then one check_rows on the bad element."""
    q, k, v = _qkv()
    logits = np.zeros((2, N, M), np.float32)
    logits[1, 3] = -np.inf  # element 1, child 3: no allowed parent
    f = si.attention(categorical_attention, "out")
    out, lses = jax.vmap(f.with_log_normalisers, in_axes=(None, None, None, 0))(q, k, v, logits)
    assert set(lses) == {"phi"} and lses["phi"].shape == (2, N)
    assert np.isnan(np.asarray(out[1, 3])).all() and np.isfinite(np.asarray(out[0])).all()
    si.lowering.check_rows(categorical_attention, {"phi": lses["phi"][0]}, q, k, v, logits[0])
    with pytest.raises(ValueError, match=r"no parent for child 3"):
        si.lowering.check_rows(categorical_attention, {"phi": lses["phi"][1]}, q, k, v,
                               logits[1])


@pytest.mark.parametrize("backend", ["auto", "blocked", "exact"])
def test_attention_nan_score_raises_eagerly(backend):
    q, k, v = _qkv()
    q = q.copy()
    q[3, 1] = np.nan
    f = si.attention(masked_attention, "out", backend=backend, block_q=2, block_k=4)
    with pytest.raises(ValueError, match=r"edge site 'phi': score contains NaN"):
        f(q, k, v, np.ones((N, M), bool))
    assert np.isnan(np.asarray(jax.jit(f)(q, k, v, np.ones((N, M), bool)))[3]).all()


# ------------------------------------------- a table read past its end is an error

def short_value(q, k, v):
    with numpyro.plate("queries", q.shape[0]):
        j = si.edge("phi", si.priors.Uniform(k.shape[0]), si.scores.Dot(q, k))
        numpyro.deterministic("out", Vindex(v)[j])


def short_likelihood(q, k, y):
    with numpyro.plate("queries", q.shape[0]):
        j = si.edge("phi", si.priors.Restricted.causal(q.shape[0], k.shape[0]), si.scores.Dot(q, k))
        numpyro.sample("y", dist.Normal(jnp.asarray(y)[j], 1.0), obs=jnp.zeros(q.shape[0]))


@pytest.mark.parametrize("engine", ["log_marginal", "marginals", "expectation", "map_edges",
                                    "sample_edges", "attention", "attention_exact"])
@pytest.mark.parametrize("jitted", [False, True])
def test_value_table_with_fewer_rows_than_parents_is_an_error(engine, jitted):
    """Regression: ``V[j]`` with ``V`` of 6 rows and 7 parents read a clamped row."""
    q, k, v = _qkv()
    model = short_value
    if engine.startswith("attention"):
        backend = "exact" if engine == "attention_exact" else "auto"
        f = si.attention(short_value, "out", backend=backend)
    elif engine in ("log_marginal", "marginals", "map_edges"):
        model = short_likelihood
        f = functools.partial(getattr(si, engine), short_likelihood)
    else:
        f = functools.partial(_engine(engine), short_value)
    f = jax.jit(f) if jitted else f
    with pytest.raises(ValueError, match=r"edge site\(s\) 'phi' takes values 0\.\.6 .* shape \(6,"):
        f(q, k, v[:6] if model is short_value else v[:6, 0])


def test_bounds_check_reads_negative_index_wrap_and_clipping():
    """A direct read of a short table is caught; reads shaped on purpose are not."""
    from structinfer.exact.bounds import check_gather_bounds

    v = jnp.ones((7, 2))
    probes = {"phi": np.arange(7, dtype=np.int32).reshape(7, 1)}
    for ok in (lambda d: jnp.where(d["phi"] > 0, Vindex(v)[d["phi"] - 1], 0.0),
               lambda d: v[jnp.minimum(d["phi"] + 1, 6)], lambda d: jnp.take(v, d["phi"], axis=0),
               lambda d: v[:6][jnp.where(d["phi"] < 6, d["phi"], 0)],  # a sink parent
               lambda d: jnp.take(v[:6], d["phi"], axis=0, mode="clip"),
               lambda d: jnp.take(v[:6], d["phi"], axis=0),  # NaN past the end
               lambda d: jnp.take_along_axis(v[:6], d["phi"], axis=0)):
        check_gather_bounds(ok, probes, "ok")
    for bad in (lambda d: v[:6][d["phi"]], lambda d: Vindex(v[:6])[d["phi"]],
                lambda d: Vindex(jnp.ones((3, 6, 2)))[jnp.arange(3)[:, None], d["phi"][:, None]]):
        with pytest.raises(ValueError, match="takes values 0..6"):
            check_gather_bounds(bad, probes, "bad")


def test_a_short_integer_table_read_at_an_edge_is_an_error():
    """Regression: ``si.gather`` (and ``jnp.take``) of an integer table with fewer entries
    than parents fills past the end with the most negative integer, not NaN; used as an
    index (``V[labels[phi]]``) it wrapped and clamped to row 0, a finite wrong expectation
    (brute force below). The read is refused, eagerly and under jit, as a clamped one is."""
    n, m = 3, 5
    s = jnp.asarray(np.random.default_rng(0).normal(size=(n, m)))
    v = jnp.array([-1.0, 2.0])

    def model(s, labels, read):
        with numpyro.plate("queries", n):
            phi = si.edge("phi", si.priors.Uniform(m), s)
            numpyro.deterministic("out", v[read(labels, phi)])

    p = np.asarray(jax.nn.softmax(s, -1))
    full = jnp.array([0, 1, 0, 1, 1])
    for read in (si.gather, jnp.take):
        for f in (si.expectation, jax.jit(si.expectation, static_argnums=(0, 1, 4))):
            np.testing.assert_allclose(f(model, "out", s, full, read), p @ np.asarray(v)[full],
                                       rtol=1e-5)
            with pytest.raises(ValueError, match=r"edge site\(s\) 'phi' takes values 0\.\.4 "
                                                 r".* shape \(4,\)"):
                f(model, "out", s, full[:4], read)

    def chosen_fill(labels, phi):  # a fill value the model chose, and tests for: read as is
        lab = jnp.take(labels, phi, mode="fill", fill_value=-1)
        return jnp.where(lab >= 0, lab, 0)

    np.testing.assert_allclose(si.expectation(model, "out", s, full[:3], chosen_fill),
                               p @ np.asarray(v)[np.r_[full[:3], 0, 0]], rtol=1e-5)


def test_a_guard_that_leaves_the_edge_value_as_it_is_is_still_checked():
    """Regression: ``v[jnp.maximum(phi, 0)]`` (a guard against a -1 sentinel) and
    ``v[jnp.minimum(phi, 10)]`` are the edge value itself at every parent, but counted as
    arithmetic on the index: a table one row short was read clamped, unchecked. A bound
    that cuts the range (``jnp.minimum(phi, 5)``) is the model's own clipping."""
    from structinfer.exact.bounds import check_gather_bounds

    v = jnp.ones((7, 2))
    probes = {"phi": np.arange(7, dtype=np.int32).reshape(7, 1)}
    check_gather_bounds(lambda d: v[:6][jnp.minimum(d["phi"], 5)], probes, "ok")
    check_gather_bounds(lambda d: v[jnp.maximum(d["phi"], 0)], probes, "ok")
    for bad in (lambda d: v[:6][jnp.maximum(d["phi"], 0)],
                lambda d: v[:6][jnp.minimum(10, d["phi"])],
                lambda d: v[:6][jnp.maximum(jnp.minimum(d["phi"], 6), -1)]):
        with pytest.raises(ValueError, match="takes values 0..6"):
            check_gather_bounds(bad, probes, "bad")


def test_exact_causal_head_under_jit_equals_jax_nn():
    """One causal head at a size where the old (parents x children x parents) log-prob
    needed 0.5 GB: the exact expectation under jit equals jax.nn's attention."""
    n, d = 512, 16
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(n, d)) / d**0.25, jnp.float32) for _ in range(3))

    def causal(q, k, v):
        with numpyro.plate("queries", n):
            j = si.edge("phi", si.priors.Restricted.causal(n), si.scores.Dot(q, k))
            numpyro.deterministic("out", Vindex(v)[j])

    out = jax.jit(lambda *a: si.expectation(causal, "out", *a))(q, k, v)
    want = jax.nn.dot_product_attention(q[None, :, None], k[None, :, None], v[None, :, None],
                                        is_causal=True, scale=1.0)[0, :, 0]
    np.testing.assert_allclose(out, want, atol=2e-6)


def test_structinfer_svi_and_nuts_are_float32_safe():
    """Regression: the wrappers saw the unfolded model and raised NonFiniteEnergyError."""
    _, result = si.infer.svi(jax.random.PRNGKey(0), far_forbidden, 0.0, Y, guide="delta",
                             num_steps=20, progress_bar=False)
    assert np.isfinite(np.asarray(result.losses)).all()
    mcmc = si.infer.nuts(jax.random.PRNGKey(0), far_forbidden, 0.0, Y, num_warmup=10,
                         num_samples=10, progress_bar=False)
    assert np.isfinite(np.asarray(mcmc.get_samples()["w"])).all()


@pytest.mark.parametrize("error", [AssertionError("length mismatch: [2, 1]"),
                                   KeyError("provenance")], ids=["numpyro-0.21", "numpyro-0.15"])
def test_svi_takes_the_exact_elbo_where_numpyro_cannot_trace_dependencies(monkeypatch, error):
    """Regression: where NumPyro's eval_provenance (which TraceEnum_ELBO runs on every model)
    fails, si.infer.svi raised from inside NumPyro: ``AssertionError: length mismatch``
    (NumPyro 0.21 on JAX 0.11.2; later a RuntimeError asking to upgrade NumPyro) and
    ``KeyError: 'provenance'`` (NumPyro 0.15.0, the floor, on JAX 0.4.33). It now takes
    its ELBO from the exact engine: the same loss, and the fit runs."""
    from numpyro.ops import provenance

    def broken(fn, **kwargs):
        raise error

    def guide(scale_loc, y):
        numpyro.sample("w", dist.Delta(jnp.float32(0.5)))

    monkeypatch.setattr(provenance, "eval_provenance", broken)
    fitter, result = si.infer.svi(jax.random.PRNGKey(0), far_forbidden, 0.0, Y, guide=guide,
                                  num_steps=2, progress_bar=False)
    assert np.isfinite(np.asarray(result.losses)).all()
    loss = fitter.loss.loss(jax.random.PRNGKey(1), {}, far_forbidden, guide, 0.0, Y)
    np.testing.assert_allclose(-loss, _exact(jnp.float32(0.5)), rtol=1e-5)
    _, result = si.infer.svi(jax.random.PRNGKey(0), far_forbidden, 0.0, Y, guide="delta",
                             num_steps=20, progress_bar=False)
    assert np.isfinite(np.asarray(result.losses)).all()


def test_sink_parent_model_is_not_a_false_alarm():
    """A null/sink parent (index n of n + 1) masked before the read is a valid model."""
    n = 3
    V = jnp.arange(6.0).reshape(n, 2)

    def model(V, S):
        with numpyro.plate("q", n):
            phi = si.edge("e", si.priors.Uniform(n + 1), S)
            ok = phi < n
            numpyro.deterministic("v", jnp.where(ok[..., None], V[jnp.where(ok, phi, 0)], 0.0))

    S = jnp.zeros((n, n + 1))
    # under jit (the bounds check runs at trace time, as test_value_table_... shows for jit)
    np.testing.assert_allclose(jax.jit(lambda V, S: si.expectation(model, "v", V, S))(V, S),
                               np.broadcast_to(np.asarray(V).sum(0) / (n + 1), (n, 2)), rtol=1e-6)


def test_edge_log_prob_outside_the_support_is_nan():
    """Regression (review): a pinned edge value >= m read a clamped finite log-prob."""
    from structinfer.primitives import EdgeDistribution

    logits = jnp.array([[0.0, -jnp.inf, 1.0], [2.0, 3.0, -jnp.inf]])
    assert np.isnan(EdgeDistribution(logits).log_prob(jnp.array([3, 5]))).all()
    lp = EdgeDistribution(logits).log_prob(jnp.array([2, 1]))
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits, -1)[jnp.arange(2), jnp.array([2, 1])],
                               rtol=1e-6)
