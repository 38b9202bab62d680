"""Where things live: the project checkout, the vendored tree, the user cache, built outputs."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
PROJECT_ROOT = PACKAGE_DIR.parent

#: Environment variable naming a folder that holds the built libllama / libggml (and bin/ beside it).
LIB_DIR_ENV = "PYLLAMAPOOL_LIB_DIR"


def project_root() -> Path:
    override = os.environ.get("PYLLAMAPOOL_ROOT")
    return Path(override).resolve() if override else PROJECT_ROOT


def pin_file(root: Path | None = None) -> Path:
    return (root or project_root()) / "vendor" / "llama.cpp.pin"


def vendor_dir(root: Path | None = None) -> Path:
    return (root or project_root()) / "vendor" / "llama.cpp"


def stamp_file(root: Path | None = None) -> Path:
    # Outside the vendored tree on purpose: a file inside it would show up as an untracked edit.
    return (root or project_root()) / "vendor" / ".llama.cpp.stamp"


def patches_dir(root: Path | None = None) -> Path:
    return (root or project_root()) / "patches"


def cache_dir() -> Path:
    override = os.environ.get("PYLLAMAPOOL_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pyllamapool"


def default_build_dir(target: str, root: Path | None = None) -> Path:
    return (root or project_root()) / "build" / target


def installed_lib_dir() -> Path:
    return PACKAGE_DIR / "lib"


def installed_bin_dir() -> Path:
    return PACKAGE_DIR / "bin"


def manifest_file() -> Path:
    return PACKAGE_DIR / "build-manifest.json"
