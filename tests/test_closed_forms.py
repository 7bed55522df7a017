"""The exact engine against hand-written softmax formulas (Singh & Buckley sec. 3, app. 8).

Every reference below is written directly with numpy/jax.nn, independent of the
engine. Sizes are distinct primes (children 5, parents 7, features 3, values 2).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import matrix
from jax.test_util import check_grads
from numpyro.ops.indexing import Vindex

import structinfer as si

N, M, D, DV = 5, 7, 3, 2


def _data(seed=0, n=N, m=M, dtype=np.float32):
    r = np.random.default_rng(seed)
    xq = r.normal(size=(n, D)).astype(dtype)
    xk = r.normal(size=(m, D)).astype(dtype)
    v = r.normal(size=(m, DV)).astype(dtype)
    return xq, xk, v


def attention_model(prior_fn, score_cls=si.scores.Dot, **score_kw):
    def model(xq, xk, v):
        with numpyro.plate("queries", xq.shape[0]):
            j = si.edge("phi", prior_fn(xq.shape[0], xk.shape[0]), score_cls(xq, xk, **score_kw))
            numpyro.deterministic("out", v[j])

    return model


def softmax_ref(logits):
    logits = np.asarray(logits, np.float64)
    m = np.max(logits, -1, keepdims=True)
    e = np.exp(logits - m)
    return e / e.sum(-1, keepdims=True)


def lse_ref(logits):
    logits = np.asarray(logits, np.float64)
    m = np.max(logits, -1, keepdims=True)
    return (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]


def check_all(model, args, log_prior, scores, v, tol):
    logits = scores + log_prior
    A = softmax_ref(logits)
    out = si.expectation(model, "out", *args)
    marg = si.marginals(model, *args)["phi"]
    logz = si.log_marginal(model, *args)
    np.testing.assert_allclose(marg, A, atol=tol, rtol=tol)
    np.testing.assert_allclose(out, A @ np.asarray(v, np.float64), atol=tol, rtol=tol)
    np.testing.assert_allclose(logz, lse_ref(logits).sum(), atol=tol * 10, rtol=tol)
    np.testing.assert_allclose(si.energy(model, *args), -logz, rtol=1e-6)
    np.testing.assert_array_equal(si.map_edges(model, *args)["phi"], A.argmax(-1))


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_cross_attention_issue_example(precision, request):
    if precision == "float64":
        request.getfixturevalue("x64")
    dtype = np.float32 if precision == "float32" else np.float64
    r = np.random.default_rng(1)
    xq, xk = r.normal(size=(N, 11)).astype(dtype), r.normal(size=(M, 11)).astype(dtype)
    wq, wk, wv = (r.normal(size=(D, 11)).astype(dtype) for _ in range(3))

    def cross_attention(xq, xk, wq, wk, wv):
        with numpyro.plate("queries", xq.shape[0]):
            j = si.edge("phi", si.priors.Uniform(xk.shape[0]), si.scores.Dot(xq @ wq.T, xk @ wk.T))
            numpyro.deterministic("out", (xk @ wv.T)[j])

    Q, K, V = (np.float64(xq) @ wq.T, np.float64(xk) @ wk.T, np.float64(xk) @ wv.T)
    S = Q @ K.T
    A = softmax_ref(S)
    tol = 2e-5 if dtype == np.float32 else 1e-12
    out = si.expectation(cross_attention, "out", xq, xk, wq, wk, wv)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, A @ V, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(
        si.marginals(cross_attention, xq, xk, wq, wk, wv)["phi"], A, atol=tol
    )
    np.testing.assert_allclose(
        si.log_marginal(cross_attention, xq, xk, wq, wk, wv),
        lse_ref(S - math.log(M)).sum(),
        rtol=tol,
    )


def test_self_attention_with_and_without_self_edge(x64):
    x, _, v = _data(2, n=N, m=N, dtype=np.float64)
    S = x @ x.T
    for include_self in (True, False):
        mask = ~np.eye(N, dtype=bool) if not include_self else np.ones((N, N), bool)
        prior = (
            (lambda n, m: si.priors.Uniform(m))
            if include_self
            else (lambda n, m: si.priors.Restricted(~np.eye(n, dtype=bool)))
        )
        model = attention_model(prior)
        log_prior = np.where(mask, -np.log(mask.sum(-1, keepdims=True)), -np.inf)
        check_all(model, (x, x, v[:N]), log_prior, S, v[:N], 1e-12)


@pytest.mark.parametrize("include_self", [True, False])
def test_causal_attention(x64, include_self):
    x, _, v = _data(3, n=N, m=N, dtype=np.float64)
    v = v[:N]
    S = x @ x.T
    lo = 0 if include_self else 1
    mask = (np.arange(N)[:, None] - np.arange(N)[None, :]) >= lo
    if not include_self:  # first child has no earlier parent: drop it
        no_self = attention_model(lambda n, m: si.priors.Restricted.causal(n, include_self=False))
        with pytest.raises(ValueError, match="edge site 'phi': .*allows no parent for child 0"):
            si.log_marginal(no_self, x, x, v)
        return
    model = attention_model(lambda n, m: si.priors.Restricted.causal(n, include_self=include_self))
    log_prior = np.where(mask, -np.log(np.maximum(mask.sum(-1, keepdims=True), 1)), -np.inf)
    check_all(model, (x, x, v), log_prior, S, v, 1e-12)


def test_graph_masked_attention(x64):
    xq, xk, v = _data(4, dtype=np.float64)
    r = np.random.default_rng(4)
    adj = r.random((N, M)) < 0.4
    adj[np.arange(N), r.integers(0, M, N)] = True  # every child has a parent
    model = attention_model(lambda n, m: si.priors.Restricted.from_graph(adj))
    log_prior = np.where(adj, -np.log(adj.sum(-1, keepdims=True)), -np.inf)
    check_all(model, (xq, xk, v), log_prior, xq @ xk.T, v, 1e-12)


def test_sliding_window(x64):
    n = 11
    x = np.random.default_rng(5).normal(size=(n, D))
    v = np.random.default_rng(6).normal(size=(n, DV))
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    mask = (d >= 0) & (d < 3)
    model = attention_model(lambda n_, m: si.priors.Restricted.window(n_, 3))
    log_prior = np.where(mask, -np.log(mask.sum(-1, keepdims=True)), -np.inf)
    check_all(model, (x, x, v), log_prior, x @ x.T, v, 1e-12)


def test_relative_position_linear_bias(x64):
    xq, xk, v = _data(7, dtype=np.float64)
    bias = np.random.default_rng(7).normal(size=N + M - 1)
    model = attention_model(lambda n, m: si.priors.RelativePosition(bias, m))
    i, j = np.arange(N)[:, None], np.arange(M)[None, :]
    logits = bias[i - j + M - 1]
    log_prior = logits - lse_ref(logits)[:, None]
    check_all(model, (xq, xk, v), log_prior, xq @ xk.T, v, 1e-12)


def test_relative_position_circulant_and_hartley(x64):
    n = 7
    x = np.random.default_rng(8).normal(size=(n, D))
    v = np.random.default_rng(9).normal(size=(n, DV))
    c = np.random.default_rng(10).normal(size=n)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    circ = c[(i - j) % n]  # ln P = circ(c)
    model = attention_model(lambda n_, m: si.priors.RelativePosition.circulant(c))
    check_all(model, (x, x, v), circ - lse_ref(circ)[:, None], x @ x.T, v, 1e-12)

    beta = np.random.default_rng(11).normal(size=4)
    theta = 2 * np.pi * (i - j) / n
    ln_p = sum(beta[k] * (np.cos(k * theta) + np.sin(k * theta)) for k in range(4))
    model = attention_model(lambda n_, m: si.priors.RelativePosition.hartley(beta, n))
    check_all(model, (x, x, v), ln_p - lse_ref(ln_p)[:, None], x @ x.T, v, 1e-12)
    # the Hartley table is circulant: each row is the previous one rolled by one
    table = si.priors.RelativePosition.hartley(beta, n)._log_weights(n)
    np.testing.assert_allclose(np.roll(table[0], 1), table[1], atol=1e-12)


@pytest.mark.parametrize("include_self", [True, False])
def test_geometric_prior(x64, include_self):
    n, q = 7, 0.3
    x = np.random.default_rng(12).normal(size=(n, D))
    v = np.random.default_rng(13).normal(size=(n, DV))
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    d0 = 0 if include_self else 1
    w = np.where(d >= d0, np.log(q) + (d - d0) * np.log1p(-q), -np.inf)
    if not include_self:
        with pytest.raises(ValueError, match="child 0"):
            si.priors.Geometric(q, n, include_self=False).log_table(n)
        # children 1.. with an offset of one position
        w = w[1:]
        x_c = x[1:]
        model = attention_model(
            lambda n_, m: si.priors.Geometric(q, m, include_self=False, offset=1)
        )
        check_all(model, (x_c, x, v), w - lse_ref(w)[:, None], x_c @ x.T, v, 1e-12)
        return
    model = attention_model(lambda n_, m: si.priors.Geometric(q, m))
    check_all(model, (x, x, v), w - lse_ref(w)[:, None], x @ x.T, v, 1e-12)
    # closed-form normaliser of the truncated geometric: 1 - (1-q)^(i+1)
    table = np.asarray(si.priors.Geometric(q, n).log_table(n))
    expect = np.log(q) + d * np.log1p(-q) - np.log1p(-((1 - q) ** (np.arange(n) + 1)))[:, None]
    np.testing.assert_allclose(table[d >= 0], expect[d >= 0], atol=1e-12)


def test_categorical_prior_and_temperature(x64):
    xq, xk, v = _data(14, dtype=np.float64)
    logits = np.random.default_rng(14).normal(size=(N, M))
    model = attention_model(lambda n, m: si.priors.Categorical(logits), scale=0.5)
    check_all(model, (xq, xk, v), logits - lse_ref(logits)[:, None], 0.5 * xq @ xk.T, v, 1e-12)


def test_multihead_batched_plates(x64):
    H, B = 3, 2
    r = np.random.default_rng(15)
    q = r.normal(size=(B, H, N, D))
    k = r.normal(size=(B, H, M, D))
    v = r.normal(size=(B, H, M, DV))

    def mha(q, k, v):
        with numpyro.plate("batch", B, dim=-3), numpyro.plate("heads", H, dim=-2):
            with numpyro.plate("queries", N, dim=-1):
                j = si.edge("phi", si.priors.Uniform(M), si.scores.Dot(q, k, scale=D**-0.5))
                numpyro.deterministic("out", Vindex(v[:, :, None])[..., j, :])

    A = softmax_ref(np.einsum("bhid,bhjd->bhij", q, k) * D**-0.5)
    np.testing.assert_allclose(si.marginals(mha, q, k, v)["phi"], A, atol=1e-12)
    np.testing.assert_allclose(si.expectation(mha, "out", q, k, v), A @ v, atol=1e-12)


def test_multihop_chain_of_edges(x64):
    """N hops written as a chain of edge sites equal sum_{k=1..N} P^k V (app. 7.3)."""
    n = 5
    r = np.random.default_rng(16)
    x, v = r.normal(size=(n, D)), r.normal(size=(n, DV))

    def multihop(x, v, hops):
        with numpyro.plate("nodes", n):
            prior, score = si.priors.Uniform(n), si.scores.Dot(x, x)
            j = si.edge("hop0", prior, score)
            out = v[j]
            for h in range(1, hops):
                j = si.edge(f"hop{h}", prior, score, child=j)
                out = out + v[j]
            numpyro.deterministic("out", out)

    P = softmax_ref(x @ x.T)
    for hops in (1, 2, 3):
        ref = sum(np.linalg.matrix_power(P, h) for h in range(1, hops + 1)) @ v
        np.testing.assert_allclose(si.expectation(multihop, "out", x, v, hops), ref, atol=1e-12)
    # each hop is normalised, so log Z is the first hop's
    np.testing.assert_allclose(
        si.log_marginal(multihop, x, v, 3), lse_ref(x @ x.T - np.log(n)).sum(), rtol=1e-12
    )


def test_gradients_match_closed_form(x64):
    xq, xk, v = _data(17, dtype=np.float64)
    model = attention_model(lambda n, m: si.priors.Restricted.causal(n, m, offset=m - n))

    def f(xq, xk, v):
        return si.expectation(model, "out", xq, xk, v)

    # check_grads evaluates f many times: jitted (one trace), the eager gradients below
    check_grads(jax.jit(f), (xq, xk, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
    mask = (np.arange(N)[:, None] + M - N - np.arange(M)[None, :]) >= 0

    def ref(xq, xk, v):
        return jax.nn.softmax(jnp.where(mask, xq @ xk.T, -jnp.inf), -1) @ v

    g1 = jax.grad(lambda a: jnp.sum(jnp.sin(f(a, xk, v))))(xq)
    g2 = jax.grad(lambda a: jnp.sum(jnp.sin(ref(a, xk, v))))(xq)
    np.testing.assert_allclose(g1, g2, atol=1e-12)
    gl = jax.grad(lambda a: si.log_marginal(model, a, xk, v))(xq)
    np.testing.assert_allclose(
        gl,
        jax.grad(lambda a: jnp.sum(jax.nn.logsumexp(jnp.where(mask, a @ xk.T, -jnp.inf), -1)))(xq),
        atol=1e-12,
    )
    check_grads(jax.jit(lambda a: si.log_marginal(model, a, xk, v)), (xq,), order=2, atol=1e-5,
                rtol=1e-5)


def test_jit_and_vmap():
    xq, xk, v = _data(18)
    model = attention_model(lambda n, m: si.priors.Uniform(m), scale=0.3)
    f = jax.jit(lambda a, b, c: si.expectation(model, "out", a, b, c))
    ref = softmax_ref(0.3 * np.float64(xq) @ xk.T) @ v
    np.testing.assert_allclose(f(xq, xk, v), ref, atol=2e-5)
    batch = jnp.stack([xq, 2 * xq, -xq])
    out = jax.vmap(lambda a: si.expectation(model, "out", a, xk, v))(batch)
    for b in range(3):
        np.testing.assert_allclose(
            out[b], softmax_ref(0.3 * np.float64(batch[b]) @ xk.T) @ v, atol=2e-5
        )
    lz = jax.jit(lambda a: si.log_marginal(model, a, xk, v))(xq)
    assert lz.dtype == jnp.float32
    mp = jax.jit(lambda a: si.map_edges(model, a, xk, v))(xq)["phi"]
    np.testing.assert_array_equal(mp, np.argmax(np.float64(xq) @ xk.T, -1))
    draw = jax.jit(lambda k, a: si.sample_edges(k, model, a, xk, v))(jax.random.PRNGKey(1), xq)
    assert draw["phi"].shape == (N,) and draw["phi"].dtype == jnp.int32


def test_sample_edges_frequencies():
    xq, xk, v = _data(19, n=2, m=3)
    model = attention_model(lambda n, m: si.priors.Uniform(m))
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    # under jit: one program, not an eager vmap's hundreds of primitive compiles
    draws = jax.jit(jax.vmap(lambda k: si.sample_edges(k, model, xq, xk, v)["phi"]))(keys)
    A = softmax_ref(np.float64(xq) @ xk.T)
    freq = np.stack([(np.asarray(draws) == j).mean(0) for j in range(3)], -1)
    # 4000 draws: standard error <= 0.008; 5 sigma
    np.testing.assert_allclose(freq, A, atol=0.04)


def test_relative_position_offset_and_clipping(x64):
    xq, xk, v = _data(20, dtype=np.float64)
    r = np.random.default_rng(20)
    i, j = np.arange(N)[:, None], np.arange(M)[None, :]
    # offset: child i sits at parent position i + 2
    bias = r.normal(size=N + 2 + M - 1)
    model = attention_model(lambda n, m: si.priors.RelativePosition(bias, m, offset=2))
    logits = bias[i + 2 - j + M - 1]
    check_all(model, (xq, xk, v), logits - lse_ref(logits)[:, None], xq @ xk.T, v, 1e-12)
    # max_distance D: a bias of 2D + 1 entries, distances clipped to [-D, D]
    D = 2
    bias = r.normal(size=2 * D + 1)
    model = attention_model(lambda n, m: si.priors.RelativePosition(bias, m, max_distance=D))
    logits = bias[np.clip(i - j, -D, D) + D]
    check_all(model, (xq, xk, v), logits - lse_ref(logits)[:, None], xq @ xk.T, v, 1e-12)


def test_score_shared_by_every_child(x64):
    """A (1, parents) score broadcasts over the children plate."""
    xq, xk, v = _data(21, dtype=np.float64)
    s = np.random.default_rng(21).normal(size=(1, M))

    def shared(xq, xk, v):
        with numpyro.plate("queries", N):
            j = si.edge("phi", si.priors.Uniform(M), s)
            numpyro.deterministic("out", v[j])

    check_all(
        shared, (xq, xk, v), np.full((N, M), -np.log(M)), np.broadcast_to(s, (N, M)), v, 1e-12
    )


def test_a_model_with_no_factor_has_log_marginal_zero():
    """No edge, sample or factor site: the sum over structures is log 1 = 0 (was an
    AttributeError from ``.astype`` on funsor's Python 0.0), eagerly and under jit; a model
    with an observation only gives its log-density."""
    import numpyro.distributions as dist

    def empty(x):
        numpyro.deterministic("a", x)

    def observed():
        numpyro.sample("y", dist.Normal(0.0, 1.0), obs=1.0)

    x = jnp.ones(3)
    for f in (si.log_marginal, jax.jit(si.log_marginal, static_argnums=0)):
        lz = f(empty, x)
        assert lz.shape == () and lz.dtype == jnp.float32 and float(lz) == 0.0
    assert float(si.energy(empty, x)) == 0.0
    np.testing.assert_allclose(si.log_marginal(observed), -0.5 * math.log(2 * math.pi) - 0.5,
                               rtol=1e-6)


def _far_apart_cases():
    """float32 models whose factors over one edge site disagree by more than float32's
    exponent range (> 87 nats) about which parent is likely, while the joint log-weight of
    a structure stays in range: ``(model, args, logits, mu, x)`` with the float64 logits
    (children over parents) and the likelihood's means and observations (for the
    gradients' closed forms)."""
    import numpyro.distributions as dist

    def lik(mu, x):  # Normal(mu_j, 1) log-density of x_i: (..., children, parents)
        x, mu = np.asarray(x, np.float64)[..., None], np.asarray(mu, np.float64)
        return -0.5 * (x - mu) ** 2 - 0.5 * math.log(2 * math.pi)

    # the issue's example: the score favours parent 1 by 101 nats, the likelihood parent 0
    def example(x, mu, s):
        with numpyro.plate("points", x.shape[0]):
            j = si.edge("z", si.priors.Uniform(mu.shape[0]), s)
            numpyro.deterministic("out", mu[j])
            numpyro.sample("x", dist.Normal(mu[j], 1.0), obs=x)

    x, mu = np.zeros(2, np.float32), np.array([0.0, 14.2], np.float32)
    s = np.array([[0.0, 101.0], [0.0, 0.0]], np.float32)
    yield "example", example, (x, mu, s), s - math.log(2) + lik(mu, x), mu, x

    # the same under batch and head plates
    B, H, n = 2, 3, 4
    r = np.random.default_rng(30)
    sb = r.normal(size=(B, H, n, 2)).astype(np.float32)
    sb[..., 1] += np.float32(101.0) * (r.random(size=(B, H, n)) < 0.5)
    xb = (r.normal(size=(B, H, n)) * 0.1).astype(np.float32)

    def heads(x, mu, s):
        with numpyro.plate("batch", B, dim=-3), numpyro.plate("heads", H, dim=-2):
            with numpyro.plate("points", n, dim=-1):
                j = si.edge("z", si.priors.Uniform(mu.shape[0]), s)
                numpyro.deterministic("out", mu[j])
                numpyro.sample("x", dist.Normal(mu[j], 1.0), obs=x)

    yield "heads", heads, (xb, mu, sb), sb - math.log(2) + lik(mu, xb), mu, xb

    # attention: Dot scores spread over > 200 nats across the parents; each child's
    # observation sits near a parent scored 120-200 nats below its best
    n, m = 5, 7
    k = np.zeros((m, 1), np.float32)
    k[:, 0] = np.linspace(0.0, 3.0, m)
    q = np.full((n, 1), 80.0, np.float32)  # scores 0 .. 240
    mu_a = np.arange(m, dtype=np.float32) * 4.0
    xa = (mu_a[r.integers(1, 4, size=n)] + r.normal(size=n) * 0.3).astype(np.float32)

    def attention(q, k, mu, x):
        with numpyro.plate("queries", q.shape[0]):
            j = si.edge("z", si.priors.Uniform(k.shape[0]), si.scores.Dot(q, k))
            numpyro.deterministic("out", mu[j])
            numpyro.sample("x", dist.Normal(mu[j], 1.0), obs=x)

    scores = np.float64(q) @ np.float64(k).T
    assert np.ptp(scores, -1).min() > 200
    yield "attention", attention, (q, k, mu_a, xa), scores - math.log(m) + lik(mu_a, xa), mu_a, xa


@pytest.mark.parametrize("case", ["example", "heads", "attention"])
@pytest.mark.parametrize("jit", [False, True])
def test_float32_factors_far_apart_on_one_site(case, jit):
    """log Z, marginals, expectations and gradients are the float64 answer in float32
    when a site's factors disagree by more than float32's exponent range (the log-space
    contraction shifts their sum jointly; it shifted each factor by its own maximum, and
    the product of the shifted factors underflowed to log Z = -inf), eagerly and under jit."""
    name, model, args, logits, mu, x = next(c for c in _far_apart_cases() if c[0] == case)
    A = softmax_ref(logits)
    lz_ref = lse_ref(logits).sum()

    def wrap(f, *extra):
        g = lambda *a: f(model, *extra, *a)  # noqa: E731
        return jax.jit(g) if jit else g

    lz = wrap(si.log_marginal)(*args)
    assert lz.dtype == jnp.float32
    # float32 rounds each child's terms to about eps |logit|; their sum over the children
    eps = np.finfo(np.float32).eps
    np.testing.assert_allclose(lz, lz_ref, rtol=0, atol=4 * eps * np.abs(logits).max(-1).sum())
    np.testing.assert_allclose(wrap(si.marginals)(*args)["z"], A, atol=2e-5)
    np.testing.assert_allclose(wrap(si.expectation, "out")(*args), A @ np.float64(mu),
                               atol=2e-4, rtol=2e-5)
    # gradients: d log Z / d mu_j = sum_i A_ij (x_i - mu_j); for a given score, the marginals
    grads = jax.grad(wrap(si.log_marginal), argnums=tuple(range(len(args))))(*args)
    g_mu = (A * (np.float64(x)[..., None] - np.float64(mu))).reshape(-1, len(mu)).sum(0)
    i_mu = 1 if name != "attention" else 2
    np.testing.assert_allclose(grads[i_mu], g_mu, atol=2e-4, rtol=2e-5)
    if name != "attention":
        np.testing.assert_allclose(grads[2], A, atol=2e-5)
    else:  # Dot score s_ij = q_i . k_j: d/dq_i = sum_j A_ij k_j
        np.testing.assert_allclose(grads[0], A @ np.float64(args[1]), atol=2e-4, rtol=2e-5)



def _far_apart_chain(em, pot, log_t):
    """A chain of Markov edges with a potential ``pot[t, previous, next]`` at each step."""
    from numpyro.contrib.control_flow import scan

    prior = si.priors.Markov(log_t, log_t[0])

    def step(previous, xs):
        e, f = xs
        z = si.edge("z", prior, e, previous=previous)
        si.primitives.potential("f", f[jnp.maximum(previous, 0), z])
        return z, None

    scan(step, jnp.asarray(-1), (em, pot))


def _far_apart_chain_inputs(k, t):
    """Steps 1 and 2 of a chain of ``k`` states that disagree by more than float32's
    exponent range about the state between them, for *some* pairs of their outer states:
    step 1 favours z_1 = 0 by 101 nats; step 2 favours z_2 = 0 by 101 but penalises
    z_1 = z_2 = 0 by 202. The pairs (z_0, z_2 = 0) then have weight e^101 (k - 1) through
    z_1 != 0, as much as all pairs with z_2 != 0 together, but each of their terms is
    e^-101 or e^-202 of its factors' own maxima; those with z_2 != 0 are in range. The
    last state absorbs (the pairs it cannot leave are structural zeros, log 0)."""
    em = np.zeros((t, k))
    em[1, 0] = em[2, 0] = 101.0
    pot = np.zeros((t, k, k))
    pot[2, 0, 0] = -202.0
    log_t = np.full((k, k), -np.log(k))
    log_t[-1, :-1] = -np.inf
    return em, pot, log_t


def _far_apart_chain_reference(em, pot, log_t):
    """Brute force over every path in NumPy float64: log Z and its gradients with respect
    to ``em`` (the marginals), ``pot`` (the first step's marginal, then the pairwise
    marginals) and ``log_t`` (through the normalised rows, the first also the initial)."""
    import itertools

    t, k = em.shape
    paths = np.array(list(itertools.product(range(k), repeat=t)))
    with np.errstate(divide="ignore", invalid="ignore"):
        lt = log_t - np.logaddexp.reduce(log_t, -1, keepdims=True)
    prev, nxt, steps = paths[:, :-1], paths[:, 1:], np.arange(1, t)
    w = (lt[0][paths[:, 0]] + pot[0, 0][paths[:, 0]] + em[np.arange(t), paths].sum(1)
         + (lt[prev, nxt] + pot[steps, prev, nxt]).sum(1))
    log_z = np.logaddexp.reduce(w)
    p = np.exp(w - log_z)
    marg = np.stack([np.bincount(paths[:, s], weights=p, minlength=k) for s in range(t)])
    pair = np.zeros((t, k, k))
    for s in range(1, t):
        np.add.at(pair[s], (paths[:, s - 1], paths[:, s]), p)
    g_pot = pair.copy()
    g_pot[0, 0] = marg[0]
    soft = np.exp(lt)
    g_lt = (pair[1:] - marg[:-1, :, None] * soft).sum(0)
    g_lt[0] += marg[0] - soft[0]
    return log_z, (marg, g_pot, g_lt)


@pytest.mark.parametrize("k, t", matrix([(5, 3), (8, 5)], keep=lambda k, t: k == 5))
def test_float32_chain_steps_far_apart_for_some_states(k, t):
    """Regression: a float32 Markov chain of more than 4 states whose steps disagree by
    more than float32's exponent range about the state between them, for some of the
    outer states only. The product of two steps (the chain's contraction) shifted each
    step by its own maximum, so the terms of those pairs underflowed while the others did
    not: log Z was finite and too low (by log 2 here) and the marginals wrong by 0.4,
    with no error. The product is now shifted jointly (its broadcast is small): log Z
    and its gradients (those with respect to the edge's score are the marginals; through
    log 0's zero slope at the absorbing state's structural zeros too) are the float64
    brute-force answer, and so are `si.marginals` (exhaustive tier: one more compile)."""
    em, pot, log_t = _far_apart_chain_inputs(k, t)
    lz_ref, g_ref = _far_apart_chain_reference(em, pot, log_t)
    args = tuple(jnp.asarray(a, jnp.float32) for a in (em, pot, log_t))

    lz, grads = jax.jit(jax.value_and_grad(
        lambda *a: si.log_marginal(_far_apart_chain, *a), argnums=(0, 1, 2)))(*args)
    assert lz.dtype == jnp.float32
    np.testing.assert_allclose(lz, lz_ref, rtol=0, atol=4e-5)  # 303 nats in float32
    for g, r in zip(grads, g_ref):  # grads[0]: the marginals (the edge's score is em)
        np.testing.assert_allclose(g, r, atol=2e-6)
    if k > 5:  # the marginals by the engine's tilts (the same contraction, tilted)
        marg = jax.jit(lambda *a: si.marginals(_far_apart_chain, *a)["z"])(*args)
        np.testing.assert_allclose(marg, g_ref[0], atol=2e-6)
