"""Geometric x Beta mean field (Singh & Buckley sec. 5.2, app. 7.3, Algorithm 3).

References: a plain mean-field loop written here (numpy + scipy digamma), and the
exact posterior p(phi | x) from the exact engine with q integrated on a grid.
The tolerance against the exact posterior is not picked by hand: the mean-field
free energy F bounds it. F + log Z = KL(r(phi) r(q) || p(phi, q | x)) >= KL(r(phi) ||
p(phi | x)) (chain rule), so by Pinsker TV(r, p) <= sqrt((F + log Z) / 2).
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.ops.indexing import Vindex
from scipy.special import digamma
from scipy.stats import beta as beta_dist

import structinfer as si
from structinfer.infer import geometric_beta, geometric_beta_free_energy, horizon

N, D = 11, 3


def plain_mean_field(S, a0, b0, iters=500):
    n, m = S.shape
    k = np.arange(n)[:, None] - np.arange(m)[None, :]
    allowed = k >= 0
    a, b = np.full(n, a0), np.full(n, b0)
    for _ in range(iters):
        logits = np.where(allowed, S + k * (digamma(b) - digamma(a + b))[:, None], -np.inf)
        r = np.exp(logits - logits.max(1, keepdims=True))
        r /= r.sum(1, keepdims=True)
        a, b = a0 + 1.0, b0 + np.sum(r * np.where(allowed, k, 0), 1)
    return r, a, b


G = 400
QG = (np.arange(G) + 0.5) / G
K = np.arange(N)[:, None] - np.arange(N)[None, :]


def grid_model(S, log_w):
    """q_i on a midpoint grid (one per query), phi_i uniform over the allowed parents,
    factor s_ij + log q + k_ij log(1 - q)."""
    n, qg, k = N, QG, K
    allowed = k >= 0
    with numpyro.plate("queries", n):
        qi = numpyro.sample("q", dist.Categorical(logits=log_w),
                            infer={"enumerate": "parallel"})
        phi = numpyro.sample(
            "phi",
            dist.Categorical(logits=jnp.where(allowed, 0.0, -jnp.inf), validate_args=False),
            infer={"enumerate": "parallel"},
        )
        steps = Vindex(jnp.asarray(np.maximum(k, 0)))[jnp.arange(n), phi]
        s = Vindex(jnp.asarray(S))[jnp.arange(n), phi]
        numpyro.factor("lik", s + jnp.log(qg)[qi] + steps * jnp.log1p(-qg)[qi])


@jax.jit
def _grid(S, log_w):
    return si.marginals(grid_model, S, log_w)["phi"], si.log_marginal(grid_model, S, log_w)


def grid_posterior(S, a0, b0):
    """Exact p(phi | x) and log p(x) (the uniform phi prior's 1/(i+1) undone)."""
    P, logZ = _grid(S, beta_dist.logpdf(QG, a0, b0) - np.log(G))
    return np.asarray(P), float(logZ) + float(np.sum(np.log(np.arange(1, N + 1))))


@pytest.mark.parametrize("a0,b0,scale", [(2.0, 5.0, 1.0), (0.1, 0.9, 1.0), (40.0, 80.0, 0.5)])
def test_exact_mean_field_fixed_point_and_bound(x64, a0, b0, scale):
    r = np.random.default_rng(0)
    x = r.normal(size=(N, D))
    S = scale * x @ x.T
    st, info = geometric_beta(S, a0, b0, method="exact", tol=1e-12, max_iters=300)
    assert bool(np.all(info.converged))
    r_ref, a_ref, b_ref = plain_mean_field(S, a0, b0)
    np.testing.assert_allclose(st.attention, r_ref, atol=1e-9)
    np.testing.assert_allclose(st.beta, b_ref, rtol=1e-9)
    np.testing.assert_allclose(st.alpha, a_ref)
    # the free energy never increases (coordinate ascent on the ELBO)
    for i in range(N):
        e = np.asarray(info.energy[i, : int(info.num_steps[i]) + 1])
        assert np.all(np.diff(e) <= 1e-10), (i, e)
    # against the grid-exact posterior, with the tolerance the free-energy gap implies
    P, logZ = grid_posterior(S, a0, b0)
    gap = float(np.sum(st.energy)) + logZ  # sum over queries of KL(mean field || posterior)
    assert gap >= -1e-6
    tv = 0.5 * np.abs(np.asarray(st.attention) - P).sum(-1)
    assert tv.sum() <= np.sqrt(gap / 2 * N) + 1e-6  # Pinsker per query + Cauchy-Schwarz
    if a0 + b0 > 100:  # q pinned by the hyper-prior: mean field is nearly exact
        assert tv.max() < 1e-2


def test_plugin_algorithm3_and_windows():
    r = np.random.default_rng(1)
    B, H = 2, 3
    x = r.normal(size=(B, H, N, D)).astype(np.float32)
    S = np.einsum("bhid,bhjd->bhij", x, x) / np.sqrt(D)
    a0, b0 = 0.1, 0.9
    st, info = jax.jit(lambda s: geometric_beta(s, a0, b0, method="plugin", max_iters=400))(S)
    assert st.window.shape == (B, H, N) and info.num_steps.shape == (B, H, N)
    # plain Algorithm 3 for one query, as printed (plus the window test k < H)
    b_, h_, i = 1, 2, 9
    a, bb = a0, b0
    k = i - np.arange(N)
    for _ in range(int(info.num_steps[b_, h_, i])):
        q = a / (a + bb)
        win = max(1.0, np.ceil(np.log(0.05) / np.log(1 - q)))
        logits = np.where((k >= 0) & (k < win), S[b_, h_, i] + k * np.log1p(-q), -np.inf)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        a, bb = a + 1, bb + np.sum(p * np.where(k >= 0, k, 0))
    q = a / (a + bb)
    win = max(1.0, np.ceil(np.log(0.05) / np.log(1 - q)))
    logits = np.where((k >= 0) & (k < win), S[b_, h_, i] + k * np.log1p(-q), -np.inf)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    np.testing.assert_allclose(st.attention[b_, h_, i], p, atol=1e-5)
    assert int(st.window[b_, h_, i]) == int(win)
    np.testing.assert_allclose(st.window, horizon(st.mean_q), atol=0)
    # attention never reaches past the window
    kk = np.arange(N)[:, None] - np.arange(N)[None, :]
    outside = kk >= np.asarray(st.window)[..., None]
    assert np.all(np.asarray(st.attention)[outside] == 0)
    # per-query convergence: queries stop at different steps
    assert len(np.unique(np.asarray(info.num_steps))) > 1


def test_max_iters_is_reported_and_bad_input():
    S = np.random.default_rng(2).normal(size=(N, N))
    _, info = jax.jit(lambda s: geometric_beta(s, 0.1, 0.9, method="plugin", max_iters=2,
                                               tol=1e-12))(S)
    assert np.all(np.asarray(info.max_iters_reached)[1:])
    assert not np.any(np.asarray(info.converged)[1:])
    with pytest.raises(ValueError, match="alpha0 must be positive"):
        geometric_beta(S, -1.0, 0.9)
    with pytest.raises(ValueError, match="method"):
        geometric_beta(S, method="fast")
    with pytest.raises(ValueError, match="child 0 has no allowed parent"):
        geometric_beta(S, include_self=False)
    S_bad = S.copy()
    S_bad[4, 2] = np.nan
    with pytest.raises(si.infer.NonFiniteEnergyError, match="batch element \\(4,\\)"):
        geometric_beta(S_bad)


def test_nonpositive_hyperprior_under_jit_is_nan():
    """Regression: alpha0 / beta0 <= 0 raised only on concrete values; under jit
    geometric_beta returned finite energies and attention. Now they are NaN."""
    S = np.random.default_rng(3).normal(size=(N, N)).astype(np.float32)
    for name in ("alpha0", "beta0"):
        with pytest.raises(ValueError, match=f"geometric_beta: {name} must be positive"):
            geometric_beta(S, **{name: -0.5})
        st, info = jax.jit(lambda v: geometric_beta(S, **{name: v},  # noqa: B023
                                                    raise_on_nonfinite=False))(-0.5)
        assert np.all(np.asarray(info.nonfinite)), name
        assert np.all(np.isnan(st.energy)) and np.all(np.isnan(st.attention)), name
    st, info = jax.jit(lambda v: geometric_beta(S, alpha0=v))(0.1)
    assert not np.any(np.asarray(info.nonfinite)) and st.energy.dtype == np.float32


def test_bad_hyperprior_shape_and_traced_mass():
    """Regression: alpha0 / beta0 not broadcasting against (..., children) failed in
    jnp.broadcast_to without naming them; a traced `mass` raised a
    TracerBoolConversionError. The shapes are named; a traced mass outside (0, 1) is NaN."""
    S = np.zeros((2, 4, 6), np.float32)
    for a0 in (np.full(6, 0.1), np.full((3, 4), 0.1)):
        with pytest.raises(ValueError, match=rf"geometric_beta: alpha0 of shape \({a0.shape[0]},"
                           r".* must broadcast against the scores' \(\.\.\., children\) "
                           r"shape \(2, 4\)"):
            geometric_beta(S, a0, 0.9, offset=2)
    with pytest.raises(ValueError, match="geometric_beta: beta0 of shape"):
        geometric_beta(S, 0.1, np.full(5, 0.9), offset=2)
    a = np.random.default_rng(4).normal(size=(N, N)).astype(np.float32)
    with pytest.raises(ValueError, match=r"geometric_beta: mass must lie in \(0, 1\)"):
        geometric_beta(a, mass=1.5)
    for method in ("exact", "plugin"):
        run = jax.jit(lambda a, m: geometric_beta(a, mass=m, method=method,  # noqa: B023
                                                  raise_on_nonfinite=False))
        st, info = run(a, 0.9)
        ref, _ = geometric_beta(a, mass=0.9, method=method)
        np.testing.assert_allclose(st.attention, ref.attention, rtol=1e-5, atol=1e-6)
        st, info = run(a, 1.5)
        assert np.all(np.asarray(info.nonfinite)) and np.all(np.isnan(st.attention)), method


def test_geometric_beta_with_no_parents_names_the_scores():
    # (0, 0) scores were a bare "zero-size array to reduction operation max"
    with pytest.raises(ValueError, match=r"geometric_beta: scores .* at least one parent"):
        si.infer.geometric_beta(np.zeros((0, 0)))


def test_an_infinite_hyperprior_is_named():
    """Regression: an infinite alpha0 or beta0 passed the check (it is positive) and the
    run raised NonFiniteEnergyError blaming the edge scores ("check them for NaN/inf"),
    which were finite. Beta(inf, .) is no distribution: the argument is named, and under
    jit the run is NaN, as for a non-positive one."""
    S = np.random.default_rng(4).normal(size=(3, 3))
    for name in ("alpha0", "beta0"):
        with pytest.raises(ValueError, match=rf"^geometric_beta: {name} must be positive "
                                             r"and finite, got \[inf"):
            geometric_beta(S, **{name: np.inf})
        _, info = jax.jit(lambda v: geometric_beta(S, **{name: v},  # noqa: B023
                                                   raise_on_nonfinite=False))(np.inf)
        assert np.all(np.asarray(info.nonfinite)), name


def test_horizon_names_a_rate_or_mass_outside_the_unit_interval():
    """Regression: `horizon` checked nothing: a rate of -0.1 or 1 gave a window of 1, a
    rate of 0 or a mass of 1 an infinite one, and a string mass a bare TypeError ("bad
    operand type for unary -"). Each is refused naming the argument; under jit the
    window is NaN."""
    assert float(horizon(0.5)) == 5.0 and float(horizon(0.5, 0.75)) == 2.0
    for q in (-0.1, 0.0, 1.0, np.nan):
        with pytest.raises(ValueError, match=r"^horizon: q must lie in \(0, 1\)"):
            horizon(q)
        assert np.isnan(jax.jit(horizon)(q)), q
    for mass in (0.0, 1.0, np.nan):
        with pytest.raises(ValueError, match=r"^horizon: mass must lie in \(0, 1\)"):
            horizon(0.5, mass)
    with pytest.raises(TypeError, match="horizon: mass"):
        horizon(0.5, "0.9")


def test_offset_and_max_distance_are_static_ints():
    """Regression: `geometric_beta` took a fractional `offset` (1.5: fractional steps, a
    model no Geometric prior has: ``Geometric(offset=1.5)`` is refused) and a traced
    `offset` or `max_distance` failed inside NumPy with JAX's
    TracerArrayConversionError, naming neither. Both are now named."""
    S = np.random.default_rng(5).normal(size=(4, 4))
    for kw in ({"offset": 1.5}, {"max_distance": 1.5}, {"offset": True}):
        (name, value), = kw.items()
        with pytest.raises(TypeError, match=rf"^geometric_beta: {name} must be an int"):
            geometric_beta(S, **kw)
    for name in ("offset", "max_distance"):
        with pytest.raises(TypeError, match=rf"^geometric_beta: `{name}` must be a static"):
            jax.jit(lambda v: geometric_beta(S, **{name: v}))(1)  # noqa: B023
    st, _ = geometric_beta(S, offset=np.int64(1), max_distance=np.int64(2))
    ref, _ = geometric_beta(S, offset=1, max_distance=2)
    np.testing.assert_array_equal(st.attention, ref.attention)


@pytest.mark.parametrize("method", ["exact", "plugin"])
def test_16_bit_scores_run_in_float32(method):
    """Regression: bfloat16 / float16 scores ran the whole mean field in 16 bits: the
    distances and the pseudo-counts were rounded (a bfloat16 ``beta`` gained nothing once
    large), so at n = 40 the attention was 0.17 off (bfloat16) and ``beta`` 100% off while
    reported converged. The loop now runs in float32, as the exact engine contracts
    16-bit scores, and answers in float32."""
    s = jnp.asarray(2 * np.random.default_rng(6).normal(size=(24, 24)), jnp.bfloat16)
    got, _ = geometric_beta(s, method=method)
    want, _ = geometric_beta(s.astype(jnp.float32), method=method)
    assert [a.dtype for a in (got.attention, got.beta, got.energy)] == [jnp.float32] * 3
    np.testing.assert_array_equal(got.attention, want.attention)


def test_16_bit_free_energy_and_horizon_in_float32():
    """Regression: `geometric_beta_free_energy` of 16-bit terms was computed in 16 bits
    (bfloat16: 2.3 off an energy of 5 at n = 300), and `horizon` of a 16-bit rate too (a
    bfloat16 ``q = 0.001`` gave 3008 for 2996); both now run, and answer, in float32."""
    r = np.random.default_rng(7)
    k = np.arange(24)[:, None] - np.arange(24)[None, :]
    att = np.where(k >= 0, r.random((24, 24)), 0.0)
    terms = (2 * r.normal(size=(24, 24)), att / att.sum(-1, keepdims=True),
             np.full(24, 1.1), np.full(24, 30.0), 0.1, 0.9, np.maximum(k, 0))
    energy = jax.jit(geometric_beta_free_energy)
    for dt in (jnp.bfloat16, jnp.float16):
        f = energy(*(jnp.asarray(t, dt) for t in terms), k >= 0)
        f32 = energy(*(jnp.asarray(t, dt).astype(jnp.float32) for t in terms), k >= 0)
        assert f.dtype == jnp.float32
        np.testing.assert_allclose(f, f32, rtol=1e-6)
        q = jnp.asarray(0.001, dt)
        h = horizon(q)
        assert h.dtype == jnp.float32
        assert float(h) == np.ceil(np.log1p(-0.95) / np.log1p(-np.float64(q)))


def test_free_energy_of_float32_terms_with_integer_steps_is_float32_under_x64(x64):
    """Regression: integer ``steps`` (as `geometric_beta` builds them) were converted to
    the default float, so under x64 a float32 free energy came back float64."""
    r = np.random.default_rng(8)
    k = np.arange(6)[:, None] - np.arange(6)[None, :]
    att = np.where(k >= 0, r.random((6, 6)), 0.0)
    terms = [np.asarray(t, np.float32) for t in (r.normal(size=(6, 6)),
             att / att.sum(-1, keepdims=True), np.full(6, 1.1), np.full(6, 3.0))]
    f = geometric_beta_free_energy(*terms, 0.1, 0.9, np.maximum(k, 0), k >= 0)
    assert f.dtype == jnp.float32


def test_exact_mean_field_takes_a_parent_with_zero_likelihood(x64):
    """Regression: a -inf score at an allowed parent (zero likelihood, e.g. a padding
    mask) made the exact method's free energy NaN (its sum r * s had 0 * -inf), so it
    raised NonFiniteEnergyError, while the plug-in ran. The parent gets no attention,
    and a query whose other allowed parents all have -inf scores has a point-mass
    posterior over the edge, which the factorised family holds exactly:
    F = -log Z, with log Z = s + log B(a0 + 1, b0 + k) - log B(a0, b0)."""
    from scipy.special import betaln

    a0, b0 = 0.7, 1.3
    s = np.random.default_rng(5).normal(size=(4, 4))
    s[2, 1] = -np.inf             # query 2: parents 0 and 2 remain
    s[3, [0, 1, 3]] = -np.inf     # query 3: only parent 2 (one step back) remains
    state, info = geometric_beta(s, a0, b0, tol=1e-12)
    assert bool(info.converged.all())
    att = np.asarray(state.attention)
    assert att[2, 1] == 0.0 and att[3, 2] == 1.0
    log_z3 = s[3, 2] + betaln(a0 + 1, b0 + 1) - betaln(a0, b0)
    np.testing.assert_allclose(float(state.energy[3]), -log_z3, rtol=1e-10)
    # query 2 against the exact posterior: F >= -log Z, TV <= sqrt(gap / 2)
    k = np.array([2, 1, 0])
    logp = s[2, [0, 1, 2]] + betaln(a0 + 1, b0 + k) - betaln(a0, b0)
    log_z2 = np.logaddexp(logp[0], logp[2])
    gap = float(state.energy[2]) + log_z2
    post = np.exp(logp - log_z2)
    assert gap >= -1e-12
    assert 0.5 * np.abs(att[2, :3] - post).sum() <= np.sqrt(gap / 2) + 1e-12


def test_free_energy_gradient_at_a_parent_without_attention(x64):
    """Regression (review): masking the scores where the attention is 0 (to avoid
    0 * -inf) also zeroed dF/dA_ij there for a finite score, and dropped a NaN score.
    Only a -inf score is masked now: the gradient is that of the plain formula with its
    finite scores, and a NaN score gives a NaN free energy."""
    r = np.random.default_rng(3)
    s = jnp.asarray(r.normal(size=(3, 4)))
    steps = jnp.asarray(np.maximum(np.arange(3)[:, None] + 1 - np.arange(4), 0))
    allowed = jnp.asarray(np.arange(3)[:, None] + 1 >= np.arange(4))
    att = jnp.where(allowed, jnp.asarray(r.random((3, 4))), 0.0)
    att = att.at[1, 0].set(0.0)
    att = att / att.sum(-1, keepdims=True)
    a, b = jnp.full(3, 1.5), jnp.full(3, 2.5)

    def plain(att):  # the free energy written out, every score finite
        from jax.scipy.special import betaln, digamma
        elq, el1q = digamma(a) - digamma(a + b), digamma(b) - digamma(a + b)
        rr = jnp.where(allowed, att, 0.0)
        lik = jnp.sum(rr * jnp.where(allowed, s, 0.0), -1) + elq + jnp.sum(rr * steps, -1) * el1q
        prior = (0.7 - 1) * elq + (1.3 - 1) * el1q - betaln(0.7, 1.3)
        ent = -jnp.sum(jnp.where(rr > 0, rr * jnp.log(jnp.where(rr > 0, rr, 1.0)), 0.0), -1)
        hq = (betaln(a, b) - (a - 1) * digamma(a) - (b - 1) * digamma(b)
              + (a + b - 2) * digamma(a + b))
        return -(lik + prior + ent + hq)

    def ours(att, s=s):
        return geometric_beta_free_energy(s, att, a, b, 0.7, 1.3, steps, allowed)

    np.testing.assert_allclose(ours(att), plain(att), rtol=1e-12)
    g, g_ref = jax.grad(lambda x: ours(x).sum())(att), jax.grad(lambda x: plain(x).sum())(att)
    assert float(g_ref[1, 0]) != 0.0
    np.testing.assert_allclose(g, g_ref, rtol=1e-12)
    assert np.isnan(float(ours(att, s.at[1, 0].set(jnp.nan))[1]))
