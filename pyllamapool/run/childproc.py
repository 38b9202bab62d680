"""Child processes that die with this one, however it ends (an abort or a SIGKILL included).

A helper such as ggml-rpc-server left behind by a crashed parent keeps its port and its memory
until someone kills it. On Linux the child asks the kernel for SIGKILL when its parent goes away
(prctl PR_SET_PDEATHSIG), in a tiny Python wrapper that then execs the real program under the same
pid, so no Python code runs between fork and exec in this process (a preexec_fn is unsafe with the
threads llama.cpp starts).

The kernel's "parent" is the *thread* that forked, not the process: a child started from a thread
that later exits would be killed then. So children started off the main thread are forked by one
long-lived spawner thread, which lives as long as the process. Elsewhere than Linux children are
started plainly (they may outlive an aborted parent).
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: exit status of the wrapper when the parent died before the death signal was armed, or when the
#: kernel refused it: the real program never starts
WRAPPER_FAILED = 125

# Runs as `python -I -S -c _WRAPPER PARENT_PID PROGRAM ARGS...`: arm the signal, check the parent
# is still the one that started us (if it died before prctl took effect, the signal will never
# come: we were already reparented), then become the program. -I -S: no site, no user paths, so
# the few milliseconds it costs do not depend on the environment.
_WRAPPER = """\
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
    sys.stderr.write("pyllamapool: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()) + "\\n")
    os._exit(FAILED)
if os.getppid() != int(sys.argv[1]):
    sys.stderr.write("pyllamapool: parent " + sys.argv[1] + " exited before its child started\\n")
    os._exit(FAILED)
try:
    os.execv(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.stderr.write("pyllamapool: cannot run " + sys.argv[2] + ": " + str(exc) + "\\n")
    os._exit(127)
""".replace("FAILED", str(WRAPPER_FAILED))


def death_signal_supported() -> bool:
    """Whether children can be tied to this process's life (Linux, with a Python to run the wrapper)."""
    return sys.platform.startswith("linux") and bool(sys.executable)


def wrapped_argv(argv: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """argv run through the wrapper: the program execs under the wrapper's pid with SIGKILL armed
    for when `parent_pid` (default: this process) goes away. argv[0] must be a path (no PATH lookup)."""
    if not argv or os.sep not in str(argv[0]):
        raise ValueError(f"the program must be given as a path, got {argv[:1]!r}")
    return [sys.executable, "-I", "-S", "-c", _WRAPPER, str(parent_pid or os.getpid()), *map(str, argv)]


@dataclass
class _Request:
    argv: list[str]
    kwargs: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: subprocess.Popen | None = None
    error: BaseException | None = None


class _Spawner:
    """One daemon thread that forks children on behalf of other threads: it never returns, so the
    children's parent thread lives until the process ends."""

    def __init__(self) -> None:
        self._requests: "queue.SimpleQueue[_Request]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, argv: list[str], kwargs: dict[str, Any]) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="pyllamapool-spawner", daemon=True)
                self._thread.start()
        request = _Request(argv, kwargs)
        self._requests.put(request)
        request.done.wait()
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            try:
                request.result = subprocess.Popen(request.argv, **request.kwargs)
            except BaseException as exc:  # handed back to the caller's thread, raised there
                request.error = exc
            request.done.set()


_spawner = _Spawner()


def popen_tied(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen(argv, **kwargs) for a child that is SIGKILLed when this process ends, where
    the platform allows (see the module's notes). Popen.pid is the program's own pid."""
    if not death_signal_supported():
        return subprocess.Popen(list(argv), **kwargs)
    full = wrapped_argv(argv)
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(full, **kwargs)
    return _spawner.popen(full, kwargs)


__all__ = ["popen_tied", "wrapped_argv", "death_signal_supported", "WRAPPER_FAILED"]
