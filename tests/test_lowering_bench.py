"""The benchmark script's --quick mode runs (no timing is asserted), and every public
name of structinfer.lowering is documented."""

import importlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
