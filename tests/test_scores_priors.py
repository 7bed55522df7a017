"""Each score's dense table and each prior's log table against plain formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conftest import float64
from jax.test_util import check_grads
from numpyro.ops.indexing import Vindex

import structinfer as si

N, M, D = 5, 7, 3


@pytest.fixture
def data(x64):
    r = np.random.default_rng(3)
    return r.normal(size=(N, D)), r.normal(size=(M, D))


def pair(f, q, k):
    return np.array([[f(q[i], k[j]) for j in range(len(k))] for i in range(len(q))])


def test_dot_and_bilinear(data):
    q, k = data
    np.testing.assert_allclose(si.scores.Dot(q, k).dense(), pair(np.dot, q, k), atol=1e-12)
    np.testing.assert_allclose(si.scores.Dot(q, k, 0.5).dense(), 0.5 * pair(np.dot, q, k))
    r = np.random.default_rng(4)
    wq, wk = r.normal(size=(2, D)), r.normal(size=(2, D))
    ref = pair(lambda a, b: a @ wq.T @ wk @ b, q, k)
    np.testing.assert_allclose(si.scores.Bilinear(q, k, wq, wk).dense(), ref, atol=1e-12)


@pytest.mark.parametrize(
    "prec_kind", ["none", "scalar", "diag", "diag_per_parent", "full", "full_per_parent"]
)
def test_neg_sq_dist_is_gaussian_log_density(data, prec_kind):
    x, mu = data
    r = np.random.default_rng(5)
    L = r.normal(size=(M, D, D))
    full = np.einsum("kij,klj->kil", L, L) + D * np.eye(D)
    prec = {
        "none": None,
        "scalar": 2.5,
        "diag": r.uniform(0.5, 2, size=D),
        "diag_per_parent": r.uniform(0.5, 2, size=(M, D)),
        "full": full[0],
        "full_per_parent": full,
    }[prec_kind]

    def P(j):
        if prec is None:
            return np.eye(D)
        p = np.asarray(prec)
        if p.ndim == 0:
            return p * np.eye(D)
        if prec_kind == "diag":
            return np.diag(p)
        if prec_kind == "diag_per_parent":
            return np.diag(p[j])
        return p if p.ndim == 2 else p[j]

    logw = np.log(r.dirichlet(np.ones(M)))
    ref = np.array(
        [
            [
                logw[j]
                - 0.5 * (x[i] - mu[j]) @ P(j) @ (x[i] - mu[j])
                + 0.5 * np.linalg.slogdet(P(j))[1]
                - 0.5 * D * math.log(2 * math.pi)
                for j in range(M)
            ]
            for i in range(N)
        ]
    )
    s = si.scores.NegSqDist(x, mu, precision=prec, log_weights=logw, normalize=True)
    np.testing.assert_allclose(s.dense(), ref, atol=1e-10)
    # normalised: log Z of a GMM model equals the mixture log-likelihood from numpyro
    if prec_kind in ("full", "full_per_parent", "none"):
        covs = np.stack([np.linalg.inv(P(j)) for j in range(M)])
        mix = dist.MixtureSameFamily(
            dist.Categorical(probs=np.exp(logw)), dist.MultivariateNormal(mu, covs)
        )

        def gmm():  # prior = mixing weights, score = component log-density
            with numpyro.plate("points", N):
                si.edge(
                    "z",
                    si.priors.Categorical(logw),
                    si.scores.NegSqDist(x, mu, precision=prec, normalize=True),
                )

        np.testing.assert_allclose(si.log_marginal(gmm), mix.log_prob(x).sum(), rtol=1e-10)


def test_idw_inverse_gaussian_cosine(data):
    q, k = data
    k = k.copy()
    k[2] = q[1]  # an exact match: zero distance
    dist_ = lambda a, b: np.linalg.norm(a - b)  # noqa: E731
    for p in (1.0, 2.0, 3.0):
        ref = pair(lambda a, b: -np.log(1e-3 + dist_(a, b) ** p), q, k)
        np.testing.assert_allclose(si.scores.NegLogDist(q, k, p=p).dense(), ref, atol=1e-10)
        ref = pair(lambda a, b: 1 / (0.1 + dist_(a, b) ** p), q, k)
        np.testing.assert_allclose(si.scores.InvDist(q, k, p=p, eps=0.1).dense(), ref, atol=1e-10)
    ref = pair(lambda a, b: np.exp(-(dist_(a, b) ** 2) / 1.5**2), q, k)
    np.testing.assert_allclose(si.scores.GaussianKernel(q, k, sigma=1.5).dense(), ref, atol=1e-12)
    ref = pair(lambda a, b: 2 * a @ b / np.linalg.norm(a) / np.linalg.norm(b), q, k)
    np.testing.assert_allclose(si.scores.Cosine(q, k, scale=2.0).dense(), ref, atol=1e-7)
    # the IDW softmax is Shepard's weighting (eps + d^p)^-1 / sum (McCarter eq. 6)
    w = 1 / (1e-3 + pair(dist_, q, k) ** 2)
    np.testing.assert_allclose(
        jax.nn.softmax(si.scores.NegLogDist(q, k).dense(), -1),
        w / w.sum(-1, keepdims=True),
        atol=1e-10,
    )
    # finite gradients at zero distance for p < 2
    g = jax.grad(lambda a: si.scores.NegLogDist(a, k, p=1.0).dense().sum())(jnp.asarray(q))
    assert np.all(np.isfinite(g))


def test_linear_gaussian_and_sum(data):
    x, _ = data
    r = np.random.default_rng(6)
    z = r.normal(size=(M, 2))
    A = r.normal(size=(M, D, 2))
    b = r.normal(size=(M, D))
    prec = r.uniform(0.5, 2, size=D)
    ref = np.array(
        [
            [-0.5 * np.sum(prec * (x[i] - A[j] @ z[j] - b[j]) ** 2) for j in range(M)]
            for i in range(N)
        ]
    )
    s = si.scores.LinearGaussian(x, z, A, b, precision=prec)
    np.testing.assert_allclose(s.dense(), ref, atol=1e-12)
    s2 = si.scores.Sum(s, si.scores.Custom(np.ones((N, M))))
    np.testing.assert_allclose(s2.dense(), ref + 1, atol=1e-12)
    np.testing.assert_allclose((s + si.scores.Custom(lambda: jnp.ones((N, M)))).dense(), ref + 1)


def test_sum_broadcasts_its_terms_as_an_edge_broadcasts_its_score():
    """Regression: ``Sum`` refused a ``(1, parents)`` bias table (or a ``(children, 1)``
    one) beside an ``(n, m)`` score, while ``edge`` takes such a score itself. The terms
    broadcast; the exact engine and the blocked kernel give the NumPy softmax."""
    n, m = 5, 7
    rng = np.random.default_rng(8)
    q, k = rng.normal(size=(n, 3)), rng.normal(size=(m, 3))
    v = rng.normal(size=(m, 2))
    bias, per_child = rng.normal(size=(1, m)), rng.normal(size=(n, 1))
    score = si.scores.Sum(si.scores.Dot(q, k), bias, si.scores.Custom(per_child))
    assert (score.num_children, score.num_parents) == (n, m)
    logits = q @ k.T + bias + per_child
    np.testing.assert_allclose(score.dense(), logits, atol=1e-5)
    assert si.scores.Sum(bias, bias).num_children == 1

    def model(q, k, v):
        with numpyro.plate("queries", n):
            j = si.edge("phi", si.priors.Uniform(m),
                        si.scores.Sum(si.scores.Dot(q, k), bias, per_child))
            numpyro.deterministic("out", Vindex(v)[j])

    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    with float64():
        np.testing.assert_allclose(si.expectation(model, "out", q, k, v), want, atol=1e-10)
        np.testing.assert_allclose(si.attention(model, "out", backend="blocked")(q, k, v),
                                   want, atol=1e-10)
    with pytest.raises(ValueError, match=r"Sum: the scores' \(children, parents\) sizes do "
                       r"not broadcast: \[\(5, 7\), \(3, 7\)\]"):
        si.scores.Sum(si.scores.Dot(q, k), np.zeros((3, m)))


def test_score_gradients(data):
    q, k = data
    for cls in (si.scores.Dot, si.scores.NegLogDist, si.scores.NegSqDist, si.scores.Cosine):
        check_grads(lambda a, b: cls(a, b).dense(), (q, k), order=1, modes=["rev"], atol=1e-5)


def test_prior_tables_normalised_and_structured(x64):
    n, m = N, M
    tables = {
        "uniform": si.priors.Uniform(m),
        "causal": si.priors.Restricted.causal(n, m, offset=m - n),
        "window": si.priors.Restricted.window(n, 3, m, offset=m - n),
        "window_sym": si.priors.Restricted.window(n, 2, m, causal=False),
        "graph": si.priors.Restricted.from_graph(np.eye(n, m) + np.eye(n, m, 1)),
        "block": si.priors.Restricted.block_sparse(np.array([[1, 0], [1, 1]]), (3, 4)),
        "rel": si.priors.RelativePosition(np.arange(n + m - 1.0), m),
        "rel_clip": si.priors.RelativePosition(np.arange(5.0), m, max_distance=2),
        "geo": si.priors.Geometric(0.25, m, offset=m - n),
        "geo_max": si.priors.Geometric(0.25, m, offset=m - n, max_distance=2),
        "cat": si.priors.Categorical(np.random.default_rng(0).normal(size=(n, m))),
    }
    for name, prior in tables.items():
        nn = 6 if name == "block" else n
        t = np.asarray(prior.log_table(nn))
        assert t.shape == (nn, prior.num_parents), name
        np.testing.assert_allclose(np.exp(t).sum(-1), 1.0, atol=1e-12, err_msg=name)
        assert prior.describe()["kind"] == prior.kind
    d = np.arange(n)[:, None] + m - n - np.arange(m)[None, :]
    win = np.isfinite(np.asarray(tables["window"].log_table(n)))
    np.testing.assert_array_equal(win, (d >= 0) & (d < 3))
    np.testing.assert_array_equal(
        np.isfinite(np.asarray(tables["geo_max"].log_table(n))), (d >= 0) & (d <= 2)
    )
    blk = np.isfinite(np.asarray(tables["block"].log_table(6)))
    np.testing.assert_array_equal(blk[:3, 4:], False)
    np.testing.assert_array_equal(blk[3:, :], True)
    # relative position: the table depends on i - j only (Toeplitz)
    rel = np.asarray(tables["rel"].log_table(n))
    assert rel.shape == (n, m)
    lw = np.asarray(tables["rel"]._log_weights(n))
    for i in range(1, n):
        np.testing.assert_allclose(lw[i, 1:], lw[i - 1, :-1])
    # a numpyro Categorical is accepted as a prior
    cat = dist.Categorical(logits=jnp.zeros((n, m)))
    assert isinstance(si.priors.as_prior(cat, "phi"), si.priors.Categorical)


def test_geometric_q_per_child_and_traced(x64):
    qs = np.linspace(0.1, 0.9, N)
    t = np.asarray(si.priors.Geometric(qs, N).log_table(N))
    for i, q in enumerate(qs):
        w = q * (1 - q) ** np.arange(i, -1, -1.0)
        np.testing.assert_allclose(np.exp(t[i, : i + 1]), w / w.sum(), atol=1e-12)
    g = jax.grad(lambda q: si.priors.Geometric(q, N).log_table(N)[4, 2])(0.3)
    assert np.isfinite(g)


_DISTANCE_PRIORS = [
    ("causal", lambda: si.priors.Restricted.causal(N, M, offset=2)),
    ("causal_no_self", lambda: si.priors.Restricted.causal(N, M, include_self=False, offset=1)),
    ("window", lambda: si.priors.Restricted.window(N, 3, M, offset=2)),
    ("window_both_sides", lambda: si.priors.Restricted.window(N, 2, M, causal=False,
                                                               include_self=False)),
]


@pytest.mark.parametrize("offset", [-2, 0, 3])
def test_band_mask_is_the_one_distance_mask(offset):
    """`priors.band_mask` against a loop over every (child, parent); the constructors'
    masks and the lowering's `DistanceBand` are that function's bands."""
    from structinfer.lowering import DistanceBand

    bands = [dict(), dict(dmin=0), dict(dmin=1), dict(dmax=2), dict(dmin=-1, dmax=2),
             dict(dmin=-2, dmax=2, exclude_zero=True), dict(exclude_zero=True)]
    for band in bands:
        want = np.array([[(band.get("dmin") is None or i + offset - j >= band["dmin"])
                          and (band.get("dmax") is None or i + offset - j <= band["dmax"])
                          and not (band.get("exclude_zero") and i + offset - j == 0)
                          for j in range(M)] for i in range(N)])
        got = si.priors.band_mask(N, M, offset=offset, xp=np, **band)
        assert isinstance(got, np.ndarray) and got.dtype == bool, band
        np.testing.assert_array_equal(got, want, err_msg=str(band))
        np.testing.assert_array_equal(jax.jit(lambda: si.priors.band_mask(
            N, M, offset=offset, **band))(), want, err_msg=str(band))
        np.testing.assert_array_equal(DistanceBand(offset=offset, **band).mask(N, M), want)
    R = si.priors.Restricted
    for prior, band in [
        (R.causal(N, M, offset=offset), dict(dmin=0)),
        (R.causal(N, M, include_self=False, offset=offset), dict(dmin=1)),
        (R.window(N, 3, M, offset=offset), dict(dmin=0, dmax=2)),
        (R.window(N, 3, M, include_self=False, offset=offset), dict(dmin=1, dmax=3)),
        (R.window(N, 2, M, causal=False, offset=offset), dict(dmin=-1, dmax=1)),
        (R.window(N, 2, M, causal=False, include_self=False, offset=offset),
         dict(dmin=-1, dmax=1, exclude_zero=True)),
    ]:
        want = si.priors.band_mask(N, M, offset=offset, xp=np, **band)
        np.testing.assert_array_equal(prior.concrete_mask, want, err_msg=str(prior.pattern))


@pytest.mark.parametrize("make", [f for _, f in _DISTANCE_PRIORS],
                         ids=[i for i, _ in _DISTANCE_PRIORS])
def test_a_distance_mask_is_built_in_the_trace(make):
    """Regression: the table of a causal or window prior read its (n, m) mask as a
    constant, which XLA folded at compile time (16 s at n = 2048, 42 s at 3072). The
    table is now built from iota under jit: no (n, m) constant in the program, and the
    same table as the mask's."""
    prior = make()
    want = np.where(prior.concrete_mask, 0.0, -np.inf)
    want = want - np.log(prior.concrete_mask.sum(-1, keepdims=True))
    closed = jax.make_jaxpr(lambda: prior.log_table(N))()
    assert all(np.size(c) < N * M for c in closed.consts), [np.shape(c) for c in closed.consts]
    np.testing.assert_allclose(jax.jit(lambda: make().log_table(N))(), want, rtol=1e-6)
    np.testing.assert_allclose(prior.log_table(N), want, rtol=1e-6)


def test_a_pattern_that_is_not_its_mask_keeps_the_mask():
    """A ``Causal`` claim on a mask that is not causal: the mask alone is the prior."""
    mask = np.tril(np.ones((N, M), bool), 2) & ~np.eye(N, M, dtype=bool)
    mask[:, 0] = True
    prior = si.priors.Restricted(mask, pattern=si.priors.Causal())
    want = np.where(mask, 0.0, -np.inf) - np.log(mask.sum(-1, keepdims=True))
    np.testing.assert_allclose(jax.jit(prior.log_table, static_argnums=0)(N), want, rtol=1e-6)


def _live_consts(closed) -> list:
    """The constants of ``closed`` that an equation with a used result reads (JAX 0.4.33
    stages ``jnp.asarray`` of a NumPy array as a ``device_put`` whose result nobody reads:
    a dead constant, gone before XLA sees the program)."""
    j = closed.jaxpr
    used = {id(v) for v in j.outvars}
    for e in j.eqns:
        if any(type(o).__name__ != "DropVar" for o in e.outvars):
            used.update(id(v) for v in e.invars)
    return [c for v, c in zip(j.constvars, closed.consts) if id(v) in used]


def test_a_concrete_band_mask_is_built_in_the_trace_by_masked_and_restricted():
    """Regression: a ``Masked`` prior read its concrete (n, m) mask as a constant of the
    program (which XLA folds while compiling), and so did a ``Restricted`` one whose band
    mask came without a ``Causal`` / ``Window`` pattern. A concrete mask that is a distance
    band is now rebuilt from iota by both: no (n, m) constant, the same table as the
    traced mask's (which is never rebuilt); a mask that is no band is kept."""
    n = 64
    r = np.random.default_rng(4)
    bands = {"causal": np.tril(np.ones((n, n), bool)),
             "window": np.tril(np.ones((n, n), bool)) & ~np.tril(np.ones((n, n), bool), -4),
             "no self": ~np.eye(n, dtype=bool)}
    other = r.random((n, n)) < 0.5
    other[:, 0] = True
    base = si.priors.Categorical(jnp.linspace(0.0, 1.0, n))
    priors = {"masked": lambda mask: si.priors.Masked(base, mask),
              "restricted": si.priors.Restricted}
    for kind, make in priors.items():
        for name, mask in {**bands, "other": other}.items():
            closed = jax.make_jaxpr(lambda mask=mask: make(mask).log_table(n))()
            big = [np.shape(c) for c in _live_consts(closed) if np.size(c) >= n * n]
            assert bool(big) == (name == "other"), (kind, name, big)
            traced = jax.jit(lambda m: make(m).log_table(n))(mask)
            np.testing.assert_allclose(make(mask).log_table(n), traced, rtol=1e-6,
                                       err_msg=f"{kind} {name}")


def test_a_causal_head_compiles_without_an_n_by_n_constant():
    """The engine's whole program for one causal head (expectation under jit) holds no
    (n, n) constant: XLA has nothing of that size to fold when it compiles."""
    n = 64

    def model(q, k, v):
        with numpyro.plate("queries", n):
            phi = si.edge("phi", si.priors.Restricted.causal(n), si.scores.Dot(q, k))
            numpyro.deterministic("out", v[phi])

    x = jnp.ones((n, 2), jnp.float32)
    closed = jax.make_jaxpr(lambda q, k, v: si.expectation(model, "out", q, k, v))(x, x, x)
    live = _live_consts(closed)
    assert all(np.size(c) < n * n for c in live), [np.shape(c) for c in live]


def test_a_16_bit_prior_is_normalised_in_float32():
    """The exact engine sums a 16-bit model's tables in float32: a prior's log-table is
    normalised in float32 (not rounded to bfloat16 first), equal to the float32 table of
    the same rounded parameters."""
    n = 7
    bias = jnp.asarray(np.random.default_rng(0).normal(size=(2, 2 * n - 1)), jnp.bfloat16)
    for make in (lambda b: si.priors.RelativePosition(b, n),
                 lambda b: si.priors.Categorical(b[:, None, :n])):
        got = make(bias).log_table(n)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, make(bias.astype(jnp.float32)).log_table(n),
                                   rtol=1e-6, atol=1e-6)



@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_16_bit_hartley_prior_is_its_exact_coefficients_table(dtype):
    """`RelativePosition.hartley` with 16-bit coefficients: the log-table (float32) is the
    one of the coefficients' exact values, as for every 16-bit prior. The basis and the
    sum over coefficients were rounded to 16 bits (an error of 0.015 in a float32 table)."""
    n, K = 11, 5
    beta = jnp.asarray(2 * np.random.default_rng(0).normal(size=(2, K)), dtype)
    b64 = np.asarray(beta, np.float64)
    ang = 2 * np.pi * np.arange(K)[:, None] * np.arange(n)[None, :] / n
    logits = b64 @ (np.cos(ang) + np.sin(ang))  # (2, n): one per distance mod n
    d = (np.arange(n)[:, None] - np.arange(n)[None, :]) % n
    want = logits[:, d]
    want = want - np.log(np.exp(want).sum(-1, keepdims=True))
    got = si.priors.RelativePosition.hartley(beta, n).log_table(n)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("sigma", [0.7, 0.002])
def test_a_16_bit_gaussian_kernel_width_is_squared_in_float32(dtype, sigma):
    """`GaussianKernel` with a 16-bit ``sigma``: the float32 table is the one of its exact
    value. ``sigma ** 2`` was rounded to 16 bits (5e-4 off at 0.7 in bfloat16), and a
    float16 ``0.002 ** 2`` is subnormal, losing most of its bits."""
    r = np.random.default_rng(0)
    q, k = (jnp.asarray(0.5 * sigma * r.normal(size=(n, 3)), dtype) for n in (5, 7))
    s = jnp.asarray(sigma, dtype)
    d2 = ((np.asarray(q, np.float64)[:, None] - np.asarray(k, np.float64)[None]) ** 2).sum(-1)
    want = np.exp(-d2 / np.float64(s) ** 2)
    got = si.scores.GaussianKernel(q, k, sigma=s).dense()
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("cls", [si.scores.NegLogDist, si.scores.InvDist])
def test_a_16_bit_distance_exponent_is_its_exact_value(cls, dtype):
    """`NegLogDist` / `InvDist` with a 16-bit ``p``: the float32 table is the one of its
    exact value. The exponent ``p / 2 - 1`` was rounded to 16 bits (a bfloat16 ``p = 0.3``
    put NegLogDist's table 0.019 off at distances ~50)."""
    r = np.random.default_rng(0)
    q, k = (jnp.asarray(30 * r.normal(size=(n, 3)), dtype) for n in (5, 7))
    p = jnp.asarray(0.3, dtype)
    d2 = ((np.asarray(q, np.float64)[:, None] - np.asarray(k, np.float64)[None]) ** 2).sum(-1)
    dp = d2 ** (np.float64(p) / 2)
    want = -np.log(1e-3 + dp) if cls is si.scores.NegLogDist else 1 / (1e-3 + dp)
    got = cls(q, k, p=p).dense()
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

def test_negsqdist_full_precision_normaliser_reads_its_symmetric_part():
    """The quadratic form of a full precision reads only its symmetric part, and so does
    the normaliser: a non-symmetric precision whose symmetric part is I gives log Z and
    marginals of the identity precision (its own log-determinant, log 10 here, would add
    n/2 log 10 to log Z)."""
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(4, 2)), jnp.float32)
    mu = jnp.asarray(r.normal(size=(3, 2)), jnp.float32)

    def model(P):
        with numpyro.plate("data", 4):
            si.edge("c", si.priors.Uniform(3), si.scores.NegSqDist(x, mu, P, normalize=True))

    skew = jnp.array([[1.0, 3.0], [-3.0, 1.0]])
    np.testing.assert_allclose(si.log_marginal(model, skew), si.log_marginal(model, jnp.eye(2)),
                               rtol=1e-6)
    per_parent = jnp.broadcast_to(skew, (3, 2, 2))
    np.testing.assert_allclose(si.log_marginal(model, per_parent),
                               si.log_marginal(model, jnp.broadcast_to(jnp.eye(2), (3, 2, 2))),
                               rtol=1e-6)


def test_from_graph_takes_a_traced_adjacency():
    """Regression: ``Restricted.from_graph`` read its adjacency with NumPy, so a graph
    passed as an argument (under ``jit``, or to ``si.attention``) raised a misleading
    "indexes a NumPy array" error; it now builds the same prior as a concrete graph."""
    import jax

    r = np.random.default_rng(2)
    q, k, v = (jnp.asarray(r.normal(size=(4, 3)), jnp.float32) for _ in range(3))
    adj = jnp.asarray(r.random((4, 4)) < 0.5)

    def model(q, k, v, adj):
        with numpyro.plate("queries", 4):
            j = si.edge("phi", si.priors.Restricted.from_graph(adj, self_loops=True),
                        si.scores.Dot(q, k))
            numpyro.deterministic("out", v[j])

    want = si.expectation(model, "out", q, k, v, adj)
    allowed = np.asarray(adj) | np.eye(4, dtype=bool)
    s = np.where(allowed, np.asarray(q) @ np.asarray(k).T, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(want, (w / w.sum(-1, keepdims=True)) @ np.asarray(v),
                               atol=1e-5)
    for got in (jax.jit(lambda *a: si.expectation(model, "out", *a))(q, k, v, adj),
                si.attention(model, "out")(q, k, v, adj)):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("shape", ["heads", "parents", "heads_parents"])
def test_linear_gaussian_takes_batch_dims_on_its_precision(shape, normalize, x64):
    r"""Regression: a per-head precision ``(H, 1, 1, d_x)`` was refused while ``b`` took
    batch dims. The precision now broadcasts against ``(..., children, parents, d_x)``
    (per head, per parent $\Lambda_k$, both), as ``b`` does against ``(..., parents,
    d_x)``: the table and the edge posterior against a plain float64 NumPy formula."""
    H, n, m, dx, dz = 2, 5, 7, 3, 11
    r = np.random.default_rng(5)
    x, z, A = r.normal(size=(H, n, dx)), r.normal(size=(m, dz)), r.normal(size=(dx, dz))
    b = r.normal(size=(H, 1, dx))
    prec = r.uniform(0.5, 2.0, size={"heads": (H, 1, 1, dx), "parents": (m, dx),
                                     "heads_parents": (H, 1, m, dx)}[shape])
    diff = x[:, :, None, :] - (z @ A.T + b)[:, None, :, :]                 # (H, n, m, dx)
    want = -0.5 * (prec * diff**2).sum(-1)
    if normalize:
        want = want + 0.5 * np.log(np.broadcast_to(prec, diff.shape)).sum(-1) \
            - 0.5 * dx * np.log(2 * np.pi)
    score = si.scores.LinearGaussian(x, z, A, b=b, precision=prec, normalize=normalize)
    np.testing.assert_allclose(score.dense(), want, rtol=1e-12, atol=1e-12)

    def model(x, z, A, b, prec):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("children", n, dim=-1):
            si.edge("phi", si.priors.Uniform(m),
                    si.scores.LinearGaussian(x, z, A, b=b, precision=prec, normalize=normalize))

    post = np.exp(want - want.max(-1, keepdims=True))
    post = post / post.sum(-1, keepdims=True)
    for f in (si.marginals, jax.jit(si.marginals, static_argnums=0)):
        np.testing.assert_allclose(f(model, x, z, A, b, prec)["phi"], post, rtol=1e-10,
                                   atol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("per_parent", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_neg_sq_dist_full_precision_16bit(dtype, per_parent, normalize):
    """A 16-bit full precision: the check and the log-determinant run in float32."""
    r = np.random.default_rng(3)
    a = r.normal(size=(M, D, D)) * 0.3
    P64 = a @ np.swapaxes(a, -1, -2) + np.eye(D)
    x, mu, prec = (jnp.asarray(t, dtype) for t in
                   (r.normal(size=(N, D)), r.normal(size=(M, D)), P64 if per_parent else P64[0]))
    v = jnp.asarray(r.normal(size=(M, 2)), dtype)
    xf, mf, pf, vf = (np.asarray(jnp.asarray(t, jnp.float32), np.float64) for t in (x, mu, prec, v))
    diff = xf[:, None] - mf[None]
    pj = pf if per_parent else np.broadcast_to(pf, (M, D, D))
    s = -0.5 * np.einsum("ijd,jde,ije->ij", diff, pj, diff)
    if normalize:
        s = s + 0.5 * np.linalg.slogdet(pj)[1]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)

    def model(x, mu, prec, v):
        with numpyro.plate("points", N):
            j = si.edge("z", si.priors.Uniform(M),
                        si.scores.NegSqDist(x, mu, prec, normalize=normalize))
            numpyro.deterministic("out", v[j])

    np.testing.assert_allclose(si.marginals(model, x, mu, prec, v)["z"], p, atol=1e-5)
    want, tol = p @ vf, 2e-2 if dtype == jnp.bfloat16 else 3e-3
    got = [si.expectation(model, "out", x, mu, prec, v)]
    if not per_parent:  # a per-parent full precision is not lowered
        got.append(si.attention(model, "out")(x, mu, prec, v))
    for y in got:
        assert y.dtype == dtype
        np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=tol)


def _band_of_by_brute_force(mask):
    """Every band (and self-edge choice) a concrete mask could be, checked cell by cell."""
    n, m = mask.shape
    if n < 2 or not mask.any(-1).all():
        return None
    d = np.arange(n)[:, None] - np.arange(m)[None, :]
    for exclude_zero in (False, True):
        allowed = mask & ~(exclude_zero & (d == 0))
        band = dict(dmin=int(d[allowed].min()), dmax=int(d[allowed].max()))
        want = (d >= band["dmin"]) & (d <= band["dmax"]) & ~(exclude_zero & (d == 0))
        if np.array_equal(mask, want):
            return {**band, "exclude_zero": exclude_zero}
    return None


def test_a_concrete_mask_is_read_as_a_band_exactly_and_without_an_n_by_m_temporary():
    """Regression: reading a concrete mask as a band built ``(n, m)`` int64 arrays (half a
    gigabyte, 0.7 s at n = 8192) at every ``Masked`` / ``Restricted`` construction. It
    now reads O(n + m) vectors; the answer is the brute-force one for bands, bands with
    one cell flipped, rectangular masks and masks that are no band."""
    import tracemalloc

    from structinfer.priors import _band_of

    r = np.random.default_rng(0)
    masks = []
    for n, m in [(2, 2), (5, 5), (6, 9), (9, 6), (12, 12)]:
        for band in [dict(), dict(dmin=0), dict(dmin=1), dict(dmax=0), dict(dmin=-2, dmax=1),
                     dict(dmin=-1, dmax=1, exclude_zero=True), dict(exclude_zero=True),
                     dict(dmin=0, dmax=2, exclude_zero=True), dict(dmin=2, dmax=3)]:
            mask = si.priors.band_mask(n, m, xp=np, **band)
            masks.append(mask)
            for _ in range(4):
                flipped = mask.copy()
                flipped[r.integers(n), r.integers(m)] ^= True
                masks.append(flipped)
        masks.append(r.random((n, m)) < 0.5)
    for mask in masks:
        want = _band_of_by_brute_force(mask)
        assert _band_of(mask) == want, (mask.astype(int), want)
    n = 1024
    causal = np.tri(n, dtype=bool)
    tracemalloc.start()
    try:
        assert _band_of(causal) == dict(dmin=0, dmax=n - 1, exclude_zero=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * n * n, peak  # a bool copy at most, no int64 (n, m) array
