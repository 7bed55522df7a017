"""The exact engine's seam: one inspection (ModelInfo roles) and one contraction (log_z).

* ``inspect_model`` on one model with every role (edge, enumerated, latent with and
  without a value, observed, factor, deterministic, param) inside batched plates:
  roles, shapes, plates, supports, placeholders — eagerly and under jit;
* ``log_z`` with kept plates against a per-child log-likelihood written here with
  scipy (a batch plate and a heads plate inside it), eager and under jit, float32 and
  float64; the kept terms sum to the scalar form.

Sizes are distinct primes: 2 batch elements, 3 heads, 5 children, 7 parents, 11 values.
"""

import contextlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conftest import (
    default_xla_env,
    float64,
    lowered_programs,
    matrix,
    return_hop,
    return_hop_brute,
)
from numpyro.distributions import constraints
from numpyro.handlers import substitute
from numpyro.ops.indexing import Vindex
from scipy.special import log_softmax, logsumexp
from scipy.stats import norm

import structinfer as si
from structinfer.exact import EnergyOnlyModelError, ModelInfo, inspect_model, log_z, trace_model
from structinfer.primitives import potential

B, H, N, M, K, D = 2, 3, 5, 7, 11, 2
r = np.random.default_rng(0)
SCORE = r.normal(size=(B, N, M)).astype(np.float32)
VALUES = r.normal(size=(B, M, D)).astype(np.float32)
Y = r.normal(size=(B, N)).astype(np.float32)


def every_role(score, values, y):
    s = numpyro.param("s", jnp.ones(()))  # param
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))  # latent, left without a value
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))  # given a value
    with numpyro.plate("batch", B, dim=-2):
        mix = numpyro.sample("mix", dist.Dirichlet(jnp.ones(3)))  # latent simplex, no value
        with numpyro.plate("children", N, dim=-1):
            phi = si.edge("phi", si.priors.Uniform(M), s * score)  # edge + "phi.score"
            z = numpyro.sample("z", dist.Categorical(jnp.ones(K) / K),
                               infer={"enumerate": "parallel"})  # enumerated
            v = numpyro.deterministic("v", Vindex(values[:, None])[..., phi, :] @ w)
            numpyro.factor("f", 0.1 * z)  # factor
            mu = numpyro.deterministic("mu", v + mix[..., 0])
            numpyro.sample("y", dist.Normal(mu, sigma), obs=y)  # observed


def check_every_role(info: ModelInfo):
    roles = {n: s.role for n, s in info.items()}
    assert roles == {
        "s": "param", "sigma": "latent", "w": "latent", "mix": "latent", "phi": "edge",
        "phi.score": "factor", "z": "enumerated", "v": "deterministic", "f": "factor",
        "mu": "deterministic", "y": "observed",
    }
    assert info.plates == {"batch": (-2, B), "children": (-1, N)}
    assert info.max_plate_nesting == 2 and info.first_available_dim == -3
    both = ("batch", "children")
    for name in ("phi", "phi.score", "z", "v", "f", "mu", "y"):
        assert info[name].plates == both, name
    assert info["mix"].plates == ("batch",) and info["sigma"].plates == ()
    # enumerated sites: batch shape and support size
    assert info["phi"].shape == (B, N) and info["phi"].num_values == M
    assert info["z"].shape == (B, N) and info["z"].num_values == K
    assert info["phi"].edge is not None and info["phi"].edge.num_parents == M
    assert info["phi"].edge.children_plate == "children" and info["z"].edge is None
    assert info.enumerated == {"phi": ((B, N), M), "z": ((B, N), K)}
    assert info.edges == ["phi"]
    # latent sites: shapes, supports, whether they had a value
    assert info["sigma"].shape == () and info["sigma"].support is constraints.positive
    assert info["mix"].shape == (B, 1, 3) and info["mix"].support is constraints.simplex
    assert info["w"].shape == (D,) and info["w"].event_dim == 1
    assert info["w"].support.event_dim == 1  # real_vector: Normal(...).to_event(1)
    assert info.unvalued == ["sigma", "mix"] and info["w"].has_value
    assert jnp.issubdtype(info["sigma"].dtype, jnp.floating)
    # deterministic: shape and event dims beyond the plates
    assert info.deterministic == {"v": ((B, N), 0), "mu": ((B, N), 0)}
    # factors and observations
    assert info["f"].shape == (B, N) and info["phi.score"].shape == (B, N)
    assert info["y"].shape == (B, N) and info["y"].support is constraints.real
    assert info.observed == ["y"] and info.factors == ["phi.score", "f"]
    assert info["s"].shape == () and info["s"].site_type == "param"
    assert info["y"].site_type == "sample" and info["v"].site_type == "deterministic"
    assert info.sites["batch"] == "plate" and info.sites["phi"] == "sample"
    probes = info.probes()
    assert probes["phi"].shape == (M, 1, 1) and probes["z"].shape == (K, 1, 1, 1)


def test_model_info_reads_every_role():
    model = substitute(every_role, data={"w": jnp.ones(D)})
    check_every_role(inspect_model(model, SCORE, VALUES, Y))

    box = []

    @jax.jit
    def traced(score, values, y):
        box.append(inspect_model(model, score, values, y))
        return 0.0

    traced(SCORE, VALUES, Y)
    check_every_role(box[0])


def test_placeholders_lie_inside_the_support_and_are_not_draws():
    model = substitute(every_role, data={"w": jnp.ones(D)})
    tr = trace_model(model, (SCORE, VALUES, Y), placeholders=True)
    assert float(tr["sigma"]["value"]) == 1.0  # exp(0): biject_to(positive) at the origin
    mix = np.asarray(tr["mix"]["value"])
    np.testing.assert_allclose(mix, np.full((B, 1, 3), 1 / 3), rtol=1e-6)
    # without placeholders the unvalued site is refused by name
    with pytest.raises(ValueError, match="sample site 'sigma' is latent and not enumerable"):
        trace_model(model, (SCORE, VALUES, Y))
    # the engine functions that contract the model refuse it too
    with pytest.raises(ValueError, match="sample site 'sigma' is latent and not enumerable"):
        si.log_marginal(model, SCORE, VALUES, Y)


# --------------------------------------------------------------------------------------
# log Z with kept plates: a batch plate and a heads plate inside it
# --------------------------------------------------------------------------------------


def heads_model(logits, score, values, y):
    """y[b, h, i] ~ N(values[b, h, phi[b, h, i]], 0.5), phi ~ softmax(logits + score)."""
    with (
        numpyro.plate("batch", B, dim=-3),
        numpyro.plate("heads", H, dim=-2),
        numpyro.plate("children", N, dim=-1),
    ):
        phi = si.edge("phi", si.priors.Categorical(logits), score)
        mu = si.gather(values[:, :, None, :], phi)
        numpyro.sample("y", dist.Normal(mu, 0.5), obs=y)


def heads_data(dtype):
    g = np.random.default_rng(1)
    logits = g.normal(size=(B, H, N, M))
    score = g.normal(size=(B, H, N, M))
    values = g.normal(size=(B, H, M))
    y = g.normal(size=(B, H, N))
    return tuple(jnp.asarray(a, dtype) for a in (logits, score, values, y))


def brute_heads(logits, score, values, y):
    """ll[b, h, i] = log sum_j softmax_j(log p + score)[b, h, i, j] N(y[b, h, i]; values[b, h, j])."""
    logits, score, values, y = (np.asarray(a, np.float64) for a in (logits, score, values, y))
    ll = np.zeros((B, H, N))
    for b in range(B):
        for h in range(H):
            for i in range(N):
                lp = log_softmax(log_softmax(logits[b, h, i]) + score[b, h, i])
                ll[b, h, i] = logsumexp(lp + norm.logpdf(y[b, h, i], values[b, h], 0.5))
    return ll


@pytest.mark.parametrize("precision", ["float32", "float64"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_log_z_keeps_plates_per_child(precision, jit, request):
    if precision == "float64":
        request.getfixturevalue("x64")
    dtype = jnp.float32 if precision == "float32" else jnp.float64
    data = heads_data(dtype)
    ref = brute_heads(*data)

    def kept(*a):
        info = inspect_model(heads_model, *a)  # one inspection for the three contractions
        observed = log_z(heads_model, a, info=info, keep_plates="observed",
                         score_factors="normalize")
        if not jit:  # eager funsor is slow: one contraction is enough there
            return observed, None, None
        outer = log_z(heads_model, a, info=info, keep_plates=("batch", "children"),
                      score_factors="normalize")
        return observed, outer, log_z(heads_model, a, info=info)

    observed, outer, scalar = (jax.jit(kept) if jit else kept)(*data)
    tol = 2e-5 if precision == "float32" else 1e-12
    assert observed.shape == (B, H, N) and observed.dtype == dtype
    np.testing.assert_allclose(observed, ref, rtol=tol, atol=tol)
    if not jit:
        return
    # heads inside the kept (batch, children) plates are multiplied out first
    assert outer.shape == (B, N)
    np.testing.assert_allclose(outer, ref.sum(1), rtol=tol, atol=tol)
    # the scalar form keeps the score normalisers: log Z = sum ll + sum_i lse_j(log p + s)
    logits, score = (np.asarray(a, np.float64) for a in data[:2])
    lse = logsumexp(log_softmax(logits, -1) + score, -1).sum()
    np.testing.assert_allclose(scalar, ref.sum() + lse, rtol=tol, atol=tol * 100)


def test_log_z_kept_structure_and_errors():
    data = heads_data(jnp.float32)
    value, struct = log_z(heads_model, data, keep_plates=("batch", "children"),
                          score_factors="normalize", return_structure=True)
    assert struct.plates == ("batch", "children") and struct.shape == (B, N)
    assert struct.observed == ("y",) and struct.conditional_factors == ("phi.score",)
    with pytest.raises(EnergyOnlyModelError, match=r"'phi\.score'.*score_factors='normalize'"):
        log_z(heads_model, data, keep_plates="observed")
    with pytest.raises(ValueError, match=r"keep_plates names \['time'\]"):
        log_z(heads_model, data, keep_plates=("time",), score_factors="normalize")
    with pytest.raises(ValueError, match="tilts and keep_plates"):
        log_z(heads_model, data, keep_plates="observed",
              tilts={"phi": (jnp.zeros((B, H, N, M)), 0)})
    scalar, none = log_z(heads_model, data, return_structure=True)
    assert none is None and scalar.shape == ()


def test_likelihood_structure_before_fitting():
    """Latent sites without values get placeholders: the structure is static."""

    def model(values, y):
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
        with numpyro.plate("children", N):
            phi = si.edge("phi", si.priors.Uniform(M))
            numpyro.sample("y", dist.Normal(si.gather(values, phi), sigma), obs=y)

    values, y = jnp.asarray(r.normal(size=M)), jnp.asarray(r.normal(size=N))
    s = si.exact.likelihood_structure(model, None, values, y)
    assert s.name == "y" and s.plates == ("children",) and s.shape == (N,)
    with pytest.raises(ValueError, match="sample site 'sigma' is latent"):
        si.exact.pointwise_log_likelihood(model, None, values, y)


def _dtype_model(q, k, v):
    with numpyro.plate("children", q.shape[0]):
        phi = si.edge("phi", si.priors.Restricted.causal(q.shape[0], k.shape[0]),
                      si.scores.Dot(q, k))
        numpyro.deterministic("out", Vindex(v)[..., phi, :])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_float32_model_gives_float32_answers_with_x64_enabled(x64, jit):
    """With float64 switched on, a float32 model's marginals and expectations stay float32
    (the zero tilts take the model's dtype, not the default float)."""
    r = np.random.default_rng(3)
    q, k, v = (jnp.asarray(r.normal(size=s), jnp.float32) for s in [(5, 3), (5, 3), (5, 2)])
    marg = (jax.jit(si.marginals, static_argnums=0) if jit else si.marginals)(_dtype_model, q, k, v)
    out = (jax.jit(si.expectation, static_argnums=(0, 1)) if jit else si.expectation)(
        _dtype_model, "out", q, k, v)
    assert marg["phi"].dtype == jnp.float32 and out.dtype == jnp.float32
    with float64():  # the same model in float64 answers in float64
        q64, k64, v64 = (jnp.asarray(a, jnp.float64) for a in (q, k, v))
        assert si.marginals(_dtype_model, q64, k64, v64)["phi"].dtype == jnp.float64
        np.testing.assert_allclose(si.expectation(_dtype_model, "out", q64, k64, v64), out,
                                   rtol=1e-5, atol=1e-6)


def _scoreless_model(y, mu):
    with numpyro.plate("children", y.shape[0]):
        phi = si.edge("phi", si.priors.Uniform(mu.shape[0]))
        # a float32 scale: NumPyro's Normal with a Python float scale is float64 under x64
        numpyro.sample("y", dist.Normal(mu[phi], jnp.ones((), mu.dtype)), obs=y)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_scoreless_float32_model_gives_float32_answers_with_x64_enabled(x64, jit):
    """Regression: an edge with a parameter-free prior and no score (its table in the
    default float) made a float32 model answer in float64; the answers equal float64's."""
    y = jnp.asarray([0.1, 1.2, 1.9, -0.3], jnp.float32)
    mu = jnp.asarray([0.0, 1.0, 2.0], jnp.float32)
    wrap = (lambda f: jax.jit(f, static_argnums=0)) if jit else (lambda f: f)  # noqa: E731
    lz = wrap(si.log_marginal)(_scoreless_model, y, mu)
    marg = wrap(si.marginals)(_scoreless_model, y, mu)["phi"]
    ll = (jax.jit(si.exact.pointwise_log_likelihood, static_argnums=0) if jit
          else si.exact.pointwise_log_likelihood)(_scoreless_model, None, y, mu)
    assert lz.dtype == marg.dtype == ll.dtype == jnp.float32
    y64, mu64 = (jnp.asarray(a, jnp.float64) for a in (y, mu))
    # brute force: sum_i log sum_j (1/3) N(y_i | mu_j, 1)
    ref = np.log((np.exp(-0.5 * (np.asarray(y64)[:, None] - np.asarray(mu64)) ** 2)
                  / np.sqrt(2 * np.pi) / 3).sum(1))
    np.testing.assert_allclose(ll, ref, rtol=1e-6)
    np.testing.assert_allclose(lz, ref.sum(), rtol=1e-6)
    assert si.log_marginal(_scoreless_model, y64, mu64).dtype == jnp.float64


def _causal_head(q, k, v):
    with numpyro.plate("queries", q.shape[0]):
        phi = si.edge("phi", si.priors.Restricted.causal(q.shape[0]),
                      si.scores.Dot(q, k, scale=q.shape[-1] ** -0.5))
        numpyro.deterministic("out", Vindex(v)[..., phi, :])


#: the check of ``test_causal_expectation_is_right_at_4097_under_jit``, run in a subprocess
CAUSAL_4097 = textwrap.dedent(
    """
    import jax, numpy as np, numpyro
    from numpyro.ops.indexing import Vindex
    import structinfer as si

    jax.config.update("jax_enable_compilation_cache", False)  # each jit really compiles


    def causal_head(q, k, v):
        with numpyro.plate("queries", q.shape[0]):
            phi = si.edge("phi", si.priors.Restricted.causal(q.shape[0]),
                          si.scores.Dot(q, k, scale=q.shape[-1] ** -0.5))
            numpyro.deterministic("out", Vindex(v)[..., phi, :])


    n, d = 4097, 32
    r = np.random.default_rng(4097)
    q, k, v = (r.normal(size=(n, d)).astype(np.float32) for _ in range(3))
    s = (q.astype(np.float64) @ k.T.astype(np.float64)) * d**-0.5
    s[np.triu_indices(n, 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)
    for _ in range(3):  # a fresh jit each time: a new compile
        out = np.asarray(jax.jit(lambda q, k, v: si.expectation(causal_head, "out", q, k, v))(
            q, k, v))
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, atol=2e-5)
    print("ok")
    """
)


def test_causal_expectation_is_right_at_4097_under_jit():
    """Regression: one causal head's compiled expectation at n = 4097 (head dim 32,
    float32) gave NaN rows or rows off by ~1 on CPU. The value's tilt was a dot of the
    values with the zero tilt, fused by XLA:CPU's YNNPACK with the softmax reductions and
    written over its own input (docs/known_issues.md). Whether a compile is hit varies
    from compile to compile, so three fresh compiles are checked against a float64
    softmax. It runs in a subprocess with XLA's default flags (the session compiles with
    fast-compile flags: tests/conftest.py), the code users run."""
    proc = subprocess.run([sys.executable, "-c", CAUSAL_4097], env=default_xla_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_a_non_finite_value_is_never_a_finite_wrong_number():
    """An infinite entry in one head's values makes that head's expectation non-finite,
    never a finite wrong number; a value with no event entries is an empty expectation
    (eager and under jit)."""
    h, n, d = 2, 5, 3
    r = np.random.default_rng(6)
    q, k = (r.normal(size=(h, n, d)).astype(np.float32) for _ in range(2))
    v = r.normal(size=(h, n, d)).astype(np.float32)
    v[0, 2, 1] = np.inf

    def heads(q, k, v):
        with numpyro.plate("heads", h, dim=-2), numpyro.plate("queries", n, dim=-1):
            phi = si.edge("phi", si.priors.Uniform(n), si.scores.Dot(q, k))
            numpyro.deterministic("out", Vindex(v[:, None])[..., phi, :])

    s = np.einsum("hid,hjd->hij", q.astype(np.float64), k.astype(np.float64))
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hij,hjd->hid", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    for run in (si.expectation, jax.jit(si.expectation, static_argnums=(0, 1))):
        out = np.asarray(run(heads, "out", q, k, v))
        assert not np.isfinite(out[0]).all()
        fin = np.isfinite(out)
        np.testing.assert_allclose(out[fin], want[fin], rtol=1e-5, atol=1e-6)
        empty = np.asarray(run(heads, "out", q, k, v[..., :0]))
        assert empty.shape == (h, n, 0)


def test_a_nonzero_tilt_on_a_value_is_the_tilted_log_z():
    """``log_z`` with a non-zero tilt $t$ on a value adds $\\langle t, v(\\phi)\\rangle$ to
    every structure's log-weight (the forward pass skips that dot only at $t = 0$)."""
    r = np.random.default_rng(5)
    q, k, v = (jnp.asarray(r.normal(size=s), jnp.float32) for s in [(N, 3), (N, 3), (N, D)])
    t = jnp.asarray(r.normal(size=(N, D)), jnp.float32)
    s = np.asarray(q @ k.T, np.float64) * 3**-0.5
    s[np.triu_indices(N, 1)] = -np.inf
    want = logsumexp(s - np.log(np.arange(1, N + 1))[:, None]
                     + np.asarray(t, np.float64) @ np.asarray(v, np.float64).T, axis=-1).sum()
    f = jax.jit(lambda t: log_z(_causal_head, (q, k, v), tilts={"out": (t, 1)}))
    np.testing.assert_allclose(f(t), want, rtol=1e-5)
    np.testing.assert_allclose(f(jnp.zeros_like(t)), log_z(_causal_head, (q, k, v)), rtol=1e-6)
    # the derivative at a non-zero tilt is the tilted posterior's expectation
    w = s - np.log(np.arange(1, N + 1))[:, None] + np.asarray(t @ v.T, np.float64)
    pt = np.exp(w - logsumexp(w, axis=-1, keepdims=True))
    np.testing.assert_allclose(jax.jit(jax.grad(f))(t),
                               pt @ np.asarray(v, np.float64), rtol=1e-5, atol=1e-6)


def test_a_repeated_eager_call_lowers_no_new_program():
    """Regression: the engine's two ``lax.cond`` (reading a table at an enumerated
    value, the tilt's inner product) took branch functions made anew at every call, so
    JAX traced, lowered and compiled them again at each eager call of the exact engine
    (0.1-0.4 s a call, 3-5x the rest of a repeated call). A repeated call with the same
    shapes must lower nothing."""
    def model(q, k, v):
        with numpyro.plate("heads", 2, dim=-2), numpyro.plate("queries", 6, dim=-1):
            j = si.edge("phi", si.priors.Restricted.causal(6), si.scores.Dot(q, k, scale=0.3))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    q, k, v = (jnp.asarray(r.normal(size=(2, 6, 3)), jnp.float32) for _ in range(3))

    def calls():
        return (si.log_marginal(model, q, k, v), si.marginals(model, q, k, v),
                si.expectation(model, "out", q, k, v))

    first = calls()
    with lowered_programs() as lowered:
        again = calls()
    assert not lowered
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


def _no_structure_models():
    """Two models that give every structure zero probability: independent edges whose
    every parent a factor forbids, and a Markov chain that must end in a state it can
    never reach (its one allowed move is to stay)."""
    from numpyro.contrib.control_flow import scan

    def forbidden(s):
        with numpyro.plate("children", s.shape[0]):
            j = si.edge("phi", si.priors.Uniform(s.shape[1]), s)
            forbid = jnp.where(j < 2, -jnp.inf, 0.0) + jnp.where(j >= 2, -jnp.inf, 0.0)
            potential("forbid", forbid.astype(s.dtype))  # the model is in the scores' dtype
            numpyro.deterministic("out", jnp.sin(1.0 + j).astype(s.dtype))

    k = 3
    stay = jnp.asarray(np.where(np.eye(k, dtype=bool), 0.0, -np.inf), jnp.float32)
    start = jnp.asarray([0.0, -np.inf, -np.inf], jnp.float32)

    def stuck(emission):
        prior = si.priors.Markov(stay, start)

        def step(previous, xs):
            e, is_last = xs
            z = si.edge("z", prior, e, previous=previous)
            potential("end", jnp.where(is_last & (z != k - 1), -jnp.inf, 0.0))
            numpyro.deterministic("out", jnp.sin(1.0 + z))
            return z, None

        scan(step, jnp.asarray(-1), (emission, jnp.arange(emission.shape[0]) == emission.shape[0] - 1))

    r = np.random.default_rng(8)
    return {
        "forbidden": (forbidden, jnp.asarray(r.normal(size=(3, 4)), jnp.float32), "phi"),
        "markov": (stuck, jnp.asarray(r.normal(size=(5, k)), jnp.float32), "z"),
    }


@pytest.mark.parametrize("case", ["forbidden", "markov"])
def test_no_possible_structure_is_an_error_or_minus_one_never_a_forbidden_structure(case):
    """Regression: `map_edges` and `sample_edges` read a structure off funsor's (or the
    Viterbi) tables even when every structure has zero probability, and returned a
    forbidden one (all zeros, or a path the chain cannot take); the expectations and
    marginals were NaN with no error on concrete inputs. On concrete inputs each is now an
    error naming the model; under jit and vmap every edge reads -1 and an expectation NaN.
    ``log_marginal`` is -inf (the log of zero), as before."""
    model, x, site = _no_structure_models()[case]
    key = jax.random.PRNGKey(0)
    # (eager calls of a model with NumPyro's scan lower its programs at every call: the
    # chain's eager check is the fused path's, below; both paths share the check)
    if case == "forbidden":
        assert float(si.log_marginal(model, x)) == -np.inf
        for run in (si.map_edges, lambda m, x: si.sample_edges(key, m, x)):
            with pytest.raises(ValueError, match=f"model '{model.__name__}' has no "
                               f"structure.*'{site}'.*zero probability"):
                run(model, x)

    def both(x):
        return si.map_edges(model, x)[site], si.sample_edges(key, model, x)[site]

    for out in jax.jit(both)(x):
        assert out.dtype == jnp.int32 and np.all(np.asarray(out) == -1), out
    # the posterior's expectations and marginals (eagerly the exact engine's and the
    # fused path's error; NaN under jit, as before)
    zero = "gives every structure of its edge sites zero probability"
    with pytest.raises(ValueError, match=zero):
        si.attention(model, "out")(x)
    if case == "forbidden":
        x16 = x.astype(jnp.bfloat16)  # bfloat16 has float32's range: read it too
        for run in (lambda: si.expectation(model, "out", x), lambda: si.marginals(model, x),
                    lambda: si.expectation(model, "out", x16)):
            with pytest.raises(ValueError, match=zero):
                run()
        assert np.all(np.isnan(jax.jit(lambda x: si.expectation(model, "out", x))(x)))

        def free(s):  # a possible structure is returned as before
            with numpyro.plate("children", s.shape[0]):
                si.edge("phi", si.priors.Uniform(s.shape[1]), s)

        want = np.argmax(np.asarray(x), -1)
        np.testing.assert_array_equal(si.map_edges(free, x)["phi"], want)
        # under vmap, per element: a NaN score has no structure either (never argmax's
        # pick among NaNs), while its neighbour in the batch keeps its own
        out = jax.jit(jax.vmap(lambda s: si.map_edges(free, s)["phi"]))(
            jnp.stack([x, x.at[0, 0].set(jnp.nan)]))
        np.testing.assert_array_equal(out, np.stack([want, np.full_like(want, -1)]))


# ---------------------------------------------------------------------------------------
# A masked-out edge site (numpyro.handlers.mask): a child that is not there


def _masked_attention(q, k, v, mask, prior):
    with numpyro.plate("children", q.shape[0]):
        with numpyro.handlers.mask(mask=mask):
            j = si.edge("phi", prior, si.scores.Dot(q, k))
        numpyro.deterministic("out", v[j])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("prior", ["uniform", "causal", "geometric"])
def test_a_masked_out_child_adds_nothing_to_log_z(x64, prior, jit):
    """Regression: a masked edge site summed a log-prob of 0 over every parent, so each
    masked-out child added log(parents) to log Z (NumPyro's mask of an enumerated site).
    A masked-out child now takes its parent uniformly among those its prior allows: log Z
    is that of the model without it, and its marginal and expectation are the uniform
    ones there (the causal and geometric priors allow each child the earlier parents)."""
    r = np.random.default_rng(3)
    n = m = 5
    q, k, v = (jnp.asarray(r.normal(size=(n, 3))) for _ in range(3))
    mask = jnp.array([True, False, True, True, False])
    pr = {"uniform": si.priors.Uniform(m), "causal": si.priors.Restricted.causal(n),
          "geometric": si.priors.Geometric(0.4, n)}[prior]
    args = (q, k, v, mask, pr)
    fns = [lambda *a: si.log_marginal(_masked_attention, *a),
           lambda *a: si.marginals(_masked_attention, *a)["phi"],
           lambda *a: si.expectation(_masked_attention, "out", *a)]
    log_z, marg, out = (jax.jit(f, static_argnums=4)(*args) if jit else f(*args)
                        for f in fns)
    # independent: the kept children's log-sum-exp of log prior + q.k, by hand
    lp = np.asarray(pr.log_table(n))
    s = lp + np.asarray(q) @ np.asarray(k).T
    keep = np.asarray(mask)
    np.testing.assert_allclose(log_z, logsumexp(s[keep], axis=-1).sum(), rtol=1e-12)
    np.testing.assert_allclose(marg[keep], np.exp(s - logsumexp(s, -1, keepdims=True))[keep],
                               rtol=1e-12)
    allowed = np.isfinite(lp) & np.ones((n, m), bool)
    uniform = allowed / allowed.sum(-1, keepdims=True)
    np.testing.assert_allclose(marg[~keep], uniform[~keep], rtol=1e-12)
    np.testing.assert_allclose(out[~keep], uniform[~keep] @ np.asarray(v), rtol=1e-12)
    # every child masked out (a Python False as well): log Z is 0
    none = (q, k, v, False, pr)
    np.testing.assert_allclose(si.log_marginal(_masked_attention, *none), 0.0, atol=1e-12)
    np.testing.assert_allclose(
        si.log_marginal(_masked_attention, q, k, v, jnp.zeros(n, bool), pr), 0.0, atol=1e-12)


def test_a_masked_out_childs_nan_score_is_not_refused():
    """Regression: a NaN score in a masked-out child's row (padding may hold anything) was
    refused by the eager exact engine while ``jit`` and ``si.attention`` answered (a
    masked-out Markov step's too). It is not refused: eager equals jit, the kept children
    are those of the model without that child, and a NaN entry counts as a forbidden
    parent, as ``-inf`` does; a NaN in a kept child's row is still refused, naming it."""
    r = np.random.default_rng(5)
    q, k, v = (np.asarray(r.normal(size=(4, 3)), np.float32) for _ in range(3))
    q[3] = np.nan
    mask = jnp.array([True, True, True, False])
    args = (q, k, v, mask, si.priors.Uniform(4))
    out = si.expectation(_masked_attention, "out", *args)
    jitted = jax.jit(lambda *a: si.expectation(_masked_attention, "out", *a, args[4]))
    np.testing.assert_allclose(out, jitted(*args[:4]), atol=1e-6)
    s = q[:3] @ k.T - np.log(4.0)  # the uniform prior's log-table
    p = np.exp(s - logsumexp(s, -1, keepdims=True))
    np.testing.assert_allclose(out, np.concatenate([p, np.full((1, 4), 0.25)]) @ v, atol=1e-6)
    np.testing.assert_allclose(si.log_marginal(_masked_attention, *args),
                               logsumexp(s, -1).sum(), rtol=1e-6)
    with pytest.raises(ValueError, match=r"edge site 'phi': score contains NaN at index "
                       r"\(3, 0\)"):
        si.log_marginal(_masked_attention, q, k, v, jnp.ones(4, bool), args[4])

    def table(s, keep):  # a row partly NaN: those parents are forbidden, the rest uniform
        with numpyro.plate("children", 2), numpyro.handlers.mask(mask=keep):
            si.edge("phi", si.priors.Uniform(3), s)

    s = jnp.asarray([[0.0, 1.0, 2.0], [0.0, jnp.nan, 5.0]])
    keep = jnp.asarray([True, False])
    for marg in (si.marginals(table, s, keep)["phi"],
                 jax.jit(lambda *a: si.marginals(table, *a)["phi"])(s, keep)):
        np.testing.assert_allclose(marg, [np.exp([0, 1, 2]) / np.exp([0, 1, 2]).sum(),
                                          [0.5, 0.0, 0.5]], atol=1e-6)

    from numpyro.contrib.control_flow import scan

    def chain(em, keep):  # a masked-out first step with a NaN emission
        prior = si.priors.Markov(jnp.zeros((3, 3)), jnp.zeros(3))

        def step(previous, xs):
            e, kp = xs
            with numpyro.handlers.mask(mask=kp):
                return si.edge("z", prior, e, previous=previous), None

        scan(step, jnp.asarray(-1), (em, keep))

    em = jnp.asarray([[0.0, jnp.nan, 0.0], [0.3, -0.2, 0.5]])
    keep = jnp.asarray([False, True])
    want = np.exp([0.3, -0.2, 0.5]) / np.exp([0.3, -0.2, 0.5]).sum()
    if numpyro.__version__.startswith("0.15."):  # get_mask fails inside its scan steps:
        with pytest.raises(ValueError, match="score contains NaN"):  # refused, as before
            si.marginals(chain, em, keep)
        return
    np.testing.assert_allclose(si.marginals(chain, em, keep)["z"],  # (jit answered)
                               [[0.5, 0.0, 0.5], want], atol=1e-6)


def test_under_a_mask_a_bad_score_entry_is_named_by_its_own_value():
    """Regression: under ``numpyro.handlers.mask`` the score's check read the edge's table
    (log-prior + score), so a +inf score where a causal prior forbids the edge was named
    NaN (-inf + inf), and a mask that does not broadcast against the children raised
    NumPy's broadcasting error from the check instead of NumPyro's later one."""
    def model(s, keep):
        with numpyro.plate("c", 4), numpyro.handlers.mask(mask=keep):
            si.edge("phi", si.priors.Restricted.causal(4), si.scores.Custom(s))

    s = np.zeros((4, 4), np.float32)
    s[0, 3] = np.inf  # above the diagonal: the prior forbids it
    for keep in (True, jnp.ones(4, bool)):
        with pytest.raises(ValueError, match=r"score contains inf at index \(0, 3\) "
                           r"\(shape \(4, 4\)\)"):
            si.log_marginal(model, s, keep)
    with pytest.raises(ValueError, match="Incompatible shapes for broadcasting"):
        si.log_marginal(model, np.zeros((4, 4), np.float32), jnp.ones(3, bool))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_padded_child_with_no_allowed_parent_has_zero_gradient(x64, jit):
    """Regression: a padded query (masked out) whose keys are all padding too (a score
    row of -inf) made d log Z / d score NaN on every entry of its row under jit (the
    logsumexp of the empty row, read through the mask's where: 0 * NaN), and was refused
    eagerly as a child left no parent. It is not there: its gradient is 0, and the kept
    children's is that of the model without it (the plain softmax of their rows)."""
    r = np.random.default_rng(4)
    n = m = 4
    keep = jnp.array([True, True, True, False])
    s = jnp.where(keep[None, :] & keep[:, None], jnp.asarray(r.normal(size=(n, m))), -jnp.inf)

    def model(s):
        with numpyro.plate("children", n), numpyro.handlers.mask(mask=keep):
            si.edge("phi", si.priors.Uniform(m), s)

    f = lambda s: si.log_marginal(model, s)  # noqa: E731
    log_z, grad = (jax.jit(jax.value_and_grad(f)) if jit else jax.value_and_grad(f))(s)
    kept = np.asarray(s)[:3, :3] - np.log(m)
    np.testing.assert_allclose(log_z, logsumexp(kept, -1).sum(), rtol=1e-12)
    if not jit:  # on concrete values, the check of empty rows passes the padded child
        np.testing.assert_allclose(f(s), log_z, rtol=1e-12)
    want = np.zeros((n, m))
    want[:3, :3] = np.exp(kept - logsumexp(kept, -1, keepdims=True))
    np.testing.assert_allclose(grad, want, rtol=1e-12, atol=1e-15)


def test_a_padded_child_the_prior_leaves_no_parent_is_not_refused(x64):
    """Regression: a prior that gives a padded child (masked out) no parent, a
    ``Restricted`` mask of the kept pairs, was refused eagerly as a child left no parent
    (the prior's own check), eagerly and under jit. Log Z is the kept children's; a kept
    child with no parent is still refused, and under jit (a traced mask: which children
    are kept is not known) log Z is not finite."""
    r = np.random.default_rng(8)
    n = 4
    keep = np.array([True, True, True, False])
    allowed = np.tril(np.ones((n, n), bool)) & keep[:, None] & keep[None, :]
    s = jnp.asarray(r.normal(size=(n, n)))

    def model(s, keep):
        with numpyro.plate("children", n), numpyro.handlers.mask(mask=keep):
            si.edge("phi", si.priors.Restricted(allowed), s)

    t = np.where(allowed, np.asarray(s) - np.log(np.maximum(allowed.sum(-1, keepdims=True),
                                                            1)), -np.inf)
    want = logsumexp(t[:3], -1).sum()
    np.testing.assert_allclose(si.log_marginal(model, s, jnp.asarray(keep)), want, rtol=1e-12)
    np.testing.assert_allclose(jax.jit(lambda s: si.log_marginal(model, s, keep))(s), want,
                               rtol=1e-12)
    with pytest.raises(ValueError, match="Restricted prior allows no parent for child 3"):
        si.log_marginal(model, s, jnp.ones(n, bool))
    assert not np.isfinite(jax.jit(lambda s, k: si.log_marginal(model, s, k))(
        s, jnp.ones(n, bool)))


def test_attention_with_padded_queries_and_keys_has_the_gradients_of_the_unpadded(x64):
    """As above through ``si.attention`` under jit (padding keys masked by
    ``mask_parents``, from every query a padded one; padded queries masked out by
    ``numpyro.handlers.mask``): the gradients in q, k
    and v are those of a plain softmax over the kept rows (a padded query reads the
    values' mean: its edge is uniform), no NaN."""
    r = np.random.default_rng(6)
    n, d = 4, 2
    q, k, v = (jnp.asarray(r.normal(size=(n, d))) for _ in range(3))
    keep = jnp.array([True, True, True, False])

    def model(q, k, v):
        with numpyro.plate("children", n):
            pad = keep[:, None] & keep[None, :]  # a padded query is allowed no key
            with si.handlers.mask_parents(mask=pad), numpyro.handlers.mask(mask=keep):
                j = si.edge("phi", si.priors.Uniform(n), si.scores.Dot(q, k))
            numpyro.deterministic("out", v[j])

    att = si.attention(model, "out")

    def plain(q, k, v):
        o = jax.nn.softmax(q[:3] @ k[:3].T, -1) @ v[:3]
        return jnp.sum(o ** 2) + jnp.sum(v.mean(0) ** 2)

    got = jax.jit(jax.grad(lambda *a: jnp.sum(att(*a) ** 2), (0, 1, 2)))(q, k, v)
    for g, w in zip(got, jax.grad(plain, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14)


def test_a_masked_out_child_observed_through_its_edge_takes_its_parent_uniformly(x64):
    """An observation read at a masked-out child's edge sees a uniform parent among those
    its prior allows: the child's term is the uniform mixture over them, a proper
    density."""
    keys, x = jnp.array([0.0, 2.0, 4.0]), jnp.array([0.3, 2.5])

    def model(x):
        with numpyro.plate("children", 2):
            with numpyro.handlers.mask(mask=jnp.array([True, False])):
                phi = si.edge("phi", si.priors.Geometric(0.5, 3), jnp.zeros((2, 3)))
            numpyro.sample("x", dist.Normal(keys[phi], 1.0), obs=x)

    lp = np.asarray(si.priors.Geometric(0.5, 3).log_table(2))
    like = norm.logpdf(np.asarray(x)[:, None], np.asarray(keys), 1.0)
    allowed = np.isfinite(lp[1])
    assert allowed.sum() == 2  # the geometric prior allows child 1 the parents 0 and 1
    want = logsumexp(lp[0] + like[0]) + logsumexp(like[1][allowed]) - np.log(allowed.sum())
    np.testing.assert_allclose(si.log_marginal(model, x), want, rtol=1e-12)


def test_masked_out_steps_of_a_markov_chain_add_nothing_to_log_z(x64):
    """Padding a chain (steps masked out, as in an HMM over sequences of unequal length):
    log Z is that of the unpadded chain, by brute force over every path."""
    import itertools

    from numpyro.contrib.control_flow import scan

    r = np.random.default_rng(5)
    steps, kk, length = 4, 3, 2
    em, lt, li = r.normal(size=(steps, kk)), r.normal(size=(kk, kk)), r.normal(size=kk)

    def chain(em, keep):
        prior = si.priors.Markov(jnp.asarray(lt), jnp.asarray(li))

        def step(previous, xs):
            e, kp = xs
            with numpyro.handlers.mask(mask=kp):
                z = si.edge("z", prior, e, previous=previous)
            return z, None

        scan(step, jnp.asarray(-1), (em, keep))

    lt_n, li_n = lt - logsumexp(lt, -1, keepdims=True), li - logsumexp(li)
    want = logsumexp([li_n[p[0]] + em[0, p[0]] + sum(lt_n[p[t - 1], p[t]] + em[t, p[t]]
                                                      for t in range(1, length))
                      for p in itertools.product(range(kk), repeat=length)])
    keep = jnp.arange(steps) < length
    np.testing.assert_allclose(si.log_marginal(chain, jnp.asarray(em), keep), want,
                               rtol=1e-10)


def test_a_mask_of_python_true_leaves_the_edge_as_it_is():
    """As NumPyro's ``Distribution.mask``: ``mask=True`` is no mask, so the lowering
    still runs the kernels."""
    q = k = v = jnp.ones((3, 2))

    def model(q, k, v):
        with numpyro.plate("children", 3), numpyro.handlers.mask(mask=True):
            j = si.edge("phi", si.priors.Uniform(3), si.scores.Dot(q, k))
            numpyro.deterministic("out", v[j])

    assert si.attention(model, "out").explain(q, k, v).path == "lowered"


def test_a_mask_around_the_plates_of_a_shared_table_masks_out_children(x64):
    """Regression: with the mask written around the plates and a prior shared by the
    batch (the table lacks the batch dim), the plate expanded the edge before the mask
    wrapped it, so NumPyro's plain mask applied: each masked-out child added log m."""
    B, n = 2, 4
    keys = jnp.array([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    r = np.random.default_rng(1)
    x = jnp.asarray(np.asarray(keys)[[[0, 1, 2, 1], [3, 3, 0, 2]]]
                    + 0.5 * r.normal(size=(B, n, 2)))
    keep = jnp.array([[True, True, True, False], [True, True, False, False]])

    def outer(x, keep):
        with numpyro.handlers.mask(mask=keep):
            with numpyro.plate("batch", B, dim=-2), numpyro.plate("queries", n, dim=-1):
                phi = si.edge("phi", si.priors.Restricted.causal(n))
                numpyro.sample("x", dist.Normal(Vindex(keys)[phi], 0.7).to_event(1), obs=x)

    lp = norm.logpdf(np.asarray(x)[:, :, None], np.asarray(keys), 0.7).sum(-1)  # (B, n, m)
    allowed = np.tril(np.ones((n, n), bool))
    t = np.where(allowed, lp - np.log(allowed.sum(-1, keepdims=True)), -np.inf)
    want = logsumexp(t, -1)[np.asarray(keep)].sum()
    np.testing.assert_allclose(si.log_marginal(outer, x, keep), want, rtol=1e-12)
    np.testing.assert_allclose(si.marginals(outer, x, keep)["phi"][0, 3], 0.25, rtol=1e-12)


def test_a_negative_edge_value_has_no_probability():
    """Regression: an edge value of -1 (what `map_edges` gives a row with no posterior
    under jit) read the last parent, so conditioning on it gave a finite log-density.
    Outside the support it is NaN, as a value past the end is."""
    q = k = jnp.asarray(np.random.default_rng(0).normal(size=(3, 2)), jnp.float32)

    def model(q, k):
        with numpyro.plate("queries", 3):
            si.edge("phi", si.priors.Uniform(3), si.scores.Dot(q, k))

    for bad in ([0, 1, -1], [0, 1, 3]):
        cond = numpyro.handlers.condition(model, {"phi": jnp.array(bad)})
        assert np.isnan(si.log_marginal(cond, q, k)), bad
    edge = si.primitives.EdgeDistribution(jnp.zeros(3))
    np.testing.assert_array_equal(np.isnan(edge.log_prob(jnp.array([-1, 0, 2, 3]))),
                                  [True, False, False, True])


def test_an_edge_conditioned_outside_its_support_leaves_no_finite_answer_under_jit():
    """Regression: with ``phi`` conditioned on -1 (`map_edges`' answer under jit for a row
    with no posterior) log Z was NaN, but under jit the marginals and expectations of the
    other edge, derivatives of log Z in its tilts, were finite (the NaN is a constant).
    Eagerly the edges are named; under jit every answer is NaN."""
    r = np.random.default_rng(1)
    s, v = jnp.asarray(r.normal(size=(3, 4))), jnp.asarray(r.normal(size=4))

    def model(s, fixed):
        with numpyro.plate("queries", 3):
            a = si.edge("phi", si.priors.Uniform(4), s)
            b = si.edge("psi", si.priors.Uniform(4), s)
            numpyro.deterministic("out", si.gather(v, a) - si.gather(v, b))

    def answers(s, fixed):
        cond = numpyro.handlers.condition(model, {"phi": fixed})
        return si.marginals(cond, s, fixed)["psi"], si.expectation(cond, "out", s, fixed)

    good = jnp.array([0, 3, 1])
    p = np.asarray(jax.nn.softmax(s, -1))  # psi is independent of phi: its softmax
    marg, out = jax.jit(answers)(s, good)
    np.testing.assert_allclose(marg, p, rtol=1e-5)
    np.testing.assert_allclose(out, np.asarray(v)[good] - p @ np.asarray(v), rtol=1e-5)
    bad = good.at[1].set(-1)
    with pytest.raises(ValueError, match="log-marginal is NaN"):
        answers(s, bad)
    assert all(np.isnan(x).all() for x in jax.jit(answers)(s, bad))


def test_an_edge_conditioned_on_a_forbidden_parent_leaves_no_finite_answer():
    """Regression: with ``phi`` (a causal edge) conditioned on a parent its prior forbids,
    log Z is -inf: no structure is possible. Eagerly `expectation` raised, but under jit
    the marginals and expectations of the other edge (derivatives in its tilts, which the
    constant -inf does not reach) were finite, and `si.attention` called eagerly (which
    runs the engine under its own jit) returned them as the answer."""
    r = np.random.default_rng(1)
    s, v = jnp.asarray(r.normal(size=(3, 4))), jnp.asarray(r.normal(size=4))

    def model(s, fixed):
        with numpyro.plate("queries", 3):
            a = si.edge("phi", si.priors.Restricted.causal(3, 4), s)
            b = si.edge("psi", si.priors.Uniform(4), s)
            numpyro.deterministic("out", si.gather(v, a) - si.gather(v, b))

    def answers(s, fixed):
        cond = numpyro.handlers.condition(model, {"phi": fixed})
        return si.marginals(cond, s, fixed)["psi"], si.expectation(cond, "out", s, fixed)

    bad = jnp.array([0, 2, 1])  # child 1 takes parent 2, after it
    with pytest.raises(ValueError, match="zero probability"):
        answers(s, bad)
    assert all(np.isnan(x).all() for x in jax.jit(answers)(s, bad))
    grad = jax.jit(jax.grad(lambda s: answers(s, bad)[1].sum()))(s)
    assert np.isnan(grad).all()  # not the 0 of a where
    cond = numpyro.handlers.condition(model, {"phi": bad})
    with pytest.raises(ValueError, match="zero probability"):
        si.attention(cond, "out")(s, bad)
    assert np.isnan(jax.jit(si.attention(cond, "out"))(s, bad)).all()

    def one(s):  # one edge, its child 0 left no parent: that row is NaN, the others are not
        with numpyro.plate("queries", 3):
            a = si.edge("phi", si.priors.Restricted.causal(3, 4), s)
            numpyro.deterministic("out", si.gather(v, a))

    s0 = s.at[0, 0].set(-jnp.inf)
    out = jax.jit(lambda s: si.expectation(one, "out", s))(s0)
    assert np.isnan(out[0]) and np.isfinite(out[1:]).all()


def test_a_value_recorded_inside_the_mask_has_the_uniform_expectation(x64):
    """Regression: a deterministic site recorded inside ``numpyro.handlers.mask`` had its
    engine tilt masked too, so a masked-out child's expectation came out 0, not the
    parents' mean. (Draws stay the edge's own: NumPyro's mask changes densities only, and
    ``Predictive`` masks every site to skip them.)"""
    r = np.random.default_rng(4)
    q, k, v = (jnp.asarray(r.normal(size=(4, 2))) for _ in range(3))
    keep = jnp.array([True, True, False, True])

    def model(q, k, v, keep):
        with numpyro.plate("queries", 4), numpyro.handlers.mask(mask=keep):
            j = si.edge("phi", si.priors.Uniform(4), si.scores.Dot(5.0 * q, k))
            numpyro.deterministic("out", v[j])

    for out in (si.expectation(model, "out", q, k, v, keep),
                jax.jit(lambda *a: si.expectation(model, "out", *a))(q, k, v, keep),
                si.attention(model, "out")(q, k, v, keep)):
        np.testing.assert_allclose(out[2], np.asarray(v).mean(0), rtol=1e-10)


def test_nested_masks_intersect_and_a_false_mask_keeps_the_dtype(x64):
    """Regression: a second ``numpyro.handlers.mask`` wrapped the masked edge in NumPyro's
    plain mask (a child masked only by the outer one added log m again); a Python
    ``False`` mask gave float64 log Z for a float32 model under x64."""
    r = np.random.default_rng(6)
    q, k = (jnp.asarray(r.normal(size=(4, 2))) for _ in range(2))
    inner, outer = jnp.array([True, False, True, True]), jnp.array([True, True, True, False])

    def model(q, k, a, b):
        with numpyro.plate("queries", 4), numpyro.handlers.mask(mask=a):
            with numpyro.handlers.mask(mask=b):
                si.edge("phi", si.priors.Uniform(4), si.scores.Dot(q, k))

    s = np.asarray(q) @ np.asarray(k).T - np.log(4)
    keep = np.asarray(inner & outer)
    np.testing.assert_allclose(si.log_marginal(model, q, k, outer, inner),
                               logsumexp(s[keep], -1).sum(), rtol=1e-12)
    q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
    for a in (False, jnp.zeros(4, bool)):
        lz = si.log_marginal(model, q32, k32, a, True)
        assert lz.dtype == jnp.float32 and lz == 0.0


# -- an edge given a value by numpyro.handlers.substitute ----------------------------------

def _two_edges(x, keys):
    with numpyro.plate("children", x.shape[0]):
        phi = si.edge("phi", si.priors.Uniform(keys.shape[0]), si.scores.Dot(x, keys))
        numpyro.sample("x", dist.Normal(Vindex(keys)[phi], 0.7).to_event(1), obs=x)
        psi = si.edge("psi", si.priors.Uniform(keys.shape[0]), si.scores.Dot(x, keys))
        numpyro.deterministic("w", Vindex(keys)[psi])


_KEYS = np.array([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]], np.float32)
_X = _KEYS[[0, 1, 2, 1, 0]] + 0.5 * r.normal(size=(5, 2)).astype(np.float32)
_PHI = np.array([0, 1, 2, 1, 0], np.int32)


@pytest.mark.parametrize("jit", [False, True])
def test_a_substituted_edge_is_fixed_at_its_value_as_condition_fixes_it(jit):
    """``substitute(model, data={"phi": j})`` fixes the edge: log Z is the joint density
    at ``j`` (NumPy, written here), as with ``condition``, never the sum over every
    structure; the marginals, expectations and ``si.attention`` sum the other edge only."""
    sub = substitute(_two_edges, data={"phi": jnp.asarray(_PHI)})
    cond = numpyro.handlers.condition(_two_edges, {"phi": jnp.asarray(_PHI)})
    s = _X @ _KEYS.T                                                    # (children, parents)
    # phi: prior x score at j, its row normaliser, the observation; psi sums to its normaliser
    expected = (s[np.arange(5), _PHI] - np.log(3) + norm.logpdf(_X, _KEYS[_PHI], 0.7).sum(-1)
                + logsumexp(s, -1) - np.log(3)).sum()
    lm = jax.jit(si.log_marginal, static_argnums=0) if jit else si.log_marginal
    np.testing.assert_allclose(lm(sub, _X, _KEYS), lm(cond, _X, _KEYS), rtol=1e-6)
    np.testing.assert_allclose(lm(sub, _X, _KEYS), expected, rtol=1e-5)
    assert inspect_model(sub, _X, _KEYS)["phi"].role == "observed"
    A = si.marginals(sub, _X, _KEYS)
    assert list(A) == ["psi"]
    for fixed in (sub, cond):  # (funsor's MAP read the conditioned edge too: a KeyError)
        assert list(si.map_edges(fixed, _X, _KEYS)) == ["psi"]
    np.testing.assert_allclose(A["psi"], np.exp(log_softmax(s, -1)), rtol=1e-5, atol=1e-6)
    w = np.exp(log_softmax(s, -1)) @ _KEYS
    np.testing.assert_allclose(si.expectation(sub, "w", _X, _KEYS), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(si.attention(sub, "w")(_X, _KEYS), w, rtol=1e-5, atol=1e-6)


# -- structural zeros inside a contraction: a product of factors that leaves some pairs of
# -- states unconnected (log 0 = -inf) must not make the derivatives of log Z NaN


#: (x64, jit) of the NaN-derivative regressions below: by default each dtype and each
#: mode once (float64 eagerly, float32 under jit); the other pair in the exhaustive tier
DTYPE_MODE = matrix([(False, False), (False, True), (True, False), (True, True)],
                    keep=lambda x64, jit: x64 != jit,
                    ids=["float32-eager", "float32-jit", "float64-eager", "float64-jit"])


@pytest.mark.parametrize("x64, jit", DTYPE_MODE)
def test_structural_zeros_inside_a_contraction_give_exact_gradients_not_nan(x64, jit):
    """Regression: two causal hops with a joint restriction (the second hop lands near the
    start) gave NaN gradients of log Z, NaN marginals and expectations although log Z was
    finite: eliminating the first hop leaves pairs (start, second hop) with no connecting
    path, log 0 = -inf, whose derivative met a zero cotangent (0 * inf). Value, marginals,
    expectation and d log Z / d scores equal brute force over every pair of hops in NumPy
    float64 (the score gradients by central differences of it), eager and under jit."""
    n = 5
    g = np.random.default_rng(3)
    s1, s2 = g.normal(size=(2, n, n))
    v, y = g.normal(size=(2, n))
    dtype = jnp.float64 if x64 else jnp.float32
    tol = dict(rtol=1e-9, atol=1e-10) if x64 else dict(rtol=1e-4, atol=2e-5)

    def run(s1, s2):
        args = (s1, s2, jnp.asarray(v, dtype), jnp.asarray(y, dtype))
        lz, grads = jax.value_and_grad(si.log_marginal, argnums=(1, 2))(return_hop, *args)
        return lz, grads, si.marginals(return_hop, *args), si.expectation(
            return_hop, "out", *args)

    with float64() if x64 else contextlib.nullcontext():
        lz, (g1, g2), marg, ev = (jax.jit(run) if jit else run)(
            jnp.asarray(s1, dtype), jnp.asarray(s2, dtype))
        assert lz.dtype == dtype and marg["hop1"].dtype == dtype
    ref_z, ref_hop1, ref_hop2, ref_ev = return_hop_brute(s1, s2, v, y)
    assert np.isfinite(ref_z) and not ref_hop2[np.triu_indices(n, 1)].any()  # k > i: none
    np.testing.assert_allclose(lz, ref_z, **tol)
    np.testing.assert_allclose(marg["hop1"], ref_hop1, **tol)
    np.testing.assert_allclose(marg["hop2"], ref_hop2, **tol)
    np.testing.assert_allclose(ev, ref_ev, **tol)
    h = 1e-6
    for s, grad, which in ((s1, g1, 0), (s2, g2, 1)):
        central = np.zeros_like(s)
        for idx in np.ndindex(s.shape):
            up, down = s.copy(), s.copy()
            up[idx] += h
            down[idx] -= h
            ab_up, ab_down = [s1, s2], [s1, s2]
            ab_up[which], ab_down[which] = up, down
            central[idx] = (return_hop_brute(*ab_up, v, y)[0]
                            - return_hop_brute(*ab_down, v, y)[0]) / (2 * h)
        np.testing.assert_allclose(grad, central, rtol=1e-5 if x64 else 1e-4,
                                   atol=1e-7 if x64 else 2e-5)


# -- no possible structure in a model that couples enumerated sites: under jit (where the
# -- eager checks cannot raise) every derivative is NaN, never the safe einsum's zeros


def _agree(s1, s2, alive, v, y):
    """Two edges per child that must pick the same parent; no structure explains the
    observation ``seen = 1`` of a child with ``alive`` False (0 at every parent),
    so log Z = -inf with no empty score row (which the edge would refuse eagerly)."""
    with numpyro.plate("children", s1.shape[0]):
        j = si.edge("phi", si.priors.Uniform(s1.shape[1]), si.scores.Custom(s1))
        k = si.edge("psi", si.priors.Uniform(s2.shape[1]), si.scores.Custom(s2))
        potential("agree", jnp.where(j == k, 0.0, -jnp.inf).astype(s1.dtype))
        numpyro.deterministic("out", v[j] + v[k])
        numpyro.sample("y", dist.Normal(v[j], 1.0), obs=y)
        seen = jnp.where(alive, jnp.ones_like(v)[j], 0.0)
        numpyro.sample("seen", dist.Delta(seen), obs=jnp.ones_like(y))


def _agree_brute(s1, s2, alive, v, y):
    """Per child: log Z_i and d log Z_i / d s1_i of `_agree`, NumPy float64 (j = k)."""
    s1, s2, v, y = (np.asarray(a, np.float64) for a in (s1, s2, v, y))
    m = s1.shape[1]
    w = s1 + s2 - 2 * np.log(m) + norm.logpdf(y[:, None], v[None], 1.0)  # (child, j = k)
    w = np.where(np.asarray(alive)[:, None], w, -np.inf)
    with np.errstate(invalid="ignore"):
        return logsumexp(w, -1), np.exp(w - logsumexp(w, -1, keepdims=True))


_NS, _MS = 5, 7


def _agree_inputs(dtype, dead=3):
    g = np.random.default_rng(13)
    s1, s2 = (jnp.asarray(a, dtype) for a in g.normal(size=(2, _NS, _MS)))
    v, y = jnp.asarray(g.normal(size=_MS), dtype), jnp.asarray(g.normal(size=_NS), dtype)
    alive = jnp.arange(_NS) != dead
    return s1, s2, alive, v, y


@pytest.mark.parametrize("jit", [pytest.param(False, id="eager", marks=pytest.mark.exhaustive),
                                 pytest.param(True, id="jit")])
@pytest.mark.parametrize("x64", [False, pytest.param(True, marks=pytest.mark.exhaustive)], ids=["float32", "float64"])
def test_no_possible_structure_of_coupled_edges_has_nan_derivatives_never_zeros(x64, jit):
    """Regression: in a model whose contraction couples enumerated sites (two edges tied
    by a factor; a Markov chain), the safe einsum differentiates log 0 to zero, so where
    log Z = -inf (no structure at all) the derivatives of log Z in the scores were finite
    numbers under jit (a chain's: one-hot rows; the tied edges': softmax rows), and the
    derivatives of the (NaN) marginals and expectations were zeros. Each is now NaN, as the
    marginals and expectations themselves; with a possible structure the same model's
    derivatives equal brute force (NumPy float64)."""
    dtype = jnp.float64 if x64 else jnp.float32
    tol = dict(rtol=1e-9, atol=1e-10) if x64 else dict(rtol=1e-4, atol=2e-5)
    stuck, em, _ = _no_structure_models()["markov"]
    with float64() if x64 else contextlib.nullcontext():
        s1, s2, alive, v, y = _agree_inputs(dtype)
        em = em.astype(dtype)
        run = jax.jit if jit else (lambda f: f)

        def lm(a, b, alive):
            return si.log_marginal(_agree, a, b, alive, v, y)

        # a possible structure: exact (d log Z / d s1 is the posterior of j = k)
        everyone = jnp.ones(_NS, bool)
        lz, g1 = run(jax.value_and_grad(lm))(s1, s2, everyone)
        ref_z, ref_post = _agree_brute(s1, s2, everyone, v, y)
        np.testing.assert_allclose(lz, ref_z.sum(), **tol)
        np.testing.assert_allclose(g1, ref_post, **tol)
        # none: log Z = -inf; its derivatives NaN (eagerly too), never a number
        lz, (g1, g2) = run(jax.value_and_grad(lm, argnums=(0, 1)))(s1, s2, alive)
        assert lz.dtype == dtype and float(lz) == -np.inf
        assert np.isnan(np.asarray(g1)).all() and np.isnan(np.asarray(g2)).all()
        chain = run(jax.grad(lambda e: si.log_marginal(stuck, e)))(em)
        assert np.isnan(np.asarray(chain)).all(), chain
        if not jit:  # eagerly the marginals and expectations are the engine's error
            with pytest.raises(ValueError, match="zero probability"):
                si.marginals(_agree, s1, s2, alive, v, y)
            return

        def marg(a, b):
            return si.marginals(_agree, a, b, alive, v, y)["psi"]

        def ev(a, b):
            return si.expectation(_agree, "out", a, b, alive, v, y)

        for f in (marg, ev):
            assert np.isnan(np.asarray(jax.jit(f)(s1, s2))).all()
            for d in jax.jit(jax.grad(lambda a, b, f=f: f(a, b).sum(), argnums=(0, 1)))(s1, s2):
                assert np.isnan(np.asarray(d)).all(), d
        d = jax.jit(jax.grad(lambda e: si.expectation(stuck, "out", e).sum()))(em)
        assert np.isnan(np.asarray(d)).all(), d


@pytest.mark.parametrize("x64, jit", DTYPE_MODE)
def test_a_kept_element_with_no_structure_has_nan_derivatives_the_others_exact(x64, jit):
    """Regression: with kept plates (the pointwise log-likelihood) of a model that couples
    enumerated sites, an element with no possible structure (l_e = -inf) had zero
    derivatives (the safe einsum's log 0). They are now NaN in that element's own rows
    only; every other element's value and derivatives equal brute force (NumPy float64)."""
    dtype = jnp.float64 if x64 else jnp.float32
    tol = dict(rtol=1e-9, atol=1e-10) if x64 else dict(rtol=1e-4, atol=2e-5)
    dead = 3
    with float64() if x64 else contextlib.nullcontext():
        s1, s2, alive, v, y = _agree_inputs(dtype, dead)

        def pointwise(a):
            return log_z(_agree, (a, s2, alive, v, y), keep_plates="observed",
                         score_factors="normalize")

        run = jax.jit if jit else (lambda f: f)
        ll = np.asarray(run(pointwise)(s1))
        g = np.asarray(run(jax.grad(lambda a: pointwise(a).sum()))(s1))
    # the reference: l_i = log Z_i - log sum_{j, k} (prior x scores, tied), d l_i / d s1_i
    s1n, s2n, vn, yn = (np.asarray(a, np.float64) for a in (s1, s2, v, y))
    w = s1n[:, :, None] + s2n[:, None, :] - 2 * np.log(_MS)
    tied = np.where(np.eye(_MS, dtype=bool), w, -np.inf)
    num = tied.diagonal(0, 1, 2) + norm.logpdf(yn[:, None], vn[None], 1.0)
    den = tied.diagonal(0, 1, 2)
    ref = logsumexp(num, -1) - logsumexp(den, -1)
    ref_g = np.exp(num - logsumexp(num, -1, keepdims=True)) - np.exp(
        den - logsumexp(den, -1, keepdims=True))
    live = np.arange(_NS) != dead
    assert ll[dead] == -np.inf and np.isnan(g[dead]).all()
    np.testing.assert_allclose(ll[live], ref[live], **tol)
    np.testing.assert_allclose(g[live], ref_g[live], **tol)


@pytest.mark.parametrize("equation, shapes, budget", [
    ("ab,ab->b", [(5, 3), (5, 3)], None),  # attention: joint shift
    ("abc,cb->ca", [(4, 3, 2), (2, 3)], None),  # joint, output dims in another order
    ("b,ab->a", [(3,), (4, 3)], None),  # joint, the smaller operand first
    ("ab,bc->ac", [(6, 6), (6, 6)], None),  # a real product (6x), small: joint shift
    ("ab,bc->ac", [(6, 6), (6, 6)], 0),  # the same above the budget: per-operand shifts
])
def test_log_einsum_equals_the_float64_log_sum_exp(equation, shapes, budget, monkeypatch):
    """The engine's log-space einsum is log sum exp of the summed operands over the summed
    dims, for each dim order and both shifts; where the factors disagree by 101 nats its
    joint shift keeps the float32 answer finite (an attention's factors, and a product of
    a chain's steps whose broadcast is within `JOINT_MAX_ELEMENTS`: some of its entries
    underflowed to -inf, the others stayed finite); above that budget (``budget=0``)
    each operand is shifted by its own maximum, and such a product underflows."""
    from structinfer.exact import _log_einsum
    from structinfer.exact._log_einsum import einsum

    if budget is not None:
        monkeypatch.setattr(_log_einsum, "JOINT_MAX_ELEMENTS", budget)
    r = np.random.default_rng(3)
    ops = [r.normal(size=s).astype(np.float32) * 3 for s in shapes]
    ops[0][..., 0] = -np.inf  # a -inf entry
    got = einsum(equation, *map(jnp.asarray, ops))
    with np.errstate(divide="ignore"):  # (a -inf entry's whole sum: log 0)
        ref = np.log(np.einsum(equation, *[np.exp(np.float64(o)) for o in ops]))
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)
    a = np.zeros((2, 2), np.float32)
    a[1, :] = 101.0  # the summed dim a: op 1 favours a = 1, op 2 a = 0
    np.testing.assert_allclose(einsum("ab,ab->b", jnp.asarray(a), jnp.asarray(-a)),
                               [np.log(2.0)] * 2, rtol=1e-6)
    if equation != "ab,bc->ac":
        return
    # a product of two 5-state steps: x favours b = 0 by 101 nats for every a, y's column
    # c = 0 favours b != 0 by 202; c = 0 is log(4 e^101 + 1), the others log(e^101 + 4)
    x = np.zeros((5, 5), np.float32)
    x[:, 0] = 101.0
    y = np.zeros((5, 5), np.float32)
    y[0, 0], y[1:, 0] = -101.0, 101.0
    got = np.asarray(einsum("ab,bc->ac", jnp.asarray(x), jnp.asarray(y)))
    ref = np.log(np.exp(np.float64(x)) @ np.exp(np.float64(y)))
    if budget is None:
        np.testing.assert_allclose(got, ref, rtol=1e-6)
    else:  # each term is e^-101 or e^-202 of its operands' maxima in column 0 only
        assert (got[:, 0] == -np.inf).all()
        np.testing.assert_allclose(got[:, 1:], ref[:, 1:], rtol=1e-6)
