"""Every example runs in --quick mode (a smoke run with real checks inside)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# examples owned by other test files (they run them themselves) are skipped here
OWNED_ELSEWHERE = {
    "derive_mechanisms.py",  # tests/test_examples_mechanisms.py
    "infer_svi_attention.py",  # tests/test_infer_numpyro.py
    "infer_nuts_expanding.py",  # tests/test_infer_numpyro.py
    "reproduce_lm.py",  # tests/test_nn_lm.py
}
EXAMPLES = sorted(
    p for p in (ROOT / "examples").glob("*.py") if p.name not in OWNED_ELSEWHERE
)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_quick(path, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(path), "--quick"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
