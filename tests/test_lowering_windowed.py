"""The windowed kernel (expanding attention's geometric prior) and its truncation bound.

Oracles: the exact engine on the truncated model, and a NumPy softmax over the
untruncated geometric prior for the truncation bound

    |y_i - y_i^W| <= tau_i * max_{j,j'} |V_j - V_j'|,
    tau_i <= rho_i e^{Delta_i} / (rho_i e^{Delta_i} + 1 - rho_i),

with rho_i the prior mass the window leaves out and Delta_i the spread of child
i's scores (tau_i = rho_i exactly when all scores are equal).
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import on_gpu

import structinfer as si
from structinfer.lowering import (
    attention,
    explain,
    geometric_band_log_prior,
    windowed_attention,
    windowed_posterior,
    windowed_scores,
    windowed_values,
)

pytestmark = pytest.mark.gpu  # the GPU subset: pytest -m gpu

N, M, D, DV = 19, 23, 5, 3
OFF = M - N  # children are the last N of M positions


def softmax_np(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _data(seed=0, dtype=np.float64):
    r = np.random.default_rng(seed)
    return (r.normal(size=(N, D)).astype(dtype), r.normal(size=(M, D)).astype(dtype),
            r.normal(size=(M, DV)).astype(dtype))


def geo_model(q_geo, window, include_self=True):
    d0 = 0 if include_self else 1

    def model(xq, xk, v):
        with numpyro.plate("q", xq.shape[0]):
            j = si.edge("phi", si.priors.Geometric(q_geo, xk.shape[0], include_self=include_self,
                                                  offset=OFF + 1 - d0,
                                                  max_distance=d0 + window - 1),
                        si.scores.Dot(xq, xk, scale=0.5))
            numpyro.deterministic("out", v[j])

    return model


@pytest.mark.parametrize("include_self", [True, False])
def test_windowed_equals_exact_engine_on_truncated_prior(x64, include_self):
    xq, xk, v = _data(0)
    qg = np.random.default_rng(1).uniform(0.1, 0.5, size=N)  # one q per child
    model = geo_model(qg, 6, include_self)
    if not on_gpu():  # a GPU's auto path picks its own kernel
        assert explain(model, "out", xq, xk, v).kernels == {"phi": "windowed"}
    ref = jax.jit(lambda *a: si.expectation(model, "out", *a))(xq, xk, v)
    out = attention(model, "out", block_q=4)(xq, xk, v)
    np.testing.assert_allclose(out, ref, atol=1e-12)
    d0 = 0 if include_self else 1
    direct = jax.jit(lambda a, b, c: windowed_attention(
        a, b, c, qg, 6, offset=OFF + 1 - d0, min_distance=d0, scale=0.5, block_size=4))
    np.testing.assert_allclose(direct(xq, xk, v), ref, atol=1e-12)


def test_truncation_error_is_bounded_by_prior_mass_left_out(x64):
    xq, xk, v = _data(2)
    xq, xk = 0.4 * xq, 0.4 * xk
    qg, W = 0.15, 8
    dist = np.arange(N)[:, None] + OFF - np.arange(M)[None, :]
    logp = np.where(dist >= 0, np.log(qg) + dist * np.log1p(-qg), -np.inf)
    spread = np.ptp(v, axis=0).max()
    f = jax.jit(lambda a, b, c: windowed_attention(a, b, c, qg, W, offset=OFF, block_size=4))
    for scores in (np.zeros((N, M)), xq @ xk.T):
        full = softmax_np(logp + scores) @ v
        trunc = np.asarray(f(xq, xk, v) if scores.any() else f(0 * xq, xk, v))
        err = np.abs(full - trunc).max(-1)
        prior = softmax_np(logp)
        rho = np.where(dist >= W, prior, 0.0).sum(-1)  # prior mass beyond the window
        allowed = dist >= 0
        delta = np.where(allowed, scores, -np.inf).max(-1) - np.where(allowed, scores, np.inf).min(-1)
        tau = rho * np.exp(delta) / (rho * np.exp(delta) + 1 - rho)
        assert np.all(err <= tau * spread + 1e-12)
        post = softmax_np(logp + scores)
        tail = np.where(dist >= W, post, 0.0).sum(-1)
        assert np.all(tail <= tau + 1e-12)
        if not scores.any():  # equal scores: the posterior tail is exactly the prior tail
            np.testing.assert_allclose(tail, rho, atol=1e-12)
        assert err.max() > 0  # some rows do have parents beyond the window


def test_pieces_against_numpy_with_horizon_and_per_head_q(x64):
    r = np.random.default_rng(3)
    H, W = 2, 7
    q = r.normal(size=(H, N, D))
    k = r.normal(size=(H, M, D))
    v = r.normal(size=(H, M, DV))
    qg = np.array([[0.2], [0.45]])  # one q per head
    horizon = np.array([[5], [3]])  # the mean-field loop's H(q_t), per head
    s = jax.jit(lambda a, b: windowed_scores(a, b, W, offset=OFF, block_size=4))(q, k)
    lp = geometric_band_log_prior(qg, W, horizon)
    probs = windowed_posterior(s, lp)
    y = windowed_values(probs, v, offset=OFF, block_size=4)
    t = np.arange(W)
    j = np.arange(N)[:, None] + OFF - t[None, :]  # parent of band slot t
    valid = (j >= 0) & (j < M)
    jj = np.clip(j, 0, M - 1)
    s_ref = np.where(valid, np.einsum("hid,hitd->hit", q, k[:, jj]), -np.inf)
    np.testing.assert_allclose(np.where(valid, s, 0), np.where(valid, s_ref, 0), atol=1e-12)
    assert np.all(np.isneginf(np.asarray(s)[:, ~valid]))
    lp_ref = np.where(t[None, None] < horizon[..., None], np.log(qg)[..., None]
                      + t * np.log1p(-qg)[..., None], -np.inf)
    p_ref = softmax_np(s_ref + lp_ref)
    np.testing.assert_allclose(probs, p_ref, atol=1e-12)
    y_ref = np.einsum("hit,hitd->hid", p_ref, np.where(valid[..., None], v[:, jj], 0))
    np.testing.assert_allclose(y, y_ref, atol=1e-12)


def test_windowed_gradients_match_dense_autodiff(x64):
    xq, xk, v = _data(4)
    qg = 0.3

    def dense(a, b, c):
        d = np.arange(N)[:, None] + OFF - np.arange(M)[None, :]
        lp = jnp.where((d >= 0) & (d < 6), np.log(qg) + d * np.log1p(-qg), -jnp.inf)
        return jax.nn.softmax(a @ b.T + lp, -1) @ c

    def win(a, b, c):
        return windowed_attention(a, b, c, qg, 6, offset=OFF, block_size=4)

    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))  # noqa: E731
    g1 = jax.jit(jax.grad(loss(win), argnums=(0, 1, 2)))(xq, xk, v)
    g2 = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2)))(xq, xk, v)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-12)


def test_windowed_input_errors():
    with pytest.raises(ValueError, match="window must be an int >= 1, got 0"):
        windowed_scores(np.zeros((3, 2)), np.zeros((5, 2)), 0)
    with pytest.raises(ValueError, match="same d"):
        windowed_scores(np.zeros((3, 2)), np.zeros((5, 4)), 2)


def test_a_16_bit_geometric_q_is_the_exact_values_prior_past_256_distances():
    """A bfloat16 ``q`` (a bfloat16 model's parameter) gives the band log-prior of its exact
    value, computed in float32 as `priors.Geometric` does: in bfloat16 the distances past
    256 are not integers and ``t log(1 - q)`` keeps 8 bits."""
    W = 300
    qg = jnp.bfloat16(0.01)
    t = np.arange(W)
    q64 = np.float64(qg)
    want = np.log(q64) + t * np.log1p(-q64)  # independent reference, float64
    lp = geometric_band_log_prior(qg, W)
    assert lp.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lp, np.float64)[0], want, rtol=1e-6)
    # the same through the fused function on float32 features: a float32 answer
    r = np.random.default_rng(5)
    n = W + 2
    q, k, v = (jnp.asarray(0.1 * r.normal(size=(n, 2)), jnp.float32) for _ in range(3))
    y = windowed_attention(q, k, v, qg, W, block_size=64)
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    logits = (np.asarray(q, np.float64) @ np.asarray(k, np.float64).T
              + np.where((d >= 0) & (d < W), np.log(q64) + d * np.log1p(-q64), -np.inf))
    np.testing.assert_allclose(y, softmax_np(logits) @ np.asarray(v, np.float64), atol=2e-6)


@pytest.mark.parametrize("qg", [0.0, 1.0, -0.5, 1.5])
def test_a_geometric_q_outside_the_open_unit_interval_is_named_or_nan(qg):
    """``q = 0`` gave every band slot ``-inf`` and an output of zeros, a finite wrong
    number; ``q = 1`` gave NaN without a word. Concrete: the error names ``q``; traced: NaN."""
    x = jnp.ones((5, 2))
    with pytest.raises(ValueError, match=r"geometric_band_log_prior: q must lie in \(0, 1\)"):
        windowed_attention(x, x, x, qg, 3, block_size=4)
    with pytest.raises(ValueError, match=r"q must lie in \(0, 1\)"):
        geometric_band_log_prior(qg, 3)
    y = jax.jit(lambda g: windowed_attention(x, x, x, g, 3, block_size=4))(qg)
    assert np.isnan(np.asarray(y)).all()


_WINDOWED_INT_ARGS = {  # argument -> a call taking it (the others valid)
    "window": lambda x, a: windowed_attention(x, x, x, 0.3, a),
    "offset": lambda x, a: windowed_attention(x, x, x, 0.3, 3, offset=a),
    "min_distance": lambda x, a: windowed_scores(x, x, 3, min_distance=a),
    "block_size": lambda x, a: windowed_values(jnp.ones((5, 3)), x, block_size=a),
}


@pytest.mark.parametrize("arg", list(_WINDOWED_INT_ARGS))
def test_windowed_integer_arguments_are_checked_by_name(arg):
    """The band's sizes set shapes: a traced one raised JAX's concretization error naming
    no argument, and a float (``window=2.5``), a bool or a block size of 0 or below was
    silently truncated or taken. Each is now refused naming the argument."""
    x = jnp.ones((5, 2))
    call = _WINDOWED_INT_ARGS[arg]
    with pytest.raises(TypeError, match=f"`{arg}` must be a static Python int"):
        jax.jit(lambda a: call(x, a))(2)
    bad = [2.5, True] + ([0, -4] if arg in ("window", "block_size") else [])
    for value in bad:
        with pytest.raises(ValueError, match=f"{arg} must be an? .*int.*got {value!r}"):
            call(x, value)
    call(x, np.int64(1))  # NumPy ints are ints


def test_a_child_with_no_parent_in_the_band_is_an_error_or_nan():
    """A child whose band holds no parent (the first child without the self-edge, or a
    horizon of 0) came out of `windowed_attention` as a row of zeros, a finite number the
    exact engine (which refuses such a child) never gives. Concrete: the error names the
    child; traced: its row is NaN, the others unchanged."""
    r = np.random.default_rng(2)
    q, k, v = (jnp.asarray(r.normal(size=(6, 2)), jnp.float32) for _ in range(3))
    with pytest.raises(ValueError, match=r"windowed_attention: child 0 has no parent"):
        windowed_attention(q, k, v, 0.3, 3, min_distance=1)
    with pytest.raises(ValueError, match=r"windowed_attention: child 0 has no parent"):
        windowed_attention(q, k, v, 0.3, 3, horizon=0)
    y = jax.jit(lambda a: windowed_attention(a, k, v, 0.3, 3, min_distance=1))(q)
    assert np.isnan(np.asarray(y[0])).all()
    d = np.arange(6)[:, None] - np.arange(6)[None, :]
    logits = (np.asarray(q, np.float64) @ np.asarray(k, np.float64).T
              + np.where((d >= 1) & (d <= 3), np.log(0.3) + (d - 1) * np.log1p(-0.3), -np.inf))
    np.testing.assert_allclose(y[1:], (softmax_np(logits[1:]) @ np.asarray(v, np.float64)),
                               atol=2e-6)


@pytest.mark.parametrize("call, match", [
    # v with fewer parents than k: the mass on the missing parents read as a zero value
    (lambda q, k, v: windowed_attention(q, k, v[:, :6], 0.3, 4, offset=2),
     r"windowed_attention: v .*\(2, 6, 4\).* 8 parents of k"),
    (lambda q, k, v: jax.jit(lambda a: windowed_attention(q, k, a, 0.3, 4, offset=2))(v[:, :6]),
     r"windowed_attention: v "),
    (lambda q, k, v: windowed_attention(q, k, jnp.concatenate([v, v[:1]]), 0.3, 4, offset=2),
     r"windowed_attention: v .*batch dims \(3,\) do not broadcast"),
    (lambda q, k, v: windowed_attention(q, k, v, jnp.full((5,), 0.3), 4, offset=2),
     r"windowed_attention: geometric_q of shape \(5,\) does not broadcast"),
    (lambda q, k, v: windowed_attention(q, k, v, 0.3, 4, offset=2, horizon=jnp.ones(5)),
     r"windowed_attention: horizon of shape \(5,\) does not broadcast"),
    (lambda q, k, v: windowed_values(jnp.ones((2, 6, 4)) / 4, v[0, :, 0]),
     r"windowed_values: v must be \(\.\.\., m, dv\)"),
    (lambda q, k, v: windowed_values(jnp.ones((2, 6, 4)) / 4, jnp.concatenate([v, v[:1]])),
     r"windowed_values: the batch dims of probs \(2,\) and v \(3,\) do not broadcast"),
    (lambda q, k, v: windowed_scores(q, jnp.concatenate([k, k[:1]]), 4),
     r"windowed_scores: the batch dims of q \(2,\) and k \(3,\) do not broadcast"),
])
def test_windowed_attention_names_an_argument_of_the_wrong_shape(call, match):
    """``v`` with fewer parents than ``k`` ran, its missing parents' posterior mass
    silently multiplying a zero value (a finite wrong number); a ``v``, ``geometric_q``
    or ``horizon`` that did not fit the batch gave JAX's bare broadcasting error. Each now
    raises naming the argument and the expected shape."""
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(2, 6, 3)), jnp.float32)
    k = jnp.asarray(r.normal(size=(2, 8, 3)), jnp.float32)
    v = jnp.asarray(r.normal(size=(2, 8, 4)), jnp.float32)
    with pytest.raises(ValueError, match=match):
        call(q, k, v)


def test_a_bfloat16_scale_multiplies_the_float32_scores():
    """Regression: ``windowed_scores(..., scale=d**-0.5)`` of bfloat16 features rounded
    ``scale * q`` to bfloat16 (logits 0.02 off at d = 128); the scale now multiplies the
    float32 products, as the kernels' does, so the scores are the float32 ones."""
    r = np.random.default_rng(0)
    n, d, w = 64, 128, 8
    q = jnp.asarray(4 * r.normal(size=(n, d)), jnp.bfloat16)
    k = jnp.asarray(r.normal(size=(n, d)), jnp.bfloat16)
    s = windowed_scores(q, k, w, scale=d ** -0.5)
    unscaled = windowed_scores(q, k, w)
    assert s.dtype == unscaled.dtype == jnp.float32
    ok = np.isfinite(np.asarray(unscaled))
    np.testing.assert_allclose(np.asarray(s)[ok], (np.asarray(unscaled) * d ** -0.5)[ok],
                               rtol=1e-6, atol=1e-5)
