"""llama.cpp's own expert cache (`--moe-cache-mib`, upstream since b11480) and the expert pool in one
binary: each works alone, both at once is refused, and both decode bit-identically to stock on the RPC
testbed. benchmarks/upstream.py sets them side by side; its short mode runs here."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyllamapool.run.decode import run_context
from pyllamapool.errors import PyllamapoolError
from pyllamapool.binding.llama import Context, Model
from pyllamapool.binding.moecache import parse_stats
from pyllamapool.binding.pool import PoolConfig
from pyllamapool.native.tools import tool_path

ROOT = Path(__file__).resolve().parent.parent


def greedy(model: Model, stream, **ctx_args):
    ctx = Context(model, **ctx_args)
    result = run_context(ctx, stream[:8], 0, teacher_tokens=stream[8:], keep_logits=True)
    counters = ctx.pool_counters() if ctx_args.get("pool") else None
    ctx.close()
    return result.logits, counters, ctx


def same(a, b) -> bool:
    return len(a) == len(b) > 0 and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def host_experts(qwen3_model, rpc_server):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    yield model
    model.close()


def test_upstream_cache_alone_is_bit_identical_to_stock_and_reports_its_hits(host_experts, stream):
    stock, *_ = greedy(host_experts, stream)
    cached, _, ctx = greedy(host_experts, stream, moe_cache_mib=16)
    assert same(cached, stock)
    stats = ctx.moe_cache_stats()
    assert stats is not None and stats.size_mib > 0 and stats.slots > 0
    # one lookup per (layer, selected expert) per decode step, and a warm cache hits
    assert stats.lookups > 0 and stats.hits > 0 and stats.uploaded_mib > 0
    assert stats.misses > 0 and 0.0 < stats.hit_rate < 1.0


def test_pool_alone_still_runs_beside_upstream_code(host_experts, stream):
    stock, *_ = greedy(host_experts, stream)
    for mode in ("copy", "hybrid"):
        pooled, counters, ctx = greedy(host_experts, stream, pool=PoolConfig(slots=8, mode=mode, device_mib=65536))
        assert same(pooled, stock), mode
        assert counters.lookups > 0 and counters.hits > 0
        assert ctx.moe_cache_stats() is None   # upstream's cache stayed off


def test_both_at_once_is_refused_naming_both_flags(host_experts):
    with pytest.raises(PyllamapoolError, match=r"-mec.*--moe-cache-mib.*cannot be used together"):
        Context(host_experts, pool=PoolConfig(slots=8, device_mib=65536), moe_cache_mib=16)
    # -mec 0 is no pool: upstream's cache alone is fine
    ctx = Context(host_experts, pool=PoolConfig(slots=0), moe_cache_mib=16)
    ctx.close()


@pytest.mark.parametrize("bad", [-1, 1.5, "16", True])
def test_a_bad_cache_size_is_refused_with_the_value(host_experts, bad):
    with pytest.raises(ValueError, match=r"moe_cache_mib=.* is invalid: expected a whole number of MiB >= 0"):
        Context(host_experts, moe_cache_mib=bad)


def test_the_server_lists_both_flags_and_refuses_them_together(tmp_path):
    server = tool_path("llama-server")
    help_text = subprocess.run([str(server), "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "-mec,  --moe-expert-cache" in help_text and "--moe-cache-mib N" in help_text
    both = subprocess.run([str(server), "-m", str(tmp_path / "none.gguf"), "-mec", "8", "--moe-cache-mib", "64"],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode != 0
    assert "--moe-cache-mib and -mec/--moe-expert-cache cannot be used together" in both.stdout + both.stderr


def test_the_cache_log_parser_reads_upstreams_lines():
    lines = ["impl:     RPC0[127.0.0.1:5] MoE cache size =    12.50 MiB for 96.00 MiB of host experts",
             "impl:  4 layers, F16:    16 slots (12.5%)",
             "llama_moe_cache: ubatch <= 8: hits = 30, misses = 10, hit rate = 75.00%, uploaded = 2.50 MiB",
             "llama_moe_cache: ubatch  > 8: hits = 2, misses = 2, hit rate = 50.00%, uploaded = 0.50 MiB"]
    stats = parse_stats(lines)
    assert (stats.size_mib, stats.host_expert_mib, stats.slots) == (12.5, 96.0, 16)
    assert (stats.hits, stats.misses, stats.uploaded_mib) == (32, 12, 3.0)
    assert stats.hit_rate == pytest.approx(32 / 44)
    assert parse_stats(["llama_context: nothing about a cache"]) is None


def test_the_side_by_side_benchmark_runs_in_its_short_mode(tmp_path):
    out = tmp_path / "upstream.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "upstream.py"), "--short", "--json", str(out)],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    # RPC has no device path: the host's policy serves the bank there
    assert [r["design"] for r in rows] == ["stock", "upstream cache", "pool copy", "pool hybrid", "pool bank"]
    assert rows[4]["bank"] == "on" and rows[4]["hit"] > 0
    # equal memory: upstream's cache gets the pool's MiB, rounded up to a whole MiB
    assert rows[1]["cache_mib"] >= rows[2]["pool_mib"] > 0
    assert all(r["parity"] for r in rows), [(r["design"], r["parity"]) for r in rows]
    assert all(r["tps"] > 0 for r in rows)
    assert rows[1]["hit"] > 0 and rows[2]["hit"] > 0
    assert "| upstream cache |" in result.stdout and "| pool hybrid |" in result.stdout
