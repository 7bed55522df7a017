"""Write docs/catalogue.md from the mechanism registry.

python docs/gen_catalogue.py          # rewrite the page
python docs/gen_catalogue.py --check  # exit 1 if the page is stale
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from structinfer.mechanisms.registry import render_catalogue

PAGE = pathlib.Path(__file__).resolve().parent / "catalogue.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the page is up to date")
    args = parser.parse_args(argv)
    text = render_catalogue() + "\n"
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale; run python docs/gen_catalogue.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
