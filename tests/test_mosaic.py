"""The Mosaic GPU (Hopper) kernels, `structinfer.lowering.mosaic`: the forward and the
backward's dQ and dK/dV passes.

What they refuse; their values in Pallas' Mosaic GPU interpreter on this CPU; their lowering
for CUDA on this CPU; and on an NVIDIA Hopper GPU their values and gradients against
the dense kernel (`pytest -m gpu`).

* Interpreted: JAX's Mosaic GPU interpreter (``jax._src``, JAX 0.10) runs the kernel's
  three warpgroups as threads over emulated shared memory, TMA copies and barriers (a
  barrier phase skipped or completed twice raises, or leaves a thread waiting for ever,
  which a watchdog turns into a failure; reads of memory never written give NaN), but
  lacks a few primitives the kernel uses; `mosaic_interpreted`
  stands in for them: register layout casts are the identity, a layout-annotated load is
  a plain read, a pre-initialised accumulator is a fresh one added to its initial value,
  and ``wgmma`` also takes a transposed shared-memory operand and a register one (the
  kernel's $q k^\top$ and $p V$); a TMA reduction (``copy_smem_to_gmem(...,
  reduction_op="add")``) adds into its destination, one at a time, as the hardware's
  atomic one does, and the kernels launched with mutable zero-initialised sums
  (``pl.kernel`` on refs, whose memory space is left unset) see them in global memory.
  Where that API differs (other JAX releases) these
  tests skip, or fail where ``STRUCTINFER_TEST_MOSAIC_INTERPRETER=require`` (CI).
* Lowered: needs JAX's Mosaic GPU bindings, which ship with JAX's CUDA plugin; CI
  installs the plugin, without its GPU runtime, for this file (`.ci/run`); elsewhere those
  tests skip. Lowering runs the whole Mosaic GPU compiler down to NVVM: shared-memory
  layouts and transfers, warpgroup matmul shapes, register layouts of every term.
"""

import contextlib
import dataclasses
import faulthandler
import functools
import os
import re
import threading
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import (
    assert_huge_logit_gradients,
    float32_softmax,
    huge_logit_cotangents,
    huge_logit_edge,
    on_hopper,
)
from numpyro.ops.indexing import Vindex

import structinfer as si
from structinfer.lowering import KERNELS, NotLowerableError, explain
from structinfer.lowering._lower import lower_edge
from structinfer.lowering._softmax import RowStats, backward_delta
from structinfer.lowering.accel import pallas_backward
from structinfer.lowering.dense import dense_attention
from structinfer.lowering.mosaic import (
    mosaic_backward,
    mosaic_backward_refusals,
    mosaic_dkdv,
    mosaic_dkdv_unsupported,
    mosaic_dq,
    mosaic_dq_unsupported,
    mosaic_forward,
    mosaic_unsupported,
)

pytestmark = pytest.mark.gpu

H = 2

PRIORS = {
    "causal": lambda n, e: si.priors.Restricted.causal(n),
    "window": lambda n, e: si.priors.Restricted.window(n, 100),
    "strict_causal": lambda n, e: si.priors.Restricted.causal(n, include_self=False),
    "relpos": lambda n, e: si.priors.RelativePosition(e, n, causal=True),
    "relpos_full": lambda n, e: si.priors.RelativePosition(e, n),
    "geometric": lambda n, e: si.priors.Geometric(jnp.full((H, n), 0.02), n),
    "geometric_band": lambda n, e: si.priors.Geometric(jnp.full((H, n), 0.05), n,
                                                       max_distance=150),
    "bias": lambda n, e: si.priors.Categorical(e[:, None, :n]),
    "uniform": lambda n, e: si.priors.Uniform(n),
    # blocks of 128: its own and the earlier ones, and the first block column; the last
    # block cut short when n is not a multiple of 128
    "block_sparse": lambda n, e: si.priors.Restricted.block_sparse(
        np.tri(-(-n // 128), dtype=bool) | (np.arange(-(-n // 128)) == 0), 128, n, n),
}


def _bindings():
    try:
        from jax._src.lib import mosaic_gpu  # noqa: F401
    except Exception as err:  # noqa: BLE001 (ModuleNotFoundError, or the plugin's own)
        pytest.skip(f"no Mosaic GPU bindings here (they come with JAX's CUDA plugin): {err}")


def _inputs(n, d, dtype, dv=None, seed=0):
    r = np.random.default_rng(seed)
    q, k = (jnp.asarray(r.normal(size=(H, n, d)), dtype) for _ in range(2))
    v = jnp.asarray(r.normal(size=(H, n, dv or d)), dtype)
    e = jnp.asarray(r.normal(size=(H, 2 * n - 1)), jnp.float32)
    return q, k, v, e


def _low(case, n, d, dtype, dv=None):
    q, k, v, e = _inputs(n, d, dtype, dv)
    return lower_edge(PRIORS[case](n, e), si.scores.Dot(q, k, scale=d ** -0.5), v, n, (H,))


def _model(case, n):
    def model(q, k, v, e):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", PRIORS[case](n, e),
                        si.scores.Dot(q, k, scale=q.shape[-1] ** -0.5))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    return model


def _custom_calls(text: str) -> list[str]:
    return re.findall(r"custom_call @([\w$.]+)", text)


def _interpreter_patches():
    """``[(object, name, stand-in)]`` that let the Mosaic GPU interpreter run the kernel
    (see the module docstring), or a pytest skip where this JAX's interpreter differs."""
    try:
        from jax._src import callback
        from jax._src.pallas.mosaic.interpret import utils as iutils
        from jax._src.pallas.mosaic_gpu import core as gpu_core
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        from jax._src.state import types as state_types
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        interpreter = jaxpr_interpret.JaxprInterpreter
        interpreter._interpret_wgmma_ref_p  # noqa: B018
        gpu_callbacks._get_shared_memory, gpu_callbacks.HostAllocationKey  # noqa: B018
        gpu_callbacks.copy_smem_to_gmem, gpu_callbacks.is_gmem_memory_space  # noqa: B018
    except (ImportError, AttributeError) as err:
        why = f"this JAX's Mosaic GPU interpreter differs: {err}"
        if os.environ.get("STRUCTINFER_TEST_MOSAIC_INTERPRETER") == "require":
            pytest.fail(why)
        pytest.skip(why)

    plain_run_state = pl.run_state

    def run_state(f):  # pre-initialised accumulators: fresh ones plus their initial values
        def run(inits):
            leaves, tree = jax.tree.flatten(inits, is_leaf=lambda x: hasattr(x, "_init"))
            if not all(hasattr(x, "_init") for x in leaves):  # arrays (outside a kernel)
                return plain_run_state(f)(inits)
            init = [x._init for x in leaves]

            def body(*refs):
                f(jax.tree.unflatten(tree, refs))
                return tuple(r[...] for r in refs)

            outs = pl.run_scoped(body, *[plgpu.ACC(x.shape, x.dtype) for x in init])
            return jax.tree.unflatten(tree, [a + b for a, b in zip(init, outs)])

        return run

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_key, acc_transforms,
              acc_dtype, a_key, a_transforms, b_key, b_transforms, a_value, source_info):
        device_id, thread_id = int(device_id), int(thread_id)
        memory = gpu_callbacks._get_shared_memory()
        tid = memory.get_global_thread_id(device_id, thread_id)
        info = iutils.GPULoggingInfo(
            device_id=device_id, grid_point_coords=tuple(int(x) for x in grid_point_coords),
            thread_id=thread_id, source_info=source_info)

        def ref_range(key, transforms):  # the ref's window, and its transposes after it
            transforms = gpu_callbacks._remove_noop_transforms(transforms)
            idx = [t for t in transforms if not isinstance(t, state_types.TransposeTransform)]
            perms = [t.permutation for t in transforms
                     if isinstance(t, state_types.TransposeTransform)]
            key = gpu_callbacks.HostAllocationKey.from_array(key)
            return key, iutils.to_range(jax.tree.map(int, tuple(idx))), perms

        def read(key, transforms):
            key, rng, perms = ref_range(key, transforms)
            x = memory.get_buffer_content(key, rng, tid, logging_info=info)[0]
            for p in perms:
                x = np.transpose(x, p)
            return x

        a = np.asarray(a_value) if a_value is not None else read(a_key, a_transforms)
        b = read(b_key, b_transforms)
        key, rng, _ = ref_range(acc_key, acc_transforms)
        acc = memory.get_buffer_content(key, rng, tid, logging_info=info)[0]
        out = acc + np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(acc_dtype)
        memory.store_buffer_content(key, rng, out, tid, logging_info=info)
        return token

    def wgmma_rule(self, eqn, token, get_invals):
        acc, a, b, *leaves = get_invals()
        empty = jax.tree.structure([])
        acc_t, a_t, b_t = jax.tree.unflatten(jax.tree_util.treedef_tuple(tuple(
            eqn.params[f"{x}_transforms_tree"] or empty for x in ("acc", "a", "b"))), leaves)
        a_in_regs = not isinstance(eqn.invars[1].aval, state_types.AbstractRef)
        return callback.io_callback(
            functools.partial(wgmma, acc_dtype=eqn.invars[0].aval.dtype,
                              source_info=eqn.source_info),
            gpu_callbacks.TOKEN_SHAPE_DTYPE, token=token,
            device_id=self.device_info.device_id, grid_point_coords=self.grid_point_coords,
            thread_id=self.thread_id, acc_key=acc, acc_transforms=acc_t,
            a_key=acc if a_in_regs else a, a_transforms=() if a_in_regs else a_t,
            b_key=b, b_transforms=b_t, a_value=a if a_in_regs else None, ordered=True), []

    def load(src, idx=(), *, layout=None, optimized=True):  # JAX 0.11's signature
        return src[...] if idx == () else src[idx]

    def same(x, layout):
        return x

    copy = gpu_callbacks.copy_smem_to_gmem
    adding = threading.Lock()

    def copy_smem_to_gmem(**kw):  # a TMA reduction: read, add, write, one at a time
        op = kw.get("reduction_op")
        if op is None:
            return copy(**kw)
        assert op == "add", op
        memory = gpu_callbacks._get_shared_memory()
        tid = memory.get_global_thread_id(int(kw["device_id"]), int(kw["thread_id"]))

        def where(side):
            key = gpu_callbacks.HostAllocationKey.from_array(kw[f"{side}_allocation_key_as_array"])
            t = gpu_callbacks._remove_noop_transforms(kw[f"{side}_transforms"])
            return key, iutils.to_range(jax.tree.map(int, t))

        (src_key, src), (dst_key, dst) = where("src"), where("dst")
        with adding:
            x = memory.get_buffer_content(src_key, src, tid, increment_clock=False)[0]
            y = memory.get_buffer_content(dst_key, dst, tid, increment_clock=False)[0]
            memory.store_buffer_content(dst_key, dst, y + x, tid, increment_clock=False)
        return kw["token"]

    gmem = gpu_callbacks.is_gmem_memory_space

    def is_gmem(space):  # pl.kernel's refs (the sums) carry no memory space
        return space is None or gmem(space)

    params = InterpretGPUParams(detect_races=True)
    return [(gpu_core, "layout_cast", same), (plgpu, "layout_cast", same),
            (plgpu, "load", load), (pl, "run_state", run_state),
            (interpreter, "_interpret_wgmma_ref_p", wgmma_rule),
            (gpu_callbacks, "copy_smem_to_gmem", copy_smem_to_gmem),
            (gpu_callbacks, "is_gmem_memory_space", is_gmem),
            (plgpu, "kernel", functools.partial(plgpu.kernel, interpret=params)),
            (pl, "kernel", functools.partial(pl.kernel, interpret=params))]


#: seconds an interpreted test may take before the watchdog ends its process (a thread
#: left waiting on a barrier; the tests take 4-10 s)
WATCHDOG_S = 240


@pytest.fixture
def mosaic_interpreted(monkeypatch):
    """`mosaic_forward` runs in Pallas' Mosaic GPU interpreter (module docstring);
    yields a function that says whether its race detector found a race. A watchdog ends
    the process, printing every thread's stack, if the test outlives `WATCHDOG_S`."""
    patches = _interpreter_patches()
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    for obj, name, value in patches:
        monkeypatch.setattr(obj, name, value)
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        yield lambda: bool(gpu_callbacks.get_races().races_found)
    finally:
        faulthandler.cancel_dump_traceback_later()
    with contextlib.suppress(Exception):  # after a failure the interpreter needs a reset
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

        interpret_pallas_call.reset_gpu_interpret_mode_state()


# --- what it refuses ---------------------------------------------------------------------


@pytest.mark.parametrize(("change", "why"), [
    (dict(dtype=jnp.float32), r"float16 / bfloat16"),
    (dict(n=100), r"100 children and 100 parents \(the Mosaic GPU kernel needs at least 128"),
    (dict(d=512), r"head dims 512 and 512 \(the Mosaic GPU kernel: at most 256\)"),
    (dict(d=256, case="relpos"), r"shared memory with 2 pipeline slots \(over 201 KiB\)"),
])
def test_mosaic_refuses_what_it_cannot_run_and_says_why(change, why):
    args = dict(case="causal", n=256, d=128, dtype=jnp.bfloat16) | change
    low = _low(args["case"], args["n"], args["d"], args["dtype"])
    assert re.search(why, mosaic_unsupported(low.terms, low.problem, low.batch_shape,
                                             low.mask))
    with pytest.raises(ValueError, match="mosaic_forward: .*" + why):
        mosaic_forward(low.terms, low.problem, low.batch_shape, mask=low.mask)


@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "keys"])
@pytest.mark.parametrize("table", [jnp.float32, jnp.bfloat16])
def test_a_masked_relative_position_edge_fits_every_pass(table, blocks):
    """The configuration at the edge of the shared-memory budget: a trained
    relative-position table with a block-causal mask (block lists) or a key-padding
    mask, head dim 128, bfloat16, n = 2048: the forward, dQ and dK/dV passes (with the
    table's gradient) all fit, so none falls back to the Triton kernel."""
    n = 2048
    q, k, v, e = _inputs(n, 128, jnp.bfloat16)
    keep = (np.kron(np.tri(n // 128, dtype=bool), np.ones((128, 128), bool)) if blocks
            else jnp.arange(n)[None, :] < n - 100)
    prior = si.priors.Masked(si.priors.RelativePosition(e.astype(table), n), keep)
    low = lower_edge(prior, si.scores.Dot(q, k, scale=128 ** -0.5), v, n, (H,))
    args = (low.terms, low.problem, low.batch_shape, low.mask)
    assert mosaic_unsupported(*args) is None
    assert mosaic_dq_unsupported(*args) is None
    assert mosaic_dkdv_unsupported(*args) is None
    assert mosaic_dkdv_unsupported(*args, table_grad=True) is None


def test_mosaic_refuses_masks_it_would_read_and_non_dot_scores():
    """A per-edge mask runs as block lists only when it allows all or none of every
    128 x 64 tile (the kernel never reads a mask): blocks of 96 do not, nor does a mask
    not known at trace time; an IDW score is not a dot product."""
    n = 384
    q, k, v, _ = _inputs(n, 64, jnp.bfloat16)
    sparse = si.priors.Restricted.block_sparse(np.tri(4, dtype=bool), 96)
    low = lower_edge(sparse, si.scores.Dot(q, k), v, n, (H,))
    why = mosaic_unsupported(low.terms, low.problem, low.batch_shape, low.mask)
    assert "allows part of a 128 x 64 tile" in why
    with pytest.raises(ValueError, match="allows part of a 128 x 64 tile"):
        mosaic_forward(low.terms, low.problem, low.batch_shape, mask=low.mask)
    aligned = si.priors.Restricted.block_sparse(np.tri(3, dtype=bool), 128)
    low = lower_edge(aligned, si.scores.Dot(q, k), v, n, (H,))
    assert mosaic_unsupported(low.terms, low.problem, low.batch_shape, low.mask) is None
    assert "not known at trace time" in mosaic_unsupported(low.terms, low.problem,
                                                           low.batch_shape)
    low = lower_edge(si.priors.Restricted.causal(n), si.scores.NegLogDist(q, k), v, n, (H,))
    assert "IDW" in mosaic_unsupported(low.terms, low.problem, low.batch_shape)


def test_mosaic_dkdv_table_grad_without_a_table_says_so():
    """Asking the dK/dV pass for a relative-position table's gradient on an edge without
    one is refused, naming the function and why (not a silent ``None``)."""
    low = _low("causal", 256, 64, jnp.bfloat16)
    assert mosaic_dkdv_unsupported(low.terms, low.problem, low.batch_shape) is None
    assert mosaic_dkdv_unsupported(low.terms, low.problem, low.batch_shape,
                                   table_grad=True) == "no relative-position table"
    with pytest.raises(ValueError, match="mosaic_dkdv: no relative-position table"):
        mosaic_dkdv(low.terms, low.problem, low.batch_shape, *_cotangents(low), low.mask,
                    table_grad=True)


@pytest.mark.parametrize("run", [mosaic_dq, mosaic_dkdv])
def test_mosaic_backward_passes_name_a_misshapen_argument(run):
    low = _low("causal", 256, 64, jnp.bfloat16)
    d_out, stats, delta = _cotangents(low)
    short = RowStats(stats.m[:, :255], stats.log_l[:, :255])
    with pytest.raises(ValueError, match=rf"{run.__name__}: stats.m of shape \(2, 255\), "
                                         r"expected \(2, 256\) \(batch, children\)"):
        run(low.terms, low.problem, low.batch_shape, d_out, short, delta)
    with pytest.raises(ValueError, match=r"d_out of shape \(2, 256, 32\), expected "
                                         r"\(2, 256, 64\) \(batch, children, value dim\)"):
        run(low.terms, low.problem, low.batch_shape, d_out[..., :32], stats, delta)


@pytest.mark.cpu_only
def test_forced_mosaic_off_a_gpu_says_so():
    """Forced on a CPU, with an edge it could run on a GPU: the kernel table's entry says
    the platform, from `attention` and `explain` alike."""
    n = 256
    q, k, v, e = _inputs(n, 64, jnp.bfloat16)
    model = _model("relpos", n)
    with pytest.raises(NotLowerableError, match="backend 'mosaic' cannot run edge site "
                       "'phi': Mosaic GPU runs on an NVIDIA GPU \\(the platform is cpu"):
        si.attention(model, "out", "mosaic")(q, k, v, e)
    with pytest.raises(NotLowerableError, match="Mosaic GPU runs on an NVIDIA GPU"):
        explain(model, "out", q, k, v, e, backend="mosaic")
    assert "mosaic" in si.lowering.BACKENDS
    assert KERNELS["mosaic"].label == "Mosaic GPU"


@pytest.mark.cpu_only
def test_auto_takes_mosaic_only_on_a_gpu_it_runs_on(gpu):
    """Lowering for CUDA from a CPU process (the platform faked): auto passes the Mosaic
    GPU kernel over, says why, and takes the Triton kernel."""
    n = 256
    ex = explain(_model("geometric", n), "out", *_inputs(n, 64, jnp.bfloat16))
    assert ex.kernels["phi"] == "pallas"
    assert "not Mosaic GPU: auto takes it only on a Hopper GPU of this process" in str(ex)
    # cuDNN chosen and refusing when traced (no cuDNN here): its fallback skips it too
    ex = explain(_model("relpos", n), "out", *_inputs(n, 64, jnp.bfloat16))
    assert ex.kernels["phi"] == "pallas" and "cuDNN refused at trace time" in str(ex)


@pytest.mark.cpu_only
@pytest.mark.parametrize("hopper", [True, False])
def test_auto_passes_cudnn_over_for_relpos_where_mosaic_runs(gpu, monkeypatch, hopper):
    """A relative-position table goes to the Mosaic GPU kernel, not to cuDNN with its bias
    table materialised, where that kernel runs in the process (faster where measured,
    inferred at these sizes); the priors cuDNN runs without a bias keep cuDNN, and
    relpos keeps it elsewhere."""
    from structinfer.lowering import kernels

    if hopper:  # as on a Hopper GPU: the Mosaic GPU kernel would run here
        monkeypatch.setattr(kernels, "_mosaic_runs_here", lambda low: True)
    n = 256
    for case in ("relpos", "relpos_full", "causal", "window", "uniform"):
        why = KERNELS["cudnn"].passed_over(_low(case, n, 64, jnp.bfloat16))
        if hopper and case.startswith("relpos"):
            assert why.startswith("the Mosaic GPU kernel is preferred for a relative-"), why
        else:
            assert why is None, (case, why)
    ex = explain(_model("relpos", n), "out", *_inputs(n, 64, jnp.bfloat16))
    assert ("not cuDNN: the Mosaic GPU kernel is preferred" in str(ex)) == hopper, str(ex)


# --- interpreted on this CPU ------------------------------------------------------------


def _dense_of(low):
    """The dense kernel's (y, L) on float32 copies of the lowered site's arrays."""
    up = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16)
                      else x, low.problem)
    return dense_attention(low.terms, up, low.batch_shape, "highest")


INTERPRETED = [("relpos", 256, 64, jnp.bfloat16)]
INTERPRETED_REST = [("geometric", 200, 64, jnp.float16), ("strict_causal", 256, 64, jnp.bfloat16),
                    ("window", 384, 64, jnp.bfloat16),
                    ("causal", 384, 64, jnp.float16), ("relpos_full", 320, 64, jnp.bfloat16),
                    ("block_sparse", 400, 64, jnp.bfloat16),
                    ("geometric_band", 384, 64, jnp.bfloat16), ("bias", 256, 128, jnp.bfloat16),
                    ("uniform", 200, 128, jnp.float16)]


@pytest.mark.cpu_only  # on a GPU the kernel itself runs (below)
@pytest.mark.parametrize(("case", "n", "d", "dtype"), INTERPRETED + [
    pytest.param(*c, marks=pytest.mark.exhaustive) for c in INTERPRETED_REST])
def test_mosaic_forward_interpreted_matches_the_dense_kernel(case, n, d, dtype,
                                                             mosaic_interpreted):
    """The kernel's schedule run as written, its three warpgroups as threads: y within
    16-bit tolerance of the dense kernel on float32 copies, L to float32 rounding, the
    rows with no allowed parent NaN with ``nan_rows`` (y = 0 without) and L = -inf, no
    barrier phase skipped, no race. Lengths over 2 parent blocks per slot pair reuse the
    pipeline's slots; n = 200 pads children and parents; the window skips blocks; the
    block-sparse mask (n = 400, the last block cut) is walked as block lists.

    ``nan_rows`` changes only the rows with no allowed parent (it adds 0, or NaN where L
    is not finite): both settings run on the case that has such rows (strict_causal,
    every row checked); the other cases run the kernel once (each run is seconds of
    interpreted warpgroups)."""
    low = _low(case, n, d, dtype)
    want_y, want_l = (np.asarray(x) for x in _dense_of(low))
    for nan_rows in (True, False) if case == "strict_causal" else (True,):
        y, lse = mosaic_forward(low.terms, low.problem, low.batch_shape, nan_rows=nan_rows,
                                mask=low.mask)
        assert y.dtype == dtype and lse.dtype == jnp.float32
        y, lse = np.asarray(y, np.float32), np.asarray(lse)
        empty = ~np.isfinite(want_l)
        assert empty.any() == (case == "strict_causal")
        np.testing.assert_array_equal(lse[empty], -np.inf)
        np.testing.assert_allclose(lse[~empty], want_l[~empty], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y[~empty], want_y[~empty], atol=2e-2, rtol=2e-2)
        assert np.isnan(y[empty]).all() if nan_rows else (y[empty] == 0).all()
    assert not mosaic_interpreted()


def _cotangents(low, seed=3):
    """``(d_out, stats, delta)`` for the backward passes: a random output cotangent, the
    dense kernel's L as row statistics (m = L, log l = 0: exact at these moderate logits),
    and delta from its y with a random cotangent of L."""
    y, lse = _dense_of(low)
    r = np.random.default_rng(seed)
    d_out = jnp.asarray(r.normal(size=y.shape), low.problem.v.dtype)
    d_lse = jnp.asarray(r.normal(size=lse.shape), jnp.float32)
    return d_out, RowStats.of_lse(lse), backward_delta(y, d_out, lse, d_lse, jnp.float32)


def _dense_vjp(low, d_out, stats, delta):
    """The dense kernel's gradients on float32 copies of the problem, for the cotangent of
    y ``d_out`` and the cotangent of L that gives ``delta`` (``stats``: the rows' L)."""
    lse = stats.lse()
    up = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16)
                      else x, low.problem)
    (y, _), vjp = jax.vjp(lambda p: dense_attention(low.terms, p, low.batch_shape, "highest"),
                          up)
    d_lse = jnp.sum(d_out.astype(jnp.float32) * jnp.where(jnp.isfinite(lse)[..., None], y, 0),
                    -1) - delta
    (want,) = vjp((d_out.astype(jnp.float32), jnp.where(jnp.isfinite(lse), d_lse, 0.0)))
    return want, y, d_lse


def _close(got, want, atol=2e-2):
    """Within 16-bit tolerance, relative to the reference's largest magnitude."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = float(np.abs(want).max()) + 1e-6
    np.testing.assert_allclose(got / scale, want / scale, atol=atol)


# (check, case, n, d, dtype): both passes of every case; by default (each takes 5-25 s
# interpreted) the dQ pass with the geometric prior's gradient; the rest in the exhaustive
# tier (the dK/dV pass with the relative-position table's gradient first)
DQ_INTERPRETED = [("dq", "geometric", 200, 64, jnp.float16)]
DQ_INTERPRETED_REST = [
    (check, *c) for c in [("geometric", 200, 64, jnp.float16),
                          ("relpos_full", 200, 64, jnp.float16),
                          ("relpos", 256, 64, jnp.bfloat16),
                          ("block_sparse", 400, 64, jnp.bfloat16),
                          ("causal", 384, 64, jnp.float16), ("window", 384, 64, jnp.bfloat16),
                          ("bias", 256, 128, jnp.bfloat16),
                          ("strict_causal", 256, 64, jnp.bfloat16),
                          ("geometric_band", 384, 64, jnp.bfloat16)]
    for check in ("dq", "dkdv") if (check, *c) not in DQ_INTERPRETED]


@pytest.mark.cpu_only
@pytest.mark.parametrize(("check", "case", "n", "d", "dtype"), DQ_INTERPRETED + [
    pytest.param(*c, marks=pytest.mark.exhaustive) for c in DQ_INTERPRETED_REST])
def test_mosaic_backward_pass_interpreted_matches_the_dense_gradient(check, case, n, d, dtype,
                                                                     mosaic_interpreted):
    """The backward's dQ and dK/dV passes run as written (three warpgroups as threads):
    `_check_dq`, `_check_dkdv`."""
    {"dq": _check_dq, "dkdv": _check_dkdv}[check](case, n, d, dtype)
    assert not mosaic_interpreted()


def _check_dq(case, n, d, dtype):
    """The dQ pass: the queries' gradient and the geometric prior's against the dense
    kernel's VJP on float32 copies (16-bit tolerance), zero in a row with no allowed
    parent; and through `pallas_backward`'s ``dq_pass`` the rest of the gradient is the
    Triton kernel's."""
    low = _low(case, n, d, dtype)
    d_out, stats, delta = _cotangents(low)
    dq, dgeo = mosaic_dq(low.terms, low.problem, low.batch_shape, d_out, stats, delta,
                         low.mask)
    assert dq.shape == low.problem.row.q.shape and dq.dtype == dtype
    want, y, d_lse = _dense_vjp(low, d_out, stats, delta)
    ok = np.isfinite(np.asarray(stats.lse()))
    assert ok.all() == (case != "strict_causal")
    _close(np.asarray(dq, np.float32)[ok], np.asarray(want.row.q)[ok])
    assert (np.asarray(dq, np.float32)[~ok] == 0).all()
    if low.terms.geometric:
        for r in (0, 1):
            _close(np.asarray(dgeo[..., r])[ok], np.asarray(want.row.geo[..., r])[ok])
    else:
        assert dgeo is None
    if case in ("relpos", "geometric"):  # the hook: only the dQ pass differs
        mixed = pallas_backward(low.terms, low.problem, low.batch_shape, y, stats, d_out,
                                d_lse, mask=low.mask, dq_pass=mosaic_dq)
        own = pallas_backward(low.terms, low.problem, low.batch_shape, y, stats, d_out,
                              d_lse, mask=low.mask)
        np.testing.assert_array_equal(np.asarray(mixed[0].q), np.asarray(dq))
        for a, b in zip(jax.tree.leaves(mixed[1:]), jax.tree.leaves(own[1:])):
            # (on a GPU the table's float32 atomics are not bit-reproducible)
            _close(a, b, atol=1e-5)


def _check_dkdv(case, n, d, dtype):
    """The dK/dV pass: the keys', values', per-parent bias' and relative-position table's
    gradients against the dense kernel's VJP on float32 copies (16-bit tolerance); the
    whole `mosaic_backward` (both passes in Mosaic GPU, the table's gradient summed in
    the dK/dV pass) against it too."""
    low = _low(case, n, d, dtype)
    d_out, stats, delta = _cotangents(low)
    table = low.terms.relpos is not None
    dk, dv, db, dt = mosaic_dkdv(low.terms, low.problem, low.batch_shape, d_out, stats, delta,
                                 low.mask, table_grad=table)
    assert dk.dtype == dv.dtype == dtype
    want, y, d_lse = _dense_vjp(low, d_out, stats, delta)
    _close(dk, want.col.k)
    _close(dv, want.v)
    if low.terms.col_bias:
        _close(db, want.col.bias[..., 0])
    else:
        assert db is None
    if table:
        assert dt.shape == low.problem.glob.relpos.shape and dt.dtype == jnp.float32
        _close(dt, want.glob.relpos)
    else:
        assert dt is None
    if case in ("relpos", "geometric", "bias"):
        got = mosaic_backward(low.terms, low.problem, low.batch_shape, y, stats, d_out, d_lse,
                              mask=low.mask)
        ok = np.isfinite(np.asarray(stats.lse()))
        _close(np.asarray(got[0].q, np.float32)[ok], np.asarray(want.row.q)[ok])
        _close(got[1].k, want.col.k)
        _close(got[4], want.v)
        if low.terms.col_bias:
            _close(got[1].bias, want.col.bias)
        if table:  # summed by the dK/dV pass, not the Triton kernel's table pass
            assert "table" not in mosaic_backward_refusals(low.terms, low.problem,
                                                           low.batch_shape, low.mask)
            _close(got[3].relpos, want.glob.relpos)
            # where the dK/dV pass cannot sum it, the Triton kernel's table pass does
            import structinfer.lowering.mosaic as mosaic_module

            with unittest.mock.patch.object(mosaic_module, "_table_grad_missing",
                                            lambda terms: "not here"):
                assert "table" in mosaic_backward_refusals(low.terms, low.problem,
                                                           low.batch_shape, low.mask)
                apart = mosaic_backward(low.terms, low.problem, low.batch_shape, y, stats,
                                        d_out, d_lse, mask=low.mask)
            _close(apart[3].relpos, want.glob.relpos)
            _close(apart[1].k, got[1].k, atol=1e-5)


@pytest.mark.cpu_only
@pytest.mark.exhaustive  # (interpreted: 15-35 s)
def test_mosaic_dkdv_table_sum_under_vmap_interpreted(mosaic_interpreted):
    """Under `jax.vmap` the dK/dV pass that sums the table's gradient (its sums are
    mutable arrays, which `plgpu.kernel`'s own batching does not take) launches once with
    a grid axis for the mapped one, slicing the mapped operands, the outputs and the
    sums; unmapped operands (the cotangents here) are shared: each element of the mapped
    call equals its own call."""
    n, d = 128, 64
    low = _low("relpos_full", n, d, jnp.bfloat16)
    rows = _cotangents(low)
    other = dataclasses.replace(
        low.problem, row=dataclasses.replace(low.problem.row, q=low.problem.row.q[::-1]),
        glob=dataclasses.replace(low.problem.glob, relpos=-low.problem.glob.relpos))

    def run(p, r):
        return mosaic_dkdv(low.terms, p, low.batch_shape, *r, low.mask, table_grad=True)

    both = jax.vmap(run, in_axes=(0, None))(
        jax.tree.map(lambda *x: jnp.stack(x), low.problem, other), rows)
    for i, p in enumerate((low.problem, other)):
        one = run(p, rows)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(both)):
            _close(b[i], a, atol=1e-5)
    assert not mosaic_interpreted()


@pytest.mark.cpu_only
@pytest.mark.exhaustive  # (interpreted: 15-35 s)
def test_mosaic_backward_interpreted_cross_attention(mosaic_interpreted):
    """Children and parents of different lengths with a per-parent bias (256 queries, 200
    keys: the parents padded to the dK/dV pass's 128 per program): both passes against
    the dense kernel's VJP. With 64 keys the dK/dV pass refuses (it takes 128 parents
    per program) and `mosaic_backward` keeps the Triton pass for it."""
    r = np.random.default_rng(5)

    def low_of(n, m, d=64):
        q = jnp.asarray(r.normal(size=(H, n, d)), jnp.bfloat16)
        k, v = (jnp.asarray(r.normal(size=(H, m, d)), jnp.bfloat16) for _ in range(2))
        bias = jnp.asarray(r.normal(size=(H, 1, m)), jnp.float32)
        return lower_edge(si.priors.Categorical(bias), si.scores.Dot(q, k, scale=d ** -0.5),
                          v, n, (H,))

    low = low_of(256, 200)
    d_out, stats, delta = _cotangents(low)
    want, y, d_lse = _dense_vjp(low, d_out, stats, delta)
    dq, _ = mosaic_dq(low.terms, low.problem, low.batch_shape, d_out, stats, delta)
    dk, dv, db, dt = mosaic_dkdv(low.terms, low.problem, low.batch_shape, d_out, stats, delta)
    assert dk.shape == (H, 200, 64) and db.shape == (H, 200) and dt is None
    for a, b in ((dq, want.row.q), (dk, want.col.k), (dv, want.v), (db, want.col.bias[..., 0])):
        _close(a, b)
    small = low_of(256, 64)
    assert "64 parents (the Mosaic GPU kernel needs at least 64 and 128)" in (
        mosaic_dkdv_unsupported(small.terms, small.problem, small.batch_shape))
    d_out, stats, delta = _cotangents(small)
    want, y, d_lse = _dense_vjp(small, d_out, stats, delta)
    got = mosaic_backward(small.terms, small.problem, small.batch_shape, y, stats, d_out, d_lse)
    for a, b in ((got[0].q, want.row.q), (got[1].k, want.col.k), (got[4], want.v)):
        _close(a, b)
    assert not mosaic_interpreted()


@pytest.mark.cpu_only
@pytest.mark.exhaustive
def test_mosaic_forward_interpreted_two_batch_dims_share_a_table(mosaic_interpreted):
    """Batched plates: heads x batch (2 x 3), the relative-position table one per head,
    shared by the batch (each program reads its head's tiles), against the dense kernel:
    the forward, and the backward with both Mosaic GPU passes (the table's gradient
    summed in the dK/dV pass: the batch elements that share a table add into one sum).
    Keys shared by the batch keep the Triton dK/dV pass (it sums their gradient in
    float32)."""
    n, d = 256, 64
    r = np.random.default_rng(2)
    q, k, v = (jnp.asarray(r.normal(size=(2, 3, n, d)), jnp.bfloat16) for _ in range(3))
    e = jnp.asarray(r.normal(size=(2, 1, 2 * n - 1)), jnp.float32)
    low = lower_edge(si.priors.RelativePosition(e, n, causal=True),
                     si.scores.Dot(q, k, scale=d ** -0.5), v, n, (2, 3))
    y, lse = mosaic_forward(low.terms, low.problem, low.batch_shape, nan_rows=True)
    want_y, want_l = _dense_of(low)
    assert y.shape == (2, 3, n, d) and y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_l), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y), atol=2e-2,
                               rtol=2e-2)
    d_out, stats, delta = _cotangents(low)
    want, y32, d_lse = _dense_vjp(low, d_out, stats, delta)
    assert mosaic_dkdv_unsupported(low.terms, low.problem, low.batch_shape,
                                   table_grad=True) is None
    got = mosaic_backward(low.terms, low.problem, low.batch_shape, y32, stats, d_out, d_lse)
    for a, b in ((got[0].q, want.row.q), (got[1].k, want.col.k), (got[4], want.v),
                 (got[3].relpos, want.glob.relpos)):
        _close(a, b)
    shared = lower_edge(si.priors.RelativePosition(e, n, causal=True),
                        si.scores.Dot(q, k[:, :1], scale=d ** -0.5), v, n, (2, 3))
    assert "keys or values shared by some batch dim" in mosaic_dkdv_unsupported(
        shared.terms, shared.problem, shared.batch_shape)
    assert not mosaic_interpreted()


@pytest.mark.cpu_only
@pytest.mark.exhaustive  # (interpreted: 15-35 s)
def test_mosaic_gradients_of_rows_of_huge_logits(mosaic_interpreted):
    r"""Regression: the Mosaic GPU forward and backward (interpreted) on rows whose every
    key carries a finite -1e9 bias, where float32 rounds the row max $m$ and
    $L = m + \log l$ to the same number: both passes rebuild $p = 2^{(s - m)\log_2 e -
    \log_2 l}$ from the forward's saved $m$ and $\log l$ (not $e^{s - L} = 1$), so dq, dk,
    dbias, dv (a cotangent on y and on L) equal a float32 softmax's of the same rounded
    logits (16-bit tolerance), in the huge head and the ordinary one."""
    from structinfer.lowering._spec import Problem

    n, d = 128, 64
    low = huge_logit_edge(n, d, jnp.bfloat16)
    ct = huge_logit_cotangents(low)
    (want_y, want_l), vjp = jax.vjp(
        lambda p: float32_softmax(p, scale=low.terms.dot_scale), low.problem)
    y, stats = mosaic_forward(low.terms, low.problem, low.batch_shape, stats=True)
    np.testing.assert_allclose(np.asarray(stats.lse()), np.asarray(want_l), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y), atol=2e-2)
    assert not mosaic_backward_refusals(low.terms, low.problem, low.batch_shape)
    d = mosaic_backward(low.terms, low.problem, low.batch_shape, y, stats, *ct)
    got = Problem(d[0], d[1], d[2], d[3], low.problem.const, d[4])
    assert_huge_logit_gradients(got, vjp(ct)[0], rtol=3e-2)
    assert not mosaic_interpreted()


@pytest.mark.cpu_only
@pytest.mark.exhaustive  # (~8 s interpreted; the Pallas kernel's NaN rows run by default)
def test_mosaic_forward_interpreted_nan_inputs_give_nan_rows(mosaic_interpreted):
    """A NaN query makes its row NaN (L not finite), a NaN key every row that sees it:
    never a finite number; the other rows match the dense kernel."""
    n = 256
    low = _low("window", n, 64, jnp.bfloat16)
    q = low.problem.row.q.at[1, 5].set(jnp.nan)
    k = low.problem.col.k.at[0, 200].set(jnp.nan)  # seen by children 200 .. 255 of head 0
    prob = dataclasses.replace(low.problem, row=dataclasses.replace(low.problem.row, q=q),
                               col=dataclasses.replace(low.problem.col, k=k))
    y, lse = (np.asarray(x, np.float32) for x in mosaic_forward(
        low.terms, prob, low.batch_shape, nan_rows=True))
    bad = np.zeros((H, n), bool)
    bad[1, 5] = True
    bad[0, 200:] = True
    assert np.isnan(y[bad]).all() and not np.isfinite(lse[bad]).any()
    want_y = np.asarray(_dense_of(low)[0])
    np.testing.assert_allclose(y[~bad], want_y[~bad], atol=2e-2, rtol=2e-2)
    assert not mosaic_interpreted()


@pytest.mark.cpu_only
def test_mosaic_model_path_interpreted(gpu, mosaic_interpreted):
    """``si.attention(model, "out", "mosaic")`` (a GPU faked for the dispatch): the
    Mosaic forward interpreted, against the dense kernel. Its value only, eagerly: the
    gradient's passes, interpreted inside the model's custom VJP, and the program under
    an outer ``jit`` leave the interpreter's warpgroup threads waiting on each other for
    ever here. `mosaic_backward` is run interpreted on the lowered edge
    (`_check_dkdv`), the model's gradient program is lowered for CUDA in
    `test_mosaic_model_path_lowers_for_cuda`, and both run on a Hopper GPU
    (`test_mosaic_matches_the_dense_kernel_on_a_gpu`)."""
    n, d = 256, 64
    model = _model("relpos", n)
    q, k, v, e = _inputs(n, d, jnp.bfloat16)
    got = si.attention(model, "out", "mosaic")(q, k, v, e)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(_dense(model, q, k, v, e)),
                               atol=3e-2, rtol=3e-2)
    assert explain(model, "out", q, k, v, e, backend="mosaic").kernels == {"phi": "mosaic"}
    assert not mosaic_interpreted()


# --- lowered for CUDA on this CPU --------------------------------------------------------


@pytest.mark.parametrize("case", list(PRIORS))
@pytest.mark.parametrize(("n", "d", "dtype"), [(256, 128, jnp.bfloat16),
                                               (200, 64, jnp.float16)])
def test_mosaic_forward_lowers_for_cuda(case, n, d, dtype):
    """Every term, both warpgroup sizes of head dim and both 16-bit dtypes (n = 200: the
    children and parents padded, the last parent block masked): one Mosaic GPU kernel,
    compiled down to warpgroup matmuls."""
    _bindings()
    low = _low(case, n, d, dtype)
    assert mosaic_unsupported(low.terms, low.problem, low.batch_shape, low.mask) is None
    f = jax.jit(lambda p: mosaic_forward(low.terms, p, low.batch_shape, nan_rows=True,
                                         mask=low.mask))
    text = f.trace(low.problem).lower(lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text) == ["mosaic_gpu_v2"]
    assert "wgmma.mma_async" in text


@pytest.mark.parametrize("case", list(PRIORS))
@pytest.mark.parametrize("pass_", ["dq", "dkdv"])
def test_mosaic_backward_passes_lower_for_cuda(case, pass_):
    """The backward's dQ and dK/dV passes, every term (head dim 128, bfloat16, n = 200:
    children and parents padded, the last blocks masked; with a relative-position table
    the dK/dV pass sums its gradient), compiled down to warpgroup matmuls."""
    _bindings()
    table = pass_ == "dkdv" and case.startswith("relpos")
    run, why = {"dq": (mosaic_dq, mosaic_dq_unsupported),
                "dkdv": (functools.partial(mosaic_dkdv, table_grad=table),
                         functools.partial(mosaic_dkdv_unsupported, table_grad=table))}[pass_]
    low = _low(case, 200, 128, jnp.bfloat16)
    assert why(low.terms, low.problem, low.batch_shape, low.mask) is None
    f = jax.jit(lambda p, r: run(low.terms, p, low.batch_shape, *r, low.mask))
    text = f.trace(low.problem, _cotangents(low)).lower(lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text) == ["mosaic_gpu_v2"]
    assert "wgmma.mma_async" in text
    # the table's gradient: each tile of ds added into its diagonal's tile by the TMA
    assert ("cp.reduce.async.bulk.tensor" in text) == table


@pytest.mark.parametrize(("d", "dv"), [(256, 256), (64, 128), (96, 40)])
def test_mosaic_forward_lowers_other_head_dims(d, dv):
    """Head dim 256 (the largest), value dims other than the query's (a separate output
    tile), dims padded up to 64 / 128."""
    _bindings()
    n = 384
    q, k, v, _ = _inputs(n, d, jnp.bfloat16, dv)
    low = lower_edge(si.priors.Restricted.window(n, 200), si.scores.Dot(q, k), v, n, (H,))
    steps = 2 if d == 256 else 3  # three slots of 256-wide keys and values do not fit
    f = jax.jit(lambda p: mosaic_forward(low.terms, p, low.batch_shape,
                                         max_concurrent_steps=steps))
    text = f.trace(low.problem).lower(lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text) == ["mosaic_gpu_v2"]
    if d == 256:
        with pytest.raises(ValueError,
                           match="its tiles need 263 KiB of shared memory with 3 pipeline slots"):
            mosaic_forward(low.terms, low.problem, low.batch_shape, max_concurrent_steps=3)


def test_explain_names_the_gradient_passes_the_triton_kernel_runs(gpu, monkeypatch):
    """`explain` says which of a Mosaic GPU edge's gradient the Triton kernel computes:
    nothing with the geometric prior or a relative-position table (its gradient summed
    in the dK/dV pass), the table's gradient where the dK/dV pass cannot sum it (keys
    shared by the heads: the Triton kernel's dK/dV pass; a JAX without ``pl.run_state``),
    and the dK/dV pass (with the reason) for 64 keys."""
    n, d = 256, 64
    args = _inputs(n, d, jnp.bfloat16)
    for case in ("geometric", "relpos"):
        said = explain(_model(case, n), "out", *args, backend="mosaic")
        assert said.kernels == {"phi": "mosaic"}
        assert not any("gradient" in s for s in said.notes["phi"]), str(said)
    q, k, v, e = args
    shared = explain(_model("relpos", n), "out", q, k[:1], v, e, backend="mosaic")
    (said,) = [s for s in shared.notes["phi"] if "gradient" in s]
    assert said == ("the Pallas (Triton) kernel computes, of its gradient: the dK/dV pass "
                    "(keys or values shared by some batch dim (the Triton pass sums their "
                    "gradients in float32)); the relative-position table's gradient, when "
                    "the table is trained (the Triton kernel runs the dK/dV pass, so its "
                    "table pass sums it)"), said
    with monkeypatch.context() as m:
        from jax.experimental import pallas as pl

        m.delattr(pl, "run_state")  # a JAX without what the sum is built of
        said = explain(_model("relpos", n), "out", *args, backend="mosaic")
    (said,) = [s for s in said.notes["phi"] if "gradient" in s]
    assert said == ("the Pallas (Triton) kernel computes, of its gradient: the "
                    "relative-position table's gradient, when the table is trained (this "
                    f"JAX ({jax.__version__}) lacks run_state (the sum across programs))"), said

    def cross(q, k, v, bias):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", si.priors.Categorical(bias), si.scores.Dot(q, k, scale=d ** -0.5))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    q, k, v, _ = _inputs(64, d, jnp.bfloat16)
    bias = jnp.zeros((H, 1, 64), jnp.float32)
    small = explain(cross, "out", args[0], k, v, bias, backend="mosaic")
    (said,) = [s for s in small.notes["phi"] if "gradient" in s]
    assert said.startswith("the Pallas (Triton) kernel computes, of its gradient: the dK/dV "
                           "pass ("), said
    assert "64 parents" in said and "dQ" not in said, said
    # queries shared by the heads: the dQ pass is the Triton kernel's
    shared = explain(cross, "out", args[0][0], args[1], args[2], jnp.zeros((H, 1, n)),
                     backend="mosaic")
    (said,) = [s for s in shared.notes["phi"] if "gradient" in s]
    assert "the dQ pass (queries shared by some batch dim" in said, said
    assert "dK/dV" not in said, said


@pytest.mark.parametrize("case", ["relpos", "geometric", "bias", "block_sparse"])
def test_mosaic_model_path_lowers_for_cuda(case, gpu):
    """``si.attention(model, "out", "mosaic")`` and its gradient (`mosaic_backward` on
    the forward's y and L), lowered for CUDA: one Mosaic GPU kernel for the value, three
    for the gradient (the forward, the dQ and the dK/dV passes) and no other kernel (a
    relative-position table's gradient summed by the dK/dV pass's TMA reductions), and
    explain names it."""
    _bindings()
    n, d = 256, 64
    model = _model(case, n)
    f = si.attention(model, "out", "mosaic")
    x = jax.ShapeDtypeStruct((H, n, d), jnp.bfloat16)
    e = jax.ShapeDtypeStruct((H, 2 * n - 1), jnp.float32)
    grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2, 3))
    for g, kernels in ((f, 1), (grad, 3)):
        text = jax.jit(g).trace(x, x, x, e).lower(lowering_platforms=("cuda",)).as_text()
        assert _custom_calls(text) == ["mosaic_gpu_v2"] * kernels, _custom_calls(text)
        reduced = "cp.reduce.async.bulk.tensor" in text
        assert reduced == (case == "relpos" and g is grad)
    ex = explain(model, "out", *_inputs(n, d, jnp.bfloat16), backend="mosaic")
    assert ex.kernels == {"phi": "mosaic"}


def test_mosaic_vmapped_gradient_lowers_for_cuda(gpu):
    """`jax.vmap` of a relative-position model's gradient, the table trained (its
    gradient summed in the dK/dV pass, whose mutable sums `plgpu.kernel`'s batching
    does not take): the forward and both passes lower for CUDA, three Mosaic GPU
    kernels and the TMA reductions, as without the vmap."""
    _bindings()
    n, d = 256, 64
    f = si.attention(_model("relpos", n), "out", "mosaic")
    x = jax.ShapeDtypeStruct((3, H, n, d), jnp.bfloat16)
    e = jax.ShapeDtypeStruct((3, H, 2 * n - 1), jnp.float32)
    grad = jax.vmap(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2, 3)))
    text = jax.jit(grad).trace(x, x, x, e).lower(lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text) == ["mosaic_gpu_v2"] * 3, _custom_calls(text)
    assert "cp.reduce.async.bulk.tensor" in text


# --- run on a Hopper GPU -----------------------------------------------------------------


def _hopper():
    if not on_hopper():
        pytest.skip("runs the Mosaic GPU kernel: needs an NVIDIA Hopper GPU")


def _dense(model, *args):
    up = [jnp.asarray(x, jnp.float32) for x in args]
    return si.attention(model, "out", "dense")(*up)


# strict_causal's first child has no parent: the model refuses it (the interpreted
# tests run it on the lowered edge)
@pytest.mark.parametrize("case", [c for c in PRIORS if c != "strict_causal"])
@pytest.mark.parametrize(("n", "d", "dtype"), [(384, 128, jnp.bfloat16),
                                               (200, 64, jnp.float16)])
def test_mosaic_matches_the_dense_kernel_on_a_gpu(case, n, d, dtype):
    """Values and gradients (to the queries, keys, values and the prior's table) against
    the dense kernel on float32 copies, within 16-bit tolerance, eager and under jit."""
    _hopper()
    model = _model(case, n)
    q, k, v, e = _inputs(n, d, dtype)
    want = np.asarray(_dense(model, q, k, v, e))
    f = si.attention(model, "out", "mosaic")
    for g in (f, jax.jit(f)):
        got = g(q, k, v, e)
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=3e-2)
    w = jnp.asarray(np.random.default_rng(1).normal(size=want.shape), jnp.float32)

    def loss(fn, *a):
        return jnp.sum(fn(*a).astype(jnp.float32) * w)

    ref = jax.grad(lambda *a: loss(lambda *b: _dense(model, *b), *a), (0, 1, 2, 3))(q, k, v, e)
    grad = jax.grad(lambda *a: loss(f, *a), (0, 1, 2, 3))
    for g in (grad, jax.jit(grad)):
        for a, b in zip(g(q, k, v, e), ref):
            scale = float(jnp.max(jnp.abs(b))) + 1e-6
            np.testing.assert_allclose(np.asarray(a, np.float32) / scale,
                                       np.asarray(b, np.float32) / scale, atol=3e-2)


@pytest.mark.parametrize("case", ["geometric", "block_sparse", "relpos"])
def test_auto_takes_mosaic_on_a_hopper_gpu(case):
    """On a Hopper GPU auto runs the priors cuDNN does not take on the Mosaic GPU kernels
    (measured faster than the Triton kernel at every prior, forward and backward), and a
    relative-position table too (preferred to cuDNN with the table materialised; at
    n = 256 cuDNN could run it). Not yet run on a GPU for relpos."""
    _hopper()
    n = 256
    ex = explain(_model(case, n), "out", *_inputs(n, 64, jnp.bfloat16))
    assert ex.kernels["phi"] == "mosaic", str(ex)


@pytest.mark.parametrize("case", list(PRIORS))
@pytest.mark.parametrize(("n", "d", "dtype"), [(384, 128, jnp.bfloat16),
                                               (200, 64, jnp.float16)])
def test_mosaic_backward_passes_match_the_dense_gradient_on_a_gpu(case, n, d, dtype):
    """The dQ and dK/dV passes on the card, every prior: `_check_dq`, `_check_dkdv`."""
    _hopper()
    _check_dq(case, n, d, dtype)
    _check_dkdv(case, n, d, dtype)


def test_mosaic_writes_nan_rows_on_a_gpu():
    """A row with a NaN query is NaN in the output (never a finite number); the others
    match the dense kernel."""
    _hopper()
    n, d = 256, 64
    model = _model("relpos", n)
    q, k, v, e = _inputs(n, d, jnp.bfloat16)
    bad = q.at[0, 5].set(jnp.nan)
    got = np.asarray(jax.jit(si.attention(model, "out", "mosaic"))(bad, k, v, e), np.float32)
    assert np.isnan(got[0, 5]).all()
    # eagerly the model refuses a NaN score, and a row reads only its own query
    want = np.asarray(_dense(model, q, k, v, e))
    keep = np.ones(got.shape[:2], bool)
    keep[0, 5] = False
    np.testing.assert_allclose(got[keep], want[keep], atol=3e-2, rtol=3e-2)
