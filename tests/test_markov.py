"""Markov edges: a chain of edges in a ``scan``, collapsed exactly.

Independent references written here: a NumPy forward algorithm and Viterbi, and brute
force over every path (``itertools.product``) on a short chain. Sizes: T = 5 steps,
K = 3 states, a batch of 2 (distinct primes).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import float64
from numpyro.contrib.control_flow import scan

import structinfer as si

T, K = 5, 3


def hmm(emission, log_transition, log_initial):
    """An HMM over edges: the emission log-potentials are the edge's score."""
    prior = si.priors.Markov(log_transition, log_initial)

    def step(previous, e):
        z = si.edge("z", prior, e, previous=previous)
        numpyro.deterministic("v", jnp.sin(1.0 + z))
        return z, None

    scan(step, jnp.asarray(-1), emission)


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


def test_explain_says_the_chain_runs_on_the_exact_engine():
    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(rng.normal(size=s)) for s in ((5, 2), (3, 2), (3, 7)))
    text = str(si.explain(si.mechanisms.monotonic_alignment, "out", q, k, v))
    assert "exact engine" in text and "Markov prior" in text and "'align'" in text


def test_chains_under_a_plate_are_independent():
    """A plate inside the scan: B chains at once, each as if alone."""
    em, lt, li = _params()
    ems = jnp.stack([em, _params(1)[0]], axis=1)  # (T, B = 2, K)

    def batched(ems):
        prior = si.priors.Markov(lt, li)

        def step(previous, e):
            with numpyro.plate("chains", 2):
                return si.edge("z", prior, e, previous=previous), None

        scan(step, jnp.full((2,), -1), ems)

    lz, marg = jax.jit(lambda e: (si.log_marginal(batched, e), si.marginals(batched, e)["z"]))(ems)
    assert marg.shape == (T, 2, K)
    np.testing.assert_allclose(lz, sum(_forward(ems[:, b], lt, li) for b in range(2)), rtol=1e-5)
    for b in range(2):
        np.testing.assert_allclose(marg[:, b], _brute(ems[:, b], lt, li)[1], atol=1e-5)


def test_markov_switching_em_counts_and_ascent():
    """The E-step's expected transitions match brute force; EM steps never lower log p."""
    from structinfer.infer import em_markov_switching as em

    rng = np.random.default_rng(10)
    x = jnp.asarray(np.cumsum(rng.normal(size=(6, 1)), 0))  # T = 6: 5 modes, 4 moves
    a = jnp.asarray([[[0.9]], [[-0.4]]])
    b = jnp.asarray([[0.3], [-0.3]])
    prec = jnp.asarray([[2.0], [0.7]])
    lt = jnp.asarray([[1.0, -1.0], [0.2, 0.5]])
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
