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
