"""The expert pool on a real GPU backend: ggml-vulkan on Mesa's lavapipe (GPU shaders, queues and buffers,
run by the CPU). Needs the Vulkan build beside the CPU one:

    python build.py --target vulkan --only tests --prefix build/vulkan-install

(.ci/run makes it.) Each check runs in a process of its own with that build loaded (tests/vulkan_worker.py)
and compares pooled decode with the stock host-copy path on the same device, bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VULKAN_LIB = ROOT / "build" / "vulkan-install" / "pyllamapool" / "lib"

pytestmark = pytest.mark.skipif(
    not (VULKAN_LIB / "libllama.so").exists(),
    reason="no Vulkan build: python build.py --target vulkan --only tests --prefix build/vulkan-install")


def on_vulkan(check: str, model: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYLLAMAPOOL_", "LLAMA_MOE_POOL_", "GGML_MOE_POOL"))}
    env.update(PYLLAMAPOOL_LIB_DIR=str(VULKAN_LIB), PYTHONPATH=str(ROOT),
               GGML_VK_VISIBLE_DEVICES="0",  # lavapipe is a CPU-type device, which ggml skips otherwise
               # compiled pipelines outlive the test run (the first use of a shape takes a while)
               MESA_SHADER_CACHE_DIR=str(ROOT / "build" / "vulkan" / "mesa-shader-cache"))
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "vulkan_worker.py"), check, str(model)],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("expert_type", ["F16", "Q4_0", "Q4_K"])
def test_pooled_experts_equal_the_host_copy_path_under_heavy_eviction(make_model, expert_type):
    """Quantized MUL_MAT_ID kernels read whole blocks: a pool that read past its last slot, or a slot
    id the kernel took for an expert id, would show here."""
    wide = {"n_embd": 256, "n_ff_exp": 256} if expert_type == "Q4_K" else {}
    r = on_vulkan("parity", make_model(expert_type=expert_type, **wide))
    assert any(d.startswith("Vulkan") for d in r["devices"]), r["devices"]
    assert r["enabled"] and r["device"].startswith("Vulkan"), r
    assert r["misses"] >= 2 * r["steps"] > 0 and r["evictions"] > 0
    assert r["pooled_equals_host_copy"], r
    assert r["resident_equals_host_copy"], r


def test_pinned_host_experts_pool_on_vulkan(qwen3_model):
    """-lm none keeps the host experts in Vulkan's pinned host memory: there the default is the stream
    path, which copies straight from them (no staging), bit-identical to the host-copy path."""
    r = on_vulkan("pinned", qwen3_model)
    assert r["enabled"] and r["evictions"] > 0 and r["uploads_path"] == "stream" and r["uploads"] > 0, r
    assert r["pooled_equals_host_copy"], r


def test_two_sequences_per_batch_on_vulkan(qwen3_model):
    r = on_vulkan("two-sequences", qwen3_model)
    assert r["evictions"] > 0 and r["steps"] > 0, r
    assert r["pooled_equals_host_copy"], r


def test_gate_flips_rebuild_the_graph_and_keep_parity_on_vulkan(qwen3_model):
    r = on_vulkan("gate", qwen3_model)
    assert r["gate_closures"] > 0 and r["gated_steps"] > 0 and r["steps"] > 0, r
    assert r["pooled_equals_host_copy"], r


def test_two_contexts_on_one_model_on_vulkan(qwen3_model):
    r = on_vulkan("two-contexts", qwen3_model)
    assert all(e > 0 for e in r["evictions"]), r
    assert r["pooled_equals_host_copy"], r


def test_hybrid_mode_runs_its_device_side_on_vulkan(make_model):
    # F32 experts: CPU and lavapipe then differ only in summation order
    r = on_vulkan("hybrid", make_model(expert_type="F32"))
    assert r["enabled"] and r["mode"] == "hybrid", r
    assert r["cpu_experts"] > 0 and r["device_experts"] > 0 and r["uploads"] > 0, r
    # measured: 4e-4 on logits of spread 8; an expert counted on both sides, or a padding slot
    # that is not zero, moves logits by a good part of their spread
    assert r["finite"] and r["max_abs_diff"] < 1e-3 * r["logit_std"], r
    assert r["argmax_equal"] >= r["n_steps"] - 1, r


def test_a_prompt_batch_copies_the_experts_the_pool_holds_from_its_slots(qwen3_model):
    """The stock path of a 36-token batch offloads its expert matmuls (GGML_OP_OFFLOAD_MIN_BATCH=1 in
    the worker): resident experts come from the slots, device to device, the rest from the host;
    the logits equal the run without the pool bit for bit, and nothing is evicted."""
    r = on_vulkan("prefill", qwen3_model)
    assert r["bypassed"] == 1 and r["evictions_in_prefill"] == 0, r
    assert r["prefill_device_bytes"] > 0 and r["prefill_host_bytes"] > 0, r
    assert r["pooled_equals_host_copy"], r


def test_the_scheduler_waits_for_vulkans_queued_copies_of_host_memory():
    """Upstream #23321 on a real Vulkan queue: with the CPU's compute buffer in Vulkan's pinned host
    memory, Vulkan copies a host input with a queued command; the next CPU split without inputs is
    given that memory. Before the fix the device read the overwritten value in most runs; it must
    read the first value in every one (the test runs each case ten times)."""
    tool = ROOT / "build" / "vulkan" / "bin" / "test-sched-input-reuse"
    assert tool.exists(), "the Vulkan build lacks test-sched-input-reuse: python build.py --target vulkan ..."
    env = {**os.environ, "GGML_VK_VISIBLE_DEVICES": "0"}
    result = subprocess.run([str(tool)], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Vulkan device" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
    assert "plain: 10 runs, 0 with a wrong result" in result.stdout, result.stdout[-2000:]
    assert "pipelined: 10 runs, 0 with a wrong result" in result.stdout, result.stdout[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_mapped_experts_upload_inline_by_default_and_either_path_equals_the_host_copy_path(make_model):
    """ggml-vulkan has events and a pinned host buffer type, but these experts are mapped from the
    file: both paths would read pageable memory, so the default copies on the compute queue, and
    stream (staged in pinned memory, copied on a queue of its own) is taken when asked for. Copy mode
    is bit-identical to the host-copy path either way. F32 experts, so that hybrid's two sides differ
    only in summation order."""
    r = on_vulkan("uploads", make_model(expert_type="F32"))
    assert r["copy-default"]["path"] == r["copy-inline"]["path"] == r["hybrid-default"]["path"] == "inline", r
    assert r["copy-stream"]["path"] == r["hybrid-stream"]["path"] == "stream", r
    for key in ("copy-default", "copy-inline", "copy-stream"):
        assert r[key]["enabled"] and r[key]["evictions"] > 0 and r[key]["uploads"] > 0, (key, r[key])
        assert r[key]["equals_host_copy"], (key, r[key])
    # hybrid: the same bound as test_hybrid_mode_on_vulkan (the two backends' rounding)
    scale = r["logit_std"]
    for key in ("hybrid-inline", "hybrid-stream"):
        assert r[key]["uploads"] > 0 and r[key]["max_abs_diff"] < 1e-3 * scale, (key, r[key])


def test_prefetched_experts_land_before_lavapipe_computes_them(make_model):
    """Prefetch on Vulkan: with prefetch on, and with auto (which times steps with and without it and
    says which it keeps), the logits stay within the two backends' rounding of the host-copy path (F32
    experts, as in the hybrid test): an expert read before its copy landed would be far outside it."""
    r = on_vulkan("prefetch", make_model(expert_type="F32"))
    for key in ("auto", "on"):
        run = r[key]
        assert run["enabled"] and run["uploads_path"] == "stream" and run["prefetch"] == key, run
        assert run["predicted"] > 0, run
        assert run["finite"] and run["max_abs_diff"] < 1e-3 * r["logit_std"], (key, run)
    assert r["on"]["prefetched"] > 0 and 0 < r["on"]["prefetch_hits"] <= r["on"]["prefetched"], r["on"]
    assert r["auto"]["verdict"].startswith("expert pool prefetch=auto side="), r["auto"]


def test_a_bank_the_host_serves_on_vulkan_equals_the_host_copy_path(qwen3_model):
    """Vulkan runs no GGML_OP_MOE_FETCH: the host's policy serves one bank for the layers, a step's
    misses evicting other layers' experts, on both upload paths and with two sequences a batch, bit
    for bit the host-copy path's; every miss that found the bank full evicted one expert."""
    r = on_vulkan("bank", qwen3_model)
    for key in ("inline", "stream"):
        run = r[key]
        assert run["enabled"] and (run["bank"], run["serve"], run["path"]) == ("on", "host", key), (key, run)
        assert run["evictions"] == run["misses"] - run["bank_slots"] > 0, (key, run)
        assert run["equals_host_copy"], (key, run)
    assert r["two-sequences"]["evictions"] > 0 and r["two-sequences"]["equals_host_copy"], r["two-sequences"]
