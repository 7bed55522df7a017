"""The `structinfer` command: exit codes, one-line errors, reports; as a process (the
console script, ``python -m structinfer.cli``) and in-process through `cli.main` (the
demo, most error cases: the same code, without a process's import time).

Exit status contract: 0 success, 2 usage error (bad arguments, missing path, unknown
reproduction, a --true-edges key that is not in the data), 1 runtime error (no model in
the file, wrong keys/shapes, NaN, a failing script). Errors are one line on stderr
unless --debug. (tests/test_cli_validation.py checks, in-process and without fitting,
that every input of `compare` is validated before the first fit.) Reproductions
registered by the tests run in-process, as `reproduce` runs every reproduction.
"""

import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from structinfer import cli, reproductions
from structinfer.demo import make_task

REPO = Path(__file__).resolve().parent.parent

MODELS = '''
import numpyro
import numpyro.distributions as dist
from numpyro.ops.indexing import Vindex

import structinfer as si


def _observe(x, w, sigma, prior):
    n = x.shape[0] - 1
    with numpyro.plate("children", n):
        phi = si.edge("phi", prior)
        mu = x[:-1] @ w.T
        numpyro.sample("x", dist.Normal(Vindex(mu)[..., phi, :], sigma).to_event(1), obs=x[1:])


def model_geometric(x, w):
    q = numpyro.sample("q", dist.Beta(2.0, 2.0))
    n = x.shape[0] - 1
    _observe(x, w, 0.3, si.priors.Geometric(q, n, include_self=False, offset=1))


def model_window(x, w):
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    n = x.shape[0] - 1
    _observe(x, w, sigma, si.priors.Restricted.window(n, 3, n, include_self=False, offset=1))
'''

ENERGY_MODELS = '''
import numpyro
import numpyro.distributions as dist
import structinfer as si


def model_a(x, w):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("children", x.shape[0]):
        si.edge("phi", si.priors.Uniform(x.shape[0]), si.scores.Dot(s * x, x))


def model_b(x, w):
    model_a(x, w)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    task = make_task(12, dim=3, seed=5)
    (d / "models.py").write_text(MODELS)
    (d / "energy.py").write_text(ENERGY_MODELS)
    (d / "nomodel.py").write_text("import math\n\ndef helper(x):\n    return x\n")
    (d / "syntax.py").write_text("def model_a(x:\n    pass\n")
    np.savez(d / "data.npz", x=task.x, w=task.weight, parents=task.parents,
             short_parents=task.parents[:-1])
    (d / "text.npz").write_text("x,y\n1,2\n")  # a text file renamed .npz
    np.savez(d / "wrongkeys.npz", y=task.x, w=task.weight)
    np.savez(d / "badshape.npz", x=task.x[:, 0], w=task.weight)
    bad = task.x.copy()
    bad[2, 1] = np.nan
    np.savez(d / "nan.npz", x=bad, w=task.weight)
    mods = d / "mods"  # reproductions registered by the tests (in-process)
    mods.mkdir()
    (mods / "si_test_tiny_thing.py").write_text(textwrap.dedent('''
        """A tiny reproduction used by the tests."""
        import argparse, json, os


        def main(argv=None):
            p = argparse.ArgumentParser()
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--quick", action="store_true")
            p.add_argument("--out", default=".")
            p.add_argument("--extra", default="")
            a = p.parse_args(argv)
            with open(os.path.join(a.out, "results.json"), "w") as f:
                json.dump({"seed": a.seed, "quick": a.quick, "extra": a.extra}, f)
            return 0
    '''))
    (mods / "si_test_broken.py").write_text('"""Always fails."""\n\ndef main(argv=None):\n    return 3\n')
    (mods / "si_test_talker.py").write_text(
        '"""Prints its table, writes nothing."""\n\ndef main(argv=None):\n'
        '    print("a table of results")\n    return 0\n')
    (mods / "si_test_needs_sklearn.py").write_text(
        '"""Needs scikit-learn."""\nimport sklearn\n\ndef main(argv=None):\n    return 0\n')
    (mods / "si_test_writer.py").write_text(textwrap.dedent('''
        """Writes results.json to --out; a --quick run only when --out is given (as lm)."""
        import argparse, json, os, sys


        def main(argv=None):
            p = argparse.ArgumentParser()
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--quick", action="store_true")
            p.add_argument("--out", default=None)
            p.add_argument("--no-progress", action="store_true")
            a = p.parse_args(argv)
            if a.out is None and a.quick:
                return 0
            out = a.out or os.path.join("results", "writer")
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "results.json"), "w") as f:
                json.dump({"argv": sys.argv[1:] if argv is None else list(argv)}, f)
            return 0
    '''))
    (mods / "si_test_bars.py").write_text(textwrap.dedent('''
        """Shows a progress bar unless --no-progress, writes nothing."""
        import argparse, sys

        from tqdm import tqdm


        def main(argv=None):
            p = argparse.ArgumentParser()
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--quick", action="store_true")
            p.add_argument("--out", default=None)
            p.add_argument("--no-progress", dest="progress", action="store_false")
            a = p.parse_args(argv)
            for _ in tqdm(range(3), desc="training", disable=not a.progress, file=sys.stderr):
                pass
            return 0
    '''))
    bench = d / "bench"
    bench.mkdir()
    (bench / "attention.py").write_text(
        'import sys\nprint("ratio table", " ".join(sys.argv[1:]))\n'
    )
    (d / "empty").mkdir()
    return d


def _env(files, **extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["STRUCTINFER_JAX_CACHE"] = str(files / "jax-cache")
    env.update(extra)
    return env


def _cmd(*args):
    return [sys.executable, "-m", "structinfer.cli", *map(str, args)]


def run(files, *args, env=None, timeout=600):
    return subprocess.run(_cmd(*args), capture_output=True, text=True, cwd=files,
                          env=_env(files, **(env or {})), timeout=timeout)


def run_many(files, cases):
    """Start every case at once (they are import-bound) and wait for all."""
    procs = [
        subprocess.Popen(_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=files, env=_env(files, **env))
        for args, env in cases
    ]
    out = []
    for p in procs:
        so, se = p.communicate(timeout=600)
        out.append((p.returncode, so, se))
    return out


ERROR_CASES = [
    # (args, env, exit status, text expected in the single stderr line)
    (["compare", "missing.py", "data.npz"], {}, 2, "models file 'missing.py' does not exist"),
    (["compare", "models.py", "nothere.npz"], {}, 2, "data file 'nothere.npz' does not exist"),
    (["compare", "nomodel.py", "data.npz"], {}, 1, "nomodel.py: defines no model"),
    (["compare", "syntax.py", "data.npz"], {}, 1, "syntax.py:1: syntax error"),
    (["compare", "models.py", "wrongkeys.npz"], {}, 1,
     "model 'geometric' needs argument 'x' but wrongkeys.npz has keys ['w', 'y']"),
    (["compare", "models.py", "badshape.npz"], {}, 1,
     "model 'geometric' (models.py) fails on badshape.npz (x: (12,), w: (3, 3))"),
    (["compare", "models.py", "nan.npz"], {}, 1,
     "nan.npz: array 'x' contains NaN at index (2, 1) (shape (12, 3))"),
    (["compare", "energy.py", "data.npz"], {}, 1, "cannot be compared by predictive density"),
    (["compare", "models.py", "data.npz", "--true-edges", "nokey"], {}, 2,
     "argument --true-edges: no array 'nokey' in data.npz"),
    (["compare", "models.py", "data.npz", "--num-samples", "0"], {}, 2,
     "expected a positive integer, got 0"),
    (["compare", "models.py", "data.npz", "--true-edges", "short_parents"], {}, 2,
     "argument --true-edges: 'short_parents' has shape (10,); model 'geometric' (edge site "
     "'phi') needs one parent index per child, shape (11,)"),
    (["compare", "models.py", "data.npz", "--num-samples", "10", "--num-chains", "2"], {}, 2,
     "PSIS-LOO needs at least 25 posterior draws in all, got 2 chain(s) x 10 draws = 20"),
    (["compare", "models.py", "data.npz", "--seed", "-1"], {}, 2,
     "argument --seed: expected an integer in [0, 4294967295], got '-1'"),
    (["compare", "models.py", "text.npz"], {}, 2,
     "data file 'text.npz' is not a valid .npz archive (not a zip file)"),
    (["demo", "--bogus"], {}, 2, "unrecognized arguments: --bogus"),
    (["frobnicate"], {}, 2, "invalid choice: 'frobnicate'"),
    (["reproduce", "nosuch"], {}, 2, "unknown reproduction 'nosuch'"),
    (["reproduce", "svi-attention"], {}, 2,
     "'svi-attention' is a worked example, not a paper reproduction: run python "
     "examples/infer_svi_attention.py"),
    (["bench"], {"bench": "empty"}, 1, "attention.py not found"),
]


def _case_env(files, spec):
    env = {}
    if spec.get("bench"):
        env["STRUCTINFER_BENCHMARKS"] = str(files / spec["bench"])
    return env


def _main(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, [ln for ln in out.err.splitlines() if ln.strip()]


#: the cases also run as a process (all run in-process through `cli.main`): a usage error,
#: a runtime error before any trace and one after a model's trace (a stray warning or
#: log line on stderr shows there, not to capsys), and --debug's traceback, which only a
#: process prints
PROCESS_CASES = (["frobnicate"], ["compare", "models.py", "nan.npz"],
                 ["compare", "models.py", "badshape.npz"])


def test_errors_are_one_line_with_the_right_exit_status(files, capsys, monkeypatch):
    monkeypatch.chdir(files)
    monkeypatch.setenv("STRUCTINFER_JAX_CACHE", "0")  # the test session's cache stays
    checked = []
    for args, spec, code, text in ERROR_CASES:
        with monkeypatch.context() as m:
            for k, v in _case_env(files, spec).items():
                m.setenv(k, v)
            rc, _, lines = _main(capsys, *args)
        # usage and runtime errors alike: exactly one line, no usage block, no traceback
        assert (rc, len(lines)) == (code, 1) and text in lines[0], (args, rc, lines)
        if args in PROCESS_CASES:
            checked.append((args, spec, code, text))
    assert len(checked) == len(PROCESS_CASES)
    cases = [(args, _case_env(files, spec)) for args, spec, _, _ in checked]
    results = run_many(files, cases + [(["compare", "models.py", "nan.npz", "--debug"], {})])
    for (args, _, code, text), (rc, _so, se) in zip(checked, results):
        lines = [ln for ln in se.strip().splitlines() if ln.strip()]
        assert rc == code and len(lines) == 1 and text in se, (args, rc, se)
    rc, so, se = results[-1]  # --debug: the traceback is shown
    assert rc == 1 and "Traceback" in se and "contains NaN" in se


def test_help_for_every_command(capsys):
    for argv in (["--help"], ["demo", "--help"], ["compare", "--help"], ["reproduce", "--help"],
                 ["bench", "--help"]):
        assert cli.main(argv) == 0
        text = capsys.readouterr().out
        if argv != ["--help"]:
            for flag in ("--seed", "--out", "--debug"):
                assert flag in text, (argv, flag)
    assert cli.main([]) == 2  # no command: help on stderr, usage error


def test_console_script_is_declared():
    eps = importlib.metadata.entry_points(group="console_scripts", name="structinfer")
    assert [ep.value for ep in eps] == ["structinfer.cli:main"]


def test_python_dash_m_structinfer_runs_the_command():
    """``python -m structinfer`` is the ``structinfer`` command (was "No module named
    structinfer.__main__")."""
    out = subprocess.run([sys.executable, "-m", "structinfer", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: structinfer ") and "reproduce" in out.stdout


@pytest.fixture
def registered(files, monkeypatch):
    """The test modules of ``files/mods`` registered as reproductions (run in-process)."""
    monkeypatch.syspath_prepend(str(files / "mods"))
    for name in ("tiny-thing", "broken", "needs-sklearn", "talker", "writer", "bars"):
        monkeypatch.setitem(reproductions.REPRODUCTIONS, name,
                            "si_test_" + name.replace("-", "_"))
    monkeypatch.setenv("STRUCTINFER_JAX_CACHE", "0")
    return files


def test_reproduce_lists_the_shipped_reproductions(tmp_path):
    r = subprocess.run(_cmd("reproduce", "--list"), capture_output=True, text=True,
                       cwd=tmp_path, env=_env(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("multihop", "expanding", "hopfield", "idw", "mixtures"):
        assert f"structinfer.reproductions.{name}" in r.stdout
    assert "Multi-hop attention on the toy task" in r.stdout
    # the descriptions speak to users: no tracker numbers of the project's own history
    assert not re.search(r"\bissues? #?\d", r.stdout), r.stdout


def test_reproduce_registry_and_run(registered, capsys):
    rc, out, _ = _main(capsys, "reproduce", "--list")
    assert rc == 0
    assert "tiny-thing" in out and "A tiny reproduction used by the tests." in out
    out_dir = registered / "rep-out"
    rc, _, err = _main(capsys, "reproduce", "tiny-thing", "--quick", "--seed", "3", "--out",
                       out_dir, "--", "--extra", "hello")
    assert rc == 0, err
    got = pd.read_json(out_dir / "results.json", typ="series")
    assert got["seed"] == 3 and bool(got["quick"]) and got["extra"] == "hello"
    rc, _, err = _main(capsys, "reproduce", "broken", "--quiet", "--out", registered / "b")
    assert rc == 1 and err == ["structinfer reproduce: error: reproduction 'broken' "
                               "(si_test_broken) failed with exit status 3"], err


def test_reproduce_quiet_prints_nothing_and_an_unused_out_folder_is_removed(
        registered, capsys, monkeypatch, tmp_path):
    """--quiet silences the reproduction's own printing too; the folder the command made
    for a run that wrote nothing in it (a --quick smoke run) is removed again."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = _main(capsys, "reproduce", "talker", "--quick", "--quiet")
    assert rc == 0 and out == "" and err == [], (out, err)
    assert os.listdir(".") == []  # no structinfer-reproduce/talker/ left behind
    rc, out, _ = _main(capsys, "reproduce", "talker", "--quick")
    assert rc == 0 and "a table of results" in out and os.listdir(".") == []


def test_reproduce_names_the_extra_of_a_missing_optional_dependency(registered, capsys,
                                                                    monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn raises
    rc, _, err = _main(capsys, "reproduce", "needs-sklearn", "--quiet", "--out",
                       registered / "never")
    assert rc == 1 and len(err) == 1, err
    assert 'needs scikit-learn, an optional dependency that is not installed: pip install ' \
        '"structinfer[examples]"' in err[0]
    # a shipped reproduction importing optax at the top
    monkeypatch.setitem(sys.modules, "optax", None)
    monkeypatch.delitem(sys.modules, "structinfer.reproductions.multihop", raising=False)
    rc, _, err = _main(capsys, "reproduce", "multihop", "--quick", "--quiet", "--out",
                       registered / "never")
    assert rc == 1 and len(err) == 1 and "needs optax" in err[0] and "[examples]" in err[0]
    assert not (registered / "never").exists()


def test_reproduce_quick_writes_only_with_out(registered, capsys, monkeypatch, tmp_path):
    """A --quick run gets --out only when the user gave one: a reproduction that writes a
    smoke run's outputs to --out (as lm does) writes nothing otherwise."""
    monkeypatch.chdir(tmp_path)
    rc, _, err = _main(capsys, "reproduce", "writer", "--quick", "--quiet")
    assert rc == 0 and err == [] and os.listdir(".") == [], (err, os.listdir("."))
    rc, _, err = _main(capsys, "reproduce", "writer", "--quick", "--quiet", "--out", "mine")
    assert rc == 0 and os.listdir("mine") == ["results.json"], err
    rc, _, err = _main(capsys, "reproduce", "writer", "--quiet")  # a full run: the default
    assert rc == 0 and os.listdir("structinfer-reproduce/writer") == ["results.json"], err


@pytest.mark.parametrize("flags", [[], ["--quiet"], ["--no-progress"]], ids=str)
def test_reproduce_quiet_and_no_progress_hide_the_reproductions_bars(
        registered, capsys, monkeypatch, tmp_path, flags):
    monkeypatch.chdir(tmp_path)
    rc, _, err = _main(capsys, "reproduce", "bars", "--quick", *flags)
    assert rc == 0
    assert ("training" in " ".join(err)) == (not flags), err


def test_every_shipped_reproduction_takes_no_progress(capsys):
    """`reproduce --quiet` / `--no-progress` pass --no-progress on to the reproduction."""
    import importlib

    for name, module in reproductions.REPRODUCTIONS.items():
        try:
            main = importlib.import_module(module).main
        except ModuleNotFoundError as e:  # an optional dependency is not installed
            assert reproductions.missing_dependency(e), e
            continue
        with pytest.raises(SystemExit) as exc:
            main(["--no-progress", "--help"])
        assert exc.value.code == 0 and "--no-progress" in capsys.readouterr().out, name


def test_unrecognized_arguments_name_the_subcommand(registered, capsys, monkeypatch,
                                                   tmp_path):
    """An option the subcommand does not take names the subcommand; for `reproduce`, it
    says that a reproduction's own options go after --; a reproduction's own argparse
    error is a usage error too."""
    monkeypatch.chdir(tmp_path)
    rc, _, err = _main(capsys, "reproduce", "lm", "--resume")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("structinfer reproduce: error: unrecognized arguments: --resume")
    assert "structinfer reproduce lm -- --resume" in err[0], err
    assert err[0].endswith("(see structinfer reproduce --help)"), err
    rc, _, err = _main(capsys, "demo", "extra")
    assert (rc, err) == (2, ["structinfer demo: error: unrecognized arguments: extra "
                             "(see structinfer demo --help)"])
    rc, _, err = _main(capsys, "reproduce", "tiny-thing", "--quick", "--", "--bogus")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("structinfer reproduce: error: reproduction 'tiny-thing'"), err
    assert "unrecognized arguments: --bogus" in err[0], err
    assert "structinfer reproduce tiny-thing -- --help" in err[0], err
    assert os.listdir(".") == []
    rc, out, err = _main(capsys, "reproduce", "tiny-thing", "--", "--help")
    assert rc == 0 and "--extra" in out and err == [], err


def test_an_out_folder_that_cannot_be_made_is_a_usage_error(registered, capsys,
                                                           monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STRUCTINFER_BENCHMARKS", str(registered / "bench"))
    outs = ["x" * 300 + "/out"]  # a name too long for the file system
    if os.path.isdir("/proc/sys"):  # a folder no one may make a folder in
        outs.append("/proc/sys/structinfer-test")
    for out in outs:
        for command in (["demo", "--quick"], ["reproduce", "tiny-thing"], ["bench"],
                        ["compare", registered / "models.py", registered / "data.npz"]):
            rc, _, err = _main(capsys, *command, "--out", out, "--quiet", "--no-progress")
            assert rc == 2 and len(err) == 1, (command, out, err)
            assert f"error: argument --out: cannot make folder '{out}'" in err[0], err
    assert os.listdir(".") == []


def test_bench_runs_the_benchmark_script(files):
    r = run(files, "bench", "--quick", "--", "--n", "7", env={"STRUCTINFER_BENCHMARKS":
                                                             str(files / "bench")})
    assert r.returncode == 0, r.stderr
    assert "ratio table --quick --n 7" in r.stdout


@pytest.mark.exhaustive  # (a fit as a process, ~20 s; the default tier runs `demo --quick`)
def test_compare_user_models(files):
    """A full run; a model's name is any string (its plot's file name keeps the letters,
    digits, '.', '-' and '_')."""
    (files / "named.py").write_text(
        MODELS + '\nMODELS = {"geometric/v1": model_geometric, "window": model_window}\n')
    out = files / "cmp-out"
    r = run(files, "compare", "named.py", "data.npz", "--quick", "--true-edges", "parents",
            "--out", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    table = pd.read_csv(out / "comparison.csv", index_col=0)
    assert set(table.index) == {"geometric/v1", "window"}
    edges = pd.read_csv(out / "edges.csv", index_col=0)
    assert {"map_accuracy", "effective_parents"} <= set(edges.columns)
    report = (out / "report.md").read_text()
    assert "| geometric/v1 |" in report and "elpd" in report
    assert "`attention_geometric_v1.png`" in report
    assert (out / "compare.png").stat().st_size > 0
    assert (out / "attention_window.png").stat().st_size > 0
    assert (out / "attention_geometric_v1.png").stat().st_size > 0


def test_model_names_become_distinct_file_names():
    names = ["geo/v1", "geo_v1", "GEO_V1", "a b:c", "", "..", "é" * 300]
    got = cli._file_stems(names)
    assert list(got) == names
    assert list(got.values())[:6] == ["geo_v1", "geo_v1_2", "GEO_V1_3", "a_b_c", "_", ".."]
    assert len({v.lower() for v in got.values()}) == len(names)  # case-insensitive disks
    assert all(len(f"attention_{v}.png".encode()) < 255 for v in got.values())


SIBLING_HELPER = """
import numpyro
import numpyro.distributions as dist
from numpyro.ops.indexing import Vindex

import structinfer as si


def observe(x, w, sigma, prior):
    n = x.shape[0] - 1
    with numpyro.plate("children", n):
        phi = si.edge("phi", prior)
        mu = x[:-1] @ w.T
        numpyro.sample("x", dist.Normal(Vindex(mu)[..., phi, :], sigma).to_event(1), obs=x[1:])
"""

SIBLING_MODELS = """
import numpyro
import numpyro.distributions as dist

import structinfer as si
from si_test_sibling_helper import observe


def model_geometric(x, w):
    q = numpyro.sample("q", dist.Beta(2.0, 2.0))
    observe(x, w, 0.3, si.priors.Geometric(q, x.shape[0] - 1, include_self=False, offset=1))


def model_window(x, w):
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    n = x.shape[0] - 1
    observe(x, w, sigma, si.priors.Restricted.window(n, 3, n, include_self=False, offset=1))
"""


def test_compare_models_file_imports_a_module_beside_it(files):
    """`from <module beside the models file> import ...` works from any working directory:
    the file's folder is on the import path while it loads (checked up to the data
    check, which runs after the models are loaded and before any fit)."""
    sub = files / "sibling"
    sub.mkdir(exist_ok=True)
    (sub / "si_test_sibling_helper.py").write_text(SIBLING_HELPER)
    (sub / "models.py").write_text(SIBLING_MODELS)
    script = Path(sys.executable).with_name("structinfer")  # the console script, if installed
    for cwd, path in ((files, "sibling/models.py"), (sub, "models.py")):
        cmd = _cmd("compare", path, files / "wrongkeys.npz")
        if cwd == sub and script.exists():  # its sys.path[0] is its own folder, not the cwd
            cmd = [str(script), *cmd[3:]]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=_env(files),
                           timeout=600)
        assert r.returncode == 1, r.stderr
        assert "importing it failed" not in r.stderr, r.stderr
        assert "model 'geometric' needs argument 'x'" in r.stderr, r.stderr


def test_demo_quick(files, capsys, monkeypatch):
    """The main job, in-process (`test_compare_user_models` runs a fit as a process)."""
    monkeypatch.setenv("STRUCTINFER_JAX_CACHE", "0")  # the test session's cache stays
    out = files / "demo-out"
    rc, stdout, err = _main(capsys, "demo", "--quick", "--out", out, "--seed", "1",
                            "--no-progress")
    assert rc == 0, err
    assert "PSIS-LOO comparison" in stdout and "best edge recovery" in stdout
    table = pd.read_csv(out / "comparison.csv", index_col=0)
    assert set(table.index) == {"uniform", "window", "relative", "geometric"}
    assert sorted(table["rank"]) == [0, 1, 2, 3]
    edges = pd.read_csv(out / "edges.csv", index_col=0)
    assert ((edges["map_accuracy"] >= 0) & (edges["map_accuracy"] <= 1)).all()
    report = (out / "report.md").read_text()
    for name in ("uniform", "window", "relative", "geometric"):
        assert f"| {name} |" in report
    for png in ("attention.png", "distance.png", "compare.png", "trace_geometric.png",
                "q_prior_posterior.png"):
        assert (out / png).stat().st_size > 0, png


def test_the_note_for_several_edge_sites_speaks_to_the_command_line():
    """Regression: the note passed on compare_edges' "pass site=", an argument the command
    line does not have; it says what the command skipped and where a site is chosen."""
    import structinfer.diagnostics as dg

    with pytest.raises(ValueError) as err:
        dg.edge_summary(_two_edge_sites_idata(), site=None)
    note = cli._no_edge_table(err.value)
    assert note.startswith("note: no edges.csv and no attention plots (")
    assert "compare_edges(idatas, site=...) in Python" in note


def _two_edge_sites_idata():
    import numpy as np
    import xarray as xr

    a = np.full((1, 1, 2, 2), 0.5)
    dims = ["chain", "draw", "child", "parent"]
    post = xr.Dataset({"phi": (dims, a), "psi": (dims, a)})
    return xr.DataTree.from_dict({"edge_posterior": post})
