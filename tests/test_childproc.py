"""Children tied to their parent's life (pyllamapool.run.childproc): they die when the parent aborts,
also when a short-lived thread started them. Runs without the native build (the child is sleep)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from procs import kill_if_alive, run_aborting_parent, wait_gone
from pyllamapool.run.childproc import WRAPPER_FAILED, death_signal_supported, popen_tied, wrapped_argv

SLEEP = "/bin/sleep"

linux_only = pytest.mark.skipif(not death_signal_supported(), reason="the parent-death signal is Linux's")


@linux_only
def test_a_tied_child_dies_when_its_parent_aborts():
    pids = run_aborting_parent(
        "import os, subprocess\n"
        "from pyllamapool.run.childproc import popen_tied\n"
        f"p = popen_tied([{SLEEP!r}, '60'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
        "os.abort()\n")
    try:
        assert wait_gone(pids[0]), f"sleep {pids[0]} outlived its aborted parent"
    finally:
        kill_if_alive(pids)


@linux_only
def test_a_child_started_from_a_thread_that_exits_lives_until_the_process_ends():
    """PDEATHSIG follows the forking thread: a thread that started a child and returned must not
    take the child with it; the process's end must."""
    pids = run_aborting_parent(
        "import os, subprocess, threading, time\n"
        "from pyllamapool.run.childproc import popen_tied\n"
        "box = []\n"
        "def start():\n"
        f"    box.append(popen_tied([{SLEEP!r}, '60'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))\n"
        # the thread outlives the wrapper's prctl: a child armed against this thread would die now
        "    time.sleep(0.5)\n"
        "t = threading.Thread(target=start)\n"
        "t.start(); t.join()\n"
        "time.sleep(0.5)\n"
        "alive = box[0].poll() is None\n"
        "print(box[0].pid, flush=True)\n"
        "print(1 if alive else 0, flush=True)\n"
        "os.abort()\n")
    try:
        child, alive_after_thread = pids
        assert alive_after_thread == 1, "the child died with the thread that started it"
        assert wait_gone(child), f"sleep {child} outlived its aborted parent"
    finally:
        kill_if_alive(pids[:1])


@linux_only
def test_the_tied_child_keeps_the_wrapper_pid_and_exits_normally():
    proc = popen_tied([SLEEP, "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    # after exec the pid is the program's: /proc shows sleep, not python, while it runs
    proc = popen_tied([SLEEP, "5"])
    try:
        deadline = time.monotonic() + 10
        comm = ""
        while time.monotonic() < deadline and comm != "sleep":
            comm = Path(f"/proc/{proc.pid}/comm").read_text().strip()
            time.sleep(0.02)
        assert comm == "sleep"
    finally:
        proc.kill()
        proc.wait(timeout=5)


@linux_only
def test_a_child_whose_parent_is_already_gone_never_starts_the_program(tmp_path):
    """The wrapper checks the parent after arming the signal: one that is not the pid it was given
    (here: a pid that is not its parent, as after a reparenting) means no signal would ever come."""
    marker = tmp_path / "ran"
    argv = wrapped_argv(["/bin/sh", "-c", f"touch {marker}"], parent_pid=1)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    assert result.returncode == WRAPPER_FAILED
    assert "exited before its child started" in result.stderr
    assert not marker.exists()


def test_a_program_must_be_given_as_a_path():
    with pytest.raises(ValueError, match="must be given as a path"):
        wrapped_argv(["sleep", "1"])


@linux_only
def test_a_program_that_cannot_run_is_reported(tmp_path):
    result = subprocess.run(wrapped_argv([str(tmp_path / "missing")]), capture_output=True, text=True, timeout=20)
    assert result.returncode == 127 and "cannot run" in result.stderr
