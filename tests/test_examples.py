"""Every example and every shipped reproduction runs in --quick mode (a smoke run with
real checks inside); the reproductions run through `structinfer reproduce`, as users run
them: one (:data:`IN_A_SUBPROCESS`) as a command in its own process, the others through
the same command in-process (`reproduce` imports and runs a reproduction in its own
process too), which saves a Python + JAX start-up per reproduction. The default tier runs
:data:`REPRESENTATIVES` (the command both ways); the other reproductions' smoke runs are
in the exhaustive tier (CI's second leg); their building blocks have tests of their own
(``tests/test_reproductions.py``, the switching-EM tests of ``tests/test_markov.py``, the
IDW score's)."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import matrix

from structinfer import cli
from structinfer.reproductions import REPRODUCTIONS

ROOT = Path(__file__).resolve().parents[1]
# examples owned by other test files (they run them themselves) are skipped here
OWNED_ELSEWHERE = {
    "derive_mechanisms.py",  # tests/test_examples_mechanisms.py
    "infer_svi_attention.py",  # tests/test_infer_numpyro.py
    "infer_nuts_expanding.py",  # tests/test_infer_numpyro.py
}
# reproductions owned by other test files
REPRODUCTIONS_OWNED_ELSEWHERE = {"lm"}  # tests/test_nn_lm.py
#: the shipped reproduction run as a command in a subprocess (the quickest one)
IN_A_SUBPROCESS = "hopfield"
#: the reproductions whose smoke run is in the default tier: the command as a process (the
#: others, in-process, in the exhaustive tier)
REPRESENTATIVES = {IN_A_SUBPROCESS}
EXAMPLES = sorted(
    p for p in (ROOT / "examples").glob("*.py") if p.name not in OWNED_ELSEWHERE
)


def _run(cmd, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               STRUCTINFER_JAX_CACHE="0")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_quick(path, tmp_path):
    _run([sys.executable, str(path), "--quick"], tmp_path)


@pytest.mark.parametrize("name", matrix(sorted(set(REPRODUCTIONS) - REPRODUCTIONS_OWNED_ELSEWHERE),
                                        keep=lambda name: name in REPRESENTATIVES))
def test_reproduction_quick(name, tmp_path, monkeypatch):
    args = ["reproduce", name, "--quick", "--quiet", "--out", str(tmp_path / "out")]
    if name == IN_A_SUBPROCESS:
        _run([sys.executable, "-m", "structinfer.cli", *args], tmp_path)
    else:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("STRUCTINFER_JAX_CACHE", "0")  # keep the session's cache
        with _jax_config_restored():  # a reproduction may switch float64 on for itself
            assert cli.main([*args, "--debug"]) == 0  # --debug: a failure's traceback
    assert not (tmp_path / "out").exists()  # a smoke run writes nothing, no folder either


@contextlib.contextmanager
def _jax_config_restored():
    x64 = jax.config.jax_enable_x64
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", x64)
