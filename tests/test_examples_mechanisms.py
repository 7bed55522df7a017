"""The tutorial example runs (``--quick``) and its two-hop matrix is P + P^2."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_derive_mechanisms_quick():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "derive_mechanisms.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for title in (
        "cross attention",
        "window",
        "relative position",
        "geometric x Beta",
        "inverse distance",
        "two hops",
    ):
        assert title in out, f"missing section {title!r}"
    diff = float(re.search(r"max \|difference\| = ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-4  # float32 engine vs P + P^2 from the one-hop attention
