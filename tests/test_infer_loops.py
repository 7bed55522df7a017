"""Every algorithm module of ``structinfer.infer`` has the same shape: ``run`` is ``step``
iterated from ``init`` until the step's convergence rule holds or ``max_iters``.

Each test iterates ``init`` / ``step`` in a plain Python loop and compares the state, the
energy trace, the step count and the reason for stopping with ``run`` (which loops
under ``jax.lax.while_loop``); the EM algorithms on models (``em_gmm``,
``em_linear_mixture``, ``em_slot``) are checked the same way in ``test_infer_em.py``
beside their runs. Model expansion (a scan, not an iteration) is checked against a plain
sequential loop. Sizes are small distinct primes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_run_is_iterated_step, iterate_steps

from structinfer.infer import convex_concave, em_energy, expand, gradient, mean_field


def hopfield_log_z(X, beta):
    """G(mu) = sum_i lse_j beta mu_i . x_j (Singh & Buckley sec. 4.2), in plain jnp."""
    return lambda mu: jnp.sum(jax.nn.logsumexp(beta * mu @ X.T, -1))


def test_cccp(x64):
    r = np.random.default_rng(0)
    X, beta = r.normal(size=(5, 3)), 2.0
    log_z = hopfield_log_z(X, beta)
    mu0 = X[:2] + 0.3 * r.normal(size=(2, 3))
    out = convex_concave.run(log_z, mu0, precision=beta, tol=1e-9, max_iters=50)
    ref = iterate_steps(convex_concave.init(log_z, mu0, beta),
                  lambda s: convex_concave.step(log_z, s, beta, 1e-9), lambda s: s.energy, 50)
    assert ref[3]
    assert_run_is_iterated_step(out, ref)


def test_gradient_descent(x64):
    r = np.random.default_rng(1)
    X = r.normal(size=(5, 3))
    log_z = hopfield_log_z(X, 2.0)

    def F(mu):
        return jnp.sum(mu**2) - log_z(mu)

    mu0 = X[:2] + 0.3 * r.normal(size=(2, 3))
    out = gradient.run(F, mu0, step_size=0.2, tol=1e-6, max_iters=200)
    ref = iterate_steps(gradient.init(F, mu0), lambda s: gradient.step(F, s, 0.2, 1e-6),
                  lambda s: s.energy, 200)
    assert ref[3]
    assert_run_is_iterated_step(out, ref)


@pytest.mark.parametrize("method", ["exact", "plugin"])
def test_geometric_beta(x64, method):
    # one query (child at position 6, parents 0..6): per-query stopping is plain stopping
    s = np.random.default_rng(2).normal(size=(1, 7))
    kw = dict(method=method, offset=6)
    out = mean_field.run(s, 0.3, 1.1, max_iters=100, **kw)
    ref = iterate_steps(jax.jit(lambda s: mean_field.init(s, 0.3, 1.1, **kw))(s),
                  lambda st: mean_field.step(s, st, 0.3, 1.1, **kw), lambda st: st.energy, 100)
    assert ref[3]
    assert_run_is_iterated_step(out, ref)


def test_energy_em(x64):
    # E(v; θ) = ½|v - θ|² - lse(v): latents pulled towards θ, θ towards the latents
    def energy(v, th):
        return 0.5 * jnp.sum((v - th["c"]) ** 2) - jax.nn.logsumexp(v)

    v0, th0 = jnp.array([0.3, -0.2, 0.5]), {"c": jnp.zeros(3)}
    kw = dict(e_step_size=0.3, e_iters=30, e_tol=1e-9)
    out = em_energy.run(energy, v0, th0, m_step_size=0.5, tol=1e-12, max_iters=5, **kw)
    ref = iterate_steps(em_energy.init(energy, v0, th0, **kw),
                  lambda s: em_energy.step(energy, s, m_step_size=0.5, tol=1e-12, **kw),
                  lambda s: s.energy, 5)
    assert_run_is_iterated_step(out, ref)


def plain_expand(children, parents, active, sim, tau, init):
    """Model expansion as a plain sequential loop (numpy)."""
    parents, active = np.array(parents, float), np.array(active, bool)
    energies, added, overflow = [], [], False
    for c in children:
        s = np.where(active, sim(c, parents), -np.inf)
        m = s.max()
        e = -(m + np.log(np.sum(np.exp(s - m))))
        add = e > tau and not active.all()
        if add:
            k = int(np.flatnonzero(~active)[0])
            parents[k], active[k] = init(c), True
        overflow |= (e > tau) and not add
        energies.append(e)
        added.append(add)
    return parents, active, np.array(energies), np.array(added), overflow


@pytest.mark.parametrize("capacity", [4, 7])
def test_expand_is_the_sequential_rule(x64, capacity):
    r = np.random.default_rng(6)
    children = np.concatenate([r.normal(size=(5, 2)) * 0.3 + 3 * k for k in range(5)])
    children = children[r.permutation(len(children))]
    parents = np.zeros((capacity, 2))
    parents[0] = children[0]
    active = np.arange(capacity) < 1

    def sim(c, p):
        return -0.5 * np.sum((c - p) ** 2, -1)

    res = jax.jit(lambda c, p, a: expand(c, p, a, sim, 2.5, init_fn=lambda c: c + 0.1))(
        children, parents, active)
    ref = plain_expand(children, parents, active, sim, 2.5, lambda c: c + 0.1)
    for got, want in zip(res, ref):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12)
    assert bool(res.overflow) == (capacity == 4)


@pytest.mark.parametrize("tol", [-1e-6, float("nan"), "1e-6", np.full(2, 1e-6), True])
def test_a_bad_tolerance_is_named(tol):
    """Regression: no loop checked `tol`. A negative or NaN one ran to `max_iters` (it
    can never be met) with no error; a string or an array failed inside JAX with a bare
    TypeError ("'<=' not supported between instances of 'DynamicJaxprTracer' and 'str'")
    or a broadcasting ValueError. Each run now names its argument first, before any work."""
    import structinfer as si

    x, eye = np.zeros((3, 2)), np.stack([np.eye(2)] * 2)
    log_z = hopfield_log_z(np.eye(2), 1.0)
    runs = {
        "cccp": lambda t: si.infer.cccp(log_z, x, tol=t),
        "gradient_descent": lambda t: si.infer.gradient_descent(lambda m: -log_z(m), x, tol=t),
        "geometric_beta": lambda t: si.infer.geometric_beta(np.zeros((3, 3)), 0.1, 0.9, tol=t),
        "energy_em": lambda t: si.infer.energy_em(lambda v, th: jnp.sum((v - th) ** 2),
                                                  x, x, tol=t),
        "energy_em e_tol": lambda t: si.infer.energy_em(lambda v, th: jnp.sum((v - th) ** 2),
                                                        x, x, e_tol=t),
        "gmm_em": lambda t: si.infer.gmm_em(x, x[:2], eye, tol=t),
        "linear_mixture_em": lambda t: si.infer.linear_mixture_em(x, x, eye, x[:2], eye,
                                                                  tol=t),
        "markov_switching_em": lambda t: si.infer.markov_switching_em(x, eye, x[:2],
                                                                      np.ones((2, 2)), tol=t),
        "slot_em": lambda t: si.infer.slot_em(x, x[:2], np.eye(2), np.eye(2), tol=t),
    }
    # each loop's `step` too (a user's own loop calls it; it ignored a bad `tol`)
    from structinfer.infer import em_gmm, em_linear_mixture, em_markov_switching, em_slot

    xs = jnp.asarray(x)
    energy = lambda v, th: jnp.sum((v - th) ** 2)  # noqa: E731
    steps = {
        "cccp": lambda t: convex_concave.step(log_z, convex_concave.init(log_z, xs), tol=t),
        "gradient_descent": lambda t: gradient.step(
            lambda m: -log_z(m), gradient.init(lambda m: -log_z(m), xs), 0.1, tol=t),
        "geometric_beta": lambda t: mean_field.step(
            np.zeros((3, 3)), mean_field.init(np.zeros((3, 3)), 0.1, 0.9), 0.1, 0.9, tol=t),
        "energy_em": lambda t: em_energy.step(energy, em_energy.init(energy, xs, xs), tol=t),
        "energy_em e_tol": lambda t: em_energy.step(energy, em_energy.init(energy, xs, xs),
                                                    e_tol=t),
        "gmm_em": lambda t: em_gmm.step(xs, em_gmm.init(x, x[:2], eye), tol=t),
        "linear_mixture_em": lambda t: em_linear_mixture.step(
            xs, xs, em_linear_mixture.init(x, x, eye, x[:2], eye), tol=t),
        "markov_switching_em": lambda t: em_markov_switching.step(
            xs, em_markov_switching.init(x, eye, x[:2], np.ones((2, 2))), tol=t),
        "slot_em": lambda t: em_slot.step(xs, em_slot.init(x, x[:2], np.eye(2), np.eye(2)),
                                          tol=t),
    }
    for table in (runs, steps):
        for name, run in table.items():
            fn, _, arg = name.partition(" ")
            with pytest.raises(ValueError, match=rf"^{fn}: {arg or 'tol'} must be a non-negative "
                                                 r"number \(a convergence tolerance\), got"):
                run(tol)


def test_a_step_size_of_another_shape_is_named():
    """Regression: a step size that broadcast the means to a bigger shape (or did not
    broadcast at all) failed inside JAX ("while_loop body function carry input and carry
    output must have equal types", "incompatible shapes for broadcasting"), naming
    neither the function nor the argument. cccp's precision was already checked so."""
    f = lambda mu: jnp.sum((mu - 1.0) ** 2)  # noqa: E731
    e = lambda v, th: jnp.sum((v - th) ** 2) + jnp.sum(th**2)  # noqa: E731
    for bad in (jnp.full((2, 3), 0.1), jnp.full((4,), 0.1)):
        with pytest.raises(ValueError, match=r"gradient_descent: `step_size` of shape "
                           r"\(\d, ?\d?\) must broadcast to the shape of the means \(3,\)"):
            gradient.run(f, jnp.zeros(3), step_size=bad)
        with pytest.raises(ValueError, match=r"energy_em: `e_step_size` of shape .* must "
                           r"broadcast to the shape of the latents \(3,\)"):
            em_energy.run(e, jnp.ones(3), jnp.ones(3), e_step_size=bad)
        with pytest.raises(ValueError, match=r"energy_em: `m_step_size` of shape .* must "
                           r"broadcast to the shape of the params \(3,\)"):
            em_energy.run(e, jnp.ones(3), jnp.ones(3), m_step_size=bad)
    # a scalar, a per-leaf pytree and an array that broadcasts still run
    st, _ = gradient.run(lambda mu: f(mu["a"]) + f(mu["b"]),
                         {"a": jnp.zeros(3), "b": jnp.zeros((2, 3))},
                         step_size={"a": 0.25, "b": jnp.full((3,), 0.25)})
    np.testing.assert_allclose(st.mu["b"], 1.0, atol=1e-4)
