"""``python -m structinfer``: the ``structinfer`` command (`structinfer.cli.main`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
