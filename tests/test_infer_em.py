"""EM on log-sum-exp energies (Tschantz) against plain EM loops written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_run_is_iterated_step, iterate_steps, lowered_programs, matrix
from scipy.stats import multivariate_normal

import structinfer as si
from structinfer.infer import (
    em_energy,
    em_gmm,
    em_linear_mixture,
    em_markov_switching,
    em_slot,
    energy_em,
    expand,
    gmm_em,
    linear_mixture_em,
    markov_switching_em,
    slot_m_step,
)

D = 2


def gmm_data(seed=0, n_per=(31, 37, 41)):
    r = np.random.default_rng(seed)
    centres = np.array([[0.0, 0.0], [5.0, 1.0], [1.0, 6.0]])
    x = np.concatenate([c + r.normal(size=(n, D)) * s for c, n, s in
                        zip(centres, n_per, (0.7, 1.0, 0.5))])
    return x, centres


def plain_gmm_em(x, means, covs, w, iters):
    lls = []
    for _ in range(iters + 1):
        dens = np.stack([w[k] * multivariate_normal(means[k], covs[k]).pdf(x)
                         for k in range(len(w))], 1)
        lls.append(np.log(dens.sum(1)).sum())
        r = dens / dens.sum(1, keepdims=True)
        nk = r.sum(0)
        w = nk / len(x)
        means = (r.T @ x) / nk[:, None]
        covs = np.stack([(r[:, k, None] * (x - means[k])).T @ (x - means[k]) / nk[k]
                         for k in range(len(w))])
    return lls


def test_gmm_em_matches_plain_em_and_never_decreases(x64):
    x, _ = gmm_data()
    r = np.random.default_rng(1)
    means0 = x[r.choice(len(x), 3, replace=False)]
    covs0 = np.stack([np.eye(D)] * 3)
    run = jax.jit(lambda x, m, c: gmm_em(x, m, c, max_iters=40, tol=1e-12))
    st, info = run(x, means0, covs0)
    lls = plain_gmm_em(x, means0, covs0, np.full(3, 1 / 3), 10)
    np.testing.assert_allclose(-np.asarray(info.energy[:11]), lls, rtol=1e-10)
    e = np.asarray(info.energy[: int(info.num_steps) + 1])
    assert np.all(np.diff(e) <= 1e-9 * np.abs(e).max())
    np.testing.assert_allclose(st.responsibilities.sum(1), 1.0, atol=1e-12)
    # run is em_gmm.step iterated from em_gmm.init until its convergence rule
    ref = iterate_steps(jax.jit(em_gmm.init)(x, means0, covs0),
                        lambda s: em_gmm.step(x, s, tol=1e-12), lambda s: -s.log_likelihood, 40)
    assert_run_is_iterated_step((st, info), ref)


def test_gmm_em_is_scikit_learns_em_from_the_same_start(x64):
    """Means, full covariances, weights and log-likelihood after 6 iterations against
    scikit-learn's GaussianMixture started at the same parameters (unequal weights and
    covariances, no ridge on either side)."""
    from sklearn.mixture import GaussianMixture

    x, centres = gmm_data()
    covs0 = np.stack([np.eye(D) * s for s in (0.5, 1.0, 2.0)])
    w0 = np.array([0.5, 0.3, 0.2])
    st, info = gmm_em(x, centres + 0.5, covs0, w0, max_iters=6, tol=0.0)
    assert int(info.num_steps) == 6 and bool(info.max_iters_reached)
    gm = GaussianMixture(3, covariance_type="full", reg_covar=0.0, max_iter=6, tol=0.0,
                         weights_init=w0, means_init=centres + 0.5,
                         precisions_init=np.linalg.inv(covs0), init_params="random")
    with pytest.warns(UserWarning):  # "did not converge": the same 6 iterations
        gm.fit(x)
    np.testing.assert_allclose(st.means, gm.means_, rtol=1e-10)
    np.testing.assert_allclose(st.covariances, gm.covariances_, rtol=1e-10)
    np.testing.assert_allclose(st.weights, gm.weights_, rtol=1e-10)
    np.testing.assert_allclose(st.log_likelihood, gm.score(x) * len(x), rtol=1e-10)


def test_linear_mixture_recovers_modes(x64):
    r = np.random.default_rng(2)
    T, K = 211, 2
    A = np.array([[[0.9, -0.2], [0.1, 0.5]], [[-0.5, 0.3], [0.4, -0.8]]])
    b = np.array([[1.0, -1.0], [-2.0, 2.0]])
    sd = np.array([0.1, 0.2])
    u = r.normal(size=(T, D))
    z = r.integers(0, K, T)
    y = np.einsum("tij,tj->ti", A[z], u) + b[z] + sd[z, None] * r.normal(size=(T, D))
    A0 = A + 0.3 * r.normal(size=A.shape)
    b0 = b + 0.5 * r.normal(size=b.shape)
    covs0 = np.stack([np.eye(D)] * K)
    st, info = jax.jit(lambda u, y: linear_mixture_em(u, y, A0, b0, covs0, max_iters=60,
                                                      tol=1e-12))(u, y)
    e = np.asarray(info.energy[: int(info.num_steps) + 1])
    assert np.all(np.diff(e) <= 1e-9 * np.abs(e).max())
    ref = iterate_steps(jax.jit(em_linear_mixture.init)(u, y, A0, b0, covs0),
                        lambda s: em_linear_mixture.step(u, y, s, tol=1e-12),
                        lambda s: -s.log_likelihood, 60)
    assert_run_is_iterated_step((st, info), ref)
    np.testing.assert_allclose(st.A, A, atol=0.05)
    np.testing.assert_allclose(st.b, b, atol=0.05)
    np.testing.assert_allclose(np.sqrt(np.diagonal(st.covariances, axis1=1, axis2=2)),
                               sd[:, None].repeat(2, 1), rtol=0.25)
    # the M-step is the weighted least-squares solution (plain lstsq per mode)
    R = np.asarray(st.responsibilities)
    ut = np.concatenate([u, np.ones((T, 1))], 1)
    A_prev = np.asarray(st.A)
    for k in range(K):
        sw = np.sqrt(R[:, k])[:, None]
        sol = np.linalg.lstsq(sw * ut, sw * y, rcond=None)[0].T
        np.testing.assert_allclose(sol[:, :2], A_prev[k], atol=1e-6)


def test_linear_mixture_e_step_model_is_the_regression_mixture_likelihood(x64):
    """The E-step's model (the catalogue's switching_linear_dynamics with pairs and the
    normaliser) against scipy: log Z = sum_t log sum_k w_k N(y_t; A_k u_t + b_k, S_k) and
    the edge marginals are the responsibilities; full and diagonal precisions."""
    r = np.random.default_rng(9)
    T, K, du, dy = 11, 3, 5, 2
    u, y = r.normal(size=(T, du)), r.normal(size=(T, dy))
    A, b = r.normal(size=(K, dy, du)), r.normal(size=(K, dy))
    L = r.normal(size=(K, dy, dy))
    covs = L @ np.swapaxes(L, 1, 2) + np.eye(dy)
    w = np.array([0.2, 0.5, 0.3])
    diag = np.diagonal(covs, axis1=1, axis2=2)

    @jax.jit
    def engine(p):
        args = (si.mechanisms.switching_linear_dynamics, u, A, b, p, jnp.log(w))
        kw = dict(targets=y, normalize=True)
        return si.log_marginal(*args, **kw), si.marginals(*args, **kw)["mode"]

    for cov, prec in ((covs, np.linalg.inv(covs)), (diag[..., None] * np.eye(dy), 1 / diag)):
        dens = np.array([[w[k] * multivariate_normal(A[k] @ u[t] + b[k], cov[k]).pdf(y[t])
                          for k in range(K)] for t in range(T)])
        log_z, resp = engine(prec)
        np.testing.assert_allclose(log_z, np.log(dens.sum(1)).sum(), rtol=1e-12)
        np.testing.assert_allclose(resp, dens / dens.sum(1, keepdims=True), atol=1e-12)


def test_slot_m_step_is_weighted_least_squares(x64):
    r = np.random.default_rng(3)
    n, S, dx, dm, dk = 13, 3, 5, 2, 2
    x, mu = r.normal(size=(n, dx)), r.normal(size=(S, dm))
    A = r.dirichlet(np.ones(S), size=n)
    wk, wq = r.normal(size=(dk, dx)), r.normal(size=(dk, dm))

    def objective(wk, wq):
        diff = (x @ wk.T)[:, None, :] - (mu @ wq.T)[None, :, :]
        return np.sum(A[..., None] * diff**2)

    wk1, wq1 = slot_m_step(x, mu, A, wk, wq, whiten=False)
    # W_Q solve: rows of W_Q mu_i regress W_K x_j with weights A_ji (plain lstsq)
    rows = [(j, i) for j in range(n) for i in range(S)]
    sw = np.sqrt([A[j, i] for j, i in rows])[:, None]
    wq_ref = np.linalg.lstsq(sw * mu[[i for _, i in rows]],
                             sw * (x @ wk.T)[[j for j, _ in rows]], rcond=None)[0].T
    np.testing.assert_allclose(wq1, wq_ref, atol=1e-10)
    wk_ref = np.linalg.lstsq(sw * x[[j for j, _ in rows]],
                             sw * (mu @ wq_ref.T)[[i for _, i in rows]], rcond=None)[0].T
    np.testing.assert_allclose(wk1, wk_ref, atol=1e-10)
    assert objective(wk1, wq1) <= objective(wk, wq_ref) <= objective(wk, wq)
    # whitened: W_K C_xx W_K^T = I
    wk2, _ = slot_m_step(x, mu, A, wk, wq, whiten=True)
    cxx = np.einsum("js,ja,jb->ab", A, x, x) / A.sum()
    np.testing.assert_allclose(wk2 @ cxx @ wk2.T, np.eye(dk), atol=1e-10)


@pytest.mark.exhaustive  # (~6 s; tests/test_slot_em.py runs slot EM by default)
def test_slot_em_runs_and_reports():
    r = np.random.default_rng(4)
    x = np.concatenate([r.normal(size=(7, 3)) + 3, r.normal(size=(7, 3)) - 3]).astype(np.float32)
    slots0, eye = 0.1 * jnp.ones((2, 3)) + jnp.eye(2, 3), jnp.eye(3)
    st, info = jax.jit(lambda x: si.infer.slot_em(x, slots0, eye, eye, e_iters=5,
                                                  max_iters=3))(x)
    assert info.energy.shape == (4,) and np.all(np.isfinite(info.energy[: int(info.num_steps) + 1]))
    np.testing.assert_allclose(st.attention.sum(1), 1.0, atol=1e-5)
    # run is em_slot.step iterated from em_slot.init until its convergence rule
    init = jax.jit(lambda x: em_slot.init(x, slots0, eye, eye, e_iters=5))
    ref = iterate_steps(init(x), lambda s: em_slot.step(x, s, e_iters=5), lambda s: s.energy, 3)
    assert_run_is_iterated_step((st, info), ref, rtol=1e-4)


def test_energy_em_reaches_the_gmm_maximum_likelihood(x64):
    """General scheme: latents = component means (E-step by gradient descent), params = a
    shared log-precision and mixing logits (M-step by gradient steps). At convergence it
    satisfies the same stationarity as closed-form EM with a shared spherical variance."""
    x, _ = gmm_data(5, (23, 29, 31))
    n = len(x)

    def energy(means, theta):
        prec = jnp.exp(theta["log_prec"])
        return -si.log_marginal(si.mechanisms.gaussian_mixture, x, means,
                                jnp.broadcast_to(prec * jnp.eye(D), (3, D, D)),
                                jax.nn.log_softmax(theta["logits"]), normalize=True)

    r = np.random.default_rng(6)
    means0 = x[r.choice(n, 3, replace=False)]
    theta0 = {"log_prec": jnp.array(0.0), "logits": jnp.zeros(3)}
    st, info = jax.jit(lambda m, t: energy_em(energy, m, t, e_step_size=0.01, e_iters=200,
                                              m_step_size=0.005, max_iters=400, tol=1e-13))(
        means0, theta0)
    e = np.asarray(info.energy[: int(info.num_steps) + 1])
    assert e[-1] < e[0] - 10
    # plain stationarity check with the final responsibilities
    means, prec = np.asarray(st.latents), float(np.exp(st.params["log_prec"]))
    w = np.asarray(jax.nn.softmax(st.params["logits"]))
    dens = np.stack([w[k] * multivariate_normal(means[k], np.eye(D) / prec).pdf(x)
                     for k in range(3)], 1)
    R = dens / dens.sum(1, keepdims=True)
    np.testing.assert_allclose(means, (R.T @ x) / R.sum(0)[:, None], atol=2e-3)
    np.testing.assert_allclose(w, R.mean(0), atol=2e-3)
    var = np.sum(R * ((x[:, None, :] - means[None]) ** 2).sum(-1)) / (n * D)
    np.testing.assert_allclose(1 / prec, var, rtol=2e-2)


def test_model_expansion_finds_the_missing_component(x64):
    x, centres = gmm_data(7)
    r = np.random.default_rng(8)
    x = x[r.permutation(len(x))]
    kmax = 5
    means = np.zeros((kmax, D))
    means[:2] = centres[:2]  # the model lacks the third component
    active = np.array([True, True, False, False, False])
    var = 1.0

    def sim(child, means):  # log N(x; mu_k, var I) with equal weights
        return -0.5 * jnp.sum((child - means) ** 2, -1) / var - D / 2 * jnp.log(2 * jnp.pi * var)

    # tau: the energy of a point at 4 standard deviations from its component
    tau = 0.5 * 16 + D / 2 * np.log(2 * np.pi * var)
    res = jax.jit(lambda x, m, a: expand(x, m, a, sim, tau))(x, means, active)
    assert int(np.sum(res.active)) == 3 and not bool(res.overflow)
    new = int(np.flatnonzero(res.active)[-1])
    assert np.linalg.norm(np.asarray(res.parents)[new] - centres[2]) < 3.0
    first = int(np.flatnonzero(res.added)[0])
    assert res.energies[first] > tau
    # refine the expanded mixture by EM: all three centres are recovered
    act = np.asarray(res.active)
    w = act / act.sum()
    st, _ = jax.jit(lambda p, w: gmm_em(x, p, np.stack([np.eye(D)] * kmax), w, max_iters=50,
                                        reg=1e-6))(res.parents, w)
    found = np.asarray(st.means)[act]
    for c in centres:
        assert np.min(np.linalg.norm(found - c, axis=1)) < 0.4


def test_expand_refuses_a_sim_fn_of_another_shape():
    """Regression: a sim_fn returning (K_max, 1) broadcast against `active` to
    (K_max, K_max): the log-sum-exp ran over inactive placeholders too, a finite wrong
    energy. Its shape is checked (statically: under jit too), naming sim_fn."""
    parents = jnp.array([[0.0, 0.0], [5.0, 5.0], [0.1, 0.1], [0.0, 0.0]])
    active = jnp.array([True, True, False, False])
    children = jnp.array([[0.05, 0.05], [3.0, 3.0]])
    good = lambda c, z: -0.5 * jnp.sum((z - c) ** 2, -1)  # noqa: E731
    bad = lambda c, z: -0.5 * jnp.sum((z - c) ** 2, -1, keepdims=True)  # noqa: E731
    for run in (expand, jax.jit(expand, static_argnums=(3, 4))):
        with pytest.raises(ValueError, match=r"expand: sim_fn must return .* shape \(4,\) "
                           r"\(that of `active`\), got shape \(4, 1\)"):
            run(children, parents, active, bad, 2.0)
    res = expand(children, parents, active, good, tau=2.0)
    ref = [-jax.nn.logsumexp(good(c, parents[:2])) for c in children]
    np.testing.assert_allclose(res.energies, ref, rtol=1e-6)
    with pytest.raises(ValueError, match=r"expand: active must be \(K_max,\)"):
        jax.jit(lambda a: expand(children, parents, a, good, 2.0))(active[None])


def test_expand_names_a_nan_or_non_numeric_tau():
    """Regression: a NaN tau compared False with every energy: no child was ever added (an
    unexplained child with energy inf stayed so), with no error. Now it is a ValueError
    naming tau (under jit, the energies are NaN); a string is a TypeError naming tau (was
    JAX's bare one)."""
    parents, active = jnp.zeros((2, 2)), jnp.zeros(2, bool)
    children = jnp.array([[0.0, 0.0], [3.0, 3.0]])
    sim = lambda c, z: -0.5 * jnp.sum((z - c) ** 2, -1)  # noqa: E731
    with pytest.raises(ValueError, match="expand: tau must not be NaN"):
        expand(children, parents, active, sim, float("nan"))
    with pytest.raises(TypeError, match="expand: tau"):
        expand(children, parents, active, sim, "1")
    res = jax.jit(lambda t: expand(children, parents, active, sim, t))(jnp.nan)
    assert np.isnan(np.asarray(res.energies)).all() and np.isnan(np.asarray(res.parents)).all()
    # and the gradient of a child's energy in that child (a `where` on the energy alone
    # gave finite zeros)
    one = jnp.array([True, False])  # one active parent: the energies depend on the child
    g = jax.jit(jax.grad(lambda c: expand(c, parents, one, sim, jnp.nan).energies[1]))(
        children)
    assert np.isnan(np.asarray(g[1])).all()
    with pytest.raises(ValueError, match="expand_components: tau must not be NaN"):
        si.mechanisms.expand_components(children[0], parents, active, float("nan"))
    e = jax.jit(lambda t: si.mechanisms.expand_components(children[0], parents, active, t))(
        jnp.nan)[2]
    assert np.isnan(np.asarray(e)).all()
    comps = jax.jit(lambda t: si.mechanisms.expand_components(children[0], parents, active, t))(
        jnp.nan)[0]
    assert np.isnan(np.asarray(comps)).all()
    # a vector tau (one threshold per child?) failed inside lax.scan with JAX's bare
    # error, or broadcast in expand_components; now both name tau, traced too
    for bad in (jnp.ones(2), jnp.ones((1,))):
        with pytest.raises(ValueError, match=r"expand: tau must be a scalar.*shape \("):
            jax.jit(lambda t: expand(children, parents, active, sim, t))(bad)
        with pytest.raises(ValueError, match=r"expand_components: tau must be a scalar"):
            si.mechanisms.expand_components(children[0], parents, active, bad)
    for tau, added in ((2.0, [True, True]), (np.inf, [False, False])):
        res = jax.jit(lambda t: expand(children, parents, active, sim, t))(tau)
        assert np.asarray(res.added).tolist() == added
        assert not np.isnan(np.asarray(res.energies)).any()
        assert not np.isnan(np.asarray(res.parents)).any()


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="gmm_em: x .* means .* covariances"):
        gmm_em(np.zeros((5, 2)), np.zeros((3, 3)), np.zeros((3, 3, 3)))
    x, m, c = np.zeros((5, 2)), np.zeros((3, 2)), np.stack([np.eye(2)] * 3)
    with pytest.raises(ValueError, match=r"gmm_em: weights of shape \(2,\), expected \(3,\)"):
        gmm_em(x, m, c, np.full(2, 0.5))
    for bad in ([-0.5, 1.0, 0.5], [0.2, 0.2, 0.2]):  # negative; not summing to 1
        with pytest.raises(ValueError, match="gmm_em: weights .* non-negative and sum to 1"):
            gmm_em(x, m, c, np.asarray(bad))
    with pytest.raises(ValueError, match="linear_mixture_em"):
        linear_mixture_em(np.zeros((5, 2)), np.zeros((5, 2)), np.zeros((2, 2, 3)),
                          np.zeros((2, 2)), np.zeros((2, 2, 2)))


def test_energy_em_surfaces_a_failed_e_step():
    """Regression: the E-step's gradient descent ran with raise_on_nonfinite=False and
    handed back its last finite point with a finite energy when it diverged, so the run
    reported converged=True, nonfinite=False at latents that are not a minimum of E. A
    diverged E-step is now a non-finite energy at that step."""
    def quartic(v, th):  # min over v at v = 0; a step of 1e10 overflows at once
        return jnp.sum(v**4) + jnp.sum((th - 1.0) ** 2)

    v0, th0 = jnp.array([1.0]), jnp.array([0.0])
    kw = dict(e_step_size=1e10, m_step_size=0.4, max_iters=200)
    assert not np.isfinite(float(em_energy.init(quartic, v0, th0, e_step_size=1e10).energy))
    with pytest.raises(si.infer.NonFiniteEnergyError, match="energy_em: .* initial state.*"
                       "E-step.*e_step_size") as err:
        energy_em(quartic, v0, th0, **kw)
    assert err.value.step == 0
    _, info = energy_em(quartic, v0, th0, raise_on_nonfinite=False, **kw)
    assert bool(info.nonfinite) and not bool(info.converged)

    def stiff(v, th):  # the E-step's descent is stable while exp(th) * e_step_size < 1
        return jnp.sum(jnp.exp(th) * v**2) + jnp.sum((th - 3.0) ** 2)

    kw = dict(e_step_size=0.3, m_step_size=0.4, max_iters=50)
    with pytest.raises(si.infer.NonFiniteEnergyError, match="energy_em: .* step 1;.*"
                       "E-step.*e_step_size") as err:
        energy_em(stiff, v0, th0, **kw)
    assert err.value.step == 1
    st, info = energy_em(stiff, v0, th0, raise_on_nonfinite=False, **kw)
    assert bool(info.nonfinite) and int(info.num_steps) == 1
    assert not np.isfinite(float(info.energy[1]))
    # the state returned is the first E-step's (the last finite one): v near 0, theta = 0
    assert abs(float(st.latents[0])) < 1e-5 and float(st.params[0]) == 0.0
    # one step by hand shows the same
    s0 = em_energy.init(stiff, v0, th0, e_step_size=0.3)
    s1, _ = em_energy.step(stiff, s0, e_step_size=0.3, m_step_size=0.4)
    assert np.isfinite(float(s0.energy)) and not np.isfinite(float(s1.energy))


def test_energy_em_names_an_m_step_that_leaves_e_non_finite():
    """A non-finite E at the new parameters (before any E-step descent) is the M-step's."""
    def log_barrier(v, th):  # finite for th < 1 only; the M-step jumps past it
        return jnp.sum(v**2) - jnp.sum(jnp.log1p(-th)) - jnp.sum(10.0 * th)

    with pytest.raises(si.infer.NonFiniteEnergyError, match="energy_em: .* step 1;.*"
                       "M-step.*m_step_size"):
        energy_em(log_barrier, jnp.array([1.0]), jnp.array([0.5]), m_step_size=1.0)


def dead_mode_data(seed=0, T=41):
    """Two-mode data where mode 1 starts far from every target: it gets no data."""
    r = np.random.default_rng(seed)
    u = r.normal(size=(T, D))
    y = 0.9 * u + 0.1 * r.normal(size=(T, D))
    A0 = np.stack([np.eye(D), np.eye(D)])
    b0 = np.array([[0.0, 0.0], [1e3, 1e3]])
    return u, y, A0, b0, np.stack([np.eye(D)] * 2)


@pytest.mark.parametrize("reg", [0.0, 1e-3])
def test_linear_mixture_em_keeps_a_dead_mode_off(x64, reg):
    """Regression: a mode with no data made the weighted least squares 0/0 (NaN) and the
    run raised "a mode lost its data? set reg > 0", although reg never reached the least
    squares. As in gmm_em, such a mode now keeps its parameters at weight 0, and the
    others are fitted as without it."""
    u, y, A0, b0, C0 = dead_mode_data()
    st, info = linear_mixture_em(u, y, A0, b0, C0, reg=reg, tol=1e-12)
    assert bool(info.converged)
    assert float(st.weights[1]) == 0.0 and np.all(np.asarray(st.responsibilities)[:, 1] == 0)
    np.testing.assert_array_equal(st.A[1], A0[1])
    np.testing.assert_array_equal(st.b[1], b0[1])
    np.testing.assert_array_equal(st.covariances[1], C0[1])
    one, _ = linear_mixture_em(u, y, A0[:1], b0[:1], C0[:1], reg=reg, tol=1e-12)
    np.testing.assert_allclose(st.log_likelihood, one.log_likelihood, rtol=1e-10)
    for a, b in ((st.A, one.A), (st.b, one.b), (st.covariances, one.covariances)):
        np.testing.assert_allclose(np.asarray(a)[0], np.asarray(b)[0], rtol=1e-8, atol=1e-12)
    e = np.asarray(info.energy[: int(info.num_steps) + 1])
    assert np.all(np.isfinite(e))


def test_linear_mixture_em_reg_regularises_the_least_squares(x64):
    """A mode with data at a single target has a singular least-squares Gram matrix: with
    reg = 0 the step is not finite, with reg > 0 (the ridge the message asks for) it is
    the ridge regression."""
    u, y, A0, b0, C0 = dead_mode_data()
    st = em_linear_mixture.init(u, y, A0, b0 * 0, C0)
    resp = np.zeros((len(u), 2))
    resp[:, 0], resp[3] = 1.0, [0.0, 1.0]  # mode 1 owns target 3 alone
    st = st._replace(responsibilities=jnp.asarray(resp))
    step = jax.jit(lambda st, reg: em_linear_mixture.step(u, y, st, reg=reg))
    new, _ = step(st, 0.0)
    assert not np.isfinite(float(new.log_likelihood))
    reg = 1e-2
    new, _ = step(st, reg)
    assert np.isfinite(float(new.log_likelihood))
    ut = np.concatenate([u, np.ones((len(u), 1))], 1)[3:4]
    ridge = np.linalg.solve(ut.T @ ut + reg * np.eye(D + 1), ut.T @ y[3:4]).T
    np.testing.assert_allclose(new.A[1], ridge[:, :D], rtol=1e-10)
    np.testing.assert_allclose(new.b[1], ridge[:, D], rtol=1e-10)
    # a single target: the message's advice works
    with pytest.raises(si.infer.NonFiniteEnergyError, match="linear_mixture_em: .*set reg > 0"):
        linear_mixture_em(u[:1], y[:1], A0, b0 * 0, C0)
    _, info = linear_mixture_em(u[:1], y[:1], A0, b0 * 0, C0, reg=reg)
    assert not bool(info.nonfinite)


@pytest.mark.exhaustive  # (~12 s; the default tier keeps the linear mixture's dead mode off)
def test_markov_switching_em_keeps_a_dead_mode_off(x64):
    """Regression: a mode with no data made the M-step's variance 0/0 (NaN) whatever the
    ridge; it now keeps its parameters (and its row of the transition matrix)."""
    r = np.random.default_rng(1)
    x = np.cumsum(0.1 * r.normal(size=(43, D)), 0)
    A0, b0 = np.stack([np.eye(D)] * 2), np.array([[0.0, 0.0], [1e3, 1e3]])
    p0 = np.ones((2, D))
    st, info = markov_switching_em(x, A0, b0, p0, tol=1e-12)
    with lowered_programs() as compiles:  # (the same shapes again: nothing to compile)
        again, _ = markov_switching_em(x + 1.0, A0, b0 + 1.0, p0, tol=1e-12)
    assert not compiles and np.all(np.asarray(again.responsibilities)[:, 1] == 0)
    assert bool(info.converged)
    assert np.all(np.asarray(st.responsibilities)[:, 1] == 0)
    np.testing.assert_array_equal(st.A[1], A0[1])
    np.testing.assert_array_equal(st.b[1], b0[1])
    np.testing.assert_array_equal(st.precisions[1], p0[1])
    np.testing.assert_allclose(st.log_transition[1], np.log([0.5, 0.5]))  # never left
    # never entered: a zero count, log P = -inf (exact Baum-Welch), which the next E-step
    # contracts exactly (no NaN)
    np.testing.assert_array_equal(st.log_transition[0], [0.0, -np.inf])
    one, _ = markov_switching_em(x, A0[:1], b0[:1], p0[:1], tol=1e-12)
    np.testing.assert_allclose(st.log_likelihood, one.log_likelihood, rtol=1e-10)
    np.testing.assert_allclose(st.A[0], one.A[0], rtol=1e-8, atol=1e-12)


def _reg_runs():
    r = np.random.default_rng(0)
    x = r.normal(size=(23, D))
    c2, c3 = np.stack([np.eye(D)] * 2), np.stack([np.eye(D)] * 3)
    return x, c3, {
        "gmm_em": lambda reg: gmm_em(x, x[:3], c3, reg=reg),
        "linear_mixture_em": lambda reg: linear_mixture_em(x[:-1], x[1:], c2, np.zeros((2, D)),
                                                           c2, reg=reg),
        "markov_switching_em": lambda reg: markov_switching_em(x, c2, np.zeros((2, D)),
                                                               np.ones((2, D)), reg=reg),
    }


def test_em_refuses_a_negative_reg():
    """Regression: gmm_em(reg=-10) made every covariance negative definite, its energy
    went up and the run reported converged=True. A negative ridge is refused."""
    x, c3, runs = _reg_runs()
    for name, fn in runs.items():
        for bad in (-10.0, np.float32(-1e-3), np.nan):
            with pytest.raises(ValueError, match=f"{name}: reg must be a non-negative"):
                fn(bad)
    st = em_gmm.init(x, x[:3], c3)
    with pytest.raises(ValueError, match="gmm_em: reg must be a non-negative"):
        em_gmm.step(x, st, reg=-1.0)


# (each compiles a whole EM loop: gmm_em by default, the others exhaustive)
@pytest.mark.parametrize("name", matrix(["gmm_em", "linear_mixture_em", "markov_switching_em"],
                                        lambda name: name == "gmm_em"))
def test_a_negative_reg_under_jit_stops_on_a_nan_energy(name):
    """Under jit, where a negative ridge cannot be checked, the energy is NaN and the run
    stops on it, not converged."""
    jitted = jax.jit(_reg_runs()[2][name])  # (one program for both values)
    _, info = jitted(-10.0)
    assert bool(info.nonfinite) and not bool(info.converged), name
    _, info = jitted(1e-3)
    assert not bool(info.nonfinite), name


def test_linear_mixture_em_checks_its_weights():
    """Regression: a negative weight was accepted and ended in a misleading "a mode lost
    its data" error. The weights are checked as gmm_em checks them."""
    u, y = np.zeros((5, 2)), np.zeros((5, 2))
    A, b, c = np.stack([np.eye(2)] * 2), np.zeros((2, 2)), np.stack([np.eye(2)] * 2)
    for bad in ([1.5, -0.5], [0.2, 0.2]):
        with pytest.raises(ValueError, match=r"linear_mixture_em: weights .* non-negative "
                           "and sum to 1"):
            linear_mixture_em(u, y, A, b, c, np.asarray(bad))
    with pytest.raises(ValueError, match=r"linear_mixture_em: weights of shape \(3,\), "
                       r"expected \(2,\)"):
        linear_mixture_em(u, y, A, b, c, np.full(3, 1 / 3))
    with pytest.raises(ValueError, match="linear_mixture_em: weights"):
        em_linear_mixture.init(u, y, A, b, c, np.asarray([1.5, -0.5]))


@pytest.mark.exhaustive  # (~6 s: three EM loops compiled)
def test_bad_weights_under_jit_are_nan():
    """Regression: the weights were checked on concrete values only. Under jit a negative
    weight switched its component off and weights not summing to 1 were renormalised:
    a finite wrong log-likelihood. Now (traced) they make it NaN and the run stops."""
    x, centres = gmm_data()
    covs = np.stack([np.eye(D)] * 3)
    c2 = np.stack([np.eye(D)] * 2)
    runs = {
        "gmm_em": (lambda w: gmm_em(x, centres, covs, w, max_iters=3), 3),
        "linear_mixture_em": (lambda w: linear_mixture_em(x[:-1], x[1:], c2,
                                                          np.zeros((2, D)), c2, w,
                                                          max_iters=3), 2),
    }
    for name, (fn, k) in runs.items():
        for bad in (np.r_[-0.5, 1.5, np.zeros(k - 2)], np.full(k, 0.2)):
            with pytest.raises(ValueError, match=f"{name}: weights .* sum to 1"):
                fn(bad)
            st, info = jax.jit(fn)(bad)
            assert bool(info.nonfinite) and not bool(info.converged), (name, bad)
            assert np.isnan(st.log_likelihood), (name, bad)
        st, info = jax.jit(fn)(np.full(k, 1.0 / k))
        assert not bool(info.nonfinite) and np.isfinite(st.log_likelihood), name
    # float32 weights summing to 1 up to rounding pass, and stay float32
    w32 = np.full(3, 1 / 3, np.float32)
    st, _ = gmm_em(x.astype(np.float32), centres.astype(np.float32),
                   covs.astype(np.float32), w32, max_iters=2)
    assert st.weights.dtype == np.float32


def test_16_bit_data_is_refused_naming_the_argument():
    """Regression: bfloat16 data crashed inside jnp.linalg with "Unsupported dtype
    bfloat16", naming neither the function nor the argument. Refused (statically: under
    jit too), naming both."""
    x, centres = gmm_data()
    xb = jnp.asarray(x, jnp.bfloat16)
    c2, c3 = np.stack([np.eye(D)] * 2), np.stack([np.eye(D)] * 3)
    runs = {
        "gmm_em: x": lambda x: gmm_em(x, centres, c3, max_iters=2),
        "linear_mixture_em: inputs": lambda x: linear_mixture_em(x[:-1], x[1:], c2,
                                                                 np.zeros((2, D)), c2),
        "linear_mixture_em: targets": lambda x: linear_mixture_em(x[:-1].astype(np.float32),
                                                                  x[1:], c2,
                                                                  np.zeros((2, D)), c2),
        "markov_switching_em: x": lambda x: markov_switching_em(x, c2, np.zeros((2, D)),
                                                                np.ones((2, D))),
    }
    for what, fn in runs.items():
        for dt in (jnp.bfloat16, jnp.float16):
            for run in (fn, jax.jit(fn)):
                with pytest.raises(TypeError, match=f"{what} is {jnp.dtype(dt).name}: .*"
                                   "float32 or float64"):
                    run(xb.astype(dt))
    with pytest.raises(TypeError, match="gmm_em: x is bfloat16"):
        em_gmm.init(xb, centres, c3)


def test_energy_em_promotes_integer_params():
    """Regression: integer params (latents were promoted) failed in jax.grad with "grad
    requires real- or complex-valued inputs"."""
    st, info = energy_em(lambda v, th: jnp.sum((v - th) ** 2), jnp.zeros(2), jnp.array([1, 2]),
                         max_iters=3)
    assert jnp.issubdtype(st.params.dtype, jnp.floating) and not bool(info.nonfinite)
    np.testing.assert_allclose(st.latents, [1.0, 2.0], atol=1e-2)


def test_arguments_are_named_in_errors():
    """Regression: these raised "not enough values to unpack", a dot_general TypeError or
    "max_iters must be a positive int" (for e_iters)."""
    r = np.random.default_rng(0)
    x, c = r.normal(size=(19, D)), np.stack([np.eye(D)] * 3)
    with pytest.raises(ValueError, match=r"gmm_em: means must be \(K, d\), got shape \(2,\)"):
        gmm_em(x, x[0], c)
    with pytest.raises(ValueError, match=r"gmm_em: covariances must be \(K, d, d\)"):
        gmm_em(x, x[:3], np.eye(D))
    with pytest.raises(ValueError, match=r"gmm_em: x must be \(points, d\), got shape "
                       r"\(1, 19, 2\).*jax.vmap"):
        gmm_em(x[None], x[:3], c)
    with pytest.raises(ValueError, match=r"linear_mixture_em: inputs must be \(T, d_u\)"):
        linear_mixture_em(x[None], x, c[:2], np.zeros((2, D)), c[:2])
    with pytest.raises(ValueError, match=r"linear_mixture_em: A must be \(K, d_y, d_u\)"):
        linear_mixture_em(x, x, np.eye(D), np.zeros((2, D)), c[:2])
    with pytest.raises(ValueError, match=r"markov_switching_em: x must be \(T, d\)"):
        markov_switching_em(x[None], c[:2], np.zeros((2, D)), np.ones((2, D)))

    def energy(v, t):
        return jnp.sum((v - t) ** 2)

    for e_iters in (0, -1, 2.5, True):
        match = f"energy_em: e_iters must be a positive int.*got {e_iters!r}"
        with pytest.raises(ValueError, match=match):
            energy_em(energy, jnp.ones(2), jnp.zeros(2), e_iters=e_iters)
        with pytest.raises(ValueError, match=match):
            em_energy.init(energy, jnp.ones(2), jnp.zeros(2), e_iters=e_iters)
    # the shared loop's max_iters check names the algorithm
    with pytest.raises(ValueError, match=r"gmm_em: max_iters must be a positive int.*got 0"):
        gmm_em(x, x[:3], c, max_iters=0)
    with pytest.raises(ValueError, match=r"energy_em: max_iters must be a positive int"):
        energy_em(energy, jnp.ones(2), jnp.zeros(2), max_iters=-1)



@pytest.mark.exhaustive  # (~7 s of compiles)
def test_a_second_em_run_of_the_same_shapes_compiles_nothing():
    """Regression: each EM `run` built a fresh loop closure, so every call, even with the
    same shapes, traced and compiled its loop again (and ran the first E-step op by op):
    7-25 s for a 43-step `markov_switching_em` (checked in its dead-mode test). A second
    call now reuses the compiled run (that it computes the same numbers, the other tests
    here check)."""
    r = np.random.default_rng(3)
    x1, x2 = r.normal(size=(2, 9, D))
    eye2, eye3 = np.stack([np.eye(D)] * 2), np.stack([np.eye(D)] * 3)
    runs = {
        "gmm_em": lambda x: gmm_em(x, x[:3], eye3, reg=1e-3),
        "linear_mixture_em": lambda x: linear_mixture_em(x[:-1], x[1:], eye2,
                                                         np.zeros((2, D)), eye2, reg=1e-3),
        "slot_em": lambda x: si.infer.slot_em(x, x[:2], np.eye(D), np.eye(D), e_iters=2,
                                              max_iters=3),
    }
    for name, run in runs.items():
        run(x1)
        with lowered_programs() as compiles:
            run(x2)
        assert not compiles, f"{name} compiled {len(compiles)} programs again"
    # slot_em's eigenvalue cut-off stays an array argument: traced, it runs
    st, info = jax.jit(lambda rt: si.infer.slot_em(x1, x1[:2], np.eye(D), np.eye(D), e_iters=2,
                                                   max_iters=3, rtol=rt))(1e-5)
    assert int(info.num_steps) >= 1 and np.isfinite(np.asarray(st.energy)).all()


@pytest.mark.parametrize("which", ["e_step_size", "m_step_size"])
def test_energy_em_refuses_a_negative_step_size(which):
    """Regression: a negative M-step size climbed the energy in the parameters; a negative
    E-step size climbed it in the latents. Each is named."""
    def energy(z, th):
        return jnp.sum((z - th) ** 2) + jnp.sum(th ** 2)

    kw = {"e_step_size": 0.1, "m_step_size": 0.1, which: -0.1}
    with pytest.raises(ValueError, match=rf"energy_em: `{which}` must be non-negative"):
        energy_em(energy, jnp.ones(2), jnp.zeros(2), **kw)


def test_em_on_no_data_names_the_argument():
    # was a bare AssertionError ("size of plate should be positive") from the E-step
    m, c = np.zeros((2, 2)), np.stack([np.eye(2)] * 2)
    with pytest.raises(ValueError, match=r"gmm_em: x must be \(points, d\) with at least one"):
        gmm_em(np.zeros((0, 2)), m, c)
    with pytest.raises(ValueError, match=r"linear_mixture_em: inputs must be \(T, d_u\) with"):
        linear_mixture_em(np.zeros((0, 2)), np.zeros((0, 2)), c, m, c, reg=0.1)
    with pytest.raises(ValueError, match=r"slot_em: x must be \(tokens, d_x\) with at least"):
        si.infer.slot_em(np.zeros((0, 2)), np.ones((2, 2)), np.eye(2), np.eye(2))
    with pytest.raises(ValueError, match=r"markov_switching_em: x must be \(T, d\) with at"):
        markov_switching_em(np.zeros((0, 2)), c, m, np.ones((2, 2)))


def test_a_non_positive_definite_covariance_is_named():
    """Regression: linear_mixture_em's model (switching_linear_dynamics with
    normalize=True) took log|Lambda| from slogdet's magnitude, so an indefinite
    covariance gave a finite initial log-likelihood and responsibilities from no
    Gaussian at all; gmm_em stopped with "a covariance became singular? set reg > 0"
    and markov_switching_em with "too few points" for a non-positive covariance the
    user passed in. Each names the argument now; the model refuses the precision
    (eagerly; NaN under jit)."""
    r = np.random.default_rng(0)
    x = r.normal(size=(9, D))
    eye2 = np.stack([np.eye(D)] * 2)
    bad = np.stack([np.diag([1.0, -1.0]), np.eye(D)])
    zeros = np.zeros((2, D))
    with pytest.raises(ValueError, match=r"gmm_em: covariances must be symmetric and "
                       r"positive definite; component 0 is not: its smallest eigenvalue is -1"):
        gmm_em(x, x[:2], bad)
    with pytest.raises(ValueError, match=r"linear_mixture_em: covariances must be symmetric "
                       r"and positive definite; component 0 is not"):
        linear_mixture_em(x[:-1], x[1:], eye2, zeros, bad)
    with pytest.raises(ValueError, match=r"linear_mixture_em: covariances must be"):
        em_linear_mixture.init(x[:-1], x[1:], eye2, zeros, bad)
    for p in (np.array([[1.0, 0.0], [1.0, 1.0]]), np.array([[1.0, -1.0], [1.0, 1.0]]),
              np.array([[np.inf, 1.0], [1.0, 1.0]])):  # +inf: was blamed on the data
        with pytest.raises(ValueError, match=r"markov_switching_em: precisions must be "
                           r"positive and finite; component 0 is not"):
            markov_switching_em(x, eye2, zeros, p)
    # the model itself: a finite wrong log-likelihood before
    model = si.mechanisms.switching_linear_dynamics
    args = (x[:-1], eye2, zeros, np.linalg.inv(bad), np.log(np.full(2, 0.5)))
    with pytest.raises(ValueError, match="switching_linear_dynamics: precisions must be "
                       "positive"):
        si.log_marginal(model, *args, targets=x[1:], normalize=True)
    lz = jax.jit(lambda p: si.log_marginal(model, *args[:3], p, args[4], targets=x[1:],
                                           normalize=True))(args[3])
    assert np.isnan(lz)
    # a non-symmetric precision: its quadratic form reads the symmetric part, and so
    # does the normaliser (slogdet of the precision itself was another Gaussian's)
    skew = np.stack([[[2.0, 1.5], [-0.5, 1.0]], np.eye(D)])
    sym = 0.5 * (skew + np.swapaxes(skew, -1, -2))
    lz_skew, lz_sym = (si.log_marginal(model, *args[:3], p, args[4], targets=x[1:],
                                       normalize=True) for p in (skew, sym))
    np.testing.assert_allclose(lz_skew, lz_sym, rtol=1e-6)
    # under jit, where it cannot be checked, the run stops on the NaN
    _, info = jax.jit(lambda c: linear_mixture_em(x[:-1], x[1:], eye2, zeros, c,
                                                  max_iters=1, raise_on_nonfinite=False))(bad)
    assert bool(info.nonfinite) and int(info.num_steps) == 0


@pytest.mark.exhaustive  # (~10 s: three EM fits)
def test_positive_definite_checks_allow_float32_rounding():
    """Regression (review): the positive-definite checks were exact: a float32 covariance
    computed as the inverse of a well-posed precision (asymmetric by rounding) was refused
    by gmm_em, and under jit the run stopped as non-finite; float32 eigvalsh of an
    ill-conditioned precision inside linear_mixture_em's E-step read a small negative
    eigenvalue and aborted a run that converges. Rounding is allowed now (the symmetric
    part is read); an indefinite matrix is still refused."""
    r = np.random.default_rng(1)
    d = 16
    basis, _ = np.linalg.qr(r.normal(size=(d, d)))
    prec = (basis * np.logspace(0, 4, d)) @ basis.T
    cov = jnp.linalg.inv(jnp.asarray((prec + prec.T) / 2, jnp.float32))
    assert not np.array_equal(np.asarray(cov), np.asarray(cov).T)  # rounding asymmetry
    x = jnp.asarray(r.multivariate_normal(np.zeros(d), np.linalg.inv(prec), 300), jnp.float32)
    covs, w = jnp.stack([cov, cov]), jnp.array([0.5, 0.5], jnp.float32)
    state, _ = gmm_em(x, x[:2], covs, w, max_iters=2)
    _, info = jax.jit(lambda c: gmm_em(x, x[:2], c, w, max_iters=2))(covs)
    assert np.isfinite(float(state.log_likelihood)) and not bool(info.nonfinite)
    # targets on scales 1e2 .. 1e-2 with little noise: float32 precisions of condition 1e10
    T, du, dy = 200, 3, 4
    u = r.normal(size=(T, du))
    scale = np.array([1e2, 1.0, 1e-2, 1.0])
    y = (u @ r.normal(size=(dy, du)).T) * scale
    y = y + r.normal(size=(T, dy)) * np.array([1.0, 1e-3, 1e-3, 1.0]) * scale
    u, y = jnp.asarray(u, jnp.float32), jnp.asarray(y, jnp.float32)
    A = jnp.asarray(r.normal(size=(2, dy, du)), jnp.float32)
    c0 = jnp.stack([jnp.cov(y.T)] * 2)
    for run in (linear_mixture_em, jax.jit(linear_mixture_em)):
        st, inf = run(u, y, A, jnp.zeros((2, dy), jnp.float32), c0)
        assert np.isfinite(float(st.log_likelihood)) and int(inf.num_steps) > 1
    # NegSqDist reads a full precision by the same rule, eagerly and traced: condition
    # 2e8 in float32 (float32's eigvalsh reads its smallest eigenvalue, 1, as -0.1)
    p10 = (basis * np.logspace(0, 8.25, d)) @ basis.T
    p10 = jnp.asarray((p10 + p10.T) / 2, jnp.float32)
    q, k = x[:3] * 1e-4, x[3:7] * 1e-4
    s = si.scores.NegSqDist(q, k, precision=p10).dense()
    st = jax.jit(lambda p: si.scores.NegSqDist(q, k, precision=p).dense())(p10)
    diff = np.asarray(q, np.float64)[:, None] - np.asarray(k, np.float64)[None]
    want = -0.5 * np.einsum("ija,ab,ijb->ij", diff, np.asarray(p10, np.float64), diff)
    np.testing.assert_allclose(s, want, rtol=1e-3)
    np.testing.assert_allclose(st, want, rtol=1e-3)
    assert float(jnp.linalg.eigvalsh(p10)[0]) < 0 < np.linalg.eigvalsh(np.float64(p10))[0]
    # an indefinite, a singular, an asymmetric or a non-finite covariance is named (review)
    bad = {"its smallest eigenvalue is -1": covs.at[0, 0, 0].set(-1.0),
           "its smallest eigenvalue is -?[0-9.e-]+": jnp.stack([jnp.ones((d, d)), cov]),
           r"\|C - C\^T\| reaches": covs.at[1, 0, 1].add(1.0),
           "it has a non-finite entry": covs.at[0, 1, 1].set(jnp.inf)}
    for why, c in bad.items():
        with pytest.raises(ValueError, match=r"gmm_em: covariances must be symmetric and "
                           r"positive definite; component \d is not: " + why):
            gmm_em(x, x[:2], c, w)
        _, info = jax.jit(lambda c: gmm_em(x, x[:2], c, w, raise_on_nonfinite=False))(c)
        assert bool(info.nonfinite), why
    # a clearly indefinite precision is refused traced too (not taken for rounding)
    big = jnp.asarray([[1e6, 0.0], [0.0, -1.0]], jnp.float32)
    assert np.isnan(jax.jit(lambda p: si.scores.NegSqDist(
        jnp.zeros((1, 2)), jnp.ones((3, 2)), precision=p).dense())(big)).all()


def test_markov_switching_em_names_bad_log_weights():
    """Regression: a row of log_transition with no finite entry (no move out of a mode),
    an all -inf log_initial, a NaN or a +inf log-weight each stopped at the initial state
    with "a mode with too few points to fit its A, b and precisions? raise reg", which
    blames the data. Each is named now."""
    x = np.random.default_rng(0).normal(size=(9, D))
    A, b, p = np.stack([np.eye(D)] * 2), np.zeros((2, D)), np.ones((2, D))
    bad_lt = ([[0.0, 0.0], [-np.inf, -np.inf]], [[0.0, np.nan], [0.0, 0.0]],
              [[0.0, np.inf], [0.0, 0.0]])
    for lt in bad_lt:
        with pytest.raises(ValueError, match=r"markov_switching_em: log_transition .* each row "
                           r"needs a finite entry"):
            markov_switching_em(x, A, b, p, np.asarray(lt))
    for li in ([-np.inf, -np.inf], [np.nan, 0.0]):
        with pytest.raises(ValueError, match=r"markov_switching_em: log_initial .* needs a "
                           r"finite entry"):
            markov_switching_em(x, A, b, p, None, np.asarray(li))
    # a forbidden move (-inf next to a finite entry) is a model, not an error
    st = jax.jit(em_markov_switching.init)(x, A, b, p, np.asarray([[0.0, -np.inf], [0.0, 0.0]]))
    assert np.isfinite(st.log_likelihood)
