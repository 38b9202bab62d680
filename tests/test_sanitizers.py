"""The series under AddressSanitizer + UndefinedBehaviorSanitizer, and under ThreadSanitizer. Each needs
its sanitized build beside the CPU one:

    python build.py --target cpu --sanitize --only tests --prefix build/sanitize-install
    python build.py --target cpu --sanitize thread --only tests --prefix build/tsan-install

(.ci/run makes both.) The ctest runs as built; pooled decode runs as a selection of the suite in a
process of its own with the sanitized libraries (and their RPC server) loaded and the runtimes preloaded
into Python, which is not instrumented. Any report fails the test.

ThreadSanitizer sees the threads the pool's work crosses: ggml-cpu's thread pool (the pool's ops run on
its first thread while the others wait, and the CPU's share of a hybrid step overlaps the device's),
the RPC client's dispatcher thread, and a monitor thread reading and resetting the counters while
another decodes. It slows decode some 20 to 50 times, so its selection is small.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SANITIZED_LIB = ROOT / "build" / "sanitize-install" / "pyllamapool" / "lib"
CTEST = ROOT / "build" / "cpu-sanitize" / "bin" / "test-expert-pool"
TSAN_LIB = ROOT / "build" / "tsan-install" / "pyllamapool" / "lib"
TSAN_CTEST = ROOT / "build" / "cpu-tsan" / "bin" / "test-expert-pool"

needs_asan = pytest.mark.skipif(
    not (SANITIZED_LIB / "libllama.so").exists(),
    reason="no sanitized build: python build.py --target cpu --sanitize --only tests --prefix build/sanitize-install")
needs_tsan = pytest.mark.skipif(
    not (TSAN_LIB / "libllama.so").exists(),
    reason="no ThreadSanitizer build: python build.py --target cpu --sanitize thread --only tests --prefix build/tsan-install")

REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer", "WARNING: ThreadSanitizer")


def loaded_from(lib_dir: Path) -> dict[str, str]:
    """The suite's own decode tests against the libraries in lib_dir (tests/conftest.py keeps this
    variable where it clears the developer's PYLLAMAPOOL_* settings)."""
    return {"PYLLAMAPOOL_TESTS_LIB_DIR": str(lib_dir), "PYTHONPATH": str(ROOT)}


def runtime(name: str) -> str:
    return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()


def clean_env() -> dict[str, str]:
    """This environment without the pool's and pyllamapool's settings; an abort reports and exits
    (ggml's gdb backtrace can hang attaching under a sanitizer)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYLLAMAPOOL_", "LLAMA_MOE_POOL_", "GGML_MOE_POOL"))}
    env["GGML_NO_BACKTRACE"] = "1"
    return env


def tsan_env(preload: bool) -> dict[str, str]:
    env = clean_env()
    env["TSAN_OPTIONS"] = "halt_on_error=1:second_deadlock_stack=1"
    if preload:
        env["LD_PRELOAD"] = runtime("libtsan.so")
        env.update(loaded_from(TSAN_LIB))
    return env


def sanitizer_env(preload: bool) -> dict[str, str]:
    env = clean_env()
    # Python itself leaks by design at exit: leak checking is for the ctest only
    env["ASAN_OPTIONS"] = f"detect_leaks={0 if preload else 1}:abort_on_error=1:strict_string_checks=1"
    # the ctest ends normally, so leaks are checked at its exit; ggml-rpc's registries live for the process
    env["LSAN_OPTIONS"] = f"suppressions={ROOT / 'tests' / 'lsan.supp'}:print_suppressions=0"
    env["UBSAN_OPTIONS"] = f"print_stacktrace=1:halt_on_error=1:suppressions={ROOT / 'tests' / 'ubsan.supp'}"
    if preload:
        env["LD_PRELOAD"] = " ".join(runtime(lib) for lib in ("libasan.so", "libubsan.so"))
        env.update(loaded_from(SANITIZED_LIB))
    return env


def run_suite(selection: list[str], env: dict[str, str], lib_dir: Path) -> subprocess.CompletedProcess:
    """pytest on a selection of the suite, in a process of its own with lib_dir's libraries; its
    conftest says which libraries it loaded, so that a run on the plain build cannot pass for this one."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *selection],
                            capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    assert f"pyllamapool tests: libraries from {lib_dir}" in result.stderr, result.stderr[-2000:]
    return result


def assert_clean(result: subprocess.CompletedProcess) -> None:
    out = result.stdout + result.stderr
    found = [r for r in REPORTS if r in out]
    assert result.returncode == 0 and not found, (found, out[-4000:])


def outcomes(result: subprocess.CompletedProcess) -> dict[str, int]:
    """pytest's closing tally ("3 passed, 1 skipped, 168 deselected in ...") as counts by outcome."""
    tally = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", tally)}


def assert_selection_passed(result: subprocess.CompletedProcess, at_least: int, skips: bool = True) -> None:
    """Every selected test ran and passed: none failed or errored, at least at_least of them passed,
    and, where skips is False, none was skipped (a skip there would be a test that did not run)."""
    counts = outcomes(result)
    assert counts.get("passed", 0) >= at_least, (counts, result.stdout[-2000:])
    assert not counts.get("failed") and not counts.get("error") and not counts.get("errors"), counts
    assert skips or not counts.get("skipped"), counts


def assert_ctest_clean(ctest: Path, env: dict[str, str]) -> None:
    result = subprocess.run([str(ctest)], capture_output=True, text=True, timeout=900, env=env)
    assert_clean(result)
    assert " 0 failed" in result.stdout + result.stderr


@needs_asan
def test_the_expert_pool_ctest_is_clean_under_sanitizers():
    assert_ctest_clean(CTEST, sanitizer_env(False))


@needs_asan
def test_pooled_decode_is_clean_under_sanitizers():
    """Heavy eviction, repacked experts read from the file, biases and scales, the gate closing and
    reopening, two sequences, two contexts on one model, the all-or-none rollback."""
    selection = ("bit_identical_to_the_resident or every_expert_type and (Q4_0 or Q4_K) or travel or "
                 "gate_closes_every_step or two_sequences or several_contexts or failed_allocation")
    result = run_suite([str(ROOT / "tests" / "test_pool.py"), "-k", selection], sanitizer_env(True), SANITIZED_LIB)
    assert_clean(result)
    assert_selection_passed(result, at_least=1)


@needs_asan
def test_pooled_decode_on_the_lazy_copy_device_is_clean_under_sanitizers():
    """Both modes with their copies and graphs deferred to synchronize: a queued copy whose host
    source was freed before the device read it is a use after free here."""
    result = run_suite([str(ROOT / "tests" / "test_lazy_device.py"), "-k", "heavy or two_sequences or staging"],
                       sanitizer_env(True), SANITIZED_LIB)
    assert_clean(result)
    assert_selection_passed(result, at_least=1)


@needs_tsan
def test_the_expert_pool_ctest_is_clean_under_thread_sanitizer():
    assert_ctest_clean(TSAN_CTEST, tsan_env(False))


@needs_tsan
def test_pooled_decode_is_clean_under_thread_sanitizer():
    """Counters read and reset from a monitor thread while another decodes (RPC, whose client has a
    dispatcher thread of its own), and hybrid decode with stream uploads at heavy eviction on the
    lazy-copy device (the CPU's share beside the device's queue, the upload queue beside the compute one)."""
    result = run_suite([str(ROOT / "tests" / "test_pool.py"), str(ROOT / "tests" / "test_lazy_device.py"), "-k",
                        "counters_read_from_another_thread or heavy_eviction and F16 and hybrid and stream"],
                       tsan_env(True), TSAN_LIB)
    assert_clean(result)
    # The monitor-thread test and heavy eviction with mapped experts pinned and gathered (pin on, off).
    assert_selection_passed(result, at_least=3, skips=False)
