"""The benchmark script's --quick mode runs (no timing is asserted), and every public
name of structinfer.lowering is documented."""

import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.exhaustive  # (~8 s: a benchmark process; the default tier runs gpu.py --quick)
def test_benchmark_quick_mode_runs():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "attention.py"), "--quick",
         "--no-torch"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "window     fwd" in out and "window fwd+bwd" in out
    for peer in ("jax.nn(xla)=", "jnp=", "exact=", "kernel="):
        assert peer in out
    assert "expanding attention" in out


def test_lowering_public_names_have_docstrings():
    for mod_name in ("structinfer.lowering", "structinfer.lowering.sharded",
                     "structinfer.lowering.accel"):
        mod = importlib.import_module(mod_name)
        assert mod.__doc__
        for name in mod.__all__:
            obj = getattr(mod, name)
            if isinstance(obj, (str, tuple)):
                continue
            assert obj.__doc__, f"{mod_name}.{name} has no docstring"


def test_flex_rows_get_a_compile_each():
    """Regression: a whole table compiles FlexAttention once per (size, case), more than
    dynamo's default recompile limit of 8, past which torch.compile silently ran it
    eagerly (the n = 4096 FlexAttention column read 10-60x slow). The benchmark raises the
    limit (checked on a stand-in for torch's config: torch is optional)."""
    import types

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import attention as bench
    finally:
        sys.path.pop(0)
    cfg = types.SimpleNamespace(recompile_limit=8, cache_size_limit=8)
    bench.flex_recompile_budget(types.SimpleNamespace(_dynamo=types.SimpleNamespace(config=cfg)))
    rows = 3 * 5 * 2  # sizes x cases x (fwd, fwd+bwd) of the suite's biggest table
    assert cfg.recompile_limit >= rows and cfg.cache_size_limit >= rows
    old = types.SimpleNamespace(cache_size_limit=8)  # an older torch: only the old name
    bench.flex_recompile_budget(types.SimpleNamespace(_dynamo=types.SimpleNamespace(config=old)))
    assert old.cache_size_limit >= rows and not hasattr(old, "recompile_limit")
