"""A loopback RPC test device: `ggml-rpc-server` on 127.0.0.1, started and stopped by its own pid.

Through llama.cpp's RPC backend the server is a separate device with its own buffers, reached over
loopback as a GPU is over PCIe: run layers there with `--rpc ENDPOINT -ngl 99`, keep experts on the
host with `--n-cpu-moe`, and an expert pool lives on that device. Only 127.0.0.1 is ever bound.

On Linux a server dies with the process that started it, also when that process aborts or is
killed (pyllamapool.run.childproc: the parent-death signal).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .childproc import popen_tied
from ..errors import PyllamapoolError
from ..native.tools import tool_path

LOOPBACK = "127.0.0.1"

#: servers started by this process and not stopped yet, by endpoint
_running: "dict[str, RpcServer]" = {}
#: endpoints whose server this process stopped (until a new one starts there): ggml aborts the
#: process on a dead RPC connection, so callers must know not to query them
_stopped: set[str] = set()


def server_for(endpoint: str) -> "RpcServer | None":
    """The server this process started at endpoint and has not stopped (it may have died since)."""
    return _running.get(endpoint)


def mark_stopped(endpoint: str) -> None:
    """Record that an endpoint this process used no longer serves (one not started through RpcServer,
    e.g. a test's proxy): device listings then skip it instead of querying it."""
    _running.pop(endpoint, None)
    _stopped.add(endpoint)


def stopped_here(endpoint: str) -> bool:
    """Whether this process stopped the server at endpoint (and started none there since)."""
    return endpoint in _stopped


class RpcServerError(PyllamapoolError):
    """The RPC server could not be started, or stopped answering."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class RpcServer:
    """One running ggml-rpc-server. Use as a context manager, or call start()/stop()."""
    port: int
    threads: int = 1
    binary: Path | None = None
    log_path: Path | None = None
    startup_timeout_s: float = 20.0
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _log_dir: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def start(self) -> "RpcServer":
        binary = Path(self.binary) if self.binary else tool_path("ggml-rpc-server")
        if not binary.is_file():
            raise RpcServerError(f"RPC server binary {binary} does not exist; build it with "
                                 f"`python build.py --target cpu`")
        if not port_is_free(self.port):
            raise RpcServerError(f"port {self.port} on {LOOPBACK} is already in use")
        if self.log_path is None:
            self._log_dir = tempfile.TemporaryDirectory(prefix="pyllamapool-rpc-")
            self.log_path = Path(self._log_dir.name) / f"rpc-{self.port}.log"
        log = open(self.log_path, "wb")
        env = dict(os.environ)
        env.pop("LLAMA_CACHE", None)
        argv = [str(binary), "-H", LOOPBACK, "-p", str(self.port), "-t", str(self.threads)]
        # the server prints with stdio: line-buffer it so the log is readable while it runs
        stdbuf = shutil.which("stdbuf")
        if stdbuf:
            argv = [stdbuf, "-oL", "-eL", *argv]
        # tied to this process: an abort or a SIGKILL here must not leave the server holding its
        # port and memory
        self._proc = popen_tied(
            argv,
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RpcServerError(f"ggml-rpc-server exited with code {self._proc.returncode} before "
                                     f"accepting on {self.endpoint}:\n{self.log_text()[-1500:]}")
            if _accepts(self.port):
                _running[self.endpoint] = self
                _stopped.discard(self.endpoint)
                return self
            time.sleep(0.05)
        self.stop()
        raise RpcServerError(f"ggml-rpc-server did not accept on {self.endpoint} within "
                             f"{self.startup_timeout_s:.0f} s:\n{self.log_text()[-1500:]}")

    def stop(self) -> None:
        if _running.get(self.endpoint) is self:
            del _running[self.endpoint]
            _stopped.add(self.endpoint)
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def close(self) -> None:
        self.stop()
        if self._log_dir is not None:
            self._log_dir.cleanup()
            self._log_dir = None

    def __enter__(self) -> "RpcServer":
        return self.start() if not self.running else self

    def __exit__(self, *exc) -> None:
        self.close()


def start_rpc_server(port: int | None = None, threads: int = 1, binary: Path | None = None,
                     log_path: Path | None = None, attempts: int = 3) -> RpcServer:
    """Start a server on a free loopback port (or the given one) and wait until it accepts."""
    last: RpcServerError | None = None
    for _ in range(attempts if port is None else 1):
        server = RpcServer(port or free_port(), threads=threads, binary=binary, log_path=log_path)
        try:
            return server.start()
        except RpcServerError as exc:  # another process may have taken the free port meanwhile
            server.close()
            last = exc
    assert last is not None
    raise last
