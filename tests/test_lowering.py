"""The lowered engine against the exact engine and a plain NumPy softmax.

Oracles:
* ``np_reference``: softmax(score.dense() + prior.log_table(n)) @ V in float64 NumPy
  (the tables are the core's definitions, closed-form tested in test_closed_forms);
* ``si.expectation`` (the funsor engine) for whole models;
* dense autodiff for the blocked kernel's custom VJP.

Tolerances: float32 — 2e-5 absolute on O(1) outputs (logits are O(3), so the
softmax error is a few ulps of the largest logit); float64 — 1e-11.
Sizes are distinct primes and not multiples of the (small) block sizes used, so
every test has padded last blocks, and causal / window / block-sparse priors
have fully masked blocks that are skipped.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import (
    assert_huge_logit_gradients,
    float32_softmax,
    huge_logit_cotangents,
    huge_logit_edge,
    matrix,
    on_gpu,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from numpyro.ops.indexing import Vindex

import structinfer as si
from structinfer.lowering import NotLowerableError, attention, explain
from structinfer.lowering._lower import lower_edge
from structinfer.lowering.blocked import blocked_attention, make_schedule
from structinfer.lowering.dense import dense_attention
from structinfer.lowering.windowed import windowed_kernel

pytestmark = pytest.mark.gpu  # the GPU subset: pytest -m gpu

N, M, D, DV = 23, 29, 5, 3
BQ, BK = 4, 8  # small blocks: many blocks, padded tails


def softmax_np(logits):
    logits = np.asarray(logits, np.float64)
    mx = np.max(logits, -1, keepdims=True)
    e = np.exp(logits - mx)
    return e / e.sum(-1, keepdims=True)


def np_reference(prior, score, v, n):
    table = np.asarray(prior.log_table(n), np.float64)
    if score is not None:
        table = table + np.asarray(score.dense(), np.float64)
    return softmax_np(table) @ np.asarray(v, np.float64)


def _feats(seed, dtype, n=N, m=M, d=D):
    r = np.random.default_rng(seed)
    xq = (0.6 * r.normal(size=(n, d))).astype(dtype)
    xk = (0.6 * r.normal(size=(m, d))).astype(dtype)
    v = r.normal(size=(m, DV)).astype(dtype)
    return xq, xk, v


# --- priors x Dot, and scores x one prior -----------------------------------------


def _priors(n, m, dtype):
    r = np.random.default_rng(1)
    bm = r.random((-(-n // 6), -(-m // 6))) < 0.4
    bm[np.arange(bm.shape[0]), r.integers(0, bm.shape[1], bm.shape[0])] = True
    cat = r.normal(size=(n, m)).astype(dtype)
    cat[r.random((n, m)) < 0.3] = -np.inf
    cat[np.arange(n), r.integers(0, m, n)] = 0.5
    return {
        "uniform": si.priors.Uniform(m),
        "causal": si.priors.Restricted.causal(n, m, offset=m - n),
        "window": si.priors.Restricted.window(n, 3, m, offset=m - n),
        "window_1": si.priors.Restricted.window(n, 1, m, offset=m - n),  # one parent per row
        "window_sym": si.priors.Restricted.window(n, 4, m, causal=False, include_self=False),
        "block_sparse": si.priors.Restricted(
            np.repeat(np.repeat(bm, 6, 0), 6, 1)[:n, :m], pattern=si.priors.BlockSparse(6)
        ),
        "categorical": si.priors.Categorical(cat),
        "categorical_row": si.priors.Categorical(r.normal(size=m).astype(dtype)),
        "relpos": si.priors.RelativePosition(r.normal(size=n + m - 1).astype(dtype), m),
        "relpos_clip": si.priors.RelativePosition(
            r.normal(size=9).astype(dtype), m, max_distance=4, causal=True, offset=m - n
        ),
        "geometric": si.priors.Geometric(np.asarray(0.3, dtype), m, offset=m - n),
        "geometric_trunc": si.priors.Geometric(
            r.uniform(0.1, 0.6, size=n).astype(dtype), m, include_self=False,
            offset=m - n + 1, max_distance=7,
        ),
    }


PRIORS = list(_priors(N, M, np.float32))


@pytest.mark.parametrize("name", PRIORS)
def test_priors_with_dot_score_all_kernels(name):
    xq, xk, v = _feats(0, np.float32)
    prior = _priors(N, M, np.float32)[name]
    score = si.scores.Dot(xq, xk, scale=0.7)
    ref = np_reference(prior, score, v, N)
    low = lower_edge(prior, score, v, N)
    t, p = low.terms, low.problem
    run = jax.jit(lambda p: (dense_attention(t, p, ())[0],
                             blocked_attention(t, p, (), block_q=BQ, block_k=BK, mask=low.mask)[0]))
    for y in run(p):
        np.testing.assert_allclose(y, ref, atol=2e-5)
    if t.dmin is not None and t.dmax is not None:
        y = jax.jit(lambda p: windowed_kernel(t, p, (), block_q=BQ)[0])(p)
        np.testing.assert_allclose(y, ref, atol=2e-5)


def test_masked_blocks_are_skipped():
    prior = _priors(N, M, np.float32)["window"]
    low = lower_edge(prior, None, np.zeros((M, 1), np.float32), N)
    sched = make_schedule(low.terms, BQ, BK, low.mask)
    # a window of 3 at block size 4 x 8 touches at most 2 parent blocks per child block
    assert max(len(r) for r in sched.fwd) <= 2 < sched.nkb
    # brute force: a block is live iff some allowed edge lies in it
    mask = np.asarray(prior.mask)
    for a, row in enumerate(sched.fwd):
        for b in range(sched.nkb):
            any_ok = mask[a * BQ:(a + 1) * BQ, b * BK:(b + 1) * BK].any()
            assert (b in row) == any_ok
    # brute force: a live block is computed without a mask iff every edge in it is
    # allowed and none of its parents is padding
    wide_sym = si.priors.Restricted.window(N, 12, M, causal=False, include_self=False)
    for name, bq, bk in [("causal", BQ, BK), ("window", BQ, BK), ("relpos_clip", BQ, BK),
                         ("uniform", BQ, BK), ("wide_sym", 3, 2)]:
        p = wide_sym if name == "wide_sym" else _priors(N, M, np.float32)[name]
        low = lower_edge(p, None, np.zeros((M, 1), np.float32), N)
        sched = make_schedule(low.terms, bq, bk, low.mask)
        allowed = np.isfinite(np.asarray(p.log_table(N)))
        for a, row in enumerate(sched.fwd):
            for b in row:
                blk = allowed[a * bq:(a + 1) * bq, b * bk:(b + 1) * bk]
                want = blk.shape[1] == bk and blk.all()
                assert ((a, b) in sched.full) == want, (name, a, b)
        if name in ("causal", "wide_sym"):  # both kinds occur
            assert sched.full and len(sched.full) < sum(map(len, sched.fwd))
    bs = _priors(N, M, np.float32)["block_sparse"]
    low = lower_edge(bs, None, np.zeros((M, 1), np.float32), N)
    assert low.mask is not None
    sched = make_schedule(low.terms, 6, 6, low.mask)
    assert sched.live_fraction < 1.0


#: priors whose partial blocks a cut shrinks at the block sizes of the tests below
CUT_PRIORS = ("causal", "window", "window_1", "window_sym", "relpos_clip", "geometric",
              "geometric_trunc")


@pytest.mark.parametrize("bq,bk", [(4, 4), (6, 4), (4, 8)])
def test_cut_blocks_cover_the_allowed_edges(bq, bk):
    """Brute force over every prior: the rectangles of a block (`Schedule.pattern`, here
    cut from halves of 2 or more) lie inside it and do not overlap, cover every allowed
    edge of the block, and a rectangle computed without the mask holds only allowed edges
    and no padded parent. A causal diagonal block is cut to three quarters."""
    for name, prior in _priors(N, M, np.float32).items():
        low = lower_edge(prior, None, np.zeros((M, 1), np.float32), N)
        sched = make_schedule(low.terms, bq, bk, low.mask, min_piece=2)
        if name in CUT_PRIORS:
            assert sched.pieces, name
        allowed = np.isfinite(np.asarray(prior.log_table(N)))
        pad = np.zeros((sched.nqb * bq, sched.nkb * bk), bool)
        pad[:N, :M] = allowed
        for a, row in enumerate(sched.fwd):
            for b in row:
                blk = pad[a * bq:(a + 1) * bq, b * bk:(b + 1) * bk]
                covered = np.zeros(blk.shape, int)
                for r0, rn, c0, cn, masked in sched.pattern(a, b):
                    assert 0 <= r0 and r0 + rn <= bq and 0 <= c0 and c0 + cn <= bk
                    covered[r0:r0 + rn, c0:c0 + cn] += 1
                    if not masked:
                        real = max(N - a * bq - r0, 0)  # rows past n are padding
                        assert blk[r0:r0 + rn, c0:c0 + cn][:real].all(), (name, a, b)
                        assert (b * bk + c0 + cn) <= M, (name, a, b)
                assert covered.max() <= 1 and (covered[blk] == 1).all(), (name, a, b)
    if bq == bk:  # square causal: each diagonal block is cut to three quarters
        low = lower_edge(si.priors.Restricted.causal(4 * bq), None, np.zeros((4 * bq, 1)), 4 * bq)
        sched = make_schedule(low.terms, bq, bk, None, min_piece=2)
        h = bq // 2
        cut = ((0, h, 0, h, True), (h, h, 0, bq, True))
        assert sched.pieces == tuple(((a, a), cut) for a in range(4))
        assert make_schedule(low.terms, bq, bk, None, min_piece=h + 1).pieces == ()


#: by default a band prior with a shared key (causal), one with per-head keys and a table
#: (relpos_clip), a truncated geometric one and the block-sparse mask; the rest in the
#: exhaustive tier
@pytest.mark.parametrize("name", matrix(
    CUT_PRIORS + ("block_sparse", "categorical"),
    keep=lambda name: name in ("causal", "relpos_clip", "geometric_trunc", "block_sparse")))
def test_cut_blocks_values_and_gradients(x64, name):
    """The kernel on a schedule with cut blocks (halves of 2, or 3 x 4, in turn; the band
    priors' partial blocks are cut) against the NumPy softmax and against dense autodiff;
    every other prior shares its keys across the heads (their cotangent sums over heads)."""
    H = 2
    r = np.random.default_rng(11)
    q, k = r.normal(size=(H, N, D)), r.normal(size=(H, M, D))
    v = r.normal(size=(H, M, DV))
    prior = _priors(N, M, np.float64)[name]
    odd = PRIORS.index(name) % 2
    if odd:
        k = k[0]
    bq, bk = [(4, 4), (6, 8)][odd]

    def f(kernel, q, k, v):
        low = lower_edge(prior, si.scores.Dot(q, k, scale=0.5), v, N, (H,))
        if kernel == "dense":
            return dense_attention(low.terms, low.problem, (H,))
        sched = make_schedule(low.terms, bq, bk, low.mask, min_piece=2)
        if name in CUT_PRIORS:
            assert sched.pieces
        return blocked_attention(low.terms, low.problem, (H,), schedule=sched)

    y, lse = jax.jit(lambda *a: f("blocked", *a))(q, k, v)
    kh = np.broadcast_to(k, (H, M, D))
    want = np.stack([np_reference(prior, si.scores.Dot(q[h], kh[h], scale=0.5), v[h], N)
                     for h in range(H)])
    np.testing.assert_allclose(y, want, atol=1e-11, rtol=0)

    def loss(kernel, *a):
        y, lse = f(kernel, *a)
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.where(jnp.isfinite(lse), jnp.cos(lse), 0.0))

    gd = jax.jit(jax.grad(lambda *a: loss("dense", *a), argnums=(0, 1, 2)))(q, k, v)
    gb = jax.jit(jax.grad(lambda *a: loss("blocked", *a), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(gd, gb):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("name", ["relpos_clip", "geometric_trunc", "block_sparse",
                                  "categorical", "window_sym"])
def test_block_logits_transposed_is_the_transpose(x64, name):
    """`block_logits(transposed=True)` builds every term (dot, IDW, per-edge table,
    relative position, geometric, band, masks, padded parents) parents x children: equal
    to the transpose of the children x parents block, on a block that is not square."""
    from structinfer.lowering._spec import block_logits

    xq, xk, v = _feats(9, np.float64)
    score = si.scores.Sum(si.scores.Dot(xq, xk), si.scores.NegLogDist(xq, xk),
                          si.scores.Custom(np.random.default_rng(3).normal(size=(N, M))))
    low = lower_edge(_priors(N, M, np.float64)[name], score, v, N)
    t, p = low.terms, low.problem
    i0, bq, j0, bk = 5, 7, 11, 4
    rows = jax.tree.map(lambda x: x[..., i0:i0 + bq, :], p.row)
    cols = jax.tree.map(lambda x: x[..., j0:j0 + bk, :], p.col)
    pair = jax.tree.map(lambda x: x[..., i0:i0 + bq, j0:j0 + bk], p.pair)
    const = p.const.map(lambda x: x[..., i0:i0 + bq, j0:j0 + bk], lambda x: x[..., j0:j0 + bk])
    args = (t, rows, cols, pair, p.glob, const, jnp.arange(i0, i0 + bq),
            jnp.arange(j0, j0 + bk), jnp.float64, jnp.arange(bk) < 3)
    s, ok = block_logits(*args)
    st, ok_t = block_logits(*args, transposed=True)
    assert st.shape == s.shape[:-2] + (bk, bq)
    # the same sums; a GPU's matmul may order a dot product's terms differently when the
    # operands are swapped (one ulp), so the check is to a few ulp of float64, not bit-exact
    np.testing.assert_allclose(st, jnp.swapaxes(s, -1, -2), rtol=4 * np.finfo(np.float64).eps,
                               atol=4 * np.finfo(np.float64).eps)
    np.testing.assert_array_equal(ok_t, jnp.swapaxes(ok, -1, -2))


def test_default_blocks_cut_float32_user_path():
    """The user's path at the default 256 x 256 blocks, float32, under jit: a causal model
    of 384 children (a cut diagonal block and a padded half block) equals jax.nn's
    attention in value and gradient; a geometric prior (cut blocks, backward built
    children x parents) equals the dense kernel."""
    H, n, d = 2, 384, 16
    r = np.random.default_rng(7)
    q, k, v = (jnp.asarray(r.normal(size=(H, n, d)), jnp.float32) for _ in range(3))

    def model_of(prior):
        def model(q, k, v):
            with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
                j = si.edge("phi", prior, si.scores.Dot(q, k, scale=d**-0.5))
                numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])
        return model

    def grads(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))(q, k, v)

    causal = attention(model_of(si.priors.Restricted.causal(n)), "out")
    if not on_gpu():  # a GPU's auto path picks its own kernel: the values are checked all the same
        assert explain(model_of(si.priors.Restricted.causal(n)), "out", q, k, v).kernels == {
            "phi": "blocked"}

    def ref(q, k, v):
        t = lambda x: jnp.swapaxes(x, 0, 1)[None]  # noqa: E731  (1, n, H, d)
        return jnp.swapaxes(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=True)[0],
                            0, 1)

    np.testing.assert_allclose(jax.jit(causal)(q, k, v), ref(q, k, v), atol=2e-6)
    for a, b in zip(grads(causal), grads(ref)):
        np.testing.assert_allclose(a, b, atol=2e-5)
    geo = model_of(si.priors.Geometric(0.05, n))
    if not on_gpu():
        assert explain(geo, "out", q, k, v).kernels == {"phi": "blocked"}
    fast, dense = attention(geo, "out"), attention(geo, "out", backend="dense")
    np.testing.assert_allclose(jax.jit(fast)(q, k, v), jax.jit(dense)(q, k, v), atol=2e-6)
    for a, b in zip(grads(fast), grads(dense)):
        np.testing.assert_allclose(a, b, atol=2e-5)


def _scores(xq, xk, dtype):
    r = np.random.default_rng(2)
    mu = xk
    diag = r.uniform(0.5, 2.0, size=D).astype(dtype)
    perp = r.uniform(0.5, 2.0, size=(M, D)).astype(dtype)
    A = r.normal(size=(D, D)).astype(dtype)
    full = (A @ A.T / D + np.eye(D)).astype(dtype)
    wq = r.normal(size=(4, D)).astype(dtype)
    wk = r.normal(size=(4, D)).astype(dtype)
    lw = r.normal(size=M).astype(dtype)
    return {
        "dot": si.scores.Dot(xq, xk),
        "bilinear": si.scores.Bilinear(xq, xk, wq, wk, scale=0.3),
        "cosine": si.scores.Cosine(xq, xk, scale=2.0),
        "negsq_identity": si.scores.NegSqDist(xq, mu),
        "negsq_diag_weights": si.scores.NegSqDist(xq, mu, diag, log_weights=lw),
        "negsq_perparent_norm": si.scores.NegSqDist(xq, mu, perp, normalize=True),
        "negsq_full": si.scores.NegSqDist(xq, mu, full),
        "idw": si.scores.NegLogDist(xq, xk, p=1.5, eps=1e-2),
        "linear_gaussian": si.scores.LinearGaussian(xq, xk[:, :3], r.normal(size=(D, 3)).astype(dtype), precision=np.float32(2.0).astype(dtype)),
        "custom": si.scores.Custom(r.normal(size=(N, M)).astype(dtype)),
        "sum": si.scores.Sum(si.scores.Dot(xq, xk, scale=0.5), si.scores.NegLogDist(xq, xk),
                             si.scores.NegSqDist(xq, mu, diag)),
    }


SCORE_GROUPS = {  # one compile per group: the lowered terms of a Sum are the union
    "matmul": ["dot", "bilinear", "cosine", "custom"],
    "gaussian": ["negsq_identity", "negsq_diag_weights", "negsq_perparent_norm", "negsq_full",
                 "linear_gaussian"],
    "idw": ["idw"],
    "sum": ["sum"],
}


@pytest.mark.parametrize("group", list(SCORE_GROUPS))
def test_scores_blocked_equals_reference(group):
    xq, xk, v = _feats(3, np.float32)
    table = _scores(xq, xk, np.float32)
    score = si.scores.Sum(*[table[k] for k in SCORE_GROUPS[group]])
    prior = si.priors.Restricted.causal(N, M, offset=M - N)
    ref = np_reference(prior, score, v, N)
    low = lower_edge(prior, score, v, N)
    y = jax.jit(lambda p: blocked_attention(low.terms, p, (), block_q=BQ, block_k=BK)[0])(
        low.problem
    )
    np.testing.assert_allclose(y, ref, atol=3e-5)


@pytest.mark.parametrize("kind", ["relpos", "geometric_trunc"])
def test_float64_near_machine_precision(x64, kind):
    xq, xk, v = _feats(4, np.float64)
    prior = _priors(N, M, np.float64)[kind]
    score = si.scores.Sum(si.scores.Dot(xq, xk), si.scores.NegLogDist(xq, xk))
    ref = np_reference(prior, score, v, N)
    low = lower_edge(prior, score, v, N)
    y = jax.jit(lambda p: blocked_attention(low.terms, p, (), block_q=BQ, block_k=BK,
                                            mask=low.mask)[0])(low.problem)
    assert y.dtype == jnp.float64
    np.testing.assert_allclose(y, ref, atol=1e-11, rtol=0)


# --- gradients: custom VJP (recompute per block) == dense autodiff ------------------


def test_blocked_gradients_match_dense(x64):
    """Row (q, geometric q), column (k, v), pair (custom table) and global (relative
    bias) cotangents of the custom VJP against dense autodiff, including keys shared
    by all heads (the hand-written dot-product cotangent sums over the heads)."""
    r = np.random.default_rng(5)
    H, n, m = 3, 13, 17
    q = r.normal(size=(H, n, D))
    k = r.normal(size=(H, m, D))
    v = r.normal(size=(H, m, DV))
    bias = r.normal(size=(H, 2 * m - 1))  # offset m - n: n + offset + m - 1 distances
    gq = r.uniform(0.2, 0.7, size=(H, n))
    table = r.normal(size=(n, m))

    def make(case, q, k, bias, gq, table):
        if case == 0:
            return (si.priors.RelativePosition(bias, m, causal=True, offset=m - n),
                    si.scores.Sum(si.scores.Dot(q, k), si.scores.Custom(table)))
        if case == 2:  # keys shared by the heads: their cotangent sums over heads
            return si.priors.Uniform(m), si.scores.Dot(q, k[0], scale=0.3)
        return (si.priors.Geometric(gq, m, offset=m - n, max_distance=6),
                si.scores.NegLogDist(q, k, p=1.0))

    for case in range(3):
        def f(kernel, q, k, v, bias, gq, table, case=case):
            prior, score = make(case, q, k, bias, gq, table)
            low = lower_edge(prior, score, v, n, (H,))
            if kernel == "dense":
                y, lse = dense_attention(low.terms, low.problem, (H,))
            else:
                y, lse = blocked_attention(low.terms, low.problem, (H,), block_q=4, block_k=8)
            return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(lse) * 0.1)

        args = (q, k, v, bias, gq, table)
        wrt = {0: (0, 1, 2, 3, 5), 1: (0, 1, 2, 4), 2: (0, 1, 2)}[case]
        gd = jax.jit(jax.grad(lambda *a: f("dense", *a), argnums=wrt))(*args)
        gb = jax.jit(jax.grad(lambda *a: f("blocked", *a), argnums=wrt))(*args)
        for a, b in zip(gd, gb):
            assert np.abs(a).max() > 1e-3  # the gradient is not trivially zero
            np.testing.assert_allclose(b, a, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_blocked_gradients_of_rows_of_huge_logits(causal):
    r"""Regression: a row whose every key carries a finite -1e9 bias (a fully masked row
    written as a bias) has logits near -1e9, where float32's spacing is 64: its max $m$
    and $L = m + \log l$ round to the same number, so a backward that rebuilt
    $p = e^{s - L}$ got 1 per key (the gradients a row's length too large) while the
    forward's $e^{s - m} / l$ is uniform. The backward rebuilds $p$ from the saved $m$ and
    $\log l$: y, L and dq, dk, dbias, dv (with a cotangent on y and on L) equal those of a
    plain float32 softmax of the same rounded logits, also with a causal mask (rows of
    different lengths, several blocks per row)."""
    n, d = 24, 8
    mask = np.tri(n, dtype=bool) if causal else None
    low = huge_logit_edge(n, d, jnp.float32, mask)
    ct = huge_logit_cotangents(low)
    ref = jax.vjp(lambda p: float32_softmax(p, mask), low.problem)
    got = jax.jit(lambda p, ct: (lambda o, vjp: (o, vjp(ct)))(*jax.vjp(
        lambda p: blocked_attention(low.terms, p, (2,), block_q=8, block_k=8, mask=low.mask),
        p)))(low.problem, ct)
    np.testing.assert_allclose(got[0][0], ref[0][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0][1], ref[0][1], rtol=1e-6)
    assert_huge_logit_gradients(got[1][0], ref[1](ct)[0])


# --- whole models: attention(model) == si.expectation(model) ------------------------


def _mha_model(prior_fn, B=2, H=3):
    def mha(q, k, v):
        n, m = q.shape[-2], k.shape[-2]
        with numpyro.plate("batch", B, dim=-3), numpyro.plate("heads", H, dim=-2):
            with numpyro.plate("queries", n, dim=-1):
                j = si.edge("phi", prior_fn(n, m), si.scores.Dot(q, k, scale=D**-0.5))
                numpyro.deterministic("out", Vindex(v[:, :, None])[..., j, :])

    return mha


_EXACT: dict = {}  # exact-engine references shared by parametrised tests


@pytest.mark.parametrize("backend", ["auto", "dense", "blocked"])
def test_multihead_batched_model_equals_exact(backend):
    r = np.random.default_rng(6)
    B, H, n, m = 2, 3, 11, 13
    q = r.normal(size=(B, H, n, D)).astype(np.float32)
    k = r.normal(size=(B, H, m, D)).astype(np.float32)
    v = r.normal(size=(B, H, m, DV)).astype(np.float32)
    bias = r.normal(size=(H, n + m - 1)).astype(np.float32)  # one bias per head
    model = _mha_model(lambda n, m: si.priors.RelativePosition(bias, m), B, H)
    if "mha" not in _EXACT:
        _EXACT["mha"] = jax.jit(lambda *a: si.expectation(model, "out", *a))(q, k, v)
    ref = _EXACT["mha"]
    f = attention(model, "out", backend, block_q=4, block_k=8)
    out = f(q, k, v)
    assert out.shape == (B, H, n, DV)
    np.testing.assert_allclose(out, ref, atol=2e-5)


def test_value_is_any_function_of_the_parent_and_event_shapes():
    xq, xk, v = _feats(7, np.float32)
    w = np.random.default_rng(7).normal(size=(M, 2, 2)).astype(np.float32)

    def model(xq, xk, v, w):
        with numpyro.plate("q", xq.shape[0]):
            j = si.edge("phi", si.priors.Geometric(0.2, xk.shape[0], offset=M - N),
                        si.scores.Dot(xq, xk))
            numpyro.deterministic("out", jnp.sin(jnp.asarray(w)[j]) + j[..., None, None])

    table = (np.sin(np.float64(w)) + np.arange(M)[:, None, None]).reshape(M, 4)
    prior = si.priors.Geometric(0.2, M, offset=M - N)
    ref = np_reference(prior, si.scores.Dot(xq, xk), table, N).reshape(N, 2, 2)
    out = attention(model, "out", "blocked", block_q=4, block_k=8)(xq, xk, v, w)
    assert out.shape == (N, 2, 2)
    np.testing.assert_allclose(out, ref, atol=5e-5)


def _multihop(hops, score_fn):
    def model(x, v):
        n = x.shape[0]
        with numpyro.plate("nodes", n):
            prior = si.priors.Restricted.causal(n)
            j = si.edge("hop0", prior, score_fn(x))
            out = v[j]
            for h in range(1, hops):
                j = si.edge(f"hop{h}", prior, score_fn(x), child=j)
                out = out + v[j]
            numpyro.deterministic("out", out)

    return model


@pytest.mark.parametrize("hops", [2, 3])
def test_multihop_lowers_to_one_kernel_per_hop(hops, x64):
    r = np.random.default_rng(8)
    n = 17
    x, v = r.normal(size=(n, D)), r.normal(size=(n, DV))
    model = _multihop(hops, lambda x: si.scores.Dot(x, x, scale=0.5))
    ex = explain(model, "out", x, v, backend="blocked")
    assert ex.path == "lowered" and len(ex.kernels) == hops
    assert ex.follows["hop1"] == "hop0"
    out = attention(model, "out", "blocked", block_q=4, block_k=8)(x, v)
    mask = np.tril(np.ones((n, n), bool))
    P = softmax_np(np.where(mask, 0.5 * x @ x.T, -np.inf))
    ref = sum(np.linalg.matrix_power(P, h) for h in range(1, hops + 1)) @ v
    np.testing.assert_allclose(out, ref, atol=1e-11)
    if hops == 2:
        np.testing.assert_allclose(
            out, jax.jit(lambda *a: si.expectation(model, "out", *a))(x, v), atol=1e-11
        )


def test_jit_vmap_grad_of_attention_function():
    xq, xk, v = _feats(9, np.float32)

    def model(xq, xk, v):
        with numpyro.plate("q", xq.shape[0]):
            j = si.edge("phi", si.priors.Restricted.causal(N, M, offset=M - N),
                        si.scores.Dot(xq, xk))
            numpyro.deterministic("out", v[j])

    f = attention(model, "out", "blocked", block_q=4, block_k=8)
    mask = (np.arange(N)[:, None] + M - N - np.arange(M)[None, :]) >= 0

    def ex(a, b, c):  # plain softmax attention written here
        return jax.nn.softmax(jnp.where(mask, a @ b.T, -jnp.inf), -1) @ c

    batch = jnp.stack([xq, 0.5 * xq])
    np.testing.assert_allclose(
        jax.jit(jax.vmap(lambda a: f(a, xk, v)))(batch),
        jax.jit(jax.vmap(lambda a: ex(a, xk, v)))(batch), atol=2e-5,
    )
    g = jax.jit(jax.grad(lambda a, b, c: jnp.sum(f(a, b, c) ** 2), argnums=(0, 1, 2)))
    ge = jax.jit(jax.grad(lambda a, b, c: jnp.sum(ex(a, b, c) ** 2), argnums=(0, 1, 2)))
    for a, b in zip(g(xq, xk, v), ge(xq, xk, v)):
        np.testing.assert_allclose(a, b, atol=5e-5)


# --- auto: kernel choice, fallbacks and their explanations --------------------------


def _simple(prior_fn, score_fn, value_fn=None, extra=None):
    def model(xq, xk, v):
        n, m = xq.shape[0], xk.shape[0]
        with numpyro.plate("q", n):
            j = si.edge("phi", prior_fn(n, m), score_fn(xq, xk))
            if extra is not None:
                extra(j, xq, xk, v)
            numpyro.deterministic("out", v[j] if value_fn is None else value_fn(j, xq, v))

    return model


@pytest.mark.cpu_only
def test_auto_picks_kernels():
    xq, xk, v = _feats(10, np.float32, n=200, m=211)
    dot = lambda a, b: si.scores.Dot(a, b)  # noqa: E731
    ex = explain(_simple(lambda n, m: si.priors.Uniform(m), dot), "out", xq, xk, v)
    assert ex.kernels == {"phi": "blocked"} and "matmul" in str(ex)
    geo = _simple(lambda n, m: si.priors.Geometric(0.3, m, offset=m - n, max_distance=20), dot)
    assert explain(geo, "out", xq, xk, v).kernels == {"phi": "windowed"}
    small = _simple(lambda n, m: si.priors.Uniform(m), dot)
    assert explain(small, "out", *_feats(0, np.float32)).kernels == {"phi": "dense"}
    assert explain(small, "out", xq, xk, v, backend="exact").path == "exact"


def test_kernel_table_contract():
    """One row per kernel, one contract (STYLE 5): the table is read-only and names the
    backends; every entry that can run an edge here runs it — a window with rows that have
    no parent (children 0 and 1) — to the dense kernel's numbers on the other rows, and
    writes NaN in the empty rows exactly when its entry says it does (``nan_rows``:
    `attention` writes them for the others); a refusing entry's fallbacks are entries."""
    import dataclasses
    from collections.abc import Mapping, MutableMapping

    from structinfer.lowering import BACKENDS, KERNELS, Kernel, KernelConfig
    from structinfer.lowering._lower import lower_edge

    assert isinstance(KERNELS, Mapping) and not isinstance(KERNELS, MutableMapping)
    assert KERNELS.__doc__
    assert BACKENDS == ("auto", "exact", *KERNELS)
    with pytest.raises(TypeError):
        KERNELS["mine"] = KERNELS["dense"]  # type: ignore[index]
    n, m = 13, 11
    xq, xk, v = _feats(3, np.float32, n=n, m=m)
    low = lower_edge(si.priors.Restricted.window(n, 3, m, offset=-2),
                     si.scores.Dot(xq, xk, scale=0.5), v, n, ())
    y0, l0 = KERNELS["dense"].run(low, low.problem, (), KernelConfig())
    ran = []
    for name, k in KERNELS.items():
        assert isinstance(k, Kernel) and k.name == name
        with pytest.raises(dataclasses.FrozenInstanceError):
            k.nan_rows = not k.nan_rows  # type: ignore[misc]
        assert all(f in KERNELS for f in k.fallback) and k.ring_step in KERNELS
        assert KERNELS[k.ring_step].passes is not None  # takes a chunk's global offsets
        if k.unsupported(low) is not None:  # cuDNN off a GPU
            continue
        y, lse = jax.jit(lambda p, k=k: k.run(low, p, (), KernelConfig(4, 4)))(low.problem)
        assert np.isneginf(lse[:2]).all() and np.isfinite(lse[2:]).all(), name
        assert np.isnan(y[:2]).all() == k.nan_rows and not np.isnan(y[2:]).any(), name
        np.testing.assert_allclose(y[2:], y0[2:], atol=2e-6, err_msg=name)
        np.testing.assert_allclose(lse[2:], l0[2:], atol=2e-6, err_msg=name)
        ran.append(name)
    # Pallas runs interpreted here, on a JAX with its Triton backend (not the floor's)
    has_pallas = KERNELS["pallas"].unsupported(low) is None
    assert {"dense", "blocked", "windowed", *(["pallas"] if has_pallas else [])} <= set(ran)
    assert has_pallas or "Pallas Triton backend" in KERNELS["pallas"].unsupported(low)


def _dot_ref(xq, xk, v, extra=0.0):
    return softmax_np(np.float64(xq) @ np.float64(xk).T + extra) @ np.float64(v)


FALLBACKS = {  # model, (site, words in the explanation), NumPy reference
    "inv_dist score": (
        _simple(lambda n, m: si.priors.Uniform(m), lambda a, b: si.scores.InvDist(a, b)),
        ("phi", "score InvDist"),
        lambda xq, xk, v: np_reference(si.priors.Uniform(M), si.scores.InvDist(xq, xk), v, N),
    ),
    "per-parent full precision": (
        _simple(lambda n, m: si.priors.Uniform(m), lambda a, b: si.scores.NegSqDist(
            a, b, np.broadcast_to(np.eye(D, dtype=np.float32), (b.shape[0], D, D)))),
        ("phi", "per-parent full precision"),
        lambda xq, xk, v: np_reference(si.priors.Uniform(M), si.scores.NegSqDist(xq, xk), v, N),
    ),
    "value depends on the child": (
        _simple(lambda n, m: si.priors.Uniform(m), lambda a, b: si.scores.Dot(a, b),
                value_fn=lambda j, xq, v: v[j] + xq[:, :DV]),
        ("out", "child index"),
        lambda xq, xk, v: _dot_ref(xq, xk, v) + xq[:, :DV],
    ),
    "likelihood on the edge": (
        _simple(lambda n, m: si.priors.Uniform(m), lambda a, b: si.scores.Dot(a, b),
                extra=lambda j, xq, xk, v: numpyro.sample(
                    "y", numpyro.distributions.Normal(v[j][..., 0], 1.0), obs=xq[:, 0])),
        ("y", "depends on edge 'phi'"),
        lambda xq, xk, v: _dot_ref(
            xq, xk, v, -0.5 * (np.float64(xq[:, :1]) - np.float64(v[:, 0])[None]) ** 2),
    ),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_fallback_is_exact_and_explained(case):
    model, (site, words), ref_fn = FALLBACKS[case]
    xq, xk, v = _feats(11, np.float32)
    ex = explain(model, "out", xq, xk, v)
    assert ex.path == "exact"
    assert ex.fallback.site == site and words in str(ex), str(ex)
    out = attention(model, "out")(xq, xk, v)
    np.testing.assert_allclose(out, ref_fn(xq, xk, v), atol=2e-5)
    with pytest.raises(NotLowerableError, match=f"site '{site}'"):
        attention(model, "out", "blocked")(xq, xk, v)


def test_non_separable_two_edge_value_falls_back():
    r = np.random.default_rng(12)
    x, v = r.normal(size=(7, D)).astype(np.float32), r.normal(size=(7, DV)).astype(np.float32)

    def model(x, v):
        with numpyro.plate("nodes", 7):
            j = si.edge("a", si.priors.Uniform(7), si.scores.Dot(x, x))
            k = si.edge("b", si.priors.Uniform(7), si.scores.Dot(x, x), child=j)
            numpyro.deterministic("out", v[j] * v[k])

    ex = explain(model, "out", x, v)
    assert ex.path == "exact" and "sum of per-edge terms" in str(ex)
    P = softmax_np(np.float64(x) @ np.float64(x).T)  # both hops share the same table
    ref = np.einsum("ij,jk,jd,kd->id", P, P, np.float64(v), np.float64(v))
    np.testing.assert_allclose(attention(model, "out")(x, v), ref, atol=2e-5)


def test_pattern_that_lies_about_its_mask_uses_the_mask():
    xq, xk, v = _feats(13, np.float32)
    mask = np.random.default_rng(13).random((N, M)) < 0.5
    mask[:, 0] = True
    liar = lambda n, m: si.priors.Restricted(mask, pattern=si.priors.Causal())  # noqa: E731
    model = _simple(liar, lambda a, b: si.scores.Dot(a, b))
    assert "does not match" in str(explain(model, "out", xq, xk, v, backend="blocked"))
    out = attention(model, "out", "blocked", block_q=4, block_k=8)(xq, xk, v)
    np.testing.assert_allclose(out, np_reference(liar(N, M), si.scores.Dot(xq, xk), v, N),
                               atol=2e-5)


def test_bad_arguments_are_named():
    model = _simple(lambda n, m: si.priors.Uniform(m), lambda a, b: si.scores.Dot(a, b))
    with pytest.raises(ValueError, match="backend must be one of"):
        attention(model, "out", "flash")
    with pytest.raises(KeyError, match="no site 'nope'"):
        attention(model, "nope")(*_feats(0, np.float32))
    with pytest.raises(NotLowerableError, match="no finite distance band"):
        attention(model, "out", "windowed")(*_feats(0, np.float32))


# --- random shapes (hypothesis): blocked / windowed == NumPy softmax ----------------


@settings(max_examples=3, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 23), extra=st.integers(0, 9), bq=st.integers(1, 9), bk=st.integers(1, 9),
    width=st.integers(1, 6), seed=st.integers(0, 2**16),
)
def test_random_shapes_blocked_and_windowed(n, extra, bq, bk, width, seed):
    m = n + extra
    r = np.random.default_rng(seed)
    xq, xk = r.normal(size=(n, 3)).astype(np.float32), r.normal(size=(m, 3)).astype(np.float32)
    v = r.normal(size=(m, 2)).astype(np.float32)
    bias = r.normal(size=(2 * width + 1,)).astype(np.float32)
    prior = si.priors.RelativePosition(bias, m, offset=extra, max_distance=width, causal=True)
    window = si.priors.Restricted.window(n, width, m, offset=extra)
    for pr in (prior, window):
        score = si.scores.Dot(xq, xk)
        ref = np_reference(pr, score, v, n)
        low = lower_edge(pr, score, v, n)
        y = jax.jit(lambda p: blocked_attention(low.terms, p, (), block_q=bq, block_k=bk)[0])(
            low.problem)
        np.testing.assert_allclose(y, ref, atol=2e-5)
    low = lower_edge(window, si.scores.Dot(xq, xk), v, n)
    y = jax.jit(lambda p: windowed_kernel(low.terms, p, (), block_q=bq)[0])(low.problem)
    np.testing.assert_allclose(y, np_reference(window, si.scores.Dot(xq, xk), v, n), atol=2e-5)


# --- soundness: cases that used to lower to a wrong answer must fall back ---------


def _small(seed=0, n=3, m=4, d=2, dv=2, vscale=1.0):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.normal(size=(n, d))), jnp.asarray(r.normal(size=(m, d))),
            jnp.asarray(vscale * r.normal(size=(m, dv))))


def _same_as_exact(model, args, site=None, part=None):
    """attention(model) agrees with the exact engine (value or error); with ``site`` the
    model must fall back and explain must name the site (and the part)."""
    try:
        ex = explain(model, "out", *args)
    except ValueError as err:  # the exact engine refuses the model itself: so must attention
        msg = str(err)[:40].replace("(", r"\(")
        with pytest.raises(ValueError, match=msg):
            si.expectation(model, "out", *args)
        with pytest.raises(ValueError, match=msg):
            attention(model, "out")(*args)
        return None
    if site is not None:
        assert ex.path == "exact" and ex.fallback.site == site, str(ex)
        if part is not None:
            assert ex.fallback.part == part, str(ex)
    try:
        ref = si.expectation(model, "out", *args)
    except ValueError as err:
        with pytest.raises(ValueError, match=str(err)[:40].replace("(", r"\(")):
            attention(model, "out")(*args)
        return ex
    np.testing.assert_allclose(attention(model, "out")(*args), ref, atol=1e-12)
    return ex


def test_scaled_or_masked_edge_falls_back(x64):
    q, k, V = _small()
    n, m = q.shape[0], k.shape[0]

    def scaled(q, k, V):
        with numpyro.plate("c", n):
            with numpyro.handlers.scale(scale=3.0):
                j = si.edge("phi", si.priors.Uniform(m), si.scores.Dot(q, k))
            numpyro.deterministic("out", V[j])

    def masked(q, k, V):
        with numpyro.plate("c", n):
            with numpyro.handlers.mask(mask=jnp.array([True, False, True])):
                j = si.edge("phi", si.priors.Uniform(m), si.scores.Dot(q, k))
            numpyro.deterministic("out", V[j])

    def unit_scale(q, k, V):
        with numpyro.plate("c", n):
            with numpyro.handlers.scale(scale=1.0):
                j = si.edge("phi", si.priors.Uniform(m), si.scores.Dot(q, k))
            numpyro.deterministic("out", V[j])

    ex = _same_as_exact(scaled, (q, k, V), "phi", "scale")
    assert ex is None or "scale" in str(ex)
    assert "mask" in str(_same_as_exact(masked, (q, k, V), "phi", "mask"))
    assert _same_as_exact(unit_scale, (q, k, V)).path == "lowered"
    # the lowering's own check (whatever the exact engine does with a scaled site)
    from structinfer.lowering._recognise import _check_unscaled, _Fail

    for sc in (3.0, jnp.array([1.0, 2.0, 1.0])):
        with pytest.raises(_Fail, match="scale"):
            _check_unscaled("phi", {"scale": sc, "mask": None, "fn": None})
    with pytest.raises(_Fail, match="mask"):
        _check_unscaled("phi.score", {"scale": None, "mask": jnp.ones(3, bool), "fn": None})
    _check_unscaled("phi", {"scale": 1.0, "mask": None, "fn": None})


def test_cast_to_int_is_not_separable(x64):
    q, k, V = _small(vscale=3.0)
    n, m = q.shape[0], k.shape[0]

    def model(q, k, V):
        with numpyro.plate("c", n):
            a = si.edge("a", si.priors.Uniform(m), si.scores.Dot(q, k))
            b = si.edge("b", si.priors.Uniform(m), si.scores.Dot(-q, k))
            numpyro.deterministic("out", (V[a] + V[b]).astype(jnp.int32).astype(V.dtype))

    assert "per-edge" in str(_same_as_exact(model, (q, k, V), "out", "value"))


def _loop_model(n, m, body, trips=2):
    def model(q, k, V):
        with numpyro.plate("c", n):
            a = si.edge("a", si.priors.Uniform(m), si.scores.Dot(q, k))
            b = si.edge("b", si.priors.Uniform(m), si.scores.Dot(-q, k))
            A, B = V[a], V[b]
            shp = jnp.broadcast_shapes(A.shape, B.shape)
            A, B, z = A + jnp.zeros(shp), B + jnp.zeros(shp), jnp.zeros(shp)
            out = jax.lax.fori_loop(0, trips, body, (A, B, z, z))[3]
            numpyro.deterministic("out", out)
    return model


def test_loop_bodies_are_analysed_to_a_fixed_point(x64):
    q, k, V = _small()
    n, m = q.shape[0], k.shape[0]

    def product(i, c):  # iteration 2 multiplies a copy of A (made in iteration 1) by B
        a_, b_, c_, d_ = c
        return (a_, b_, a_, d_ + c_ * b_)

    def summed(i, c):  # A + B accumulated: separable however many iterations
        a_, b_, c_, d_ = c
        return (a_, b_, a_, d_ + 0.5 * c_ + b_)

    _same_as_exact(_loop_model(n, m, product), (q, k, V), "out", "value")
    assert _same_as_exact(_loop_model(n, m, summed, trips=3), (q, k, V)).path == "lowered"


def test_value_mixing_children_is_not_reread_diagonally(x64):
    q, k, V = _small(n=5, m=5)

    def model(q, k, V):
        with numpyro.plate("c", 5):
            j = si.edge("phi", si.priors.Uniform(5), si.scores.Dot(q, k))
            Vj = V[j]
            numpyro.deterministic("out", Vj - Vj.mean(axis=-2, keepdims=True))

    _same_as_exact(model, (q, k, V))

    def closed(q_unused):  # concrete values: the diagonal table is checked, then rejected
        return model(q, k, V)

    ref = si.expectation(closed, "out", q)
    np.testing.assert_allclose(attention(closed, "out")(q), ref, atol=1e-12)


def test_relpos_lowering_uses_the_prior_lookup(x64):
    from structinfer.lowering._spec import relpos_weights

    r = np.random.default_rng(3)
    n, m = 6, 9
    d = jnp.arange(n)[:, None] + (m - n) - jnp.arange(m)[None, :]
    for prior in (si.priors.RelativePosition(r.normal(size=2 * m - 1), m, offset=m - n),
                  si.priors.RelativePosition(r.normal(size=7), m, max_distance=3),
                  si.priors.RelativePosition.circulant(r.normal(size=m))):
        low = lower_edge(prior, None, r.normal(size=(m, 2)), n)
        rp = low.terms.relpos
        np.testing.assert_array_equal(relpos_weights(rp, prior.bias, d),
                                      prior.distance_log_weights(d))
    short = si.priors.RelativePosition(r.normal(size=n + m - 1), m, offset=m - n)
    with pytest.raises(Exception, match="bias"):
        lower_edge(short, None, r.normal(size=(m, 2)), n)


def test_the_dense_backend_keeps_forward_mode_and_second_derivatives():
    """Forward mode and second derivatives of the dense backend work and equal the exact
    engine's; a row with no allowed parent (a traced mask, under ``jit``) is NaN and
    leaves the others alone, and a loss that drops it after a nonlinearity has the exact
    engine's gradient (the row's cotangent is zeroed where the NaN rows are written:
    passed through, the NaN made the values' gradient NaN)."""
    n, d = 6, 2
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(n, d))) for _ in range(3))

    def model(q, k, v, mask):
        with numpyro.plate("nodes", n):
            j = si.edge("phi", si.priors.Restricted(mask), si.scores.Dot(q, k, scale=0.7))
            numpyro.deterministic("out", v[j])

    dense, exact = attention(model, "out", "dense"), attention(model, "out", "exact")
    causal = np.tril(np.ones((n, n), bool))

    def loss(f):
        return lambda q: jnp.sum(jnp.sin(f(q, k, v, causal)))

    for fn in (jax.hessian, jax.jacfwd):
        np.testing.assert_allclose(fn(loss(dense))(q), fn(loss(exact))(q), atol=1e-5)
    empty = causal.copy()
    empty[3] = False  # child 3 has no allowed parent
    y = jax.jit(dense)(q, k, v, empty)
    assert np.isnan(np.asarray(y)).any(-1).tolist() == [i == 3 for i in range(n)]
    np.testing.assert_allclose(np.delete(np.asarray(y), 3, 0),
                               np.delete(np.asarray(exact(q, k, v, causal)), 3, 0), atol=1e-6)

    def kept(f, mask):  # the loss without row 3, after a nonlinearity
        return lambda q, v: jnp.sum(jnp.where(np.arange(n)[:, None] == 3, 0.0,
                                              jnp.sin(f(q, k, v, mask))))

    g = jax.jit(jax.grad(kept(dense, empty), (0, 1)))(q, v)
    ref = jax.grad(kept(exact, causal), (0, 1))(q, v)  # row 3 dropped: its mask is moot
    for a, b in zip(ref, g):
        np.testing.assert_allclose(b, a, atol=1e-5)


@pytest.mark.parametrize("backend", ["blocked", "pallas"])
def test_a_loss_that_drops_an_empty_row_has_the_dense_kernels_gradient(backend):
    """Regression: the blocked and Pallas kernels write the NaN of a row with no allowed
    parent inside their custom VJP, whose backward read that row's cotangent (NaN after
    a nonlinearity: ``0 * cos(NaN)``), so a loss that drops the row had NaN gradients in
    every key and value, where the dense kernel's (the ``where`` of `with_nan_rows`) are
    those of the model without the row. Now the row's cotangent is zeroed as the dense
    kernel's: the gradients are the exact engine's with the row given any parent."""
    n, d = 8, 2
    r = np.random.default_rng(1)
    q, k, v = (jnp.asarray(r.normal(size=(n, d)), jnp.float32) for _ in range(3))

    def model(q, k, v, mask):
        with numpyro.plate("nodes", n):
            j = si.edge("phi", si.priors.Restricted(mask), si.scores.Dot(q, k, scale=0.7))
            numpyro.deterministic("out", v[j])

    causal = np.tril(np.ones((n, n), bool))
    empty = causal.copy()
    empty[5] = False  # child 5 has no allowed parent
    drop = (np.arange(n) == 5)[:, None]

    def kept(f, mask):  # the loss without row 5, after a nonlinearity
        return lambda q, k, v: jnp.sum(jnp.where(drop, 0.0, jnp.sin(f(q, k, v, mask))))

    f = attention(model, "out", backend, block_q=4, block_k=4)
    want = jax.grad(kept(attention(model, "out", "exact"), causal), (0, 1, 2))(q, k, v)
    try:
        got = jax.jit(jax.grad(kept(f, empty), (0, 1, 2)))(q, k, v)
    except NotLowerableError as err:  # Pallas (interpreted) needs its Triton backend
        assert backend == "pallas" and "Triton backend" in str(err), str(err)
        pytest.skip(str(err))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5)


#: by default the uniform prior with five children and the geometric with one (a 1 x 1
#: problem on the windowed kernel too); the rest in the exhaustive tier
@pytest.mark.parametrize("prior, n", matrix(
    [(p, n) for p in ("uniform", "relpos", "geometric") for n in (1, 5)],
    keep=lambda prior, n: (prior, n) in (("uniform", 5), ("geometric", 1)),
    ids=[f"{p}-{n}" for p in ("uniform", "relpos", "geometric") for n in (1, 5)]))
def test_a_single_parent_is_lowered_on_every_kernel(n, prior):
    """One parent (m = 1): every child takes it, ``y_i = v_0``; the model is lowered (a
    probe over one parent cannot show the value depending on the edge, and needs not) and
    each kernel gives the exact engine's value and gradient."""
    xq, xk, v = _feats(21, np.float32, n=n, m=1)
    make = {"uniform": lambda n, m: si.priors.Uniform(m),
            "relpos": lambda n, m: si.priors.RelativePosition(np.linspace(-1, 1, n + m - 1,
                                                                          dtype=np.float32), m),
            "geometric": lambda n, m: si.priors.Geometric(np.float32(0.3), m, max_distance=n)}
    model = _simple(make[prior], lambda a, b: si.scores.Dot(a, b))
    ex = explain(model, "out", xq, xk, v)
    assert ex.path == "lowered", str(ex)
    exact = attention(model, "out", "exact")
    want = np.broadcast_to(v[0], (n, DV))
    # a value that does not read the edge still falls back (the exact engine refuses it)
    const = _simple(make[prior], lambda a, b: si.scores.Dot(a, b),
                    value_fn=lambda j, xq, v: jnp.broadcast_to(v[0], (n, DV)))
    assert explain(const, "out", xq, xk, v).path == "exact"
    np.testing.assert_allclose(exact(xq, xk, v), want, atol=1e-6)
    kernels = ["auto", "dense", "blocked", "pallas"] + (["windowed"] if prior == "geometric"
                                                        else [])
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
    g_exact = jax.grad(loss(exact), (0, 1, 2))(xq, xk, v)
    for backend in kernels:
        f = attention(model, "out", backend, block_q=4, block_k=8)
        try:
            y = f(xq, xk, v)
        except NotLowerableError as err:  # Pallas (interpreted) needs its Triton backend
            assert backend == "pallas" and "Triton backend" in str(err), str(err)
            continue
        np.testing.assert_allclose(y, want, atol=1e-6, err_msg=backend)
        g = jax.grad(loss(f), (0, 1, 2))(xq, xk, v)
        for a, b in zip(g, g_exact):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=backend)


@pytest.mark.parametrize("arg", ["block_q", "block_k"])
@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "8"])
def test_block_sizes_are_checked(arg, bad):
    model = _simple(lambda n, m: si.priors.Uniform(m), lambda a, b: si.scores.Dot(a, b))
    with pytest.raises(ValueError, match=f"{arg} must be a positive integer.*got {bad!r}"):
        attention(model, "out", "blocked", **{arg: bad})


def test_forward_mode_through_a_fused_kernel_names_the_site_and_the_way_out():
    """The fused kernels' gradients are custom VJPs (reverse mode): ``jax.jvp`` through
    one raises naming the edge site, the kernel and the backends with forward mode."""
    xq, xk, v = _feats(22, np.float32)
    model = _simple(lambda n, m: si.priors.Restricted.causal(n, m, offset=m - n),
                    lambda a, b: si.scores.Dot(a, b))
    f = attention(model, "out", "blocked", block_q=4, block_k=8)
    with pytest.raises(TypeError, match=r"edge site 'phi' runs on the blocked kernel.*"
                       r"reverse mode.*'dense', 'windowed' or 'exact'"):
        jax.jvp(lambda q: f(q, xk, v), (xq,), (xq,))
    auto = attention(model, "out")  # small: the dense kernel, forward mode works
    jax.jvp(lambda q: auto(q, xk, v), (xq,), (xq,))
    geo = _simple(lambda n, m: si.priors.Geometric(0.3, m, offset=m - n, max_distance=4),
                  lambda a, b: si.scores.Dot(a, b))
    windowed = attention(geo, "out", "windowed")  # plain JAX too
    y, t = jax.jvp(lambda q: windowed(q, xk, v), (xq,), (xq,))
    y_ref, t_ref = jax.jvp(lambda q: attention(geo, "out", "exact")(q, xk, v), (xq,), (xq,))
    np.testing.assert_allclose(t, t_ref, atol=2e-5)


def test_second_derivatives_run_on_the_blocked_kernel_and_the_fused_passes_say_so(x64):
    """Forward mode over the gradient (``jax.hessian``): the blocked kernel's backward is
    plain JAX, so it gives the exact engine's Hessian; the Pallas kernel's passes have no
    derivative of their own, and say so with the backends that have one."""
    n = 9
    r = np.random.default_rng(23)
    q, k, v = (jnp.asarray(r.normal(size=(n, 3))) for _ in range(3))
    model = _simple(lambda n, m: si.priors.Restricted.causal(n, m),
                    lambda a, b: si.scores.Dot(a, b))

    def loss(backend):
        f = attention(model, "out", backend, block_q=4, block_k=4)
        return lambda q: jnp.sum(jnp.sin(f(q, k, v)))

    t = jnp.asarray(r.normal(size=q.shape))  # a Hessian-vector product: forward over reverse

    def hvp(backend):
        return jax.jvp(jax.grad(loss(backend)), (q,), (t,))[1]

    try:
        np.testing.assert_allclose(hvp("blocked"), hvp("exact"), atol=1e-10)
        np.testing.assert_allclose(jax.hessian(loss("blocked"))(q),
                                   jax.hessian(loss("exact"))(q), atol=1e-10)
    except NotImplementedError as err:  # an old JAX (the floor's 0.4.33): the kernel's
        # loop barrier has no derivative or batching rule there
        assert "optimization_barrier" in str(err) and jax.__version_info__ < (0, 10), err
    try:
        jax.grad(loss("pallas"))(q)
    except NotLowerableError as err:  # Pallas (interpreted) needs its Triton backend
        pytest.skip(str(err))
    with pytest.raises(TypeError, match="derivative of a gradient.*'blocked'"):
        jax.hessian(loss("pallas"))(q)


def test_numpy_integer_arguments_are_static_like_ints():
    """Regression: a NumPy integer argument (a size read from a config array) was traced,
    so a model using it as a window size failed in `attention` and `explain` while the
    exact engine ran it. It is static, like a Python int: the same answer, one compile
    per value."""
    n, d = 8, 4
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(n, d)), jnp.float32) for _ in range(3))

    def model(q, k, v, w):
        with numpyro.plate("q", n):
            j = si.edge("phi", si.priors.Restricted.window(n, w), si.scores.Dot(q, k))
            numpyro.deterministic("out", v[j])

    want = si.expectation(model, "out", q, k, v, 3)
    f = attention(model, "out")
    for w in (3, np.int64(3), np.int32(3)):
        np.testing.assert_allclose(f(q, k, v, w), want, rtol=1e-6, atol=1e-6)
        assert explain(model, "out", q, k, v, w).path == "lowered"


@pytest.mark.parametrize("c", [1e5, 3e7])
def test_dense_weights_sum_to_one_at_large_logits(c):
    """The dense kernel's weights are normalised by their own sum: with every score -c
    in float32 (the row log-normaliser rounded to the ulp of c, about 0.008 at 1e5 and
    2 at 3e7) the expectation of a constant value is that constant, as the exact engine
    and the blocked kernel give (it was off by 0.3% at 1e5 and by 2x at 3e7). ``auto``
    takes the dense kernel at this size on a CPU."""
    n = 4

    def model(q, k, v):
        with numpyro.plate("children", n):
            j = si.edge("phi", si.priors.Restricted.causal(n), si.scores.Dot(q, k))
            numpyro.deterministic("out", v[j])

    q = jnp.full((n, 1), -c, jnp.float32)
    k = jnp.ones((n, 1), jnp.float32)
    v = jnp.ones((n, 1), jnp.float32)
    for backend in ("dense", "auto"):
        y = si.attention(model, "out", backend=backend)(q, k, v)
        np.testing.assert_allclose(np.asarray(y), 1.0, rtol=1e-6, err_msg=backend)
    # its log-normaliser is still the row's: -c + log(i + 1)
    low = lower_edge(si.priors.Restricted.causal(n), si.scores.Dot(q, k), v, n, ())
    _, lse = dense_attention(low.terms, low.problem, ())
    np.testing.assert_allclose(np.asarray(lse, np.float64), -c + np.log(np.arange(1, n + 1)),
                               rtol=1e-7)
