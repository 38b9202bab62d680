"""Route llama.cpp / ggml log output into Python `logging`, with the right levels.

ggml logs in fragments (a line may arrive in pieces, continued with GGML_LOG_LEVEL_CONT), so text
is buffered until a newline. Levels come from the bound header's enum (never copied by hand).
Captures let callers read what llama.cpp printed during a call (e.g. the expert pool lines).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

from . import _ffi

logger = logging.getLogger("pyllamapool.llama")

_state = threading.local()
_lock = threading.Lock()
_installed: dict[str, object] = {}
_captures: list[list[tuple[int, str]]] = []


def _level_map(lib) -> dict[int, int]:
    return {
        lib.GGML_LOG_LEVEL_NONE: logging.INFO,
        lib.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
        lib.GGML_LOG_LEVEL_INFO: logging.INFO,
        lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
        lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
    }


def _emit(level: int, line: str) -> None:
    with _lock:
        for capture in _captures:
            capture.append((level, line))
    logger.log(level, line)


def install() -> None:
    """Install the callback once per process (llama_log_set is global)."""
    if _installed:
        return
    ffi, lib, _ = _ffi.load()
    levels = _level_map(lib)
    cont = lib.GGML_LOG_LEVEL_CONT
    pending = {"level": logging.INFO, "text": ""}

    @ffi.callback("void(enum ggml_log_level, const char *, void *)")
    def on_log(level, text, _user):  # pragma: no cover - exercised through llama.cpp
        try:
            chunk = ffi.string(text).decode("utf-8", "replace")
            if level != cont:
                if pending["text"]:
                    _emit(pending["level"], pending["text"])
                    pending["text"] = ""
                pending["level"] = levels.get(level, logging.INFO)
            pending["text"] += chunk
            while "\n" in pending["text"]:
                line, pending["text"] = pending["text"].split("\n", 1)
                _emit(pending["level"], line)
        except Exception:  # never let a Python error unwind into C
            pass

    _installed["callback"] = on_log  # keep it alive for the life of the process
    lib.llama_log_set(on_log, ffi.NULL)


def uninstall() -> None:
    """Give llama.cpp its own stderr logger back (at exit: no call may reach Python after it)."""
    if not _installed:
        return
    ffi, lib, _ = _ffi.load()
    lib.llama_log_set(ffi.NULL, ffi.NULL)
    _installed.clear()


@contextlib.contextmanager
def capture() -> Iterator[list[tuple[int, str]]]:
    """Collect (python_level, line) of everything llama.cpp logs inside the block."""
    install()
    lines: list[tuple[int, str]] = []
    with _lock:
        _captures.append(lines)
    try:
        yield lines
    finally:
        with _lock:
            # by identity: nested captures may hold equal lists, and list.remove compares by value
            del _captures[next(i for i, c in enumerate(_captures) if c is lines)]


def errors_in(lines: list[tuple[int, str]]) -> list[str]:
    return [text for level, text in lines if level >= logging.WARNING]
