"""The patch series' own C++ tests, run through ctest in the CPU build."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ctest_expert_pool_passes():
    build = ROOT / "build" / "cpu"
    assert (build / "CTestTestfile.cmake").exists(), "no CPU build: run `python build.py --target cpu`"
    result = subprocess.run(["ctest", "--test-dir", str(build), "-R", "^test-expert-pool$", "--output-on-failure"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "100% tests passed out of 1" in result.stdout
