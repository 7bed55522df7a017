"""benchmarks/nn_layer.py --quick runs: both layers, equal outputs (the
script asserts it), a time and a temporary-buffer size for each (no timing asserted)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "nn_layer.py"


@pytest.mark.exhaustive  # (~4 s; the default tier runs benchmarks/gpu.py --quick)
def test_nn_layer_benchmark_quick(capsys):
    spec = importlib.util.spec_from_file_location("nn_layer_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--quick"])
    assert [r["case"] for r in rows] == ["window"]  # --quick: one case, one size
    for r in rows:
        assert set(r["seconds"]) == {"structinfer", "flax"}
        assert all(t > 0 for t in r["seconds"].values())
    out = capsys.readouterr().out
    assert out.count("load average") == 2 and "flax/ours" in out
