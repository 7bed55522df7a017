"""Shared test helpers. Sizes use distinct primes so a swapped axis fails."""

import jax
import numpy as np
import pytest

# float64 is opt-in per test via the `x64` fixture; the default is float32.


@pytest.fixture
def x64():
    """Run a test with float64 enabled, restoring the previous setting after."""
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", prev)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
