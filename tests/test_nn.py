"""structinfer.nn.Attention: equal to flax.nnx.MultiHeadAttention (uniform / causal), to
si.expectation of its mechanism (every prior), to a quadrature of the Beta integral
(collapsed geometric x Beta); gradients by finite differences; jit, batch dims, float32 /
float64; the decode cache equals the full pass; a hyperprior by random_nnx_module; errors
name the argument. Sizes are distinct primes: batch 2, n 7, m 5, features 11, heads 3,
head_dim 5, out 13."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conftest import float64, matrix
from flax import nnx
from jax.test_util import check_grads
from numpyro.contrib.module import random_nnx_module
from numpyro.infer.util import log_density
from scipy.special import roots_sh_jacobi

import structinfer as si
from structinfer import nn as sinn
from structinfer.nn.heads import beta_geometric_log_pmf

pytestmark = pytest.mark.gpu  # the GPU subset: pytest -m gpu

B, N, M, F, H, D, OUT = 2, 7, 5, 11, 3, 5, 13

MECHANISMS = {
    "uniform": lambda: sinn.uniform(),
    "causal": lambda: sinn.causal(),
    "window": lambda: sinn.window(3),
    "relative_position": lambda: sinn.relative_position(4),
    "geometric": lambda: sinn.geometric(0.3),
    "geometric_beta": lambda: sinn.geometric_beta(2.0, 3.0),
    "causal_temperature": lambda: sinn.causal(temperature=True),
}


def layer_for(mech, dtype=jnp.float32, seed=0, **kw):
    kw.setdefault("qkv_features", H * D)
    kw.setdefault("out_features", OUT)
    kw.setdefault("num_heads", H)
    return sinn.Attention(mech, in_features=F, param_dtype=dtype, rngs=nnx.Rngs(seed), **kw)


def randomise_hyper(layer, seed=1):
    """Move every hyperparameter off its initial value (unconstrained normal draws)."""
    keys = jax.random.split(jax.random.key(seed), max(len(layer.hyper), 1))
    for key, name in zip(keys, sorted(layer.hyper)):
        p = layer.hyper[name]
        p[...] = p[...] + jax.random.normal(key, p.shape, p.dtype)


def inputs(shape, dtype, seed=2):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def tol(dtype):
    return dict(rtol=0, atol=2e-5) if dtype == jnp.float32 else dict(rtol=0, atol=1e-11)


def maybe64(dtype):
    return float64() if dtype == jnp.float64 else contextlib.nullcontext()


# --------------------------------------------------------------------------- vs flax
@pytest.mark.parametrize("case, dtype", [
    ("uniform", jnp.float32), ("causal", jnp.float64), ("uniform_cross", jnp.float32),
    ("causal_gqa", jnp.float64),
])
def test_equals_flax_multihead_attention(case, dtype):
    with maybe64(dtype):
        # grouped-query attention: 6 query heads share 3 key/value heads in pairs
        kw = {"num_heads": 6, "num_kv_heads": 3, "qkv_features": 6 * D} if case.endswith(
            "gqa") else {}
        if case.endswith("cross"):  # with the other options of flax's layer
            kw.update(normalize_qk=True, use_bias=False)
        mech = sinn.causal() if case.startswith("causal") else sinn.uniform()
        layer = layer_for(mech, dtype, seed=3, **kw)
        mha = nnx.MultiHeadAttention(**{"num_heads": H, "qkv_features": H * D, **kw},
                                     in_features=F, out_features=OUT, param_dtype=dtype,
                                     decode=False, rngs=nnx.Rngs(4))
        nnx.update(layer, nnx.state(mha, nnx.Param))  # the same weights, by name
        xq = inputs((B, N, F), dtype)
        xk = inputs((B, M, F), dtype, seed=5) if case.endswith("cross") else xq
        mask = nnx.make_causal_mask(jnp.ones((B, N))) if case.startswith("causal") else None
        # both layers in one program (the numbers are the subject; the layer runs eagerly
        # in test_equals_exact_expectation_of_the_mechanism)
        got, want = nnx.jit(lambda layer, mha, xq, xk: (layer(xq, xk), mha(xq, xk, mask=mask)))(
            layer, mha, xq, xk)
        assert got.dtype == dtype
        # flax's float64 attention is good to ~1e-7 only (ours is 1e-15 from a NumPy
        # softmax): compare at that level
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 if dtype == jnp.float32 else 1e-6)


def test_same_rngs_same_weights_as_flax():
    layer = layer_for(sinn.uniform(), seed=7, dropout_rate=0.1)
    mha = nnx.MultiHeadAttention(num_heads=H, in_features=F, qkv_features=H * D,
                                 out_features=OUT, dropout_rate=0.1, rngs=nnx.Rngs(7))
    want = nnx.to_pure_dict(nnx.state(mha, nnx.Param))
    got = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    for path in ("query", "key", "value", "out"):
        for leaf in ("kernel", "bias"):
            np.testing.assert_array_equal(got[path][leaf], want[path][leaf])


def test_abstract_init_with_nnx_eval_shape():
    """Built under a trace (flax's abstract initialisation), the mechanism is still read."""
    abstract = nnx.eval_shape(lambda: layer_for(sinn.geometric(0.3)))
    assert abstract.hyper["q"].shape == (H, 1) and abstract.causal


# --------------------------------------------------------------------------- vs exact
def by_hand(layer, mech, xq, xk):
    """Projections by einsum, each sequence through si.expectation (the exact engine)."""
    p = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    proj = lambda x, w: jnp.einsum("...f,fhd->...hd", x, w["kernel"]) + w["bias"]  # noqa: E731
    q, k, v = proj(xq, p["query"]), proj(xk, p["key"]), proj(xk, p["value"])
    # the stored values are unconstrained: the rate is a logit, positive ones are logs
    to_value = {"q": jax.nn.sigmoid, "alpha": jnp.exp, "beta": jnp.exp, "temperature": jnp.exp,
                "bias": lambda u: u}
    hyper = {name: to_value[name](u) for name, u in p.get("hyper", {}).items()}
    model = numpyro.handlers.substitute(mech, data=hyper)
    heads = lambda a: jnp.moveaxis(a, -2, -3)  # noqa: E731
    exact = jax.jit(jax.vmap(lambda q, k, v: si.expectation(model, "out", q, k, v)))
    o = exact(heads(q), heads(k), heads(v))
    return jnp.einsum("bhnd,hdo->bno", o, p["out"]["kernel"]) + p["out"]["bias"]


def inverse_distance(q, k, v):
    """Not lowered (InvDist score): the layer takes the exact engine."""
    n, m = q.shape[-2], k.shape[-2]
    with numpyro.plate("heads", q.shape[0], dim=-2), numpyro.plate("queries", n, dim=-1):
        j = si.edge("phi", si.priors.Restricted.causal(n, m, offset=m - n),
                    si.scores.InvDist(q, k))
        numpyro.deterministic("out", numpyro.ops.indexing.Vindex(v[:, None])[..., j, :])


@pytest.mark.parametrize("name, dtype", [
    *[(name, jnp.float64) for name in [*MECHANISMS, "inverse_distance"]],
    ("causal", jnp.float32),
])
def test_equals_exact_expectation_of_the_mechanism(name, dtype):
    with maybe64(dtype):
        mech = inverse_distance if name == "inverse_distance" else MECHANISMS[name]()
        layer = layer_for(mech, dtype)
        randomise_hyper(layer)
        x = inputs((B, N, F), dtype)
        explanation = layer.explain(x)
        assert explanation.path == ("exact" if name == "inverse_distance" else "lowered")
        np.testing.assert_allclose(layer(x), by_hand(layer, mech, x, x), **tol(dtype))
        if name == "uniform":  # cross attention: the queries are the last n of m keys
            xk = inputs((B, M + N, F), dtype, seed=5)
            np.testing.assert_allclose(layer(x, xk), by_hand(layer, mech, x, xk), **tol(dtype))


def test_collapsed_geometric_beta_equals_quadrature(x64):
    """p(phi_i = j | x) ∝ e^{s_ij} ∫ q (1-q)^{d_ij} Beta(q; a, b) dq, by Gauss-Legendre."""
    a, b = np.array([[2.0], [0.7], [5.0]]), np.array([[3.0], [1.5], [0.9]])
    mech = numpyro.handlers.substitute(sinn.geometric_beta(),
                                       data={"alpha": jnp.asarray(a), "beta": jnp.asarray(b)})
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(H, N, D)) for _ in range(3))
    got = jax.jit(lambda q, k, v: si.expectation(mech, "out", q, k, v))(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    d = np.arange(N)[:, None] - np.arange(N)[None, :]  # distance back from query i
    want = np.zeros((H, N, D))
    for h in range(H):
        # Gauss-Jacobi on (0, 1) with weight q^(a-1) (1-q)^(b-1): exact for the
        # polynomial q (1-q)^d, d < N (20 nodes >> degree N)
        u, w = roots_sh_jacobi(20, a[h, 0] + b[h, 0] - 1, a[h, 0])
        w = w / w.sum()  # the Beta(a, b) density's normaliser
        prior = np.einsum("t,tij->ij", w, u[:, None, None]
                          * (1 - u[:, None, None]) ** np.maximum(d, 0))
        prior = np.where(d >= 0, prior, 0.0)
        s = q[h] @ k[h].T / np.sqrt(D)
        p = prior * np.exp(s - s.max(-1, keepdims=True))
        want[h] = (p / p.sum(-1, keepdims=True)) @ v[h]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-11)


def test_beta_geometric_log_pmf_of_16_bit_parameters_sums_in_float32():
    """Regression: 16-bit ``alpha``, ``beta`` (the geometric_beta mechanism's parameters
    when called on 16-bit inputs) summed the log-pmf's steps in 16 bits, 0.08 off the
    exact value at distance 600 in bfloat16; it is now summed, and answered, in
    float32, as every prior's table of 16-bit parameters."""
    want = beta_geometric_log_pmf(jnp.ones((1, 1)), jnp.full((1, 1), 2.0), 600)
    for dt in (jnp.bfloat16, jnp.float16):
        got = beta_geometric_log_pmf(jnp.ones((1, 1), dt), jnp.full((1, 1), 2.0, dt), 600)
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("name, backend", matrix([  # by default each prior and backend once
    ("geometric", "blocked"), ("relative_position", "blocked"),  # the custom VJP
    ("geometric", "dense"), ("relative_position", "exact"),
], keep=lambda name, backend: (name, backend) != ("geometric", "blocked")))
def test_gradients_match_finite_differences(name, backend, x64):
    layer = layer_for(MECHANISMS[name](), jnp.float64, backend=backend, block_q=3, block_k=4)
    randomise_hyper(layer)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    x = inputs((B, N, F), jnp.float64)
    w = inputs((B, N, OUT), jnp.float64, seed=9)

    def loss(x, params):
        return jnp.sum(nnx.merge(graphdef, params, rest)(x) * w)

    check_grads(loss, (x, params), order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)
    g = jax.grad(loss, argnums=1)(x, params)
    assert all(float(jnp.abs(leaf).max()) > 0 for leaf in jax.tree.leaves(g["hyper"]))


# --------------------------------------------------------------------------- jit, batch
@pytest.mark.parametrize("dtype", [jnp.float32])  # float64: the exact / gradient tests
def test_jit_and_batch_dims(dtype):
    with maybe64(dtype):
        layer = layer_for(sinn.geometric(0.2), dtype)
        x = inputs((2, 3, N, F), dtype)
        eager = layer(x)
        jitted = nnx.jit(lambda m, x: m(x))(layer, x)
        np.testing.assert_allclose(jitted, eager, **tol(dtype))
        np.testing.assert_allclose(eager[1, 2], layer(x[1, 2]), **tol(dtype))  # no batch dim
        assert eager.shape == (2, 3, N, OUT) and eager.dtype == dtype


def test_trains_with_optax():
    """A few Adam steps on a toy target move the loss and the geometric rate."""
    import optax

    layer = layer_for(sinn.geometric(0.5))
    opt = nnx.Optimizer(layer, optax.adam(3e-2), wrt=nnx.Param)
    x = inputs((B, N, F), jnp.float32)
    target = jnp.roll(x, 2, axis=-2) @ inputs((F, OUT), jnp.float32, seed=8)  # two back

    @nnx.jit
    def step(layer, opt):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(layer)
        opt.update(layer, g)
        return loss

    q0 = layer.hyperparameters()["q"]
    losses = [float(step(layer, opt)) for _ in range(8)]
    assert losses[-1] < losses[0]
    assert not np.allclose(layer.hyperparameters()["q"], q0)


# --------------------------------------------------------------------------- decode
@pytest.mark.parametrize("name", ["causal", "window", "geometric"])
def test_decode_cache_equals_full_pass(name):
    layer = layer_for(MECHANISMS[name](), num_kv_heads=1 if name == "causal" else None)
    randomise_hyper(layer)
    x = inputs((B, N, F), jnp.float32)
    full = layer(x)
    layer.init_cache((B, N, F))
    step = nnx.jit(lambda m, xt: m(xt, decode=True))
    steps = jnp.concatenate([step(layer, x[:, t : t + 1]) for t in range(N)], axis=1)
    np.testing.assert_allclose(steps, full, rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="cache is full"):
        layer(x[:, :1], decode=True)
    # under jit the full cache cannot raise: a step past it is NaN, not the clamped last row
    assert np.isnan(np.asarray(step(layer, x[:, :1]))).all()


def test_decode_refuses_non_causal_and_uninitialised():
    with pytest.raises(ValueError, match="decode needs a causal mechanism"):
        layer_for(sinn.uniform()).init_cache((B, N, F))
    with pytest.raises(ValueError, match="call init_cache first"):
        layer_for(sinn.causal())(inputs((B, 1, F), jnp.float32), decode=True)


# --------------------------------------------------------------------------- hyperprior
def test_beta_hyperprior_by_random_nnx_module():
    """The same layer lifted with a Beta prior over q: log p = log Beta(q) + log |dq/du| +
    the likelihood of the layer at that q (and nothing of the mechanism leaks)."""
    layer = layer_for(sinn.geometric(0.3))
    x = inputs((B, N, F), jnp.float32)
    y = inputs((B, N, OUT), jnp.float32, seed=6)

    def model(x, y):
        net = random_nnx_module("attn", layer, prior=layer.hyperprior({"q": dist.Beta(2.0, 5.0)}))
        numpyro.sample("y", dist.Normal(net(x), 1.0).to_event(3), obs=y)

    sites = []

    def joint(u):
        value, trace = log_density(model, (x, y), {}, {"attn/hyper.q": u})
        sites.extend(trace)
        return value

    u = jnp.array([[-1.0], [0.5], [2.0]])
    got = jax.jit(joint)(u)
    assert set(sites) == {"attn$params", "attn/hyper.q", "y"}
    at_q = nnx.clone(layer)
    at_q.hyper["q"][...] = u

    @nnx.jit
    def reference(at_q):
        q = jax.nn.sigmoid(at_q.hyper["q"][...])
        return (dist.Beta(2.0, 5.0).log_prob(q).sum() + jnp.log(q * (1 - q)).sum()
                + dist.Normal(at_q(x), 1.0).log_prob(y).sum())

    want = reference(at_q)
    np.testing.assert_allclose(got, want, rtol=1e-5)


# --------------------------------------------------------------------------- dropout
def test_dropout_on_head_outputs():
    layer = layer_for(sinn.causal(), dropout_rate=0.5)
    plain = layer_for(sinn.causal())
    x = inputs((B, N, F), jnp.float32)
    np.testing.assert_allclose(layer(x, deterministic=True), plain(x), rtol=0, atol=1e-6)
    assert not np.allclose(layer(x, deterministic=False), plain(x))
    with pytest.raises(ValueError, match="deterministic="):
        layer(x)


# --------------------------------------------------------------------------- errors
def _latent(q, k, v):
    numpyro.sample("rate", dist.Beta(1.0, 1.0))
    sinn.causal()(q, k, v)


def _wrong_value(q, k, v):
    with numpyro.plate("heads", q.shape[0], dim=-2), numpyro.plate("queries", q.shape[1], dim=-1):
        j = si.edge("phi", si.priors.Uniform(k.shape[1]), si.scores.Dot(q, k))
        numpyro.deterministic("out", j)


def _length_bias(q, k, v):
    b = numpyro.param("bias", jnp.zeros((q.shape[0], 2 * k.shape[1] - 1)))
    n = q.shape[1]
    with numpyro.plate("heads", q.shape[0], dim=-2), numpyro.plate("queries", n, dim=-1):
        j = si.edge("phi", si.priors.RelativePosition(b, n), si.scores.Dot(q, k))
        numpyro.deterministic("out", numpyro.ops.indexing.Vindex(v[:, None])[..., j, :])


@pytest.mark.parametrize("build, call, match", [
    (dict(mechanism=None), None, "mechanism must be a model"),
    (dict(qkv_features=16), None, r"qkv_features \(16\) must be divisible by num_heads"),
    (dict(num_heads=0), None, "num_heads must be an int >= 1"),
    (dict(num_kv_heads=2), None, "divisible by num_kv_heads"),
    (dict(backend="fast"), None, "backend must be one of"),
    (dict(dropout_rate=1.0), None, "dropout_rate must lie in"),
    (dict(mechanism=_latent), None, "site 'rate' is a latent sample site"),
    (dict(mechanism=_wrong_value), None, r"value site 'out' has shape \(3, 3\)"),
    (dict(value="y"), None, "no deterministic value site 'y'"),
    ({}, dict(inputs_q=(B, N, F + 2)), r"inputs_q must be \(\.\.\., length, 11\)"),
    ({}, dict(inputs_k=(B + 1, N, F)), "inputs_k batch dims"),
    ({}, dict(inputs_v=(B, N + 1, F)), "inputs_v"),
    ({}, dict(mask=(B, H, N, N + 1)), r"mask of shape \(2, 3, 7, 8\) does not broadcast"),
    (dict(mechanism=_length_bias), dict(), "hyperparameter 'bias' has shape"),
])
def test_bad_input_errors_name_the_argument(build, call, match):
    kw = dict(mechanism=sinn.causal())
    kw.update(build)
    mech = kw.pop("mechanism")
    if call is None:
        with pytest.raises((ValueError, TypeError), match=match):
            layer_for(mech, **kw)
        return
    layer = layer_for(mech, **kw)
    x = inputs((B, N, F), jnp.float32)
    args = {"inputs_q": x}
    for name in ("inputs_q", "inputs_k", "inputs_v"):
        if name in call:
            args[name] = inputs(call[name], jnp.float32)
    if "inputs_v" in args and "inputs_k" not in args:
        args["inputs_k"] = x
    mask = jnp.ones(call["mask"], bool) if "mask" in call else None
    with pytest.raises(ValueError, match=match):
        layer(**args, mask=mask)


def test_array_like_inputs_are_arrays_and_others_are_named():
    """Nested lists (what ``jnp.shape`` reads) run as their arrays; a non-array input is a
    TypeError naming the argument, not an AttributeError on ``.shape``."""
    layer = layer_for(sinn.causal())
    x = inputs((B, N, F), jnp.float32)
    listed = np.asarray(x).tolist()
    np.testing.assert_allclose(layer(listed), layer(x), rtol=0, atol=1e-6)
    np.testing.assert_allclose(layer(x, listed, listed), layer(x), rtol=0, atol=1e-6)
    assert layer.explain(listed).kernels == layer.explain(x).kernels
    with pytest.raises(TypeError, match="inputs_k must be an array"):
        layer(x, object())
    with pytest.raises(ValueError, match=r"decode takes one position per call.*got inputs_q of "
                                         r"shape \(2, 2, 11\)"):
        layer.init_cache((B, N, F))
        layer(x[:, :2], decode=True)


# --------------------------------------------------------------------------- masks
@pytest.mark.parametrize("mech, dtype", [("uniform", jnp.float32), ("causal", jnp.float64)])
def test_mask_equals_flax_multihead_attention(mech, dtype):
    """``mask=`` as flax's: a padding mask from ``make_attention_mask`` (float 0 / 1) and
    a random per-head mask, against ``flax.nnx.MultiHeadAttention`` with the same weights
    and the same mask (the causal mechanism's against flax's with its causal mask
    combined), eagerly and under jit."""
    with maybe64(dtype):
        layer = layer_for(MECHANISMS[mech](), dtype, seed=3)
        mha = nnx.MultiHeadAttention(num_heads=H, qkv_features=H * D, in_features=F,
                                     out_features=OUT, param_dtype=dtype, decode=False,
                                     rngs=nnx.Rngs(4))
        nnx.update(layer, nnx.state(mha, nnx.Param))
        x = inputs((B, N, F), dtype)
        keep = jnp.arange(N)[None, :] < jnp.array([[N], [4]])  # the second sequence: 4
        pad = nnx.make_attention_mask(jnp.ones((B, N), bool), keep)  # (B, 1, N, N) float
        rand = jax.random.bernoulli(jax.random.key(9), 0.6, (B, H, N, N)).at[..., 0].set(True)
        causal = nnx.make_causal_mask(jnp.ones((B, N)))
        for mask in (pad, rand):
            want = mha(x, mask=nnx.combine_masks(mask, causal) if mech == "causal" else mask)
            for got in (layer(x, mask=mask),
                        nnx.jit(lambda layer, x, mask: layer(x, mask=mask))(layer, x, mask)):
                assert got.dtype == dtype
                np.testing.assert_allclose(got, want, rtol=0,
                                           atol=2e-5 if dtype == jnp.float32 else 1e-6)


@pytest.mark.parametrize("kind", ["keys", "flax"])
@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_a_padding_mask_is_the_unpadded_sequence(name, kind):
    """Every mechanism: a sequence padded to length N with its padding masked out gives,
    at its own positions, the output and the gradient of the unpadded sequence (the
    priors read distances, which the padding does not change). ``keys``: a key-padding
    mask, one per key for the kernels; ``flax``: ``make_attention_mask(keep, keep)``,
    whose padded queries are masked from every key (left unrestricted)."""
    with float64():
        layer = layer_for(MECHANISMS[name](), jnp.float64)
        randomise_hyper(layer)
        x = inputs((B, N, F), jnp.float64)
        length = 4
        keep = jnp.broadcast_to(jnp.arange(N) < length, (B, N))
        if kind == "flax":
            keep = nnx.make_attention_mask(keep, keep)
        else:
            keep = keep[:, None, None, :]  # (B, 1, 1, N): one per key
            assert "prior Masked (one per parent" in str(layer.explain(x, mask=keep))
            if name == "window":  # padded queries 6 sees padding keys 4..6 only
                with pytest.raises(ValueError, match="allows no parent for child 6"):
                    layer(x, mask=keep)
                return

        def loss(layer, x, mask):
            return jnp.sum(layer(x, mask=mask)[:, :length] ** 2)

        def unpadded(layer, x):
            return jnp.sum(layer(x[:, :length]) ** 2)

        got = layer(x, mask=keep)[:, :length]
        np.testing.assert_allclose(got, layer(x[:, :length]), rtol=0, atol=1e-11)
        g1 = nnx.grad(loss)(layer, x, keep)
        g2 = nnx.grad(unpadded)(layer, x)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11),
                     nnx.to_pure_dict(g1), nnx.to_pure_dict(g2))


@pytest.mark.parametrize("name", ["uniform", "relative_position", "geometric"])
def test_a_bfloat16_padding_mask_answers_in_bfloat16(name):
    """A bfloat16 layer on a left-padded sequence (flax's ``make_attention_mask``, so
    that the causal priors see the padding before the sequence): the output and the
    parameters' gradients are bfloat16 and finite, and at the sequence's own positions
    equal the float32 layer's (the same weights) on the unpadded sequence within
    bfloat16's precision, eagerly and under jit."""
    length = 4
    own = slice(N - length, None)
    keep = nnx.make_attention_mask(*(jnp.broadcast_to(jnp.arange(N) >= N - length,
                                                      (B, N)),) * 2)
    ref = layer_for(MECHANISMS[name](), jnp.float32)
    randomise_hyper(ref)
    layer = layer_for(MECHANISMS[name](), jnp.bfloat16)
    nnx.update(layer, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(ref, nnx.Param)))
    x = inputs((B, N, F), jnp.float32).astype(jnp.bfloat16)
    want = ref(x[:, own].astype(jnp.float32))
    scale = float(jnp.max(jnp.abs(want)))
    for got in (layer(x, mask=keep),
                nnx.jit(lambda layer, x, m: layer(x, mask=m))(layer, x, keep)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got[:, own], np.float32), want,
                                   rtol=0, atol=3e-2 * scale)
    grads = nnx.grad(lambda layer: jnp.sum(layer(x, mask=keep)[:, own]
                                           .astype(jnp.float32) ** 2))(layer)
    for g in jax.tree.leaves(nnx.to_pure_dict(grads)):
        assert g.dtype == jnp.bfloat16 and np.isfinite(np.asarray(g, np.float32)).all()


def test_mask_errors():
    layer = layer_for(sinn.causal())
    x = inputs((B, N, F), jnp.float32)
    with pytest.raises(TypeError, match="mask must be boolean or real"):
        layer(x, mask=jnp.ones((N, N), jnp.complex64))
    # a query the mask and the prior leave no key: the error names the edge site and the
    # batch element; under jit its row is NaN
    none = jnp.ones((B, 1, N, N), bool).at[1, 0, 3, :4].set(False)
    with pytest.raises(ValueError, match=r"batch index \(1,\).*edge site 'phi'.*child 3 "
                       r"\(head 0\)"):
        layer(x, mask=none)
    per_head = jnp.ones((B, H, N, N), bool).at[1, 2, 3, :4].set(False)
    with pytest.raises(ValueError, match=r"batch index \(1,\).*child 3 \(head 2\)"):
        layer(x, mask=per_head)
    out = nnx.jit(lambda layer, x, m: layer(x, mask=m))(layer, x, none)
    assert np.isnan(np.asarray(out[1, 3])).all() and np.isfinite(np.asarray(out[0])).all()
    # a query masked from every key is padding: unrestricted, its output the unmasked one
    pad = jnp.ones((B, 1, N, N), bool).at[1, 0, 3].set(False)
    np.testing.assert_array_equal(layer(x, mask=pad), layer(x))
    layer.init_cache((B, N, F))
    with pytest.raises(ValueError, match="mask is not supported with decode=True"):
        layer(x[:, :1], mask=jnp.ones((B, 1, 1, N), bool), decode=True)


def test_hyperprior_unknown_name():
    with pytest.raises(KeyError, match="'rate' is not a hyperparameter"):
        layer_for(sinn.geometric()).hyperprior({"rate": dist.Beta(1.0, 1.0)})


# --------------------------------------------------------------------------- bad rows, batched
def _bad_row_cases():
    """(mechanism, inputs_q, inputs_k, text the error names) with a row that has no parent."""
    nan = inputs((B, N, F), jnp.float32).at[1, 4, 2].set(jnp.nan)
    return {
        # more queries than keys: the first queries of a causal cross attention see no key
        "causal_cross": (sinn.causal(), inputs((B, N, F), jnp.float32),
                         inputs((B, M, F), jnp.float32),
                         rf"structinfer.nn.causal: {N} queries but only {M} keys"),
        "nan_input": (sinn.uniform(), nan, None, r"score contains NaN"),
    }


@pytest.mark.parametrize("case", ["causal_cross", "nan_input"])
def test_batched_bad_rows_raise_like_unbatched(case):
    """The unbatched call raises the documented error; the batched call (vmapped heads)
    raises it too, naming the edge site and the batch element, never NaN rows. More
    queries than keys in a causal head is known from the shapes alone: the head's error,
    raised under jit as well."""
    mech, xq, xk, text = _bad_row_cases()[case]
    layer = layer_for(mech)
    first = 1 if case == "nan_input" else 0  # the first batch element with a bad row
    with pytest.raises(ValueError, match=text):
        layer(xq[first], None if xk is None else xk[first])
    jitted = nnx.jit(lambda m, a, b: m(a, b))
    if case == "causal_cross":  # known from the shapes: the head says so, batched and jitted
        for run in (lambda: layer(xq, xk), lambda: jitted(layer, xq, xk)):
            with pytest.raises(ValueError, match=text):
                run()
        return
    with pytest.raises(ValueError, match=rf"edge site 'phi'.*{text}|{text}.*edge site 'phi'") as e:
        layer(xq, xk)
    assert f"batch index ({first},)" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=rf"batch index \(0, {first}\)"):  # two batch dims
        layer(xq[None], None if xk is None else xk[None])
    # under jit the rows are NaN, as the README says (no error, never a finite number)
    out = jitted(layer, xq, xk)
    assert np.isnan(np.asarray(out[first])).any()


# --------------------------------------------------------------------------- empty inputs
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_zero_queries_give_an_empty_output_like_flax(dtype):
    with maybe64(dtype):
        layer = layer_for(sinn.causal(), dtype=dtype)
        mha = nnx.MultiHeadAttention(H, F, qkv_features=H * D, out_features=OUT,
                                     param_dtype=dtype, decode=False, rngs=nnx.Rngs(0))
        for shape in [(B, 0, F), (0, F), (B, 3, 0, F)]:
            x = jnp.ones(shape, dtype)
            out = layer(x)
            want = mha(x)
            assert out.shape == want.shape == shape[:-1] + (OUT,), (out.shape, want.shape)
            assert out.dtype == want.dtype == dtype
        # zero queries and some keys (cross attention): empty as well
        out = layer(jnp.ones((B, 0, F), dtype), jnp.ones((B, M, F), dtype))
        assert out.shape == (B, 0, OUT) and out.dtype == dtype
        out = jax.jit(lambda x: layer(x))(jnp.ones((B, 0, F), dtype))
        assert out.shape == (B, 0, OUT)


def test_zero_keys_are_an_error_naming_the_argument():
    layer = layer_for(sinn.uniform())
    with pytest.raises(ValueError, match=r"inputs_k has no positions.*every query"):
        layer(inputs((B, N, F), jnp.float32), jnp.ones((B, 0, F)))
    with pytest.raises(ValueError, match=r"inputs_k has no positions"):
        layer.explain(inputs((B, N, F), jnp.float32), jnp.ones((B, 0, F)))
    with pytest.raises(ValueError, match=r"no query to explain"):
        layer.explain(jnp.ones((B, 0, F)))


# --------------------------------------------------------------------------- head arguments
@pytest.mark.parametrize("make, match", [
    (lambda: sinn.geometric_beta(-1.0, 1.0), r"geometric_beta: alpha must be positive"),
    (lambda: sinn.geometric_beta(0.0, 1.0), r"geometric_beta: alpha must be positive"),
    (lambda: sinn.geometric_beta(1.0, 0.0), r"geometric_beta: beta must be positive"),
    (lambda: sinn.geometric_beta(1.0, jnp.array([[1.0], [jnp.nan]])),
     r"geometric_beta: beta must be positive"),
    (lambda: sinn.geometric(0.0), r"geometric: q must lie in \(0, 1\)"),
    (lambda: sinn.geometric(1.5), r"geometric: q must lie in \(0, 1\)"),
    (lambda: sinn.geometric(None), r"geometric: q must lie in \(0, 1\), got None"),
    (lambda: sinn.geometric(0.3, max_distance=-1), r"geometric: max_distance must be"),
    (lambda: sinn.geometric(0.3, max_distance=2.5), r"geometric: max_distance must be"),
    (lambda: beta_geometric_log_pmf(jnp.ones(1), -jnp.ones(1), 4),
     r"beta_geometric_log_pmf: beta must be positive"),
    (lambda: beta_geometric_log_pmf(jnp.ones(1), jnp.ones(1), 0),
     r"beta_geometric_log_pmf: size must be a positive int"),
])
def test_head_arguments_are_validated(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_numpy_integer_sizes_are_taken_as_ints():
    """Regression: `window` and `relative_position` refused NumPy integers (`geometric`
    took them); every size of a ready-made head takes one, as a static int, and runs
    the same mechanism as the Python int."""
    x = inputs((H, N, D), jnp.float32)
    for make in (sinn.window, sinn.relative_position,
                 lambda s: sinn.geometric(0.3, max_distance=s)):
        want = si.attention(make(3), "out")(x, x, x)
        np.testing.assert_array_equal(si.attention(make(np.int64(3)), "out")(x, x, x), want)
    with pytest.raises(ValueError,
                       match=r"window: size must be a positive int, got (np.int32\()?0"):
        sinn.window(np.int32(0))


def test_head_arguments_stay_traceable():
    """Traced good arguments work under jit as concrete ones do."""
    f = jax.jit(lambda a, b: beta_geometric_log_pmf(a, b, 4))
    np.testing.assert_allclose(f(jnp.ones(1), jnp.ones(1)),
                               beta_geometric_log_pmf(jnp.ones(1), jnp.ones(1), 4))
    x = inputs((H, N, D), jnp.float32)
    g = jax.jit(lambda a: si.expectation(sinn.geometric_beta(a, 2.0), "out", x, x, x))
    # the reference with concrete arguments (checked as such) in one program of its own
    ref = jax.jit(lambda x: si.expectation(sinn.geometric_beta(2.0, 2.0), "out", x, x, x))(x)
    np.testing.assert_allclose(g(jnp.asarray(2.0)), ref, rtol=1e-5, atol=1e-6)


def test_traced_bad_head_arguments_are_nan_with_a_nan_gradient():
    """Regression: the heads checked their values on concrete arguments only, so a traced
    bad one (under jit or grad) gave a finite wrong answer. As every check of the library,
    a traced bad argument now makes the answer and its gradient NaN."""
    f = lambda a: beta_geometric_log_pmf(a, jnp.ones(1), 4).sum()  # noqa: E731
    assert np.isnan(jax.jit(f)(-jnp.ones(1)))
    assert np.all(np.isnan(jax.grad(f)(-jnp.ones(1))))
    x = inputs((H, N, D), jnp.float32)
    for make, bad in ((lambda a: sinn.geometric_beta(a, 2.0), -1.0),
                      (lambda a: sinn.geometric_beta(2.0, a), 0.0),
                      (lambda a: sinn.geometric(a), 1.5)):
        out = lambda a: si.expectation(make(a), "out", x, x, x).sum()  # noqa: E731
        assert np.isnan(jax.jit(out)(jnp.asarray(bad)))
        assert np.isnan(jax.grad(out)(jnp.asarray(bad)))


@pytest.mark.parametrize("temperature", [False, True])
def test_a_bfloat16_layer_with_a_temperature_keeps_bfloat16_kernels(temperature, gpu):
    """Regression: with ``temperature=True`` the heads divided the bfloat16 queries by
    the float32 temperature parameter, so the score, and the kernel, ran in float32 (on
    a GPU: no cuDNN, and twice the memory), though the output was bfloat16. The
    queries keep the layer's dtype (the platform faked as a GPU: cuDNN's dtype check
    passes; it then refuses here for want of cuDNN)."""
    x = jax.random.normal(jax.random.key(0), (1, 256, 32))  # over the dense kernel's size
    layer = sinn.Attention(sinn.causal(temperature=temperature), num_heads=2, in_features=32,
                           dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    said = str(layer.explain(x))
    assert "cuDNN takes float16" not in said and "cuDNN refused at trace time" in said, said
    assert layer(x).dtype == jnp.bfloat16


@pytest.mark.parametrize("name", ["causal", "window", "relative_position", "geometric",
                                  "geometric_beta"])
def test_more_queries_than_keys_in_a_causal_layer_says_so(name):
    """Regression: cross attention with more queries than keys in a layer whose prior
    forbids later keys (the queries are the last n of the m positions: the first n - m
    have no key at or before them) raised the prior's generic error, which hinted at a
    self-edge (include_self=True) the layer's prior already has. The head now says what
    is wrong (the counts) and what to do, naming itself."""
    layer = sinn.Attention(MECHANISMS[name](), num_heads=2, in_features=8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError) as err:
        layer(jnp.ones((5, 8)), jnp.ones((3, 8)))
    said = str(err.value)
    assert said.startswith(f"structinfer.nn.{name}: 5 queries but only 3 keys"), said
    assert "the first 2 queries have no key at or before them" in said
    assert "at least as many keys as queries" in said and "structinfer.nn.uniform()" in said
    assert "include_self" not in said and "self-edge" not in said
    layer(jnp.ones((3, 8)), jnp.ones((5, 8)))  # fewer queries than keys: a suffix, fine


@pytest.mark.parametrize("factory", ["uniform", "causal", "window", "relative_position",
                                     "geometric", "geometric_beta"])
def test_a_mechanism_factory_passed_uncalled_is_named(factory):
    """Regression: ``Attention(si.nn.causal, ...)`` (the factory, not the mechanism it
    returns) failed while tracing it on q, k, v: 'causal() takes 0 positional arguments
    but 3 were given'."""
    with pytest.raises(TypeError, match=rf"si\.nn\.{factory} makes a mechanism: call it"):
        sinn.Attention(getattr(sinn, factory), num_heads=H, in_features=F, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("make, name", [
    (lambda v: sinn.geometric(v), "q"),
    (lambda v: sinn.geometric_beta(v, 2.0), "alpha"),
    (lambda v: sinn.geometric_beta(1.0, v), "beta"),
])
def test_a_per_head_initial_value_of_the_wrong_shape_is_named(make, name):
    """Regression: one rate per head given as a flat ``(heads,)`` list failed in JAX,
    'Incompatible types for broadcasting: input type=float32[3] and requested type
    float32[3,1]', naming neither the argument nor the shape it needs."""
    flat = [0.2, 0.4, 0.6][:H]
    with pytest.raises(ValueError, match=rf"{name} of shape \({H},\) must broadcast to "
                                         rf"\(heads, 1\) = \({H}, 1\)"):
        sinn.Attention(make(flat), num_heads=H, in_features=F, qkv_features=H * D,
                       rngs=nnx.Rngs(0))
    col = np.asarray(flat)[:, None]  # the documented (heads, 1) works
    layer = sinn.Attention(make(col), num_heads=H, in_features=F, qkv_features=H * D,
                           rngs=nnx.Rngs(0))
    np.testing.assert_allclose(layer.hyperparameters()[name].ravel(), flat, rtol=1e-6)


@pytest.mark.parametrize("name", ["geometric", "geometric_beta", "causal_temperature"])
def test_low_precision_hyperparameters_are_constrained_in_the_computation_dtype(name):
    """Regression: with ``param_dtype=jnp.bfloat16`` and a float32 computation the layer
    mapped each stored (unconstrained) hyperparameter to the mechanism's value in
    bfloat16 (a sigmoid / softplus rounded to 8 bits) and only then cast it to float32:
    a finite answer off by up to 3e-4 from the float32 layer with the same parameters.
    As flax promotes its parameters to the computation dtype before using them, the
    layer equals that float32 layer to float32 rounding."""
    ref = layer_for(MECHANISMS[name](), jnp.float32)
    randomise_hyper(ref)
    layer = sinn.Attention(MECHANISMS[name](), H, F, H * D, OUT, param_dtype=jnp.bfloat16,
                           dtype=jnp.float32, rngs=nnx.Rngs(0))
    nnx.update(layer, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(ref, nnx.Param)))
    nnx.update(ref, jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(layer, nnx.Param)))
    x = inputs((B, N, F), jnp.float32)
    got, want = layer(x), ref(x)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("kw, match", [
    (dict(param_dtype=jnp.int32), r"param_dtype must be a floating dtype.*int32"),
    (dict(dtype=jnp.int32), r"dtype must be None or a floating dtype.*int32"),
    (dict(dtype=jnp.complex64), r"dtype must be None or a floating dtype.*complex64"),
    (dict(dropout_rate=None), r"dropout_rate must lie in \[0, 1\) \(a number\), got None"),
])
def test_bad_dtypes_and_dropout_rate_are_named(kw, match):
    """Regression: an integer ``param_dtype`` reached the geometric prior as a rate of 0
    (its error named ``q``, not the argument), an integer ``dtype`` failed inside the
    projections, and ``dropout_rate=None`` raised a bare ``float()`` TypeError."""
    with pytest.raises(ValueError, match=match):
        sinn.Attention(sinn.geometric(0.3), H, F, H * D, rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("name", ["causal", "geometric"])
def test_decode_answers_in_the_dtype_of_the_full_pass(name):
    """Regression: a bfloat16 layer (bfloat16 parameters and inputs) decoding with
    ``init_cache``'s default float32 cache ran the heads on the float32 cache and
    answered in float32, 4e-3 off its own full pass (flax's layer refuses the dtype
    mix). Each step now runs in the dtype of the projections, as the full pass does,
    and equals it."""
    layer = layer_for(MECHANISMS[name](), jnp.bfloat16)
    x = inputs((B, N, F), jnp.float32).astype(jnp.bfloat16)
    full = layer(x)
    layer.init_cache(x.shape)
    steps = jnp.concatenate([layer(x[:, t:t + 1], decode=True) for t in range(N)], axis=1)
    assert steps.dtype == full.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(steps, np.float32), np.asarray(full, np.float32))


@pytest.mark.parametrize("name", ["geometric", "geometric_beta"])
def test_prior_tables_of_a_bfloat16_layer_are_the_prior_it_applies(name):
    """Regression: ``prior_tables`` of a layer with bfloat16 parameters computed the
    tables from the bfloat16-rounded rates (up to 8e-3 off in log space), not the
    float32 values the heads add: they equal the float32 layer's with the same
    parameters."""
    ref = layer_for(MECHANISMS[name](), jnp.float32)
    randomise_hyper(ref)
    layer = layer_for(MECHANISMS[name](), jnp.bfloat16)
    nnx.update(layer, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(ref, nnx.Param)))
    nnx.update(ref, jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(layer, nnx.Param)))
    got, want = layer.prior_tables(N)["phi"], ref.prior_tables(N)["phi"]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_an_unbatched_bad_row_names_the_head_not_a_batch_index():
    """Regression: on inputs without a batch dim the error of a row with no allowed key
    (or a NaN score) named the head as a batch index, '(batch index (2,))', of an input
    that has no batch; as on batched inputs it names the head, and the layer."""
    layer = sinn.Attention(sinn.causal(), num_heads=H, in_features=F, qkv_features=H * D,
                           rngs=nnx.Rngs(0))
    x = inputs((N, F), jnp.float32)
    mask = jnp.ones((H, N, N), bool).at[2, 3, :4].set(False)
    with pytest.raises(ValueError, match=r"^structinfer\.nn\.Attention: edge site 'phi'.*"
                                         r"child 3 \(head 2\)") as err:
        layer(x, mask=mask)
    assert "batch index" not in str(err.value)
    with pytest.raises(ValueError, match=r"edge site 'phi': score contains NaN") as err:
        layer(x.at[4, 2].set(jnp.nan))
    assert "batch index" not in str(err.value)


def test_a_padding_mask_that_leaves_a_query_no_key_says_so():
    """Regression: a key-padding mask over a window prior that leaves a padded query only
    padded keys raised the prior's generic hint (a causal prior without a self-edge, more
    children than parents: 'use include_self=True'), which the layer's prior already has.
    The error now says that the mask leaves the child none of the parents its prior
    allows, and what to do (mask the padded queries too)."""
    layer = sinn.Attention(sinn.window(3), num_heads=2, in_features=8, rngs=nnx.Rngs(0))
    keep = (jnp.arange(N) < 4)[None, None, :]  # (1, 1, N): one per key
    with pytest.raises(ValueError, match=r"allows no parent for child 6") as err:
        layer(inputs((N, 8), jnp.float32), mask=keep)
    said = str(err.value)
    assert "include_self" not in said and "more children than parents" not in said, said
    assert "mask" in said and "make_attention_mask" in said, said
