"""The language-modelling experiment (structinfer.reproductions.lm, `structinfer reproduce lm`) in --quick mode: every
prior trains, is evaluated and reported (table, JSON, plot); the corpus split is by file
and deterministic; the reported priors are the mechanisms' own."""

import importlib
import json
import math

import numpy as np
import pytest


@pytest.fixture(scope="module")
def lm():
    return importlib.import_module("structinfer.reproductions.lm")


def test_corpus_is_split_by_file(lm):
    data, info = lm.stdlib_corpus()
    assert set(data) == {"train", "val", "test"}
    assert all(info["files"][k] > 0 and data[k].size == info["bytes"][k] for k in data)
    assert info["bytes"]["train"] > 4 * info["bytes"]["test"]
    again, _ = lm.stdlib_corpus()
    assert all(np.array_equal(data[k], again[k]) for k in data)  # deterministic
    # no file in two splits: a split's text never contains another split's first file
    first = {k: bytes(v[: v.tobytes().index(b"\0")]) for k, v in data.items()}
    assert first["test"] not in data["train"].tobytes()
    w = lm.eval_windows(data["val"], 16, 5)
    assert w.shape == (5, 17) and w.dtype == np.uint8


def test_quick_run_reports_every_prior(lm, tmp_path, capsys):
    assert lm.main(["--quick", "--quiet", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["table"]) == set(lm.PRIORS)
    for r in res["runs"]:
        # an untrained byte model sits near log2(256) = 8 bits; nothing is NaN
        assert 6.0 < r["val_bpc"] < 9.0 and 6.0 < r["test_bpc"] < 9.0, r
        assert r["step_seconds"] > 0
        assert "is lowered" in r["explain"], r["explain"]
        heads = r["heads"][0]
        assert len(heads) == res["config"]["heads"]
        ctx = res["config"]["context"]
        if r["prior"] == "uniform-causal":
            assert all(h["window95"] == math.ceil(0.95 * ctx) for h in heads)
        if r["prior"] == "window":
            assert all(h["window95"] == res["config"]["window"] for h in heads)
        if r["prior"] == "geometric":
            # truncated to the context: P(d < w) = (1 - (1-q)^w) / (1 - (1-q)^ctx)
            for h in heads:
                q = h["q"]
                cdf = [(1 - (1 - q) ** w) / (1 - (1 - q) ** ctx) for w in range(1, ctx + 1)]
                assert h["window95"] == 1 + next(i for i, c in enumerate(cdf) if c >= 0.95)
        if r["prior"] == "geometric-beta":
            assert all(h["prior_mean_q"] == pytest.approx(h["alpha"] / (h["alpha"] + h["beta"]))
                       for h in heads)
    md = (tmp_path / "results.md").read_text()
    assert all(f"| {p} |" in md for p in lm.PRIORS)
    assert (tmp_path / "lm.png").stat().st_size > 10_000
    _check_resume(lm, tmp_path, capsys)



def _check_resume(lm, out, capsys):
    """An interrupted experiment resumes: ``--resume`` keeps the runs of results.json
    (written after every run) and trains only missing ones (here: none), and refuses a
    file made with other settings."""
    path = out / "results.json"
    res = json.loads(path.read_text())
    assert len(res["runs"]) == len(lm.PRIORS)
    res["runs"][1]["test_bpc"] = 7.25  # a marker: a kept run is read, not retrained
    path.write_text(json.dumps(res))
    capsys.readouterr()
    args = ["--quick", "--quiet", "--out", str(out), "--resume"]
    assert lm.main([*args, "--priors", "uniform-causal", res["runs"][1]["prior"]]) == 0
    printed = capsys.readouterr().out
    assert printed.count("from results.json") == 2 and "test 7.250 bpc" in printed
    res = json.loads(path.read_text())
    assert res["table"][res["runs"][1]["prior"]]["test_bpc"]["mean"] == 7.25
    with pytest.raises(SystemExit, match="other settings.*'lr'"):
        lm.main([*args, "--lr", "0.1"])
