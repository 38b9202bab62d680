"""The build manifest: which tree, patches, target and flags the installed libraries came from."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from . import paths


class StaleBuildWarning(UserWarning):
    """The built libraries were made from a different patch series than the checkout holds."""


def read_manifest(lib_dir: Path | None = None) -> dict | None:
    candidates = [lib_dir.parent / "build-manifest.json"] if lib_dir else []
    candidates.append(paths.manifest_file())
    for path in candidates:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                return None
    return None


def current_series_digest() -> str | None:
    """Digest of the checkout's pin + patches/series; None outside a project checkout."""
    from .patches import Series
    from .pin import Pin

    root = paths.project_root()
    if not (root / "patches").is_dir() or not paths.pin_file(root).exists():
        return None
    try:
        return Series.load(root / "patches").digest(Pin.load(paths.pin_file(root)))
    except Exception:
        return None


def check_current(manifest: dict | None) -> str | None:
    """A warning text when the manifest's series differs from the checkout's, else None."""
    if not manifest:
        return None
    digest = current_series_digest()
    if digest and manifest.get("series_digest") not in (digest, None):
        return ("the built llama.cpp libraries do not match patches/series (built from series "
                f"{str(manifest.get('series_digest'))[:12]}, checkout has {digest[:12]}); "
                "rebuild with `python build.py`")
    return None


def warn_if_stale() -> None:
    if os.environ.get("PYLLAMAPOOL_NO_STALE_WARNING"):
        return
    text = check_current(read_manifest())
    if text:
        warnings.warn(text, StaleBuildWarning, stacklevel=3)
