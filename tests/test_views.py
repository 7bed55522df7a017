"""Constant-index gathers replayed as views (``structinfer.lowering._views``).

Oracle: the gather itself (``fn(*args)`` evaluated plainly). Every case checks that
the replay returns the identical array; the view cases also check that no
``gather`` is left in the jitted program, and the non-view cases (permutations,
duplicates mixed with offsets, clipped or out-of-bounds indices) that the rewrite
was *not* taken — it must be exact or absent.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import matrix
from numpyro.ops.indexing import Vindex

import structinfer as si
from structinfer.lowering._views import eval_with_views, gather_as_view

PHI = np.arange(7, dtype=np.int32).reshape(7, 1, 1)

VIEWS = {
    "vindex_probe": lambda v: Vindex(v[:, None])[..., PHI, :],
    "take_axis1": lambda v: jnp.take(v, np.arange(7), axis=1),
    "take_axis2_window": lambda v: jnp.take(v, np.arange(1, 4), axis=2),
    "slice_and_index": lambda v: v[1:, 2:5, np.arange(2)],
    "broadcast_row": lambda v: v[:, np.zeros(4, np.int32)],
    "function_of_gather": lambda v: jnp.sin(Vindex(v)[..., PHI[..., 0], :]) * 2.0,
    "under_nested_jit": lambda v: jax.jit(lambda w: jnp.take(w, np.arange(7), axis=1))(v),
    "scalar_index": lambda v: v[2, 3],
}
NOT_VIEWS = {
    "permutation": lambda v: v[:, np.array([2, 0, 1])],
    "clip_mode": lambda v: jnp.take(v, np.arange(9), axis=1, mode="clip"),
    "fill_mode": lambda v: jnp.take(v, np.arange(9), axis=1, mode="fill"),
    "traced_index": None,  # built in the test: the index depends on an input
}


def _lowered(f, v):
    return jax.jit(lambda w: eval_with_views(f, w)).lower(v).as_text()


@pytest.mark.parametrize("name", sorted(VIEWS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_view_gathers_are_rewritten_exactly(name, dtype, x64):
    f = VIEWS[name]
    v = jnp.asarray(np.random.default_rng(0).normal(size=(3, 7, 5)).astype(dtype))
    want = f(v)
    got = jax.jit(lambda w: eval_with_views(f, w))(v)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "gather" not in _lowered(f, v)


@pytest.mark.parametrize("name", sorted(NOT_VIEWS))
def test_non_views_keep_the_gather(name):
    v = jnp.asarray(np.random.default_rng(1).normal(size=(3, 7, 5)).astype(np.float32))
    if name == "traced_index":
        idx = jnp.asarray([1, 2], jnp.int32)

        def f(w, i):
            return w[:, i]

        want = f(v, idx)
        got = jax.jit(lambda w, i: eval_with_views(f, w, i))(v, idx)
        text = jax.jit(lambda w, i: eval_with_views(f, w, i)).lower(v, idx).as_text()
    else:
        f = NOT_VIEWS[name]
        want = f(v)
        got = jax.jit(lambda w: eval_with_views(f, w))(v)
        text = _lowered(f, v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "gather" in text


@pytest.mark.parametrize("seed", matrix(range(40), keep=lambda seed: seed < 12))
def test_random_indexing_expressions(seed):
    """Random mixes of slices, integers, shifted ``arange`` index arrays (views) and
    shuffled index arrays (not views) on a 4-d operand: always the identical array;
    no gather left when every index array is an ``arange``."""
    r = np.random.default_rng(seed)
    shape = tuple(int(s) for s in r.integers(2, 6, size=4))
    v = jnp.asarray(r.normal(size=shape).astype(np.float32))
    index, views = [], True
    for _ax, s in enumerate(shape):
        kind = r.choice(["full", "slice", "int", "arange", "shuffled"])
        lo = int(r.integers(0, s - 1))
        hi = int(r.integers(lo + 1, s + 1))
        if kind == "full":
            index.append(slice(None))
        elif kind == "slice":
            index.append(slice(lo, hi))
        elif kind == "int":
            index.append(lo)
        elif kind == "arange":
            index.append(np.arange(lo, hi, dtype=np.int32))
        else:
            index.append(r.permutation(s)[: max(hi - lo, 2)].astype(np.int32))
            views = False
    arrays = [i for i in index if isinstance(i, np.ndarray)]
    if len(arrays) > 1:  # advanced indices must broadcast: put each on its own axis
        k = 0
        for pos, i in enumerate(index):
            if isinstance(i, np.ndarray):
                index[pos] = i.reshape((-1,) + (1,) * (len(arrays) - 1 - k))
                k += 1
    index = tuple(index)

    def f(w):
        return w[index]

    want = f(v)
    got = jax.jit(lambda w: eval_with_views(f, w))(v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if views:
        assert "gather" not in _lowered(f, v), index


def test_gather_as_view_rejects_non_affine_maps():
    """Direct check of the affine test: an index map that is affine on a prefix and
    then jumps must not be rewritten."""
    x = jnp.arange(20.0).reshape(4, 5)
    idx = np.array([[0], [1], [3]], np.int32)  # rows 0, 1, 3: not evenly spaced
    dn = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                        start_index_map=(0,))
    params = dict(dimension_numbers=dn, slice_sizes=(1, 5), indices_are_sorted=False,
                  unique_indices=False, mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
                  fill_value=None)
    assert gather_as_view(x, idx, params) is None
    idx = np.array([[1], [2], [3]], np.int32)
    np.testing.assert_array_equal(np.asarray(gather_as_view(x, idx, params)),
                                  np.asarray(x[1:4]))


def test_replay_is_differentiable():
    v = jnp.asarray(np.random.default_rng(2).normal(size=(3, 7, 5)).astype(np.float32))
    f = VIEWS["function_of_gather"]
    g1 = jax.grad(lambda w: jnp.sum(f(w) ** 2))(v)
    g2 = jax.jit(jax.grad(lambda w: jnp.sum(eval_with_views(f, w) ** 2)))(v)
    np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), rtol=1e-6)


def test_model_path_reads_the_value_matrix_without_a_gather():
    """The attention function from a model compiles to the same gather-free program as
    the kernel: the probe's Vindex no longer costs an element-wise pass over V."""
    H, n, d = 2, 13, 4

    def model(q, k, v):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", si.priors.Restricted.window(n, 3), si.scores.Dot(q, k))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    r = np.random.default_rng(3)
    q, k, v = (jnp.asarray(r.normal(size=(H, n, d)), jnp.float32) for _ in range(3))
    f = si.attention(model, "out")
    text = jax.jit(f).lower(q, k, v).compile().as_text()
    assert "gather(" not in text
    want = si.attention(model, "out", backend="exact")(q, k, v)
    np.testing.assert_allclose(np.asarray(f(q, k, v)), np.asarray(want), atol=2e-5)
