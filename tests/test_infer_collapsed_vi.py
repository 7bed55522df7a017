"""Collapsed VI (Singh & Buckley sec. 4, app. 7.1) against plain formulas written here.

Every reference below is plain numpy: the Hopfield / slot / block-slot updates of
sec. 4.2-4.3 and app. 8.2.1, the predictive-coding gradient of app. 7.2, and the
Hessian of log Z by autodiff for the Laplace term. Sizes are distinct primes.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.handlers import substitute

import structinfer as si
from structinfer.infer import (
    NonFiniteEnergyError,
    cccp,
    gradient_descent,
    laplace,
    model_energy,
    model_log_z,
)


def softmax(a, axis=-1):
    a = np.asarray(a, np.float64)
    e = np.exp(a - a.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def lse(a, axis=-1):
    a = np.asarray(a, np.float64)
    m = a.max(axis, keepdims=True)
    return (m + np.log(np.exp(a - m).sum(axis, keepdims=True))).squeeze(axis)


# ----------------------------------------------------------------------------- models


def hopfield(X, beta, mu):
    """MCHN (sec. 4.2): each latent query takes one memory, score beta mu^T x_j."""
    with numpyro.plate("queries", mu.shape[0]):
        si.edge("memory", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=beta))


def block_slot(x, mem, wk, wq, mu):
    """Block-slot (app. 8.2.1): tokens take slots; every block of every slot takes a memory."""
    S, B, _ = mu.shape
    with numpyro.plate("tokens", x.shape[0]):
        si.edge("slot", si.priors.Uniform(S), si.scores.Dot(x @ wk.T, mu.reshape(S, -1) @ wq.T))
    with numpyro.plate("blocks", B, dim=-2), numpyro.plate("slots", S, dim=-1):
        si.edge("memory", si.priors.Uniform(mem.shape[0]),
                si.scores.Dot(jnp.swapaxes(mu, 0, 1), jnp.swapaxes(mem, 0, 1)))


def pcn(y, w1, w2, m, k1, k2, mu):
    """Two-layer predictive coding with a uniform prior over incoming synapses (app. 7.2)."""
    z1, z2 = mu["z1"], mu["z2"]
    numpyro.factor("z1.prior", -0.5 * jnp.sum((z1 - m) ** 2))
    with numpyro.plate("layer2", z2.shape[0]):
        err = z2[:, None] - w1 * z1[None, :]
        si.edge("syn1", si.priors.Uniform(z1.shape[0]), si.scores.Custom(-0.5 * k1 * err**2))
    with numpyro.plate("obs", y.shape[0]):
        err = y[:, None] - w2 * z2[None, :]
        si.edge("syn2", si.priors.Uniform(z2.shape[0]), si.scores.Custom(-0.5 * k2 * err**2))


def pcn_grad_ref(y, w1, w2, m, k1, k2, z1, z2):
    """dF/dmu from the paper's formula: softmax-weighted prediction errors."""
    e1 = z2[:, None] - w1 * z1[None, :]
    a1 = softmax(-0.5 * k1 * e1**2)  # layer-2 unit i over its parents in layer 1
    e2 = y[:, None] - w2 * z2[None, :]
    a2 = softmax(-0.5 * k2 * e2**2)
    g1 = (z1 - m) - np.sum(a1 * k1 * e1 * w1, 0)  # outgoing edges of z1
    g2 = np.sum(a1 * k1 * e1, 1) - np.sum(a2 * k2 * e2 * w2, 0)  # incoming + outgoing
    return g1, g2


def pcn_energy_ref(y, w1, w2, m, k1, k2, z1, z2):
    e1 = -0.5 * k1 * (z2[:, None] - w1 * z1[None, :]) ** 2 - np.log(len(z1))
    e2 = -0.5 * k2 * (y[:, None] - w2 * z2[None, :]) ** 2 - np.log(len(z2))
    return 0.5 * np.sum((z1 - m) ** 2) - lse(e1).sum() - lse(e2).sum()


# ------------------------------------------------------------------------------ tests


@jax.jit
def run_hopfield(X, beta, mu0):
    return cccp(model_log_z(hopfield, "mu", X, beta), mu0, precision=beta, tol=1e-10,
                max_iters=200)


def test_cccp_nonpositive_precision_under_jit_is_nan():
    """Regression: a non-positive precision raised only on concrete values; under jit
    cccp returned a finite energy. Now the energy is NaN and the run stops on it."""
    X = jax.random.normal(jax.random.key(0), (7, 3))
    mu0 = X[:2] + 0.1
    log_z = model_log_z(hopfield, "mu", X, 1.0)
    with pytest.raises(ValueError, match="cccp: `precision` .* must be positive"):
        cccp(log_z, mu0, precision=-1.0)
    for bad in (-1.0, 0.0):
        st, info = jax.jit(lambda p: cccp(log_z, mu0, precision=p,
                                          raise_on_nonfinite=False))(bad)
        assert bool(info.nonfinite) and np.isnan(st.energy)
    st, info = jax.jit(lambda p: cccp(log_z, mu0, precision=p))(1.0)
    assert not bool(info.nonfinite) and np.isfinite(st.energy)


def test_gradient_descent_refuses_a_negative_step_size():
    """Regression: a negative step size ran gradient *ascent* on the free energy and
    reported it converged (the Hopfield energy rose from -5.0 to 0.9, `info.converged`
    True). Concrete: an error naming it; under jit: NaN. (A zero leaf holds a mean.)"""
    X = jax.random.normal(jax.random.key(0), (7, 3))
    energy = model_energy(hopfield, "mu", X, 1.0)
    mu0 = X[:2] + 0.1
    for bad in (-0.1, [-0.1, 0.1]):
        with pytest.raises(ValueError, match="gradient_descent: `step_size` must be non-negative"):
            gradient_descent(energy, mu0, step_size=jnp.asarray(bad)[:, None] if isinstance(
                bad, list) else bad)
    st, info = jax.jit(lambda h: gradient_descent(energy, mu0, step_size=h,
                                                  raise_on_nonfinite=False))(-0.1)
    assert bool(info.nonfinite) and not bool(info.converged)
    st, _ = gradient_descent(energy, mu0, step_size=jnp.array([[0.0], [0.1]]), max_iters=5)
    np.testing.assert_array_equal(st.mu[0], mu0[0])  # a zero step holds that mean
    assert not np.allclose(st.mu[1], mu0[1])


def test_cccp_precision_of_another_shape_is_named():
    """Regression: a precision not broadcasting to mu's shape failed in a multiply, or
    (extra leading dims) broadcast mu to its shape and failed on the edge's plates."""
    X = jax.random.normal(jax.random.key(0), (7, 3))
    mu0 = X[:2] + 0.1
    log_z = model_log_z(hopfield, "mu", X, 1.0)
    for p in (jnp.ones((3, 3)), jnp.ones((4, 2, 3)), jnp.ones((1, 2, 3))):
        with pytest.raises(ValueError, match=rf"cccp: `precision` of shape {re.escape(str(p.shape))} "
                           r"must broadcast to the shape of the means \(2, 3\)"):
            cccp(log_z, mu0, precision=p)
    st, _ = cccp(log_z, mu0, precision=jnp.ones(3), max_iters=3)  # broadcasts: fine
    assert st.mu.shape == (2, 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cccp_hopfield_matches_plain_update_and_descends(x64, seed):
    r = np.random.default_rng(seed)
    M, D, Q, beta = 7, 5, 3, 0.7
    X = r.normal(size=(M, D))
    mu0 = r.normal(size=(Q, D))
    st, info = run_hopfield(X, beta, mu0)
    # the first three iterates against the plain update mu <- softmax(beta mu X^T) X
    mu = mu0
    F_ref = []
    for _ in range(4):
        F_ref.append(0.5 * beta * np.sum(mu**2) - lse(beta * mu @ X.T - np.log(M)).sum())
        mu = softmax(beta * mu @ X.T) @ X
    np.testing.assert_allclose(info.energy[:4], F_ref, rtol=1e-10, atol=1e-10)
    e = np.asarray(info.energy[: int(info.num_steps) + 1])
    assert np.all(np.diff(e) <= 1e-12 * np.abs(e[:-1]).max()), "F increased"
    assert bool(info.converged)
    # stationary point: dF/dmu = beta mu - beta softmax(beta mu X^T) X = 0
    mu = np.asarray(st.mu)
    np.testing.assert_allclose(mu, softmax(beta * mu @ X.T) @ X, atol=1e-8)


def test_hopfield_retrieval_in_one_step():
    r = np.random.default_rng(3)
    M, D = 7, 97
    X = np.sign(r.normal(size=(M, D))).astype(np.float32)
    # patterns well separated: every overlap between distinct patterns is small vs D
    overlap = np.abs(X @ X.T - D * np.eye(M)).max()
    assert overlap <= D / 3
    xi = X.copy()
    flip = r.choice(D, size=(M, 4), replace=True)
    for i in range(M):
        xi[i, flip[i]] *= -1
    log_z = model_log_z(hopfield, "mu", X, 1.0)
    one, info1 = jax.jit(lambda mu: cccp(log_z, mu, max_iters=1))(xi)
    np.testing.assert_allclose(one.mu, X, atol=1e-3)  # back to the stored patterns
    assert bool(info1.max_iters_reached) and not bool(info1.converged)
    full, info = jax.jit(lambda mu: cccp(log_z, mu, tol=1e-4, max_iters=10))(xi)
    assert bool(info.converged) and int(info.num_steps) == 2  # step 2 confirms the fixed point


def test_slot_attention_competition_over_slots(x64):
    r = np.random.default_rng(5)
    n_per, D, S = 11, 3, 2
    # opposite objects: a slot claiming one scores the other's tokens negatively, so the
    # softmax over slots hands them to the other slot (with the unnormalised dot score,
    # orthogonal objects would let one slot grow and claim both)
    centres = np.array([[3.0, 0.5, 0], [-3.0, 0.5, 0]])
    labels = np.repeat([0, 1], n_per)
    x = centres[labels] + 0.3 * r.normal(size=(2 * n_per, D))
    wk, wq = np.eye(D), np.eye(D)
    mu0 = 0.3 * r.normal(size=(S, D))
    def slots_at(mu):  # the catalogue's slot attention, edge potentials only
        return substitute(si.mechanisms.slot_attention, data={"slots": mu})

    def log_z(mu):
        return si.log_marginal(slots_at(mu), x, wq, wk, S, node_potential=False)

    st, info = jax.jit(lambda mu: cccp(log_z, mu, tol=1e-9, max_iters=100))(mu0)
    assert bool(info.converged)
    A = np.asarray(si.marginals(slots_at(st.mu), x, wq, wk, S, node_potential=False)["phi"])
    # the softmax runs over the slots (competition), not over the tokens
    np.testing.assert_allclose(A, softmax(x @ wk.T @ wq @ np.asarray(st.mu).T, axis=1),
                               atol=1e-12)
    # fixed point of the paper's update mu_i = sum_j A_ji W_Q^T W_K x_j
    np.testing.assert_allclose(st.mu, A.T @ x @ wk.T @ wq, atol=1e-8)
    # each object (cluster) is claimed by its own slot
    owner = A.argmax(1)
    assert len(set(owner[labels == 0])) == 1 and len(set(owner[labels == 1])) == 1
    assert owner[0] != owner[-1]
    e = np.asarray(info.energy[: int(info.num_steps) + 1])
    assert np.all(np.diff(e) <= 1e-10)


def test_block_slot_update_matches_paper_formula(x64):
    r = np.random.default_rng(6)
    n, S, B, db, L, dk = 7, 3, 2, 5, 11, 13
    x = r.normal(size=(n, 4))
    mem = r.normal(size=(L, B, db))
    wk, wq = 0.4 * r.normal(size=(dk, 4)), 0.4 * r.normal(size=(dk, B * db))
    mu0 = r.normal(size=(S, B, db))
    log_z = model_log_z(block_slot, "mu", x, mem, wk, wq)
    one, _ = jax.jit(lambda mu: cccp(log_z, mu, max_iters=1))(mu0)
    # mu_i = sum_j softmax_i(mu_i Q^T K x_j) Q^T K x_j + sum_{k,b} softmax_k(mu_i^b . m_k^b) m_k^b
    QK = wq.T @ wk  # (B*db, 4)
    A = softmax((x @ wk.T) @ (wq @ mu0.reshape(S, -1).T), axis=1)  # (n, S) over slots
    ref = (A.T @ (x @ QK.T)).reshape(S, B, db)
    for b in range(B):
        P = softmax(mu0[:, b] @ mem[:, b].T, axis=1)  # (S, L) over memories
        ref[:, b] += P @ mem[:, b]
    np.testing.assert_allclose(one.mu, ref, atol=1e-10)
    _, info = jax.jit(lambda mu: cccp(log_z, mu, tol=1e-9, max_iters=60))(mu0)
    e = np.asarray(info.energy[: int(info.num_steps) + 1])
    assert np.all(np.diff(e) <= 1e-10 * np.abs(e).max())


def _pcn_problem(seed=7):
    r = np.random.default_rng(seed)
    K1, K2, N = 2, 3, 5
    args = dict(
        y=r.normal(size=N), w1=r.normal(size=(K2, K1)), w2=r.normal(size=(N, K2)),
        m=r.normal(size=K1), k1=1.3, k2=0.7,
    )
    mu0 = {"z1": r.normal(size=K1), "z2": r.normal(size=K2)}
    return args, mu0


def test_predictive_coding_gradient_descent(x64):
    args, mu0 = _pcn_problem()
    a = tuple(args.values())
    F = model_energy(pcn, "mu", *a)
    f0, g = jax.jit(jax.value_and_grad(F))(mu0)
    np.testing.assert_allclose(f0, pcn_energy_ref(*a, mu0["z1"], mu0["z2"]), rtol=1e-12)
    g1, g2 = pcn_grad_ref(*a, mu0["z1"], mu0["z2"])
    np.testing.assert_allclose(g["z1"], g1, atol=1e-12)
    np.testing.assert_allclose(g["z2"], g2, atol=1e-12)
    st, info = jax.jit(lambda mu: gradient_descent(F, mu, step_size=0.05, tol=1e-7,
                                                   max_iters=3000))(mu0)
    assert bool(info.converged)
    e = np.asarray(info.energy[: int(info.num_steps) + 1])
    assert np.all(np.diff(e) <= 1e-12)
    g1, g2 = pcn_grad_ref(*a, np.asarray(st.mu["z1"]), np.asarray(st.mu["z2"]))
    assert max(np.abs(g1).max(), np.abs(g2).max()) <= 1e-7


def test_laplace_against_autodiff_hessian(x64):
    # Hopfield at its fixed point (bilinear: the expectation term is the node term only)
    r = np.random.default_rng(8)
    X, beta = r.normal(size=(7, 5)), 1.1
    st, _ = run_hopfield(X, beta, r.normal(size=(3, 5)))

    def hop_node(X, beta, mu):
        numpyro.factor("node", -0.5 * beta * jnp.sum(mu**2))
        hopfield(X, beta, mu)

    lap = jax.jit(lambda mu: laplace(hop_node, "mu", mu, X, beta))(st.mu)
    H = jax.jit(jax.hessian(lambda u: si.log_marginal(hop_node, X, beta, mu=u)))(st.mu)
    np.testing.assert_allclose(lap.hessian, H.reshape(15, 15), atol=1e-10)
    np.testing.assert_allclose(lap.expectation_term, -beta * np.eye(15), atol=1e-12)
    np.testing.assert_allclose(lap.covariance @ lap.precision, np.eye(15), atol=1e-8)
    # predictive coding: non-quadratic edge potentials, both terms matter
    args, mu0 = _pcn_problem(9)
    a = tuple(args.values())
    lap = jax.jit(lambda mu: laplace(pcn, "mu", mu, *a))(mu0)
    F = model_energy(pcn, "mu", *a)
    flat, unravel = jax.flatten_util.ravel_pytree(mu0)
    Hf = jax.jit(jax.hessian(lambda u: F(unravel(u))))(flat)
    np.testing.assert_allclose(lap.precision, Hf, atol=1e-10)
    assert np.abs(lap.var_term).max() > 1e-3


def test_cccp_vmaps_over_a_batch():
    r = np.random.default_rng(10)
    X = r.normal(size=(7, 3)).astype(np.float32)
    log_z = model_log_z(hopfield, "mu", X, 1.0)
    mus = r.normal(size=(5, 2, 3)).astype(np.float32)
    run = jax.jit(jax.vmap(lambda m: cccp(log_z, m, tol=1e-5, max_iters=50)))
    st, info = run(mus)
    assert info.energy.shape == (5, 51) and info.num_steps.shape == (5,)
    single = jax.jit(lambda m: cccp(log_z, m, tol=1e-5, max_iters=50))
    for b in range(5):
        one, i1 = single(mus[b])
        np.testing.assert_allclose(st.mu[b], one.mu, atol=1e-5)
        assert int(info.num_steps[b]) == int(i1.num_steps)


def test_nonfinite_energy_names_step_and_site():
    def model(mu):
        numpyro.factor("log_barrier", -jnp.sum(jnp.log(mu)))  # NaN once mu < 0
        with numpyro.plate("c", 2):
            si.edge("phi", si.priors.Uniform(3), si.scores.Dot(mu[None, :2].repeat(2, 0),
                                                                jnp.eye(3)[:, :2]))

    F = model_energy(model, "mu")
    with pytest.raises(NonFiniteEnergyError, match=r"step 1.*'log_barrier'") as err:
        gradient_descent(F, jnp.array([0.5, 0.5, 0.5]), step_size=10.0, max_iters=5)
    assert err.value.step == 1
    # under jit the loop stops with a status instead; raise_on_nonfinite() raises afterwards
    st, info = jax.jit(lambda m: gradient_descent(F, m, step_size=10.0, max_iters=5))(
        jnp.array([0.5, 0.5, 0.5]))
    assert bool(info.nonfinite) and int(info.num_steps) == 1
    np.testing.assert_allclose(st.mu, [0.5, 0.5, 0.5])  # the last finite state
    with pytest.raises(NonFiniteEnergyError, match="step 1"):
        info.raise_on_nonfinite("gd")


# ------------------------------------------- laplace: separability decided structurally


def _hop_node(X, beta, mu):
    numpyro.factor("node", -0.5 * beta * jnp.sum(mu**2))
    hopfield(X, beta, mu)


def _obs_on_edge(X, beta, mu):
    """Hopfield plus an observation read at the chosen memory: log Z does not split."""
    numpyro.factor("node", -0.5 * beta * jnp.sum(mu**2))
    with numpyro.plate("queries", mu.shape[0]):
        phi = si.edge("memory", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=beta))
        numpyro.sample("y", dist.Normal(si.gather(X[:, 0], phi), 1.0), obs=X[: mu.shape[0], 1])


def _factor_via_deterministic(X, beta, mu):
    """A factor on a deterministic value read at the edge (no observed site involved)."""
    numpyro.factor("node", -0.5 * beta * jnp.sum(mu**2))
    with numpyro.plate("queries", mu.shape[0]):
        phi = si.edge("memory", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=beta))
        v = numpyro.deterministic("v", si.gather(X[:, 1], phi))
        numpyro.factor("lik", -0.5 * v**2)


def _chain(X, beta, mu):
    """Two hops (child= chain): the second edge's distribution is indexed by the first."""
    numpyro.factor("node", -0.5 * beta * jnp.sum(mu**2))
    n = X.shape[0]
    score = si.scores.Dot(mu, X)  # mu: (n, d), so every node is a child and a parent
    with numpyro.plate("nodes", n):
        j = si.edge("hop1", si.priors.Uniform(n), score)
        si.edge("hop2", si.priors.Uniform(n), score, child=j)


def _shared_obs(X, beta, mu):
    """Two edges coupled through one observation of the sum of what they pick."""
    numpyro.factor("node", -0.5 * beta * jnp.sum(mu**2))
    with numpyro.plate("queries", mu.shape[0]):
        a = si.edge("a", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X))
        b = si.edge("b", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, -X))
        numpyro.sample("y", dist.Normal(si.gather(X[:, 0], a) + si.gather(X[:, 0], b), 1.0),
                       obs=jnp.zeros(mu.shape[0]))


@pytest.mark.parametrize(
    "model, site, edge, shape",
    [
        (_obs_on_edge, "y", "memory", (3, 5)),
        (_factor_via_deterministic, "lik", "memory", (3, 5)),
        (_chain, "hop2", "hop1", (7, 5)),
        (_shared_obs, "y", "a", (3, 5)),
    ],
)
def test_laplace_refuses_edge_dependence_eagerly_and_under_jit(x64, model, site, edge, shape):
    # Item 7 of "Trust at every size": the separability check ran on concrete values
    # only, so under jit a model whose observation depends on an edge returned a
    # Hessian off by O(1) (1.56 on entries up to 1.05 for _obs_on_edge) instead of the
    # error it raised eagerly. Now it is decided from the model's structure: same error.
    r = np.random.default_rng(11)
    X, beta = r.normal(size=(7, 5)), 1.1
    mu = r.normal(size=shape)
    pattern = rf"site '{site}'.*depends on edge site '{edge}'"
    with pytest.raises(ValueError, match=pattern) as eager:
        laplace(model, "mu", mu, X, beta)
    with pytest.raises(ValueError, match=pattern) as jitted:
        jax.jit(lambda m: laplace(model, "mu", m, X, beta))(mu)
    assert str(eager.value) == str(jitted.value)


def test_laplace_separable_same_hessian_eagerly_and_under_jit(x64):
    r = np.random.default_rng(8)
    X, beta = r.normal(size=(7, 5)), 1.1
    st, _ = run_hopfield(X, beta, r.normal(size=(3, 5)))
    H = jax.jit(jax.hessian(lambda u: si.log_marginal(_hop_node, X, beta, mu=u)))(st.mu)
    eager = laplace(_hop_node, "mu", st.mu, X, beta)
    jitted = jax.jit(lambda mu: laplace(_hop_node, "mu", mu, X, beta))(st.mu)
    for lap in (eager, jitted):
        np.testing.assert_allclose(lap.hessian, H.reshape(15, 15), atol=1e-10)
    np.testing.assert_allclose(eager.hessian, jitted.hessian, atol=1e-12)
    np.testing.assert_allclose(eager.covariance, jitted.covariance, rtol=1e-10, atol=1e-12)


@pytest.mark.exhaustive  # (~12 s of compiles)
def test_laplace_observed_edge_is_a_node_term(x64):
    # an edge site given a value (handlers.condition) is not collapsed: its log-prob at
    # the value is part of A(mu), eagerly and under jit
    args, mu0 = _pcn_problem(12)
    a = tuple(args.values())
    model = numpyro.handlers.condition(pcn, data={"syn1": jnp.array([0, 1, 1])})
    flat, unravel = jax.flatten_util.ravel_pytree(mu0)
    H = jax.jit(jax.hessian(lambda u: si.log_marginal(model, *a, mu=unravel(u))))(flat)
    eager = laplace(model, "mu", mu0, *a)
    jitted = jax.jit(lambda mu: laplace(model, "mu", mu, *a))(mu0)
    for lap in (eager, jitted):
        np.testing.assert_allclose(lap.hessian, H, atol=1e-10)


def _masked_edge(X, beta, mu):
    numpyro.factor("node", -0.5 * beta * jnp.sum(mu**2))
    with numpyro.plate("queries", 3), numpyro.handlers.mask(mask=jnp.array([True, False, True])):
        si.edge("memory", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=beta))


def test_laplace_keeps_the_models_dtype(x64):
    """Regression: under jax_enable_x64 a float32 model's var_term, hessian, precision
    and covariance came out float64 (the Uniform prior's log-table is float64 there);
    now every field is float32, as the exact engine's log Z, and equals the float64 run."""
    X = np.random.default_rng(14).normal(size=(7, 3))
    mu = X[:2] + 0.1
    r32 = laplace(_hop_node, "mu", mu.astype(np.float32), X.astype(np.float32), 1.0)
    assert {f: str(getattr(r32, f).dtype) for f in r32._fields} == dict.fromkeys(
        r32._fields, "float32")
    r64 = laplace(_hop_node, "mu", mu, X, 1.0)
    assert r64.covariance.dtype == np.float64
    np.testing.assert_allclose(r32.covariance, r64.covariance, rtol=1e-4, atol=1e-6)
    rb = laplace(_hop_node, "mu", mu.astype(jnp.bfloat16), X.astype(jnp.bfloat16), 1.0)
    assert all(getattr(rb, f).dtype != np.float64 for f in rb._fields)


def _cosine_node(X, mu):
    numpyro.factor("node", -0.5 * jnp.sum(mu**2))
    with numpyro.plate("queries", mu.shape[0]):
        si.edge("memory", si.priors.Uniform(X.shape[0]), si.scores.Cosine(mu, X, scale=3.0))


def test_laplace_of_a_16_bit_mean_is_float32_accurate():
    """Regression: for a bfloat16 ``mu`` the expectation term (a Hessian in ``mu``) came
    back rounded to bfloat16 (0.3% off) and spoilt the float32 hessian and covariance;
    the expansion now runs in float32, every matrix float32 and equal to a float32 run on
    the same rounded inputs."""
    r = np.random.default_rng(15)
    X = jnp.asarray(3 * r.normal(size=(5, 3)), jnp.bfloat16)
    mu = X[:2] + jnp.asarray(0.3 * r.normal(size=(2, 3)), jnp.bfloat16)
    run = jax.jit(lambda mu, X: laplace(_cosine_node, "mu", mu, X))
    rb = run(mu, X)
    r32 = run(mu.astype(jnp.float32), X.astype(jnp.float32))
    assert rb.mean.dtype == jnp.bfloat16
    for f in r32._fields[1:]:
        assert getattr(rb, f).dtype == jnp.float32, f
        np.testing.assert_allclose(getattr(rb, f), getattr(r32, f), rtol=1e-5, atol=1e-6)


def test_laplace_refuses_masked_edge_eagerly_and_under_jit(x64):
    # a masked edge contributes nothing for its masked children; its score table does
    r = np.random.default_rng(13)
    X, beta = r.normal(size=(7, 5)), 1.1
    mu = r.normal(size=(3, 5))
    with pytest.raises(ValueError, match="site 'memory' is under numpyro.handlers.mask") as eager:
        laplace(_masked_edge, "mu", mu, X, beta)
    with pytest.raises(ValueError, match="site 'memory' is under numpyro.handlers.mask") as jitted:
        jax.jit(lambda m: laplace(_masked_edge, "mu", m, X, beta))(mu)
    assert str(eager.value) == str(jitted.value)


@pytest.mark.parametrize("rtol", [-1e-4, float("nan"), "1e-4", np.full(2, 1e-4)])
def test_laplace_names_a_bad_rtol(rtol):
    """Regression: `laplace` passed `rtol` unchecked to its consistency check: a string
    failed inside JAX naming `atol` ("Error interpreting argument to allclose"), and a
    negative or NaN one was taken (a check no value meets, unless both sides agree
    exactly). It is now refused, named, before any work."""
    X, mu = np.eye(3), np.zeros((2, 3))
    with pytest.raises(ValueError, match=r"^laplace: rtol must be a non-negative number"):
        laplace(_hop_node, "mu", mu, X, 1.0, rtol=rtol)
