"""Restricting parents by a boolean mask: the `Masked` prior, the `mask_parents` handler.

Oracle: a NumPy softmax of the base prior's own ``log_table`` plus the score, with the
masked parents removed, written here; every engine (the exact engine, the lowered
kernels, Pallas interpreted) against it, eagerly and under ``jit``, values and the
gradient. Sizes: 2 heads, 5 children, 7 parents, 3 features, 2 value dims (distinct).
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import matrix
from numpyro.contrib.control_flow import scan
from numpyro.ops.indexing import Vindex

import structinfer as si

P = si.priors
H, N, M, D, DV = 2, 5, 7, 3, 2

BASES = {
    "uniform": lambda: P.Uniform(M),
    "causal": lambda: P.Restricted.causal(N, M),
    "window": lambda: P.Restricted.window(N, 3, num_parents=M),
    "geometric": lambda: P.Geometric(0.3, M),
    "relpos": lambda: P.RelativePosition(jnp.linspace(-1.0, 1.0, 2 * M - 1), M),
    "categorical": lambda: P.Categorical(jnp.linspace(0.0, 1.0, M)),
}


def _data(seed=0):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.normal(size=s), jnp.float32)
                 for s in ((H, N, D), (H, M, D), (H, M, DV)))


def _masks():
    r = np.random.default_rng(1)
    per_edge = r.random((H, N, M)) < 0.6
    per_edge[..., :N] |= np.eye(N, dtype=bool)  # the self-edge keeps every row non-empty
    keys = np.ones((H, 1, M), bool)
    keys[0, 0, [3, 5]] = keys[1, 0, 4] = False  # every child keeps its self-edge
    return {"keys": jnp.asarray(keys), "edges": jnp.asarray(per_edge)}


def model(q, k, v, prior):
    with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", N, dim=-1):
        j = si.edge("phi", prior, si.scores.Dot(q, k))
        numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])


def masked_model(q, k, v, prior, mask):
    with si.handlers.mask_parents(mask=mask):
        model(q, k, v, prior)


def _reference(prior, mask, q, k, v):
    lp = np.asarray(prior.log_table(N), np.float64)
    s = np.where(np.asarray(mask), lp, -np.inf) + np.einsum(
        "hid,hjd->hij", np.float64(q), np.float64(k))
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hij,hjd->hid", w / w.sum(-1, keepdims=True), np.float64(v))


CASES = [(b, m, e) for b in BASES for m in ("keys", "edges")
         for e in ("exact", "auto", "blocked", "pallas")]


@pytest.mark.parametrize("base, mask_kind, engine", matrix(
    CASES, lambda b, m, e: b == "relpos" or (m == "keys") == (e in ("auto", "pallas"))))
def test_masked_prior_every_engine(base, mask_kind, engine):
    """Each base prior under a mask per key (per head) or per edge: the engines agree with
    the NumPy softmax over the allowed parents, eagerly and under jit."""
    q, k, v = _data()
    mask = _masks()[mask_kind]
    prior = BASES[base]()
    want = _reference(prior, mask, q, k, v)
    if engine == "exact":
        def run(q, k, v, m):
            return si.expectation(model, "out", q, k, v, P.Masked(prior, m))
    else:
        f = si.attention(model, "out", engine)
        assert f.explain(q, k, v, P.Masked(prior, mask)).path == "lowered"

        def run(q, k, v, m):
            return f(q, k, v, P.Masked(prior, m))
    for got in (run(q, k, v, mask), jax.jit(run)(q, k, v, mask)):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("engine", ["auto", "pallas"])
def test_masked_relative_position_gradient(engine):
    """The gradient through a masked relative-position prior (queries and the trained
    table), against autodiff of a plain softmax written here."""
    q, k, v = _data()
    mask = _masks()["keys"]
    f = si.attention(model, "out", engine)

    def loss(q, bias):
        prior = P.Masked(P.RelativePosition(bias, M), mask)
        return jnp.sum(f(q, k, v, prior) ** 2)

    def plain(q, bias):
        d = jnp.arange(N)[:, None] - jnp.arange(M)[None, :]
        s = jnp.einsum("hid,hjd->hij", q, k) + bias[d + M - 1]
        w = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        return jnp.sum(jnp.einsum("hij,hjd->hid", w, v) ** 2)

    bias = jnp.linspace(-1.0, 1.0, 2 * M - 1)
    got, want = jax.grad(loss, (0, 1))(q, bias), jax.grad(plain, (0, 1))(q, bias)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_mask_parents_is_the_masked_prior_and_nests():
    """The handler gives each edge the `Masked` prior; nested handlers intersect."""
    q, k, v = _data()
    masks = _masks()
    prior = P.Geometric(0.3, M)
    want = _reference(prior, masks["keys"] & masks["edges"], q, k, v)

    def nested(q, k, v, a, b):
        with si.handlers.mask_parents(mask=a), si.handlers.mask_parents(mask=b):
            model(q, k, v, prior)

    for f in (lambda *a: si.expectation(nested, "out", *a), si.attention(nested, "out")):
        np.testing.assert_allclose(f(q, k, v, masks["keys"], masks["edges"]), want,
                                   rtol=0, atol=2e-5)
    one = si.expectation(masked_model, "out", q, k, v, prior, masks["keys"])
    np.testing.assert_allclose(one, _reference(prior, masks["keys"], q, k, v), atol=2e-5)


@pytest.mark.parametrize("base", ["uniform", "relpos"])
def test_mask_parents_around_an_engine_call_reaches_every_entry_point(base):
    """Regression: ``mask_parents`` as a context around ``si.attention(...)(...)``,
    ``si.map_edges`` or ``si.sample_edges`` raised "no edge site consulted" (their model
    runs hid every message from the handlers around the call). Now each applies the mask,
    and a lowered function answers neither a call without the mask from a trace made
    under it nor a call under the mask from a trace made without it (both kept the
    other call's answer)."""
    q, k, v = _data()
    prior = BASES[base]()
    keep = jnp.asarray(_masks()["keys"])

    def plain(q, k, v):
        model(q, k, v, prior)

    want = _reference(prior, keep, q, k, v)
    unmasked = _reference(prior, jnp.ones_like(keep), q, k, v)
    f = si.attention(plain, "out")
    with si.handlers.mask_parents(mask=keep):
        np.testing.assert_allclose(f(q, k, v), want, atol=2e-5)
        np.testing.assert_allclose(jax.jit(f)(q, k, v), want, atol=2e-5)
        np.testing.assert_allclose(si.attention(plain, "out", "blocked")(q, k, v), want,
                                   atol=2e-5)
        best = si.map_edges(plain, q, k, v)["phi"]
        drawn = si.sample_edges(jax.random.PRNGKey(0), plain, q, k, v)["phi"]
    np.testing.assert_allclose(f(q, k, v), unmasked, atol=2e-5)  # the mask is gone
    scores = jnp.where(keep, jnp.einsum("hid,hjd->hij", q, k) + prior.log_table(N), -jnp.inf)
    np.testing.assert_array_equal(best, jnp.argmax(scores, -1))
    assert bool(jnp.all(jnp.take_along_axis(jnp.broadcast_to(keep, scores.shape),
                                            drawn[..., None], -1)))

    g = si.attention(plain, "out")
    np.testing.assert_allclose(g(q, k, v), unmasked, atol=2e-5)  # cached without a mask
    with si.handlers.mask_parents(mask=keep):  # not answered from that cache
        np.testing.assert_allclose(g(q, k, v), want, atol=2e-5)
        si.log_marginal(plain, q, k, v)  # (another edge the mask reaches)
    np.testing.assert_allclose(g(q, k, v), unmasked, atol=2e-5)


def test_bad_masks_are_refused_naming_the_site():
    q, k, v = _data()
    prior = P.Uniform(M)
    run = lambda m: si.marginals(masked_model, q, k, v, prior, m)  # noqa: E731
    with pytest.raises(TypeError, match="edge site 'phi': mask_parents: .*must be a boolean"):
        run(jnp.ones((M,)))
    with pytest.raises(ValueError, match="edge site 'phi': mask_parents: .*with 7 parents"):
        run(jnp.ones((M + 1,), bool))
    with pytest.raises(ValueError, match="edge site 'phi'.*"):  # does not fit the plates
        run(jnp.ones((3, 1, M), bool))
    empty = jnp.ones((H, N, M), bool).at[1, 2].set(False)
    with pytest.raises(ValueError, match="edge site 'phi': Masked prior allows no parent "
                                         r"for child 2 \(batch index \(1,\)\)"):
        run(empty)
    with pytest.raises(TypeError, match="not a Markov one"):
        P.Masked(P.Markov(jnp.zeros((3, 3)), jnp.zeros(3)), jnp.ones(3, bool))

    def chain(em):
        prior = P.Markov(jnp.zeros((3, 3)), jnp.zeros(3))

        def step(prev, e):
            with si.handlers.mask_parents(mask=jnp.ones(3, bool)):
                return si.edge("z", prior, e, previous=prev), None

        scan(step, jnp.asarray(-1), em)

    with pytest.raises(ValueError, match="edge site 'z': mask_parents does not apply to a "
                                         "Markov edge"):
        si.log_marginal(chain, jnp.zeros((4, 3)))


def test_numpyro_nuts_on_a_masked_prior_samples_the_masked_posterior():
    """NUTS (NumPyro's, through `si.infer.nuts`) over a geometric prior's rate with a
    key-padding mask in `mask_parents`: its posterior mean and spread equal a grid
    posterior computed here in NumPy (each child's likelihood summed over the allowed
    parents of the renormalised, masked prior). Every third parent is masked out and the
    data come from mostly self-edges, so the mask moves the posterior far (checked)."""
    import numpyro.distributions as dist

    n, noise = 24, 0.3

    def rate_model(v, keep, y):
        q = numpyro.sample("q", dist.Beta(2.0, 2.0))
        with si.handlers.mask_parents(mask=keep), numpyro.plate("children", n):
            j = si.edge("phi", si.priors.Geometric(q, n))
            numpyro.sample("y", dist.Normal(v[j], noise), obs=y)

    rng = np.random.default_rng(0)
    v = rng.normal(size=n) * 2
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    prior = np.where(d >= 0, 0.6 * 0.4 ** np.maximum(d, 0), 0.0)  # unmasked, q = 0.6
    y = v[[rng.choice(n, p=row / row.sum()) for row in prior]] + noise * rng.normal(size=n)
    keep = np.arange(n) % 3 != 1

    qs = np.linspace(0.0025, 0.9975, 400)

    def grid_posterior(keep):
        like = np.exp(-0.5 * ((y[:, None] - v[None, :]) / noise) ** 2)  # (child, parent)
        w = np.where((d >= 0) & keep, (1 - qs[:, None, None]) ** np.maximum(d, 0), 0.0)
        lp = np.log((w * like).sum(-1) / w.sum(-1)).sum(-1) + np.log(qs * (1 - qs))
        p = np.exp(lp - lp.max())
        p /= p.sum()
        mean = (p * qs).sum()
        return mean, np.sqrt((p * (qs - mean) ** 2).sum())

    mean, sd = grid_posterior(keep)
    assert abs(mean - grid_posterior(np.ones(n, bool))[0]) > 2 * sd  # the mask matters
    mcmc = si.infer.nuts(jax.random.key(0), rate_model, jnp.asarray(v, jnp.float32),
                         jnp.asarray(keep)[None], jnp.asarray(y, jnp.float32),
                         num_warmup=300, num_samples=600, progress_bar=False)
    draws = np.asarray(mcmc.get_samples()["q"])
    assert abs(draws.mean() - mean) < 0.25 * sd
    assert 0.75 < draws.std() / sd < 1.25


def test_a_mask_no_edge_consults_is_an_error():
    """Regression: ``mask_parents`` around code that declares no edge (the wrong call, or
    a model whose edges lie outside it) was silently ignored. Every run under it that
    reaches no edge site now raises, naming the handler; a handler some edge consults is
    as before, and an error raised inside is not hidden by this one."""
    q, k, v = _data()
    prior = P.Uniform(M)
    keep = jnp.ones((M,), bool).at[3].set(False)

    def outside(q, k, v):  # the handler wraps a call that comes before the edge
        with si.handlers.mask_parents(mask=keep):
            q = q * 1.0
        model(q, k, v, prior)

    said = "mask_parents: no edge site consulted this handler"
    for run in (lambda: si.marginals(outside, q, k, v),
                lambda: jax.jit(lambda *a: si.log_marginal(outside, *a))(q, k, v),
                lambda: si.attention(outside, "out")(q, k, v)):
        with pytest.raises(ValueError, match=said):
            run()
    with pytest.raises(ValueError, match=said):  # as a wrapper of a function with no edge
        si.handlers.mask_parents(lambda: None, mask=keep)()

    def steps(s):  # outside a scan: its steps' edges saw the mask in some runs only
        def step(c, s_t):
            with numpyro.plate("queries", N):
                si.edge("phi", prior, s_t)
            return c, None

        with si.handlers.mask_parents(mask=keep):
            scan(step, 0, s)

    s = jnp.asarray(np.random.default_rng(3).normal(size=(3, N, M)), jnp.float32)
    with pytest.raises(ValueError, match=said + ".*inside a numpyro scan, wrap the step"):
        si.log_marginal(steps, s)

    def scanned(s):  # the scan in a model called inside one handler
        def step(c, s_t):
            with numpyro.plate("queries", N):
                si.edge("phi", prior, s_t)
            return c, None

        scan(step, 0, s)

    # regression: the first step saw the handler (NumPyro unrolls it), the others not:
    # a log Z masked in one step of three, a finite wrong number
    with pytest.raises(ValueError, match="edge site 'phi': mask_parents outside a numpyro "
                       "scan reaches the scan's first step only"):
        with si.handlers.mask_parents(mask=keep):
            si.log_marginal(scanned, s)
    with pytest.raises(ZeroDivisionError):  # the body's own error first
        with si.handlers.mask_parents(mask=keep):
            raise ZeroDivisionError
    np.testing.assert_allclose(si.expectation(masked_model, "out", q, k, v, prior, keep),
                               _reference(prior, keep, q, k, v), atol=2e-5)


# ---------------------------------------------------------------------------------------
# a masked-out child (numpyro.handlers.mask) under mask_parents: uniform over its allowed


PAD_N, PAD_M = 3, 5  # 3 children, 5 parents: 125 joint paths, enumerated below
PAD_BASES = {
    "uniform": lambda: P.Uniform(PAD_M),
    "causal": lambda: P.Restricted.causal(PAD_N, PAD_M),
    "geometric": lambda: P.Geometric(0.3, PAD_M),
}


def _padded(s, v, keep, allow, prior):
    with numpyro.plate("children", PAD_N):
        with si.handlers.mask_parents(mask=allow), numpyro.handlers.mask(mask=keep):
            j = si.edge("phi", prior, s)
        numpyro.deterministic("out", v[j])


def _padded_brute_force(s, v, keep, allow, prior):
    """Every joint path of the three edges: a kept child's factor is its masked prior
    times e^score; a masked-out child's is uniform over the parents its edge allows (the
    prior's and the mask's support, less the score's -inf entries), over all of them when
    it allows none. Log Z, marginals, E[out] and the MAP path."""
    import itertools

    from scipy.special import logsumexp

    lp = np.where(np.asarray(allow), np.asarray(prior.log_table(PAD_N), np.float64), -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):  # the padded row has no parent
        norm = logsumexp(lp, -1, keepdims=True)
        lp = np.where(np.isfinite(norm), lp - norm, -np.inf)  # the masked prior, renormalised
    s = np.asarray(s, np.float64)
    factor = []
    for i in range(PAD_N):
        if keep[i]:
            factor.append(lp[i] + s[i])
        else:
            ok = np.isfinite(lp[i] + s[i])
            ok = ok if ok.any() else np.ones(PAD_M, bool)
            factor.append(np.where(ok, -np.log(ok.sum()), -np.inf))
    paths = np.array(list(itertools.product(range(PAD_M), repeat=PAD_N)))
    logw = sum(factor[i][paths[:, i]] for i in range(PAD_N))
    log_z = logsumexp(logw)
    p = np.exp(logw - log_z)
    marg = np.stack([np.bincount(paths[:, i], p, PAD_M) for i in range(PAD_N)])
    out = marg @ np.asarray(v, np.float64)
    return log_z, marg, out, factor


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("base", list(PAD_BASES))
def test_a_masked_out_child_takes_only_the_parents_its_mask_allows(x64, base, jit):
    """Regression: a child masked out by ``numpyro.handlers.mask`` took its parent
    uniformly over ALL parents, including those ``mask_parents`` (or its prior, or a
    -inf score) forbids: its marginal put mass on forbidden parents, its expectation
    read their values, and ``sample_edges`` / ``map_edges`` could return them. It now
    takes its parent uniformly over the parents its edge allows (all of them only when it
    allows none, a padded child), still adding nothing to log Z: every answer against
    the joint enumeration of the three edges."""
    r = np.random.default_rng(2)
    prior = PAD_BASES[base]()
    s = r.normal(size=(PAD_N, PAD_M))
    s[1, 0] = -np.inf  # a -inf score forbids its edge, as a mask does
    s, v = jnp.asarray(s), jnp.asarray(r.normal(size=(PAD_M, 2)))
    keep = jnp.array([True, False, False])
    allow = jnp.array([[True] * PAD_M,                      # kept: the prior's parents
                       [True, True, False, False, True],    # masked out: 0 (score), 1, 4
                       [False] * PAD_M])                    # padded: none
    args = (s, v, keep, allow, prior)
    log_z, marg, out, factor = _padded_brute_force(*args)
    assert np.count_nonzero(marg[1]) < PAD_M  # the mask matters for the masked-out child

    fns = [lambda *a: si.log_marginal(_padded, *a),
           lambda *a: si.marginals(_padded, *a)["phi"],
           lambda *a: si.expectation(_padded, "out", *a),
           lambda *a: si.map_edges(_padded, *a)["phi"]]
    got = [jax.jit(f, static_argnums=4)(*args) if jit else f(*args) for f in fns]
    np.testing.assert_allclose(got[0], log_z, rtol=1e-12)
    np.testing.assert_allclose(got[1], marg, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(got[2], out, rtol=1e-12, atol=1e-15)
    for i, j in enumerate(np.asarray(got[3])):  # a most probable parent of each child
        assert factor[i][j] == pytest.approx(factor[i].max(), rel=1e-12), (i, j)
    keys = jax.random.split(jax.random.PRNGKey(0), 64)
    draws = jax.vmap(lambda key: si.sample_edges(key, _padded, *args)["phi"])(keys)
    for i in range(PAD_N):
        assert np.all(marg[i][np.asarray(draws)[:, i]] > 0), i  # never a forbidden parent


def test_a_masked_out_child_conditioned_on_a_padding_value_adds_its_constant():
    """Regression (review): a masked-out child conditioned on a value that is no parent
    (a padding sentinel, -1 or m) made the whole log density NaN, where NumPyro's mask
    ignores a masked-out value; it contributes its row's -log |A_i|, as at a parent its
    edge allows. A kept child's -1 is still NaN (no parent), a forbidden parent -inf."""
    from numpyro.infer.util import log_density

    prior = PAD_BASES["causal"]()
    r = np.random.default_rng(3)
    s, v = jnp.asarray(r.normal(size=(PAD_N, PAD_M))), jnp.asarray(r.normal(size=(PAD_M, 2)))
    keep = jnp.array([True, False, False])
    allow = jnp.array([[True] * PAD_M, [True, True, False, False, True], [False] * PAD_M])
    args = (s, v, keep, allow, prior)

    def lp(phi):
        cond = numpyro.handlers.condition(_padded, {"phi": jnp.asarray(phi)})
        return float(log_density(cond, args, {}, {})[0])

    # child 1 allows parents 0 and 1 (its causal prior and the mask): -log 2 at 0, 1, -1, m
    at_parent = lp([0, 1, 0])
    for pad in (-1, PAD_M):
        assert lp([0, pad, 0]) == pytest.approx(at_parent, rel=1e-6)
        assert lp([0, 1, pad]) == pytest.approx(at_parent, rel=1e-6)  # padded child: -log m
    assert lp([0, 4, 0]) == -np.inf  # a parent child 1's causal prior forbids
    assert np.isnan(lp([-1, 1, 0]))  # a kept child's -1 is no parent
