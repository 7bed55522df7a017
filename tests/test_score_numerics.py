"""Numerics of the Gaussian and cosine scores and of 16-bit prior parameters.

Each answer is checked against a float64 NumPy softmax written here, on the same
(rounded) inputs:

* ``NegSqDist`` (every precision form, also inside ``Sum``) and ``LinearGaussian`` with
  features far from the origin: the lowered kernels expand the score as a matmul plus a
  bias, which must not cancel catastrophically; the gradients w.r.t. the features and
  the means in float32 match autodiff of the plain formula in float64.
* ``Cosine`` with float16 features whose squared norm overflows float16.
* ``NegSqDist`` with a full precision in bfloat16 / float16 (linear algebra in float32).
* ``Geometric`` / ``LinearGaussian`` with 16-bit parameters: the exact engine's
  marginals are those of the 16-bit model computed in float32, not rounded to 16 bits;
  the lowered ``LinearGaussian``'s predictions $A z + b$ too (far from the origin).
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import float64, matrix

import structinfer as si

N, M, D = 13, 7, 3
# (dtype, common shift, tolerance on the attention output)
DTYPES = [(jnp.float32, 1000.0, 1e-4), (jnp.bfloat16, 30.0, 6e-2), (jnp.float16, 300.0, 1e-2)]
FORMS = ["identity", "scalar", "diag", "parent_diag", "full", "sum_dot"]


def f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _precision(form, rng):
    if form == "scalar":
        return np.asarray(1.5)
    if form == "diag":
        return rng.uniform(0.5, 2.0, size=D)
    if form == "parent_diag":
        return rng.uniform(0.5, 2.0, size=(M, D))
    if form == "full":
        a = rng.normal(size=(D, D)) * 0.3
        return a @ a.T + np.eye(D)
    return None


def _inputs(form, dtype, shift, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(N, D)) + shift, dtype)
    mu = jnp.asarray(rng.normal(size=(M, D)) + shift, dtype)
    v = jnp.asarray(rng.normal(size=(M, 2)), dtype)
    prec = _precision(form, rng)
    prec = None if prec is None else jnp.asarray(prec, dtype)
    return x, mu, v, prec


_R = np.random.default_rng(9)
QD, KD = _R.normal(size=(N, D)), _R.normal(size=(M, D))  # the Dot term's own features


def _score(form, x, mu, prec):
    g = si.scores.NegSqDist(x, mu, prec)
    if form == "sum_dot":
        q, k = jnp.asarray(QD, x.dtype), jnp.asarray(KD, x.dtype)
        return si.scores.Sum(si.scores.Dot(q, k, scale=0.5), g)
    return g


def _model(form):
    def model(x, mu, v, prec):
        with numpyro.plate("points", x.shape[0]):
            j = si.edge("z", si.priors.Uniform(mu.shape[0]), _score(form, x, mu, prec))
            numpyro.deterministic("out", v[j])

    return model


def _ref_scores(xp, form, x, mu, prec, dtype):
    """The plain formula $-\\tfrac12 (x_i-\\mu_j)^\\top\\Lambda_j(x_i-\\mu_j)$ (+ the dot)."""
    diff = x[:, None, :] - mu[None, :, :]
    if prec is None:
        s = -0.5 * (diff * diff).sum(-1)
    elif form == "full":
        s = -0.5 * xp.einsum("ijd,de,ije->ij", diff, prec, diff)
    else:  # scalar, (d,) or (m, d): broadcasts against (n, m, d)
        s = -0.5 * (diff * diff * prec).sum(-1)
    if form == "sum_dot":
        s = s + 0.5 * xp.asarray(f64(jnp.asarray(QD, dtype)) @ f64(jnp.asarray(KD, dtype)).T)
    return s


def _ref_attention(s, v):
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


#: by default each form in one dtype and each dtype in two forms (a Latin rotation); the
#: other pairs in the exhaustive tier
@pytest.mark.parametrize("form, dtype, shift, tol", matrix(
    [(f, *d) for f in FORMS for d in DTYPES],
    lambda f, dtype, *_: [d[0] for d in DTYPES].index(dtype) == FORMS.index(f) % len(DTYPES),
    ids=[f"{f}-{d[0].__name__}" for f in FORMS for d in DTYPES]))
def test_gaussian_scores_far_from_origin(form, dtype, shift, tol):
    x, mu, v, prec = _inputs(form, dtype, shift)
    p64 = None if prec is None else f64(prec)
    want = _ref_attention(_ref_scores(np, form, f64(x), f64(mu), p64, dtype), f64(v))
    model = _model(form)
    np.testing.assert_allclose(f64(si.expectation(model, "out", x, mu, v, prec)), want,
                               atol=tol, err_msg="exact")
    for backend in ("auto", "blocked", "pallas"):
        got = si.attention(model, "out", backend)(x, mu, v, prec)
        assert got.dtype == dtype
        np.testing.assert_allclose(f64(got), want, atol=tol, err_msg=backend)


@pytest.mark.parametrize("form", FORMS)
def test_gaussian_scores_far_from_origin_gradients(form):
    x, mu, v, prec = _inputs(form, jnp.float32, 1000.0, seed=1)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(N, 2)), jnp.float32)
    model = _model(form)

    def loss(x, mu):
        return jnp.sum(si.attention(model, "out", "blocked")(x, mu, v, prec) * w)

    gx, gmu = jax.grad(loss, argnums=(0, 1))(x, mu)
    with float64():
        args = [None if a is None else jnp.asarray(f64(a)) for a in (x, mu, v, prec, w)]

        def ref(x, mu):
            s = _ref_scores(jnp, form, x, mu, args[3], jnp.float32)
            return jnp.sum(jax.nn.softmax(s, -1) @ args[2] * args[4])

        rx, rmu = (np.asarray(g) for g in jax.grad(ref, argnums=(0, 1))(*args[:2]))
    scale = max(np.abs(rx).max(), np.abs(rmu).max())
    np.testing.assert_allclose(f64(gx), rx, atol=1e-4 * scale)
    np.testing.assert_allclose(f64(gmu), rmu, atol=1e-4 * scale)


@pytest.mark.parametrize("magnitude", [1.0, 200.0])
def test_cosine_float16_large_norms(magnitude):
    """float16 features of norm above 256: $\\|q\\|^2$ overflows float16, not the score."""
    r = np.random.default_rng(4)
    q, k = (jnp.asarray(r.normal(size=(s, 8)) * magnitude, jnp.float16) for s in (N, M))
    v = jnp.asarray(r.normal(size=(M, 2)), jnp.float16)
    qf, kf, vf = f64(q), f64(k), f64(v)
    s = 10.0 * (qf / np.linalg.norm(qf, axis=-1, keepdims=True)) @ (
        kf / np.linalg.norm(kf, axis=-1, keepdims=True)).T
    want = _ref_attention(s, vf)

    def model(q, k, v):
        with numpyro.plate("i", N):
            j = si.edge("phi", si.priors.Uniform(M), si.scores.Cosine(q, k, scale=10.0))
            numpyro.deterministic("out", v[j])

    got = {"exact": si.expectation(model, "out", q, k, v)}
    for backend in ("auto", "blocked", "pallas"):
        got[backend] = si.attention(model, "out", backend)(q, k, v)
    got["jit"] = jax.jit(si.attention(model, "out"))(q, k, v)
    for name, y in got.items():
        assert y.dtype == jnp.float16
        np.testing.assert_allclose(f64(y), want, atol=2e-2, err_msg=name)


def _softmax_rows(a):
    p = np.exp(a - a.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def test_geometric_bfloat16_q_marginals_in_float32():
    """A bfloat16 $q$: the log-weights $\\log q + d\\log(1-q)$ are computed in float32 with
    the distances exact (distances above 256 are not integers in bfloat16)."""
    n = 300
    r = np.random.default_rng(5)
    q, k = (jnp.asarray(r.normal(size=(n, 4)) * 0.1, jnp.float32) for _ in range(2))
    rate = jnp.asarray(0.005, jnp.bfloat16)

    v = jnp.asarray(r.normal(size=(n, 2)), jnp.float32)

    def model(q, k, rate):
        with numpyro.plate("i", n):
            j = si.edge("phi", si.priors.Geometric(rate, n), si.scores.Dot(q, k))
            numpyro.deterministic("out", v[j])

    qr = f64(rate)
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    lp = np.where(d >= 0, np.log(qr) + np.maximum(d, 0) * np.log1p(-qr), -np.inf)
    want = _softmax_rows(lp + f64(q) @ f64(k).T)
    got = si.marginals(model, q, k, rate)["phi"]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(f64(got), want, atol=2e-6, rtol=1e-4)
    for backend in ("auto", "blocked"):  # the kernels take log q, log(1-q) in float32 too
        y = si.attention(model, "out", backend)(q, k, rate)
        np.testing.assert_allclose(f64(y), want @ f64(v), atol=2e-6, err_msg=backend)


def test_linear_gaussian_bfloat16_marginals_in_float32():
    """bfloat16 features, states and maps: the exact engine's table is computed in float32
    from the rounded inputs (the residual $x_i - A z_k - b$ is not rounded to 16 bits)."""
    r = np.random.default_rng(6)
    x, z = jnp.asarray(r.normal(size=(N, D)) * 3, jnp.bfloat16), jnp.asarray(
        r.normal(size=(M, 2)), jnp.bfloat16)
    A = jnp.asarray(r.normal(size=(D, 2)) * 3, jnp.bfloat16)
    b = jnp.asarray(r.normal(size=(D,)) * 3, jnp.bfloat16)
    prec = jnp.asarray(r.uniform(0.5, 2.0, size=D), jnp.bfloat16)

    def model(x, z, A, b, prec):
        with numpyro.plate("i", N):
            si.edge("phi", si.priors.Uniform(M), si.scores.LinearGaussian(x, z, A, b, prec))

    pred = f64(z) @ f64(A).T + f64(b)
    diff = f64(x)[:, None] - pred[None]
    want = _softmax_rows(-0.5 * (diff * diff * f64(prec)).sum(-1))
    got = si.marginals(model, x, z, A, b, prec)["phi"]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(f64(got), want, atol=1e-5)


@pytest.mark.parametrize("dtype, shift, tol", [(jnp.float16, 3000.0, 2e-3),
                                               (jnp.bfloat16, 300.0, 1.5e-2)])
def test_linear_gaussian_16_bit_predictions_far_from_origin(dtype, shift, tol):
    """16-bit children, states, map and offset with predictions $A z_k + b$ far from the
    origin (a large spread between the offset and the residuals): every engine answers
    the float64 softmax of the rounded inputs within the output's rounding. Regression:
    the lowering computed the predictions in 16 bits, rounding them to the ulp of
    $|A z + b|$ (2 at 3000 in float16) before centring them, so the kernels' answers were
    0.84 off at a shift of 3000 in float16 (0.11 at 300); the exact engine's table, its
    marginals and log Z were right (its residuals are float32)."""
    r = np.random.default_rng(6)
    x = jnp.asarray(r.normal(size=(N, D)) + shift, dtype)
    z = jnp.asarray(r.normal(size=(M, 2)), dtype)
    A = jnp.asarray(r.normal(size=(D, 2)), dtype)
    b = jnp.asarray(r.normal(size=(D,)) + shift, dtype)
    prec = jnp.asarray(r.uniform(0.5, 2.0, size=D), dtype)
    v = jnp.asarray(r.normal(size=(M, 2)), dtype)

    def model(x, z, A, b, prec, v):
        with numpyro.plate("i", N):
            j = si.edge("phi", si.priors.Uniform(M), si.scores.LinearGaussian(x, z, A, b, prec))
            numpyro.deterministic("out", v[j])

    diff = f64(x)[:, None] - (f64(z) @ f64(A).T + f64(b))[None]
    s = -0.5 * (diff * diff * f64(prec)).sum(-1)
    want = _softmax_rows(s)
    top = s.max(-1)
    log_z = float(np.sum(top + np.log(np.exp(s - top[:, None]).sum(-1)) - np.log(M)))
    args = (x, z, A, b, prec, v)
    np.testing.assert_allclose(f64(si.marginals(model, *args)["phi"]), want, atol=1e-4)
    np.testing.assert_allclose(float(si.log_marginal(model, *args)), log_z, rtol=1e-4)
    for backend in ("exact", "dense"):  # every kernel reads the one lowering of the score
        y = si.attention(model, "out", backend)(*args)
        assert y.dtype == dtype
        np.testing.assert_allclose(f64(y), want @ f64(v), atol=tol, err_msg=backend)


@pytest.mark.parametrize("masked", [False, True])
def test_float32_prior_parameter_in_float64_model_normalised_in_float64(masked):
    """Under x64, a float32 relative-position bias in a float64 model: the exact engine
    normalises the prior in float64 from the bias's exact value, as the kernels do.
    Regression (``masked``): under a `Masked` prior (a key-padding mask) the base prior
    was normalised in float32, its own table before the mask: off by float32 rounding."""
    n = 17
    r = np.random.default_rng(7)
    keep = np.arange(n) % 3 != 1 if masked else np.ones(n, bool)
    with float64():
        q, k, v = (jnp.asarray(r.normal(size=s)) for s in ((n, 5), (n, 5), (n, 2)))
        bias = jnp.asarray(r.normal(size=(11,)) * 3, jnp.float32)

        def model(q, k, v, bias):
            with numpyro.plate("i", n):
                prior = si.priors.RelativePosition(bias, n, max_distance=5)
                if masked:
                    prior = si.priors.Masked(prior, keep)
                j = si.edge("phi", prior, si.scores.Dot(q, k, scale=0.5))
                numpyro.deterministic("out", v[j])

        d = np.arange(n)[:, None] - np.arange(n)[None]
        lp = np.where(keep, np.asarray(bias, np.float64)[np.clip(d, -5, 5) + 5], -np.inf)
        want = _softmax_rows(lp + 0.5 * np.asarray(q) @ np.asarray(k).T)
        got = si.marginals(model, q, k, v, bias)["phi"]
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-15)
        y = si.expectation(model, "out", q, k, v, bias)
        np.testing.assert_allclose(np.asarray(y), want @ np.asarray(v), rtol=1e-12, atol=1e-14)
