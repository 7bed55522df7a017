"""Every fenced Python block of README.md and docs/*.md runs as written.

mktestdocs runs the ```` ```python ```` blocks of a page in order, in one namespace (a
later block may use what an earlier one defined), so a page is one test. A block that is
deliberately partial (a fragment of a model, pseudo-code, a step that must run before JAX
starts) says so in its info string — ```` ```{.python notest} ```` in docs/ (what
Material renders), ```` ```python notest ```` in the README — and is not run. Numbers the
pages state are checked by ``assert`` lines in the blocks themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest

mktestdocs = pytest.importorskip("mktestdocs")

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# pages left out, and why; a page leaves this list once its blocks are runnable or marked
EXCLUDED: dict[str, str] = {}

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(\S.*)?$")


def fences(text: str) -> list[str]:
    """The info strings of the fenced blocks of a Markdown page."""
    infos, inside = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if not m:
            continue
        if inside is None:
            inside = m.group(1)
            infos.append((m.group(2) or "").strip())
        elif m.group(1).startswith(inside) and not m.group(2):
            inside = None
    return infos


def is_python(info: str) -> bool:
    return bool(re.match(r"^(\{\s*\.)?(python3?|py)\b", info))


def runnable(path: Path) -> bool:
    return any(info == "python" for info in fences(path.read_text()))


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in EXCLUDED], ids=lambda p: p.name)
def test_page_blocks_are_run_or_marked(page):
    """A Python block is either run (exactly ```python) or explicitly marked notest."""
    odd = [
        info
        for info in fences(page.read_text())
        if is_python(info) and info != "python" and "notest" not in info
    ]
    assert not odd, f"{page.name}: Python blocks neither run nor marked notest: {odd}"


#: pages whose blocks run in the exhaustive tier only (each 10-17 s on two cores; CI runs
#: them every time): the reference pages and the concepts, beside the README and the
#: tutorial
EXHAUSTIVE_PAGES = {"performance.md", "nn.md", "numpyro_tools.md", "diagnostics.md",
                    "known_issues.md", "inference.md", "concepts.md"}


@pytest.mark.parametrize("page", [
    pytest.param(p, id=p.name, marks=[pytest.mark.exhaustive] * (p.name in EXHAUSTIVE_PAGES))
    for p in PAGES if p.name not in EXCLUDED and runnable(p)])
def test_snippets_run(page):
    x64 = jax.config.jax_enable_x64
    try:
        mktestdocs.check_md_file(page, memory=True)
    finally:
        assert jax.config.jax_enable_x64 == x64, f"{page.name} changed jax_enable_x64"
        jax.config.update("jax_enable_x64", x64)


def test_exclusions_are_still_needed():
    """An excluded page whose Python blocks are all marked must be run again."""
    for name in EXCLUDED:
        page = ROOT / "docs" / name
        assert page.exists() and runnable(page), f"remove {name} from EXCLUDED in {__file__}"
