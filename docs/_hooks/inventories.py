"""MkDocs hook: read the checked-in Sphinx inventories as local files.

mkdocstrings downloads each inventory listed under ``handlers.python.inventories``. The
site is built where only package registries can be reached, so ``mkdocs.yml`` lists the
files in ``docs/_inventories/`` (made by ``docs/gen_inventories.py``) by a path relative to
``mkdocs.yml``, each with the ``base_url`` of its project's documentation; this hook turns
such a path into a ``file:`` URL before mkdocstrings reads it. The URL ends with a hash of
the file, so that mkdocstrings' one-day download cache never serves an older version.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import urlparse

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority


@event_priority(100)  # before mkdocstrings reads its handlers' configuration
def on_config(config, **kwargs):
    root = Path(config.config_file_path).resolve().parent
    handlers = config.plugins["mkdocstrings"].config.handlers
    inventories = handlers.get("python", {}).get("inventories", [])
    for i, item in enumerate(inventories):
        entry = {"url": item} if isinstance(item, str) else dict(item)
        if urlparse(entry["url"]).scheme:
            continue
        path = (root / entry["url"]).resolve()
        if not path.is_file():
            raise PluginError(f"inventory {entry['url']} not found (looked at {path})")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        entry["url"] = f"{path.as_uri()}#{digest}"
        inventories[i] = entry
    return config
