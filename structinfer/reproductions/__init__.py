"""The papers' experiments, shipped with the package: ``structinfer reproduce NAME``.

Each reproduction is one module of this package with a ``main(argv=None) -> int`` that
parses ``--seed``, ``--quick`` (a smoke run that checks its numbers and writes nothing,
at most what it writes when ``--out`` is given), ``--out DIR`` (where a full run writes
``results.json`` and its figures) and ``--no-progress`` (hide progress bars), and exits
0 on success. ``structinfer reproduce NAME`` calls it in-process (so a file in the
current directory is never run), passing ``--out`` for a ``--quick`` run only when the
user gave one, and ``--no-progress`` for ``--quiet`` or ``--no-progress``;
``python -m structinfer.reproductions.NAME`` runs it too. Adding a reproduction is one
module here and one line in `REPRODUCTIONS`.

The reproductions train with optax and compare with scikit-learn: install the
``examples`` extra (``pip install "structinfer[examples]"``); ``lm`` also needs the
``nn`` extra (flax). The results and how they compare with the papers are in
``docs/reproductions.md``.
"""

from __future__ import annotations

import ast
import importlib.util

__all__ = ["REPRODUCTIONS", "OPTIONAL_DEPENDENCIES", "EXTRA", "describe", "missing_dependency"]

#: ``structinfer reproduce`` name -> module (run through its ``main(argv)``)
REPRODUCTIONS: dict[str, str] = {
    "multihop": "structinfer.reproductions.multihop",
    "expanding": "structinfer.reproductions.expanding",
    "hopfield": "structinfer.reproductions.hopfield",
    "idw": "structinfer.reproductions.idw",
    "mixtures": "structinfer.reproductions.mixtures",
    "switching": "structinfer.reproductions.switching",
    "lm": "structinfer.reproductions.lm",
}

#: the extra that installs the reproductions' optional dependencies
EXTRA = "examples"

#: the reproductions' optional dependencies: import name -> (distribution, extra)
OPTIONAL_DEPENDENCIES: dict[str, tuple[str, str]] = {
    "optax": ("optax", EXTRA),
    "sklearn": ("scikit-learn", EXTRA),
    "flax": ("flax", "nn"),
}


def describe(module: str) -> str:
    """The first sentence or paragraph of a module's docstring on one line, read from its
    source without importing it (``reproduce --list`` stays fast); ``""`` if it has none
    or cannot be found."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "get_source"):
        return ""
    try:
        doc = ast.get_docstring(ast.parse(spec.loader.get_source(module) or ""))
    except (OSError, SyntaxError, ValueError, ImportError):
        return ""
    return " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""


def missing_dependency(error: ModuleNotFoundError) -> str | None:
    """What to install when ``error`` is a missing optional dependency of the
    reproductions (``None`` for any other missing module)."""
    top = (error.name or "").split(".")[0]
    if top not in OPTIONAL_DEPENDENCIES:
        return None
    dist, extra = OPTIONAL_DEPENDENCIES[top]
    return (f"{dist}, an optional dependency that is not installed: "
            f'pip install "structinfer[{extra}]"')
