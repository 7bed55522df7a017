"""The package's import structure, read from its source (AST), not from a running import.

* No module uses another module's private name: ``from .x import _y``,
  ``from x import _y``, ``import a._b``, ``from pkg._private import y`` for a package
  other than structinfer, a private module of a structinfer package the importer is not
  inside (``from ..lowering._spec import accum_dtype`` in ``nn``; a package's own private
  modules may export public names to the modules inside it, e.g.
  ``from .._checks import is_concrete`` anywhere in structinfer, ``from ._spec import
  Terms`` in ``lowering``), and attribute access ``obj._name`` of a private name the
  module does not define itself (NamedTuple's ``_replace`` & co. are public API). A
  name the module defines does not excuse ``super()._name`` or ``module._name`` on an
  imported module or class: those are the other class's / module's names.
* Arrows point down: the engine's floors (``_checks``, ``priors``, ``scores``,
  ``primitives``, ``handlers``, ``exact``) import nothing from the floors above them.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

#: the package's source folder (found without importing it)
PKG = Path(importlib.util.find_spec("structinfer").origin).resolve().parent

#: public API of NamedTuple / namedtuple, spelled with a leading underscore
NAMEDTUPLE_API = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}

#: ``super()._hook`` calls of a third-party base class's private method, per file: the one
#: place a subclass must override a framework hook that has no public counterpart.
#: ``infer.NUTS`` overrides NumPyro HMC's ``_init_state`` (where the initial point is
#: searched) to run a single chain's search compiled; NumPyro has no public hook for it
#: (``MCMC.run(init_params=...)`` still runs the eager search). Each entry must be used.
FRAMEWORK_HOOKS = {"structinfer/infer/fit.py": {"_init_state"}}

#: the engine's floors and what they must never import
LOWER = ("_checks", "_jaxpr", "priors", "scores", "primitives", "handlers", "exact")
UPPER = ("infer", "diagnostics", "lowering", "mechanisms", "testing", "nn", "cli", "demo")


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(mod: str, node: ast.ImportFrom, is_package: bool) -> str:
    """Absolute module of ``from <level dots><module> import ...`` in module ``mod``."""
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    keep = len(base) - node.level + (1 if is_package else 0)
    parts = base[:keep] + ([node.module] if node.module else [])
    return ".".join(parts)


def own_submodule(source: str, name: str, package: str) -> bool:
    """``from <source> import <name>`` names a private submodule of the importer's own
    package (``from . import _spec`` in ``lowering/__init__.py``): the package's own
    implementation, not another module's private name."""
    if not (source == package or package.startswith(source + ".")):
        return False
    if source.split(".")[0] != "structinfer":
        return False
    folder = PKG.parent.joinpath(*source.split("."))
    return (folder / f"{name}.py").exists() or (folder / name / "__init__.py").exists()


def sources():
    for path in sorted(PKG.rglob("*.py")):
        yield path, module_name(path), ast.parse(path.read_text(), filename=str(path))


def defined_names(tree: ast.AST) -> set[str]:
    """Private names a module defines itself: functions, classes, assignments (also to
    attributes, ``self._x = ...``) and keyword/argument names."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return out


def imported_names(tree: ast.AST) -> set[str]:
    """Names an import binds in the module (``import numpyro`` -> ``numpyro``,
    ``from numpyro.infer import NUTS as N`` -> ``N``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out.add(alias.asname or alias.name.split(".")[0])
    return out


def private_module_outside(source: str, importer: str) -> str | None:
    """The private module of ``source`` (``structinfer.lowering._spec``) when the importer
    is not inside the package that holds it, else None."""
    parts = source.split(".")
    if parts[0] != "structinfer":
        return None
    for i, part in enumerate(parts):
        if private(part):
            package = ".".join(parts[:i])
            if not (importer == package or importer.startswith(package + ".")):
                return ".".join(parts[: i + 1])
            return None
    return None


def private_uses(path: Path, mod: str, tree: ast.AST) -> list[str]:
    where = lambda node: f"{path.relative_to(PKG.parent)}:{node.lineno}"  # noqa: E731
    own = defined_names(tree)
    imported = imported_names(tree)
    is_package = path.name == "__init__.py"
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.module == "__future__":
                continue
            source = resolve(mod, node, is_package)
            package = mod if is_package else mod.rpartition(".")[0]
            for alias in node.names:
                if private(alias.name) and not own_submodule(source, alias.name, package):
                    bad.append(f"{where(node)}: from {source} import {alias.name}")
            third_party = not (node.level or source.split(".")[0] == "structinfer")
            if third_party and any(private(p) for p in source.split(".")):
                bad.append(f"{where(node)}: from {source} import ... (a private module)")
            elif not third_party and private_module_outside(source, mod):
                bad.append(f"{where(node)}: from {source} import ... (a private module of "
                           "another package)")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(private(p) for p in alias.name.split(".")):
                    bad.append(f"{where(node)}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            is_super = (isinstance(base, ast.Call) and isinstance(base.func, ast.Name)
                        and base.func.id == "super")
            rel = str(path.relative_to(PKG.parent))
            if is_super and node.attr in FRAMEWORK_HOOKS.get(rel, ()):
                continue
            foreign = is_super or (isinstance(base, ast.Name) and base.id in imported)
            if node.attr in NAMEDTUPLE_API or (node.attr in own and not foreign):
                continue
            bad.append(f"{where(node)}: {ast.unparse(node)}")
    return bad


def imported_modules(path: Path, mod: str, tree: ast.AST) -> list[tuple[int, str]]:
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = resolve(mod, node, is_package)
            out.append((node.lineno, source))
            out += [(node.lineno, f"{source}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def floor(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "structinfer" else None


def test_no_module_uses_another_modules_private_names():
    bad = [b for path, mod, tree in sources() for b in private_uses(path, mod, tree)]
    assert not bad, "private names used across modules:\n  " + "\n  ".join(bad)


def test_every_framework_hook_is_still_used():
    """An entry of ``FRAMEWORK_HOOKS`` that no ``super()._hook`` call needs any more is
    removed (the list cannot grow stale)."""
    for rel, hooks in FRAMEWORK_HOOKS.items():
        tree = ast.parse((PKG.parent / rel).read_text())
        used = {n.attr for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Call)
                and isinstance(n.value.func, ast.Name) and n.value.func.id == "super"}
        assert hooks <= used, (rel, hooks - used)


def test_engine_floors_import_nothing_from_above():
    bad = []
    for path, mod, tree in sources():
        if floor(mod) not in LOWER:
            continue
        for line, target in imported_modules(path, mod, tree):
            if floor(target) in UPPER:
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: {mod} imports {target}")
    assert not bad, "an engine floor imports from above it:\n  " + "\n  ".join(bad)


def test_the_checks_can_fail():
    """Each rule catches its pattern (a test that cannot fail is a bug)."""
    src = (
        "from .x import _y\n"
        "from numpyro.primitives import _PYRO_STACK\n"
        "import a._b\n"
        "from jax._src import core\n"
        "from .._checks import is_concrete\n"
        "from . import exact\n"
        "exact._log_z\n"
        "score._prec_kind\n"
        "t._replace\n"
        "self._ok\n"
        "_mine = 1\n"
        "x._mine\n"
        "from numpyro.infer import HMC\n"
        "def _init_state(self): return super()._init_state()\n"
        "HMC._mine\n"
    )
    tree = ast.parse(src)
    bad = private_uses(PKG / "demo.py", "structinfer.demo", tree)
    found = sorted(b.split(": ", 1)[1] for b in bad)
    assert found == sorted([
        "from structinfer.x import _y",
        "from numpyro.primitives import _PYRO_STACK",
        "import a._b",
        "from jax._src import ... (a private module)",
        "exact._log_z",
        "score._prec_kind",
        "super()._init_state",
        "HMC._mine",
    ]), found
    # a package may import its own private submodule; a name that is not one is flagged
    tree = ast.parse("from . import _spec\nfrom . import _nope\nfrom ..lowering import _spec\n")
    bad = private_uses(PKG / "lowering" / "__init__.py", "structinfer.lowering", tree)
    assert [b.split(": ", 1)[1] for b in bad] == ["from structinfer.lowering import _nope"], bad
    bad = private_uses(PKG / "infer" / "fit.py", "structinfer.infer.fit",
                       ast.parse("from ..lowering import _spec\n"))
    assert [b.split(": ", 1)[1] for b in bad] == ["from structinfer.lowering import _spec"], bad
    # a private module of another package; inside the package that holds it, a private
    # module exports its public names
    bad = private_uses(PKG / "nn" / "layer.py", "structinfer.nn.layer",
                       ast.parse("from ..lowering._spec import accum_dtype\n"))
    assert [b.split(": ", 1)[1] for b in bad] == [
        "from structinfer.lowering._spec import ... (a private module of another package)"], bad
    for importer, src in [("structinfer.lowering.dense", "from ._spec import Terms\n"),
                          ("structinfer.lowering.sharded", "from ..lowering._spec import T\n"),
                          ("structinfer.nn.layer", "from .._jaxpr import classify\n")]:
        path = PKG.joinpath(*importer.split(".")[1:]).with_suffix(".py")
        assert private_uses(path, importer, ast.parse(src)) == [], (importer, src)
    tree = ast.parse("from ..infer import cccp\nimport structinfer.diagnostics\n")
    targets = [t for _, t in imported_modules(PKG / "exact" / "api.py", "structinfer.exact.api",
                                               tree)]
    assert "structinfer.infer" in targets and "structinfer.diagnostics" in targets
    assert floor("structinfer.infer.cccp") == "infer"
