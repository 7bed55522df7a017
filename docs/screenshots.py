"""Screenshots of the built documentation site, to look at pages as a reader sees them.

Builds the site (or takes ``--site DIR``), serves it on 127.0.0.1 and renders each page
with headless Chromium (Debian's ``chromium``: ``apt-get install chromium``) to a PNG:

    python docs/screenshots.py                      # -> docs-screenshots/*.png
    python docs/screenshots.py --out /tmp/shots --pages index catalogue --height 4000

Look at the images: math typeset (no raw ``\\(...\\)``), wide tables scroll inside their
box rather than being cut off, code blocks scroll, nothing overlaps. Chromium runs with a
fresh profile and without network services; MathJax is served with the site, so pages
render offline. ``--width 800`` gives a narrow (tablet) view.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> path of the page in the site (directory URLs), with an optional anchor
PAGES = {
    "index": "",
    "concepts": "concepts/",
    "tutorial": "tutorial/",
    "catalogue": "catalogue/",
    "api": "api/structinfer/",
    "api-priors": "api/priors/",
    "api-scores": "api/scores/",
    "api-mechanisms": "api/mechanisms/",
    "api-exact": "api/exact/",
    "api-infer": "api/infer/",
    "api-nn": "api/nn/",
    "api-lowering": "api/lowering/",
    "api-diagnostics": "api/diagnostics/",
    "nn": "nn/",
    "benchmarks": "benchmarks/",
    "numpyro-tools": "numpyro_tools/",
}

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def build_site(site: Path) -> None:
    """``mkdocs build`` into ``site`` (not strict: the pictures are wanted even with warnings)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--no-strict", "-q", "-d", str(site)],
        cwd=ROOT,
        env=env,
        check=True,
    )


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve ``site`` on a free loopback port; returns the server and its base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def screenshot(chromium: str, url: str, png: Path, width: int, height: int, wait_ms: int) -> None:
    """Render ``url`` to ``png`` with a fresh Chromium profile."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [
            chromium,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            f"--virtual-time-budget={wait_ms}",
            f"--screenshot={png}",
            url,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if not png.exists():
        raise RuntimeError(f"chromium wrote no {png}:\n{proc.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, help="a built site (default: build one)")
    parser.add_argument("--out", type=Path, default=Path("docs-screenshots"))
    parser.add_argument("--pages", nargs="*", default=list(PAGES), choices=list(PAGES))
    parser.add_argument("--width", type=int, default=1366)
    parser.add_argument("--height", type=int, default=2400)
    parser.add_argument("--wait-ms", type=int, default=10000, help="time for MathJax to run")
    args = parser.parse_args(argv)

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        parser.error("needs Chromium: apt-get install chromium")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="structinfer-site-") as tmp:
        site = args.site
        if site is None:
            site = Path(tmp) / "site"
            build_site(site)
        server, base = serve(site)
        try:
            for name in args.pages:
                png = args.out / f"{name}.png"
                png.unlink(missing_ok=True)
                screenshot(chromium, base + PAGES[name], png, args.width, args.height, args.wait_ms)
                print(png)
        finally:
            server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
