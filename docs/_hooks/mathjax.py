"""MkDocs hook: ship MathJax with the site, so that math renders without a CDN.

MathJax 3 comes from the PyPI package ``django-static-mathjax`` (its ``mathjax/static/
mathjax/es5`` folder is MathJax's own ``es5`` distribution; the package has no
dependencies and needs no Django to be read from). The hook adds the TeX-to-CommonHTML
bundle, the TeX extensions it autoloads, its web fonts and its menu to the site under
``assets/mathjax/``; ``mkdocs.yml`` loads ``_js/mathjax-config.js`` and then
``assets/mathjax/tex-chtml.js``. Math is written ``$...$`` / ``$$...$$`` (or ``\\(...\\)``,
``\\[...\\]``) and marked by ``pymdownx.arithmatex`` (``generic: true``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

DEST = "assets/mathjax"
# what tex-chtml.js loads at run time, relative to MathJax's es5 folder
PARTS = ("tex-chtml.js", "input/tex/extensions", "output/chtml/fonts/woff-v2", "ui", "a11y")


def mathjax_root() -> Path:
    """MathJax's ``es5`` folder inside the installed ``django-static-mathjax`` package."""
    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise PluginError(
            "the docs ship MathJax from the `django-static-mathjax` package; install it "
            "(it is in the `test` extra: pip install -e '.[test]')"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax" / "es5"
    if not (root / "tex-chtml.js").is_file():
        raise PluginError(f"no MathJax es5 bundle at {root}")
    return root


def on_files(files, config, **kwargs):
    root = mathjax_root()
    for part in PARTS:
        path = root / part
        paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for p in paths:
            uri = f"{DEST}/{p.relative_to(root).as_posix()}"
            files.append(File.generated(config, uri, abs_src_path=str(p)))
    return files
