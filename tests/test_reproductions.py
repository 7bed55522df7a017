"""Finer checks of the reproductions' data generators (the reproductions themselves run
in --quick mode in test_examples.py). Cheap: no training, no engine compilation."""

import importlib

import jax
import numpy as np
import pytest


def _load(name):
    return importlib.import_module(f"structinfer.reproductions.{name}")


@pytest.fixture(scope="module")
def multihop():
    return _load("multihop")


@pytest.fixture(scope="module")
def expanding():
    return _load("expanding")


def test_multihop_sequences_put_the_chain_where_the_positions_say(multihop):
    make = jax.jit(multihop.make_task, static_argnums=(1, 2, 3))
    sample = jax.jit(multihop.sample_sequences, static_argnums=3)
    wr, wy = make(jax.random.PRNGKey(3), multihop.DIM, 2, 4.0)
    x, y, p0, p1 = (np.asarray(a) for a in sample(jax.random.PRNGKey(4), wr, wy, 13))
    wr, wy = np.asarray(wr), np.asarray(wy)
    rows = np.arange(13)
    x0, x1, x2 = x[rows, p0], x[rows, p1], x[:, -1]
    # the target is W_y (x_1 + x_0) of the tokens at the reported positions
    np.testing.assert_allclose(y, (x0 + x1) @ wy, rtol=1e-5, atol=1e-5)
    assert np.all(p0 != p1) and np.all(p0 < multihop.N_TOKENS - 1) and np.all(p1 < multihop.N_TOKENS - 1)
    # the chain: x_2 - W_r x_1 and x_1 - W_r x_0 are the (unit-variance) noise terms
    r1, r2 = x1 - x0 @ wr.T, x2 - x1 @ wr.T
    assert abs(np.var(r1) - 1.0) < 0.5 and abs(np.var(r2) - 1.0) < 0.5
    # the relation has the requested rank and spectral norm
    assert np.linalg.matrix_rank(wr, tol=1e-4) == 2
    np.testing.assert_allclose(np.linalg.norm(wr, 2), 4.0, rtol=1e-5)
    # positions are shuffled: x_0 is not always at the same place
    _, _, p0_many, _ = sample(jax.random.PRNGKey(5), wr, wy, 100)
    assert len(np.unique(np.asarray(p0_many))) == multihop.N_TOKENS - 1


def test_multihop_mask_forbids_the_final_token_and_self_edges(multihop):
    m = multihop.parent_mask(7, self_edges=False)
    assert not m[:, -1].any() and not np.diag(m).any() and m.sum() == 7 * 6 - 6
    m = multihop.parent_mask(7, self_edges=True)
    assert not m[:, -1].any() and m[:-1, :-1].all()


def test_expanding_sequences_place_x1_at_a_geometric_distance(expanding):
    wr, wy = jax.jit(expanding.make_task, static_argnums=(1, 2))(jax.random.PRNGKey(0), 10, 4.0)
    p = 0.2
    sample = jax.jit(expanding.sample_sequences, static_argnums=(3, 4))
    x, y, dist = (np.asarray(a) for a in sample(jax.random.PRNGKey(1), wr, wy, 1000, p))
    n = expanding.N_TOKENS
    rows = np.arange(len(dist))
    x1 = x[rows, n - 1 - dist]
    np.testing.assert_allclose(y, x1 @ np.asarray(wy), rtol=1e-5, atol=1e-6)
    assert dist.min() >= 1 and dist.max() <= n - 1
    # E[D] = 1/p for the (barely clipped) geometric on {1, 2, ...}; sd(mean) ~ 0.14
    assert abs(dist.mean() - 1 / p) < 0.6


def test_gaussian_slot_e_step_is_the_weighted_mean_and_a_stationary_point(x64):
    """The slot-attention edit in the mixtures reproduction: with Gaussian potentials (W_Q = I,
    no node potential) the CCCP / majorise-minimise step is the attention-weighted mean of
    the keys, and its fixed point is a stationary point of F = ½λ‖μ‖² − log Z."""
    mix = _load("mixtures")
    jnp = jax.numpy
    x, _, slots0, _, _ = (np.asarray(a) for a in mix.make_scene(1))
    jx, js, eye = jnp.asarray(x), jnp.asarray(slots0), jnp.eye(5)
    mu1, _ = mix.gaussian_slot_e_step(jx, js, eye, eye, 1.0, lam=0.0, iters=1)
    a0 = np.asarray(mix.marginals(mix.gaussian_slot_model, jx, js, eye, eye, 1.0)["slot"])
    np.testing.assert_allclose(mu1, (a0.T @ x) / a0.sum(0)[:, None], rtol=1e-8, atol=1e-10)
    mu, _ = mix.gaussian_slot_e_step(jx, js, eye, eye, 1.0, iters=200)
    g = jax.grad(mix.gaussian_slot_free_energy, argnums=1)(jx, mu, eye, eye, 1.0)
    assert np.abs(np.asarray(g)).max() < 1e-6
