"""Multi-device kernels on 4 simulated CPU devices, against the single-device result.

XLA's device count is fixed when JAX starts, so the checks run in a subprocess
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` set before JAX is
imported. The script compares head/batch sharding (the same kernel on each slice:
equal to float32 rounding, 1e-6, as XLA may fuse a 1-head program differently from a
4-head one) and ring attention (float32, 2e-6: the
partial softmaxes are merged in a different order) with the single-device
blocked kernel, the ring gradients with the single-device gradients, and
``structinfer.attention(model, mesh=...)`` with the exact engine (and, in bfloat16,
that it answers in bfloat16). Then ``backend="pallas"`` with ``mesh=``: every shard runs
the Pallas kernel (interpreted; ring attention's steps with traced global offsets),
values and gradients against the single-device dense kernel.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import xla_flags

SCRIPT = textwrap.dedent(
    """
    import os
    assert "--xla_force_host_platform_device_count=4" in os.environ["XLA_FLAGS"]
    import jax, jax.numpy as jnp, numpy as np, numpyro
    import structinfer as si
    from numpyro.ops.indexing import Vindex
    from structinfer.lowering._lower import lower_edge
    from structinfer.lowering.blocked import blocked_attention
    from structinfer.lowering.sharded import head_sharded_attention, ring_attention

    assert len(jax.devices()) == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("x",))
    r = np.random.default_rng(0)
    H, n, m, D = 4, 20, 28, 5          # 20 / 4 = 5 children per device, not a block multiple
    q = r.normal(size=(H, n, D)).astype(np.float32)
    k = r.normal(size=(H, m, D)).astype(np.float32)
    v = r.normal(size=(H, m, 3)).astype(np.float32)
    bias = r.normal(size=(H, 2 * m - 1)).astype(np.float32)  # offset m - n
    HB = r.random((H, 5, 7)) < 0.5   # blocks of 4 x 4, one mask per head
    HB[..., 0] = True
    cases = {
        "relpos_causal": si.priors.RelativePosition(bias, m, causal=True, offset=m - n),
        "window": si.priors.Restricted.window(n, 3, m, offset=m - n),   # empty chunk pairs
        # on one device the blocked kernel reads the heads' block mask per block; on a
        # shard of the heads it reads the shard's (n, m) mask
        "block_sparse_heads": si.priors.Restricted.block_sparse(HB, 4),
    }
    for name, prior in cases.items():
        low = lower_edge(prior, si.scores.Dot(q, k, scale=0.5), v, n, (H,))
        single = jax.jit(lambda p: blocked_attention(low.terms, p, (H,), block_q=4, block_k=8,
                                                    mask=low.mask))
        heads = jax.jit(lambda p: head_sharded_attention(low.terms, p, (H,), mesh, block_q=4,
                                                         block_k=8, mask=low.mask))
        ring = jax.jit(lambda p: ring_attention(low.terms, p, (H,), mesh, block_q=4, block_k=8))
        y0, l0 = single(low.problem)
        y1, l1 = heads(low.problem)
        y2, l2 = ring(low.problem)
        # the same kernel on each slice; XLA may fuse a 1-head and a 4-head program
        # differently (an ulp apart), so equal to float32 rounding rather than bit-exact
        np.testing.assert_allclose(y1, y0, atol=1e-6, rtol=0)
        np.testing.assert_allclose(l1, l0, atol=1e-6, rtol=0)
        np.testing.assert_allclose(y2, y0, atol=2e-6)
        np.testing.assert_allclose(l2, l0, atol=2e-6)
        if name == "block_sparse_heads":  # without the mask's value: the (n, m) mask
            y3, _ = jax.jit(lambda p: blocked_attention(low.terms, p, (H,), block_q=4,
                                                        block_k=8))(low.problem)
            np.testing.assert_allclose(y0, y3, atol=1e-6)
        if name in ("relpos_causal", "block_sparse_heads"):
            loss = lambda f: (lambda p: jnp.sum(jnp.sin(f(p)[0])))
            g0 = jax.jit(jax.grad(loss(single), allow_int=True))(low.problem)
            for f in (ring, heads):
                g = jax.jit(jax.grad(loss(f), allow_int=True))(low.problem)
                for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g)):
                    if a.dtype != jax.dtypes.float0:
                        np.testing.assert_allclose(b, a, atol=2e-5)
        print("ok", name)

    # the whole model, sharded over heads and over the sequence, vs the exact engine
    def mha(q, k, v):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", si.priors.Restricted.causal(n, m, offset=m - n),
                        si.scores.Dot(q, k, scale=0.5))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    ref = jax.jit(lambda *a: si.expectation(mha, "out", *a))(q, k, v)
    for shard in ("heads", "sequence"):
        f = si.attention(mha, "out", "blocked", mesh=mesh, shard=shard, block_q=4, block_k=8)
        np.testing.assert_allclose(f(q, k, v), ref, atol=2e-5)
        print("ok model", shard)

    # bfloat16 in, bfloat16 out (ring attention merges its chunks in float32), with the
    # precision argument passed to every device's kernel
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    for shard in ("heads", "sequence"):
        f = si.attention(mha, "out", "blocked", mesh=mesh, shard=shard, block_q=4, block_k=8,
                         precision="highest")
        yb = f(qb, kb, vb)
        assert yb.dtype == jnp.bfloat16, yb.dtype
        np.testing.assert_allclose(np.asarray(yb, np.float32), ref, atol=3e-2)
        print("ok bfloat16", shard)
    """
)


#: ``attention(..., backend="pallas", mesh=mesh)`` on the (prior, shard) pairs ``CASES``
#: against the single-device dense kernel: values and gradients, and that the program
#: holds the Pallas kernel's forward and backward
PALLAS_SCRIPT = textwrap.dedent(
    """
    import os, re
    assert "--xla_force_host_platform_device_count=4" in os.environ["XLA_FLAGS"]
    import jax, jax.numpy as jnp, numpy as np, numpyro
    import structinfer as si
    from numpyro.ops.indexing import Vindex

    assert len(jax.devices()) == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("x",))
    r = np.random.default_rng(1)
    H, n, D = 4, 32, 8               # 8 children and parents per device in the ring
    q, k = (r.normal(size=(H, n, D)).astype(np.float32) for _ in range(2))
    v = r.normal(size=(H, n, 3)).astype(np.float32)
    e = (0.5 * r.normal(size=(H, 2 * n - 1))).astype(np.float32)
    BLOCKS = np.eye(8, dtype=bool) | (r.random((8, 8)) < 0.3)
    priors = {  # the prior's parameter is the model's 4th argument (differentiated)
        "relpos_causal": lambda e: si.priors.RelativePosition(e, n, causal=True),
        "geometric": lambda e: si.priors.Geometric(0.05 + 0.5 * jax.nn.sigmoid(e[..., :n]),
                                                   n, max_distance=10),
        # a per-edge mask (no parameter: e's gradient is zero), cut by the ring's chunks
        "block_sparse": lambda e: si.priors.Restricted.block_sparse(BLOCKS, 4),
    }

    def run(f, *a):  # f(*a) jitted, and whether the Pallas forward / backward ran in it
        traced = jax.jit(f).trace(*a)
        names = set(re.findall(r"structinfer_attention\\w*", str(traced.jaxpr)))
        out = traced.lower().compile()(*a)
        return out, ("structinfer_attention" in names, "structinfer_attention_dkdv" in names)

    for name, shard in CASES:
        def model(q, k, v, e, prior=priors[name]):
            with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
                j = si.edge("phi", prior(e), si.scores.Dot(q, k, scale=0.4))
                numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

        loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
        dense = si.attention(model, "out", "dense")
        y0 = dense(q, k, v, e)
        g0 = jax.grad(loss(dense), argnums=(0, 1, 2, 3))(q, k, v, e)
        # the forced kernel reaches every shard: the Pallas kernel (interpreted here)
        f = si.attention(model, "out", "pallas", mesh=mesh, shard=shard)
        grad = jax.grad(loss(f), argnums=(0, 1, 2, 3))
        (y, _), ran = run(f.with_log_normalisers, q, k, v, e)
        assert ran == (True, False), ran
        np.testing.assert_allclose(y, y0, atol=2e-5)
        g, ran = run(grad, q, k, v, e)
        assert ran == (True, True), ran
        for i, (a, b) in enumerate(zip(g0, g)):
            assert np.abs(a).max() > 1e-3 or (i == 3 and name == "block_sparse")
            np.testing.assert_allclose(b, a, atol=5e-5)
        print("ok", name, shard)
    """
)


#: (prior, shard) of the Pallas kernel on a mesh: by default (in the test above) the ring
#: on the causal relative-position prior (traced offsets, chunk pairs above the diagonal
#: skipped, the table's gradient) and on a block-sparse mask (each chunk pair's slice of
#: the mask read in every block); the rest in the exhaustive tier
PALLAS_CASES = [("relpos_causal", "sequence"), ("block_sparse", "sequence"),
                ("geometric", "heads"), ("relpos_causal", "heads"), ("geometric", "sequence"),
                ("block_sparse", "heads")]
DEFAULT_PALLAS = 1


def _run(script: str, oks: int) -> None:
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == oks, proc.stdout


HUGE_LOGITS_SCRIPT = textwrap.dedent(
    """
    import os, sys
    assert "--xla_force_host_platform_device_count=4" in os.environ["XLA_FLAGS"]
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, TESTS)
    from conftest import (assert_huge_logit_gradients, float32_softmax,
                          huge_logit_cotangents, huge_logit_edge)
    from structinfer.lowering.sharded import ring_attention

    mesh = jax.make_mesh((4,), ("x",))
    n = 32                      # 8 children and parents per device
    for causal in (False, True):
        mask = np.tri(n, dtype=bool) if causal else None
        low = huge_logit_edge(n, 8, jnp.float32, mask)
        ct = huge_logit_cotangents(low)
        ref = jax.vjp(lambda p: float32_softmax(p, mask), low.problem)
        for kernel in ("blocked", "pallas"):
            f = lambda p: ring_attention(low.terms, p, (2,), mesh, block_q=8, block_k=8,
                                         kernel=kernel)
            out, vjp = jax.vjp(jax.jit(f), low.problem)
            np.testing.assert_allclose(out[0], ref[0][0], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(out[1], ref[0][1], rtol=1e-6)
            assert_huge_logit_gradients(vjp(ct)[0], ref[1](ct)[0])
            print("ok", kernel, causal)
    """
)


@pytest.mark.exhaustive  # (a 4-device subprocess, ~20 s; the default tier runs the kernels'
# own huge-logit tests and the sharded runners on a one-device mesh)
def test_ring_attention_gradients_of_rows_of_huge_logits():
    r"""Regression: ring attention (4 simulated devices; blocked and Pallas steps) on rows
    whose every key carries a finite -1e9 bias, where float32 rounds each chunk's row max
    $m$ and $L = m + \log l$ to the same number: the chunks are merged by their $m$ and
    $\log l$ (merging by $L$ weighed every chunk alike, whatever its number of allowed
    keys) and each step's backward rebuilds $p$ from the global $m$ and $\log l$, so y,
    L and dq, dk, dbias, dv equal a plain float32 softmax's of the same rounded logits,
    without and with a causal mask (chunks a row sees in part)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    _run(f"TESTS = {tests!r}\n" + HUGE_LOGITS_SCRIPT, 4)


@pytest.mark.exhaustive  # (a 4-device subprocess, ~30 s)
def test_sharded_and_ring_attention_on_four_simulated_devices():
    # one subprocess (JAX starts once): the blocked kernel's checks, then the Pallas
    # kernel's default case
    _run(SCRIPT + f"\nCASES = {PALLAS_CASES[:DEFAULT_PALLAS]!r}\n" + PALLAS_SCRIPT,
         7 + DEFAULT_PALLAS)


@pytest.mark.exhaustive
def test_sharded_runners_run_the_pallas_kernel_on_four_simulated_devices():
    """``attention(..., backend="pallas", mesh=mesh)``: each shard runs the Pallas kernel
    (interpreted on these CPU devices; its forward and backward are in the program) —
    head sharding over the heads, ring attention with the Pallas passes given each chunk
    pair's traced global offsets and merged by their log-normalisers — and the values and
    gradients (queries, keys, values, the relative-position table / geometric q) equal the
    single-device dense kernel's, for a causal relative-position, a truncated geometric
    and a block-sparse prior, with each sharding (the default tier runs one pair)."""
    _run(f"CASES = {PALLAS_CASES[DEFAULT_PALLAS:]!r}\n" + PALLAS_SCRIPT,
         len(PALLAS_CASES) - DEFAULT_PALLAS)


CUDNN_MESH_SCRIPT = '''
import jax, jax.numpy as jnp, numpy as np, numpyro
from numpyro.ops.indexing import Vindex
import structinfer as si
from structinfer.lowering import accel
accel.platform = lambda: "gpu"  # cuDNN stood in for by JAX's XLA implementation
real = jax.nn.dot_product_attention
def fake(q, k, v, bias=None, *, implementation=None, **kw):
    up = lambda x: None if x is None else x.astype(jnp.float32)
    y, res = real(up(q), up(k), up(v), up(bias), implementation="xla", **kw)
    return y.astype(q.dtype), res
accel.jax.nn.dot_product_attention = fake
H, n, d = 8, 64, 16
def model(q, k, v):
    with numpyro.plate("heads", H, dim=-2), numpyro.plate("q", n, dim=-1):
        j = si.edge("phi", si.priors.Restricted.causal(n), si.scores.Dot(q, k, scale=0.25))
        numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])
mesh = jax.make_mesh((4,), ("heads",), axis_types=(jax.sharding.AxisType.Auto,))
r = np.random.default_rng(0)
q, k, v = (jnp.asarray(r.normal(size=(H, n, d)), jnp.bfloat16) for _ in range(3))
f = jax.jit(si.attention(model, "out", "cudnn", mesh=mesh))
text = f.lower(q, k, v).compile().as_text()
assert not any(c in text for c in ("all-gather", "all-reduce", "all-to-all")), text
want = jax.jit(si.attention(model, "out", "cudnn"))(q, k, v)
np.testing.assert_allclose(np.asarray(f(q, k, v), np.float32), np.asarray(want, np.float32),
                           atol=1e-2)
print("ok")
'''


def test_cudnn_on_a_mesh_writes_its_nan_rows_without_a_collective():
    """Regression (review): on a mesh the cuDNN path wrote its NaN rows a second time on
    the global output with a scatter, whose row indices the partitioner gathered across
    the devices. The rows are written per shard; the program has no collective."""
    import jax

    if not hasattr(jax.sharding, "AxisType"):
        pytest.skip("this JAX has no mesh axis types")
    _run(CUDNN_MESH_SCRIPT, 1)


def _mha_model():
    """A multi-head causal attention model of any size (for the argument checks)."""
    import numpyro
    from numpyro.ops.indexing import Vindex

    import structinfer as si

    def mha(q, k, v):
        H, n = q.shape[:2]
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", si.priors.Restricted.causal(n, k.shape[1]),
                        si.scores.Dot(q, k))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    return mha


def test_sharded_runners_run_on_a_one_device_mesh():
    """Regression: on JAX 0.4.33 (the floor) ``attention(..., mesh=...)`` failed on import:
    it used ``jax.shard_map`` and ``jax.sharding.AxisType``, which that release lacks. Both
    ways of sharding run on a one-device mesh (no other device needed) and give the
    exact engine's answer."""
    import jax
    import numpy as np

    import structinfer as si

    mha = _mha_model()
    mesh = jax.make_mesh((1,), ("x",))
    r = np.random.default_rng(3)
    q, k, v = (r.normal(size=(2, 5, 3)).astype(np.float32) for _ in range(3))
    want = si.expectation(mha, "out", q, k, v)
    for shard in ("heads", "sequence"):
        got = jax.jit(si.attention(mha, "out", mesh=mesh, shard=shard))(q, k, v)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=shard)


def test_mesh_arguments_are_checked_when_attention_is_built():
    """Regression: a wrong ``axis_name`` was found only at the first call, a mesh that is
    not a ``jax.sharding.Mesh`` gave an AttributeError there, and ``shard=`` /
    ``axis_name=`` without ``mesh=``, ``mesh=`` with ``backend="exact"`` and ``runner=``
    with ``mesh=`` were silently ignored. Each is refused when ``attention`` is built,
    naming the argument and what it takes (a one-device mesh: no other device needed)."""
    import jax

    import structinfer as si
    from structinfer.lowering.sharded import head_sharded

    mha = _mha_model()
    mesh = jax.make_mesh((1,), ("x",))
    with pytest.raises(ValueError, match=r"axis_name 'y' is not an axis of the mesh: "
                                         r"expected one of \('x',\)"):
        si.attention(mha, "out", mesh=mesh, axis_name="y")
    with pytest.raises(ValueError, match=r"mesh has axes \('a', 'b'\): pass axis_name"):
        si.attention(mha, "out", mesh=jax.make_mesh((1, 1), ("a", "b")))
    for bad in ("x", mesh.abstract_mesh):
        with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh .*got "
                                            f"{type(bad).__name__}"):
            si.attention(mha, "out", mesh=bad)
    for kw in ({"shard": "sequence"}, {"shard": "heads"}, {"axis_name": "x"}):
        (name, given), = kw.items()
        with pytest.raises(ValueError, match=f"attention: {name}={given!r} needs mesh="):
            si.attention(mha, "out", **kw)
    with pytest.raises(ValueError, match=r"shard must be one of \('heads', 'sequence'\), "
                                         "got 'rows'"):
        si.attention(mha, "out", mesh=mesh, shard="rows")
    with pytest.raises(ValueError, match="attention: mesh= .* backend='exact'"):
        si.attention(mha, "out", "exact", mesh=mesh)
    with pytest.raises(ValueError, match="attention: pass mesh= or runner=, not both"):
        si.attention(mha, "out", mesh=mesh, runner=lambda *a: None)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        head_sharded(None)


def test_an_empty_shard_and_an_unused_mesh_are_said():
    """Regression: ``shard=""`` was read as ``"heads"``; it is refused, naming the argument
    and the values it takes. And ``f.explain`` of ``attention(..., mesh=...)`` for a model
    that falls back to the exact engine said nothing of the mesh: it says the mesh is not
    used and why (the exact engine runs on one device)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as dist

    import structinfer as si

    mha = _mha_model()
    mesh = jax.make_mesh((1,), ("x",))
    with pytest.raises(ValueError, match=r"attention: shard must be one of \('heads', "
                                         r"'sequence'\), got '' \(None, the default: "
                                         r"'heads'\)"):
        si.attention(mha, "out", mesh=mesh, shard="")

    def mixed(q, k, v):  # an enumerated site that is no edge: the exact engine runs it
        c = numpyro.sample("c", dist.Categorical(jnp.ones(2) / 2),
                           infer={"enumerate": "parallel"})
        with numpyro.plate("queries", q.shape[0]):
            j = si.edge("phi", si.priors.Uniform(k.shape[0]), si.scores.Dot(q * (c + 1), k))
            numpyro.deterministic("out", v[j])

    x = np.ones((3, 2), np.float32)
    e = si.attention(mixed, "out", mesh=mesh).explain(x, x, x)
    assert e.path == "exact" and e.fallback is not None
    said = ("mesh= is not used: the model falls back to the exact engine, which runs on one "
            "device")
    assert said in e.mesh and said in str(e), str(e)
    assert si.explain(mixed, "out", x, x, x).mesh == ""  # no mesh, nothing to say
    lowered = si.attention(mha, "out", mesh=mesh).explain(*(np.ones((2, 4, 2), np.float32),) * 3)
    assert lowered.path == "lowered" and lowered.mesh == ""


def test_a_mesh_the_exact_engine_does_not_use_is_said_at_call_time():
    """Regression: ``attention(..., mesh=...)`` on a model that falls back to the exact
    engine (which runs on one device) said so only in ``f.explain``; the call was silent.
    The call warns (`MeshFallbackWarning`), with the reason, once per trace: again for new
    shapes, not for a call that reuses the trace, nor without a mesh or for a lowered
    model. The answer is the exact engine's."""
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as dist

    import structinfer as si
    from structinfer.lowering import MeshFallbackWarning

    def mixed(q, k, v):  # an enumerated site that is no edge: the exact engine runs it
        c = numpyro.sample("c", dist.Categorical(jnp.ones(2) / 2),
                           infer={"enumerate": "parallel"})
        with numpyro.plate("queries", q.shape[0]):
            j = si.edge("phi", si.priors.Uniform(k.shape[0]), si.scores.Dot(q, k))
            numpyro.deterministic("out", v[j] * (c + 1.0)[..., None])

    mesh = jax.make_mesh((1,), ("x",))
    f = si.attention(mixed, "out", mesh=mesh)
    x = np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(3, 2)
    said = (r"structinfer.attention: mesh= is not used: the model falls back to the exact "
            r"engine, which runs on one device \(a mesh shards the lowered kernels only\): "
            r"site 'c': ")
    with pytest.warns(MeshFallbackWarning, match=said) as caught:
        out = f(x, x, x)
    # (older JAX releases also warn, from funsor, that a tracer was hashed: not counted)
    assert len([w for w in caught if issubclass(w.category, MeshFallbackWarning)]) == 1
    np.testing.assert_allclose(out, si.expectation(mixed, "out", x, x, x), rtol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MeshFallbackWarning)
        f(x, x, x)  # the same trace: said once
        si.attention(mixed, "out")(x, x, x)  # no mesh: nothing to say
        si.attention(_mha_model(), "out", mesh=mesh)(*(np.ones((2, 4, 2), np.float32),) * 3)
    with pytest.warns(MeshFallbackWarning, match=said):
        f(x[:2], x, x)  # new shapes: a new trace


def test_explain_reports_the_sharded_plan():
    """Regression: ``f.explain`` of ``attention(..., mesh=...)`` described the
    single-device path. It names, per edge, the mesh axis and its devices, heads or ring
    attention, and the kernel each shard (each ring step) runs."""
    import jax
    import numpy as np

    import structinfer as si

    mha = _mha_model()
    mesh = jax.make_mesh((1,), ("x",))
    q = np.ones((2, 8, 4), np.float32)
    heads = si.attention(mha, "out", "dense", mesh=mesh).explain(q, q, q)
    assert heads.kernels == {"phi": "dense"}
    assert heads.sharding == {"phi": "heads / batch split over mesh axis 'x' (1 device): "
                                     "each device runs the dense kernel on its slice"}
    assert "edge 'phi' on the mesh: heads / batch split over mesh axis 'x'" in str(heads)
    ring = si.attention(mha, "out", "dense", mesh=mesh, shard="sequence").explain(q, q, q)
    assert ring.sharding == {"phi": "ring attention over mesh axis 'x' (1 device): children "
                                    "and parents in 1 chunk each, the parents passed round "
                                    "the ring; each step runs the blocked kernel"}
    assert si.explain(mha, "out", q, q, q).sharding == {}  # one device

    # a Markov chain runs on one device (the mesh does not apply): said, not left out
    import jax.numpy as jnp
    import numpyro
    from numpyro.contrib.control_flow import scan

    def hmm(scores, log_transition):
        prior = si.priors.Markov(log_transition, jnp.zeros(3))

        def step(previous, score_t):
            z = si.edge("z", prior, score_t, previous=previous)
            numpyro.deterministic("v", jax.nn.one_hot(z, 3))
            return z, None

        scan(step, jnp.asarray(-1), scores)

    chain = si.attention(hmm, "v", mesh=mesh).explain(jnp.zeros((4, 3)), jnp.zeros((3, 3)))
    assert chain.kernels == {"z": "markov_scan"}
    assert chain.sharding == {"z": "runs on one device (a Markov chain's scan is not sharded)"}


#: sizes the mesh axis of 4 devices does not divide: each error names the edge site, the
#: sharding, the mesh axis and what it expected, from the call and from ``f.explain``
INDIVISIBLE_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np, pytest
    import structinfer as si

    mesh = jax.make_mesh((4,), ("x",))
    heads = (r"edge site 'phi': shard='heads' splits the leading batch dim .* over the 4 "
             r"devices of mesh axis 'x': expected it divisible by 4, got batch shape \\(3,\\)")
    ring = (r"edge site 'phi': ring attention \\(shard='sequence'\\) splits the children "
            r"and the parents over the 4 devices of mesh axis 'x': expected both divisible "
            r"by 4, got 6 children and 8 parents")
    for shard, shape, said in (("heads", (3, 8, 2), heads), ("sequence", (4, 6, 2), ring)):
        f = si.attention(MHA, "out", "blocked", mesh=mesh, shard=shard)
        q, kv = np.ones(shape, np.float32), np.ones((shape[0], 8, 2), np.float32)
        for call in (f, f.explain):
            with pytest.raises(ValueError, match=said):
                call(q, kv, kv)
        print("ok", shard)
    """
)


def test_sizes_a_mesh_axis_does_not_divide_are_refused_naming_the_edge_site():
    """Regression: a head count (leading plate) or sequence length the mesh axis does not
    divide gave a message naming neither the edge site nor the sharding; it names both,
    the mesh axis and what was expected, from the call and from ``f.explain``."""
    import inspect

    model = textwrap.dedent(inspect.getsource(_mha_model))
    _run(model + "\nMHA = _mha_model()\n" + INDIVISIBLE_SCRIPT, 2)
