"""Where specadapt keeps files it makes once and reads on every later start.

The root is ``$SPECADAPT_CACHE``, else ``~/.cache/specadapt``:

- ``models/``: the assembled GGUF files of the model presets (:mod:`specadapt.engine.presets`);
- ``derived/<file stem>-<key>/``: what is derived from one GGUF file (its tensor index, transformers config and
  tokenizer, the decoded blocks of the native forward; :mod:`specadapt.engine.gguf_load`), keyed by the file's
  resolved path, size and modification time, so a changed or moved file gets a fresh directory.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_root", "models_dir", "derived_cache_dir"]

CACHE_ENV = "SPECADAPT_CACHE"
#: bump when what is cached under derived/ changes
DERIVED_VERSION = "1"


def cache_root() -> Path:
    """``$SPECADAPT_CACHE`` or ``~/.cache/specadapt`` (not created here)."""
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "specadapt"


def models_dir() -> Path:
    """Folder of the assembled preset files."""
    return cache_root() / "models"


def derived_cache_dir(gguf_path: str | os.PathLike) -> Path:
    """The cache directory of what is derived from one GGUF file (not created here).

    Raises:
        OSError: the file cannot be stat'ed.
    """
    st = os.stat(gguf_path)
    key = f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{DERIVED_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "derived" / f"{Path(gguf_path).stem}-{digest}"
