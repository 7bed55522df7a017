"""Dtypes and numerics of `structinfer.attention` and `structinfer.nn.Attention`.

* Output dtype: every kernel (dense, blocked, windowed, Pallas interpreted, the exact
  engine) answers in the value's dtype: bfloat16 in, bfloat16 out, also when the prior
  holds float32 parameters (a Python-float geometric ``q``, a float32 relative-position
  table); float32 in under x64, float32 out (never the default float).
* Accumulation: bfloat16 inputs are multiplied in bfloat16 and accumulated in float32
  (logits, running max, exp-sum, the p·v product), as flash-attention kernels do: the
  error against a float64 softmax of the same rounded inputs is the one of a bfloat16
  answer, not of a bfloat16 softmax.
* cuDNN is still chosen (GPU dispatch faked on this CPU) for a bfloat16 model whose prior
  has float32 parameters: the prior's terms do not promote the queries, keys and values.
* Precision: ``precision=`` reaches every matmul of the kernels (forward and the blocked
  kernel's backward), and ``precision=None`` follows ``jax.default_matmul_precision``.
"""

import contextlib
import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import float64, matrix, on_hopper
from jax.extend.core import jaxprs_in_params
from numpyro.contrib.control_flow import scan
from numpyro.ops.indexing import Vindex

import structinfer as si
import structinfer.nn as sinn
from structinfer.lowering import explain

pytestmark = pytest.mark.gpu  # the GPU subset: pytest -m gpu

H = 2
BF16 = jnp.bfloat16


def _model(prior_fn, n, m=None, scale=0.25):
    m = n if m is None else m

    def model(q, k, v, e=None):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", prior_fn(n, m, e), si.scores.Dot(q, k, scale=scale))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    return model


PRIORS = {  # prior(n, m, extra); extra: a float32 table where the prior takes one
    "causal": lambda n, m, e: si.priors.Restricted.causal(n),
    "geometric_float_q": lambda n, m, e: si.priors.Geometric(0.1, n, max_distance=9),
    "relpos_f32": lambda n, m, e: si.priors.RelativePosition(e, n, causal=True),
}


def _inputs(dtype, n, d=8, seed=0):
    r = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(r.normal(size=(H, n, d)), dtype) for _ in range(3))
    e = jnp.asarray(0.3 * r.normal(size=(H, 2 * n - 1)), jnp.float32)
    return q, k, v, e


#: (backend, prior) run by default: every backend once, every prior at least twice
BF16_REPRESENTATIVES = {("auto", "relpos_f32"), ("exact", "causal"), ("dense", "relpos_f32"),
                        ("blocked", "geometric_float_q"), ("windowed", "geometric_float_q"),
                        ("pallas", "causal")}


@pytest.mark.parametrize("backend, prior", matrix(
    [(b, p) for b in ["auto", "exact", "dense", "blocked", "windowed", "pallas"] for p in PRIORS],
    keep=lambda backend, prior: (backend, prior) in BF16_REPRESENTATIVES))
def test_bfloat16_in_bfloat16_out(prior, backend):
    if backend == "windowed" and prior != "geometric_float_q":
        pytest.skip("the windowed kernel needs a finite distance band")
    n = 24
    model = _model(PRIORS[prior], n)
    q, k, v, e = _inputs(BF16, n)
    f = si.attention(model, "out", backend, block_q=16, block_k=16)
    y = f(q, k, v, e)
    assert y.dtype == BF16, (backend, prior, y.dtype)
    # the same number as the exact engine on float32 copies, to bfloat16's precision
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    # the reference and the gradient as one program each (the exact engine runs eagerly
    # in test_exact_engine_answers_in_the_value_dtype)
    ref = jax.jit(lambda *a: si.expectation(model, "out", *a))(*up, e)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=2e-2)
    # gradients come back in the inputs' dtypes
    g = jax.jit(jax.grad(lambda q, v, e: jnp.sum(f(q, k, v, e).astype(jnp.float32)),
                         argnums=(0, 1, 2)))(q, v, e)
    assert [x.dtype for x in g] == [BF16, BF16, jnp.float32]
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in g)


def test_accum_dtype_is_one_public_rule():
    """float32 for half and single precision, float64 for double; the layer's
    hyperparameters follow the same rule (one definition, `lowering.accum_dtype`)."""
    import structinfer.nn.layer as layer_module
    from structinfer.lowering import accum_dtype

    assert [accum_dtype(t) for t in (BF16, jnp.float16, jnp.float32, jnp.float64)] == [
        jnp.float32, jnp.float32, jnp.float32, jnp.float64]
    assert layer_module.accum_dtype is accum_dtype


def test_exact_engine_answers_in_the_value_dtype():
    n = 11
    model = _model(PRIORS["geometric_float_q"], n)
    q, k, v, _ = _inputs(BF16, n)
    assert si.expectation(model, "out", q, k, v).dtype == BF16


@pytest.mark.parametrize("backend, prior", matrix(  # each backend and each prior once
    [(b, p) for b in ["dense", "blocked"] for p in ["causal", "relpos_f32"]],
    keep=lambda backend, prior: (backend, prior) in {("dense", "relpos_f32"), ("blocked", "causal")}))
def test_integer_value_table_answers_in_the_exact_engines_dtype(prior, backend):
    """An integer value table (token ids, counts) is averaged in the dtype of the model's
    log-density, as the exact engine answers it: float32 for a float32 model under x64,
    and float32 for a bfloat16 one (whose score tables the engine keeps in float32)."""
    n = 24
    model = _model(PRIORS[prior], n)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 50, (H, n, 3)), jnp.int32)
    for dtype, x64 in ((jnp.float32, True), (BF16, False)):
        with float64() if x64 else contextlib.nullcontext():
            q, k, _, e = _inputs(dtype, n)
            want = jax.jit(lambda *a: si.expectation(model, "out", *a))(q, k, ids, e)
            assert want.dtype == jnp.float32
            f = si.attention(model, "out", backend, block_q=16, block_k=16)
            for y in (f(q, k, ids, e), jax.jit(f)(q, k, ids, e)):
                assert y.dtype == want.dtype, (backend, y.dtype)
                np.testing.assert_allclose(np.asarray(y, np.float32),
                                           np.asarray(want, np.float32), rtol=2e-2)


MIXED_SCORES = {  # features (heads, n, d), scale s -> a score the kernels lower to a matmul
    "Dot": lambda q, k, s: si.scores.Dot(q, k, scale=0.3),  # 0.3: not a power of 2
    # the scale a model argument: traced, weakly typed
    "Dot_scale_arg": lambda q, k, s: si.scores.Dot(q, k, scale=s),
    "NegSqDist": lambda q, k, s: si.scores.NegSqDist(q, k, precision=0.3),
    "Cosine": lambda q, k, s: si.scores.Cosine(q, k, scale=3.0),
}


@pytest.mark.parametrize("score, bf16", [
    *((score, "q") for score in MIXED_SCORES),
    ("NegSqDist", "qk"), ("Cosine", "qk"),
])
def test_bfloat16_queries_beside_float32_keys_stay_float32(score, bf16):
    """Regression: a bfloat16 ``q`` with float32 keys and values answers in float32, but
    the lowering rounded ``q`` to bfloat16 again once scaled (``Dot``), centred
    (``NegSqDist``) or normalised (``Cosine``) before the kernels cast it to the operands'
    float32: the answer was 3e-3 off the exact engine's on the same inputs. Also with
    the scale a model argument (multiplied into the bfloat16 ``q`` before the operands'
    dtype was known) and with bfloat16 ``q`` and ``k`` beside float32 values (the
    centred / normalised features were rounded to bfloat16, the operands being
    float32)."""
    n = 24

    def model(q, k, v, s):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", si.priors.Restricted.causal(n), MIXED_SCORES[score](q, k, s))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    q, k, v, _ = _inputs(jnp.float32, n)
    q = q.astype(BF16)
    if bf16 == "qk":
        k = k.astype(BF16)
    f32 = (q.astype(jnp.float32), k.astype(jnp.float32), v)
    want = jax.jit(lambda *a: si.expectation(model, "out", *a))(*f32, 0.3)
    y = si.attention(model, "out", "dense")(q, k, v, 0.3)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "exact", "dense", "blocked", "windowed", "pallas"])
def test_float32_in_float32_out_under_x64(backend):
    # "pallas" regression (review): under x64 the kernels' block arithmetic mixed int32
    # program ids with int64 block sizes and raised TypeError from lax.div
    with float64():
        n = 24
        model = _model(PRIORS["geometric_float_q"], n)  # q = 0.1: a float64 parameter
        q, k, v, e = _inputs(jnp.float32, n)
        y = si.attention(model, "out", backend, block_q=16, block_k=16)(q, k, v, e)
        assert y.dtype == jnp.float32, (backend, y.dtype)
        assert jax.eval_shape(lambda *a: si.expectation(model, "out", *a),
                              q, k, v, e).dtype == jnp.float32
        # float64 inputs still answer in float64
        up = [x.astype(jnp.float64) for x in (q, k, v)]
        y64 = si.attention(model, "out", backend, block_q=16, block_k=16)(*up, e)
        assert y64.dtype == jnp.float64


def _rel_rms(y, ref):
    y = np.asarray(y, np.float64)
    return float(np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref**2)))


def _softmax_reference(q, k, v, scale, causal=True):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = scale * np.einsum("...id,...jd->...ij", q, k)
    if causal:
        n = s.shape[-1]
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return np.einsum("...ij,...jd->...id", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("backend", ["dense", "blocked", "exact"])
def test_bfloat16_accumulates_in_float32(backend):
    """Causal, n = 512, d = 16: a bfloat16 softmax had 1.03 % relative RMS error;
    ``jax.nn.dot_product_attention`` in bfloat16 has 0.23 %. Regression: the exact
    engine (``si.expectation``, the fallback of every unrecognised model) rounded the
    score table to bfloat16 and contracted in it, several times the kernels' error; its
    score tables and contraction are float32 now, its answer the value's bfloat16."""
    n, d = 512, 16
    model = _model(PRIORS["causal"], n, scale=0.25)
    q, k, v, _ = _inputs(BF16, n, d, seed=1)
    q, k = 3 * q, 3 * k  # peaked rows, as trained attention has
    ref = _softmax_reference(q, k, v, 0.25)
    y = si.attention(model, "out", backend)(q, k, v)
    assert y.dtype == BF16
    if backend == "exact":
        np.testing.assert_allclose(np.asarray(si.expectation(model, "out", q, k, v),
                                              np.float32), np.asarray(y, np.float32),
                                   rtol=8e-3, atol=8e-3)  # a bfloat16 ulp
    err = _rel_rms(y, ref)
    base = _rel_rms(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        jnp.swapaxes(q, 0, 1)[None], jnp.swapaxes(k, 0, 1)[None], jnp.swapaxes(v, 0, 1)[None],
        scale=0.25, is_causal=True)[0].swapaxes(0, 1))(q, k, v), ref)
    assert err <= 5e-3 and err <= 1.5 * base, (err, base)


#: by default the kernels with a backward of their own (the rest read `block_logits`)
@pytest.mark.parametrize("backend", matrix(["dense", "blocked", "windowed", "pallas"],
                                           keep=lambda b: b in ("blocked", "pallas")))
def test_a_bfloat16_dot_scale_multiplies_the_float32_logits(backend):
    """Regression: with bfloat16 operands a static scale that is no power of two
    (``d**-0.5`` at d = 128) was folded into the queries in bfloat16, rounding every
    logit by up to ``|s q.k| 2^-8``: values about twice the exact engine's error against
    a float32 softmax of the same inputs, and the gradients of q and k over twice it.
    The kernels now multiply the float32 product ``q.k`` by the scale, as the exact
    engine (and FlashAttention) do: the values are as close as the exact engine's, the
    gradients within twice its error (they cast ``ds`` to bfloat16 for the dq and dk
    products, as flash kernels do)."""
    n, d = 128, 128
    model = _model(lambda n, m, e: si.priors.Restricted.window(n, 32), n, scale=d ** -0.5)
    q, k, v, _ = _inputs(BF16, n, d, seed=1)
    q = 4 * q  # peaked rows, as trained attention has
    ct = jnp.asarray(np.random.default_rng(2).normal(size=(H, n, d)), jnp.float32)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))

    def errors(f):  # value and (dq, dk) errors against a float32 softmax
        def loss(f):
            return lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * ct)
        f32 = si.attention(model, "out", "dense")
        up = lambda *a: f32(*(x.astype(jnp.float32) for x in a))  # noqa: E731
        y, g = jax.jit(f)(q, k, v), jax.jit(jax.grad(loss(f), (0, 1)))(q, k, v)
        ref, g_ref = up(q, k, v), jax.grad(loss(up), (0, 1))(q, k, v)
        assert y.dtype == BF16
        return rel(y, ref), max(rel(a, b) for a, b in zip(g, g_ref))

    err, g_err = errors(si.attention(model, "out", backend))
    exact, g_exact = errors(si.attention(model, "out", "exact"))
    assert err <= 1.5 * exact and g_err <= 2 * g_exact, (err, exact, g_err, g_exact)


_TRACED_N, _TRACED_D = 128, 128


def _traced_scale_model(static):
    """A windowed edge whose Dot scale is ``static`` or, when ``None``, the model's
    argument ``s`` (traced: `attention` jits)."""
    def model(q, k, v, s=None):
        s = static if s is None else s
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", _TRACED_N, dim=-1):
            j = si.edge("phi", si.priors.Restricted.window(_TRACED_N, 32),
                        si.scores.Dot(q, k, scale=s))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    return model


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


@functools.cache
def _traced_scale_case():
    """Inputs, the float32 softmax's value and gradients, and ``errors(f)``: the value,
    (dq, dk) and d(scale) errors of ``f`` against them, with the exact engine's."""
    scale = _TRACED_D ** -0.5
    q, k, v, _ = _inputs(BF16, _TRACED_N, _TRACED_D, seed=1)
    q = 4 * q  # peaked rows, as trained attention has
    ct = jnp.asarray(np.random.default_rng(2).normal(size=(H, _TRACED_N, _TRACED_D)),
                     jnp.float32)
    traced = _traced_scale_model(None)
    up = [x.astype(jnp.float32) for x in (q, k, v)]

    def loss(f, v):
        return lambda q, k, s: jnp.sum(f(q, k, v, s).astype(jnp.float32) * ct)

    f32 = si.attention(traced, "out", "dense")
    ref = f32(*up, scale)
    g_ref = jax.grad(loss(f32, up[2]), (0, 1, 2))(up[0], up[1], scale)

    def errors(f):
        y = f(q, k, v, scale)  # `attention` jits: the scale is traced there
        g = jax.jit(jax.grad(loss(f, v), (0, 1, 2)))(q, k, scale)
        assert y.dtype == BF16 and g[2].dtype == jnp.float32
        return (_rel(y, ref), max(_rel(a, b) for a, b in zip(g[:2], g_ref[:2])),
                abs(float(g[2]) - float(g_ref[2])) / abs(float(g_ref[2])), y)

    return (q, k, v, scale, ref, errors,
            errors(si.attention(traced, "out", "exact"))[:3])


#: by default the kernels with a backward of their own, and the dense one (autodiff)
@pytest.mark.parametrize("backend", matrix(["dense", "blocked", "windowed", "pallas"],
                                           keep=lambda b: b in ("dense", "blocked", "pallas")))
def test_a_traced_bfloat16_dot_scale_multiplies_the_float32_logits(backend):
    """Regression: a dot scale that is traced (a model argument, a learned temperature)
    took another path than a static one with bfloat16 operands: it was rounded to
    bfloat16 and multiplied into the bfloat16 queries, so every logit moved by up to
    ``|s q.k| 2^-8`` (the value error against a float32 softmax was 1.6-2x the static
    scale's at d = 128, ``s = d**-0.5``), and its gradient, through the bfloat16
    ``s q``, was 5-80 % off. The kernels now multiply the float32 ``q.k`` by it as they
    do a static scale: the same answer as the static scale's, and the gradients of q, k
    and of the scale itself within twice the exact engine's error against a float32
    softmax (the scale's: the blocked and Pallas backwards correct its sum for their
    ``delta``, read off the rounded output; the dense kernel differentiates the
    probabilities in float32)."""
    q, k, v, scale, ref, errors, (exact, g_exact, s_exact) = _traced_scale_case()
    err, g_err, s_err, y = errors(si.attention(_traced_scale_model(None), "out", backend))
    y_static = si.attention(_traced_scale_model(scale), "out", backend)(q, k, v)
    err_static = _rel(y_static, ref)
    assert err <= 1.1 * err_static and err <= 1.5 * exact, (err, err_static, exact)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_static, np.float32),
                               atol=1e-2)  # a bfloat16 ulp of values about 1
    assert g_err <= 2 * g_exact, (g_err, g_exact)
    assert s_err <= max(2 * s_exact, 1e-3), (s_err, s_exact)


def test_a_traced_16_bit_scale_is_kept_in_float32_and_refused_by_static_scale_kernels():
    """How a 0-d scale is lowered: static, ``Terms.dot_scale``; traced with 16-bit
    operands, the float32 ``Globals.dot_scale``, which cuDNN and Mosaic GPU (taking a
    static scale) refuse, so that ``"auto"`` falls back to the Pallas kernel; traced with
    float32 operands, folded into the queries (exact enough there)."""
    from structinfer.lowering import accel
    from structinfer.lowering._lower import lower_edge
    from structinfer.lowering.mosaic import mosaic_unsupported

    n = 16
    prior = si.priors.Restricted.causal(n)
    seen = {}

    def lowered(s, dtype):
        q, k, v, _ = _inputs(dtype, n)
        low = lower_edge(prior, si.scores.Dot(q, k, scale=s), v, n, (H,))
        seen[dtype, isinstance(s, float)] = low
        return low.problem.row.q

    for dtype in (BF16, jnp.float16, jnp.float32):
        jax.make_jaxpr(lambda s: lowered(s, dtype))(0.3)
        lowered(0.3, dtype)
    for dtype in (BF16, jnp.float16):
        static, traced = seen[dtype, True], seen[dtype, False]
        assert static.terms.dot_scale == 0.3 and static.problem.glob.dot_scale is None
        assert traced.terms.dot_scale is None
        assert traced.problem.glob.dot_scale.dtype == jnp.float32
        assert traced.problem.row.q.dtype == dtype  # unscaled, not rounded once scaled
        why = accel.cudnn_unsupported(traced.terms, traced.problem, traced.batch_shape)
        assert "traced dot-product scale" in why
        why = mosaic_unsupported(traced.terms, traced.problem, traced.batch_shape)
        assert "traced dot-product scale" in why or "Mosaic GPU" in why  # (JAX without it)
    assert seen[jnp.float32, False].problem.glob.dot_scale is None


def test_a_traced_bfloat16_scale_of_windowed_scores_multiplies_the_float32_logits():
    """`windowed_scores` with a traced scale and bfloat16 features: the scores of a static
    scale (the float32 ``q.k`` times the scale), not those of the bfloat16 ``q s``."""
    from structinfer.lowering import windowed_scores

    q, k, _, _ = _inputs(BF16, 64, 96, seed=3)
    s = 96 ** -0.5
    static = windowed_scores(q, k, 8, scale=s)
    traced = jax.jit(lambda q, k, s: windowed_scores(q, k, 8, scale=s))(q, k, s)
    assert traced.dtype == static.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(static))


def test_bfloat16_windowed_accumulates_in_float32():
    n, d = 256, 16
    model = _model(lambda n, m, e: si.priors.Restricted.window(n, 32), n, scale=0.25)
    q, k, v, _ = _inputs(BF16, n, d, seed=2)
    q, k = 3 * q, 3 * k
    qq, kk, vv = (np.asarray(x, np.float64) for x in (q, k, v))
    s = 0.25 * np.einsum("...id,...jd->...ij", qq, kk)
    dist = np.arange(n)[:, None] - np.arange(n)[None, :]
    s = np.where((dist >= 0) & (dist < 32), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("...ij,...jd->...id", p / p.sum(-1, keepdims=True), vv)
    y = si.attention(model, "out", "windowed")(q, k, v)
    assert y.dtype == BF16 and _rel_rms(y, ref) <= 5e-3, _rel_rms(y, ref)


# --- cuDNN is chosen for a bfloat16 model with float32 prior parameters ----------------


@pytest.mark.parametrize("prior", ["geometric_float_q", "relpos_f32"])
def test_bfloat16_with_float32_prior_parameters_reaches_cudnn(prior, gpu, cudnn_as_xla):
    n = 132
    prior_fn = (lambda n, m, e: si.priors.Geometric(0.1, n, max_distance=20)
                ) if prior == "geometric_float_q" else PRIORS[prior]
    model = _model(prior_fn, n)
    q, k, v, e = _inputs(BF16, n, d=16)
    ex = explain(model, "out", q, k, v, e)
    # the geometric prior takes our kernel on auto (measured faster: Mosaic GPU on a Hopper
    # GPU, else the Triton one); cuDNN, forced, must still accept it with float32 parameters
    ours = "mosaic" if on_hopper() else "pallas"
    assert ex.kernels == {"phi": ours if prior == "geometric_float_q" else "cudnn"}, str(ex)
    assert "inputs are" not in str(ex)  # never sent off cuDNN by a float32 parameter
    y = si.attention(model, "out", "cudnn")(q, k, v, e)
    assert y.dtype == BF16
    assert cudnn_as_xla and all(x[:3] == (BF16, BF16, BF16) for x in cudnn_as_xla)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = si.attention(model, "out", "dense")(*up, e)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=3e-2)


# --- precision ------------------------------------------------------------------------


KERNEL_FILES = tuple(f"structinfer/lowering/{f}.py" for f in (
    "_spec", "dense", "blocked", "windowed", "accel", "sharded"))


def _in_kernel(eqn) -> bool:
    """The equation was traced by a kernel (not by the model's own dense score, traced
    while it is recognised and dead in the compiled program)."""
    frames = eqn.source_info.traceback.frames if eqn.source_info.traceback else []
    return any(f.file_name.replace("\\", "/").endswith(KERNEL_FILES) for f in frames)


def _dot_precisions(jaxpr):
    """The precision of every dot_general a kernel traced (sub-jaxprs included)."""
    out = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general" and _in_kernel(eqn):
                out.append(eqn.params["precision"])
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return out


HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("backend", ["dense", "blocked", "windowed", "pallas"])
def test_precision_reaches_every_matmul(backend):
    n = 40
    model = _model(PRIORS["geometric_float_q"], n)
    q, k, v, e = _inputs(jnp.float32, n)
    f = si.attention(model, "out", backend, block_q=16, block_k=16, precision="highest")

    def loss(q, k, v):
        return jnp.sum(jnp.sin(f(q, k, v, e)))

    for fn in (loss, jax.grad(loss, argnums=(0, 1, 2))):
        precs = _dot_precisions(jax.make_jaxpr(fn)(q, k, v))
        assert precs and all(p == HIGHEST for p in precs), (backend, precs)
    # precision=None follows jax.default_matmul_precision (inside the context)
    g = si.attention(model, "out", backend, block_q=16, block_k=16)
    with jax.default_matmul_precision("highest"):
        precs = _dot_precisions(jax.make_jaxpr(
            jax.grad(lambda q: jnp.sum(jnp.sin(g(q, k, v, e)))))(q))
    assert precs and all(p == HIGHEST for p in precs), (backend, precs)
    if jax.config.jax_default_matmul_precision is None:  # unset (the suite sets it on a GPU)
        precs = _dot_precisions(jax.make_jaxpr(lambda q: g(q, k, v, e))(q))
        assert precs and all(p is None for p in precs), (backend, precs)


@pytest.mark.parametrize("precision", ["highest", jax.lax.Precision.HIGHEST,
                                       ("highest", "default")])
def test_precision_reaches_the_exact_engine(precision):
    n = 7
    model = _model(PRIORS["geometric_float_q"], n)
    q, k, v, e = _inputs(jnp.float32, n)
    f = si.attention(model, "out", "exact", precision=precision)
    jx = jax.make_jaxpr(lambda q: f(q, k, v, e))(q)
    dots = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append(eqn.params["precision"])
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jx.jaxpr)
    assert dots and all(p == HIGHEST for p in dots), dots


def test_attention_refuses_a_bad_precision():
    with pytest.raises(ValueError, match="precision"):
        si.attention(_model(PRIORS["causal"], 5), "out", precision="very high")


# --- structinfer.nn.Attention -----------------------------------------------------------


F, D = 16, 8


def test_layer_float32_under_x64_answers_float32_as_flax():
    with float64():
        layer = sinn.Attention(sinn.causal(), num_heads=H, in_features=F, qkv_features=H * D,
                               rngs=nnx.Rngs(0))
        mha = nnx.MultiHeadAttention(num_heads=H, in_features=F, qkv_features=H * D,
                                     decode=False, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (2, 7, F), jnp.float32)
        assert _dtype(layer, x) == _dtype(mha, x) == jnp.float32


def _dtype(module, x):
    """The dtype a layer answers ``x`` in (traced abstractly: no program is compiled)."""
    return nnx.eval_shape(lambda m, x: m(x), module, x).dtype


_call = nnx.jit(lambda m, x: m(x))


@pytest.mark.parametrize("mech", ["causal", "geometric"])
def test_layer_dtype_and_param_dtype_as_flax(mech):
    """param_dtype for the parameters (the hyperparameters too), dtype for the
    computation: a bfloat16 layer with float32 parameters answers in bfloat16."""
    m = sinn.causal() if mech == "causal" else sinn.geometric()
    layer = sinn.Attention(m, num_heads=H, in_features=F, qkv_features=H * D,
                           dtype=BF16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    mha = nnx.MultiHeadAttention(num_heads=H, in_features=F, qkv_features=H * D,
                                 dtype=BF16, param_dtype=jnp.float32, decode=False,
                                 rngs=nnx.Rngs(0))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(layer, nnx.Param)))
    x = jax.random.normal(jax.random.key(1), (2, 7, F), jnp.float32)
    y = _call(layer, x)
    assert y.dtype == _dtype(mha, x) == BF16
    ref = _call(sinn.Attention(m, num_heads=H, in_features=F, qkv_features=H * D,
                               rngs=nnx.Rngs(0)), x)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=5e-2)
    # bfloat16 inputs, float32 parameters, no dtype: flax promotes to float32
    xb = x.astype(BF16)
    plain = sinn.Attention(m, num_heads=H, in_features=F, qkv_features=H * D,
                           rngs=nnx.Rngs(0))
    assert _dtype(plain, xb) == jnp.float32
    # a bfloat16 layer end to end
    all16 = sinn.Attention(m, num_heads=H, in_features=F, qkv_features=H * D,
                           param_dtype=BF16, rngs=nnx.Rngs(0))
    assert _call(all16, xb).dtype == BF16
    g = nnx.jit(nnx.grad(lambda mod: jnp.sum(mod(xb).astype(jnp.float32))))(all16)
    assert all(x.dtype == BF16 for x in jax.tree.leaves(g))


def test_layer_precision_reaches_the_attention():
    layer = sinn.Attention(sinn.causal(), num_heads=H, in_features=F, qkv_features=H * D,
                           precision="highest", backend="blocked", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (7, F), jnp.float32)
    graphdef, state = nnx.split(layer)
    precs = _dot_precisions(jax.make_jaxpr(
        lambda s, x: nnx.merge(graphdef, s)(x))(state, x))
    assert len(precs) >= 2 and all(p == HIGHEST for p in precs), precs  # q·k, p·v


# --- Python numbers in priors and scores take the model's dtype --------------------------

_P, _S = si.priors, si.scores
_EYE = np.eye(4)

#: priors over the 5 parents of 5 children, with a Python number where one is taken
#: (weakly typed in JAX: it has no dtype of its own), else arrays of the inputs' dtype
WEAK_PRIORS = {
    "Uniform": lambda x: _P.Uniform(5),
    "Restricted": lambda x: _P.Restricted.causal(5),
    "Categorical": lambda x: _P.Categorical(jnp.zeros(5, x.dtype)),
    "RelativePosition": lambda x: _P.RelativePosition(jnp.linspace(0, 1, 9, dtype=x.dtype), 5),
    "RelativePosition.hartley": lambda x: _P.RelativePosition.hartley(
        jnp.ones(2, x.dtype), 5),
    "Geometric": lambda x: _P.Geometric(0.3, 5),
    "Geometric window": lambda x: _P.Geometric(0.3, 5, max_distance=2),
}

#: scores of the features ``x`` (5, 4), with Python-number parameters (ints too)
WEAK_SCORES = {
    "Dot": lambda x: _S.Dot(x, x, scale=0.5),
    "Bilinear": lambda x: _S.Bilinear(x, x, _EYE.astype(x.dtype), _EYE.astype(x.dtype), 0.5),
    "NegSqDist": lambda x: _S.NegSqDist(x, x, precision=2.0, normalize=True),
    "NegSqDist int": lambda x: _S.NegSqDist(x, x, precision=2),
    "NegLogDist": lambda x: _S.NegLogDist(x, x, p=1.5, eps=0.1),
    "InvDist": lambda x: _S.InvDist(x, x, p=1, eps=1),
    "GaussianKernel": lambda x: _S.GaussianKernel(x, x, sigma=2.0),
    "Cosine": lambda x: _S.Cosine(x, x, scale=2.0, eps=1e-6),
    "LinearGaussian": lambda x: _S.LinearGaussian(x, x, _EYE.astype(x.dtype), precision=2.0,
                                                  normalize=True),
    "LinearGaussian int": lambda x: _S.LinearGaussian(x, x, _EYE.astype(x.dtype), precision=3),
    "Sum": lambda x: _S.Dot(x, x, scale=0.5) + _S.NegSqDist(x, x, precision=2.0),
}


def _markov_model(x, v):
    prior = si.priors.Markov(jnp.zeros((4, 4), x.dtype), jnp.zeros(4, x.dtype))

    def step(previous, e):
        z = si.edge("phi", prior, e, previous=previous)
        numpyro.deterministic("out", v[z])
        return z, None

    scan(step, jnp.asarray(-1), x)


def _weak_model(prior, score):
    def model(x, v):
        with numpyro.plate("children", 5):
            j = si.edge("phi", WEAK_PRIORS[prior](x), WEAK_SCORES[score](x))
            numpyro.deterministic("out", v[j])

    return model


#: the default run's weak-typing cases: a float, an int and a distance in a score, a
#: probability in a prior (Geometric's q made a float32 model float64), a table prior, a
#: sum of scores; the other priors and scores, and the Markov chain, are exhaustive
_WEAK_KEPT = {("Uniform", "Dot"), ("Geometric", "Dot"), ("Geometric window", "Dot"),
              ("RelativePosition", "Dot"), ("Uniform", "NegSqDist int"),
              ("Uniform", "LinearGaussian int"), ("Uniform", "Sum")}


@pytest.mark.parametrize("prior, score", matrix(
    [*[(p, "Dot") for p in WEAK_PRIORS], *[("Uniform", s) for s in WEAK_SCORES if s != "Dot"],
     ("Geometric", "LinearGaussian int"), ("Markov", None)],
    lambda p, s: (p, s) in _WEAK_KEPT))
def test_python_numbers_take_the_models_dtype_under_x64(prior, score, x64):
    """A Python number in a prior or score (``Geometric(0.3)``, ``Dot(scale=0.5)``,
    ``NegSqDist(precision=2)``) is weakly typed, as in JAX: under x64 a float32 model
    answers in float32 (marginals, log Z, expectation, `si.attention`; a geometric q made
    them float64) and a float64 model in float64."""
    model = _markov_model if prior == "Markov" else _weak_model(prior, score)
    r = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.float64):
        x = jnp.asarray(0.5 * r.normal(size=(5, 4)), dtype)
        v = jnp.asarray(r.normal(size=(4 if prior == "Markov" else 5, 2)), dtype)
        exact = jax.jit(lambda x, v: {"marginals": si.marginals(model, x, v)["phi"],  # noqa: B023
                                      "log Z": si.log_marginal(model, x, v),  # noqa: B023
                                      "expectation": si.expectation(model, "out", x, v)})  # noqa: B023
        got = {**exact(x, v), "attention": si.attention(model, "out")(x, v)}
        assert {k: a.dtype for k, a in got.items()} == dict.fromkeys(got, dtype), (
            prior, score, dtype)
