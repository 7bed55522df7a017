"""Block-sparse priors kept per block: `Restricted.block_sparse` and the lowering's
`BlockMask`.

* `tile_grid` on a `BlockMask` against the same reduction of its expanded ``(n, m)``
  mask (the independent reference: NumPy on the dense mask), every combination of
  block and tile sizes that do and do not line up, with batch dims and padding.
* The prior: its mask, table and errors against a `Restricted` prior of the expanded
  mask; a traced block mask.
* The model path: the Pallas kernel (interpreted) and the blocked kernel against the
  exact engine, values and gradients, float32 and bfloat16, eager and under ``jit``,
  one block mask per head, blocks that line up with the tiles and blocks that do not,
  the block mask known at trace time and traced; which operands each Pallas pass reads.
* Trace-time memory: a block-sparse model at n = 32768 is traced for the Pallas kernel
  with no ``(n, m)`` array on the host.
"""

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import eqns_named, matrix, numpyro_provenance_works
from numpyro.ops.indexing import Vindex

import structinfer as si
from structinfer.lowering import BlockMask, explain
from structinfer.lowering._masks import mask_and, mask_key, mask_shape, tile_grid

H = 2


def _blocks(shape, seed=0, p=0.4):
    r = np.random.default_rng(seed)
    b = r.random(shape) < p
    b[..., :, 0] = True  # every child block has a parent block
    return b


def _dense(blocks, bc, bp):
    return np.kron(blocks, np.ones((bc, bp), bool))


@pytest.mark.parametrize("bc,bp", [(16, 16), (48, 32), (64, 128), (24, 40), (128, 64)])
@pytest.mark.parametrize("bq,bk", [(16, 16), (64, 32), (128, 64)])
@pytest.mark.parametrize("batch,cut", [((), 0), ((3,), 0), ((), 5)])
def test_tile_grid_of_a_block_mask_equals_that_of_its_expansion(bc, bp, bq, bk, batch, cut):
    """``cut``: the last block of each axis that many edges short."""
    blocks = _blocks(batch + (5, 4), seed=bc + bp + bq, p=0.5)
    n, m = 5 * bc - cut, 4 * bp - cut
    nqb, nkb = -(-n // bq), -(-m // bk)
    bm = BlockMask(blocks, (bc, bp), (n, m) if cut else None)
    dense = _dense(blocks, bc, bp)[..., :n, :m]
    assert mask_shape(bm) == dense.shape
    flat = dense.reshape((-1, n, m))
    for reduce, over in ((np.any, np.any), (np.all, np.all), (np.all, np.any)):
        got = tile_grid(bm, n, m, bq, bk, nqb, nkb, reduce=reduce, over_batch=over)
        np.testing.assert_array_equal(
            got, tile_grid(dense, n, m, bq, bk, nqb, nkb, reduce=reduce, over_batch=over))
        # brute force: each tile's edges before n and m
        for a in range(nqb):
            for b in range(nkb):
                tile = over(flat, axis=0)[a * bq:(a + 1) * bq, b * bk:(b + 1) * bk]
                assert got[a, b] == reduce(tile), (reduce, a, b)


def test_mask_and_and_key():
    b1, b2 = _blocks((4, 4), 1), _blocks((4, 4), 2)
    one, two = BlockMask(b1, (8, 8)), BlockMask(b2, (8, 8))
    both = mask_and(one, two)
    assert isinstance(both, BlockMask) and both.block_size == (8, 8)
    np.testing.assert_array_equal(both.dense(), one.dense() & two.dense())
    # other block sizes and plain masks: a plain mask
    other = BlockMask(_blocks((8, 2), 3), (4, 16))
    np.testing.assert_array_equal(mask_and(one, other), one.dense() & other.dense())
    plain = np.random.default_rng(0).random((32, 32)) < 0.5
    np.testing.assert_array_equal(mask_and(one, plain), one.dense() & plain)
    assert mask_and(None, one) is one
    # batch dims and a cut last block
    cut1 = BlockMask(_blocks((3, 4, 4), 4), (8, 8), (30, 27))
    cut2 = BlockMask(_blocks((4, 4), 5), (8, 8), (30, 27))
    both = mask_and(cut1, cut2)
    assert isinstance(both, BlockMask) and both.shape == (3, 30, 27)
    np.testing.assert_array_equal(both.dense(), cut1.dense() & cut2.dense())
    np.testing.assert_array_equal(mask_and(cut1, one.dense()[:30, :27]),
                                  cut1.dense() & one.dense()[:30, :27])
    # equal contents, equal keys; block size and contents both count
    assert mask_key(BlockMask(b1.copy(), (8, 8))) == mask_key(one)
    assert mask_key(two) != mask_key(one)
    assert mask_key(BlockMask(b1, (8, 4))) != mask_key(one)
    assert mask_key(one) != mask_key(one.dense())


def test_a_block_mask_is_checked_and_is_not_an_array():
    """Code written for a NumPy mask fails loudly on a BlockMask (it would read one
    ``True``: every edge allowed); bad fields are named."""
    bm = BlockMask(_blocks((4, 4)), (8, 8))
    with pytest.raises(TypeError, match=r"not an array: call its \.dense\(\)"):
        np.asarray(bm, bool)
    with pytest.raises(TypeError, match="ambiguous"):
        bool(bm)
    with pytest.raises(ValueError, match="at least two dims"):
        BlockMask(np.ones(4, bool), (8, 8))
    with pytest.raises(ValueError, match="two positive ints"):
        BlockMask(np.ones((4, 4), bool), (8, 0))
    with pytest.raises(ValueError, match="size n=40 does not end in the last of 4 blocks"):
        BlockMask(np.ones((4, 4), bool), (8, 8), (40, 32))
    with pytest.raises(TypeError, match="known at trace time"):
        jax.jit(lambda b: BlockMask(b, (8, 8)).shape)(jnp.ones((4, 4), bool))
    with pytest.raises(ValueError, match=r"BlockMask of shape \(32, 32\), expected"):
        tile_grid(bm, 30, 32, 16, 16, 2, 2, reduce=np.any, over_batch=np.any)


def test_block_sparse_prior_keeps_the_blocks():
    blocks = _blocks((H, 6, 5), 4)
    prior = si.priors.Restricted.block_sparse(blocks, (8, 16))
    dense = _dense(blocks, 8, 16)
    assert prior.num_parents == 80 and prior.pattern.block_size == (8, 16)
    np.testing.assert_array_equal(prior.concrete_blocks, blocks)
    np.testing.assert_array_equal(prior.concrete_mask, dense)
    np.testing.assert_array_equal(prior.mask, dense)
    plain = si.priors.Restricted(dense)
    np.testing.assert_array_equal(prior.log_table(48), plain.log_table(48))
    assert prior.describe()["block_size"] == (8, 16)
    # 0/1 blocks read as booleans
    ints = si.priors.Restricted.block_sparse(blocks.astype(np.int32), 8)
    np.testing.assert_array_equal(ints.mask, _dense(blocks, 8, 8))
    # traced: no concrete value, the same table
    table = jax.jit(lambda b: si.priors.Restricted.block_sparse(b, (8, 16)).log_table(48))(
        jnp.asarray(blocks))
    np.testing.assert_array_equal(table, plain.log_table(48))


def test_block_sparse_prior_errors():
    blocks = np.ones((4, 4), bool)
    blocks[2] = False
    with pytest.raises(ValueError, match="allows no parent for child 16"):
        si.priors.Restricted.block_sparse(blocks, 8).log_table(32)
    with pytest.raises(ValueError, match=r"block_mask must have shape .*got shape \(4,\)"):
        si.priors.Restricted.block_sparse(np.ones(4, bool), 8)
    with pytest.raises(ValueError, match="block_size"):
        si.priors.Restricted.block_sparse(np.ones((4, 4), bool), 0)
    with pytest.raises(ValueError, match=r"num_parents=24 does not end in the last of the "
                                         r"4 blocks of 8 \(expected 25 to 32\)"):
        si.priors.Restricted.block_sparse(np.ones((4, 4), bool), 8, 30, 24)


def test_block_sparse_prior_with_a_short_last_block():
    """A length that is not a multiple of the block size: the last block is cut."""
    blocks = _blocks((H, 4, 3), 6)
    prior = si.priors.Restricted.block_sparse(blocks, (8, 16), num_children=27,
                                              num_parents=40)
    dense = _dense(blocks, 8, 16)[..., :27, :40]
    assert prior.num_parents == 40 and prior.size == (27, 40)
    np.testing.assert_array_equal(prior.mask, dense)
    np.testing.assert_array_equal(prior.concrete_mask, dense)
    np.testing.assert_array_equal(prior.log_table(27), si.priors.Restricted(dense).log_table(27))


def _model(n, bc, bp, known=None):
    """The model; its block mask is ``known`` (closed over: known at trace time) or its
    last argument (traced)."""

    def model(q, k, v, *arg):
        prior = si.priors.Restricted.block_sparse(known if known is not None else arg[0],
                                                  (bc, bp), n, n)
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("nodes", n, dim=-1):
            j = si.edge("phi", prior, si.scores.Dot(q, k, scale=0.3))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    return model


def _inputs(n, dtype, seed=0):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.normal(size=(H, n, 8)), dtype) for _ in range(3))


#: (n, block size, one mask per head, int8 mask read by the Pallas passes): blocks of 32
#: line up with the tiles the kernel fits to them (at n = 200 the last block is cut
#: short); blocks of 48 x 16 and 24 x 40 are not fitted (no power of two of at least 32
#: divides 48, 16 or 24); masks that differ by head leave some tiles allowed in one head
#: only, which read the mask
CASES = [(256, (32, 32), False, False), (200, (32, 32), False, False),
         (256, (64, 128), True, True), (200, (32, 32), True, True),
         (240, (48, 16), False, True), (240, (24, 40), True, True)]


#: by default, on each kernel, a cut last block of one shared mask and unfitted blocks
#: that differ by head (the int8 mask read); on the Pallas kernel also fitted tiles that
#: differ by head; the other cases in the exhaustive tier
BLOCKED_DEFAULT = {CASES[1], CASES[5]}
PALLAS_DEFAULT = {CASES[1], CASES[2], CASES[5]}


@pytest.mark.parametrize("backend, n, bs, per_head, reads_mask", matrix(
    [(b, *c) for b in ("pallas", "blocked") for c in CASES],
    keep=lambda b, *c: c in (PALLAS_DEFAULT if b == "pallas" else BLOCKED_DEFAULT),
    ids=[f"{b}-{n}-bs{i}-{p}-{r}" for b in ("pallas", "blocked")
         for i, (n, _, p, r) in enumerate(CASES)]))
def test_block_sparse_model_against_the_exact_engine(n, bs, per_head, reads_mask, backend):
    bc, bp = bs
    blocks = _blocks(((H,) if per_head else ()) + (-(-n // bc), -(-n // bp)), seed=n + bc)
    if per_head:  # the heads' masks differ
        blocks[1, 0, -1] = not blocks[0, 0, -1]
    known, traced = _model(n, bc, bp, blocks), _model(n, bc, bp)
    f, g = si.attention(known, "out", backend), si.attention(traced, "out", backend)
    exact = si.attention(known, "out", "exact")
    for model, note in ((known, f"blocks of {bc} x {bp}; empty blocks skipped"),
                        (traced, "traced: no block skipping")):
        ex = explain(model, "out", *_inputs(n, jnp.float32), blocks, backend=backend)
        assert ex.kernels == {"phi": backend} and note in str(ex), str(ex)
    for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)):
        q, k, v = _inputs(n, dtype)
        ref = exact(*(x.astype(jnp.float32) for x in (q, k, v)))
        for y in (f(q, k, v), jax.jit(f)(q, k, v), jax.jit(g)(q, k, v, blocks)):
            assert y.dtype == dtype
            np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=tol, rtol=tol)
    q, k, v = _inputs(n, jnp.float32)

    def loss(h, *b):
        return lambda q, k, v: jnp.sum(jnp.sin(h(q, k, v, *b)))

    g0 = jax.grad(loss(exact), (0, 1, 2))(q, k, v)
    for g1 in (jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v),
               jax.jit(jax.grad(loss(g, blocks), (0, 1, 2)))(q, k, v)):
        for a, c in zip(g0, g1):
            np.testing.assert_allclose(c, a, atol=5e-5)
    if backend == "pallas":  # each pass reads its block table; the mask only when needed
        eqns = eqns_named(jax.make_jaxpr(jax.grad(loss(f)))(q, k, v).jaxpr, "pallas_call")
        assert len(eqns) == 3, eqns  # forward, dK/dV, dQ
        for call in eqns:
            dtypes = [x.aval.dtype for x in call.invars]
            assert (jnp.dtype(jnp.int8) in dtypes) == reads_mask
            assert jnp.dtype(jnp.int32) in dtypes


@pytest.mark.parametrize("backend", ["pallas", "blocked"])
def test_block_sparse_model_in_float64(x64, backend):
    """float64 inputs through a block mask (known at trace time, one per head, blocks
    that straddle the tiles): float64 out, equal to the exact engine to 1e-12, values and
    gradients."""
    n, bc, bp = 96, 24, 32
    blocks = _blocks((H, n // bc, n // bp), seed=9)
    blocks[1, 0, -1] = not blocks[0, 0, -1]
    f = si.attention(_model(n, bc, bp, blocks), "out", backend)
    exact = si.attention(_model(n, bc, bp, blocks), "out", "exact")
    q, k, v = _inputs(n, jnp.float64)
    y = jax.jit(f)(q, k, v)
    assert y.dtype == jnp.float64
    np.testing.assert_allclose(y, exact(q, k, v), atol=1e-12)

    def loss(h):
        return lambda q, k, v: jnp.sum(jnp.sin(h(q, k, v)))

    for a, c in zip(jax.grad(loss(exact), (0, 1, 2))(q, k, v),
                    jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v)):
        np.testing.assert_allclose(c, a, atol=1e-12)


def test_sparse_attention_mechanism_keeps_the_blocks():
    """The catalogue's sparse attention builds its prior per block (and still names a
    block mask of the wrong size)."""
    from structinfer.mechanisms import graph

    n, b = 64, 16
    blocks = _blocks((4, 4), 7)
    r = np.random.default_rng(0)
    x, w = r.normal(size=(n, 8)), r.normal(size=(8, 8))
    tr = numpyro.handlers.trace(numpyro.handlers.seed(graph.sparse_attention, 0)).get_trace(
        x, w, w, None, block_mask=blocks, block_size=b)
    prior = tr["phi"]["infer"][si.primitives.EDGE_INFO_KEY].prior
    assert prior.blocks is not None
    np.testing.assert_array_equal(prior.mask, _dense(blocks, b, b))
    with pytest.raises(ValueError, match=r"block_mask \(4, 4\) x block_size 8 gives a "
                                         r"\(32, 32\) pattern, expected \(64, 64\)"):
        graph.sparse_attention(x, w, w, None, block_mask=blocks, block_size=8)


def test_a_one_row_block_mask_takes_the_exact_engine():
    """One block row of one child, broadcast over the children plate by the exact
    engine: not lowered (the kernels read a block mask of the plate's children), and
    explain says why."""
    n = 16
    blocks = np.array([[True, False, True, True]])

    def model(q, k, v):
        prior = si.priors.Restricted.block_sparse(blocks, (1, 4))
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("nodes", n, dim=-1):
            j = si.edge("phi", prior, si.scores.Dot(q, k, scale=0.3))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    q, k, v = _inputs(n, jnp.float32)
    ex = explain(model, "out", q, k, v)
    assert ex.path == "exact" and "covers 1 children, the children plate has 16" in str(ex)
    y = si.attention(model, "out")(q, k, v)
    np.testing.assert_allclose(y, si.attention(model, "out", "exact")(q, k, v))


@pytest.mark.parametrize("n", [32768, 32767])
def test_tracing_a_long_block_sparse_model_allocates_no_n_by_m_array(n):
    """Regression: at n = 32768 the prior held the expanded (n, n) mask (1 GiB of
    booleans) and the lowering reduced it over tiles on the host (about 9 s of tracing);
    now the host's largest allocations are linear in n, with the last block cut short
    too (n = 32767)."""
    b = 128
    nb = -(-n // b)
    blocks = np.abs(np.arange(nb)[:, None] - np.arange(nb)[None, :]) <= 1
    blocks[:, 0] = True

    def model(q, k, v):
        prior = si.priors.Restricted.block_sparse(blocks, b, n, n)
        with numpyro.plate("heads", 1, dim=-2), numpyro.plate("nodes", n, dim=-1):
            j = si.edge("phi", prior, si.scores.Dot(q, k, scale=0.25))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    f = si.attention(model, "out", "pallas")
    x = jax.ShapeDtypeStruct((1, n, 16), jnp.bfloat16)
    tracemalloc.start()
    try:
        jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)))).trace(
            x, x, x)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**27, peak  # the (n, n) booleans alone are 2**30 bytes


def test_the_blocked_kernel_reads_a_block_mask_per_block():
    """Regression: the blocked kernel sliced each block's mask out of the ``(n, m)`` mask,
    which XLA then held in memory (n * m bytes: 17.6 MB of the forward's 17.6 MB of
    temporaries at n = 4096); it now reads the block mask at each block's indices
    (0.9 MB forward, 1.9 MB with the gradient)."""
    n, b = 4096, 128
    nb = n // b
    blocks = np.abs(np.arange(nb)[:, None] - np.arange(nb)[None, :]) <= 1

    def model(q, k, v):
        with numpyro.plate("heads", 1, dim=-2), numpyro.plate("nodes", n, dim=-1):
            j = si.edge("phi", si.priors.Restricted.block_sparse(blocks, b),
                        si.scores.Dot(q, k, scale=0.25))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    f = si.attention(model, "out", "blocked")
    x = jax.ShapeDtypeStruct((1, n, 8), jnp.float32)
    for g in (f, jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), (0, 1, 2))):
        ma = jax.jit(g).lower(x, x, x).compile().memory_analysis()
        if ma is None:
            pytest.skip("this JAX reports no memory analysis")
        assert ma.temp_size_in_bytes < n * n // 4, ma.temp_size_in_bytes


def test_blocked_attention_reads_a_given_block_mask_only_for_skipping():
    """``blocked_attention``'s ``mask`` need only bound the per-edge mask (OR over the
    batch allows every allowed edge, AND only allowed ones): a BlockMask that does so
    without being it (the heads' masks swapped) skips blocks but is never read as the
    mask. Only the kernel table's blocked entry, given a site's whole mask, reads it per
    block (`mask_per_block`)."""
    from structinfer.lowering._lower import lower_edge
    from structinfer.lowering.blocked import blocked_attention, mask_per_block
    from structinfer.lowering.dense import dense_attention

    n = 32
    blocks = _blocks((H, 4, 4), 8)
    blocks[1, 0, -1] = not blocks[0, 0, -1]
    q, k, v = _inputs(n, jnp.float32)
    low = lower_edge(si.priors.Restricted.block_sparse(blocks, 8), si.scores.Dot(q, k), v,
                     n, (H,))
    ref, _ = dense_attention(low.terms, low.problem, (H,))
    swapped = BlockMask(blocks[::-1], (8, 8))
    y, _ = blocked_attention(low.terms, low.problem, (H,), block_q=8, block_k=8, mask=swapped)
    np.testing.assert_allclose(y, ref, atol=1e-6)
    terms, prob = mask_per_block(low.terms, low.problem, (H,), low.mask)
    assert terms.mask_blocks == (8, 8) and prob.const.pair_ok is None
    y, _ = blocked_attention(terms, prob, (H,), block_q=8, block_k=8, mask=low.mask)
    np.testing.assert_allclose(y, ref, atol=1e-6)
    # a shard's arrays (one head) with the whole batch's mask: unchanged
    assert mask_per_block(low.terms, low.problem, (1,), low.mask)[0] is low.terms


def test_a_one_row_block_mask_from_a_rule_is_a_column_mask():
    """A prior rule that restricts with a one-row mask gives its BlockMask: kept as the
    (one-row, O(m)) column mask it is."""
    from structinfer.lowering import TermBuilder

    terms = TermBuilder(16, 16)
    row = np.array([[True, False]])
    terms.restrict_pairs(jnp.asarray(np.repeat(row, 8, -1)), BlockMask(row, (1, 8)))
    np.testing.assert_array_equal(terms._mask, np.repeat(row, 8, -1))


def test_numpyros_tools_on_a_block_sparse_model(x64):
    """NumPyro's own tools on a model whose edge has a block-sparse prior with a cut last
    block: TraceEnum_ELBO's loss with an empty guide is minus the log marginal computed by
    hand from the expanded mask (and equals ``si.log_marginal``), and Predictive draws
    only allowed parents."""
    import numpyro.distributions as dist
    from numpyro.infer import Predictive, TraceEnum_ELBO

    n, b = 10, 4
    blocks = np.array([[True, False, False], [True, True, False], [False, True, True]])
    prior = si.priors.Restricted.block_sparse(blocks, b, n, n)
    mask = _dense(blocks, b, b)[:n, :n]
    r = np.random.default_rng(3)
    x, y = r.normal(size=(n, 2)), r.normal(size=n)
    v = r.normal(size=n)

    def model(x, y=None):
        with numpyro.plate("nodes", n):
            j = si.edge("phi", prior, si.scores.Dot(x, x, scale=0.5))
            numpyro.sample("y", dist.Normal(jnp.asarray(v)[j], 0.5), obs=y)

    # the prior (uniform on the allowed parents) times the score's potential and the
    # likelihood, summed over each child's parents
    log_prior = np.where(mask, -np.log(mask.sum(1, keepdims=True)), -np.inf)
    lik = -0.5 * ((y[:, None] - v[None]) / 0.5) ** 2 - np.log(0.5 * np.sqrt(2 * np.pi))
    want = np.log(np.exp(log_prior + 0.5 * x @ x.T + lik).sum(1)).sum()
    np.testing.assert_allclose(si.log_marginal(model, x, y), want, rtol=1e-10)
    if numpyro_provenance_works():  # else TraceEnum_ELBO fails (upstream; see conftest)
        loss = TraceEnum_ELBO().loss(jax.random.key(0), {}, model, lambda x, y=None: None,
                                     x, y)
        np.testing.assert_allclose(-loss, want, rtol=1e-10)
    draws = Predictive(model, num_samples=50)(jax.random.key(1), x)["phi"]
    assert mask[np.arange(n), np.asarray(draws)].all()
