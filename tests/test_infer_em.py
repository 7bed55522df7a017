"""EM on log-sum-exp energies (Tschantz) against plain EM loops written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_run_is_iterated_step, iterate_steps
from scipy.stats import multivariate_normal

import structinfer as si
from structinfer.infer import (
    em_gmm,
    em_linear_mixture,
    em_slot,
    energy_em,
    expand,
    gmm_em,
    linear_mixture_em,
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
