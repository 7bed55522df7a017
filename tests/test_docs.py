"""The documentation site builds with ``mkdocs build --strict``, warning by warning.

The build runs without ``-q`` (which would hide the warnings ``--strict`` counts) and every
warning it prints is compared with ``docs/known_warnings.txt``, the list of warnings that are
known and not yet fixed (mostly griffe's complaints about docstrings; phase 3 of the
renovation removes them). The list may only shrink: a warning that is not on it fails the
test, and so does a listed warning that no longer occurs, so the file always says exactly
what is left. With an empty list the build itself must succeed.

A griffe warning names a file and a line; the list names the object instead
(``structinfer.scores.Dot: No type or annotation for parameter 'q'``), so that an edit
elsewhere in the file does not move it. After fixing warnings, rewrite the list with

    PYTHONPATH=$PWD python tests/test_docs.py --update

which refuses to add entries unless given ``--allow-new`` (for a moved module, say).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KNOWN = ROOT / "docs" / "known_warnings.txt"

_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+-\s+(.*)$")
_GRIFFE = re.compile(r"^griffe: (?P<path>[^:]+\.py):(?P<line>\d+): (?P<msg>.*)$")
_ABORTED = re.compile(r"Aborted with (\d+) warnings? in strict mode")


def build(docs_root: Path, site_dir: Path) -> subprocess.CompletedProcess:
    """Run ``mkdocs build --strict`` in ``docs_root`` (no ``-q``) and return the process."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site_dir)],
        cwd=docs_root,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def records(output: str) -> list[tuple[str, str]]:
    """Split mkdocs' log into ``(level, message)`` records (continuation lines joined)."""
    out: list[tuple[str, str]] = []
    for line in output.splitlines():
        m = _RECORD.match(line)
        if m:
            out.append((m.group(1), m.group(2).strip()))
        elif out and line.strip() and not _ABORTED.search(line):
            level, msg = out[-1]
            out[-1] = (level, msg + " " + line.strip())
    return out


@cache
def _objects(path: str) -> list[tuple[int, int, str]]:
    """``(first line, last line, qualified name)`` of every class and function in a file."""
    file = ROOT / path
    module = ".".join(Path(path).with_suffix("").parts)
    module = module.removesuffix(".__init__")
    found: list[tuple[int, int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found.append((first, child.end_lineno or child.lineno, name))
                walk(child, name)

    walk(ast.parse(file.read_text()), module)
    return found


def normalise(message: str) -> str:
    """A warning without its line number: a griffe warning names its innermost object."""
    m = _GRIFFE.match(message)
    if not m:
        return message
    path, line = m.group("path"), int(m.group("line"))
    module = ".".join(Path(path).with_suffix("").parts).removesuffix(".__init__")
    inside = [(first, name) for first, last, name in _objects(path) if first <= line <= last]
    name = max(inside)[1] if inside else module
    return f"griffe: {name}: {m.group('msg')}"


def warnings_of(proc: subprocess.CompletedProcess) -> list[str]:
    """The normalised WARNING/ERROR messages of a build; checks mkdocs' own count."""
    recs = records(proc.stdout + "\n" + proc.stderr)
    errors = [f"ERROR: {msg}" for level, msg in recs if level in ("ERROR", "CRITICAL")]
    warns = [msg for level, msg in recs if level == "WARNING"]
    aborted = _ABORTED.search(proc.stdout + proc.stderr)
    if aborted:
        assert int(aborted.group(1)) == len(warns), (
            f"mkdocs counted {aborted.group(1)} warnings, the log shows {len(warns)}:\n"
            + "\n".join(warns)
        )
    return sorted(errors + [normalise(w) for w in warns])


def known() -> list[str]:
    lines = KNOWN.read_text().splitlines() if KNOWN.exists() else []
    return sorted(s for s in (ln.strip() for ln in lines) if s and not s.startswith("#"))


def compare(found: list[str], expected: list[str]) -> tuple[list[str], list[str]]:
    """(new warnings, listed warnings that no longer occur), with multiplicity."""
    f, e = Counter(found), Counter(expected)
    return sorted((f - e).elements()), sorted((e - f).elements())


@pytest.mark.exhaustive  # (~15 s: a whole mkdocs build; CI's exhaustive leg builds the site)
def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    proc = build(ROOT, tmp_path / "site")
    found = warnings_of(proc)
    new, gone = compare(found, known())
    msg = []
    if new:
        msg.append("new warnings (fix them; do not add them to docs/known_warnings.txt):")
        msg += [f"  {w}" for w in new]
    if gone:
        msg.append(
            "listed in docs/known_warnings.txt but no longer raised (remove them: "
            "`python tests/test_docs.py --update`):"
        )
        msg += [f"  {w}" for w in gone]
    assert not msg, "\n".join(msg) + "\n\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    if not found:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    else:
        assert proc.returncode != 0  # strict mode aborts on the listed warnings
    check_site(tmp_path / "site")


def check_site(site: Path) -> None:
    """The built site loads nothing from another host, ships MathJax and links out."""
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 10
    remote = re.compile(r"<(?:script|link)\b[^>]*(?:src|href)=\"(?:https?:)?//[^\"]*\"")
    for page in pages:
        html = page.read_text()
        loads = [m.group(0) for m in remote.finditer(html) if 'rel="canonical"' not in m.group(0)]
        assert not loads, f"{page.relative_to(site)} loads from another host: {loads[:3]}"
    assert (site / "assets" / "mathjax" / "tex-chtml.js").is_file()
    index = (site / "index.html").read_text()
    assert "assets/mathjax/tex-chtml.js" in index and "_js/mathjax-config.js" in index
    assert 'class="arithmatex"' in (site / "catalogue" / "index.html").read_text()
    api = (site / "api" / "structinfer" / "index.html").read_text()
    for target in (
        "https://docs.jax.dev/en/latest/_autosummary/jax.Array.html#jax.Array",
        "https://docs.python.org/3/library/stdtypes.html#str",
        "https://num.pyro.ai/en/stable/distributions.html#numpyro.distributions.discrete.CategoricalLogits",
    ):
        assert f'href="{target}"' in api, f"the API page does not link to {target}"


def test_a_new_warning_fails(tmp_path):
    """The check above can fail: a tiny site with a broken link gives a warning not listed."""
    pytest.importorskip("mkdocs")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the page](page.md).\n")
    (tmp_path / "docs" / "page.md").write_text("# Page\n\nSee [nothing](no_such_page.md).\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: scratch\nstrict: true\n")
    proc = build(tmp_path, tmp_path / "site")
    new, gone = compare(warnings_of(proc), known())
    assert [w for w in new if "no_such_page.md" in w], proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert new and not compare(known(), known())[0]


def _update(allow_new: bool) -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        proc = build(ROOT, Path(tmp) / "site")
    found = warnings_of(proc)
    new, gone = compare(found, known())
    for w in gone:
        print(f"- {w}")
    for w in new:
        print(f"+ {w}")
    if new and not allow_new:
        print(f"{len(new)} new warnings: fix them, or pass --allow-new if they only moved.")
        return 1
    header = [
        "# Warnings of `mkdocs build --strict` that are known and not yet fixed.",
        "# tests/test_docs.py fails on any warning not listed here and on any listed",
        "# warning that no longer occurs. This list may only shrink.",
    ]
    KNOWN.write_text("\n".join(header + found) + "\n")
    print(f"{KNOWN.relative_to(ROOT)}: {len(found)} warnings")
    return 0


if __name__ == "__main__":
    sys.exit(_update("--allow-new" in sys.argv))
