"""`structinfer compare` checks every input before the first fit.

Run in-process with ``structinfer.infer.nuts`` replaced by a stub that raises
``REACHED THE FIT``: a bad input must exit 2 with one line on stderr naming the
argument (the stub is never reached); good inputs reach the stub. No model is
ever fitted here, so these tests take seconds.
"""

import zipfile

import numpy as np
import pytest

from structinfer import cli, infer
from structinfer.demo import make_task

MODELS = '''
import numpyro
import numpyro.distributions as dist
from numpyro.ops.indexing import Vindex

import structinfer as si


def _observe(x, w, sigma, prior, name="phi"):
    n = x.shape[0] - 1
    with numpyro.plate("children", n):
        phi = si.edge(name, prior)
        mu = x[:-1] @ w.T
        numpyro.sample(name + "_x", dist.Normal(Vindex(mu)[..., phi, :], sigma).to_event(1),
                       obs=x[1:])


def model_geometric(x, w):
    q = numpyro.sample("q", dist.Beta(2.0, 2.0))
    n = x.shape[0] - 1
    _observe(x, w, 0.3, si.priors.Geometric(q, n, include_self=False, offset=1))


def model_window(x, w):
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    n = x.shape[0] - 1
    _observe(x, w, sigma, si.priors.Restricted.window(n, 3, n, include_self=False, offset=1))
'''

TWO_SITES = MODELS + '''

def model_two(x, w):
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    n = x.shape[0] - 1
    _observe(x, w, sigma, si.priors.Restricted.causal(n, n, include_self=False, offset=1), "a")
    _observe(x, w, sigma, si.priors.Restricted.causal(n, n, include_self=False, offset=1), "b")
'''

NO_EDGES = MODELS + '''

def model_plain(x, w):
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("nodes", x.shape[0]):
        numpyro.sample("x", dist.Normal(0.0, sigma).expand([x.shape[1]]).to_event(1), obs=x)
'''

SHORTER = MODELS + '''

def model_shorter(x, w):
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    n = x.shape[0] - 2
    _observe(x[1:], w, sigma, si.priors.Restricted.causal(n, n, include_self=False, offset=1))
'''

SCORED = """
import numpyro
import numpyro.distributions as dist
from numpyro.ops.indexing import Vindex

import structinfer as si


def _observe(x, w, scale):
    n = x.shape[0] - 1
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("children", n):
        prior = si.priors.Restricted.causal(n, include_self=False, offset=1)
        phi = si.edge("phi", prior, si.scores.Dot(x[1:], x[:-1], scale=scale))
        mu = x[:-1] @ w.T
        numpyro.sample("x", dist.Normal(Vindex(mu)[..., phi, :], sigma).to_event(1), obs=x[1:])


def model_sharp(x, w):
    _observe(x, w, 1.0)


def model_flat(x, w):
    _observe(x, w, 0.1)
"""

REACHED = "REACHED THE FIT"


@pytest.fixture
def work(tmp_path, monkeypatch):
    """Files in a temporary folder (the working directory); fitting is stubbed out."""
    task = make_task(12, dim=3, seed=5)
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "two.py").write_text(TWO_SITES)
    (tmp_path / "noedges.py").write_text(NO_EDGES)
    (tmp_path / "models.txt").write_text(MODELS)
    (tmp_path / "scored.py").write_text(SCORED)
    (tmp_path / "shorter.py").write_text(SHORTER)
    p = task.parents
    np.savez(tmp_path / "data.npz", x=task.x, w=task.weight, parents=p,
             short=p[:-1], wide=np.stack([p, p]), floats=p.astype(np.float32),
             flags=p > 0, high=np.where(np.arange(p.size) == 3, p.size, p),
             negative=np.where(np.arange(p.size) == 2, -1, p))
    (tmp_path / "text.npz").write_text("x,y\n1,2\n")
    np.save(tmp_path / "array.npy", task.x)
    (tmp_path / "array.npz").write_bytes((tmp_path / "array.npy").read_bytes())
    good = (tmp_path / "data.npz").read_bytes()
    (tmp_path / "truncated.npz").write_bytes(good[: len(good) // 2])
    (tmp_path / "empty.npz").write_bytes(b"")
    with zipfile.ZipFile(tmp_path / "notes.npz", "w") as z:
        z.writestr("notes.txt", "hello")
    with zipfile.ZipFile(tmp_path / "badmember.npz", "w") as z:
        z.writestr("x.npy", b"\x93NUMPY garbage")
    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}], dtype=object))
    (tmp_path / "afile").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STRUCTINFER_JAX_CACHE", "0")
    (tmp_path / "nothing").mkdir()  # no script: bench never starts one
    monkeypatch.setenv("STRUCTINFER_BENCHMARKS", str(tmp_path / "nothing"))

    def stub(*args, **kwargs):
        raise RuntimeError(f"{REACHED} with num_warmup={kwargs.get('num_warmup')}")

    monkeypatch.setattr(infer, "nuts", stub)
    return tmp_path


def _run(capsys, *argv):
    rc = cli.main([str(a) for a in argv] + ["--no-progress", "--quiet"])
    err = capsys.readouterr().err
    return rc, [ln for ln in err.splitlines() if ln.strip()]


def _usage_error(capsys, argv, *expected):
    rc, lines = _run(capsys, *argv)
    assert rc == 2, (argv, rc, lines)
    assert len(lines) == 1, (argv, lines)  # one line: no usage block, no traceback
    for text in expected:
        assert text in lines[0], (argv, lines)
    assert REACHED not in lines[0]
    return lines[0]


BAD_TRUE_EDGES = [
    ("short", "shape (10,)", "one parent index per child, shape (11,)"),
    ("wide", "shape (2, 11)", "shape (11,)"),
    ("floats", "integer parent indices", "float32"),
    ("flags", "integer parent indices", "bool"),
    ("high", "[0, 11)", "max 11"),
    ("negative", "[0, 11)", "min -1"),
    ("nokey", "no array 'nokey'", "keys:"),
    ("x", "integer parent indices", "float32"),
]


@pytest.mark.parametrize("case", BAD_TRUE_EDGES, ids=[c[0] for c in BAD_TRUE_EDGES])
def test_bad_true_edges_stop_before_fitting(work, capsys, case):
    key, *expected = case
    line = _usage_error(capsys, ["compare", "models.py", "data.npz", "--true-edges", key],
                        "--true-edges", *expected)
    assert not (work / "structinfer-compare").exists(), line


def test_true_edges_need_one_edge_site_per_model(work, capsys):
    _usage_error(capsys, ["compare", "two.py", "data.npz", "--true-edges", "parents"],
                 "--true-edges", "model 'two'", "2 edge sites", "'a', 'b'")
    _usage_error(capsys, ["compare", "noedges.py", "data.npz", "--true-edges", "parents"],
                 "--true-edges", "model 'plain'", "no edge site")


def test_good_true_edges_reach_the_fit(work, capsys):
    rc, lines = _run(capsys, "compare", "models.py", "data.npz", "--true-edges", "parents",
                     "--quick")
    assert rc == 1 and REACHED in lines[-1], lines


@pytest.mark.parametrize("argv,expected", [
    (["--num-samples", "10"], "at least 25 posterior draws"),
    (["--num-samples", "12", "--num-chains", "2"], "2 chain(s) x 12 draws = 24"),
    (["--quick", "--num-samples", "20"], "1 chain(s) x 20 draws = 20"),
    (["--num-chains", "0"], "argument --num-chains: expected a positive integer, got 0"),
    (["--num-warmup", "-3"], "argument --num-warmup: expected a positive integer, got -3"),
    # no adaptation would leave NUTS at its initial step size: a stuck chain
    (["--num-warmup", "0"], "argument --num-warmup: expected a positive integer, got 0"),
    (["--num-samples", "many"], "argument --num-samples: expected a positive integer, got 'many'"),
])
def test_too_few_draws_for_loo_stop_before_fitting(work, capsys, argv, expected):
    _usage_error(capsys, ["compare", "models.py", "data.npz", *argv], expected)


@pytest.mark.parametrize("warmup", ["1", "7"])
def test_enough_draws_reach_the_fit(work, capsys, warmup):
    rc, lines = _run(capsys, "compare", "models.py", "data.npz", "--num-samples", "13",
                     "--num-chains", "2", "--num-warmup", warmup)
    assert rc == 1 and f"{REACHED} with num_warmup={warmup}" in lines[-1], lines


@pytest.mark.parametrize("command", [["compare", "models.py", "data.npz"], ["demo"],
                                     ["reproduce", "anything"], ["bench"]])
@pytest.mark.parametrize("seed", ["-1", "4294967296", "1.5", "x"])
def test_seed_out_of_range_is_a_usage_error(work, capsys, command, seed):
    _usage_error(capsys, [*command, "--seed", seed], "argument --seed",
                 "expected an integer in [0, 4294967295]")


def test_largest_seed_is_accepted(work, capsys):
    rc, lines = _run(capsys, "compare", "models.py", "data.npz", "--seed", "4294967295")
    assert rc == 1 and REACHED in lines[-1], lines


BAD_NPZ = [
    ("text.npz", "not a zip file"),
    ("array.npz", "a single .npy array"),
    ("truncated.npz", "not a zip file"),
    ("empty.npz", "empty file"),
    ("notes.npz", "member 'notes.txt' is not a .npy array"),
    ("badmember.npz", "member 'x.npy'"),
]


@pytest.mark.parametrize("name,expected", BAD_NPZ, ids=[c[0] for c in BAD_NPZ])
def test_a_file_that_is_not_an_npz_archive_says_so(work, capsys, name, expected):
    line = _usage_error(capsys, ["compare", "models.py", name],
                        f"data file '{name}' is not a valid .npz archive", expected)
    assert "pickle" not in line.lower(), line


def test_object_arrays_are_refused_without_advice_to_unpickle(work, capsys):
    rc, lines = _run(capsys, "compare", "models.py", "objects.npz")
    assert rc == 1 and len(lines) == 1, lines
    assert "array 'x' holds Python objects (dtype object); expected numbers" in lines[0]
    assert "allow_pickle" not in lines[0]


def test_paths_are_checked_before_anything_runs(work, capsys):
    _usage_error(capsys, ["compare", "models.txt", "data.npz"],
                 "models file 'models.txt' is not a Python file (.py)")
    _usage_error(capsys, ["compare", "models.py", "data.npz", "--out", "afile"],
                 "argument --out", "'afile' exists and is not a folder")
    _usage_error(capsys, ["demo", "--out", "afile"], "argument --out",
                 "'afile' exists and is not a folder")


@pytest.mark.parametrize("argv,expected", [
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["compare", "models.py"], "the following arguments are required: DATA.npz"),
    (["compare", "models.py", "data.npz", "--score-factors", "maybe"], "--score-factors"),
])
def test_argparse_errors_are_one_line(work, capsys, argv, expected):
    _usage_error(capsys, argv, expected, "--help")


def test_models_file_imports_a_module_beside_it_and_sys_path_is_restored(work, capsys):
    import sys

    sub = work / "sub"
    sub.mkdir()
    (sub / "si_test_validation_helper.py").write_text("import structinfer as si\nPRIOR = si\n")
    (sub / "models.py").write_text("from si_test_validation_helper import PRIOR  # noqa\n"
                                   + MODELS)
    before = list(sys.path)
    try:
        rc, lines = _run(capsys, "compare", "sub/models.py", "data.npz", "--quick")
        assert rc == 1 and REACHED in lines[-1], lines
        assert sys.path == before
    finally:
        sys.modules.pop("si_test_validation_helper", None)


def test_models_of_different_observations_stop_before_fitting(work, capsys):
    """One model observes 10 children, the others 11: PSIS-LOO cannot compare them, and
    the command says so before the first fit (not after fitting every model)."""
    rc, lines = _run(capsys, "compare", "shorter.py", "data.npz")
    assert rc == 1 and len(lines) == 1, lines
    assert REACHED not in lines[0], lines
    assert "model 'shorter'" in lines[0] and "(10,)" in lines[0] and "(11,)" in lines[0], lines


def test_score_factor_error_names_the_command_line_option(work, capsys):
    rc, lines = _run(capsys, "compare", "scored.py", "data.npz")
    assert rc == 1 and len(lines) == 1, lines
    assert "model 'sharp'" in lines[0] and "pass --score-factors normalize" in lines[0], lines
    assert "score_factors=" not in lines[0], lines
    assert lines[0].count("model '") == 1, lines  # named once, as MODELS.py names it
    rc, lines = _run(capsys, "compare", "scored.py", "data.npz", "--score-factors", "normalize")
    assert rc == 1 and REACHED in lines[-1], lines


@pytest.mark.parametrize("flags", [[], ["--quiet"], ["--no-progress"]], ids=str)
@pytest.mark.parametrize("command", [["compare", "models.py", "data.npz"], ["demo"]],
                         ids=lambda c: c[0])
def test_quiet_and_no_progress_hide_the_progress_bars(work, capsys, command, flags):
    rc = cli.main([*command, "--quick", *flags])
    err = capsys.readouterr().err
    assert rc == 1 and REACHED in err, err  # the bar starts before the first fit
    assert ("fitting" in err) == (not flags), err


def test_a_usage_error_of_compare_does_not_load_jax(tmp_path):
    """Regression (review): the draw minimum was read from the diagnostics, so `structinfer
    compare` loaded JAX, NumPyro and funsor (seconds) before its first argument check;
    the command promises to start without JAX."""
    import subprocess
    import sys

    code = ("import sys; from structinfer import cli; "
            "rc = cli.main(['compare', 'nope.py', 'nope.npz', '--num-samples', '3']); "
            "print(rc, 'jax' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert "PSIS-LOO needs at least 25" in r.stderr, r.stderr
    assert r.stdout.split()[-1] == "False", r.stdout
