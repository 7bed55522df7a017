"""Two JAX processes (``jax.distributed``) running the sharded kernels, against one process.

The test starts two Python processes on this machine, each with one CPU device, joined
through a coordinator on a free localhost port (JAX's own multi-process runtime; CPU
collectives go through gloo). Together they see a mesh of two devices; each runs
``structinfer.attention(model, "out", mesh=mesh, shard=...)`` on global arrays — heads
split over the processes (inputs sharded by heads) and ring attention over the sequence
(inputs replicated) — gathers the result, and compares it with the same model computed by
that process alone on its own device (``backend="blocked"``, no mesh): equal to float32
rounding (the ring merges partial softmaxes in another order).

Skipped only when no localhost TCP port can be opened (a sandbox without networking);
any other failure of the launch is a failure.
"""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import FAST_COMPILE_FLAGS

WORKER = textwrap.dedent(
    """
    import sys
    import jax

    pid, port = int(sys.argv[1]), sys.argv[2]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=90)
    import numpy as np
    import numpyro
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from numpyro.ops.indexing import Vindex

    import structinfer as si

    assert jax.process_count() == 2 and jax.device_count() == 2, jax.devices()
    assert len(jax.local_devices()) == 1
    H, n, D = 4, 40, 8
    r = np.random.default_rng(0)  # the same inputs in both processes
    q, k, v = (r.normal(size=(H, n, D)).astype(np.float32) for _ in range(3))
    bias = (0.3 * r.normal(size=(H, 2 * n - 1))).astype(np.float32)

    def mha(q, k, v, bias):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("queries", n, dim=-1):
            j = si.edge("phi", si.priors.RelativePosition(bias, n, causal=True),
                        si.scores.Dot(q, k, scale=0.3))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    single = si.attention(mha, "out", "blocked", block_q=8, block_k=8)(q, k, v, bias)
    # Auto axes: with inputs sharded by heads, JAX's explicit-sharding mode (the default
    # of make_mesh) would ask the model's own gather V[phi] for an output sharding
    # (older JAX has no axis types: its axes are all Auto)
    auto = ({"axis_types": (jax.sharding.AxisType.Auto,)}
            if hasattr(jax.sharding, "AxisType") else {})
    mesh = jax.make_mesh((2,), ("x",), **auto)
    for shard, spec, tol in (("heads", P("x"), 1e-6), ("sequence", P(), 2e-6)):
        sh = NamedSharding(mesh, spec)
        glob = [jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx])
                for x in (q, k, v)]
        rep = jax.make_array_from_callback(bias.shape, NamedSharding(mesh, P()),
                                           lambda idx: bias[idx])
        f = si.attention(mha, "out", "blocked", mesh=mesh, shard=shard, block_q=8,
                         block_k=8)
        y = multihost_utils.process_allgather(jax.jit(f)(*glob, rep), tiled=True)
        np.testing.assert_allclose(np.asarray(y), np.asarray(single), atol=tol, rtol=0)
        print("ok", shard, flush=True)
    jax.distributed.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.exhaustive  # (~8 s: three processes; one-process meshes run by default)
def test_two_processes_run_the_sharded_kernels_like_one():
    try:
        port = _free_port()
    except OSError as err:  # pragma: no cover - sandbox without localhost networking
        pytest.skip(f"cannot open a localhost TCP port for the coordinator: {err}")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device each
    fast = [f for f in os.environ.get("XLA_FLAGS", "").split() if f in FAST_COMPILE_FLAGS]
    if fast:  # the session's fast compiles
        env["XLA_FLAGS"] = " ".join(fast)
    env["JAX_PLATFORMS"] = "cpu"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:  # pragma: no cover - a hung peer
                p.kill()
                p.communicate()
    for i, (p, out) in enumerate(zip(procs, outs)):
        if "Multiprocess computations aren't implemented on the CPU backend" in out:
            pytest.skip("this jaxlib's CPU backend runs no multi-process computation (0.4.33)")
        assert p.returncode == 0, f"process {i}:\n{out}"
        assert "ok heads" in out and "ok sequence" in out, out
