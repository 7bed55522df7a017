"""GPU dispatch of the lowered engine, tested on a CPU.

* Dispatch: ``structinfer.lowering.accel.platform`` is replaced by a function returning
  ``"gpu"``, and ``explain`` / ``attention`` are checked to pick cuDNN, the Pallas kernel
  or the blocked kernel by the rules in ``accel`` (dtype, head dims, structure), to name
  the reason when they do not, and to fall back when JAX's cuDNN wrapper refuses at trace
  time (it always does here: no cuDNN).
* cuDNN plumbing (layout, bias table, causal window, log-normaliser): ``jax.nn``'s cuDNN
  call is redirected to its XLA implementation, which takes the same arguments; results
  against the dense kernel (float16 inputs; the dense kernel is the naive twin tested
  against the exact engine in test_lowering.py).
* The Pallas kernel runs in Pallas' interpreter (``backend="pallas"`` off a GPU) and is
  compared with the dense kernel and, in one case, the exact engine (values; gradients
  against the dense kernel's autodiff), and is lowered for CUDA
  (``lowering_platforms=("cuda",)``) to check it uses only operations Triton takes.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import (
    assert_huge_logit_gradients,
    eqns_named,
    float32_softmax,
    huge_logit_cotangents,
    huge_logit_edge,
    matrix,
    on_hopper,
)
from numpyro.ops.indexing import Vindex

import structinfer as si
from structinfer.lowering import NotLowerableError, accel, explain
from structinfer.lowering._lower import lower_edge
from structinfer.lowering._softmax import RowStats
from structinfer.lowering.dense import dense_attention

H, N, D = 2, 131, 16  # 131^2 logits: above the dense kernel's limit


def _model(prior_fn, score_fn=None, n=N):
    def model(q, k, v, extra=None):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            score = (si.scores.Dot(q, k, scale=0.25) if score_fn is None
                     else score_fn(q, k))
            j = si.edge("phi", prior_fn(n, extra), score)
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    return model


def _inputs(dtype, n=N, d=D, dv=D, seed=0):
    r = np.random.default_rng(seed)
    q, k = (jnp.asarray(r.normal(size=(H, n, d)), dtype) for _ in range(2))
    return q, k, jnp.asarray(r.normal(size=(H, n, dv)), dtype)


pytestmark = pytest.mark.gpu

CAUSAL = lambda n, e: si.priors.Restricted.causal(n)  # noqa: E731


@pytest.mark.cpu_only
def test_a_refusing_cudnn_falls_back_to_pallas(gpu):
    # cuDNN's preconditions hold, but JAX's cuDNN wrapper refuses here (no cuDNN): the
    # Pallas kernel runs instead, and explain says why
    # (an older JAX's wrapper takes no return_residual: refused before tracing, said so)
    old_jax = "return_residual" not in inspect.signature(jax.nn.dot_product_attention).parameters
    said = "takes no return_residual" if old_jax else "cuDNN refused at trace time"
    ex = explain(_model(CAUSAL), "out", *_inputs(jnp.float16))
    assert ex.kernels == {"phi": "pallas"}
    assert said in str(ex)
    with pytest.raises(NotLowerableError, match="takes no return_residual" if old_jax
                       else "cuDNN refused"):
        si.attention(_model(CAUSAL), "out", "cudnn")(*_inputs(jnp.float16))


def test_a_cudnn_wrapper_without_the_residual_is_refused_before_tracing(gpu, monkeypatch):
    """Regression: on JAX 0.4.33 (the floor) cuDNN was chosen on a GPU and its call failed
    when traced (``jax.nn.dot_product_attention`` there takes no ``return_residual`` nor
    ``local_window_size``). Such a wrapper is refused when the kernel is chosen, saying
    which arguments it lacks, and the Pallas kernel runs."""

    def old(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
            query_seq_lengths=None, key_value_seq_lengths=None, implementation=None):
        raise AssertionError("the cuDNN wrapper is called")

    monkeypatch.setattr(accel.jax.nn, "dot_product_attention", old)
    ex = explain(_model(CAUSAL), "out", *_inputs(jnp.float16))
    assert ex.kernels == {"phi": "pallas"}, str(ex)
    assert ("jax.nn.dot_product_attention takes no return_residual / local_window_size"
            in str(ex)), str(ex)


def test_dispatch_rules_on_a_faked_gpu(gpu):
    h16 = _inputs(jnp.float16)
    f32 = _inputs(jnp.float32)
    causal = _model(CAUSAL)
    # float32: cuDNN is not tried
    ex = explain(causal, "out", *f32)
    assert ex.kernels == {"phi": "pallas"} and "cuDNN takes float16" in str(ex)
    # head dims that differ / are not a multiple of 8
    assert "differs from value head dim" in str(explain(causal, "out", *_inputs(
        jnp.float16, dv=8)))
    assert "multiple of 8" in str(explain(causal, "out", *_inputs(jnp.float16, d=12, dv=12)))
    # a band cuDNN does not express (no self edge) -> Pallas
    no_self = _model(lambda n, e: si.priors.Restricted.causal(n, include_self=False, offset=1))
    assert "causal window" in str(explain(no_self, "out", *h16))
    # an IDW score: neither fused kernel -> blocked
    idw = _model(CAUSAL, lambda q, k: si.scores.NegLogDist(q, k))
    ex = explain(idw, "out", *f32)
    assert ex.kernels == {"phi": "blocked"} and "not Pallas: an IDW score" in str(ex)
    # small problems keep the dense kernel; a CPU keeps the blocked one
    assert explain(_model(CAUSAL, n=64), "out", *_inputs(jnp.float16, n=64)).kernels == {
        "phi": "dense"}


@pytest.mark.cpu_only
def test_cpu_keeps_the_blocked_kernel():
    ex = explain(_model(CAUSAL), "out", *_inputs(jnp.float16))
    assert ex.kernels == {"phi": "blocked"} and "cuDNN" not in str(ex)


def test_forced_fused_backends_explain_what_they_cannot_run():
    q, k, v = _inputs(jnp.float32)
    with pytest.raises(NotLowerableError,
                       match="backend 'cudnn' cannot run edge site 'phi': .*float16"):
        si.attention(_model(CAUSAL), "out", "cudnn")(q, k, v)
    idw = _model(CAUSAL, lambda q, k: si.scores.NegLogDist(q, k))
    with pytest.raises(NotLowerableError,
                       match="backend 'pallas' cannot run edge site 'phi': an IDW"):
        si.attention(idw, "out", "pallas")(q, k, v)


@pytest.mark.cpu_only
def test_forced_cudnn_off_a_gpu_says_so_before_tracing():
    """The cuDNN entry of the kernel table states the platform among what it cannot run:
    forced on a CPU, with inputs it could take on a GPU, the error says so (rather than
    relaying JAX's cuDNN wrapper refusing when traced), from `explain` too."""
    args = _inputs(jnp.float16)
    with pytest.raises(NotLowerableError, match="cuDNN runs on a GPU \\(the platform is cpu"):
        si.attention(_model(CAUSAL), "out", "cudnn")(*args)
    with pytest.raises(NotLowerableError, match="cuDNN runs on a GPU"):
        explain(_model(CAUSAL), "out", *args, backend="cudnn")


def _dense(model, *args):
    """The dense kernel (the naive twin, itself tested against the exact engine) on
    float32 copies of the inputs."""
    up = [None if x is None else jnp.asarray(x, jnp.float32) for x in args]
    return np.asarray(si.attention(model, "out", "dense")(*up))


CUDNN_CASES = {  # prior, extra argument, score (None: Dot)
    "causal": (CAUSAL, None, None),
    "window": (lambda n, e: si.priors.Restricted.window(n, 9), None, None),
    "relpos": (lambda n, e: si.priors.RelativePosition(e, n, causal=True), "relpos", None),
    "geometric": (lambda n, e: si.priors.Geometric(e, n, max_distance=20), "geo", None),
    "parent_bias": (lambda n, e: si.priors.Uniform(n), None,  # -|k_j|^2 / 2: a column bias
                    lambda q, k: si.scores.NegSqDist(0.5 * q, 0.5 * k)),
}


@pytest.mark.parametrize("case", list(CUDNN_CASES))
def test_cudnn_plumbing_through_the_xla_implementation(case, gpu, cudnn_as_xla):
    n = 132  # even lengths: cuDNN's backward with a bias needs them
    prior_fn, extra, score_fn = CUDNN_CASES[case]
    r = np.random.default_rng(1)
    e = {None: None,
         "relpos": jnp.asarray(0.5 * r.normal(size=(H, 2 * n - 1)), jnp.float16),
         "geo": jnp.asarray(r.uniform(0.05, 0.5, size=(H, n)), jnp.float16)}[extra]
    model = _model(prior_fn, score_fn, n=n)
    args = _inputs(jnp.float16, n=n) + (e,)
    # auto takes cuDNN, except for the geometric prior: our kernel measured faster there
    # (Mosaic GPU on a Hopper GPU, else the Triton one; forced, cuDNN still runs it), and
    # a relative-position table on a Hopper GPU (Mosaic GPU measured faster)
    ex = explain(model, "out", *args)
    if case == "geometric" or (case == "relpos" and on_hopper()):
        ours = "mosaic" if on_hopper() else "pallas"
        assert ex.kernels == {"phi": ours} and "measured faster" in str(ex), str(ex)
    else:
        assert ex.kernels == {"phi": "cudnn"}, str(ex)
    y = si.attention(model, "out", "cudnn")(*args)
    assert y.dtype == jnp.float16 and cudnn_as_xla[0][0] == jnp.float16  # the value dtype
    np.testing.assert_allclose(y, _dense(model, *args), atol=6e-3)
    # the row log-normaliser too, against the dense kernel's (both layouts: with a bias
    # and without)
    q, k, v, e = args
    score = si.scores.Dot(q, k, scale=0.25) if score_fn is None else score_fn(q, k)
    low = lower_edge(prior_fn(n, e), score, v, n, (H,))
    _, lse = accel.cudnn_attention(low.terms, low.problem, low.batch_shape)
    up = jax.tree.map(lambda x: x.astype(jnp.float32), low.problem)
    _, ref = dense_attention(low.terms, up, (H,))
    np.testing.assert_allclose(lse.astype(jnp.float32), ref, atol=2e-2)


@pytest.mark.parametrize("relpos", [False, True])
def test_cudnn_plumbing_with_two_batch_dims_and_shared_keys(relpos, gpu, cudnn_as_xla):
    """Batch dims (3, 2) flattened into cuDNN's batch (or, with a bias, its heads), keys
    and values shared by the batch (broadcast to it), and the output and the row
    log-normaliser put back: against the dense kernel."""
    n, d = 64, 16
    r = np.random.default_rng(8)
    q = jnp.asarray(r.normal(size=(3, 2, n, d)), jnp.float16)
    k = jnp.asarray(r.normal(size=(1, 1, n, d)), jnp.float16)
    v = jnp.asarray(r.normal(size=(n, d)), jnp.float16)
    e = jnp.asarray(0.5 * r.normal(size=(3, 1, 2 * n - 1)), jnp.float16)
    prior = (si.priors.RelativePosition(e, n, causal=True) if relpos
             else si.priors.Restricted.window(n, 9))
    low = lower_edge(prior, si.scores.Dot(q, k, scale=0.25), v, n, (3, 2))
    assert accel.cudnn_unsupported(low.terms, low.problem, low.batch_shape) is None
    y, lse = accel.cudnn_attention(low.terms, low.problem, low.batch_shape)
    up = jax.tree.map(lambda x: x.astype(jnp.float32), low.problem)
    y0, l0 = dense_attention(low.terms, up, (3, 2))
    assert y.shape == (3, 2, n, d) and lse.shape == (3, 2, n)
    np.testing.assert_allclose(y.astype(jnp.float32), y0, atol=6e-3)
    np.testing.assert_allclose(lse, l0, atol=2e-2)


def test_cudnn_writes_nan_rows_eager_and_jit_and_differentiates(gpu, cudnn_as_xla):
    """A row with a NaN query has a NaN log-normaliser: eagerly the score check names
    it; under ``jit`` the cuDNN path writes the row NaN (not differentiated: scattered
    into the output), in the inputs' dtype, the other rows the dense kernel's; a loss
    that drops the row has the dense kernel's gradient (differentiated: a ``where``)."""
    model = _model(CAUSAL)
    q, k, v = _inputs(jnp.float16)
    q = q.at[1, 5].set(jnp.nan)
    f = si.attention(model, "out", "cudnn")
    dense = si.attention(model, "out", "dense")
    with pytest.raises(ValueError, match="edge site 'phi': score contains NaN"):
        f(q, k, v)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    want = np.asarray(jax.jit(dense)(*up))
    y = jax.jit(f)(q, k, v)
    assert y.dtype == jnp.float16
    y = np.asarray(y, np.float32)
    for got in (y, want):
        assert np.isnan(got[1, 5]).all() and np.isfinite(np.delete(got[1], 5, 0)).all()
    np.testing.assert_allclose(y[0], want[0], atol=6e-3)
    np.testing.assert_allclose(np.delete(y[1], 5, 0), np.delete(want[1], 5, 0), atol=6e-3)

    def loss(f):  # rows 0.. of head 0 only: head 1 reads the NaN query's row
        return lambda v: jnp.sum(jnp.sin(f(q, k, v)[0].astype(jnp.float32)))

    got = np.asarray(jax.jit(jax.grad(loss(f)))(v), np.float32)
    want = np.asarray(jax.jit(jax.grad(loss(dense)))(up[2]))
    np.testing.assert_allclose(got[0], want[0], atol=2e-2)
    # head 1: the NaN row's weights times a zero cotangent, NaN at (at least) its parents
    for g in (got, want):
        assert np.isnan(g[1, :6]).all()


def test_cudnn_log_normaliser_refuses_a_gradient(gpu, cudnn_as_xla):
    """JAX's cuDNN wrapper drops the cotangent of the row log-normaliser it returns (its
    residual), so a gradient through ``f.with_log_normalisers``' ``L`` on the cuDNN kernel
    would miss a term: it raises, naming the kernels that differentiate ``L``, instead of
    answering a finite wrong number. A gradient of the output alone is unaffected, and
    the Pallas kernel differentiates ``L`` (against the dense kernel)."""
    model = _model(CAUSAL)
    q, k, v = _inputs(jnp.float16)

    def loss(backend, with_lse, k=k, v=v):
        f = si.attention(model, "out", backend).with_log_normalisers

        def g(q):
            y, lses = f(q, k, v)
            out = jnp.sum(y.astype(jnp.float32) ** 2)
            return out + (jnp.sum(jnp.sin(lses["phi"])) if with_lse else 0.0)

        return g

    with pytest.raises(NotImplementedError, match="log-normaliser.*cuDNN.*pallas"):
        jax.grad(loss("cudnn", True))(q)
    np.testing.assert_allclose(jax.grad(loss("cudnn", False))(q).astype(jnp.float32),
                               jax.grad(loss("dense", False))(q.astype(jnp.float32)),
                               atol=2e-2, rtol=2e-2)
    # in float32 throughout: a float16 output rounds differently in the two kernels (one
    # float16 ulp moved the gradient by 1e-4 on a CPU, 3e-4 on an H100); a missing L
    # term moves it by ~0.1
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    g_dense = jax.grad(loss("dense", True, *up[1:]))(up[0])
    g_pallas = jax.jit(jax.grad(loss("pallas", True, *up[1:])))(up[0])
    np.testing.assert_allclose(g_pallas, g_dense, atol=1e-3)


def _moves_data(line: str) -> bool:
    """Whether a ``stablehlo.transpose`` line reorders two axes longer than 1 (a copy);
    moving only axes of length 1 leaves the bytes where they are."""
    import re

    perm = [int(x) for x in re.search(r"dims = \[([\d, ]*)\]", line).group(1).split(",")]
    shape = [int(x) for x in re.search(r"tensor<([\dx]+)x\w+>\)", line).group(1).split("x")]
    kept = [a for a in perm if shape[a] > 1]
    return kept != sorted(kept)


@pytest.mark.parametrize("case", ["causal", "window"])
def test_cudnn_call_reads_and_writes_the_arrays_in_place(case, monkeypatch):
    """Lowered for CUDA on this CPU (JAX's cuDNN version check answered), the cuDNN path
    without a bias, forward and backward, holds no transpose that moves data: our
    ``(batch, L, f)`` arrays go to cuDNN as its batch of one head each, so the fused call
    is all the model path adds (on an H100, with the old heads-as-heads layout's four
    copies, the model path measured about 0.08 ms over the bare call at n = 4096, 32
    heads, head dim 128, about what those copies move; not re-measured since)."""
    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not hasattr(fa, "check_cudnn_version"):
        pytest.skip("this JAX's cuDNN wrapper has no version check to answer")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91900)
    n = 132
    prior = {"causal": si.priors.Restricted.causal(n),
             "window": si.priors.Restricted.window(n, 9)}[case]
    q, k, v = _inputs(jnp.bfloat16, n=n)
    low = lower_edge(prior, si.scores.Dot(q, k, scale=0.25), v, n, (H,))
    assert accel.cudnn_unsupported(low.terms, low.problem, low.batch_shape) is None

    def loss(p):
        y, _ = accel.cudnn_attention(low.terms, p, low.batch_shape)
        return y.astype(jnp.float32).sum()

    for f in (loss, jax.grad(loss)):
        try:
            text = jax.jit(f).trace(low.problem).lower(lowering_platforms=("cuda",)).as_text()
        except (NotImplementedError, TypeError) as e:  # an older JAX's wrapper refuses
            pytest.skip(f"JAX's cuDNN wrapper does not lower here: {e}")
        assert "__cudnn$fmha" in text
        copies = [ln.strip() for ln in text.splitlines()
                  if "stablehlo.transpose" in ln and _moves_data(ln)]
        assert not copies, copies


@pytest.mark.parametrize("case", ["window", "relpos"])
def test_cudnn_model_path_adds_no_pass_over_the_queries(case, gpu, monkeypatch):
    """Regression (H200): the model path around cuDNN added whole passes over (heads, n,
    head dim) arrays beside the fused call: the score's scale multiplied the queries
    before it and their gradient after it, and the NaN-row ``where`` had a backward
    ``select`` on the output's cotangent; the forward's NaN-row ``select`` read and wrote
    the whole output (about 0.025 ms of a 0.12 ms window forward on an H100). Lowered
    for CUDA on this CPU (JAX's cuDNN version check answered), through
    ``si.attention``: the scale is cuDNN's own (``fmha_scale``), the forward writes its
    NaN rows with one scatter into the output (which XLA may run in place: not timed on
    a GPU yet), and a gradient is the two cuDNN calls alone (the NaN rows' ``where``
    fused into the loss)."""
    import re

    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not hasattr(fa, "check_cudnn_version"):
        pytest.skip("this JAX's cuDNN wrapper has no version check to answer")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91900)
    n, d = 132, 16
    prior = {"window": lambda e: si.priors.Restricted.window(n, 9),
             "relpos": lambda e: si.priors.RelativePosition(e, n, causal=True)}[case]

    def model(q, k, v, e):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", prior(e), si.scores.Dot(q, k, scale=d ** -0.5))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    f = si.attention(model, "out", "cudnn")
    x = jax.ShapeDtypeStruct((H, n, d), jnp.bfloat16)
    e = jax.ShapeDtypeStruct((H, 2 * n - 1), jnp.float32)
    grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2))
    passes = {}
    for name, g in (("forward", f), ("gradient", grad)):
        try:
            text = jax.jit(g).trace(x, x, x, e).lower(lowering_platforms=("cuda",)).as_text()
        except (NotImplementedError, TypeError, NotLowerableError) as err:  # an older JAX's
            # wrapper refuses (0.4.33's is refused before tracing: no return_residual)
            pytest.skip(f"JAX's cuDNN wrapper does not lower here: {err}")
        assert text.count("__cudnn$fmha") == (1 if name == "forward" else 2), name
        assert re.findall(r"fmha_scale\\22: ([\d.e-]+)", text) == (
            ["0.25"] * (1 if name == "forward" else 2)), name
        passes[name] = [ln.split("=")[1].split()[0] for ln in text.splitlines()
                        if re.search(r"stablehlo\.(multiply|select|divide) .*"
                                     rf"tensor<{H}x{n}x{d}x", ln)]
        passes[name] += re.findall(r'"stablehlo\.scatter"\(%\w+, %\w+, %\w+\)[^}]*\}'
                                   rf"[\s\S]*?-> tensor<({H * n}x{d})x", text)
    assert passes == {"forward": [f"{H * n}x{d}"], "gradient": []}, passes


PALLAS_CASES = {  # prior(n, m, extra) on n = 37 children, m = 45 parents
    "causal_offset": lambda n, m, e: si.priors.Restricted.causal(n, m, offset=m - n),
    "window_no_self": lambda n, m, e: si.priors.Restricted.window(
        n, 6, m, causal=False, include_self=False),
    "relpos_clipped": lambda n, m, e: si.priors.RelativePosition(e[..., :9], m, max_distance=4),
    "geometric_trunc": lambda n, m, e: si.priors.Geometric(
        0.05 + 0.5 * jax.nn.sigmoid(e[..., :n]), m, offset=m - n, include_self=False,
        max_distance=12),
    "categorical_row": lambda n, m, e: si.priors.Categorical(
        jnp.where(jnp.arange(m) % 7 == 3, -jnp.inf, e[0, :m])),
    # whole 16-blocks and scattered edges, every child with a parent
    "mask": lambda n, m, e: si.priors.Restricted(_sparse_mask(n, m)),
}


def _sparse_mask(n: int, m: int) -> np.ndarray:
    r = np.random.default_rng(n * m)
    blocks = np.kron(r.random((-(-n // 16), -(-m // 16))) < 0.4, np.ones((16, 16), bool))
    mask = blocks[:n, :m] | (r.random((n, m)) < 0.1)
    mask[np.arange(n), np.arange(n) % m] = True
    return mask


def _pallas_model(prior_fn, n, m):
    def model(q, k, v, e):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", prior_fn(n, m, e), si.scores.Dot(q, k, scale=0.4))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    return model


@pytest.mark.parametrize("case", list(PALLAS_CASES))
def test_pallas_kernel_interpreted_equals_exact(case):
    n, m, d, dv = 37, 45, 12, 5  # padded features / values / lengths, offsets
    r = np.random.default_rng(2)
    q = jnp.asarray(r.normal(size=(H, n, d)), jnp.float32)
    k = jnp.asarray(r.normal(size=(H, m, d)), jnp.float32)
    v = jnp.asarray(r.normal(size=(H, m, dv)), jnp.float32)
    e = jnp.asarray(0.5 * r.normal(size=(H, 2 * m - 1)), jnp.float32)
    model = _pallas_model(PALLAS_CASES[case], n, m)
    f = si.attention(model, "out", "pallas", block_q=16, block_k=16)
    # the exact engine as one program (the numbers are the subject, not its eager run)
    ref = (jax.jit(lambda *a: si.expectation(model, "out", *a))(q, k, v, e)
           if case == "geometric_trunc" else si.attention(model, "out", "dense")(q, k, v, e))
    np.testing.assert_allclose(f(q, k, v, e), ref, atol=2e-5)
    # gradients: the Pallas backward (dK/dV, dQ and the prior's parameters: the per-parent
    # bias, the geometric prior's q, the relative-position table), against autodiff of
    # the dense kernel
    loss = lambda g: lambda q, k, v, e: jnp.sum(jnp.sin(g(q, k, v, e)))  # noqa: E731
    dense = si.attention(model, "out", "dense")
    g1 = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2, 3)))(q, k, v, e)
    g0 = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2, 3)))(q, k, v, e)
    for i, (a, b) in enumerate(zip(g0, g1)):
        assert i == 3 and case in ("causal_offset", "window_no_self", "mask") or (
            np.abs(a).max() > 1e-3)
        np.testing.assert_allclose(b, a, atol=5e-5)


def _passes_against_dense(terms, prob, batch, r, mask=None):
    """Both Pallas passes (interpreted; blocks of 16 x 16 forward, 16 x 32 backward)
    against the dense kernel and its autodiff, with random cotangents of the output and
    of the row log-normaliser: values and L on the rows with a parent (the others' L must
    be -inf in both), and the gradients of q, k, v and the relative-position table.
    Returns the finite rows."""
    y_shape, lse_shape = (x.shape for x in jax.eval_shape(
        lambda p: dense_attention(terms, p, batch), prob))
    dy_raw = jnp.asarray(r.normal(size=y_shape), jnp.float32)
    dlse_raw = jnp.asarray(r.normal(size=lse_shape), jnp.float32)

    @jax.jit  # one program: the interpreted kernels run op by op when eager
    def run(prob, dy_raw, dlse_raw):
        y0, lse0 = dense_attention(terms, prob, batch)
        fin = jnp.isfinite(lse0)
        dy = jnp.where(fin[..., None], dy_raw, 0.0)
        dlse = jnp.where(fin, dlse_raw, 0.0)
        (g0,) = jax.vjp(lambda p: dense_attention(terms, p, batch), prob)[1]((dy, dlse))
        y1, stats1 = accel.pallas_forward(terms, prob, batch, block_q=16, block_k=16,
                                          interpret=True, mask=mask, stats=True)
        grads = accel.pallas_backward(terms, prob, batch, y1, stats1, dy, dlse, block_q=16,
                                      block_k=32, interpret=True, mask=mask)
        return y0, lse0, fin, g0, y1, stats1.lse(), grads

    y0, lse0, fin, g0, y1, lse1, (d_row, d_col, _, d_glob, d_v) = run(prob, dy_raw, dlse_raw)
    fin = np.asarray(fin)
    np.testing.assert_array_equal(np.isfinite(lse1), fin)
    np.testing.assert_allclose(np.where(fin, lse1, 0.0), np.where(fin, lse0, 0.0), atol=1e-5)
    np.testing.assert_allclose(np.where(fin[..., None], y1, 0.0),
                               np.where(fin[..., None], y0, 0.0), atol=1e-5)
    for a, b in ((g0.row.q, d_row.q), (g0.col.k, d_col.k), (g0.v, d_v),
                 (g0.glob.relpos, d_glob.relpos)):
        np.testing.assert_allclose(b, a, atol=5e-5)
    return fin


#: (dmin, dmax, offset, exclude_zero)
BANDS = [(None, -3, 0, False), (None, 4, -10, True), (2, None, 20, False), (-20, 30, 15, True),
         (5, 9, -3, False), (None, None, 7, True), (40, None, 0, False)]
#: by default: an open lower and an open upper bound, a two-sided band, rows with no
#: parent, positive, zero and negative offsets, with and without the self-edge
DEFAULT_BANDS = [BANDS[0], BANDS[1], BANDS[3], BANDS[6]]


@pytest.mark.parametrize("band", matrix([(b,) for b in BANDS], keep=lambda band: band in DEFAULT_BANDS))
def test_pallas_passes_over_many_blocks_equal_the_dense_kernel(band):
    """Both Pallas passes called with small blocks (several child and parent blocks, of
    unequal sizes), every gradient against autodiff of the dense kernel, over distance bands
    with offsets, an excluded self-edge and rows with no parent: the live-block ranges of
    the forward, the dK/dV pass and the dQ pass."""
    import dataclasses

    dmin, dmax, offset, exclude_zero = band
    n, m = 35, 50
    r = np.random.default_rng(9)
    q = jnp.asarray(r.normal(size=(1, n, 8)), jnp.float32)
    k = jnp.asarray(r.normal(size=(1, m, 8)), jnp.float32)
    v = jnp.asarray(r.normal(size=(1, m, 4)), jnp.float32)
    e = jnp.asarray(r.normal(size=(1, 2 * m - 1)), jnp.float32)
    low = lower_edge(si.priors.RelativePosition(e, m), si.scores.Dot(q, k, scale=0.4), v, n,
                     (1,))
    terms = dataclasses.replace(low.terms, dmin=dmin, dmax=dmax, offset=offset,
                                exclude_zero=exclude_zero)
    _passes_against_dense(terms, low.problem, low.batch_shape, r)


def _mask_case(case: str, n: int, m: int) -> np.ndarray:
    """Per-edge masks for the Pallas kernel's block lists, ``(n, m)`` or ``(H, n, m)``."""
    r = np.random.default_rng(11)
    if case == "block_sparse":  # blocks of 16 x 16: whole blocks of the forward's grid
        blocks = r.random((-(-n // 16), -(-m // 16))) < 0.45
        blocks[0, 0] = blocks[1, 0] = False  # child blocks 0 and 1 see only later blocks
        blocks[:, -1] = True
        return np.kron(blocks, np.ones((16, 16), bool))[:n, :m]
    if case == "graph":  # scattered edges, a few rows with no parent
        mk = r.random((n, m)) < 0.2
        mk[[3, 17]] = False
        return mk
    # a mask per head: one block-sparse, one banded (and some rows empty)
    band = np.abs(np.arange(n)[:, None] + 20 - np.arange(m)[None, :]) <= 4
    return np.stack([_mask_case("block_sparse", n, m), band])


#: (mask case, (dmin, dmax) band of the relative-position terms, mask given concretely)
MASK_CASES = [("block_sparse", (None, None), True), ("graph", (None, 30), True),
              ("per_head", (-20, None), True), ("graph", (None, None), False),
              ("per_head", (None, None), False)]


@pytest.mark.parametrize("case,band,concrete", MASK_CASES)
def test_pallas_per_edge_mask_equals_the_dense_kernel(case, band, concrete):
    """A per-edge mask (block-sparse, scattered, one per head) with relative-position
    terms and a distance band through both Pallas passes, small unequal blocks, against
    the dense kernel (values, row log-normalisers and every gradient, the table's
    included): given concretely, each program visits its list of live blocks and reads
    the mask only in partial ones; traced, every block in the band is listed and reads
    it. A block-sparse mask on whole blocks is never read by the forward."""
    import dataclasses

    from structinfer.lowering._spec import Consts

    n, m = 40, 50
    r = np.random.default_rng(5)
    q = jnp.asarray(r.normal(size=(H, n, 8)), jnp.float32)
    k = jnp.asarray(r.normal(size=(H, m, 8)), jnp.float32)
    v = jnp.asarray(r.normal(size=(H, m, 4)), jnp.float32)
    e = jnp.asarray(r.normal(size=(H, 2 * m - 1)), jnp.float32)
    low = lower_edge(si.priors.RelativePosition(e, m), si.scores.Dot(q, k, scale=0.4), v, n,
                     (H,))
    mask = _mask_case(case, n, m)
    terms = dataclasses.replace(low.terms, pair_ok=True, dmin=band[0], dmax=band[1])
    prob = dataclasses.replace(low.problem, const=Consts(pair_ok=jnp.asarray(mask)))
    batch, given = low.batch_shape, mask if concrete else None
    fin = _passes_against_dense(terms, prob, batch, r, mask=given)
    assert not fin.all() or case == "block_sparse"  # rows with no parent are checked too

    def forward(p):
        return accel.pallas_forward(terms, p, batch, block_q=16, block_k=16, interpret=True,
                                    mask=given)

    # which operands the forward reads: the block lists, and the mask itself (int8)
    # unless every live block is whole
    (call,) = eqns_named(jax.make_jaxpr(forward)(prob).jaxpr, "pallas_call", into_kernels=False)
    dtypes = [x.aval.dtype for x in call.invars]
    assert (jnp.dtype(jnp.int8) in dtypes) == (case != "block_sparse" or not concrete)
    assert sum(dt == jnp.int32 and x.aval.ndim == 2
               for dt, x in zip(dtypes, call.invars)) == 1


@pytest.mark.parametrize("case", ["block_sparse", "per_head"])
def test_pallas_block_lists_hold_the_live_blocks(case):
    """The block lists against a brute-force reading of the band and the mask: every
    block with an allowed edge is listed once, as full or partial; a full block has every
    edge allowed (in every head; padding aside, which every tile masks); by parent, the
    same blocks. A block-sparse mask on whole blocks lists exactly its blocks, all full."""
    import dataclasses

    n, m, dmin = 40, 48, (None if case == "block_sparse" else -12)
    mask = _mask_case(case, n, m)
    q = jnp.zeros((H, n, 8))
    low = lower_edge(si.priors.Restricted(mask), si.scores.Dot(q, q[:, :1].repeat(m, 1)),
                     jnp.zeros((H, m, 4)), n, (H,))
    terms = dataclasses.replace(low.terms, dmin=dmin)
    lay = accel.Layout(terms, low.problem, low.batch_shape, 16, 16)
    d = np.arange(n)[:, None] - np.arange(m)[None, :]
    ok = np.broadcast_to(mask & (d >= (-np.inf if dmin is None else dmin)), (H, n, m))
    padded = np.ones((H, lay.n_pad, lay.m_pad), bool)  # padding: allowed for "full"
    padded[:, :n, :m] = ok
    allowed = np.zeros_like(padded)
    allowed[:, :n, :m] = ok
    tiles = lambda x: x.reshape(H, lay.nqb, 16, lay.nkb, 16)  # noqa: E731
    some = tiles(allowed).any(axis=(0, 2, 4))
    every = tiles(padded).all(axis=(0, 2, 4))
    for by_parent in (False, True):
        grids = accel._block_grids(terms, mask, lay)
        table, needs_mask = accel.block_table(grids, by_parent), grids[2]
        assert needs_mask == (case != "block_sparse")
        listed = np.zeros((lay.nqb, lay.nkb), int)
        full = np.zeros((lay.nqb, lay.nkb), bool)
        for r, row in enumerate(table):
            nf, npart = row[:2]
            assert not row[2 + nf + npart:].any()
            for u, c in enumerate(row[2:2 + nf + npart]):
                blk = (c, r) if by_parent else (r, c)
                listed[blk] += 1
                full[blk] = u < nf
        assert listed.max() == 1 and (listed[some] == 1).all()
        assert not (full & ~every).any()
        if case == "block_sparse":
            np.testing.assert_array_equal(listed == 1, some)
            np.testing.assert_array_equal(full, some)


def test_block_sparse_and_graph_priors_run_on_pallas(gpu):
    """A block-sparse and a graph prior through the model path: on a (faked) GPU ``auto``
    takes the Pallas kernel (cuDNN takes no per-edge mask), and the interpreted kernel
    equals the dense one, values and gradients, eager and under ``jit`` with the mask
    known at trace time; and with the same mask traced (a `Restricted` prior of a jitted
    function's argument)."""
    n = 144  # 144^2 logits: above the dense kernel's limit
    r = np.random.default_rng(4)
    blocks = r.random((9, 9)) < 0.3
    blocks[np.arange(9), np.arange(9)] = True
    adjacency = r.random((n, n)) < 0.05
    priors = {"block_sparse": si.priors.Restricted.block_sparse(blocks, 16),
              "graph": si.priors.Restricted.from_graph(adjacency, self_loops=True)}

    def model_of(prior_of):
        def model(q, k, v, *mask):
            with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
                j = si.edge("phi", prior_of(*mask), si.scores.Dot(q, k, scale=0.25))
                numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

        return model

    q, k, v = _inputs(jnp.float32, n=n)
    traced = si.attention(model_of(si.priors.Restricted), "out", "pallas", block_q=16,
                          block_k=16)
    loss = lambda g, *a: lambda q, k, v: jnp.sum(jnp.sin(g(q, k, v, *a)))  # noqa: E731
    for name, prior in priors.items():
        model = model_of(lambda prior=prior: prior)
        ex = explain(model, "out", q, k, v)
        assert ex.kernels == {"phi": "pallas"} and "not cuDNN: a per-edge mask" in str(ex), (
            name, str(ex))
        dense = si.attention(model, "out", "dense")
        ref = dense(q, k, v)
        f = si.attention(model, "out", "pallas", block_q=16, block_k=16)
        np.testing.assert_allclose(f(q, k, v), ref, atol=2e-5)  # eager
        np.testing.assert_allclose(jax.jit(f)(q, k, v), ref, atol=2e-5)  # mask known
        mask = jnp.asarray(prior.mask)
        np.testing.assert_allclose(jax.jit(traced)(q, k, v, mask), ref, atol=2e-5)
        g0 = jax.jit(jax.grad(loss(dense), (0, 1, 2)))(q, k, v)
        for g1 in (jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v),
                   jax.jit(jax.grad(loss(traced, mask), (0, 1, 2)))(q, k, v)):
            for a, b in zip(g0, g1):
                np.testing.assert_allclose(b, a, atol=5e-5)


def test_a_concrete_mask_reaches_the_pallas_passes():
    """Through the model path, a block-sparse mask known at trace time reaches the Pallas
    forward and backward (``blocked_attention`` hands it to them): on blocks of 128, whole
    tiles of every pass, each pass reads its block table and never the mask; the same
    mask traced is read by every pass."""
    n = 256
    blocks = np.array([[True, False], [True, True]])

    def model(q, k, v, *mask):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            prior = (si.priors.Restricted(*mask) if mask
                     else si.priors.Restricted.block_sparse(blocks, 128))
            j = si.edge("phi", prior, si.scores.Dot(q, k, scale=0.25))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    q, k, v = _inputs(jnp.float32, n=n)
    f = si.attention(model, "out", "pallas")
    mask = jnp.asarray(np.kron(blocks, np.ones((128, 128), bool)))
    for extra, reads_mask in (((), False), ((mask,), True)):
        grad = jax.grad(lambda q, *a, extra=extra: jnp.sum(f(q, *a, *extra) ** 2))
        calls = eqns_named(jax.make_jaxpr(grad)(q, k, v).jaxpr, "pallas_call")
        assert len(calls) == 3, calls  # forward, dK/dV, dQ
        for call in calls:
            dtypes = [x.aval.dtype for x in call.invars]
            assert (jnp.dtype(jnp.int8) in dtypes) == reads_mask
            assert jnp.dtype(jnp.int32) in dtypes  # the block table


def test_a_mask_of_the_wrong_shape_is_named():
    """``mask=`` of the Pallas passes must broadcast to the edge's ``(..., n, m)``: else a
    ValueError names the argument, the shape given and the one expected."""
    n = 40
    mask = _mask_case("graph", n, n)
    q, k, v = _inputs(jnp.float32, n=n)
    low = lower_edge(si.priors.Restricted(mask), si.scores.Dot(q, k), v, n, (H,))
    y, lse = jnp.zeros((H, n, v.shape[-1])), jnp.zeros((H, n))
    stats = RowStats(lse, lse)
    for call in (
        lambda mk: accel.pallas_forward(low.terms, low.problem, (H,), interpret=True,
                                        mask=mk),
        lambda mk: accel.pallas_backward(low.terms, low.problem, (H,), y, stats, y, lse,
                                         interpret=True, mask=mk),
    ):
        with pytest.raises(ValueError, match=r"mask of shape \(40, 39\).*\(\.\.\., 40, 40\)"):
            call(mask[:, :-1])


def test_a_replacement_pass_without_a_mask_argument_is_not_given_one():
    """``blocked_attention`` hands the concrete per-edge mask only to a replacement pass
    that takes a ``mask`` argument: one written before (no such argument) still runs,
    reading the mask in every block, and equals the one given it."""
    from structinfer.lowering.blocked import blocked_attention

    n = 40
    mask = _mask_case("graph", n, n)
    q, k, v = _inputs(jnp.float32, n=n)
    low = lower_edge(si.priors.Restricted(mask), si.scores.Dot(q, k, scale=0.4), v, n, (H,))

    def old_forward(terms, prob, batch, *, precision=None):
        return accel.pallas_forward(terms, prob, batch, block_q=16, block_k=16,
                                    interpret=True, precision=precision)

    def new_forward(terms, prob, batch, **kw):
        return accel.pallas_forward(terms, prob, batch, block_q=16, block_k=16,
                                    interpret=True, **kw)

    ys = [jax.jit(lambda p, fw=fw: blocked_attention(
        low.terms, p, (H,), mask=low.mask, forward=fw)[0])(low.problem)
        for fw in (old_forward, new_forward)]
    np.testing.assert_allclose(ys[0], ys[1], atol=1e-6)
    fin = np.isfinite(np.asarray(ys[0]))
    ref = dense_attention(low.terms, low.problem, (H,))[0]
    np.testing.assert_allclose(np.where(fin, ys[0], 0.0), np.where(fin, ref, 0.0), atol=2e-5)


def test_pallas_full_block_ranges_hold_exactly_the_blocks_with_every_edge_allowed():
    """The tiles computed without a mask (`full_parents` for the forward and dQ passes,
    `full_children` for dK/dV) against a brute-force reading of the band: exactly the
    blocks whose every edge (padded children included, no padded parent) is inside the
    distance band, over bands with both, one or no bound, positive, zero and negative
    offsets and block sizes of 16 and 32, for each program."""
    import dataclasses

    q = jnp.zeros((1, 35, 8))
    k = jnp.zeros((1, 70, 8))
    low = lower_edge(si.priors.Uniform(70), si.scores.Dot(q, k), jnp.zeros((1, 70, 4)), 35,
                     (1,))
    for dmin, dmax, offset in [(None, -3, 0), (0, None, 0), (2, None, 20), (-20, 30, 15),
                               (5, 40, -3), (None, None, 7), (40, None, 0), (-60, -2, 9)]:
        terms = dataclasses.replace(low.terms, dmin=dmin, dmax=dmax, offset=offset)
        for bq, bk in [(16, 16), (16, 32), (32, 16)]:
            nqb, nkb = -(-35 // bq), -(-70 // bk)
            i = np.arange(nqb * bq).reshape(nqb, bq)
            j = np.arange(nkb * bk).reshape(nkb, bk)
            d = i[:, None, :, None] + offset - j[None, :, None, :]  # (a, t, i, j)
            ok = (j < 70)[None, :, None, :] & np.ones_like(d, bool)
            if dmin is not None:
                ok &= d >= dmin
            if dmax is not None:
                ok &= d <= dmax
            every = ok.all(axis=(2, 3))  # (a, t)
            a = jnp.arange(nqb, dtype=jnp.int32)
            lo, hi = (np.broadcast_to(x, a.shape)
                      for x in accel.full_parents(terms, a, bq, bk, offset))
            got = np.arange(nkb)[None, :] >= lo[:, None]
            got &= np.arange(nkb)[None, :] < hi[:, None]
            np.testing.assert_array_equal(got, every, err_msg=str((dmin, dmax, offset, bq, bk)))
            t = jnp.arange(nkb, dtype=jnp.int32)
            lo, hi = (np.broadcast_to(x, t.shape)
                      for x in accel.full_children(terms, t, bq, bk, nqb, offset))
            got = np.arange(nqb)[None, :] >= lo[:, None]
            got &= np.arange(nqb)[None, :] < hi[:, None]
            np.testing.assert_array_equal(got, every.T, err_msg=str((dmin, dmax, offset, bq, bk)))
    excluded = dataclasses.replace(low.terms, dmin=-4, dmax=4, exclude_zero=True)
    assert accel.full_parents(excluded, 0, 16, 16, 0) is None
    assert accel.full_children(excluded, 0, 16, 16, 3, 0) is None


TILE_CASES = {  # prior(n, m, e), children n, parents m, blocks, the queries' batch
    "full_causal_offset": (lambda n, m, e: si.priors.RelativePosition(
        e[..., :2 * m - 1], m, offset=m - n, causal=True), 37, 45, (16, 32), (H,)),
    "clipped": (lambda n, m, e: si.priors.RelativePosition(e[..., :9], m, max_distance=4),
                37, 45, (32, 16), (H,)),
    # a batch of 3 with one table each, shared by the heads: tiles per table, picked by
    # the batch element's index
    "circulant_batch": (lambda n, m, e: si.priors.RelativePosition.circulant(
        e[:1, :m] + jnp.arange(3.0)[:, None, None], causal=True), 29, 29, (32, 16), (3, H)),
}


# (each compiles the Pallas passes interpreted, ~4 s: the batch of tables by default)
@pytest.mark.parametrize("case", matrix(list(TILE_CASES), lambda c: c == "circulant_batch"))
def test_pallas_relative_position_tiles_equal_the_lookup(case, monkeypatch):
    """The relative-position table expanded per block diagonal (`relpos_tiles`, read by
    the backward's passes by default) holds the very entries the lookup per element
    reads: the forward and every gradient of the three passes are equal bit for bit, on
    unequal block sizes, n != m, an offset, causal, clipped and circulant distances, a
    table shared by a batch (interpreted everywhere). The default reads the tiles in the backward
    only (the forward measured faster with the lookup), never for a shard (a traced
    offset) or past `RELPOS_TILES_MAX_BYTES`."""
    prior_fn, n, m, (bq, bk), batch = TILE_CASES[case]
    r = np.random.default_rng(6)
    q = jnp.asarray(r.normal(size=batch + (n, 8)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(H, m, 8)), jnp.float32) for _ in range(2))
    e = jnp.asarray(r.normal(size=(H, 2 * m - 1)), jnp.float32)
    low = lower_edge(prior_fn(n, m, e), si.scores.Dot(q, k, scale=0.4), v, n, batch)
    ct = jnp.asarray(r.normal(size=batch + (n, 8)), jnp.float32)

    def passes(p, tiles=None, starts=None):
        kw = dict(block_q=bq, block_k=bk, tiles=tiles, starts=starts, interpret=True)
        y, stats = accel.pallas_forward(low.terms, p, batch, stats=True, **kw)
        return y, stats.lse(), accel.pallas_backward(low.terms, p, batch, y, stats, ct,
                                                     jnp.ones_like(stats.m), **kw)

    looked_up, tiled = (jax.jit(lambda p, t=t: passes(p, t))(low.problem) for t in (False, True))
    # the table's gradient is summed by a scatter-add, whose order a GPU does not fix (the
    # interpreter's too): equal to rounding there, everything else bit for bit
    (*rest_a, d_glob_a), (*rest_b, d_glob_b) = (x[:2] + (x[2][:3] + x[2][4:], x[2][3])
                                                for x in (looked_up, tiled))
    assert float(jnp.abs(d_glob_b.relpos).max()) > 1e-3
    np.testing.assert_allclose(d_glob_b.relpos, d_glob_a.relpos, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(rest_a), jax.tree.leaves(rest_b)):
        np.testing.assert_array_equal(b, a)

    def reads_tiles(**kw):  # which pallas_calls (forward, dK/dV, dQ, table) take tiles
        jaxpr = jax.make_jaxpr(lambda p: passes(p, **kw))(low.problem).jaxpr
        return [any(x.aval.ndim == 4 for x in e.invars)
                for e in eqns_named(jaxpr, "pallas_call", into_kernels=False)]

    assert reads_tiles() == [False, True, True, True]
    tiles = [x.aval.shape for e in eqns_named(jax.make_jaxpr(passes)(low.problem).jaxpr,
                                              "pallas_call", into_kernels=False)
             for x in e.invars if x.aval.ndim == 4]
    tables = int(np.prod(low.problem.glob.relpos.shape[:-1]))  # not one set per (batch, head)
    assert {t[0] for t in tiles} == {tables}
    assert reads_tiles(starts=(jnp.int32(0), jnp.int32(0))) == [False] * 4
    monkeypatch.setattr(accel, "RELPOS_TILES_MAX_BYTES", 0)
    assert reads_tiles() == [False] * 4


@pytest.mark.parametrize("case", list(TILE_CASES))
@pytest.mark.parametrize("square", [False, True])
def test_relpos_tiles_grad_is_the_transpose_of_relpos_tiles(case, square):
    """`relpos_tiles_grad` (diagonal sums, then a small scatter) is the VJP of
    `relpos_tiles` that autodiff gives (a scatter of every tile entry), to float32
    rounding: causal, clipped and circulant distances, an offset, unequal and square
    blocks, one table per batch element."""
    prior_fn, n, m, (bq, bk), batch = TILE_CASES[case]
    if square:
        bq = bk = 16
    r = np.random.default_rng(8)
    e = jnp.asarray(r.normal(size=(H, 2 * m - 1)), jnp.float32)
    q = jnp.zeros(batch + (n, 8), jnp.float32)
    k = jnp.zeros((H, m, 8), jnp.float32)
    low = lower_edge(prior_fn(n, m, e), si.scores.Dot(q, k), k, n, batch)
    table = low.problem.glob.relpos
    n_pad, m_pad = -(-n // bq) * bq, -(-m // bk) * bk
    tiles, vjp = jax.vjp(lambda t: accel.relpos_tiles(low.terms, t, bq, bk, n_pad, m_pad),
                         table)
    ct = jnp.asarray(r.normal(size=tiles.shape), jnp.float32)
    (want,) = vjp(ct)
    got = accel.relpos_tiles_grad(low.terms, ct, table.shape[-1], n_pad, m_pad)
    assert got.shape == table.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="relpos_tiles_grad: .* tiles, expected"):
        accel.relpos_tiles_grad(low.terms, ct[..., 1:, :, :], table.shape[-1], n_pad, m_pad)


def test_pallas_relative_position_pass_runs_only_for_its_gradient():
    """The relative-position table's gradient (atomics, a pass of its own) is traced only
    when the table is differentiated: a layer with a fixed table pays nothing for it."""
    n, m = 20, 24
    r = np.random.default_rng(5)
    q, k, v = (jnp.asarray(r.normal(size=(H, s, 8)), jnp.float32) for s in (n, m, m))
    e = jnp.asarray(r.normal(size=(H, 2 * m - 1)), jnp.float32)
    f = si.attention(_pallas_model(PALLAS_CASES["relpos_clipped"], n, m), "out", "pallas",
                     block_q=16, block_k=16)

    def loss(q, k, v, e):
        return jnp.sum(f(q, k, v, e) ** 2)

    def passes(argnums):
        text = str(jax.make_jaxpr(jax.grad(loss, argnums=argnums))(q, k, v, e))
        return ("structinfer_attention_dkdv" in text, "structinfer_attention_drelpos" in text)

    assert passes((0, 1, 2)) == (True, False)
    assert passes((0, 3)) == (True, True)


@pytest.mark.parametrize("backend", ["pallas", "blocked"])
def test_backward_padding_rows_do_not_overflow_into_nan(backend):
    """Regression (review): padding rows (n = 37 in blocks of 16) have finite logits and no
    log-normaliser; a large relative-position bias overflowed their e^s to inf, and the
    backward's zero cotangent there became inf * 0 = NaN in dK, dV and the bias' gradient
    (both the Pallas and the portable blocked kernel's backward)."""
    n, m = 37, 45
    r = np.random.default_rng(7)
    q, k, v = (jnp.asarray(r.normal(size=(H, s, 8)), jnp.float32) for s in (n, m, m))
    e = jnp.asarray(100.0 + r.normal(size=(H, 2 * m - 1)), jnp.float32)  # e^100 = inf
    prior = lambda n, m, e: si.priors.RelativePosition(e, m)  # noqa: E731
    model = _pallas_model(prior, n, m)

    def loss(g):
        return lambda q, k, v, e: jnp.sum(jnp.sin(g(q, k, v, e)))

    f = si.attention(model, "out", backend, block_q=16, block_k=16)
    g1 = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2, 3)))(q, k, v, e)
    g0 = jax.jit(jax.grad(loss(si.attention(model, "out", "dense")), argnums=(0, 1, 2, 3)))(
        q, k, v, e)
    for a, b in zip(g0, g1):
        assert np.isfinite(b).all()
        np.testing.assert_allclose(b, a, atol=5e-5)


def test_pallas_bfloat16_values_and_gradients_within_bfloat16_tolerance():
    """bfloat16 in: the kernels multiply in bfloat16 and accumulate in float32; values and
    gradients match a float32 reference to bfloat16's precision."""
    n, m = 40, 48
    r = np.random.default_rng(6)
    q32, k32, v32 = (jnp.asarray(r.normal(size=(H, s, 16)), jnp.float32) for s in (n, m, m))
    e = jnp.asarray(0.5 * r.normal(size=(H, 2 * m - 1)), jnp.float32)
    for case in ("relpos_clipped", "geometric_trunc", "mask"):
        model = _pallas_model(PALLAS_CASES[case], n, m)
        f = si.attention(model, "out", "pallas", block_q=16, block_k=16)
        dense = si.attention(model, "out", "dense")

        def loss(g, q, k, v):
            return jnp.sum(g(q, k, v, e).astype(jnp.float32) * v32[..., :1, :])

        bf = [x.astype(jnp.bfloat16) for x in (q32, k32, v32)]
        y = jax.jit(f)(*bf, e)
        assert y.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(y, np.float32), dense(q32, k32, v32, e),
                                   atol=3e-2)
        g1 = jax.jit(jax.grad(lambda *a: loss(f, *a), argnums=(0, 1, 2)))(*bf)
        g0 = jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(q32, k32, v32)
        for a, b in zip(g0, g1):
            assert b.dtype == jnp.bfloat16
            scale = float(np.abs(a).max())
            np.testing.assert_allclose(np.asarray(b, np.float32), a, atol=3e-2 * scale)


def test_pallas_model_path_writes_the_nan_rows_in_the_kernel():
    """The Pallas forward writes the rows of non-finite L as NaN itself (a traced mask
    with an empty row: NaN there, the dense kernel's values elsewhere), so the model
    path holds no select over the output outside the kernel (one pass over y less)."""
    n = N
    q, k, v = _inputs(jnp.float32, n=n)
    mask = np.tril(np.ones((n, n), bool))
    mask[5] = False

    def model(q, k, v, mask):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", si.priors.Restricted(mask), si.scores.Dot(q, k, scale=0.3))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    f = si.attention(model, "out", "pallas")
    y = np.asarray(jax.jit(f)(q, k, v, mask))
    assert np.isnan(y).any(-1).tolist() == [[i == 5 for i in range(n)]] * H
    ref = np.asarray(jax.jit(si.attention(model, "out", "dense"))(q, k, v, mask))
    np.testing.assert_allclose(np.delete(y, 5, 1), np.delete(ref, 5, 1), atol=2e-5)
    selects = [e for e in eqns_named(jax.make_jaxpr(f)(q, k, v, mask).jaxpr, "select_n",
                                     into_kernels=False)
               if e.outvars[0].aval.shape == y.shape]
    assert not selects, selects


@pytest.mark.parametrize("causal", [False, True])
def test_pallas_relative_position_atomics_mask_in_the_values_shape_or_none(causal):
    """Regression (H200, JAX 0.11.2): Triton refused the relative-position table's atomic
    add ('tt.atomic_rmw' op failed to verify that mask type matches value type) when the
    edge had no distance band: the mask was one row, broadcast, not the tile's shape. The
    per-diagonal pass adds without a mask (its sums are zero off the allowed edges and its
    indices are clipped into the table, `test_pallas_diagonals_hold_every_allowed_pair`)."""
    n = 40
    r = np.random.default_rng(4)
    q, k, v = (jnp.asarray(r.normal(size=(H, n, 16)), jnp.bfloat16) for _ in range(3))
    bias = jnp.asarray(r.normal(size=(H, 2 * n - 1)), jnp.float32)
    low = lower_edge(si.priors.RelativePosition(bias, n, causal=causal),
                     si.scores.Dot(q, k, scale=0.25), v, n, (H,))

    def grads(p):
        y, stats = accel.pallas_forward(low.terms, p, low.batch_shape, interpret=False,
                                        stats=True)
        return accel.pallas_backward(low.terms, p, low.batch_shape, y, stats,
                                     jnp.ones_like(y), jnp.zeros_like(stats.m),
                                     interpret=False)[3]

    eqns = eqns_named(jax.make_jaxpr(grads)(low.problem).jaxpr, "atomic_rmw")
    assert eqns
    for eqn in eqns:
        _, _, val, mask = eqn.params["args_tree"].unflatten(eqn.invars)
        assert mask is None or mask.aval.shape == val.aval.shape


def test_pallas_diagonals_hold_every_allowed_pair():
    """The relative-position gradient's live block diagonals (`_diagonals`) against brute
    force over every (child, parent) pair: random sizes, square blocks, offsets and
    distance bands, including bands with no allowed pair (an empty range)."""
    import dataclasses

    from structinfer.lowering.accel import _diagonals

    rng = np.random.default_rng(11)
    q = jnp.zeros((1, 4, 8), jnp.float32)
    v = jnp.zeros((1, 4, 2), jnp.float32)
    low = lower_edge(si.priors.Uniform(4), si.scores.Dot(q, q), v, 4, (1,))
    empty = 0
    for _ in range(400):
        n, m, b = int(rng.integers(1, 70)), int(rng.integers(1, 70)), int(rng.choice([16, 32]))
        offset = int(rng.integers(-80, 80))
        lo, hi = (None if rng.random() < 0.3 else int(rng.integers(-100, 100)) for _ in "ab")
        terms = dataclasses.replace(low.terms, num_children=n, num_parents=m, offset=offset,
                                    dmin=lo, dmax=hi)
        nqb, nkb = -(-n // b), -(-m // b)
        first, last = _diagonals(terms, b, nqb, nkb)
        i, j = np.arange(n)[:, None], np.arange(m)[None, :]
        d = i + offset - j
        ok = np.ones_like(d, bool)
        if lo is not None:
            ok &= d >= lo
        if hi is not None:
            ok &= d <= hi
        want = set((j // b - i // b)[ok].ravel().tolist())
        empty += not want
        assert all(first <= w <= last for w in want), (n, m, b, offset, lo, hi)
        # no diagonal outside the band: each one in the range holds an allowed distance
        for w in range(first, last + 1):
            dd = offset - w * b + np.arange(-(b - 1), b)
            assert (lo is None or dd.max() >= lo) and (hi is None or dd.min() <= hi)
    assert empty > 0  # the empty range was exercised


def test_pallas_backward_runs_four_warps_by_default():
    """Regression (H100, bfloat16, head dim 128, n = 4096): the backward passes inherited the
    forward's 8 warps for wide heads and ran 1.5-2x slower than with 4 (the tuning sweep in
    docs/benchmarks.md); every backward launch now defaults to 4."""
    n = 40
    r = np.random.default_rng(4)
    q, k, v = (jnp.asarray(r.normal(size=(H, n, 128)), jnp.bfloat16) for _ in range(3))
    bias = jnp.asarray(r.normal(size=(H, 2 * n - 1)), jnp.float32)
    low = lower_edge(si.priors.RelativePosition(bias, n), si.scores.Dot(q, k, scale=0.1), v,
                     n, (H,))

    def grads(p):
        y, stats = accel.pallas_forward(low.terms, p, low.batch_shape, interpret=False,
                                        stats=True)
        return accel.pallas_backward(low.terms, p, low.batch_shape, y, stats,
                                     jnp.ones_like(y), jnp.zeros_like(stats.m),
                                     interpret=False)

    calls = eqns_named(jax.make_jaxpr(grads)(low.problem).jaxpr, "pallas_call",
                       into_kernels=False)
    params = [e.params["compiler_params"] for e in calls]  # (a dict on older JAX)
    warps = [p["triton"]["num_warps"] if isinstance(p, dict) else p.num_warps
             for p in params]
    assert warps == [8, 4, 4, 4]  # forward, dK/dV, dQ, the table's gradient


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.exhaustive),
                                   jnp.bfloat16])
def test_pallas_kernel_lowers_to_triton_for_cuda(dtype):
    """Lowering (not running) for CUDA on this CPU: every operation of the kernel body
    must have a Triton lowering (a gather of the relative-position bias included)."""
    r = np.random.default_rng(3)
    n = 200
    q, k, v = (jnp.asarray(r.normal(size=(H, n, 64)), dtype) for _ in range(3))
    bias = jnp.asarray(r.normal(size=(H, 2 * n - 1)), dtype)
    sparse = np.kron(np.tri(4, dtype=bool), np.ones((50, 50), bool))  # partial tiles
    priors = [si.priors.RelativePosition(bias, n, causal=True),
              si.priors.Geometric(jnp.asarray(0.05, dtype), n, max_distance=64),
              si.priors.Restricted(sparse),
              si.priors.Restricted.block_sparse(np.tri(4, dtype=bool), 50),  # a BlockMask
              # a BlockMask with tiles fitted to its blocks (the last one cut short)
              si.priors.Restricted.block_sparse(np.tri(7, dtype=bool), 32, n, n)]
    for prior in priors:
        low = lower_edge(prior, si.scores.Dot(q, k, scale=0.125), v, n, (H,))
        # a per-edge mask: its block lists (scalar loads, loop bounds) with the mask
        # known, every block reading the int8 mask without
        for mask in ((low.mask, None) if low.terms.pair_ok else (None,)):
            f = jax.jit(lambda p, low=low, mask=mask: accel.pallas_forward(
                low.terms, p, low.batch_shape, interpret=False, mask=mask, nan_rows=True))
            text = f.trace(low.problem).lower(lowering_platforms=("cuda",)).as_text()
            assert "triton" in text

            def grads(p, low=low, mask=mask):  # the backward passes (atomics: the table)
                y, stats = accel.pallas_forward(low.terms, p, low.batch_shape,
                                                interpret=False, mask=mask, stats=True)
                return accel.pallas_backward(low.terms, p, low.batch_shape, y, stats,
                                             jnp.ones_like(y), jnp.zeros_like(stats.m),
                                             interpret=False, mask=mask)

            text = jax.jit(grads).trace(low.problem).lower(
                lowering_platforms=("cuda",)).as_text()
            assert text.count("triton") >= 3 + (low.terms.relpos is not None)


# (each ~4 s: a relative-position table with a mask by default)
@pytest.mark.parametrize("case", matrix(["relpos_causal", "geometric_trunc", "relpos_mask"],
                                        lambda c: c == "relpos_mask"))
def test_pallas_passes_take_traced_start_offsets(case):
    """A chunk of a longer sequence, as each step of ring attention runs it: the Pallas
    forward and backward given traced global starts ``(i0, j0)`` equal the blocked kernel
    given the same starts — the output, the row log-normaliser (rows of the chunk with no
    allowed parent included) and the VJP with a nonzero cotangent of the log-normaliser
    (ring attention merges its steps by it), to the queries, keys, values and the prior's
    parameters; with a per-edge mask too (the chunk's slice of it, read in every block)."""
    import dataclasses

    from structinfer.lowering._spec import Consts
    from structinfer.lowering.blocked import blocked_attention, make_schedule

    N, n, m, i0, j0 = 48, 20, 24, 4, 12  # children 4..23 against parents 12..35
    r = np.random.default_rng(12)
    q, k = (jnp.asarray(r.normal(size=(H, N, 8)), jnp.float32) for _ in range(2))
    v = jnp.asarray(r.normal(size=(H, N, 4)), jnp.float32)
    e = jnp.asarray(0.5 * r.normal(size=(H, 2 * N - 1)), jnp.float32)
    prior = (si.priors.RelativePosition(e, N, causal=True) if case.startswith("relpos") else
             si.priors.Geometric(0.05 + 0.5 * jax.nn.sigmoid(e[..., :N]), N, max_distance=6))
    low = lower_edge(prior, si.scores.Dot(q, k, scale=0.4), v, N, (H,))
    terms = dataclasses.replace(low.terms, num_children=n, num_parents=m)
    p = low.problem
    chunk = dataclasses.replace(p, row=jax.tree.map(lambda x: x[..., i0:i0 + n, :], p.row),
                                col=jax.tree.map(lambda x: x[..., j0:j0 + m, :], p.col),
                                v=p.v[..., j0:j0 + m, :])
    if case == "relpos_mask":  # scattered edges; the chunk reads its own slice
        mask = r.random((N, N)) < 0.5
        terms = dataclasses.replace(terms, pair_ok=True)
        chunk = dataclasses.replace(chunk, const=Consts(pair_ok=jnp.asarray(
            mask[i0:i0 + n, j0:j0 + m])))
    sched = make_schedule(dataclasses.replace(terms, dmin=None, dmax=None), 8, 8)

    def run(pallas):
        hooks = (dict(forward=accel.pallas_forward, backward=accel.pallas_backward) if pallas
                 else {})

        def f(prob, starts):
            return blocked_attention(terms, prob, (H,), schedule=sched, starts=starts,
                                     **hooks)

        return jax.jit(lambda prob, starts, ct: jax.vjp(lambda x: f(x, starts), prob)[1](ct)
                       + f(prob, starts))

    y0, l0 = blocked_attention(terms, chunk, (H,), schedule=sched, starts=(i0, j0))
    fin = np.isfinite(l0)
    assert not fin.all() and fin.any()  # children 4..11 have no parent in this chunk
    ct = (jnp.where(fin[..., None], jnp.asarray(r.normal(size=y0.shape), jnp.float32), 0.0),
          jnp.where(fin, jnp.asarray(r.normal(size=l0.shape), jnp.float32), 0.0))
    starts = (jnp.int32(i0), jnp.int32(j0))
    (g0, ya, la), (g1, yb, lb) = run(False)(chunk, starts, ct), run(True)(chunk, starts, ct)
    np.testing.assert_array_equal(np.isfinite(lb), fin)
    np.testing.assert_allclose(np.where(fin, lb, 0.0), np.where(fin, la, 0.0), atol=1e-5)
    np.testing.assert_allclose(np.where(fin[..., None], yb, 0.0),
                               np.where(fin[..., None], ya, 0.0), atol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        if a.dtype != jax.dtypes.float0:  # the mask's (no) gradient
            np.testing.assert_allclose(b, a, atol=5e-5)
    assert float(np.abs(g1.row.geo if case == "geometric_trunc" else g1.row.q).max()) > 1e-3
    if case.startswith("relpos"):  # and Triton takes the traced offset (lowered for CUDA)
        def passes(prob, starts):
            kw = dict(interpret=False, starts=starts)
            y, stats = accel.pallas_forward(terms, prob, (H,), stats=True, **kw)
            return accel.pallas_backward(terms, prob, (H,), y, stats, jnp.ones_like(y),
                                         jnp.ones_like(stats.m), **kw)

        text = jax.jit(passes).trace(chunk, starts).lower(lowering_platforms=("cuda",))
        assert text.as_text().count("triton") >= 4  # forward, dK/dV, dQ, the table


@pytest.mark.parametrize("causal", [False, True])
def test_pallas_gradients_of_rows_of_huge_logits(causal):
    r"""Regression: the Pallas passes (interpreted) on rows whose every key carries a
    finite -1e9 bias, where float32 rounds the row max $m$ and $L = m + \log l$ to the
    same number: the backward rebuilds $p = e^{s - m - \log l}$ from the forward's saved
    $m$ and $\log l$ (not $e^{s - L} = 1$), so y, L and dq, dk, dbias, dv (a cotangent on
    y and on L) equal a plain float32 softmax's of the same rounded logits; with a causal
    per-edge mask too (rows of different lengths)."""
    from structinfer.lowering.blocked import blocked_attention

    n, d = 24, 8
    mask = np.tri(n, dtype=bool) if causal else None
    low = huge_logit_edge(n, d, jnp.float32, mask)
    ct = huge_logit_cotangents(low)
    ref = jax.vjp(lambda p: float32_softmax(p, mask), low.problem)

    def f(p):
        return blocked_attention(low.terms, p, (H,), mask=low.mask,
                                 forward=accel.pallas_forward, backward=accel.pallas_backward)

    out, vjp = jax.vjp(f, low.problem)
    np.testing.assert_allclose(out[0], ref[0][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[1], ref[0][1], rtol=1e-6)
    assert_huge_logit_gradients(vjp(ct)[0], ref[1](ct)[0])


@pytest.mark.parametrize("entry", ["pallas_backward", "mosaic_backward", "mosaic_dq",
                                   "mosaic_dkdv"])
def test_the_backward_entry_points_refuse_the_log_normaliser_alone(entry):
    """Regression: the backward entry points took an array of row log-normalisers L in
    place of the forward's statistics, read as m = L, log l = 0: on rows of huge logits
    (every logit near -1e9, where float32 rounds log l out of L) that gave finite wrong
    gradients. They take the forward's statistics only (``stats=True``) and name the
    argument when given an array."""
    from structinfer.lowering import mosaic

    low = huge_logit_edge(24, 8, jnp.float32)
    y, stats = accel.pallas_forward(low.terms, low.problem, (2,), interpret=True, stats=True)
    dy, dl = huge_logit_cotangents(low)
    run = getattr(accel, entry, None) or getattr(mosaic, entry)
    lse = stats.lse()
    args = (y, lse, dy, dl) if entry.endswith("backward") else (dy, lse, jnp.zeros_like(lse))
    with pytest.raises(TypeError, match=rf"{entry}: stats must be the forward's row "
                                        r"statistics .*got an array of shape \(2, 24\)"):
        run(low.terms, low.problem, (2,), *args)


def test_backward_probabilities_of_a_row_with_no_edge_are_zero():
    """Regression (review): the backward's p must be 0 on a row with no edge (log l = -inf,
    L = -inf: a padding row) whatever its logits and max, also NaN or +inf ones (a
    non-finite key or bias read only by padding rows): else the gradients of the parents
    only padding rows see turn NaN. Both backwards (blocked, Pallas) compute p here; it is
    e^{(s - m) - log l}, uniform on a row of equal huge logits (where L rounds to m)."""
    from structinfer.lowering._softmax import backward_probs

    s = jnp.array([[0.5, jnp.nan, jnp.inf, -jnp.inf], [1.0, 2.0, 3.0, -jnp.inf],
                   [-1e9, -1e9, -1e9, -jnp.inf]])
    m = jnp.array([jnp.nan, 3.0, -1e9])
    log_l = jnp.array([-jnp.inf, 0.5, np.log(3.0)])
    p = np.asarray(backward_probs(s, m[:, None], log_l[:, None]))
    np.testing.assert_array_equal(p[0], 0.0)
    np.testing.assert_allclose(p[1], np.exp(np.array([1.0, 2.0, 3.0, -np.inf]) - 3.5))
    np.testing.assert_allclose(p[2], [1 / 3, 1 / 3, 1 / 3, 0.0], rtol=1e-6)
    assert RowStats(m, log_l).lse()[2] == m[2]  # what e^{s - L} would have read
    # transposed blocks pass the statistics along the last axis
    np.testing.assert_array_equal(
        np.asarray(backward_probs(s.T, m[None, :], log_l[None, :])), p.T)


@pytest.mark.parametrize("pass_through", [False, True])
def test_nan_rows_are_written_in_every_mode(pass_through):
    """`with_nan_rows` on a finite output (as cuDNN returns for a row whose scores are all
    -inf): NaN in exactly the rows of non-finite L (-inf, +inf, NaN), in the output's
    dtype, eagerly, under ``jit`` and ``vmap``; differentiated, the kept rows' cotangent
    passes (``pass_through``: as the identity, not differentiated: the scatter)."""
    from structinfer.lowering._softmax import with_nan_rows

    y = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5, 4)), jnp.bfloat16)
    lse = (jnp.zeros((2, 3, 5)).at[0, 1, 2].set(-jnp.inf).at[1, 2, 4].set(jnp.nan)
           .at[1, 0, 0].set(jnp.inf))
    bad = ~np.isfinite(np.asarray(lse))
    f = functools.partial(with_nan_rows, pass_through=pass_through)
    vjp_out = lambda y, lse: jax.vjp(f, y, lse)[0]  # noqa: E731 - differentiated
    for g in (f, jax.jit(f), jax.vmap(f), jax.jit(jax.vmap(jax.vmap(f))), vjp_out,
              jax.jit(vjp_out)):
        out = g(y, lse)
        assert out.dtype == jnp.bfloat16 and out.shape == y.shape
        out = np.asarray(out, np.float32)
        assert np.isnan(out[bad]).all()
        np.testing.assert_array_equal(out[~bad], np.asarray(y, np.float32)[~bad])
    w = jnp.asarray(np.random.default_rng(1).normal(size=y.shape), jnp.float32)
    grad = jax.jit(jax.grad(lambda y: jnp.sum(jnp.where(
        jnp.isfinite(lse)[..., None], f(y, lse).astype(jnp.float32) * w, 0.0))))(y)
    np.testing.assert_array_equal(np.asarray(grad, np.float32)[~bad],
                                  np.asarray(w.astype(jnp.bfloat16), np.float32)[~bad])
