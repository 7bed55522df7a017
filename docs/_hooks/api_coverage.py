"""MkDocs hook: fail the build when a public name is not in the API reference.

A public name is one listed in ``__all__`` of ``structinfer`` or of a public
submodule. It is covered when an API page has a ``::: structinfer.<name>``
directive for it, or for the submodule that defines it (mkdocstrings then renders
every public member). Every covered object must also have a docstring.
"""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

from mkdocs.exceptions import PluginError


def _directives(docs_dir: Path) -> set[str]:
    found = set()
    for md in docs_dir.rglob("*.md"):
        for m in re.finditer(r"^:::\s+([\w.]+)", md.read_text(), flags=re.M):
            found.add(m.group(1))
    return found


def on_pre_build(config, **kwargs):
    docs_dir = Path(config["docs_dir"])
    documented = _directives(docs_dir)
    pkg = importlib.import_module("structinfer")
    missing, undocstringed = [], []
    for name in pkg.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(pkg, name)
        full = f"structinfer.{name}"
        if isinstance(obj, types.ModuleType):
            if full not in documented:
                missing.append(full)
                continue
            for sub in getattr(obj, "__all__", []):
                member = getattr(obj, sub)
                if isinstance(member, (str, int, float)):
                    continue
                if not getattr(member, "__doc__", None):
                    undocstringed.append(f"{full}.{sub}")
        else:
            if full not in documented and f"structinfer.{obj.__module__.split('.')[-1]}" not in documented:
                missing.append(full)
            if not getattr(obj, "__doc__", None):
                undocstringed.append(full)
    problems = []
    if missing:
        problems.append("not in the API reference: " + ", ".join(sorted(missing)))
    if undocstringed:
        problems.append("no docstring: " + ", ".join(sorted(undocstringed)))
    if problems:
        raise PluginError("undocumented public names — " + "; ".join(problems))
