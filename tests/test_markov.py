"""Markov edges: a chain of edges in a ``scan``, collapsed exactly.

Independent references written here: a NumPy forward algorithm, forward-backward and
Viterbi, and brute force over every path (``itertools.product``) on a short chain. Sizes:
T = 5 steps, K = 3 states, a batch of 2 (distinct primes). The lowering's fused
forward-backward scan (``si.attention``, kernel ``markov_scan``) is checked against the
exact engine and these references.
"""

import contextlib
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conftest import float64
from numpyro.contrib.control_flow import scan

import structinfer as si
from structinfer.primitives import potential

T, K = 5, 3


def hmm(emission, log_transition, log_initial):
    """An HMM over edges: the emission log-potentials are the edge's score."""
    prior = si.priors.Markov(log_transition, log_initial)

    def step(previous, e):
        z = si.edge("z", prior, e, previous=previous)
        numpyro.deterministic("v", jnp.sin(1.0 + z))
        return z, None

    scan(step, jnp.asarray(-1), emission)


def batched_hmm(emissions, log_transition, log_initial):
    """B chains at once: a plate inside the scan's step (``emissions`` (T, B, K))."""
    prior = si.priors.Markov(log_transition, log_initial)
    chains = emissions.shape[1]

    def step(previous, e):
        with numpyro.plate("chains", chains):
            z = si.edge("z", prior, e, previous=previous)
            numpyro.deterministic("v", jnp.sin(1.0 + z))
            return z, None

    scan(step, jnp.full((chains,), -1), emissions)


def _params(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.normal(size=(T, K)), dtype),
        jnp.asarray(rng.normal(size=(K, K)), dtype),
        jnp.asarray(rng.normal(size=K), dtype),
    )


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def _forward(em, lt, li):
    """NumPy forward algorithm: log Z."""
    em, lt, li = np.asarray(em, np.float64), _log_softmax(lt), _log_softmax(li)
    alpha = li + em[0]
    for t in range(1, len(em)):
        alpha = em[t] + np.logaddexp.reduce(alpha[:, None] + lt, axis=0)
    return np.logaddexp.reduce(alpha)


def _viterbi(em, lt, li):
    """NumPy Viterbi: the best path."""
    em, lt, li = np.asarray(em, np.float64), _log_softmax(lt), _log_softmax(li)
    delta, back = li + em[0], []
    for t in range(1, len(em)):
        s = delta[:, None] + lt
        back.append(s.argmax(0))
        delta = em[t] + s.max(0)
    path = [int(delta.argmax())]
    for b in reversed(back):
        path.insert(0, int(b[path[0]]))
    return np.array(path)


def _brute(em, lt, li):
    """Every path: log Z, marginals (T, K), E[sin(1 + z_t)]."""
    em, lt, li = np.asarray(em, np.float64), _log_softmax(lt), _log_softmax(li)
    paths = np.array(list(itertools.product(range(K), repeat=T)))
    score = li[paths[:, 0]] + em[np.arange(T), paths].sum(1)
    score += lt[paths[:, :-1], paths[:, 1:]].sum(1)
    log_z = np.logaddexp.reduce(score)
    w = np.exp(score - log_z)
    marg = np.stack([np.bincount(paths[:, t], weights=w, minlength=K) for t in range(T)])
    return log_z, marg, (w[:, None] * np.sin(1.0 + paths)).sum(0)


@pytest.fixture(scope="module")
def fitted():
    """One compiled pass, vmapped over two chains: log Z, marginals, the expectation and
    the MAP (float32)."""
    _, lt, li = _params()
    ems = jnp.stack([_params(s)[0] for s in (0, 1)])

    @jax.jit
    @jax.vmap
    def run(em):
        return (si.log_marginal(hmm, em, lt, li), si.marginals(hmm, em, lt, li)["z"],
                si.expectation(hmm, "v", em, lt, li), si.map_edges(hmm, em, lt, li)["z"])

    return (ems, lt, li), run(ems)


def test_log_z_marginals_expectation_match_forward_and_brute_force(fitted):
    (ems, lt, li), (log_z, marg, ev, _) = fitted
    assert marg.shape == (2, T, K) and log_z.dtype == jnp.float32
    for i, em in enumerate(ems):
        ref_z, ref_marg, ref_ev = _brute(em, lt, li)
        np.testing.assert_allclose(log_z[i], _forward(em, lt, li), rtol=1e-5)
        np.testing.assert_allclose(log_z[i], ref_z, rtol=1e-5)
        np.testing.assert_allclose(marg[i], ref_marg, atol=1e-5)
        np.testing.assert_allclose(ev[i], ref_ev, atol=1e-5)


def test_map_is_the_viterbi_path(fitted):
    (ems, lt, li), (*_, path) = fitted
    for i, em in enumerate(ems):
        np.testing.assert_array_equal(path[i], _viterbi(em, lt, li))


def test_draws_follow_the_marginals_and_pairs(fitted):
    (ems, lt, li), (_, margs, _, _) = fitted
    p, marg = (ems[0], lt, li), margs[0]
    keys = jax.random.split(jax.random.PRNGKey(0), 3000)
    draws = jax.jit(jax.vmap(lambda k: si.sample_edges(k, hmm, *p)["z"]))(keys)
    assert draws.shape == (3000, T)
    freq = np.stack([(draws == k).mean(0) for k in range(K)], -1)
    np.testing.assert_allclose(freq, marg, atol=0.04)  # ~4 sd of 3000 draws
    # the joint, not only the marginals: P(z_0 = z_1) from brute force
    em, lt, li = (np.asarray(a, np.float64) for a in p)
    lt, li = _log_softmax(lt), _log_softmax(li)
    paths = np.array(list(itertools.product(range(K), repeat=T)))
    score = li[paths[:, 0]] + em[np.arange(T), paths].sum(1) + lt[paths[:, :-1], paths[:, 1:]].sum(1)
    w = np.exp(score - np.logaddexp.reduce(score))
    same = (w * (paths[:, 0] == paths[:, 1])).sum()
    assert abs(float((draws[:, 0] == draws[:, 1]).mean()) - same) < 0.04


def test_float64_gradients_match_central_differences():
    with float64():
        em, lt, li = _params(3, np.float64)
        f = jax.jit(lambda lt, em: si.log_marginal(hmm, em, lt, li))
        g_lt, g_em = jax.grad(f, argnums=(0, 1))(lt, em)
        assert f(lt, em).dtype == jnp.float64
        # d log Z / d emission = the marginals (forward-backward)
        np.testing.assert_allclose(g_em, _brute(em, lt, li)[1], atol=1e-10)
        rng = np.random.default_rng(4)
        v = jnp.asarray(rng.normal(size=lt.shape))
        h = 1e-5
        central = (f(lt + h * v, em) - f(lt - h * v, em)) / (2 * h)
        np.testing.assert_allclose(jnp.sum(g_lt * v), central, rtol=1e-6)
        np.testing.assert_allclose(f(lt, em), _forward(em, lt, li), rtol=1e-12)


def test_mechanism_map_and_shapes():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(6, 2)))
    a = jnp.asarray(rng.normal(size=(K, 2, 2)) * 0.5)
    b = jnp.asarray(rng.normal(size=(K, 2)))
    prec = jnp.ones((K, 2))
    lt, li = jnp.zeros((K, K)), jnp.zeros(K)
    model = si.mechanisms.markov_switching_dynamics
    m, path = jax.jit(lambda *a: (si.marginals(model, *a)["mode"], si.map_edges(model, *a)["mode"]))(
        x, a, b, prec, lt, li)
    assert m.shape == (5, K) and path.shape == (5,)
    # uniform transitions: the modes are independent, the MAP is each step's best mode
    np.testing.assert_array_equal(path, np.argmax(m, -1))


def test_cost_is_linear_in_length():
    """A chain of 10^5 steps (K = 8) runs: O(T K^2) memory, no K^T."""
    rng = np.random.default_rng(8)
    em = jnp.asarray(rng.normal(size=(100_000, 8)), jnp.float32)
    lt = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
    lz = jax.jit(lambda e: si.log_marginal(hmm, e, lt, jnp.zeros(8)))(em)
    assert np.isfinite(float(lz))


def test_errors_name_the_site():
    em, lt, li = _params()

    def outside(em):
        si.edge("z", si.priors.Markov(lt, li), em[0], previous=jnp.asarray(-1))

    with pytest.raises(ValueError, match="'z'.*scan over the time steps"):
        si.log_marginal(outside, em)

    def no_initial(em):
        prior = si.priors.Markov(lt)
        scan(lambda p, e: (si.edge("z", prior, e, previous=p), None), jnp.asarray(-1), em)

    with pytest.raises(ValueError, match="'z'.*no initial distribution"):
        si.log_marginal(no_initial, em)

    def no_previous(em):
        prior = si.priors.Markov(lt, li)
        scan(lambda p, e: (si.edge("z", prior, e), None), jnp.asarray(-1), em)

    with pytest.raises(ValueError, match="'z'.*pass previous="):
        si.log_marginal(no_previous, em)

    with pytest.raises(ValueError, match=r"square \(K, K\)"):
        si.priors.Markov(jnp.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"log_initial must have shape \(3,\)"):
        si.priors.Markov(jnp.zeros((3, 3)), jnp.zeros(2))
    with pytest.raises(ValueError, match="log_transition must be"):
        si.mechanisms.markov_switching_dynamics(
            jnp.zeros((4, 2)), jnp.zeros((K, 2, 2)), jnp.zeros((K, 2)), jnp.ones((K, 2)),
            jnp.zeros((K, K + 1)), jnp.zeros(K))


@pytest.mark.parametrize("forbid", [False, True])
def test_chains_under_a_plate_are_independent(forbid):
    """A plate inside the scan: B chains at once, each as if alone (also with forbidden
    moves: a left-to-right chain, whose marginals were NaN)."""
    em, lt, li = _params()
    if forbid:
        lt, li = (jnp.asarray(x, jnp.float32) for x in _left_to_right("float32")[1:3])
    ems = jnp.stack([em, _params(1)[0]], axis=1)  # (T, B = 2, K)
    batched = functools.partial(batched_hmm, log_transition=lt, log_initial=li)
    lz, marg = jax.jit(lambda e: (si.log_marginal(batched, e), si.marginals(batched, e)["z"]))(ems)
    assert marg.shape == (T, 2, K)
    np.testing.assert_allclose(lz, sum(_forward(ems[:, b], lt, li) for b in range(2)), rtol=1e-5)
    for b in range(2):
        np.testing.assert_allclose(marg[:, b], _brute(ems[:, b], lt, li)[1], atol=1e-5)


@pytest.mark.parametrize("forbid", [False, True])
def test_markov_switching_em_counts_and_ascent(forbid):
    """The E-step's expected transitions match brute force; EM steps never lower log p.
    With a forbidden move (mode 1 never returns to mode 0) too: the E-step was NaN, and
    the move stays forbidden (a zero count is log P = -inf, as in Baum-Welch)."""
    from structinfer.infer import em_markov_switching as em

    rng = np.random.default_rng(10)
    x = jnp.asarray(np.cumsum(rng.normal(size=(6, 1)), 0))  # T = 6: 5 modes, 4 moves
    a = jnp.asarray([[[0.9]], [[-0.4]]])
    b = jnp.asarray([[0.3], [-0.3]])
    prec = jnp.asarray([[2.0], [0.7]])
    lt = jnp.asarray([[1.0, -1.0], [-np.inf if forbid else 0.2, 0.5]])
    li = jnp.asarray([0.3, -0.3])
    step = jax.jit(lambda st: em.step(x, st))
    st = jax.jit(em.init)(x, a, b, prec, lt, li)
    # brute force over the 2^5 mode paths
    ltn, lin = _log_softmax(lt), _log_softmax(li)
    xs = np.asarray(x, np.float64)
    mean = np.einsum("kde,te->tkd", np.asarray(a), xs[:-1]) + np.asarray(b)
    p = np.asarray(prec)
    emit = (-0.5 * ((xs[1:, None] - mean) ** 2 * p).sum(-1) + 0.5 * np.log(p).sum(-1)
            - 0.5 * np.log(2 * np.pi))
    paths = np.array(list(itertools.product(range(2), repeat=5)))
    score = lin[paths[:, 0]] + emit[np.arange(5), paths].sum(1) + ltn[paths[:, :-1], paths[:, 1:]].sum(1)
    w = np.exp(score - np.logaddexp.reduce(score))
    counts = np.zeros((2, 2))
    for path, wi in zip(paths, w):
        np.add.at(counts, (path[:-1], path[1:]), wi)
    np.testing.assert_allclose(st.transitions, counts, atol=1e-5)
    np.testing.assert_allclose(st.log_likelihood, np.logaddexp.reduce(score), rtol=1e-5)
    lls = [float(st.log_likelihood)]
    for _ in range(3):
        st, _ = step(st)
        lls.append(float(st.log_likelihood))
    assert all(b >= a - 1e-4 for a, b in zip(lls, lls[1:])), lls
    assert np.all(np.isfinite(lls)) and np.all(np.isfinite(np.asarray(st.responsibilities)))
    assert (float(st.log_transition[1, 0]) == -np.inf) == forbid


# --- the lowering: a fused forward-backward scan ----------------------------------------


def _forward_backward(initial, pair):
    """NumPy forward-backward in log space over explicit factors: marginals (T, K), log Z.

    ``initial`` (K,), ``pair`` (T - 1, K, K) (previous, next); ``-inf`` allowed."""
    initial, pair = np.asarray(initial, np.float64), np.asarray(pair, np.float64)
    lse = lambda x, ax: np.logaddexp.reduce(x, axis=ax)  # noqa: E731
    with np.errstate(invalid="ignore", divide="ignore"):
        alpha = [initial]
        for p in pair:
            alpha.append(lse(alpha[-1][:, None] + p, 0))
        beta = [np.zeros_like(initial)]
        for p in pair[::-1]:
            beta.insert(0, lse(p + beta[0][None, :], 1))
        log_z = lse(alpha[-1], 0)
        return np.exp(np.array(alpha) + np.array(beta) - log_z), log_z


def _hmm_factors(em, lt, li):
    lt, li = _log_softmax(lt), _log_softmax(li)
    em = np.asarray(em, np.float64)
    return li + em[0], lt[None] + em[1:, None, :]


def test_markov_scan_kernel_matches_numpy_forward_backward_with_forbidden_moves():
    """The kernel alone, float64: a banded, monotone transition matrix (-inf moves), where
    funsor's products meet log 0; and a chain with no allowed path (NaN, log Z = -inf)."""
    from structinfer.lowering.markov import markov_scan

    rng = np.random.default_rng(11)
    t, k, dv = 7, 5, 3
    i, j = np.arange(k)[:, None], np.arange(k)[None, :]
    band = np.where((j == i) | (j == i + 1), rng.normal(size=(k, k)), -np.inf)
    initial = np.where(np.arange(k) == 0, 0.0, -np.inf)
    pair = band[None] + rng.normal(size=(t - 1, 1, k))
    table = rng.normal(size=(t, k, dv))
    ref_marg, ref_z = _forward_backward(initial, pair)
    assert np.isfinite(ref_z) and np.isclose(ref_marg[0, 0], 1.0)
    with float64():
        run = jax.jit(markov_scan)
        marg, log_z = run(jnp.asarray(initial), jnp.asarray(pair))
        np.testing.assert_allclose(log_z, ref_z, rtol=1e-12)
        np.testing.assert_allclose(marg, ref_marg, atol=1e-12)
        y, _ = run(jnp.asarray(initial), jnp.asarray(pair), jnp.asarray(table))
        np.testing.assert_allclose(y, np.einsum("tk,tkd->td", ref_marg, table), atol=1e-12)
        # reverse mode through both scans: finite where every move is forbidden or allowed
        g = jax.grad(lambda p: run(jnp.asarray(initial), p, jnp.asarray(table))[0].sum())(
            jnp.asarray(pair))
        assert np.all(np.isfinite(np.asarray(g)[np.isfinite(pair)]))
        # no allowed path (the first state may not move on): NaN, never a number
        stuck = pair[:1].copy()
        stuck[0, 0, :] = -np.inf
        m2, z2 = run(jnp.asarray(initial), jnp.asarray(stuck))
        assert float(z2) == -np.inf and np.all(np.isnan(np.asarray(m2)))
    # a long chain in float32 keeps float32's precision (|log Z| ~ 10^3)
    long = rng.normal(size=(999, k, k)) + 2.0
    init = rng.normal(size=k)
    ref_marg, ref_z = _forward_backward(init, long)
    marg, log_z = jax.jit(markov_scan)(jnp.asarray(init, jnp.float32),
                                       jnp.asarray(long, jnp.float32))
    assert marg.dtype == jnp.float32 and abs(ref_z) > 1e3
    # bfloat16 factors accumulate in float32
    marg16, _ = jax.jit(markov_scan)(jnp.asarray(init, jnp.bfloat16),
                                     jnp.asarray(long[:9], jnp.bfloat16))
    assert marg16.dtype == jnp.float32
    np.testing.assert_allclose(marg16, _forward_backward(
        np.asarray(jnp.asarray(init, jnp.bfloat16), np.float64),
        np.asarray(jnp.asarray(long[:9], jnp.bfloat16), np.float64))[0], atol=1e-5)
    np.testing.assert_allclose(marg, ref_marg, atol=1e-5)
    np.testing.assert_allclose(log_z, ref_z, rtol=1e-5)


def test_attention_runs_the_fused_scan_and_equals_the_exact_engine(fitted):
    """si.attention on the HMM (float32, jit + vmap): the markov_scan kernel, equal to the
    exact engine's expectation, marginals and log Z (the fixture), to brute force and to a
    NumPy forward-backward."""
    from structinfer.exact import chain_factors
    from structinfer.lowering.markov import markov_scan

    (ems, lt, li), (log_z, marg, ev, _) = fitted
    expl = si.explain(hmm, "v", ems[0], lt, li)
    assert expl.path == "lowered" and expl.kernels == {"z": "markov_scan"}
    assert "forward-backward scan over the chain" in str(expl)
    y = jax.jit(jax.vmap(lambda e: si.attention(hmm, "v")(e, lt, li)))(ems)
    assert y.shape == (2, T) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, ev, atol=1e-5)

    @jax.jit  # the factors read off the model and the kernel on them: one program
    def kernel_alone(e):
        cf = chain_factors(hmm, (e, lt, li))
        m, lz = markov_scan(cf.initial, cf.pair)
        return m, lz + cf.constant

    for b in range(2):
        np.testing.assert_allclose(y[b], _brute(ems[b], lt, li)[2], atol=1e-5)
        ref, _ = _forward_backward(*_hmm_factors(ems[b], lt, li))
        np.testing.assert_allclose(y[b], ref @ np.sin(1.0 + np.arange(K)), atol=1e-5)
        m, lz = kernel_alone(ems[b])
        np.testing.assert_allclose(m, marg[b], atol=1e-5)
        np.testing.assert_allclose(lz, log_z[b], rtol=1e-5)


def test_fused_scan_float64_gradients_match_central_differences():
    """Reverse mode through the fused scans (float64) equals central differences of the
    NumPy forward-backward, for the emissions and the transition logits."""
    em, lt, li = (np.asarray(a, np.float64) for a in _params(3))
    w = np.random.default_rng(5).normal(size=T)
    vals = np.sin(1.0 + np.arange(K))

    def ref(em, lt):
        m, _ = _forward_backward(*_hmm_factors(em, lt, li))
        return float(w @ (m @ vals))

    with float64():
        f = si.attention(hmm, "v")
        loss = jax.jit(lambda e, t: jnp.dot(jnp.asarray(w), f(e, t, jnp.asarray(li))))
        e64, l64 = jnp.asarray(em, jnp.float64), jnp.asarray(lt, jnp.float64)
        assert loss(e64, l64).dtype == jnp.float64
        np.testing.assert_allclose(loss(e64, l64), ref(em, lt), rtol=1e-10)
        g_em, g_lt = jax.jit(jax.grad(loss, argnums=(0, 1)))(e64, l64)
    rng = np.random.default_rng(6)
    h = 1e-6
    for g, x, which in ((g_em, np.asarray(em, np.float64), 0), (g_lt, np.asarray(lt, np.float64), 1)):
        v = rng.normal(size=x.shape)
        args_p = [np.asarray(em, np.float64), np.asarray(lt, np.float64)]
        args_m = list(args_p)
        args_p[which], args_m[which] = x + h * v, x - h * v
        central = (ref(*args_p) - ref(*args_m)) / (2 * h)
        np.testing.assert_allclose(np.sum(np.asarray(g) * v), central, rtol=1e-6)


def test_catalogue_chains_are_fused_and_equal_their_forward_backward():
    """monotonic_alignment (the attention output E[v_phi]) and markov_switching_dynamics
    (the smoothed prediction E[A_phi x_t + b_phi]): lowered, equal to a NumPy
    forward-backward over the models' factors written out here."""
    rng = np.random.default_rng(9)
    q, k, v = (rng.normal(size=s) for s in ((7, 2), (3, 2), (3, 5)))
    # alignment: start at parent 0, stay / advance (weight 1 each), end at the last parent
    leak, m = -30.0, 3
    i, j = np.arange(m)[:, None], np.arange(m)[None, :]
    lt = np.where((j == i) | (j == i + 1), 0.0, leak)
    li = np.where(np.arange(m) == 0, 0.0, leak)
    em = q @ k.T
    em[-1] += np.where(np.arange(m) == m - 1, 0.0, leak)
    marg, _ = _forward_backward(*_hmm_factors(em, lt, li))
    args = tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v))
    expl = si.explain(si.mechanisms.monotonic_alignment, "out", *args)
    assert expl.kernels == {"align": "markov_scan"} and "edge 'align': markov_scan" in str(expl)
    y = si.attention(si.mechanisms.monotonic_alignment, "out")(*args)
    np.testing.assert_allclose(y, marg @ v, atol=2e-5)
    # switching dynamics: Gaussian emissions of x_{t+1} under each mode
    x = rng.normal(size=(6, 2))
    a, b = rng.normal(size=(K, 2, 2)) * 0.5, rng.normal(size=(K, 2))
    prec, lt, li = rng.uniform(0.5, 2.0, size=(K, 2)), rng.normal(size=(K, K)), rng.normal(size=K)
    loc = np.einsum("kde,te->tkd", a, x[:-1]) + b  # (T - 1, K, d)
    em = (-0.5 * ((x[1:, None] - loc) ** 2 * prec).sum(-1) + 0.5 * np.log(prec).sum(-1)
          - np.log(2 * np.pi))
    marg, _ = _forward_backward(*_hmm_factors(em, lt, li))
    args = tuple(jnp.asarray(z, jnp.float32) for z in (x, a, b, prec, lt, li))
    model = si.mechanisms.markov_switching_dynamics
    assert si.explain(model, "out", *args).kernels == {"mode": "markov_scan"}
    np.testing.assert_allclose(si.attention(model, "out")(*args),
                               np.einsum("tk,tkd->td", marg, loc), atol=2e-5)


def test_forbidden_moves_and_no_path_follow_the_exact_engine():
    """-inf transitions: the fused value equals a NumPy forward-backward (finite); a chain
    with no allowed path is NaN under jit, as the exact engine's, never a finite number."""
    rng = np.random.default_rng(12)
    em = jnp.asarray(rng.normal(size=(T, K)), jnp.float32)
    i, j = np.arange(K)[:, None], np.arange(K)[None, :]
    lt = jnp.asarray(np.where(j >= i, 0.0, -np.inf), jnp.float32)  # never move back
    li = jnp.asarray([0.0, -np.inf, -np.inf], jnp.float32)
    y = si.attention(hmm, "v")(em, lt, li)
    marg, _ = _forward_backward(*_hmm_factors(em, lt, li))
    np.testing.assert_allclose(y, marg @ np.sin(1.0 + np.arange(K)), atol=1e-5)

    def pinned(emission, last):  # the last edge must be state `last`: impossible at 0 ... 0
        prior = si.priors.Markov(lt, li)

        def step(previous, xs):
            e, is_last = xs
            z = si.edge("z", prior, e, previous=previous)
            potential("z.end", jnp.where(is_last & (z != last), -jnp.inf, 0.0))
            numpyro.deterministic("v", jnp.sin(1.0 + z))
            return z, None

        scan(step, jnp.asarray(-1), (emission, jnp.arange(T) == T - 1))

    assert si.explain(pinned, "v", em, 2).kernels == {"z": "markov_scan"}
    initial, pair = _hmm_factors(em, lt, li)
    pair[-1] += np.where(np.arange(K) == 2, 0.0, -np.inf)
    marg, _ = _forward_backward(initial, pair)
    np.testing.assert_allclose(si.attention(pinned, "v")(em, 2),
                               marg @ np.sin(1.0 + np.arange(K)), atol=1e-5)
    # the exact engine too (its marginals were NaN: funsor's products met log 0)
    np.testing.assert_allclose(si.marginals(pinned, em, 2)["z"], marg, atol=1e-5)
    bad_lt = jnp.asarray(np.where(j == i, 0.0, -np.inf), jnp.float32)  # stay forever at 0

    def stuck(emission):
        prior = si.priors.Markov(bad_lt, li)

        def step(previous, xs):
            e, is_last = xs
            z = si.edge("z", prior, e, previous=previous)
            potential("z.end", jnp.where(is_last & (z != K - 1), -jnp.inf, 0.0))
            numpyro.deterministic("v", jnp.sin(1.0 + z))
            return z, None

        scan(step, jnp.asarray(-1), (emission, jnp.arange(T) == T - 1))

    fused = jax.jit(si.attention(stuck, "v"))(em)
    exact, marg = jax.jit(lambda e: (si.expectation(stuck, "v", e),
                                     si.marginals(stuck, e)["z"]))(em)
    assert np.all(np.isnan(np.asarray(exact))) and np.all(np.isnan(np.asarray(fused)))
    assert np.all(np.isnan(np.asarray(marg)))
    with pytest.raises(ValueError, match="zero probability"):
        si.marginals(stuck, em)


@pytest.mark.parametrize("bad", [pytest.param(np.nan, marks=pytest.mark.exhaustive), np.inf])
def test_a_nan_or_infinite_factor_mid_chain_gives_nan_not_a_forbidden_move(bad):
    """Regression (review): a NaN or +inf log-factor at one state of a middle step was read
    as "no terms" (-inf) by the kernel's log-sum-exp, i.e. a forbidden move: the steps after
    it came back finite and wrong. A diverged parameter or an overflowing score must give
    NaN under jit, as the exact engine does, and an error naming the chain's edge site
    when called eagerly."""
    em, lt, li = _params(4)

    def poisoned(emission):
        prior = si.priors.Markov(lt, li)

        def step(previous, xs):
            e, here = xs
            z = si.edge("z", prior, e, previous=previous)
            potential("z.bad", jnp.where(here & (z == 1), bad, 0.0))
            numpyro.deterministic("v", jnp.sin(1.0 + z))
            return z, None

        scan(step, jnp.asarray(-1), (emission, jnp.arange(T) == 2))

    assert si.explain(poisoned, "v", em).kernels == {"z": "markov_scan"}
    with pytest.raises(ValueError, match="edge site 'z': the model's log-marginal is NaN"):
        si.attention(poisoned, "v")(em)
    assert np.all(np.isnan(np.asarray(jax.jit(si.attention(poisoned, "v"))(em))))
    exact = jax.jit(lambda e: si.expectation(poisoned, "v", e))(em)
    assert np.all(np.isnan(np.asarray(exact)))
    # the kernel alone, the bad entry inside the pair factors
    from structinfer.lowering.markov import markov_scan

    initial, pair = _hmm_factors(em, lt, li)
    pair[1][0, 0] = bad
    y, log_z = markov_scan(jnp.asarray(initial), jnp.asarray(pair))
    assert np.all(np.isnan(np.asarray(y))) and np.isnan(float(log_z))


def test_markov_scan_names_the_argument_of_a_wrong_shape():
    from structinfer.lowering.markov import markov_scan

    init, pair, table = jnp.zeros(K), jnp.zeros((T - 1, K, K)), jnp.zeros((T, K, 2))
    with pytest.raises(ValueError, match="pair"):
        markov_scan(init, jnp.zeros((T - 1, K, K + 1)), table)
    with pytest.raises(ValueError, match="initial"):
        markov_scan(jnp.zeros((1, K)), pair, table)
    with pytest.raises(ValueError, match="table"):
        markov_scan(init, pair, jnp.zeros((T + 1, K, 2)))
    assert markov_scan(init, pair, table)[0].shape == (T, 2)


def test_unrecognised_chains_fall_back_with_the_reason():
    em, lt, li = _params()
    ems = jnp.stack([em, _params(1)[0]], axis=1)  # (T, B = 2, K)
    batched = functools.partial(batched_hmm, log_transition=lt, log_initial=li)

    def reads_previous(em):
        prior = si.priors.Markov(lt, li)

        def step(previous, e):
            z = si.edge("z", prior, e, previous=previous)
            numpyro.deterministic("v", jnp.sin(1.0 + z) * (previous + 2.0))
            return z, None

        scan(step, jnp.asarray(-1), em)

    def backwards(em):  # the chain runs from the last emission to the first
        prior = si.priors.Markov(lt, li)

        def step(previous, e):
            z = si.edge("z", prior, e, previous=previous)
            numpyro.deterministic("v", jnp.sin(1.0 + z))
            return z, None

        scan(step, jnp.asarray(-1), em, reverse=True)

    for model, x, part in ((batched, ems, "under a plate"),
                           (reads_previous, em, "reads the previous edge"),
                           (backwards, em, "reverse=True")):
        expl = si.explain(model, "v", x)
        assert expl.path == "exact" and part in str(expl), str(expl)
    # the fallback runs (the exact engine): E[sin(1 + z_t) (z_{t-1} + 2)] by brute force
    _, lt64, li64 = (np.asarray(a, np.float64) for a in _params())
    ltn, lin = _log_softmax(lt64), _log_softmax(li64)
    paths = np.array(list(itertools.product(range(K), repeat=T)))
    score = lin[paths[:, 0]] + np.asarray(em)[np.arange(T), paths].sum(1)
    score += ltn[paths[:, :-1], paths[:, 1:]].sum(1)
    w = np.exp(score - np.logaddexp.reduce(score))
    prev = np.concatenate([np.full((len(paths), 1), -1), paths[:, :-1]], 1)
    ref = (w[:, None] * np.sin(1.0 + paths) * (prev + 2.0)).sum(0)
    np.testing.assert_allclose(si.attention(reads_previous, "v")(em), ref, atol=1e-5)
    with pytest.raises(si.lowering.NotLowerableError, match="'z'.*Markov prior.*markov_scan"):
        si.attention(hmm, "v", backend="dense")(em, lt, li)


@pytest.mark.exhaustive  # (~4 s; the default tier runs benchmarks/gpu.py --quick)
def test_benchmark_quick_mode_runs(capsys, monkeypatch):
    """benchmarks/markov_chain.py --quick (a short chain, the exact / fused pair only)."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    import markov_chain

    markov_chain.main(["--quick", "--lengths", "9", "-k", "3", "--pair-only"])
    out = capsys.readouterr().out
    assert "fused markov_scan" in out and "exact/fused run" in out, out
    assert out.count("load average") == 2
    sys.modules.pop("markov_chain", None)


@pytest.mark.exhaustive
def test_numpyro_nuts_with_the_chain_enumerated_matches_the_engine():
    """NumPyro's own MCMC(NUTS) on a Markov model with one continuous parameter (the
    stay log-odds theta, a standard normal prior), NumPyro enumerating the chain's edges
    itself: its posterior mean and sd of theta equal those by quadrature of the exact
    engine's log p(x | theta) + log p(theta) on a grid (a Monte Carlo tolerance)."""
    import numpyro.distributions as dist
    from numpyro.infer import MCMC, NUTS

    rng = np.random.default_rng(5)
    path = np.repeat(rng.integers(K, size=12), 10)  # 120 steps in runs of 10: sticky
    em = jnp.asarray(1.5 * np.eye(K)[path] + rng.normal(size=(120, K)), jnp.float32)
    li = jnp.zeros(K, jnp.float32)

    def model(em):
        theta = numpyro.sample("theta", dist.Normal(0.0, 1.0))
        hmm(em, theta * jnp.eye(K), li)

    grid = jnp.linspace(-6.0, 6.0, 1201)
    log_post = jax.jit(jax.vmap(lambda t: si.log_marginal(hmm, em, t * jnp.eye(K), li)))(
        grid) + dist.Normal(0.0, 1.0).log_prob(grid)
    w = np.asarray(jax.nn.softmax(log_post), np.float64)
    mean = float(np.sum(w * grid))
    sd = float(np.sqrt(np.sum(w * (np.asarray(grid) - mean) ** 2)))
    mcmc = MCMC(NUTS(model), num_warmup=400, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.key(0), em)
    theta = np.asarray(mcmc.get_samples()["theta"], np.float64)
    assert mean > 2.0 and sd < 0.5  # the data, not the prior, decide (2.84 +- 0.37)
    assert abs(theta.mean() - mean) < 0.15 * sd, (theta.mean(), mean, sd)
    assert abs(theta.std() - sd) < 0.15 * sd, (theta.std(), sd)


@pytest.mark.exhaustive  # (~5 s of fits)
def test_per_child_diagnostics_refuse_a_chain_by_name():
    """Regression: the pointwise log-likelihood, `check_comparable` (the CLI's `compare`
    runs it first) and `to_inference_data` of a Markov model raised a bare
    ``KeyError: '_PREV_z'``. A chain couples its steps' observations, so there is no
    per-child term: each says so, naming the site and what to use instead."""
    import numpyro.distributions as dist

    from structinfer import diagnostics as dg

    def model(y):
        stay = numpyro.sample("stay", dist.Beta(5.0, 2.0))
        prior = si.priors.Markov(jnp.log(jnp.array([[stay, 1 - stay], [1 - stay, stay]])),
                                 jnp.zeros(2))

        def step(prev, yt):
            z = si.edge("z", prior, previous=prev)
            numpyro.sample("y", dist.Normal(jnp.array([-1.0, 1.0])[z], 0.7), obs=yt)
            return z, None

        scan(step, jnp.asarray(-1), y)

    y = jnp.array([-1.1, -0.8, -1.2, 0.9, 1.1, 1.3, 0.7])
    said = r"model 'model': site 'z' lies on a Markov chain .* \(structinfer.log_marginal\)"
    with pytest.raises(ValueError, match=said):
        si.exact.pointwise_log_likelihood(model, {"stay": jnp.array(0.7)}, y)
    with pytest.raises(ValueError, match=said):
        dg.check_comparable(model, y)
    fit = si.infer.nuts(jax.random.key(0), model, y, num_warmup=5, num_samples=5,
                        progress_bar=False)
    with pytest.raises(ValueError, match=said):
        dg.to_inference_data(fit, y)


@pytest.mark.parametrize("arg", ["log_stay", "log_advance", "log_skip", "log_leak"])
def test_alignment_weights_must_be_scalars(arg):
    """monotonic_alignment's move weights are one log-weight for every step: an array
    broadcast along the destination parent without error (a per-destination 'stay'
    weight nobody asked for); now it is named."""
    q, k, v = jnp.ones((4, 2)), jnp.ones((3, 2)), jnp.ones((3, 1))
    kwargs = {"log_skip": 0.0, arg: jnp.zeros(3)}
    with pytest.raises(ValueError, match=f"monotonic_alignment: `{arg}` must be a scalar.*shape \\(3,\\)"):
        si.log_marginal(si.mechanisms.monotonic_alignment, q, k, v, **kwargs)


def test_alignment_against_pytorch_struct_linear_chain_crf(x64):
    """Optional (runs where torch and torch-struct are installed): the monotonic alignment's
    log Z and posterior against pytorch-struct's LinearChainCRF (its partition function and
    its marginals, the gradient of log Z in torch) on the same factors written out here —
    an independent implementation of the chain's sum-product."""
    torch = pytest.importorskip("torch")
    torch_struct = pytest.importorskip("torch_struct")
    rng = np.random.default_rng(13)
    t, m = 9, 4
    q, k, v = (rng.normal(size=s) for s in ((t, 3), (m, 3), (m, 2)))
    leak = -30.0
    i, j = np.arange(m)[:, None], np.arange(m)[None, :]
    lt = _log_softmax(np.where((j == i) | (j == i + 1), 0.0, leak))  # rows: previous state
    li = _log_softmax(np.where(np.arange(m) == 0, 0.0, leak))
    em = q @ k.T
    em[-1] += np.where(np.arange(m) == m - 1, 0.0, leak)  # end at the last parent
    # torch-struct's edge potentials (batch, N - 1, C_next, C_prev); the first step's
    # factor (initial + emission) goes into the first edge
    pot = lt.T[None] + em[1:, :, None]
    pot[0] += (li + em[0])[None, :]
    crf = torch_struct.LinearChainCRF(torch.tensor(pot[None], dtype=torch.float64))
    args = tuple(jnp.asarray(a, jnp.float64) for a in (q, k, v))
    log_z = si.log_marginal(si.mechanisms.monotonic_alignment, *args)
    marg = si.marginals(si.mechanisms.monotonic_alignment, *args)["align"]
    np.testing.assert_allclose(float(log_z), float(crf.partition[0].detach()), rtol=1e-9,
                               atol=1e-9)
    edge = crf.marginals[0].detach().numpy()  # (N - 1, C_next, C_prev)
    ref = np.concatenate([edge[:1].sum(1), edge.sum(2)], 0)  # (N, C)
    np.testing.assert_allclose(np.asarray(marg), ref, atol=1e-9)


def test_a_bfloat16_chain_is_contracted_in_float32():
    """A chain's 16-bit tables are summed in float32, as every edge's (review): log Z and
    the marginals equal those of the same rounded inputs in float32."""
    em, lt, li = (x.astype(jnp.bfloat16) for x in _params(3))
    up = [x.astype(jnp.float32) for x in (em, lt, li)]
    lz = si.log_marginal(hmm, em, lt, li)
    assert lz.dtype == jnp.float32
    np.testing.assert_allclose(lz, si.log_marginal(hmm, *up), rtol=1e-6)
    np.testing.assert_allclose(si.marginals(hmm, em, lt, li)["z"],
                               si.marginals(hmm, *up)["z"], atol=1e-6)


def valued_chain(s, lt, li, v):
    """A chain whose value is a table read at the edge: ``v[z_t]``."""
    prior = si.priors.Markov(lt, li)

    def step(prev, sc):
        z = si.edge("z", prior, sc, previous=prev)
        numpyro.deterministic("out", v[z])
        return z, None

    scan(step, jnp.asarray(-1), s)


def _valued_chain_args():
    """``(s, lt, li, v)`` of `valued_chain` (float32): T steps' scores, K states' log
    transitions and initial weights, a value of size 2 per state."""
    r = np.random.default_rng(0)
    return tuple(jnp.asarray(r.normal(size=x), jnp.float32)
                 for x in ((T, K), (K, K), (K,), (K, 2)))


def test_nan_score_in_a_chain_raises_eagerly_and_is_nan_under_jit():
    """A NaN score inside a Markov chain (a ``scan``, where the exact engine's value
    checks do not see it): called eagerly, `attention` raises naming the edge site, not
    an all-NaN answer; under an outer ``jit`` the answer is NaN, never finite."""
    s, lt, li, v = _valued_chain_args()
    f = si.attention(valued_chain, "out")
    np.testing.assert_allclose(f(s, lt, li, v),
                               si.expectation(valued_chain, "out", s, lt, li, v),
                               rtol=1e-5, atol=1e-6)
    bad = s.at[3, 1].set(jnp.nan)
    with pytest.raises(ValueError, match="edge site 'z': the model's log-marginal is NaN"):
        f(bad, lt, li, v)
    assert np.isnan(np.asarray(jax.jit(f)(bad, lt, li, v))).all()


def test_an_attention_edge_per_step_of_a_scan(x64):
    """Regression: a plain (non-Markov) edge with a score inside a scan body (recurrent
    attention over a memory) failed everywhere: its row-normaliser factor lost the time
    dim (``numpyro.factor``), the marginals' tilted distribution was no pytree, and the
    lowering substituted its probes into the scan. Now each engine gives the per-step
    softmax, written here; the lowering falls back to the exact engine, saying why."""
    rng = np.random.default_rng(0)
    steps, n, m, d = 3, 2, 4, 2
    qs, k, v = (jnp.asarray(rng.normal(size=s)) for s in ((steps, n, d), (m, d), (m, d)))

    def model(qs, k, v):
        def step(c, q):
            with numpyro.plate("queries", n):
                j = si.edge("phi", si.priors.Uniform(m), si.scores.Dot(q, k))
                numpyro.deterministic("out", v[j])
            return c, None

        scan(step, jnp.zeros(()), qs)

    s = np.einsum("tid,jd->tij", np.asarray(qs), np.asarray(k))
    a = np.exp(s - np.logaddexp.reduce(s, -1, keepdims=True))
    np.testing.assert_allclose(si.log_marginal(model, qs, k, v),
                               np.logaddexp.reduce(s - np.log(m), -1).sum(), rtol=1e-12)
    np.testing.assert_allclose(si.marginals(model, qs, k, v)["phi"], a, rtol=1e-12)
    f = si.attention(model, "out")
    for out in (si.expectation(model, "out", qs, k, v), f(qs, k, v)):
        np.testing.assert_allclose(out, a @ np.asarray(v), rtol=1e-12)
    assert "inside a numpyro scan" in str(f.explain(qs, k, v))


def _left_to_right(dtype):
    """A left-to-right HMM's parameters: never move back (-inf below the diagonal); the
    chain starts in state 0 (``li``) or anywhere (``li_free``)."""
    em = np.random.default_rng(12).normal(size=(T, K))
    i, j = np.arange(K)[:, None], np.arange(K)[None, :]
    lt = np.where(j >= i, np.random.default_rng(13).normal(size=(K, K)), -np.inf)
    li = np.array([0.0, -np.inf, -np.inf])
    return em, lt, li, np.zeros(K)


# (float64 checks the zero gradients at forbidden moves against central differences)
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.exhaustive), "float64"])
def test_structural_zero_transitions_give_exact_marginals_not_nan(dtype):
    """Regression: a log-transition of -inf (a left-to-right HMM) gave NaN smoothed
    marginals and expectations (log Z finite): the products of the transition matrices
    leave pairs of states unconnected, whose log 0 made every gradient NaN. The exact
    engine equals brute force over every path, under jit (the chain starting in state 0,
    or anywhere) and eagerly, and the gradients of log Z are finite: the marginals for the
    emissions, central differences for the allowed moves, zero for the forbidden ones."""
    em, lt, li, li_free = _left_to_right(dtype)
    starts = np.stack([li, li_free])
    x64 = dtype == "float64"
    tol = dict(atol=1e-12 if x64 else 2e-5)
    with float64() if x64 else contextlib.nullcontext():
        e, t = jnp.asarray(em, dtype), jnp.asarray(lt, dtype)

        @jax.jit
        @jax.vmap
        def run(i):
            return (jax.value_and_grad(si.log_marginal, argnums=(1, 2))(hmm, e, t, i),
                    si.marginals(hmm, e, t, i)["z"], si.expectation(hmm, "v", e, t, i))

        (log_z, (g_em, g_lt)), marg, ev = run(jnp.asarray(starts, dtype))
        eager = si.expectation(hmm, "v", e, t, jnp.asarray(li, dtype))
        assert log_z.dtype == dtype and marg.dtype == dtype and eager.dtype == dtype
    np.testing.assert_allclose(eager, ev[0], **tol)
    for b, start in enumerate(starts):
        ref_z, ref_marg, ref_ev = _brute(em, lt, start)
        assert np.isfinite(ref_z) and ref_marg[1:, 0].max() < 1.0
        np.testing.assert_allclose(log_z[b], ref_z, rtol=1e-12 if x64 else 1e-5)
        np.testing.assert_allclose(marg[b], ref_marg, **tol)
        np.testing.assert_allclose(ev[b], ref_ev, **tol)
        np.testing.assert_allclose(g_em[b], ref_marg, **tol)  # d log Z / d e_t(j)
        assert np.all(np.isfinite(np.asarray(g_lt[b])))
        if x64:
            h, allowed = 1e-6, np.isfinite(lt)
            for i, j in zip(*np.nonzero(allowed)):
                up, down = lt.copy(), lt.copy()
                up[i, j] += h
                down[i, j] -= h
                central = (_brute(em, up, start)[0] - _brute(em, down, start)[0]) / (2 * h)
                np.testing.assert_allclose(g_lt[b][i, j], central, atol=1e-8)
            np.testing.assert_array_equal(np.asarray(g_lt[b])[~allowed], 0.0)


def test_exact_engine_on_a_chain_with_a_nan_score_raises_eagerly_naming_the_site():
    """Regression: `si.marginals` and `si.expectation` of a chain with a NaN score (inside
    a ``scan``, where the score's own value check does not see it) returned NaN eagerly,
    where `si.attention` raised naming the edge site, as the engine does outside a scan.
    Now the same error; under jit NaN. A NaN in the value alone (log Z finite) is no
    error: the expectation is NaN."""
    s, lt, li, v = _valued_chain_args()
    bad = s.at[3, 1].set(jnp.nan)
    msg = "edge site 'z': the model's log-marginal is NaN"
    with pytest.raises(ValueError, match=msg):
        si.marginals(valued_chain, bad, lt, li, v)
    with pytest.raises(ValueError, match=msg):
        si.expectation(valued_chain, "out", bad, lt, li, v)
    marg, ev = jax.jit(lambda x: (si.marginals(valued_chain, x, lt, li, v)["z"],
                                  si.expectation(valued_chain, "out", x, lt, li, v)))(bad)
    assert np.isnan(np.asarray(marg)).all() and np.isnan(np.asarray(ev)).all()
    assert np.isnan(np.asarray(si.expectation(valued_chain, "out", s, lt, li,
                                              v.at[1, 0].set(jnp.nan)))).any()


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_short_chains_are_lowered_and_equal_forward_backward(steps):
    """Chains of 1, 2 and 3 steps (NumPyro's scan leaves a 2-step chain's one stacked step
    without a named time dim): si.attention runs the fused scan, equal to the exact
    engine and to a NumPy forward-backward, eager and jit; log Z equals the forward
    algorithm."""
    rng = np.random.default_rng(11)
    em = jnp.asarray(rng.normal(size=(steps, K)), jnp.float32)
    _, lt, li = _params(4)
    expl = si.explain(hmm, "v", em, lt, li)
    assert expl.path == "lowered" and expl.kernels == {"z": "markov_scan"}, str(expl)
    word = "edge" if steps == 1 else "edges"
    assert f"a chain of {steps} {word} over {K} states" in str(expl)
    marg, _ = _forward_backward(*_hmm_factors(em, lt, li))
    ref = marg @ np.sin(1.0 + np.arange(K))
    f = si.attention(hmm, "v")
    for y in (f(em, lt, li), jax.jit(f)(em, lt, li)):
        assert y.shape == (steps,)
        np.testing.assert_allclose(y, ref, atol=1e-5)
    np.testing.assert_allclose(si.expectation(hmm, "v", em, lt, li), ref, atol=1e-5)
    np.testing.assert_allclose(si.marginals(hmm, em, lt, li)["z"], marg, atol=1e-5)
    np.testing.assert_allclose(si.log_marginal(hmm, em, lt, li), _forward(em, lt, li),
                               rtol=1e-5)


def test_a_minus_inf_emission_is_a_forbidden_state_as_in_every_edge():
    """A -inf entry in a step's score forbids that state at that step (as a -inf score
    forbids an edge everywhere else): log Z, marginals and the expectation of the exact
    engine (eager and jit) and of the fused scan equal brute force over every path; a
    step with every state forbidden leaves no path: it raises eagerly and is NaN under
    jit."""
    em, lt, li = _params(7)
    em = em.at[0, 2].set(-jnp.inf).at[1, 0].set(-jnp.inf).at[3, jnp.array([1, 2])].set(-jnp.inf)
    log_z, marg, ev = _brute(em, lt, li)
    assert np.isfinite(log_z) and marg[1, 0] == 0 and abs(marg[3, 0] - 1) < 1e-12
    for run in (lambda f: f, jax.jit):
        np.testing.assert_allclose(run(lambda *a: si.log_marginal(hmm, *a))(em, lt, li),
                                   log_z, rtol=1e-5)
        np.testing.assert_allclose(run(lambda *a: si.marginals(hmm, *a)["z"])(em, lt, li),
                                   marg, atol=1e-5)
        np.testing.assert_allclose(run(lambda *a: si.expectation(hmm, "v", *a))(em, lt, li),
                                   ev, atol=1e-5)
        np.testing.assert_allclose(run(si.attention(hmm, "v"))(em, lt, li), ev, atol=1e-5)
    none = em.at[2].set(-jnp.inf)
    with pytest.raises(ValueError, match="zero probability"):
        si.marginals(hmm, none, lt, li)
    assert np.isnan(np.asarray(jax.jit(lambda *a: si.marginals(hmm, *a)["z"])(none, lt, li))).all()


def test_a_substituted_chain_is_fixed_at_its_path_as_condition_fixes_it():
    """Regression: ``numpyro.handlers.substitute`` of a chain's edges (a path) was summed
    over (log Z of every path, a finite wrong number) where ``condition`` fixes it: both
    now give the joint log-density at the path (NumPy), eagerly and under jit."""
    from numpyro.handlers import condition, substitute

    em, lt, li = _params(8)
    path = jnp.array([0, 2, 1, 1, 0])
    e, t, i = (np.asarray(a, np.float64) for a in (em, lt, li))
    joint = (_log_softmax(i)[path[0]] + e[0, path[0]]
             + sum(_log_softmax(t)[path[s - 1], path[s]] + e[s, path[s]] for s in range(1, T)))
    for handler in (substitute, condition):
        fixed = handler(hmm, data={"z": path})
        for run in (lambda f: f, jax.jit):
            np.testing.assert_allclose(
                run(lambda *a, fixed=fixed: si.log_marginal(fixed, *a))(em, lt, li), joint,
                rtol=1e-5)


def test_a_chain_started_from_a_state_out_of_range_is_refused_not_clamped():
    """Regression: a chain started from ``previous = K`` (or beyond; states are 0 ... K-1)
    took the prior's last row (the index was clamped): a finite wrong log Z, marginals and
    value from every engine. Now an error naming the site and ``previous`` on concrete
    values, NaN under jit (the start is traced), never a number."""
    em, lt, li = _params(9)

    def started(emission, start):
        prior = si.priors.Markov(lt, li)

        def step(previous, e):
            z = si.edge("z", prior, e, previous=previous)
            numpyro.deterministic("v", jnp.sin(1.0 + z))
            return z, None

        scan(step, start, emission)

    # in range, a given start is the chain from that state: row `start` of the transitions
    e, ltn = np.asarray(em, np.float64), _log_softmax(lt)
    paths = np.array(list(itertools.product(range(K), repeat=T)))
    score = ltn[1, paths[:, 0]] + e[np.arange(T), paths].sum(1)
    score += ltn[paths[:, :-1], paths[:, 1:]].sum(1)
    np.testing.assert_allclose(si.log_marginal(started, em, jnp.asarray(1)),
                               np.logaddexp.reduce(score), rtol=1e-5)
    start = jnp.asarray(K)
    msg = rf"edge site 'z': previous= holds {K}.*0 \.\.\. {K - 1}"
    with pytest.raises(ValueError, match=msg):
        si.log_marginal(started, em, start)
    with pytest.raises(ValueError, match=msg):
        si.attention(started, "v")(em, start)
    jitted = jax.jit(lambda e, s: (si.marginals(started, e, s)["z"],
                                   si.attention(started, "v")(e, s)))
    for out in jitted(em, start):
        assert np.isnan(np.asarray(out)).all()


@pytest.mark.parametrize("history", [0, 2])
def test_a_chain_in_a_scan_with_history_other_than_one_is_refused(history):
    """Regression: a Markov edge in ``scan(..., history=2)`` whose step also reads the edge
    two steps back (a second-order chain through the carry) gave a finite wrong log Z
    (2.25 where brute force over every path gives 0.06); with ``history=0`` (steps
    independent, as a plate) a bare ``AssertionError``. A chain of Markov edges is first
    order: every engine refuses another ``history`` naming the site and the argument."""
    em, lt, li = _params(5)

    def second_order(emission):
        prior = si.priors.Markov(lt, li)

        def step(carry, e):
            before, previous = carry
            z = si.edge("z", prior, e, previous=previous)
            potential("again", jnp.where(before < 0, 0.0, 0.4 * (z == before)))
            numpyro.deterministic("v", jnp.sin(1.0 + z))
            return (previous, z), None

        scan(step, (jnp.asarray(-1), jnp.asarray(-1)), emission, history=history)

    msg = rf"edge site 'z': a Markov edge's scan must have history=1.*got history={history}"
    with pytest.raises(ValueError, match=msg):
        si.log_marginal(second_order, em)
    with pytest.raises(ValueError, match=msg):
        si.attention(second_order, "v")(em)


def test_an_integer_score_is_read_as_float_as_for_every_edge():
    """Regression: a chain whose per-step score is an integer array (counts, say) failed
    with a bare ``data type int32 not inexact``, where every other edge reads an integer
    score as float: now log Z and the fused value equal those of the same scores as
    floats."""
    em, lt, li = _params(6)
    counts = jnp.round(3 * em).astype(jnp.int32)
    as_float = counts.astype(jnp.float32)
    np.testing.assert_allclose(si.log_marginal(hmm, counts, lt, li),
                               _forward(as_float, lt, li), rtol=1e-5)
    np.testing.assert_allclose(si.attention(hmm, "v")(counts, lt, li),
                               _brute(as_float, lt, li)[2], atol=1e-5)


def test_a_value_read_after_the_scan_is_refused_by_name_not_an_index_error():
    """Regression: the expectation of a value recorded after the chain's scan (here one
    read off the scan's last carry, ``z_{T-1}``) failed with a bare ``IndexError`` (the
    scan's steps sliced every site's zero tilt per step, this scalar one too); a value
    recorded inside the step beside it kept working. NumPyro's enumerated scan does not
    give the carry as a function of the last edge, so every engine refuses it, saying to
    record the value inside the scan's step."""
    em, lt, li = _params(2)

    def last(emission):
        prior = si.priors.Markov(lt, li)

        def step(previous, e):
            z = si.edge("z", prior, e, previous=previous)
            numpyro.deterministic("v", jnp.sin(1.0 + z))
            return z, None

        final, _ = scan(step, jnp.asarray(-1), emission)
        numpyro.deterministic("last", jnp.sin(1.0 + final))

    msg = "record the value inside the scan's step"
    with pytest.raises(ValueError, match=msg):
        si.expectation(last, "last", em)
    with pytest.raises(ValueError, match=msg):
        si.attention(last, "last")(em)
    np.testing.assert_allclose(si.expectation(last, "v", em), _brute(em, lt, li)[2], atol=1e-5)


def test_a_factor_read_after_the_scan_does_not_blame_the_steps_sites():
    """Regression: the left-over dim error of a factor read off the scan's last carry also
    named every site of the step (the edge, its score, an observation) as a site "with no
    plate", whose time dim the scan gives them; only the scan's hint is said."""
    em, lt, li = _params(2)
    ys = jnp.asarray(np.random.default_rng(5).normal(size=em.shape[0]), em.dtype)

    def last(emission, ys):
        prior = si.priors.Markov(lt, li)

        def step(previous, ey):
            e, y = ey
            z = si.edge("z", prior, e, previous=previous)
            numpyro.sample("y", dist.Normal(z * 1.0, 1.0), obs=y)
            return z, None

        final, _ = scan(step, jnp.asarray(-1), (emission, ys))
        numpyro.factor("last", jnp.sin(1.0 + final))

    with pytest.raises(ValueError, match="record the value inside the scan's step") as err:
        si.log_marginal(last, em, ys)
    assert "no plate" not in str(err.value)


def test_an_empty_chain_is_refused_by_name_not_an_unbound_local_error():
    """Regression: a chain over 0 steps (an empty emission array) failed inside NumPyro's
    enumerated scan with a bare ``UnboundLocalError``: every engine now says the scan has
    no steps."""
    _, lt, li = _params()
    empty = jnp.zeros((0, K), jnp.float32)
    msg = "scan over 0 steps"
    with pytest.raises(ValueError, match=msg):
        si.log_marginal(hmm, empty, lt, li)
    with pytest.raises(ValueError, match=msg):
        si.attention(hmm, "v")(empty, lt, li)


def test_a_factor_in_a_scan_with_history_two_is_refused_by_name():
    """Regression: a `potential` in ``scan(..., history=2)`` reading the discrete site two
    steps back (a second-order factor on NumPyro's own categorical chain, no edge) gave a
    finite wrong log Z (-3.07 where brute force over the 2^5 paths gives -4.48; NumPyro's
    ``numpyro.factor`` there raises). The engine refuses a factor in a scan whose history
    is above 1, naming the site."""
    import numpyro.distributions as dist

    y = jnp.array([0.1, 1.2, 0.9, -0.3, 1.1])
    probs = jnp.array([[0.8, 0.2], [0.3, 0.7]])

    def second_order(y):
        def step(carry, yt):
            before, previous = carry
            x = numpyro.sample("x", dist.Categorical(probs[previous]),
                               infer={"enumerate": "parallel"})
            potential("again", 0.4 * (x == before))
            numpyro.sample("y", dist.Normal(x * 1.0, 0.5), obs=yt)
            return (previous, x), None

        scan(step, (jnp.asarray(0), jnp.asarray(0)), y, history=2)

    with pytest.raises(ValueError, match=r"factor site 'again'.*history=2"):
        si.log_marginal(second_order, y)


@pytest.mark.exhaustive  # (~10 s of compiles)
def test_a_chain_whose_score_depends_on_another_enumerated_site_is_exact():
    """A per-step score that reads another enumerated site (a regime c shifting every
    step's score) carries c's enumeration dim: not a batch dim the plates miss. Its log Z
    and marginals equal brute force over (c, path)."""
    T, K = 4, 3
    r = np.random.default_rng(0)
    em, lt, li, off = (jnp.asarray(r.normal(size=s), jnp.float32)
                       for s in ((T, K), (K, K), (K,), (2, K)))
    pc = np.array([0.3, 0.7])

    def model(em):
        c = numpyro.sample("c", dist.Categorical(jnp.asarray(pc)),
                           infer={"enumerate": "parallel"})
        prior = si.priors.Markov(lt, li)

        def step(prev, e):
            return si.edge("z", prior, e + off[c], previous=prev), None

        scan(step, jnp.asarray(-1), em)

    ltn, lin = np.asarray(jax.nn.log_softmax(lt, -1)), np.asarray(jax.nn.log_softmax(li))
    logw, paths = [], []
    for c in range(2):
        for p in itertools.product(range(K), repeat=T):
            s = np.log(pc[c]) + lin[p[0]] + sum(em[t, p[t]] + off[c, p[t]] for t in range(T))
            logw.append(float(s + sum(ltn[p[t - 1], p[t]] for t in range(1, T))))
            paths.append(p)
    logz = np.logaddexp.reduce(logw)
    marg = np.zeros((T, K))
    for w, p in zip(np.exp(np.array(logw) - logz), paths):
        marg[np.arange(T), p] += w
    assert float(si.log_marginal(model, em)) == pytest.approx(logz, abs=1e-4)
    np.testing.assert_allclose(si.marginals(model, em)["z"], marg, atol=1e-5)


# --- wrongly shaped steps: a score or a carry the chain cannot keep ---------------------


def _faulty_chain(score_of=lambda e: e, carry_of=lambda carry, z: z, start=None,
                  chains=None):
    """A chain whose step scores ``score_of(e)`` and returns ``carry_of(carry, z)``
    (``start`` the scan's init, ``chains`` a plate of that many chains in the step); a
    tuple carry holds the previous edge first."""
    _, lt, li = _params()
    prior = si.priors.Markov(lt, li)

    def model(emission):
        def step(carry, e):
            previous = carry[0] if isinstance(carry, tuple) else carry
            plate = numpyro.plate("chains", chains) if chains else contextlib.nullcontext()
            with plate:
                z = si.edge("z", prior, score_of(e), previous=previous)
                numpyro.deterministic("v", jnp.sin(1.0 + z))
            return carry_of(carry, z), None

        init = start if start is not None else (
            jnp.full((chains,), -1) if chains else jnp.asarray(-1))
        scan(step, init, emission)

    return model


def _every_engine_raises(model, emission, msg):
    """Eager and jit, exact and fused, and a plain seeded run (where the check can see it)."""
    runs = {
        "log_marginal": lambda: si.log_marginal(model, emission),
        "jit marginals": lambda: jax.jit(lambda e: si.marginals(model, e)["z"])(emission),
        "attention": lambda: si.attention(model, "v")(emission),
    }
    for what, run in runs.items():
        with pytest.raises((ValueError, TypeError), match=msg) as info:
            run()
        assert "edge site 'z'" in str(info.value), what


@pytest.mark.parametrize("chains, score_of, got, expected", [
    (None, lambda e: e[None], r"\(1, 3\)", r"\(3,\)"),  # a leading dim, no plate
    (2, lambda e: e[None], r"\(1, 2, 3\)", r"\(2, 3\)"),  # a leading dim outside the plate
    (2, lambda e: jnp.concatenate([e, e[:1]]), r"\(3, 3\)", r"\(2, 3\)"),  # 3 rows, 2 chains
], ids=["leading-dim", "leading-dim-under-plate", "rows-not-chains"])
def test_a_step_score_that_does_not_fit_the_plates_is_refused_naming_both_shapes(
        chains, score_of, got, expected):
    """Regression: a step's score with a leading dim no plate covers (``(1, K)`` where
    ``(K,)`` or, under a plate of B chains, ``(B, K)`` is meant) failed with JAX's bare
    "scan body function carry input and carry output must have equal types" (the edge, the
    carry, gained the dim); one with other rows than the plate's chains with a bare
    "add got incompatible shapes". Every engine, and a plain run of the model, now names
    the site, the score's shape and the one expected."""
    em = _params()[0] if chains is None else jnp.stack([_params(s)[0] for s in (0, 1)], 1)
    model = _faulty_chain(score_of, chains=chains)
    msg = rf"edge site 'z': the step's score has shape {got}, expected {expected}"
    _every_engine_raises(model, em, msg)
    with pytest.raises(ValueError, match=msg):
        numpyro.handlers.seed(model, 0)(em)


def test_a_step_score_shared_by_the_chains_of_a_plate_still_broadcasts():
    """A ``(K,)`` (or ``(1, K)``) score under a plate of 2 chains is each chain's score:
    log Z is twice the one chain's (the shape checks above leave a broadcast alone)."""
    em, lt, li = _params()
    for score_of in (lambda e: e[0], lambda e: e[:1]):
        model = _faulty_chain(score_of, chains=2)
        np.testing.assert_allclose(si.log_marginal(model, jnp.stack([em, em], 1)),
                                   2 * _forward(em, lt, li), rtol=1e-5)


@pytest.mark.parametrize("chains, carry_of, start, msg", [
    (None, lambda p, z: p + z, None,
     r"carry is not the edge's value.*such as previous \+ z"),
    (2, lambda p, z: p + z, None,
     r"carry is not the edge's value.*such as previous \+ z"),
    (None, lambda p, z: (z[None], p[1] + 1), (jnp.asarray(-1), jnp.asarray(0)),
     r"carry\[0\] has shape \(1,\) and dtype int32, but it took shape \(\) and dtype int32"),
    (None, lambda p, z: z.astype(jnp.float32), jnp.array(-1, jnp.int32),
     r"carry has shape \(\) and dtype float32, but it took shape \(\) and dtype int32"),
    (2, lambda p, z: z, jnp.asarray(-1),
     r"previous= has shape \(\), expected \(2,\)"),
], ids=["accumulating", "accumulating-under-plate", "extra-dim-in-a-tuple", "float",
        "scalar-start-under-plate"])
def test_a_carry_that_is_not_the_edge_is_refused_naming_the_site(chains, carry_of, start,
                                                                  msg):
    """Regression: a step whose carry is not the edge it drew (``previous + z``, the edge
    with an extra dim inside a tuple, the edge as a float, or a chain under a plate started
    from one scalar) failed with a bare "cannot reshape array" (NumPyro's enumerated scan)
    or JAX's "carry input and carry output must have equal types". Every engine now names
    the edge site, the carry's shape and dtype and the ones expected."""
    em = _params()[0] if chains is None else jnp.stack([_params(s)[0] for s in (0, 1)], 1)
    model = _faulty_chain(carry_of=carry_of, start=start, chains=chains)
    _every_engine_raises(model, em, msg)


def test_a_chain_started_from_a_concrete_array_runs_under_jit():
    """Regression: a chain under a plate whose start is a concrete array the model closes
    over (``jnp.full((2,), -1)`` made outside it) failed under ``jax.jit`` and in
    `si.attention` with a bare ``TracerBoolConversionError`` (the check of ``previous``
    against the states ran a traced comparison on it); now it runs, equal to the forward
    algorithm of each chain."""
    em, lt, li = _params()
    ems = jnp.stack([em, _params(1)[0]], axis=1)
    model = _faulty_chain(start=jnp.full((2,), -1), chains=2)
    ref = sum(_forward(ems[:, b], lt, li) for b in range(2))
    np.testing.assert_allclose(jax.jit(lambda e: si.log_marginal(model, e))(ems), ref,
                               rtol=1e-5)
    np.testing.assert_allclose(si.attention(model, "v")(ems), si.expectation(model, "v", ems),
                               atol=1e-5)


@pytest.mark.parametrize("chains, shared", [(None, False), (2, False), (2, True)],
                         ids=["one-chain", "per-chain", "shared-by-the-plate"])
def test_a_numpyro_factor_in_a_chains_step_is_refused_naming_it(chains, shared):
    """Regression: a ``numpyro.factor`` in a chain's step (a per-step constant, here) failed
    in NumPyro's enumerated scan with a bare ``AssertionError`` (one chain), the engine's
    left-over-dim error naming ``_pyro_dim_3`` (under a plate) or JAX's broadcasting error
    (a factor the plate expands): NumPyro's ``Unit`` loses its time dim there. The engine
    names the site and says to write it with `potential`, whose log Z is the chain's plus
    the constants."""
    em, lt, li = _params()
    if chains is not None:
        em = jnp.stack([em, _params(1)[0]], axis=1)
    c = jnp.arange(1.0, T + 1.0) if shared or chains is None else jnp.ones((T, chains))

    def with_factor(factor):
        def model(em, c):
            prior = si.priors.Markov(lt, li)

            def step(previous, x):
                e, ct = x
                with contextlib.ExitStack() as stack:
                    if chains is not None:
                        stack.enter_context(numpyro.plate("chains", chains))
                    z = si.edge("z", prior, e, previous=previous)
                    factor("const", ct)
                    numpyro.deterministic("v", jnp.sin(1.0 + z))
                return z, None

            scan(step, jnp.full(() if chains is None else (chains,), -1), (em, c))
        return model

    chain = sum(_forward(em[:, b], lt, li) for b in range(chains)) if chains else _forward(
        em, lt, li)
    np.testing.assert_allclose(si.log_marginal(with_factor(potential), em, c),
                               chain + float(jnp.sum(jnp.broadcast_to(
                                   c if chains is None or not shared else c[:, None],
                                   em.shape[:-1]))), rtol=1e-5)
    msg = r"factor site 'const'.*numpyro.factor.*scan.*potential"
    for run in (lambda: si.log_marginal(with_factor(numpyro.factor), em, c),
                lambda: si.attention(with_factor(numpyro.factor), "v")(em, c)):
        with pytest.raises(ValueError, match=msg):
            run()


def test_a_step_value_on_no_edge_is_refused_by_its_own_name():
    """Regression: the refusal of a step's value that reads no edge (here the emission's
    sum; likewise the value of a chain conditioned on its path) named the site
    ``'_PREV_w'``, NumPyro's name for the scan's unrolled first step, not ``'w'``."""
    em, lt, li = _params()

    def model(em):
        prior = si.priors.Markov(lt, li)

        def step(previous, e):
            z = si.edge("z", prior, e, previous=previous)
            numpyro.deterministic("w", jnp.sum(e))
            return z, None

        scan(step, jnp.asarray(-1), em)

    for run in (lambda: si.expectation(model, "w", em), lambda: si.attention(model, "w")(em)):
        with pytest.raises(ValueError, match=r"deterministic site 'w': .*no dims left"):
            run()


@pytest.mark.parametrize("bad", [0.0, -1.0, np.inf, np.nan])
def test_switching_dynamics_refuses_a_precision_that_is_not_positive_and_finite(bad):
    """Regression: a zero precision (an infinite variance) gave a finite log Z and
    marginals that silently ruled its mode out (log N = -inf at every step); a negative,
    infinite or NaN one failed with NumPyro's "Normal distribution got invalid scale
    parameter", naming neither the mechanism nor the argument. Each is refused naming
    `precisions`, and is NaN under jit."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 2)), jnp.float32)
    A = jnp.asarray(rng.normal(size=(2, 2, 2)), jnp.float32)
    b, lt, li = jnp.zeros((2, 2)), jnp.zeros((2, 2)), jnp.zeros(2)
    prec = jnp.ones((2, 2)).at[0, 0].set(bad)
    msd = si.mechanisms.markov_switching_dynamics
    with pytest.raises(ValueError, match="markov_switching_dynamics: precisions must be "
                       "positive and finite"):
        si.log_marginal(msd, x, A, b, prec, lt, li)
    assert np.isnan(jax.jit(lambda p: si.log_marginal(msd, x, A, b, p, lt, li))(prec))


def test_a_chain_with_a_plated_observation_falls_back_naming_the_users_sites():
    """Regression: the fallback of a chain whose observation lies under a plate in the
    step said "site '_PREV_y': its factor reads ['_PREV_z', 'obs']", NumPyro's names for
    the scan's unrolled first step; it now names 'y' and the chain's 'z'. The fallback is
    exact (the forward algorithm over the summed per-step log-densities)."""
    em, lt, li = _params()
    y = jnp.asarray(np.random.default_rng(7).normal(size=(T, 2)), jnp.float32)
    mu = jnp.arange(K, dtype=jnp.float32)

    def model(y):
        prior = si.priors.Markov(lt, li)

        def step(previous, yt):
            z = si.edge("z", prior, previous=previous)
            with numpyro.plate("obs", 2):
                numpyro.sample("y", dist.Normal(mu[z], 1.0), obs=yt)
            numpyro.deterministic("v", mu[z])
            return z, None

        scan(step, jnp.asarray(-1), y)

    expl = str(si.explain(model, "v", y))
    assert "site 'y': its factor reads ['obs', 'z']" in expl, expl
    assert "_PREV_" not in expl, expl
    emission = (-0.5 * (np.asarray(y)[:, :, None] - np.asarray(mu)) ** 2
                - 0.5 * np.log(2 * np.pi)).sum(1)
    np.testing.assert_allclose(si.log_marginal(model, y), _forward(emission, lt, li),
                               rtol=1e-5)


def hmm_scoped_step(emission, log_transition, log_initial):
    """`hmm` with the scope inside the scan's step: the step's own sites are `l1/z`,
    `l1/v`, so NumPyro's enumeration names their dims consistently."""
    prior = si.priors.Markov(log_transition, log_initial)

    def step(previous, e):
        z = si.edge("z", prior, e, previous=previous)
        numpyro.deterministic("v", jnp.sin(1.0 + z))
        return z, None

    scan(numpyro.handlers.scope(step, "l1"), jnp.asarray(-1), emission)


def test_a_scope_around_a_scan_is_refused_naming_the_site_and_the_fix():
    """Regression: `numpyro.handlers.scope(model, "l1")` around a model whose Markov chain
    is a `scan` failed inside NumPyro with `KeyError: 'z'`: the scan records its step's
    sites after the step ran, so the scope renames the site (`l1/z`) but not the
    enumeration dims NumPyro named after the step's own names (`z`, `_PREV_z`), and its
    contraction looks the site up by the dim's name. NumPyro's own `log_density` fails
    the same way; every entry point of the engine now refuses it, naming the site, the
    scope's name for it and the fix: the scope inside the step, which is collapsed as
    the unscoped chain is."""
    from numpyro.contrib.funsor import enum, log_density

    em, lt, li = _params()
    scoped = numpyro.handlers.scope(hmm, "l1")
    with pytest.raises(KeyError):  # NumPyro's own enumeration of it
        log_density(enum(scoped, first_available_dim=-1), (em, lt, li), {}, {})
    match = (r"site 'z' of a numpyro.contrib.control_flow.scan step is recorded as 'l1/z'"
             r".*scope.*scan\(numpyro.handlers.scope\(step, prefix\), init, xs\)")
    for call in (lambda: si.log_marginal(scoped, em, lt, li),
                 lambda: si.marginals(scoped, em, lt, li),
                 lambda: si.expectation(scoped, "l1/v", em, lt, li),
                 lambda: si.map_edges(scoped, em, lt, li),
                 lambda: si.inspect_model(scoped, em, lt, li),
                 lambda: jax.jit(lambda e: si.log_marginal(scoped, e, lt, li))(em)):
        with pytest.raises(ValueError, match=match):
            call()
    # the fix the message names: the scope inside the step
    ref_z, ref_marg, ref_ev = _brute(em, lt, li)
    np.testing.assert_allclose(si.log_marginal(hmm_scoped_step, em, lt, li), ref_z,
                               rtol=1e-5)
    marg = si.marginals(hmm_scoped_step, em, lt, li)
    assert set(marg) == {"l1/z"}
    np.testing.assert_allclose(marg["l1/z"], ref_marg, atol=1e-5)
    np.testing.assert_allclose(si.expectation(hmm_scoped_step, "l1/v", em, lt, li), ref_ev,
                               atol=1e-5)
    np.testing.assert_array_equal(si.map_edges(hmm_scoped_step, em, lt, li)["l1/z"],
                                  si.map_edges(hmm, em, lt, li)["z"])


# Masked steps (numpyro.handlers.mask around the edge): a masked-out step is not there, as
# a masked-out child is (tests/test_parent_masks.py): it takes its state uniformly over the
# moves its transition row allows from the previous state and adds nothing to log Z.
def _masked_hmm(emission, log_transition, log_initial, keep):
    prior = si.priors.Markov(log_transition, log_initial)

    def step(previous, xs):
        e, kept = xs
        with numpyro.plate("chains", e.shape[0]), numpyro.handlers.mask(mask=kept):
            z = si.edge("z", prior, e, previous=previous)
            numpyro.deterministic("v", jnp.sin(1.0 + z))
        return z, None

    scan(step, jnp.full(emission.shape[1], -1), (emission, keep))


def _masked_brute(em, lt, li, keep):
    """Every path of one chain, a masked step's factor uniform over its allowed moves:
    log Z and marginals (T, K)."""
    lt, li = _log_softmax(lt), _log_softmax(li)
    paths = np.array(list(itertools.product(range(K), repeat=T)))
    score = np.zeros(len(paths))
    for t in range(T):
        log_p = li[paths[:, 0]] if t == 0 else lt[paths[:, t - 1], paths[:, t]]
        if keep[t]:
            score += log_p + np.asarray(em[t], np.float64)[paths[:, t]]
        else:
            row = li[None] if t == 0 else lt[paths[:, t - 1]]
            allowed = np.isfinite(row)
            score += np.where(np.isfinite(log_p), 0.0, -np.inf) - np.log(allowed.sum(-1))
    log_z = np.logaddexp.reduce(score)
    w = np.exp(score - log_z)
    return log_z, np.stack([np.bincount(paths[:, t], weights=w, minlength=K) for t in range(T)])


def test_masked_steps_are_not_there_and_padded_chains_equal_their_unpadded_sequences():
    """Regression guard: a chain with a masked first or middle step (forbidden moves in its
    transition matrix) against every path; and variable-length chains padded at their
    end (the usual batch) against each chain alone (forward-backward), under jit, on the
    exact engine and the fused kernel."""
    rng = np.random.default_rng(21)
    i, j = np.arange(K)[:, None], np.arange(K)[None, :]
    lt = jnp.asarray(np.where(j >= i, rng.normal(size=(K, K)), -np.inf), jnp.float32)
    li = jnp.asarray([0.0, 0.5, -np.inf], jnp.float32)
    em = jnp.asarray(rng.normal(size=(T, 2, K)), jnp.float32)
    keep = jnp.asarray(np.array([[True, False], [True, True], [False, True], [True, True],
                                 [True, True]]))  # chain 0: step 2 masked; chain 1: step 0
    log_z = si.log_marginal(_masked_hmm, em, lt, li, keep)
    marg = si.marginals(_masked_hmm, em, lt, li, keep)["z"]
    want = [_masked_brute(em[:, b], lt, li, np.asarray(keep[:, b])) for b in range(2)]
    np.testing.assert_allclose(log_z, want[0][0] + want[1][0], rtol=1e-5)
    for b in range(2):
        np.testing.assert_allclose(marg[:, b], want[b][1], atol=1e-5)

    _, lt, li = _params(3)
    keep = jnp.asarray(np.arange(T)[:, None] < np.asarray([T, 3]))  # chain 1: 3 steps

    @jax.jit  # (eager above)
    def run(*a):
        return (si.log_marginal(_masked_hmm, *a), si.marginals(_masked_hmm, *a)["z"],
                si.expectation(_masked_hmm, "v", *a), si.attention(_masked_hmm, "v")(*a))

    log_z, marg, expect, y = run(em, lt, li, keep)
    full = _brute(em[:, 0], lt, li)
    short_marg, short_z = _forward_backward(*_hmm_factors(em[:3, 1], lt, li))
    np.testing.assert_allclose(log_z, full[0] + short_z, rtol=1e-5)
    np.testing.assert_allclose(marg[:, 0], full[1], atol=1e-5)
    np.testing.assert_allclose(expect[:, 0], full[2], atol=1e-5)
    np.testing.assert_allclose(marg[:3, 1], short_marg, atol=1e-5)
    np.testing.assert_allclose(marg[3:, 1], 1 / K, atol=1e-6)  # not there
    np.testing.assert_allclose(expect[:3, 1], short_marg @ np.sin(1.0 + np.arange(K)), atol=1e-5)
    np.testing.assert_allclose(y, expect, atol=1e-5)  # (a plate: the exact engine)

    def chain(emission, keep):  # one chain: the fused kernel, vmapped over the chains
        prior = si.priors.Markov(lt, li)

        def step(previous, xs):
            e, kept = xs
            with numpyro.handlers.mask(mask=kept):
                z = si.edge("z", prior, e, previous=previous)
            numpyro.deterministic("v", jnp.sin(1.0 + z))
            return z, None

        scan(step, jnp.asarray(-1), (emission, keep))

    keep = keep.at[1, 0].set(False)  # and a masked middle step
    assert si.explain(chain, "v", em[:, 0], keep[:, 0]).kernels == {"z": "markov_scan"}
    y = jax.vmap(si.attention(chain, "v"), in_axes=1, out_axes=1)(em, keep)
    np.testing.assert_allclose(y, run(em, lt, li, keep)[2], atol=1e-5)


@pytest.mark.parametrize("children", [pytest.param(2, marks=pytest.mark.exhaustive), 3])
def test_an_edge_before_a_scan_with_a_plate_in_its_step(children):
    """Regression: NumPyro's enumerated ``scan`` names each step site's time dim from the
    dims allocated so far, so an edge site declared before the scan, enumerated at that
    dim, lent the time dim its name: the contraction summed the time steps against the
    edge. With 2 children the model failed in funsor (``Output mismatch: Bint[2] vs
    Bint[3]``); with 3 it gave a finite wrong log Z (-13.5 for -19.3). The edge and the
    scanned observations are independent: log Z is their sum, by hand."""
    V = jnp.array([-1.0, 0.0, 1.0])
    y = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
    y2 = jax.random.normal(jax.random.PRNGKey(2), (children,))

    def model(y):
        with numpyro.plate("kids2", children):
            j = si.edge("psi", si.priors.Uniform(3))
            numpyro.sample("o2", dist.Normal(V[j], 1.0), obs=y2)

        def step(carry, yt):
            with numpyro.plate("kids", yt.shape[0]):
                numpyro.sample("o", dist.Normal(0.0, 1.0), obs=yt)
            return carry, None

        scan(step, 0.0, y)

    norm = jax.scipy.stats.norm
    ref = norm.logpdf(y).sum() + jax.nn.logsumexp(
        norm.logpdf(y2[:, None], V) - jnp.log(3), -1).sum()
    np.testing.assert_allclose(si.log_marginal(model, y), ref, rtol=1e-5)
