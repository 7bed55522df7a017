"""Edge-posterior distances for every structural prior, against hand counts.

Child ``i`` sits at parent position ``i + offset`` and its distance to parent ``j``
is ``d = i + offset - j`` (``structinfer.priors``). For every prior class (and every
constructor) the offset the diagnostics use must be the one the prior was built
with: here ``expected_distance`` and ``effective_window`` are compared with plain
loops over ``i, j`` that use the offset known to the test, both on tables built
from the prior and through ``to_inference_data`` / ``edge_summary`` (where the
offset is read off the model's edge site).

Sizes: 4 children x 6 parents (cross, offset 2) or 5 x 5 (self attention).
"""

import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC
from numpyro.infer.mcmc import MCMCKernel
from numpyro.ops.indexing import Vindex
from scipy.special import softmax

import structinfer as si
from structinfer import diagnostics as dg
from structinfer import priors as P


def _causal_logits(n, m, offset, lo):
    """Logits allowing parents at distance ``d >= lo`` only, from the test's own grid."""
    d = np.arange(n)[:, None] + offset - np.arange(m)[None, :]
    r = np.random.default_rng(3)
    return np.where(d >= lo, r.normal(size=(n, m)), -np.inf)


def _graph():
    r = np.random.default_rng(4)
    return r.random((5, 5)) < 0.4


def _window_mask(n, m, offset):
    d = np.arange(n)[:, None] + offset - np.arange(m)[None, :]
    return (d >= 1) & (d <= 2)


# (id, builder() -> prior, children n, true offset, allowed(d) or None).
# ``allowed`` states the constructor's meaning in terms of the distance; the test
# checks the prior's support against it, so the "true offset" is the one the prior's
# table was really built with, not just a stored number.
CASES = [
    ("uniform-self", lambda: P.Uniform(5), 5, 0, None),
    ("uniform-cross", lambda: P.Uniform(6, offset=2), 4, 2, None),
    ("restricted-mask", lambda: P.Restricted(_window_mask(4, 6, 2), offset=2), 4, 2,
     lambda d: (d >= 1) & (d <= 2)),
    ("restricted-causal", lambda: P.Restricted.causal(4, 6, include_self=False, offset=2), 4, 2,
     lambda d: d >= 1),
    ("restricted-causal-self", lambda: P.Restricted.causal(5), 5, 0, lambda d: d >= 0),
    ("restricted-window", lambda: P.Restricted.window(4, 3, 6, include_self=False, offset=2),
     4, 2, lambda d: (d >= 1) & (d <= 3)),
    ("restricted-window-two-sided",
     lambda: P.Restricted.window(5, 2, 5, causal=False, include_self=False, offset=1), 5, 1,
     lambda d: (np.abs(d) < 2) & (d != 0)),
    ("restricted-graph", lambda: P.Restricted.from_graph(_graph(), self_loops=True), 5, 0, None),
    ("restricted-block-sparse",
     lambda: P.Restricted.block_sparse(np.array([[1, 0], [1, 1]]), (2, 3)), 4, 0, None),
    ("categorical-self", lambda: P.Categorical(np.random.default_rng(5).normal(size=(5, 5))),
     5, 0, None),
    ("categorical-shared-row", lambda: P.Categorical(np.arange(5.0)), 5, 0, None),
    # the demo's convention: child c is node c + 1, its parents are nodes 0 .. c
    ("categorical-recency", lambda: P.Categorical(_causal_logits(5, 5, 1, 1), offset=1), 5, 1,
     lambda d: d >= 1),
    ("relative-linear", lambda: P.RelativePosition(np.linspace(-1, 1, 4 + 2 + 6 - 1), 6,
                                                   offset=2), 4, 2, None),
    ("relative-clipped-causal",
     lambda: P.RelativePosition(np.arange(5.0), 5, offset=1, max_distance=2, causal=True), 5, 1,
     lambda d: d >= 0),
    ("relative-circulant", lambda: P.RelativePosition.circulant(np.arange(5.0) / 3), 5, 0, None),
    ("relative-hartley", lambda: P.RelativePosition.hartley(np.array([0.3, -0.5, 0.2]), 5), 5, 0,
     None),
    ("geometric", lambda: P.Geometric(0.3, 6, include_self=False, offset=2), 4, 2,
     lambda d: d >= 1),
    ("geometric-truncated", lambda: P.Geometric(0.4, 5, max_distance=3), 5, 0,
     lambda d: (d >= 0) & (d <= 3)),
    # its base prior's offset, with the mask on top (the padding key 5 dropped)
    ("masked-geometric", lambda: P.Masked(P.Geometric(0.3, 6, offset=2), np.arange(6) < 5),
     4, 2, None),
]
IDS = [c[0] for c in CASES]
#: one model per class and per way of stating the offset (each compiles a model)
PIPELINE = ["uniform-cross", "restricted-mask", "restricted-window", "restricted-graph",
            "categorical-self", "categorical-recency", "relative-linear", "relative-circulant",
            "geometric"]


def hand_counts(a, offset, mass):
    """Expected distance and effective window of each child, by plain loops."""
    n, m = a.shape
    expected = np.zeros(n)
    window = np.zeros(n, dtype=int)
    for i in range(n):
        total = 0.0
        for j in range(m):
            total += a[i, j] * (i + offset - j)
        expected[i] = total
        w = 0
        while sum(a[i, j] for j in range(m) if abs(i + offset - j) <= w) < mass - 1e-6:
            w += 1
        window[i] = w
    return expected, window


def _posterior(prior, n, seed=0):
    """A posterior table on the prior's support: prior x exp(random score), renormalised."""
    table = np.asarray(prior.log_table(n), np.float64)
    score = np.random.default_rng(seed).normal(size=table.shape) * 2.0
    return softmax(table + score, axis=-1)


#: priors with no parent positions to measure distances on: a Markov prior's "parents" are
#: the states of a chain (its row is chosen by the previous edge; it has no table)
NO_DISTANCES = {P.Markov}


def test_every_prior_class_is_covered():
    classes = {
        obj for _, obj in inspect.getmembers(P, inspect.isclass)
        if issubclass(obj, P.StructuralPrior) and obj is not P.StructuralPrior
    } - NO_DISTANCES
    covered = {type(build()) for _, build, *_ in CASES}
    assert classes <= covered, f"no distance test for {classes - covered}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_prior_states_its_offset(case):
    _, build, n, offset, allowed = case
    prior = build()
    assert prior.offset == offset
    assert isinstance(prior.offset, int)
    assert prior.describe()["offset"] == offset
    if allowed is not None:  # the table really was built with this offset
        d = np.arange(n)[:, None] + offset - np.arange(prior.num_parents)[None, :]
        support = np.isfinite(np.asarray(prior.log_table(n)))
        np.testing.assert_array_equal(support, np.broadcast_to(allowed(d), support.shape))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_distances_against_hand_count(case):
    _, build, n, offset, _ = case
    prior = build()
    a = _posterior(prior, n)
    for mass in (0.5, 0.9, 1.0):
        expected, window = hand_counts(a, offset, mass)
        # the prior itself is the source of the convention ...
        np.testing.assert_allclose(dg.expected_distance(a, prior), expected, atol=1e-6)
        np.testing.assert_array_equal(dg.effective_window(a, prior, mass), window)
        # ... and its offset, given as a number, means the same
        np.testing.assert_allclose(dg.expected_distance(a, prior.offset), expected, atol=1e-6)
        np.testing.assert_array_equal(dg.effective_window(a, prior.offset, mass), window)
    ds, probs = dg.distance_posterior(a, prior)
    for k, dd in enumerate(ds):
        count = sum(a[i, j] for i in range(n) for j in range(prior.num_parents)
                    if i + offset - j == dd)
        assert float(probs[k]) == pytest.approx(count / n, abs=1e-6)


def _observed_model(prior, n):
    """y_i ~ N(mu[phi_i], s) under ``prior``; s is the one continuous site."""
    mu = jnp.linspace(-2.0, 2.0, prior.num_parents)

    def model(y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("children", n):
            phi = si.edge("phi", prior)
            numpyro.sample("y", dist.Normal(Vindex(mu)[..., phi], s), obs=y)

    return model


class _Draw(NamedTuple):
    i: jax.Array
    z: dict


class FixedDraws(MCMCKernel):
    """A kernel whose chain walks through given draws: an MCMC run without a sampler."""

    def __init__(self, model, draws):
        self._model, self._draws = model, draws

    @property
    def model(self):
        return self._model

    @property
    def sample_field(self):
        return "z"

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        return _Draw(jnp.int32(-1), jax.tree.map(lambda v: v[-1], self._draws))

    def sample(self, state, model_args, model_kwargs):
        i = state.i + 1
        return _Draw(i, jax.tree.map(lambda v: v[i], self._draws))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in PIPELINE],
                         ids=[i for i in IDS if i in PIPELINE])
def test_edge_summary_reads_the_offset_of_every_prior(case):
    """Through the model: ``to_inference_data`` records the site's offset and
    ``edge_summary`` uses it (no fit: two fixed draws of ``s``)."""
    _, build, n, offset, _ = case
    prior = build()
    y = jnp.asarray(np.random.default_rng(1).normal(size=n), jnp.float32)
    model = _observed_model(prior, n)
    mcmc = MCMC(FixedDraws(model, {"s": jnp.asarray([0.6, 1.1])}), num_warmup=0, num_samples=2,
                progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), y)
    np.testing.assert_allclose(mcmc.get_samples()["s"], [0.6, 1.1])
    dt = dg.to_inference_data(mcmc, y, posterior_predictive=False)
    ep = dt["edge_posterior"]
    assert ep.attrs["phi.offset"] == offset
    a = np.asarray(ep["phi"].values, np.float64)
    expected, window = hand_counts(a, offset, 0.9)
    summary = dg.edge_summary(dt)
    assert summary["expected_distance"] == pytest.approx(expected.mean(), abs=1e-4)
    assert summary["effective_window"] == pytest.approx(window.mean())


@pytest.mark.parametrize("bad", [1.5, True, "1", None])
def test_offset_must_be_an_int_or_a_prior(bad):
    a = np.full((3, 3), 1.0 / 3)
    with pytest.raises(TypeError, match="offset"):
        dg.expected_distance(a, bad)
    with pytest.raises(TypeError, match="offset"):
        dg.effective_window(a, bad)


@pytest.mark.parametrize("make", [
    lambda: P.Uniform(3, offset=1.5),
    lambda: P.Categorical(np.zeros(3), offset=True),
    lambda: P.Restricted(np.ones((3, 3), bool), offset="1"),
])
def test_prior_offset_must_be_an_int(make):
    with pytest.raises(TypeError, match="offset must be an int"):
        make()


def test_restricted_offset_cannot_contradict_its_pattern():
    with pytest.raises(ValueError, match="offset"):
        P.Restricted(np.ones((3, 3), bool), pattern=P.Causal(include_self=True, offset=1),
                     offset=0)


def test_a_row_that_is_not_finite_or_short_of_the_mass_is_nan():
    """Regression: a NaN row (a child with no allowed parent, under `jit`) came out of
    `effective_window` as window 0 and of `edge_agreement` as a correct MAP edge (the
    argmax of a NaN row is 0), inflating the accuracy; a row whose mass never reaches
    `mass` got window 0. Never a finite wrong number: NaN, and not correct."""
    def model(mask):
        with numpyro.plate("children", 3):
            si.edge("phi", si.priors.Restricted(mask))

    mask = jnp.array([[True, False, False], [True, True, False], [False, False, False]])
    a = jax.jit(lambda m: si.marginals(model, m)["phi"])(mask)
    assert np.isnan(np.asarray(a[2])).all()
    w = np.asarray(dg.effective_window(a))
    np.testing.assert_array_equal(w[:2], [0, 1])
    assert np.isnan(w[2]) and w.dtype == np.float32
    ag = dg.edge_agreement(a, np.array([0, 0, 0]))
    assert np.asarray(ag.correct).tolist() == [True, True, False]
    assert np.isnan(ag.accuracy) and np.isnan(ag.true_parent_prob)
    short = jax.jit(lambda a: dg.effective_window(a, mass=0.9))(
        jnp.array([[0.5, 0.3, 0.0], [0.6, 0.3, 0.1]]))
    assert np.isnan(short[0]) and short[1] == 1
    assert jax.jit(dg.effective_window)(a).shape == (3,)



@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.float64])
def test_the_whole_mass_of_a_rounded_row_has_a_window(dtype, x64):
    """`effective_window(mass=1.0)` of a row that is a probability row to its dtype's
    rounding (summing to 0.9995, which the marginals' check accepts) was NaN: its mass
    never reached 1. It is the smallest window holding all of the row, as for any mass
    (read as a fraction of the row's own total)."""
    a = jnp.asarray([[0.6, 0.3995, 0.0], [0.2, 0.2, 0.6]], dtype)
    want = [1, 1]  # child 0: parents 0 and 1 (|d| <= 1); child 1: parent 2 at d = -1
    for f in (dg.effective_window, jax.jit(dg.effective_window, static_argnums=1)):
        w = f(a, 0, 1.0)
        assert w.dtype == dtype
        np.testing.assert_array_equal(np.asarray(w), want)
    np.testing.assert_array_equal(np.asarray(dg.effective_window(a, 0, 0.6)), [0, 1])

def test_log_or_unnormalised_marginals_are_refused():
    """Regression: the edge statistics took any (..., children, parents) array: a
    log-probability table or rows summing to 2 gave finite wrong expected distances,
    distance posteriors and true-parent probabilities. Concrete: refused, naming the
    argument and the row; under jit: NaN in those rows, the others unchanged."""
    p = jnp.exp(P.Geometric(0.4, 5).log_table(5))
    logp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -30.0)
    half = p.at[3].multiply(0.5)
    stats = {
        "edge_entropy": dg.edge_entropy,
        "expected_distance": dg.expected_distance,
        "effective_window": dg.effective_window,
        "distance_posterior": lambda a: dg.distance_posterior(a)[1],
        "edge_agreement": lambda a: dg.edge_agreement(a, jnp.zeros(5, int)).true_parent_prob,
    }
    for name, fn in stats.items():
        for bad, row in ((logp, 0), (2 * p, 0), (half, 3)):
            with pytest.raises(ValueError, match=rf"marginals: the row of child {row} sums to"):
                fn(bad)
        out = np.asarray(jax.jit(fn)(half))
        ref = np.asarray(fn(p))
        if name in ("distance_posterior", "edge_agreement"):  # averages over the children
            assert np.isnan(out).all(), name
        else:
            assert np.isnan(out[3]) and not np.isnan(np.delete(out, 3)).any(), name
            np.testing.assert_allclose(np.delete(out, 3), np.delete(ref, 3), rtol=1e-6)
    with pytest.raises(ValueError, match=r"batch index \(1,\)"):
        dg.edge_entropy(jnp.stack([p, -p]))
    # rounding is not refused: float32 and bfloat16 rows, and a NaN row passes as NaN
    for dt in (jnp.float32, jnp.bfloat16):
        q = jax.nn.softmax(jax.random.normal(jax.random.key(0), (7, 11)).astype(dt), -1)
        assert dg.edge_entropy(q).dtype == dt
    nan_row = p.at[2].set(jnp.nan)
    assert np.isnan(dg.expected_distance(nan_row)[2])


def test_effective_window_takes_a_traced_mass():
    """Regression: a traced `mass` raised a TracerBoolConversionError (the range was
    tested in Python). Now it runs; outside (0, 1] the windows are NaN."""
    a = jnp.full((3, 3), 1 / 3)
    run = jax.jit(lambda a, m: dg.effective_window(a, 0, m))
    np.testing.assert_array_equal(run(a, 0.9), dg.effective_window(a, 0, 0.9))
    assert np.isnan(run(a, 1.5)).all() and np.isnan(run(a, 0.0)).all()
    with pytest.raises(ValueError, match=r"effective_window: mass must lie in \(0, 1\]"):
        dg.effective_window(a, 0, 1.5)


def test_effective_window_of_bfloat16_marginals_sums_accurately():
    # the row's running mass was summed in bfloat16: 0.8979 rounded up to 0.9 and the
    # window came back 5 where 6 is needed
    row = jnp.asarray([[0.0255127, 0.77734375, 0.00105286, 0.01318359, 0.01025391,
                        0.0703125, 0.10205078]], jnp.bfloat16)
    a = np.asarray(row.astype(jnp.float32), np.float64)
    held = np.cumsum(a[0]) >= 0.9 * a.sum()
    w = dg.effective_window(row, 0, 0.9)
    assert w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w, np.float64), [np.argmax(held)])


def test_entropy_of_bfloat16_marginals_is_the_rounded_exact_value():
    # the 4096 terms were rounded to bfloat16 before the sum: a step off (seed 16's
    # entropy, seed 3's expected distance)
    rows = [np.random.default_rng(s).dirichlet(np.ones(4096), size=3) for s in (3, 16)]
    ab = jnp.asarray(np.concatenate(rows)[:, None], jnp.bfloat16)[:, 0]
    a = np.asarray(ab.astype(jnp.float32), np.float64)
    h = -np.sum(a * np.log(np.where(a > 0, a, 1.0)), axis=-1)
    d = np.sum(a * (np.arange(6)[:, None] - np.arange(4096)), axis=-1)
    for got, want in ((dg.edge_entropy(ab), h), (dg.expected_distance(ab), d)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float64),
                                      np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64))


def test_effective_parents_of_bfloat16_marginals_is_the_rounded_exact_value():
    # was exp of the entropy already rounded to bfloat16: 2624 for 2672, three steps off
    ab = jnp.asarray(np.random.default_rng(0).dirichlet(np.ones(4096), size=3), jnp.bfloat16)
    a = np.asarray(ab.astype(jnp.float32), np.float64)
    want = np.exp(-np.sum(a * np.log(np.where(a > 0, a, 1.0)), axis=-1))
    got = dg.effective_parents(ab)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float64),
                                  np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64))


def test_distance_posterior_of_bfloat16_marginals_is_the_rounded_exact_value():
    # the sum was rounded to bfloat16 and then divided by n: a step off at 78 of 315
    n, m = 300, 16
    ab = jnp.asarray(np.random.default_rng(0).dirichlet(np.ones(m), size=n), jnp.bfloat16)
    a = np.asarray(ab.astype(jnp.float32), np.float64)
    ds, got = dg.distance_posterior(ab)
    d = np.arange(n)[:, None] - np.arange(m)
    want = np.array([a[d == k].sum() / n for k in ds])
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float64),
                                  np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64))


def test_edge_agreement_answers_in_the_marginals_dtype(x64):
    """Regression: the accuracy was float32 for float64 marginals (the mean of a bool
    array), while `true_parent_prob` and the other statistics answer in the marginals'
    dtype. Now both do (16-bit marginals: the accuracy in float32, a count's fraction)."""
    n = 7
    for dt, acc in ((jnp.float64, jnp.float64), (jnp.float32, jnp.float32),
                    (jnp.bfloat16, jnp.float32)):
        a = jnp.eye(n, dtype=dt)
        got = dg.edge_agreement(a, jnp.r_[jnp.arange(n - 1), 0])
        assert got.accuracy.dtype == acc and got.true_parent_prob.dtype == dt, dt
        np.testing.assert_allclose(np.asarray(got.accuracy, np.float64), (n - 1) / n,
                                   rtol=2 * float(jnp.finfo(acc).eps))


def test_an_inference_data_is_refused_naming_the_argument():
    """Regression: an InferenceData (DataTree) or Dataset where marginals belong gave
    xarray's conversion error, which names neither the argument nor the group to read."""
    import arviz_base as az

    idata = az.from_dict({"posterior": {"a": np.zeros((1, 3, 2))}})
    for bad in (idata, idata["posterior"], idata["posterior"].to_dataset()):
        for fn in (dg.edge_entropy, dg.expected_distance,
                   lambda a: dg.edge_agreement(a, jnp.zeros(3, int))):
            with pytest.raises(TypeError, match=r"marginals must be an array.*edge_posterior"):
                fn(bad)
    # one site's marginals as a DataArray are an array
    p = np.full((1, 3, 4), 0.25)
    np.testing.assert_allclose(dg.edge_entropy(az.from_dict({"x": {"phi": p}})["x"]["phi"]),
                               np.log(4) * np.ones((1, 3)), rtol=1e-6)
