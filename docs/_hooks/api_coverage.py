"""MkDocs hook: fail the build when a public name is missing from the API reference.

The public names are read at build time from the ``__all__`` of each module in
``PUBLIC_MODULES`` (and of the public submodules those lists name, like
``structinfer.testing.registry``), so the check follows renames without edits here;
``tests/test_api.py`` walks the same list.

After the build, every public function and class must have its own heading in some page
of the site: an anchor (``id="structinfer.priors.Uniform"``) that names the same object,
under this name or another (``structinfer.edge`` covers ``structinfer.primitives.edge``).
A public constant is covered when its module is rendered (a ``::: module`` directive) or
it has its own anchor. Every covered function and class must also have a docstring.

A name that a submodule of the same name hides from the renderer (the package
``structinfer.mechanisms`` exports the model ``hopfield`` and has a module ``hopfield``)
needs its own directive with the defining module's path, e.g.
``::: structinfer.mechanisms.hopfield.hopfield``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path

#: every public module whose ``__all__`` is part of the API (``nn`` once it exists)
PUBLIC_MODULES = (
    "structinfer",
    "structinfer.priors",
    "structinfer.scores",
    "structinfer.primitives",
    "structinfer.handlers",
    "structinfer.exact",
    "structinfer.lowering",
    "structinfer.infer",
    "structinfer.mechanisms",
    "structinfer.diagnostics",
    "structinfer.testing",
    "structinfer.nn",
    "structinfer.cli",
)

#: modules that may be absent (not merged yet); any other import error fails the build
OPTIONAL = ("structinfer.nn",)

_ANCHOR = re.compile(r'\bid="(structinfer(?:\.\w+)*)"')


def public_names() -> dict[str, tuple[str, object]]:
    """``{qualified public name: (module, object)}`` over the ``__all__`` lists."""
    found: dict[str, tuple[str, object]] = {}
    todo, seen = list(PUBLIC_MODULES), set()
    while todo:
        mod_name = todo.pop(0)
        if mod_name in seen:
            continue
        seen.add(mod_name)
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if mod_name in OPTIONAL and e.name == mod_name:
                continue
            raise
        for name in getattr(mod, "__all__", ()):
            if name.startswith("__"):
                continue
            obj = getattr(mod, name)
            if isinstance(obj, types.ModuleType):
                if obj.__name__.startswith("structinfer.") and hasattr(obj, "__all__"):
                    todo.append(obj.__name__)
                continue
            found[f"{mod_name}.{name}"] = (mod_name, obj)
    return found


def resolve(path: str) -> object | None:
    """The object a dotted path names (a module, then attributes), or ``None``."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            try:  # a class's own function, not a bound method; modules load lazily
                if isinstance(obj, types.ModuleType):
                    obj = getattr(obj, attr)
                else:
                    obj = inspect.getattr_static(obj, attr)
            except AttributeError:
                return None
            if isinstance(obj, (staticmethod, classmethod)):
                obj = obj.__func__
        return obj
    return None


def anchors(site_dir: Path) -> set[str]:
    """The ``structinfer.*`` heading ids of every page of a built site."""
    out: set[str] = set()
    for page in site_dir.rglob("*.html"):
        out.update(_ANCHOR.findall(page.read_text(errors="replace")))
    return out


def missing_names(site_dir: Path) -> tuple[list[str], list[str]]:
    """(public names without a heading, documented names without a docstring)."""
    ids = anchors(site_dir)
    rendered = {id(obj) for obj in map(resolve, ids) if obj is not None}
    missing, undocumented = [], []
    for full, (module, obj) in public_names().items():
        if inspect.isclass(obj) or inspect.isroutine(obj):
            if id(obj) not in rendered:
                missing.append(full)
            elif not (obj.__doc__ or "").strip():
                undocumented.append(full)
        elif full not in ids and module not in ids:
            missing.append(full)
    return sorted(missing), sorted(undocumented)


def on_post_build(config, **kwargs):
    from mkdocs.exceptions import PluginError

    missing, undocumented = missing_names(Path(config["site_dir"]))
    problems = []
    if missing:
        problems.append(
            "not in the API reference (add a ::: directive to a page of docs/api/): "
            + ", ".join(missing)
        )
    if undocumented:
        problems.append("no docstring: " + ", ".join(undocumented))
    if problems:
        raise PluginError("undocumented public names — " + "; ".join(problems))
