"""Shared test helpers. Sizes use distinct primes so a swapped axis fails."""

import contextlib

import jax
import numpy as np
import pytest


@contextlib.contextmanager
def float64():
    """Enable float64 inside the block, restoring the previous setting after."""
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", prev)


@pytest.fixture
def x64():
    """Run a test with float64 enabled (the default elsewhere is float32)."""
    with float64():
        yield


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def iterate_steps(state, step, energy, max_iters):
    """An algorithm of ``structinfer.infer`` by hand: ``step`` (jitted once) iterated from
    ``state`` in a plain Python loop until it reports convergence or ``max_iters``.

    Returns ``(state, energies, num_steps, converged)``.
    """
    step = jax.jit(step)
    energies, conv, k = [energy(state)], False, 0
    while k < max_iters and not conv:
        state, conv = step(state)
        conv = bool(np.all(conv))
        energies.append(energy(state))
        k += 1
    return state, np.asarray(energies), k, conv


def assert_run_is_iterated_step(run_out, loop_out, rtol=1e-9):
    """``(state, info)`` of an algorithm's ``run`` equals :func:`iterate_steps`: the same
    state, energy trace, step count and reason for stopping."""
    (state, info), (state_ref, energies, k, conv) = run_out, loop_out
    assert int(np.max(info.num_steps)) == k
    assert bool(np.all(info.converged)) == conv
    assert bool(np.all(info.max_iters_reached)) == (not conv)
    assert not bool(np.any(info.nonfinite))
    np.testing.assert_allclose(np.asarray(info.energy)[..., : k + 1], energies.T, rtol=rtol,
                               atol=rtol)
    assert np.all(np.isnan(np.asarray(info.energy)[..., k + 1:]))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol)
