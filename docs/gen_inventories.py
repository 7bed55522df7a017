"""Build the Sphinx inventories (``objects.inv``) that let the API pages link out.

mkdocstrings links a name such as ``jax.Array`` or ``numpyro.infer.MCMC`` to another
project's documentation through that project's ``objects.inv``. The site is built where
only package registries can be reached (this machine, CI), so the inventories are
checked in under ``docs/_inventories/`` and ``docs/_hooks/inventories.py`` hands them to
mkdocstrings as local files; ``mkdocs.yml`` gives each its documentation's base URL.

Each inventory is made the way Sphinx makes it, from the project's documentation
sources: every ``autosummary`` entry (a page ``<toctree>/<name>.html``), every
``autoclass`` / ``autofunction`` / ``function`` / ``class`` / ... directive (an anchor on
its page) and every ``automodule``, resolved against ``currentmodule``; classes
documented with ``:members:`` get their public members. Then every public name a user
imports (``numpyro.infer.MCMC``, ``numpy.linalg.norm``) is added as an alias of the
documented object it is. Python's own inventory is made from the interpreter with the
layout of the Python docs (``library/<module>.html#<module>.<name>``, builtins on
``functions.html`` / ``stdtypes.html`` / ``exceptions.html``).

Regenerate after a major version change of one of these projects, with checkouts of
their documentation sources:

    python docs/gen_inventories.py --numpy ~/src/numpy --jax ~/src/jax \\
        --numpyro ~/src/numpyro --arviz-base ~/src/arviz-base \\
        --arviz-stats ~/src/arviz-stats --arviz-plots ~/src/arviz-plots

(any subset; ``--python`` alone needs no checkout). The packages must be installed.
"""

from __future__ import annotations

import argparse
import builtins
import importlib
import inspect
import posixpath
import re
import sys
from pathlib import Path

from mkdocstrings import Inventory, InventoryItem

OUT = Path(__file__).resolve().parent / "_inventories"

# project -> (documentation source folder inside its repository, modules users import)
PROJECTS = {
    "numpy": ("doc/source", ["numpy", "numpy.linalg", "numpy.random", "numpy.typing", "numpy.fft"]),
    "jax": (
        "docs",
        [
            "jax",
            "jax.numpy",
            "jax.lax",
            "jax.random",
            "jax.nn",
            "jax.scipy.special",
            "jax.typing",
            "jax.tree_util",
            "jax.tree",
            "jax.sharding",
        ],
    ),
    "numpyro": (
        "docs/source",
        [
            "numpyro",
            "numpyro.infer",
            "numpyro.distributions",
            "numpyro.handlers",
            "numpyro.contrib.funsor",
            "numpyro.optim",
            "numpyro.diagnostics",
        ],
    ),
    "arviz_base": ("docs/source", ["arviz_base"]),
    "arviz_stats": ("docs/source", ["arviz_stats"]),
    "arviz_plots": ("docs/source", ["arviz_plots"]),
}

_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(?:py:)?([a-z]+)::\s*(.*)$")
_ROLES = {
    "autoclass": "class",
    "class": "class",
    "autoexception": "exception",
    "exception": "exception",
    "autofunction": "function",
    "function": "function",
    "decorator": "function",
    "automethod": "method",
    "method": "method",
    "autoattribute": "attribute",
    "attribute": "attribute",
    "autoproperty": "property",
    "property": "property",
    "autodata": "data",
    "data": "data",
}


def _qualify(name: str, module: str | None, root: str) -> str:
    if module and not (name == root or name.startswith(root + ".")):
        return f"{module}.{name}"
    return name


def _members(full: str) -> list[tuple[str, str]]:
    """Public methods and properties of the class ``full`` (if importable)."""
    mod, _, attr = full.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), attr)
    except Exception:
        return []
    out = []
    for name, obj in vars(cls).items():
        if name.startswith("_"):
            continue
        role = "property" if isinstance(obj, property) else "method" if callable(obj) else None
        if role:
            out.append((f"{full}.{name}", role))
    return out


def _module_members(module: str) -> list[tuple[str, str]]:
    try:
        mod = importlib.import_module(module)
    except Exception:
        return []
    names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
    out = []
    for name in names:
        obj = getattr(mod, name, None)
        if inspect.isclass(obj):
            out.append((f"{module}.{name}", "class"))
        elif callable(obj):
            out.append((f"{module}.{name}", "function"))
    return out


def parse_sources(src: Path, root: str) -> dict[str, tuple[str, str]]:
    """``{name: (role, uri)}`` from the ``.rst`` / ``.md`` files under ``src``."""
    found: dict[str, tuple[str, str]] = {}

    def add(name: str, role: str, uri: str) -> None:
        found.setdefault(name, (role, uri))

    for path in sorted([*src.rglob("*.rst"), *src.rglob("*.md")]):
        page = path.relative_to(src).with_suffix(".html").as_posix()
        folder = posixpath.dirname(page)
        lines = path.read_text(errors="replace").splitlines()
        module: str | None = None
        cls_stack: list[tuple[int, str]] = []  # (indent, class name) for nested directives
        i = 0
        while i < len(lines):
            m = _DIRECTIVE.match(lines[i])
            i += 1
            if not m:
                continue
            indent, kind, arg = len(m.group(1)), m.group(2), m.group(3).strip()
            cls_stack = [(d, c) for d, c in cls_stack if d < indent]
            if kind in ("currentmodule", "module"):
                module = arg or None
                if kind == "module" and arg:
                    add(arg, "module", f"{page}#module-{arg}")
                continue
            if kind == "automodule":
                module = arg
                add(arg, "module", f"{page}#module-{arg}")
                opts = _options(lines, i)
                if "members" in opts:
                    for full, role in _module_members(arg):
                        add(full, role, f"{page}#{full}")
                continue
            if kind == "autosummary":
                opts = _options(lines, i)
                toctree = opts.get("toctree")
                j = i
                while j < len(lines) and (not lines[j].strip() or lines[j].startswith((" ", "\t"))):
                    entry = lines[j].strip()
                    j += 1
                    if not entry or entry.startswith(":") or entry.startswith(".."):
                        continue
                    if toctree is None:
                        continue
                    name = entry.lstrip("~").split()[0]
                    full = _qualify(name, module, root)
                    target = posixpath.normpath(posixpath.join(folder, toctree.strip("/")))
                    add(full, _role_of(full), f"{target}/{full}.html#{full}")
                i = j
                continue
            role = _ROLES.get(kind)
            if role is None or not arg:
                continue
            name = arg.split("(")[0].split()[0]
            if cls_stack and role in ("method", "attribute", "property") and "." not in name:
                full = f"{cls_stack[-1][1]}.{name}"
            else:
                full = _qualify(name, module, root)
            add(full, role, f"{page}#{full}")
            if role in ("class", "exception"):
                cls_stack.append((indent, full))
                if "members" in _options(lines, i):
                    for member, mrole in _members(full):
                        add(member, mrole, f"{page}#{member}")
    return found


def _role_of(full: str) -> str:
    mod, _, attr = full.rpartition(".")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except Exception:
        return "function"
    return "class" if inspect.isclass(obj) else "function" if callable(obj) else "data"


def _options(lines: list[str], i: int) -> dict[str, str]:
    opts = {}
    while i < len(lines) and lines[i].strip().startswith(":"):
        key, _, value = lines[i].strip()[1:].partition(":")
        opts[key.strip()] = value.strip()
        i += 1
    return opts


def _canonical(obj: object) -> str | None:
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(mod, str) and isinstance(qual, str) and "<" not in qual:
        return f"{mod}.{qual}"
    return None


def add_aliases(found: dict[str, tuple[str, str]], modules: list[str]) -> None:
    """Add the names users import (and the objects' own paths) for documented objects."""
    by_object: dict[int, tuple[str, str]] = {}
    for name, entry in list(found.items()):
        mod, _, attr = name.rpartition(".")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except Exception:
            continue
        by_object.setdefault(id(obj), entry)
        canon = _canonical(obj)
        if canon:
            found.setdefault(canon, entry)
    for module in modules:
        try:
            mod = importlib.import_module(module)
        except Exception:
            continue
        for attr in dir(mod):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            entry = by_object.get(id(obj))
            if entry is not None:
                found.setdefault(f"{module}.{attr}", entry)


def python_inventory() -> dict[str, tuple[str, str]]:
    """Builtins and common standard-library modules, with the Python docs' layout."""
    found: dict[str, tuple[str, str]] = {}
    stdtypes = {
        "str", "list", "tuple", "dict", "set", "frozenset", "range", "bytes",
        "bytearray", "memoryview",
    }  # fmt: skip
    for name, obj in vars(builtins).items():
        if name.startswith("_"):
            continue
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            found[name] = ("exception", f"library/exceptions.html#{name}")
        elif name in stdtypes:
            found[name] = ("class", f"library/stdtypes.html#{name}")
        elif inspect.isclass(obj) or callable(obj):
            found[name] = ("function", f"library/functions.html#{name}")
    for name in ("None", "True", "False", "Ellipsis", "NotImplemented"):
        found[name] = ("data", f"library/constants.html#{name}")
    modules = [
        "typing", "collections", "collections.abc", "dataclasses", "functools", "itertools",
        "pathlib", "os", "math", "enum", "abc", "contextlib", "warnings", "argparse", "types",
        "numbers", "re", "operator", "logging", "json", "time", "subprocess", "inspect",
    ]  # fmt: skip
    for module in modules:
        mod = importlib.import_module(module)
        found[module] = ("module", f"library/{module}.html#module-{module}")
        names = getattr(mod, "__all__", None) or dir(mod)
        for name in names:
            obj = getattr(mod, name, None)
            if name.startswith("_") or inspect.ismodule(obj) or obj is None:
                continue
            owner = getattr(obj, "__module__", module)
            if owner not in (module, None) and not str(owner).startswith(("_", module)):
                continue  # re-exported from another module: documented there
            role = "class" if inspect.isclass(obj) else "function" if callable(obj) else "data"
            found[f"{module}.{name}"] = (role, f"library/{module}.html#{module}.{name}")
    return found


def write(project: str, version: str, found: dict[str, tuple[str, str]]) -> Path:
    inv = Inventory(project=project, version=version)
    for name in sorted(found):
        role, uri = found[name]
        inv[name] = InventoryItem(name=name, domain="py", role=role, uri=uri, priority=1)
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{project}.inv"
    path.write_bytes(inv.format_sphinx())
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="store_true", help="write python.inv")
    for project in PROJECTS:
        parser.add_argument(
            f"--{project.replace('_', '-')}", type=Path, metavar="CHECKOUT", dest=project
        )
    args = parser.parse_args(argv)
    if args.python:
        version = ".".join(map(str, sys.version_info[:2]))
        print(write("python", version, python_inventory()), len(python_inventory()))
    for project, (docs, modules) in PROJECTS.items():
        checkout = getattr(args, project)
        if checkout is None:
            continue
        found = parse_sources(checkout / docs, project)
        add_aliases(found, modules)
        version = getattr(importlib.import_module(project), "__version__", "")
        print(write(project, version, found), len(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
