"""Packaging: lazy imports (the command answers --help without loading JAX), the
declared dependencies, and `reproduce` / `bench` never running files from the current
directory."""

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import structinfer as si
from structinfer import cli, reproductions

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("jax", "jaxlib", "numpyro", "funsor", "numpy", "arviz_base", "arviz_stats",
         "arviz_plots", "matplotlib", "xarray", "pandas", "optax", "sklearn")

PROBE = """
import contextlib, io, json, sys
import structinfer
from structinfer import cli
steps = {}
def heavy():
    return sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
steps["import structinfer"] = heavy()
names = dir(structinfer)
steps["dir(structinfer)"] = heavy()
cli.build_parser()
with contextlib.redirect_stdout(io.StringIO()):
    for argv in (["--help"], ["compare", "--help"], ["reproduce", "--list"], ["bench", "--help"]):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code
        assert rc == 0, (argv, rc)
        steps[" ".join(argv)] = heavy()
print(json.dumps({"steps": steps, "dir": names}))
"""


def test_import_and_help_load_no_heavy_module():
    """`import structinfer`, building the parser, --help and `reproduce --list` import
    none of JAX, NumPyro, funsor, NumPy, ArviZ, matplotlib (a fresh interpreter)."""
    code = f"HEAVY = {HEAVY!r}\n" + PROBE
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["steps"] == {step: [] for step in got["steps"]}, got["steps"]
    assert set(si.__all__) <= set(got["dir"])


def test_public_names_resolve_lazily():
    from structinfer import edge, marginals  # noqa: F401  (PEP 562 __getattr__)
    from structinfer.primitives import edge as edge_def

    assert edge is edge_def and si.edge is edge_def
    assert si.marginals is marginals and marginals.__module__.startswith("structinfer.exact")
    assert si.attention.__module__.startswith("structinfer.lowering")
    for name in si.__all__:
        assert getattr(si, name) is not None, name
    assert si.exact.__name__ == "structinfer.exact" and si.priors.Uniform
    assert set(si.__all__) <= set(dir(si)) and {"exact", "lowering"} <= set(dir(si))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        si.no_such_name  # noqa: B018
    assert not hasattr(si, "_no_such_private")


# --------------------------------------------------------------------------- dependencies

def _pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _names(reqs):
    return {r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
            for r in reqs}


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def test_library_imports_only_core_dependencies():
    """No library module imports an optional dependency (optax, scikit-learn, torch); the
    reproductions, which may, are shipped but need the `examples` extra."""
    lib = REPO / "structinfer"
    skip = lib / "reproductions"
    optional = {"optax", "sklearn", "torch"}
    found = {
        (str(p.relative_to(REPO)), m)
        for p in lib.rglob("*.py") if skip not in p.parents
        for m in _imports(p) if m in optional
    }
    assert not found, found


def test_dependencies_are_lean_and_unpinned():
    project = _pyproject()["project"]
    core = _names(project["dependencies"])
    assert {"jax", "numpyro", "funsor", "numpy", "arviz-base"} <= core
    assert not core & {"jaxlib", "optax", "scikit-learn", "torch"}, core  # jax requires jaxlib
    extras = project["optional-dependencies"]
    assert {"optax", "scikit-learn"} <= _names(extras["examples"])
    # the test extra carries everything the suite runs (the reproductions included)
    assert "structinfer[examples]" in extras["test"]
    for req in project["dependencies"] + [r for rs in extras.values() for r in rs]:
        assert "==" not in req, f"exact pin: {req}"


# ------------------------------------------------ nothing runs from the current directory

PLANTED = textwrap.dedent('''
    """Planted in the current directory: must never run."""
    import pathlib
    pathlib.Path({marker!r}).write_text("ran")
''')


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A working directory holding examples/reproduce_*.py and benchmarks/attention.py that
    write a marker when run; the package looks installed from a wheel (no source checkout)."""
    cwd, marker = tmp_path / "cwd", tmp_path / "ran"
    for rel in ("examples/reproduce_planted.py", "examples/reproduce_multihop.py",
                "examples/quickstart.py", "benchmarks/attention.py"):
        (cwd / rel).parent.mkdir(parents=True, exist_ok=True)
        (cwd / rel).write_text(PLANTED.format(marker=str(marker)))
    site = tmp_path / "site-packages"  # what a wheel install looks like: no pyproject.toml
    site.mkdir()
    monkeypatch.setattr(cli, "ROOT", site)
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("STRUCTINFER_BENCHMARKS", raising=False)
    monkeypatch.setenv("STRUCTINFER_JAX_CACHE", "0")
    return marker


def _main(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_reproduce_never_runs_scripts_from_the_current_directory(planted, capsys):
    rc, out, _ = _main(capsys, "reproduce", "--list")
    assert rc == 0 and "planted" not in out and "multihop" in out
    rc, _, err = _main(capsys, "reproduce", "planted", "--quick", "--out", "o1")
    assert rc == 2 and "unknown reproduction 'planted'" in err
    rc, _, err = _main(capsys, "reproduce", "quickstart", "--quick", "--out", "o2")
    assert rc == 2 and "python examples/quickstart.py" in err
    assert not planted.exists()
    # a known name resolves to the module shipped in the package, never to a file here
    origin = Path(importlib.util.find_spec(reproductions.REPRODUCTIONS["multihop"]).origin)
    assert origin.resolve().parent == Path(reproductions.__file__).resolve().parent


def test_every_reproduction_module_is_registered():
    """Adding a reproduction is one module in structinfer/reproductions and one line in
    REPRODUCTIONS: a module without its line (or a line without its module) fails here."""
    folder = Path(reproductions.__file__).parent
    modules = {f"structinfer.reproductions.{p.stem}" for p in folder.glob("*.py")
               if not p.name.startswith("_")}
    assert set(reproductions.REPRODUCTIONS.values()) == modules
    for name, module in reproductions.REPRODUCTIONS.items():
        assert reproductions.describe(module), name  # a docstring for --list


def test_bench_never_runs_a_script_from_the_current_directory(planted, capsys):
    rc, _, err = _main(capsys, "bench", "--quick", "--out", "o3")
    assert rc == 1 and "source checkout" in err and "benchmarks/attention.py" in err
    assert len(err.strip().splitlines()) == 1
    assert not planted.exists()


def test_bench_runs_the_script_of_the_checkout_holding_the_package(planted, capsys,
                                                                     tmp_path, monkeypatch):
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text('[project]\nname = "structinfer"\n')
    mark = tmp_path / "checkout-ran"
    (checkout / "benchmarks" / "attention.py").write_text(
        f"import pathlib, sys\npathlib.Path({str(mark)!r}).write_text(' '.join(sys.argv[1:]))\n")
    monkeypatch.setattr(cli, "ROOT", checkout)
    rc, _, err = _main(capsys, "bench", "--quick", "--out", "o4")
    assert rc == 0, err
    assert mark.read_text().startswith("--quick") and not planted.exists()


# ------------------------------------------------------- the oldest supported versions

FLOOR = REPO / ".ci" / "floor.txt"


def _floor_pins(text):
    pins = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, ver = line.partition("==")
            assert sep and ver.strip(), f".ci/floor.txt: not a '==' pin: {line!r}"
            pins[name.strip().lower()] = ver.strip()
    return pins


def _floors(reqs):
    """{name: version} of every plain `name>=version` requirement (markers ignored)."""
    out = {}
    for req in reqs:
        spec = req.split(";")[0].replace(" ", "")
        if ">=" in spec:
            name, _, ver = spec.partition(">=")
            out[name.split("[")[0].lower()] = ver.split(",")[0]
    return out


def _check_floor(pins, deps, ci, readme):
    """Every inconsistency between the floor pins, pyproject, .ci/run and the README."""
    floors, problems = _floors(deps), []
    for name in ("jax", "jaxlib", "numpyro", "funsor", "numpy"):
        if name not in pins:
            problems.append(f"{name} is not pinned in .ci/floor.txt")
    for name, ver in pins.items():
        want = pins.get("jax") if name == "jaxlib" else floors.get(name)  # jax brings jaxlib
        if ver != want:
            problems.append(f"{name}=={ver} in .ci/floor.txt but pyproject's floor is {want}")
        if f"{name} {ver}" not in readme:
            problems.append(f"README's 'Supported versions' does not name {name} {ver}")
    if "floor=.ci/floor.txt" not in ci or '-c "$floor"' not in ci:
        problems.append(".ci/run does not install under the constraints of .ci/floor.txt")
    if "-n 2" not in ci.split("floor=", 1)[-1]:
        problems.append(".ci/run's floor leg does not run pytest with -n 2")
    return problems


def test_floor_versions_are_the_pyproject_floors_and_ci_tests_them():
    """.ci/floor.txt pins jax, jaxlib, numpyro, funsor and numpy at exactly pyproject's
    `>=` floors (jaxlib at jax's), README names them, and .ci/run's floor leg installs
    under those pins and runs its test files, which exist. numpy is pinned too: unpinned,
    the floor leg resolved the newest numpy next to the oldest jax, and numpy's floor was
    never run."""
    pins, ci = _floor_pins(FLOOR.read_text()), (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    deps = _pyproject()["project"]["dependencies"]
    assert _check_floor(pins, deps, ci, readme) == []
    leg = ci.split("floor_tests=(", 1)[1].split(")", 1)[0].split()
    assert leg and all((REPO / t.split("::")[0]).is_file() for t in leg), leg
    assert '"${floor_tests[@]}"' in ci
    # and the check bites: a floor raised in pyproject alone, a pin missing, a leg that
    # ignores the file
    raised = [d.replace("jax>=", "jax>=9") if d.startswith("jax>=") else d for d in deps]
    assert any("jax==" in p for p in _check_floor(pins, raised, ci, readme))
    for name in ("funsor", "numpy"):
        assert any(f"{name} is not" in p for p in _check_floor(
            {k: v for k, v in pins.items() if k != name}, deps, ci, readme))
    assert _check_floor(pins, deps, ci.replace('-c "$floor"', ""), readme)


NO_FLAX = """
import json, sys
sys.modules[BLOCKED] = None  # `import BLOCKED` raises ModuleNotFoundError
out = {}
for how in ("import", "attribute"):
    for m in [m for m in sys.modules if m.startswith("structinfer.nn")]:
        del sys.modules[m]
    try:
        if how == "import":
            import structinfer.nn  # noqa: F401
        else:
            import structinfer
            structinfer.nn  # noqa: B018 (PEP 562: imports the submodule)
    except ModuleNotFoundError as e:
        out[how] = ["ModuleNotFoundError", str(e), e.name]
    except ImportError as e:
        out[how] = ["ImportError", str(e), e.name]
    else:
        out[how] = ["imported", "", None]
print(json.dumps(out))
"""


@pytest.mark.parametrize("blocked, says", [("flax", "which is not installed"),
                                            ("flax.nnx", "has no NNX")])
def test_nn_without_flax_is_a_module_not_found_error_naming_the_extra(blocked, says):
    """Without Flax (or with a Flax without NNX), `import structinfer.nn` (and
    `structinfer.nn`) raises ModuleNotFoundError (so `pytest.importorskip` and `except
    ModuleNotFoundError` work) naming Flax NNX and the pyproject extra that installs it."""
    extras = _pyproject()["project"]["optional-dependencies"]
    (extra,) = [name for name, reqs in extras.items() if "flax" in _names(reqs)
                and all(r.startswith("flax") for r in reqs)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = NO_FLAX.replace("BLOCKED", repr(blocked), 1).replace("BLOCKED", blocked)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for how, (kind, message, name) in got.items():
        assert kind == "ModuleNotFoundError", (how, kind, message)
        assert name == "flax", (how, name)
        assert "Flax" in message and "NNX" in message, message
        assert f'pip install "structinfer[{extra}]"' in message, message
        assert says in message, message
