"""The GPU comparison script's --quick mode runs on a CPU (no timing is asserted): it writes
the Markdown table and the JSON, and every structinfer row passes its correctness check."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_benchmark_quick_mode_writes_the_table_and_checks_structinfer(tmp_path):
    # two cases keep it short (the per-parent bias and the block-sparse mask: the models
    # this script adds, the rest come from benchmarks/attention.py); the peers a CPU lacks
    # are skipped with a note
    cases = ["bias", "block_sparse"]
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--quick",
         "--out", str(tmp_path), "--cases", *cases,
         "--impls", "structinfer", "structinfer-pallas", "structinfer-mosaic",
         "structinfer-cudnn", "cudnn", "tokamax-triton"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    mds, jsons = sorted(tmp_path.glob("*.md")), sorted(tmp_path.glob("*.json"))
    assert len(mds) == 1 and len(jsons) == 1, os.listdir(tmp_path)
    assert mds[0].stem == jsons[0].stem and mds[0].stem.startswith("cpu_")
    data = json.loads(jsons[0].read_text())
    assert data["device"] and data["versions"]["jax"] and data["versions"]["numpyro"]
    assert "--quick" in data["command"] and data["budget_hit"] is False

    ours = [r for r in data["rows"] if r["impl"] in ("structinfer", "structinfer-pallas")]
    assert {(r["case"], r["mode"], r["impl"]) for r in ours} == {
        (c, m, i) for c in cases for m in ("fwd", "fwd+bwd")
        for i in ("structinfer", "structinfer-pallas")}
    for r in ours:
        assert r["status"] == "ok", r
        assert r["check"]["passed"], r
        assert r["ms"] > 0 and r["tflops"] > 0
        assert ("out" in r["check"]) == (r["mode"] == "fwd")
    assert all(r["kernel"] == "pallas" for r in ours if r["impl"] == "structinfer-pallas")
    assert all(r["status"] == "skipped" for r in data["rows"] if r["impl"] == "cudnn")
    mosaic = [r for r in data["rows"] if r["impl"] == "structinfer-mosaic"]
    assert len(mosaic) == 4 and all(r["status"] == "skipped" for r in mosaic), mosaic
    forced = [r for r in data["rows"] if r["impl"] == "structinfer-cudnn"]  # with the reason
    assert len(forced) == 4 and all(r["status"] == "skipped" for r in forced), forced
    assert all("backend 'cudnn' cannot run" in r["note"] for r in forced), forced
    # every implementation runs a case before the next starts (a budget cut drops whole
    # cases), structinfer first within it
    ran = [(cases.index(r["case"]), ("fwd", "fwd+bwd").index(r["mode"])) for r in data["rows"]]
    assert ran == sorted(ran), ran
    assert data["rows"][0]["impl"] == "structinfer"

    md = mds[0].read_text()
    assert "## n = 128, 2 heads, head dim 32" in md and "## n = 128" in proc.stdout  # printed
    for text in ("| bias", "| block_sparse", "structinfer (auto)", "structinfer (pallas)",
                 "## Correctness", "cuDNN needs a GPU"):
        assert text in md, text


@pytest.mark.exhaustive  # (~12 s; the default tier runs benchmarks/gpu.py --quick)
def test_gpu_tune_quick_mode_times_pallas_and_says_why_not_mosaic():
    """benchmarks/gpu_tune.py --quick on a CPU: timed Pallas forward and backward cells per
    case (interpreted), and Mosaic GPU cells that name the platform (no GPU)."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_tune.py"), "--quick",
         "--cases", "relpos", "geometric"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 256 |")]
    assert [r.split("|")[3].strip() for r in rows] == ["relpos", "geometric"], proc.stdout
    for r in rows:
        pallas, m2, m3, bwd, *mosaic_bwd, apart, summed = (c.strip()
                                                          for c in r.split("|")[4:-2])
        assert " ms / " in pallas and " ms / " in bwd, r
        assert len(mosaic_bwd) == 3, r  # dQ, dK/dV, both
        assert all("the platform is cpu" in c for c in (m2, m3, *mosaic_bwd)), r
        # both with the relative-position table's gradient, two ways; no table, no cells
        for table in (apart, summed):
            assert ("the platform is cpu" in table) if "relpos" in r else table == "—", r


@pytest.mark.exhaustive  # (~6 s: a second benchmark process; the default tier runs --quick)
def test_gpu_benchmark_relpos_grad_checks_the_tables_gradient(tmp_path):
    """--cases relpos_grad (asked for by name: relpos with its table trained): forward +
    backward differentiates the table too, and the check compares its gradient with the
    float32 reference's (on the Pallas kernel's table pass, interpreted here)."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--quick",
         "--out", str(tmp_path), "--cases", "relpos_grad", "--modes", "fwd+bwd",
         "--impls", "structinfer", "structinfer-pallas"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (data,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    rows = [r for r in data["rows"] if r["status"] == "ok"]
    assert {r["impl"] for r in rows} == {"structinfer", "structinfer-pallas"}, data["rows"]
    for r in rows:
        assert r["case"] == "relpos_grad" and r["check"]["passed"], r
        assert {"dq", "dk", "dv", "dtable"} <= set(r["check"]), r
    assert "dq, dk, dv, dtable" in next(tmp_path.glob("*.md")).read_text()


@pytest.mark.exhaustive  # (~6 s: a second benchmark process; the default tier runs --quick)
def test_gpu_benchmark_order_impl_runs_each_tier_over_every_case(tmp_path):
    """--order impl: structinfer's rows of every case, then the forced kernels' (the
    order before case-major became the default)."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--quick",
         "--out", str(tmp_path), "--cases", "bias", "block_sparse", "--modes", "fwd",
         "--impls", "structinfer", "structinfer-pallas", "--order", "impl"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (data,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert [(r["impl"], r["case"]) for r in data["rows"]] == [
        ("structinfer", "bias"), ("structinfer", "block_sparse"),
        ("structinfer-pallas", "bias"), ("structinfer-pallas", "block_sparse")]


@pytest.mark.exhaustive  # (~4 s: eight cases x modes of the peers' layouts)
def test_gpu_benchmark_cudnn_layouts_agree():
    """The cuDNN peers' two layouts (the heads as cuDNN's heads, and as its batch, the call
    structinfer's kernel makes) give the same outputs and gradients, read back by their
    checks: run here with jax.nn's XLA implementation in cuDNN's place, on the cases
    with a bias table (per head for relpos, one for geometric) and a mask."""
    import importlib.util

    import jax
    import jax.numpy as jnp
    import numpy as np

    spec = importlib.util.spec_from_file_location(
        "gpu_bench", os.path.join(ROOT, "benchmarks", "gpu.py"))
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    p = gpu.Problem(64, 2, 16, jnp.float32)

    def attend(q, k, v, **kw):
        return jax.nn.dot_product_attention(q, k, v, scale=0.25, implementation="xla", **kw)

    for case in ("relpos", "geometric", "window", "relpos_grad"):
        for mode in ("fwd", "fwd+bwd"):
            ctx = {"p": p, "case": case, "mode": mode, "window": 8}
            got = []
            for heads_as_batch in (False, True):
                call, sync, check, _ = gpu._build_bthd(ctx, attend, heads_as_batch)
                got.append(check(call()))
            assert got[0].keys() == got[1].keys()
            for name in got[0]:
                np.testing.assert_allclose(got[1][name], got[0][name], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{case} {mode} {name}")
