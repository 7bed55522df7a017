"""NumPyro enumeration pitfalls: what goes wrong, and what the engine does about it."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from numpyro.ops.indexing import Vindex

import structinfer as si

H, N, M, DV = 3, 5, 7, 2


@pytest.fixture
def heads(x64):
    r = np.random.default_rng(0)
    return r.normal(size=(H, N, M)), r.normal(size=(H, M, DV))


def head_model(index):
    def model(s, v):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", N, dim=-1):
            j = si.edge("phi", si.priors.Uniform(M), s)
            numpyro.deterministic("out", index(v, j))

    return model


def test_vindex_and_gather_give_the_exact_posterior_mean(heads):
    s, v = heads
    ref = jax.nn.softmax(s, -1) @ v
    vindex = head_model(lambda v, j: Vindex(v[:, None])[..., j, :])
    np.testing.assert_allclose(si.expectation(vindex, "out", s, v), ref, atol=1e-12)
    # si.gather indexes the last axis of a (..., parents) table; values with an
    # event dim go through a transpose
    gathered = head_model(
        lambda v, j: jnp.stack(
            [si.gather(jnp.swapaxes(v, -1, -2)[:, c][:, None, :], j) for c in range(DV)], -1
        )
    )
    np.testing.assert_allclose(si.expectation(gathered, "out", s, v), ref, atol=1e-12)


def test_chained_indexing_is_caught_not_silently_wrong(heads):
    """``v[:, j]`` (chained/basic+advanced indexing) misaligns the enumeration dim with
    the head dim (numpyro issue 2252). The engine compares the value's shape under
    enumeration with its shape in a plain run and refuses instead of returning a
    wrong posterior mean."""
    s, v = heads
    chained = head_model(lambda v, j: v[:, j])
    with pytest.raises(ValueError, match="deterministic site 'out': under enumeration"):
        si.expectation(chained, "out", s, v)


def test_chained_indexing_of_another_edge_is_caught():
    """Following a chain by indexing one edge variable with another mixes plate
    elements; the supported way is ``si.edge(..., child=j)``."""
    r = np.random.default_rng(1)
    s, v = r.normal(size=(N, N)), r.normal(size=(N, DV))

    def model(s, v):
        with numpyro.plate("nodes", N):
            j = si.edge("hop0", si.priors.Uniform(N), s)
            k = si.edge("hop1", si.priors.Uniform(N), s)
            numpyro.deterministic("out", v[j] + v[k[j]])

    with pytest.raises(ValueError, match="follow a chain with si.edge"):
        si.expectation(model, "out", s, v)


def test_numpy_constants_as_arguments_under_jit():
    r = np.random.default_rng(2)
    s, v = r.normal(size=(N, M)).astype(np.float32), r.normal(size=(M, DV)).astype(np.float32)

    def model(s, v):
        with numpyro.plate("queries", N):
            j = si.edge("phi", si.priors.Uniform(M), s)
            numpyro.deterministic("out", v[j])  # v is a NumPy array when called eagerly

    ref = jax.nn.softmax(s, -1) @ v
    np.testing.assert_allclose(si.expectation(model, "out", s, v), ref, atol=1e-5)
    f = jax.jit(lambda s: si.expectation(model, "out", s, jnp.asarray(v)))
    np.testing.assert_allclose(f(s), ref, atol=1e-5)


def test_plate_dim_budget_counts_plates_and_sites():
    def model():
        with numpyro.plate("a", 2, dim=-1), numpyro.plate("b", 2, dim=-2):
            for k in range(si.exact.MAX_ENUM_DIMS - 2):
                si.edge(f"e{k}", si.priors.Uniform(2))

    info = si.inspect_model(model)
    assert info.max_plate_nesting == 2 and len(info.enumerated) == 30


def test_float32_large_score_on_forbidden_or_unlikely_parent():
    """funsor rescales each factor by its own max before exponentiating; a prior and a
    score whose maxima sit at different parents underflowed to log Z = -inf in float32
    before the engine folded the score into the edge's own factor."""
    s = np.array([[0.0, 1.0, 200.0], [3.0, 0.0, -50.0]], np.float32)
    mask = np.array([[True, True, False], [True, True, True]])
    logits = np.array([[0.0, 0.0, -150.0], [0.0, -1.0, 0.0]], np.float32)

    def lse(a):
        a = np.asarray(a, np.float64)
        return np.log(np.exp(a - a.max(-1, keepdims=True)).sum(-1)) + a.max(-1)

    for prior, log_prior in [
        (si.priors.Restricted(mask), np.where(mask, -np.log(mask.sum(-1, keepdims=True)), -np.inf)),
        (si.priors.Categorical(logits), logits - lse(logits)[:, None]),
    ]:

        def model(prior=prior):
            with numpyro.plate("queries", 2):
                si.edge("phi", prior, s)

        total = s + log_prior
        np.testing.assert_allclose(si.log_marginal(model), lse(total).sum(), rtol=1e-6)
        post = np.exp(total - lse(total)[:, None])
        np.testing.assert_allclose(si.marginals(model)["phi"], post, atol=1e-6)
        np.testing.assert_array_equal(si.map_edges(model)["phi"], total.argmax(-1))


def test_layers_composed_with_numpyro_scope():
    """``numpyro.handlers.scope`` renames the plates of the sites inside it; the engine
    names each plate's enumerated dim after the renamed plate, so two scoped layers are
    two independent products over their children."""
    r = np.random.default_rng(0)
    q, k = jnp.asarray(r.normal(size=(3, 2))), jnp.asarray(r.normal(size=(4, 2)))
    v = jnp.asarray(r.normal(size=(4,)))

    def layer(q, k, v):
        with numpyro.plate("queries", q.shape[0]):
            j = si.edge("phi", si.priors.Uniform(k.shape[0]), si.scores.Dot(q, k))
            numpyro.deterministic("out", v[j])

    def two_layers(q, k, v):
        numpyro.handlers.scope(layer, "l1")(q, k, v)
        numpyro.handlers.scope(layer, "l2")(-q, k, v)

    s = q @ k.T - jnp.log(4.0)
    log_z = jax.nn.logsumexp(s, -1).sum() + jax.nn.logsumexp(-s - 2 * jnp.log(4.0), -1).sum()
    assert jnp.allclose(si.log_marginal(two_layers, q, k, v), log_z, rtol=1e-5)
    p2 = jax.nn.softmax(-q @ k.T, -1)
    assert jnp.allclose(si.marginals(two_layers, q, k, v)["l2/phi"], p2, atol=1e-5)
    assert jnp.allclose(si.expectation(two_layers, "l2/out", q, k, v), p2 @ v, atol=1e-5)
    assert jnp.allclose(si.attention(two_layers, "l2/out")(q, k, v), p2 @ v, atol=1e-5)
