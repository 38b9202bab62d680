"""The patched llama.cpp programs built next to the libraries (llama-server, ggml-rpc-server, ...)."""
from __future__ import annotations

import os
from pathlib import Path

from . import paths
from ..errors import LibraryNotFound

TOOLS = ("llama-server", "llama-cli", "llama-bench", "llama-quantize", "ggml-rpc-server")


def bin_dirs() -> list[Path]:
    from ..binding._ffi import candidate_dirs
    override = os.environ.get(paths.LIB_DIR_ENV)
    if override:
        return [Path(override).parent / "bin", Path(override)]
    return [lib.parent / "bin" for lib in candidate_dirs()]


def tool_path(name: str) -> Path:
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; known: {', '.join(TOOLS)}")
    tried = []
    for directory in bin_dirs():
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
        tried.append(str(candidate))
    raise LibraryNotFound(f"{name} not found; tried: {', '.join(tried)}. Build it with "
                          f"`python build.py --target cpu`")
