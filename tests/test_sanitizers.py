"""The series under AddressSanitizer and UndefinedBehaviorSanitizer. Needs the sanitized build beside the
CPU one:

    python build.py --target cpu --sanitize --prefix build/sanitize-install

(.ci/run makes it.) The ctest runs as built; pooled decode runs as a selection of test_pool.py in a
process of its own with the sanitized libraries (and their RPC server) loaded and the runtimes preloaded
into Python, which is not instrumented. Any report fails the test.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SANITIZED_LIB = ROOT / "build" / "sanitize-install" / "pyllamapool" / "lib"
CTEST = ROOT / "build" / "cpu-sanitize" / "bin" / "test-expert-pool"

pytestmark = pytest.mark.skipif(
    not (SANITIZED_LIB / "libllama.so").exists(),
    reason="no sanitized build: python build.py --target cpu --sanitize --prefix build/sanitize-install")

REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer")


def sanitizer_env(preload: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYLLAMAPOOL_", "LLAMA_MOE_POOL_", "GGML_MOE_POOL"))}
    # Python itself leaks by design at exit: leak checking is for the ctest only
    env["ASAN_OPTIONS"] = f"detect_leaks={0 if preload else 1}:abort_on_error=1:strict_string_checks=1"
    # the ctest ends normally, so leaks are checked at its exit; ggml-rpc's registries live for the process
    env["LSAN_OPTIONS"] = f"suppressions={ROOT / 'tests' / 'lsan.supp'}:print_suppressions=0"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    if preload:
        runtimes = [subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True,
                                   check=True).stdout.strip() for lib in ("libasan.so", "libubsan.so")]
        env["LD_PRELOAD"] = " ".join(runtimes)
        env["PYLLAMAPOOL_LIB_DIR"] = str(SANITIZED_LIB)
        env["PYTHONPATH"] = str(ROOT)
    return env


def assert_clean(result: subprocess.CompletedProcess) -> None:
    out = result.stdout + result.stderr
    found = [r for r in REPORTS if r in out]
    assert result.returncode == 0 and not found, (found, out[-4000:])


def test_the_expert_pool_ctest_is_clean_under_sanitizers():
    result = subprocess.run([str(CTEST)], capture_output=True, text=True, timeout=900, env=sanitizer_env(False))
    assert_clean(result)
    assert " 0 failed" in result.stdout + result.stderr


def test_pooled_decode_is_clean_under_sanitizers():
    """Heavy eviction, repacked experts read from the file, biases and scales, the gate closing and
    reopening, two sequences, two contexts on one model, the all-or-none rollback."""
    selection = ("bit_identical_to_the_resident or every_expert_type and (Q4_0 or Q4_K) or travel or "
                 "gate_closes_every_step or two_sequences or several_contexts or failed_allocation")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                             str(ROOT / "tests" / "test_pool.py"), "-k", selection],
                            capture_output=True, text=True, timeout=1800, cwd=ROOT, env=sanitizer_env(True))
    assert_clean(result)
    assert " passed" in result.stdout and " failed" not in result.stdout


def test_pooled_decode_on_the_lazy_copy_device_is_clean_under_sanitizers():
    """Both modes with their copies and graphs deferred to synchronize: a queued copy whose host
    source was freed before the device read it is a use after free here."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                             str(ROOT / "tests" / "test_lazy_device.py"), "-k", "heavy or two_sequences"],
                            capture_output=True, text=True, timeout=1800, cwd=ROOT, env=sanitizer_env(True))
    assert_clean(result)
    assert " passed" in result.stdout and " failed" not in result.stdout
