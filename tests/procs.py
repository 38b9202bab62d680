"""Helpers for tests about processes: is a pid alive, wait for one to go, run a parent that aborts."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pid_alive(pid: int) -> bool:
    """Whether pid runs. A zombie counts as dead: in a container nobody may reap an orphan."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel directly
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    # the state follows the command name, which is in parentheses and may contain spaces
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


def run_aborting_parent(script: str, timeout_s: float = 60) -> list[int]:
    """Run `script` in a child Python that prints pids, one per line, and then aborts; return them."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            timeout=timeout_s, cwd=ROOT)
    assert result.returncode == -6, f"the parent did not abort (rc {result.returncode}):\n{result.stderr[-2000:]}"
    pids = [int(line) for line in result.stdout.split()]
    assert pids, f"the parent printed no pid:\n{result.stderr[-2000:]}"
    return pids


def kill_if_alive(pids: list[int]) -> None:
    # a failing test must not leave its sleepers behind
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, 9)
