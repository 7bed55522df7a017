"""The ``structinfer`` command: ``demo``, ``compare``, ``reproduce``, ``bench``.

Exit status: 0 on success, 2 on a usage error (bad arguments or option values, a
path that does not exist or is not what it should be, a ``--true-edges`` array that
does not fit the models, an unknown reproduction), 1 on a runtime error (a model file
that defines no model, data with wrong keys, shapes or NaN, a failing fit or script).
Every input of ``compare`` is checked before the first fit. Errors are one line on
stderr; ``--debug`` shows the traceback instead.

Heavy imports (JAX, NumPyro, ArviZ, matplotlib) happen inside the commands, so
``--help`` and usage errors answer at once.

``reproduce`` and ``bench`` never run a file from the current directory: the paper
reproductions are modules of the installed package (`structinfer.reproductions`);
the benchmark script is run only from the source checkout holding the imported package.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._psis import MIN_DRAWS

__all__ = ["main", "build_parser", "CLIError", "load_models", "load_data", "source_checkout",
           "bench_script"]

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2

#: seeds are 32-bit: JAX keeps the low 32 bits (2**32 would repeat seed 0), NumPy
#: refuses negative ones
MAX_SEED = 2**32 - 1

#: the package's parent folder: a source checkout (with benchmarks/ and examples/) when the
#: package is imported from one, ``site-packages`` for a wheel install
ROOT = Path(__file__).resolve().parent.parent

#: worked examples that ``reproduce`` ran from a checkout's examples/ folder before the
#: paper reproductions moved into the package: name -> script
WORKED_EXAMPLES = {
    "quickstart": "quickstart.py",
    "svi-attention": "infer_svi_attention.py",
    "expanding-nuts": "infer_nuts_expanding.py",
}


class CLIError(Exception):
    """An error reported as one line; ``code`` is the exit status (1 runtime, 2 usage).

    Args:
        message: the one-line message.
        code: the exit status.
    """

    def __init__(self, message: str, code: int = EXIT_RUNTIME):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------
# where `reproduce` and `bench` find their code (never in the current directory)
# --------------------------------------------------------------------------------------


def source_checkout() -> Path | None:
    """The source checkout holding the imported package, if it was imported from one.

    An editable install or ``PYTHONPATH`` imports from a checkout: the package's parent
    folder with the project's ``pyproject.toml``; a wheel's ``site-packages`` has none.
    The current directory is never consulted.

    Returns:
        The checkout's root folder, or ``None`` when installed from a wheel.
    """
    try:
        text = (ROOT / "pyproject.toml").read_text(errors="replace")
    except OSError:
        return None
    return ROOT if 'name = "structinfer"' in text else None


def bench_script() -> Path:
    """The benchmark script, ``benchmarks/attention.py`` of the source checkout.

    The environment variable ``STRUCTINFER_BENCHMARKS`` names another folder.

    Returns:
        The script's path.

    Raises:
        CLIError: saying where to get the script when there is none.
    """
    if os.environ.get("STRUCTINFER_BENCHMARKS"):
        script = Path(os.environ["STRUCTINFER_BENCHMARKS"]) / "attention.py"
        if not script.is_file():
            raise CLIError(f"benchmark script {script} not found ($STRUCTINFER_BENCHMARKS)")
        return script
    root = source_checkout()
    if root is None or not (root / "benchmarks" / "attention.py").is_file():
        raise CLIError(
            "the benchmarks are not part of the installed package: `structinfer bench` runs "
            "benchmarks/attention.py of a source checkout; get the project's repository, "
            "pip install -e . in it and run `structinfer bench` (or python "
            "benchmarks/attention.py) there"
        )
    return root / "benchmarks" / "attention.py"


# --------------------------------------------------------------------------------------
# user models and data (`structinfer compare`)
# --------------------------------------------------------------------------------------


def load_models(path: Path) -> dict[str, Callable]:
    """Model functions from a Python file (``structinfer compare``).

    Its ``MODELS`` dict ``{name: function}`` if it defines one, else every function named
    ``model_<name>`` (in file order). While the file runs, its folder is first on the
    import path (``sys.path``, restored afterwards), so it may import a module beside it
    (``from helpers import ...``) from any working directory.

    Args:
        path: the Python file.

    Returns:
        ``{name: model function}``.

    Raises:
        CLIError: if the file cannot be imported or defines no model.
    """
    spec = importlib.util.spec_from_file_location(f"_structinfer_user_models_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise CLIError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise CLIError(f"{path}:{e.lineno}: syntax error: {e.msg}") from e
    except Exception as e:  # the user's code failed at import time
        raise CLIError(f"{path}: importing it failed: {type(e).__name__}: {e}") from e
    finally:
        sys.path[:] = saved
    if hasattr(module, "MODELS"):
        models = module.MODELS
        if not isinstance(models, dict) or not all(
            isinstance(k, str) and callable(v) for k, v in models.items()
        ):
            raise CLIError(f"{path}: MODELS must be a dict {{name: model function}}")
    else:
        models = {
            name[len("model_"):]: obj
            for name, obj in vars(module).items()
            if name.startswith("model_") and inspect.isfunction(obj)
            and obj.__module__ == module.__name__
        }
    if not models:
        raise CLIError(
            f"{path}: defines no model: write MODELS = {{'name': fn, ...}} or functions "
            "named model_<name>(...) taking the data arrays as keyword arguments"
        )
    return dict(models)


def _not_npz(path: Path, why: str) -> CLIError:
    return CLIError(
        f"data file '{path}' is not a valid .npz archive ({why}); write the arrays with "
        "numpy.savez(path, name=array, ...)",
        EXIT_USAGE,
    )


def _read_npz(path: Path) -> dict[str, Any]:
    """The arrays of a ``.npz`` archive; never unpickles. Raises a usage error saying what
    the file is when it is not an archive of ``.npy`` arrays."""
    import numpy as np

    if not zipfile.is_zipfile(path):
        with open(path, "rb") as fh:
            head = fh.read(6)
        if not head:
            why = "an empty file"
        elif head == b"\x93NUMPY":
            why = "a single .npy array (numpy.save), not an archive of named arrays"
        else:
            why = "not a zip file"
        raise _not_npz(path, why)
    try:
        with zipfile.ZipFile(path) as z:
            members = z.namelist()
            broken = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise _not_npz(path, f"unreadable zip: {e}") from e
    if broken is not None:
        raise _not_npz(path, f"member '{broken}' is corrupt")
    for name in members:
        if not name.endswith(".npy"):
            raise _not_npz(path, f"member '{name}' is not a .npy array")
    data = {}
    with np.load(path, allow_pickle=False) as f:
        for key, member in zip(f.files, members):
            try:
                data[key] = f[key]
            except ValueError as e:
                if "Object arrays" in str(e):  # numpy's refusal to unpickle
                    raise CLIError(
                        f"{path}: array '{key}' holds Python objects (dtype object); expected "
                        "numbers"
                    ) from e
                raise _not_npz(path, f"member '{member}': {e}") from e
            except Exception as e:
                raise _not_npz(path, f"member '{member}': {type(e).__name__}: {e}") from e
    return data


def load_data(path: Path) -> dict[str, Any]:
    """Arrays of an ``.npz`` file, refusing NaN/inf with the key and index.

    Args:
        path: the ``.npz`` file (never unpickled).

    Returns:
        ``{key: array}``.

    Raises:
        CLIError: exit status 2 when the file is not a ``.npz`` archive of ``.npy``
            arrays (saying what it is instead), 1 for an archive with no arrays, an
            object or text array, or NaN/inf values.
    """
    import numpy as np

    data = _read_npz(path)
    if not data:
        raise CLIError(f"{path}: holds no arrays")
    for k, v in data.items():
        if v.dtype.kind in "fc":
            bad = ~np.isfinite(v)
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0])
                kind = "NaN" if np.isnan(v[idx]) else "inf"
                raise CLIError(f"{path}: array '{k}' contains {kind} at index {idx} (shape {v.shape})")
        elif v.dtype.kind not in "biu":
            raise CLIError(f"{path}: array '{k}' has dtype {v.dtype}; expected numbers")
    return data


def _bind(name: str, fn: Callable, data: dict, data_path: Path, exclude: set) -> dict:
    sig = inspect.signature(fn)
    avail = {k: v for k, v in data.items() if k not in exclude}
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return avail
    kwargs = {}
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
            raise CLIError(
                f"model '{name}': parameter '{p.name}' must be passable by keyword "
                "(the data arrays are passed as keyword arguments named like the .npz keys)"
            )
        if p.name in avail:
            kwargs[p.name] = avail[p.name]
        elif p.default is p.empty:
            raise CLIError(
                f"model '{name}' needs argument '{p.name}' but {data_path} has keys "
                f"{sorted(avail)}"
            )
    return kwargs


def _shapes(kwargs: dict) -> str:
    return ", ".join(f"{k}: {tuple(v.shape)}" for k, v in kwargs.items())


def _edge_sites(fn: Callable, kwargs: dict) -> dict[str, tuple[tuple[int, ...], int]]:
    """The edge sites of a model on the data, ``{site: (children shape, number of parents)}``.

    Read from the model's one inspection (:func:`structinfer.exact.inspect_model`), run
    shape-only (``jax.eval_shape``: traced, never compiled): the edge posterior of a site
    has shape ``children shape + (parents,)``, so a true structure for it needs the
    children shape.
    """
    import jax
    import jax.numpy as jnp

    from .exact import inspect_model

    sites: dict[str, tuple[tuple[int, ...], int]] = {}

    def run():
        info = inspect_model(fn, **{k: jnp.asarray(v) for k, v in kwargs.items()})
        sites.update({n: (s.shape, s.num_values) for n, s in info.of_role("edge").items()})
        return 0

    jax.eval_shape(run)
    return sites


def _no_edge_table(err: Exception) -> str:
    """The note when ``compare_edges`` cannot summarise the models' edges (a model with
    several edge sites): what it means on the command line, which has no site option."""
    return (f"note: no edges.csv and no attention plots ({err}): the command line "
            "summarises models with one edge site each; for one site of several call "
            "structinfer.diagnostics.compare_edges(idatas, site=...) in Python on the "
            "fitted models")


def _check_true_edges(key: str, true_edges, models: dict, sites: dict) -> None:
    """``--true-edges``: one integer parent index per child of each model's one edge site."""
    import numpy as np

    where = f"argument --true-edges: '{key}'"
    for name in models:
        found = sites[name]
        if len(found) != 1:
            which = ", ".join(f"'{s}'" for s in found)
            raise CLIError(
                f"argument --true-edges: model '{name}' has "
                + (f"{len(found)} edge sites ({which})" if found else
                   "no edge site (structinfer.edge)")
                + "; a true structure is compared with exactly one edge site per model",
                EXIT_USAGE,
            )
        site, (shape, m) = next(iter(found.items()))
        if true_edges.shape != shape:
            raise CLIError(
                f"{where} has shape {true_edges.shape}; model '{name}' (edge site '{site}') "
                f"needs one parent index per child, shape {shape}",
                EXIT_USAGE,
            )
        if true_edges.size and (true_edges.min() < 0 or true_edges.max() >= m):
            raise CLIError(
                f"{where} must hold parent indices in [0, {m}) (edge site '{site}' of model "
                f"'{name}' has {m} parents), got min {int(np.min(true_edges))}, "
                f"max {int(np.max(true_edges))}",
                EXIT_USAGE,
            )


# --------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------


def _setup_jax(args) -> None:
    cache = os.environ.get("STRUCTINFER_JAX_CACHE", os.path.expanduser("~/.cache/structinfer/jax"))
    import jax

    if cache and cache != "0":
        try:
            os.makedirs(cache, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        except (OSError, AttributeError):  # pragma: no cover - cache is an optimisation
            pass
    import matplotlib

    matplotlib.use("Agg")


def _log(args) -> Callable[[str], None]:
    return (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))


def _check_out(out: str, shown: str | None = None) -> None:
    """``--out`` must be a folder or a path where one can be made (checked, not made);
    errors name it as ``shown`` (default ``out``): what the user typed."""
    path, out = Path(out), shown or out
    try:
        if path.exists() and not path.is_dir():
            raise CLIError(f"argument --out: '{out}' exists and is not a folder", EXIT_USAGE)
        parent = next((p for p in path.absolute().parents if p.exists()), None)
    except OSError as e:  # a name too long, say
        raise CLIError(f"argument --out: cannot make folder '{out}': {e}", EXIT_USAGE) from e
    if not path.exists() and parent is not None and not parent.is_dir():
        raise CLIError(f"argument --out: '{out}' lies under '{parent}', which is not a folder",
                       EXIT_USAGE)


def _make_out(out: str, shown: str | None = None) -> None:
    """Make the ``--out`` folder (and its parents); a usage error naming it as ``shown``
    (default ``out``) when it cannot be made."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise CLIError(f"argument --out: cannot make folder '{shown or out}': {e}",
                       EXIT_USAGE) from e


def _file_stems(names: Sequence[str]) -> dict[str, str]:
    """A file-name part for each model name: its letters, digits, ``.``, ``-`` and ``_``,
    other characters replaced by ``_`` (a name may hold ``/``), at most 100 bytes, made
    distinct (ignoring case) by a suffix ``_2``, ``_3``, ..."""
    stems: dict[str, str] = {}
    used: set[str] = set()
    for name in names:
        base = re.sub(r"[^\w.-]", "_", name) or "_"
        while len(base.encode()) > 100:
            base = base[:-1]
        stem, i = base, 2
        while stem.lower() in used:
            stem, i = f"{base}_{i}", i + 1
        used.add(stem.lower())
        stems[name] = stem
    return stems


#: Python keywords in library messages -> the options that set them at the command line
_OPTION_WORDS = {"score_factors='normalize'": "--score-factors normalize"}


def _cli_words(message: str) -> str:
    """A library message with its Python keyword arguments named as command-line options."""
    for python, option in _OPTION_WORDS.items():
        message = message.replace(python, option)
    return message


def _draws(args) -> tuple[int, int, int]:
    """Warm-up, draws and chains of ``compare`` (``--quick`` defaults), enough for PSIS-LOO."""
    def given(value, quick, full):
        return value if value is not None else (quick if args.quick else full)

    nw = given(args.num_warmup, 60, 500)
    ns = given(args.num_samples, 60, 500)
    nc = given(args.num_chains, 1, 2)
    if nc * ns < MIN_DRAWS:
        raise CLIError(
            f"argument --num-samples/--num-chains: PSIS-LOO needs at least {MIN_DRAWS} "
            f"posterior draws in all, got {nc} chain(s) x {ns} draws = {nc * ns}",
            EXIT_USAGE,
        )
    return nw, ns, nc


def cmd_demo(args) -> int:
    _check_out(args.out)
    _make_out(args.out)
    _setup_jax(args)
    from .demo import run_demo

    log = _log(args)
    res = run_demo(args.out, seed=args.seed, quick=args.quick, progress=args.progress, log=log)
    cols = [c for c in ("rank", "elpd", "p", "elpd_diff", "weight", "se", "dse", "warning")
            if c in res.comparison.columns]
    log("\nPSIS-LOO comparison of the structural priors (ArviZ):\n")
    log(res.comparison[cols].to_string(float_format=lambda v: f"{v:.2f}"))
    log("\nRecovery of the true edges:\n")
    log(res.edges.to_string(float_format=lambda v: f"{v:.3f}"))
    log(
        f"\nbest predictive prior: {res.comparison.index[0]}; best edge recovery: "
        f"{res.edges.index[0]}"
    )
    log(f"report: {os.path.join(args.out, 'report.md')} ({res.seconds:.0f} s)")
    return EXIT_OK


def cmd_compare(args) -> int:
    # every input is checked here, before the first fit: arguments, paths, data, models
    nw, ns, nc = _draws(args)
    models_path, data_path = Path(args.models), Path(args.data)
    for p, what in ((models_path, "models file"), (data_path, "data file")):
        if not p.exists():
            raise CLIError(f"{what} '{p}' does not exist", EXIT_USAGE)
        if not p.is_file():
            raise CLIError(f"{what} '{p}' is not a file", EXIT_USAGE)
    if models_path.suffix != ".py":
        raise CLIError(f"models file '{models_path}' is not a Python file (.py)", EXIT_USAGE)
    _check_out(args.out)
    data = load_data(data_path)
    models = load_models(models_path)
    if len(models) < 2:
        raise CLIError(
            f"{models_path}: defines one model ({next(iter(models))}); comparing needs at least two"
        )
    exclude = set()
    true_edges = None
    if args.true_edges:
        if args.true_edges not in data:
            raise CLIError(
                f"argument --true-edges: no array '{args.true_edges}' in {data_path}; keys: "
                f"{sorted(data)}",
                EXIT_USAGE,
            )
        true_edges = data[args.true_edges]
        if true_edges.dtype.kind not in "iu":
            raise CLIError(
                f"argument --true-edges: '{args.true_edges}' must hold integer parent indices, "
                f"got {true_edges.dtype}",
                EXIT_USAGE,
            )
        exclude.add(args.true_edges)
    bound = {n: _bind(n, fn, data, data_path, exclude) for n, fn in models.items()}

    _setup_jax(args)
    import warnings

    import jax
    import matplotlib.pyplot as plt
    from tqdm.auto import tqdm

    from . import diagnostics as dg
    from . import exact, infer
    from .demo import markdown_table

    log = _log(args)
    sites, shapes = {}, {}
    for name, fn in models.items():
        try:
            dg.check_comparable(fn, score_factors=args.score_factors, **bound[name])
            shapes[name] = exact.likelihood_structure(
                fn, None, score_factors=args.score_factors, **bound[name]).shape
            sites[name] = _edge_sites(fn, bound[name])
        except dg.EnergyOnlyModelError as e:
            said = str(e)  # "model '<function>' ...": named once, as MODELS.py names it
            fn_said = f"model '{getattr(fn, '__name__', name)}' "
            said = said[len(fn_said):] if said.startswith(fn_said) else said
            raise CLIError(f"model '{name}': {_cli_words(said)}") from e
        except Exception as e:
            raise CLIError(
                f"model '{name}' ({models_path}) fails on {data_path} ({_shapes(bound[name])}): "
                f"{type(e).__name__}: {_cli_words(str(e).splitlines()[0]) if str(e) else ''}"
            ) from e
    if true_edges is not None:
        _check_true_edges(args.true_edges, true_edges, models, sites)
    if len(set(shapes.values())) > 1:  # PSIS-LOO compares the same observations only
        said = ", ".join(f"model '{n}' {tuple(s)}" for n, s in shapes.items())
        raise CLIError(
            f"the models observe different data: pointwise log-likelihood shapes {said}; "
            "compare models of the same observations (the same plates around the observed "
            "site)"
        )
    _make_out(args.out)
    idatas = {}
    bar = tqdm(list(models), desc="fitting models", disable=not args.progress)
    for name in bar:
        bar.set_postfix_str(name)
        fit = infer.nuts(jax.random.PRNGKey(args.seed), models[name], num_warmup=nw,
                         num_samples=ns, num_chains=nc, progress_bar=False, **bound[name])
        idatas[name] = dg.to_inference_data(fit, score_factors=args.score_factors,
                                            posterior_predictive=False, **bound[name])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", dg.ParetoKWarning)
        cmp = dg.compare(idatas)
    kwarn = [str(w.message) for w in rec if issubclass(w.category, dg.ParetoKWarning)]
    for w in kwarn:
        log(f"warning: {w}")
    cmp.to_csv(os.path.join(args.out, "comparison.csv"))
    files = ["comparison.csv"]
    has_edges = all("edge_posterior" in dt.children and dt["edge_posterior"].data_vars
                    for dt in idatas.values())
    edges = None
    if has_edges:
        try:
            edges = dg.compare_edges(idatas, true_edges=true_edges)
        except ValueError as e:  # several edge sites (a true structure was checked before)
            if true_edges is not None:
                raise
            log(_no_edge_table(e))
    if edges is not None:
        edges.to_csv(os.path.join(args.out, "edges.csv"))
        files.append("edges.csv")
        stems = _file_stems(list(idatas))  # a model's name may hold "/"
        for name, dt in idatas.items():
            ep = dt["edge_posterior"]
            site = [v for v in ep.data_vars if not v.endswith(("_prior", "_true"))][0]
            a = ep[site].values
            if a.ndim == 2:
                fig, ax = plt.subplots(figsize=(5, 4))
                t = true_edges if true_edges is not None and true_edges.shape == a.shape[:-1] else None
                dg.plot_attention(a, true_edges=t, ax=ax, title=name)
                png = f"attention_{stems[name]}.png"
                fig.savefig(os.path.join(args.out, png), dpi=110, bbox_inches="tight")
                plt.close(fig)
                files.append(png)
    dg.plot_compare(cmp).savefig(os.path.join(args.out, "compare.png"))
    plt.close("all")
    files.append("compare.png")
    cols = [c for c in ("rank", "elpd", "p", "elpd_diff", "weight", "se", "dse", "warning")
            if c in cmp.columns]
    lines = [
        f"# structinfer compare: {models_path.name} on {data_path.name}",
        "",
        f"NUTS: {nc} chain(s), {nw} warm-up + {ns} draws, seed {args.seed}; edges summed out "
        "exactly; PSIS-LOO over the observed elements.",
        "",
        markdown_table(cmp[cols]),
        "",
    ]
    if edges is not None:
        lines += ["## Edge posteriors", "", markdown_table(edges), ""]
    if kwarn:
        lines += ["## Pareto k warnings", ""] + [f"- {w}" for w in kwarn] + [""]
    lines += ["## Files", ""] + [f"- `{f}`" for f in files] + [""]
    with open(os.path.join(args.out, "report.md"), "w") as fh:
        fh.write("\n".join(lines))
    log("\nPSIS-LOO comparison (ArviZ):\n")
    log(cmp[cols].to_string(float_format=lambda v: f"{v:.2f}"))
    if edges is not None:
        log("\nEdge posteriors:\n")
        log(edges.to_string(float_format=lambda v: f"{v:.3f}"))
    log(f"\nreport: {os.path.join(args.out, 'report.md')}")
    return EXIT_OK


def cmd_reproduce(args) -> int:
    from . import reproductions as R

    avail = R.REPRODUCTIONS
    if args.list or not args.name:
        for name, module in avail.items():
            print(f"{name:12s} {R.describe(module)}  [{module}]")
        if not args.name and not args.list:
            raise CLIError("give the NAME of a reproduction (listed above)", EXIT_USAGE)
        return EXIT_OK
    if args.name in WORKED_EXAMPLES:
        raise CLIError(
            f"'{args.name}' is a worked example, not a paper reproduction: run python "
            f"examples/{WORKED_EXAMPLES[args.name]} in a source checkout of the project",
            EXIT_USAGE,
        )
    if args.name not in avail:
        raise CLIError(
            f"unknown reproduction '{args.name}' (available: {', '.join(avail)})", EXIT_USAGE
        )
    module = avail[args.name]
    # a smoke run writes nothing unless the user gives --out (a full run: the default)
    shown = args.out or os.path.join("structinfer-reproduce", args.name)
    out = None if args.quick and args.out is None else os.path.abspath(shown)
    argv = ["--seed", str(args.seed), *(["--quick"] if args.quick else []),
            *(["--out", out] if out else []), *([] if args.progress else ["--no-progress"]),
            *args.extra]
    what = f"reproduction '{args.name}'"
    made = None  # the outermost folder this command creates (removed again if left empty)
    if out is not None:
        _check_out(out, shown)
        made = out
        while not os.path.exists(os.path.dirname(made)):
            made = os.path.dirname(made)
        made = None if os.path.exists(made) else made
    _setup_jax(args)
    try:
        if out is not None:
            _make_out(out, shown)
        main = importlib.import_module(module).main
        if not args.quiet:
            where = f"output in {out}" if out else "a smoke run: writes nothing without --out"
            print(f"running {module} ({where})", flush=True)
        silent = (contextlib.redirect_stdout(io.StringIO()) if args.quiet
                  else contextlib.nullcontext())
        usage = _usage_errors(f"{what}: ", f" (see structinfer reproduce {args.name} -- --help)")
        with silent, usage:
            rc = main(argv)
    except ModuleNotFoundError as e:
        hint = R.missing_dependency(e)
        if hint is None:
            raise
        raise CLIError(f"{what} ({module}) needs {hint}") from e
    except SystemExit as e:  # the script's sys.exit
        rc = e.code
    finally:
        if made is not None:  # a run that wrote nothing leaves no empty folders
            _remove_empty(out, made)
    if isinstance(rc, str):  # sys.exit("message")
        raise CLIError(f"{what} ({module}): {rc}")
    if rc not in (None, 0):
        raise CLIError(f"{what} ({module}) failed with exit status {rc}")
    return EXIT_OK


@contextlib.contextmanager
def _usage_errors(prefix: str, suffix: str):
    """While a reproduction runs in-process, its own ``argparse`` usage error (printed as a
    usage block and exit status 2 by default) is a one-line usage error of the command."""
    def error(parser, message):
        raise CLIError(f"{prefix}{message}{suffix}", EXIT_USAGE)

    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved


def _remove_empty(path: str, top: str) -> None:
    """Remove ``path`` and its parents up to ``top`` while they are empty folders."""
    while os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)
        if path == top:
            return
        path = os.path.dirname(path)


def cmd_bench(args) -> int:
    script = bench_script()
    shown = args.out or "structinfer-bench"
    out = os.path.abspath(shown)
    _check_out(out, shown)
    _make_out(out, shown)
    src = script.read_text(errors="replace")
    cmd = [sys.executable, str(script)]
    if '"--seed"' in src:
        cmd += ["--seed", str(args.seed)]
    if args.quick:
        cmd.append("--quick")
    if '"--out"' in src:
        cmd += ["--out", out]
    cmd += args.extra
    try:
        rc = subprocess.call(cmd, cwd=out)
    except OSError as e:
        raise CLIError(f"benchmark {script}: could not start: {e}") from e
    if rc != 0:
        raise CLIError(f"benchmark {script} failed with exit status {rc}")
    return EXIT_OK


# --------------------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """``argparse`` with usage errors on one line (exit status 2), pointing at ``--help``."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _seed(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = None
    if v is None or not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {MAX_SEED}], got {s!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``structinfer`` command and its subcommands.

    Returns:
        The parser; usage errors exit with status 2 on one line.
    """
    common = _Parser(add_help=False)
    common.add_argument("--seed", type=_seed, default=0,
                        help=f"random seed in [0, {MAX_SEED}] (default 0)")
    common.add_argument("--out", default=None, help="output folder for the report and plots")
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    common.add_argument("--quiet", action="store_true", help="print nothing but errors")
    common.add_argument("--no-progress", dest="progress", action="store_false",
                        help="hide progress bars")

    p = _Parser(
        prog="structinfer",
        description="Attention as structural inference: compare structural priors, "
        "reproduce the papers' experiments, run benchmarks.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser(
        "demo", parents=[common],
        help="fit one model under four structural priors on a task with known structure",
        description="Generate a sequence whose nodes copy a recent parent, fit the same "
        "model under a uniform, a sliding-window, a relative-position and a geometric x "
        "Beta prior (NUTS, edges summed out), compare them by PSIS-LOO and write a "
        "report folder (default ./structinfer-demo).",
    )
    d.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke run)")
    d.set_defaults(func=cmd_demo, parser=d, default_out="structinfer-demo")

    c = sub.add_parser(
        "compare", parents=[common], help="compare your own models on your data",
        description="Fit every model in MODELS.py on the arrays of DATA.npz with NUTS (edges "
        "summed out) and compare them by PSIS-LOO. MODELS.py defines MODELS = {name: fn} or "
        "functions named model_<name>; each takes the data arrays as keyword arguments "
        "named like the .npz keys and observes its data with numpyro.sample(..., obs=...).",
    )
    c.add_argument("models", metavar="MODELS.py", help="Python file defining the models")
    c.add_argument("data", metavar="DATA.npz", help="arrays passed to the models by name")
    c.add_argument("--true-edges", metavar="KEY", help="array in DATA.npz with the true parent "
                   "of each child (not passed to the models)")
    c.add_argument("--quick", action="store_true", help="short chains (smoke run)")
    c.add_argument("--num-warmup", type=_positive, default=None,
                   help="NUTS warm-up (step-size and mass-matrix adaptation) steps per "
                   "chain, at least 1: without adaptation NUTS keeps its initial step size "
                   "(default 500, 60 with --quick)")
    c.add_argument("--num-samples", type=_positive, default=None,
                   help="posterior draws per chain (default 500, 60 with --quick)")
    c.add_argument("--num-chains", type=_positive, default=None,
                   help="Markov chains (default 2, 1 with --quick)")
    c.add_argument("--score-factors", choices=("error", "normalize"), default="error",
                   help="factor potentials in the likelihood: refuse (default) or normalise "
                   "them as a conditional prior over the edges")
    c.set_defaults(func=cmd_compare, parser=c, default_out="structinfer-compare")

    r = sub.add_parser(
        "reproduce", parents=[common], help="run a paper reproduction (shipped with the package)",
        description="Run one of the papers' experiments shipped with the package, "
        "structinfer.reproductions (list them with --list; they need the 'examples' extra, "
        "lm also the 'nn' extra). A full run writes into --out (default "
        "./structinfer-reproduce/NAME). The reproduction's own options go after --, as in "
        "structinfer reproduce lm --out results/lm -- --resume.",
    )
    r.add_argument("name", nargs="?", metavar="NAME")
    r.add_argument("--list", action="store_true", help="list the available reproductions")
    r.add_argument("--quick", action="store_true",
                   help="the reproduction's smoke run: checks its numbers and writes nothing "
                   "unless --out is given")
    r.set_defaults(func=cmd_reproduce, parser=r, default_out=None)

    b = sub.add_parser(
        "bench", parents=[common], help="run benchmarks/attention.py of a source checkout",
        description="Run the attention benchmark script (printing ratio tables) of the "
        "source checkout holding the installed package (pip install -e .); the benchmarks "
        "are not part of the wheel. Arguments after -- go to the script.",
    )
    b.add_argument("--quick", action="store_true", help="small sizes")
    b.set_defaults(func=cmd_bench, parser=b, default_out=None)
    return p


def _after_dashes(args, unknown: list[str]) -> str:
    """For ``reproduce`` and ``bench``: where the script's own arguments go."""
    if args.command == "reproduce":
        return ("; a reproduction's own arguments go after --: structinfer reproduce "
                f"{args.name or 'NAME'} -- {' '.join(unknown)}")
    if args.command == "bench":
        return ("; the benchmark script's own arguments go after --: structinfer bench -- "
                f"{' '.join(unknown)}")
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 ok, 1 runtime error, 2 usage error.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:  # arguments for the script run by `reproduce` / `bench`
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    try:
        args, unknown = parser.parse_known_args(argv)
        command = getattr(args, "command", None)
        if unknown and not command:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if unknown:  # named by the subcommand that does not take them
            args.parser.error(f"unrecognized arguments: {' '.join(unknown)}"
                              + _after_dashes(args, unknown))
        if extra and command not in (None, "reproduce", "bench"):
            args.parser.error(f"unexpected arguments after --: {' '.join(extra)}")
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if not command:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.out is None and args.default_out:
        args.out = args.default_out
    if args.quiet:  # nothing but errors: no progress bars either
        args.progress = False
    args.extra = extra
    try:
        return args.func(args)
    except CLIError as e:
        if args.debug:
            raise
        print(f"structinfer {args.command}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"structinfer {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"structinfer {args.command}: error: {type(e).__name__}: {msg} "
              "(rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
