"""The expert pool end to end on the CPU + RPC testbed: parity, accounting, admission, fail-closed."""
from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest

from pyllamapool.run.decode import run_context
from pyllamapool.binding.llama import Context, Model
from pyllamapool.binding.pool import PoolConfig, PoolConfigError, Policy, parse_layer_profile
from pyllamapool.native.tools import tool_path
from rpc_fault import AllocRefusingProxy
from pyllamapool.run.testmodel import EXPERT_TYPES, ModelSpec, StreamSpec, block_size, token_stream

SPEC = ModelSpec()


def decode(model: Model, stream, pool: PoolConfig | None = None, n_prompt: int = 8, **ctx_args):
    """Teacher-forced greedy run: (result, counters, per-pool counters, infos, status, ctx logs)."""
    ctx = Context(model, pool=pool, **ctx_args)
    result = run_context(ctx, stream[:n_prompt], 0, teacher_tokens=stream[n_prompt:], keep_logits=True)
    report = ctx.pool_report(per_pool=True)
    status = ctx.pool_status()
    ctx.close()
    return result, report, status, ctx.pool_lines()


def identical(a, b) -> bool:
    return len(a.logits) == len(b.logits) and all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits))


@pytest.fixture(params=["qwen3moe", "qwen2moe", "glm4moe"])
def arch_model(request, make_model):
    return make_model(arch=request.param)


def resident_run(model_path, rpc_server, stream, n_prompt: int = 8):
    """The stock path with every expert resident on the same (RPC) device."""
    model = Model(model_path, n_gpu_layers=99, rpc=[rpc_server.endpoint])
    ref, *_ = decode(model, stream, n_prompt=n_prompt)
    model.close()
    return ref


@pytest.fixture
def resident_reference(arch_model, rpc_server, stream):
    return resident_run(arch_model, rpc_server, stream)


def test_pool_decode_is_bit_identical_to_the_resident_stock_path(arch_model, rpc_server, stream, resident_reference):
    model = Model(arch_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    for slots in (4, 6, 8, 16):  # 4 = top-k: every step evicts heavily
        result, report, status, _ = decode(model, stream, PoolConfig(mode="copy", slots=slots, device_mib=65536))
        assert status.enabled and status.actual_slots == slots
        assert identical(result, resident_reference), f"{slots} slots changed the logits"
        c = report.counters
        assert c.hits + c.misses == c.lookups
        assert c.evictions <= c.misses
        assert (c.evictions > 0) == (slots < SPEC.n_expert)  # 4 slots (= top-k) evict on nearly every step
        # copy_bytes = sum of the bytes of missed experts, pool by pool
        for info, pc in zip(report.pools, report.pool_counters):
            assert pc.copy_bytes == pc.misses * info.slot_bytes
        assert c.copy_bytes == sum(pc.copy_bytes for pc in report.pool_counters)
    model.close()


def test_a_bank_on_rpc_is_served_by_the_hosts_policy_bit_identically(arch_model, rpc_server, stream,
                                                                     resident_reference):
    """RPC forwards GGML_OP_MOE_FETCH but cannot read the host's experts in place, so the host serves
    the bank: the pool's policy runs over (layer, expert), and a layer's misses take slots that other
    layers' experts held. The logits are the all-resident run's; every miss that found the bank full
    evicted one expert, counted once."""
    model = Model(arch_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    for slots in (4, 6):
        result, report, status, lines = decode(model, stream, PoolConfig(mode="copy", slots=slots, device_mib=65536,
                                                                         bank="on"))
        assert status.enabled and (status.bank, status.bank_reason, status.serve) == ("on", "", "host")
        assert any(" bank=on" in l for l in lines if l.startswith("expert pool status=enabled"))
        c = report.counters
        n_bank = sum({info.layer: info.slots for info in report.pools}.values())
        assert c.lookups == c.hits + c.misses and c.evictions == c.misses - n_bank > 0
        assert identical(result, resident_reference), f"{slots} slots in a bank changed the logits"
    model.close()


def test_with_slots_for_every_expert_the_pool_stops_copying(qwen3_model, rpc_server, stream):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    ctx = Context(model, pool=PoolConfig(slots=SPEC.n_expert, device_mib=65536))
    run_context(ctx, stream[:8], 0, teacher_tokens=stream[8:])
    first = ctx.pool_counters()
    assert first.evictions == 0
    assert first.misses <= SPEC.n_expert * SPEC.n_layer  # each expert copied at most once per layer
    ctx.pool_reset()
    assert ctx.pool_counters().lookups == 0
    ctx.clear()
    run_context(ctx, stream[:8], 0, teacher_tokens=stream[8:])
    second = ctx.pool_counters()
    assert second.lookups > 0 and second.hits == second.lookups
    assert second.misses == 0 and second.copy_bytes == 0
    ctx.close()
    model.close()


@pytest.mark.parametrize("mode", ["copy", "hybrid"])
def test_prefill_bypasses_the_pool_and_leaves_the_decode_set_alone(qwen3_model, rpc_server, stream, mode):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    ctx = Context(model, pool=PoolConfig(slots=8, device_mib=65536, mode=mode))
    run_context(ctx, stream[:1], 0, teacher_tokens=stream[1:20])   # warm the decode set
    before = ctx.pool_counters()
    ctx.decode(stream[20:60])                                      # a 40-token prompt: above the 32 limit
    after = ctx.pool_counters()
    assert after.bypassed_steps == before.bypassed_steps + 1
    assert (after.lookups, after.misses, after.evictions) == (before.lookups, before.misses, before.evictions)
    ctx.close()
    model.close()


def test_status_first_use_and_runtime_lines_match_the_counters(qwen3_model, rpc_server, stream):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    result, report, status, lines = decode(model, stream, PoolConfig(slots=8, device_mib=65536))
    model.close()
    status_line = next(l for l in lines if "status=" in l)
    for key in ("requested_slots=8", "actual_slots=8", "pool_count=12", "limited_by=slots", "alloc=uniform",
                "profile=none", "slots_min=8", "slots_med=8", "slots_max=8", "total_slots=96", "status=enabled",
                "reason=admitted"):
        assert key in status_line
    assert f"bytes={status.bytes}" in status_line
    assert "expert pool first-use=active reason=distinct-experts-within-slots" in lines
    runtime = next(l for l in lines if "runtime" in l)
    fields = dict(kv.split("=") for kv in runtime.split() if "=" in kv)
    c = report.counters
    assert int(fields["hits"]) == c.hits and int(fields["misses"]) == c.misses
    assert int(fields["evictions"]) == c.evictions and int(fields["copy_bytes"]) == c.copy_bytes
    assert abs(float(fields["hit_rate"]) - c.hit_rate) < 1e-4


def decode_sequences(model, pool, seqs, n_prompt: int):
    """Like llama-server with -np len(seqs): one batch of every sequence's first n_prompt tokens,
    then one token of each sequence per step. Returns (per-step logits of every sequence, counters)."""
    n_seq, n_tok = len(seqs), len(seqs[0])
    ctx = Context(model, n_seq_max=n_seq, pool=pool)
    if n_prompt:
        n = n_seq * n_prompt
        ctx.decode_batch([t for s in seqs for t in s[:n_prompt]], list(range(n_prompt)) * n_seq,
                         [q for q in range(n_seq) for _ in range(n_prompt)], [False] * (n - 1) + [True])
    logits = []
    for i in range(n_prompt, n_tok):
        ctx.decode_batch([s[i] for s in seqs], [i] * n_seq, list(range(n_seq)), [True] * n_seq)
        logits.append([ctx.logits(q) for q in range(n_seq)])
    counters = ctx.pool_counters() if pool else None
    ctx.close()
    return logits, counters


def sequences_against_resident(model_path, rpc_server, pool, seqs, n_prompt: int):
    ref_model = Model(model_path, n_gpu_layers=99, rpc=[rpc_server.endpoint])
    ref, _ = decode_sequences(ref_model, None, seqs, n_prompt)
    ref_model.close()
    model = Model(model_path, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    got, counters = decode_sequences(model, pool, seqs, n_prompt)
    model.close()
    return ref, got, counters


def test_two_sequences_in_one_batch_stay_bit_identical(qwen3_model, rpc_server, stream):
    """Like llama-server with -np 2: each step decodes one token of each of two sequences."""
    ref, got, counters = sequences_against_resident(qwen3_model, rpc_server, PoolConfig(slots=8, device_mib=65536),
                                                    [stream[:36], stream[36:72]], n_prompt=4)
    assert counters.steps >= 32 and counters.evictions > 0
    assert len(got) == len(ref) == 32
    for (ra, rb), (ga, gb) in zip(ref, got):
        assert np.array_equal(ra, ga) and np.array_equal(rb, gb)


def test_a_pool_holding_every_expert_serves_batches_wider_than_its_slots(qwen3_model, rpc_server, stream):
    """Like llama-server -np 5: 5 rows x top-4 = 20 lookups per step exceed the 16 slots, but the
    layer has only 16 experts, so every step's distinct experts fit and no step bypasses."""
    ref, got, counters = sequences_against_resident(qwen3_model, rpc_server,
                                                    PoolConfig(slots=SPEC.n_expert, device_mib=65536),
                                                    [stream[i * 14:(i + 1) * 14] for i in range(5)], n_prompt=0)
    assert counters.steps == 14 and counters.bypassed_steps == 0 and counters.hits > 0
    assert len(got) == len(ref) == 14
    for r, g in zip(ref, got):
        assert all(np.array_equal(a, b) for a, b in zip(r, g))


def test_several_contexts_on_one_model_have_their_own_pools(qwen3_model, rpc_server, stream, resident_reference_qwen3):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    c1 = Context(model, pool=PoolConfig(slots=4, device_mib=65536))
    c2 = Context(model, pool=PoolConfig(slots=8, device_mib=65536))
    r1, r2 = [], []
    c1.decode(stream[:8]); c2.decode(stream[:8])
    r1.append(c1.logits()); r2.append(c2.logits())
    for tok in stream[8:]:                      # interleaved: each step one context, then the other
        c1.decode([tok]); r1.append(c1.logits())
        c2.decode([tok]); r2.append(c2.logits())
    assert c1.pool_counters().lookups == c2.pool_counters().lookups
    assert c1.pool_counters().misses > c2.pool_counters().misses
    assert c1.pool_counters().evictions > 0 and c2.pool_counters().evictions > 0
    c1.close(); c2.close(); model.close()
    assert len(r1) == len(r2) == len(resident_reference_qwen3.logits)
    for a, b, ref in zip(r1, r2, resident_reference_qwen3.logits):
        assert np.array_equal(a, ref) and np.array_equal(b, ref)


@pytest.fixture
def resident_reference_qwen3(qwen3_model, rpc_server, stream):
    return resident_run(qwen3_model, rpc_server, stream)


# --------------------------------------------------------------------------------------------
# admission on the testbed


def pool_status(model_path, rpc, pool, **model_args):
    model = Model(model_path, n_gpu_layers=99, rpc=rpc, n_cpu_moe=99, **model_args)
    ctx = Context(model, pool=pool)
    statuses = [ctx.pool_status(i) for i in range(len(rpc))] if len(rpc) > 1 else [ctx.pool_status()]
    lines = ctx.pool_lines()
    ctx.decode([1, 2, 3])
    ctx.decode([4])
    counters = ctx.pool_counters()
    memory = ctx.memory()
    ctx.close()
    model.close()
    return statuses, lines, counters, memory


def test_emulated_small_device_binds_at_the_rail_and_allocation_matches_the_plan(qwen3_model, rpc_server):
    # in use on RPC0: ~1 MiB weights + KV + compute (~5 MiB); 1029 MiB card - 1024 rail = 5 MiB ceiling
    statuses, lines, counters, memory = pool_status(
        qwen3_model, [rpc_server.endpoint], PoolConfig(mode="copy", slots=16, device_mib=1030, rail_mib=1024))
    s = statuses[0]
    assert s.enabled and s.limited_by == "rail" and 4 <= s.actual_slots < 16, s
    assert s.bytes <= s.cap
    pool_rows = [r for r in memory if r.pool]
    assert len(pool_rows) == 1 and pool_rows[0].device.startswith("RPC")
    assert s.bytes <= pool_rows[0].pool <= s.bytes + 12 * 256  # the allocator's alignment padding only
    assert counters.lookups > 0


def test_cap_binds_when_it_is_below_the_rail_budget(qwen3_model, rpc_server):
    # 12 pools x 32 KiB per slot = 384 KiB per slot across the device, and one padding slot per pool:
    # 4 MiB hold 9 slots (+1 padding)
    statuses, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(mode="copy", slots=16, device_mib=65536, cap_mib=4))
    s = statuses[0]
    assert s.enabled and s.limited_by == "cap" and s.actual_slots == 9 and s.bytes <= 4 * 1024 * 1024


def test_no_room_disables_the_pool_and_decode_still_works(qwen3_model, rpc_server):
    statuses, lines, counters, _ = pool_status(
        qwen3_model, [rpc_server.endpoint], PoolConfig(slots=16, device_mib=1024, rail_mib=1024))
    assert not statuses[0].enabled and statuses[0].reason == "no-room"
    assert any("status=disabled reason=no-room" in l for l in lines)
    assert counters.lookups == 0


def test_memory_reserved_for_later_buffers_comes_off_the_cap(qwen3_model, rpc_server):
    """A draft model is loaded after the target context sized its pool: reserve_mib counts its weights
    as in use, so the cap drops by exactly that much and the ceiling stays."""
    plain, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=8, device_mib=4096))
    reserved, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=8, device_mib=4096, reserve_mib=100))
    assert plain[0].enabled and reserved[0].enabled
    assert plain[0].ceiling == reserved[0].ceiling
    assert plain[0].cap - reserved[0].cap == 100 * 2**20
    with pytest.raises(PoolConfigError, match="reserve_mib=-1 is invalid"):
        PoolConfig(slots=8, reserve_mib=-1).validate()


def test_a_rail_below_the_floor_is_raised_with_a_warning(qwen3_model, rpc_server, caplog):
    statuses, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=8, device_mib=65536, rail_mib=100))
    assert statuses[0].enabled
    assert statuses[0].ceiling == (65536 - 1024) * 1024 * 1024
    assert "raised to 1024 MiB" in caplog.text


BATCH_SHAPES = (1, 2, 4, 8, 16, 32, 33, 512)   # tokens per llama_decode; the last two exceed the pool's 32


def decode_in_batches(model: Model, pool: PoolConfig | None, tokens: list[int]):
    """One sequence fed in micro-batches of BATCH_SHAPES tokens: the last logits of each, the counters
    before the batches above the limit, and at the end."""
    ctx = Context(model, n_ctx=1024, n_batch=512, n_ubatch=512, pool=pool)
    logits, before_big, pos = [], None, 0
    for n in BATCH_SHAPES:
        if n > 32 and before_big is None and pool is not None:
            before_big = ctx.pool_counters()
        ctx.decode(tokens[pos:pos + n])
        logits.append(ctx.logits())
        pos += n
    after = ctx.pool_counters() if pool is not None else None
    ctx.close()
    return logits, before_big, after


@pytest.mark.parametrize("mode", ["copy", "hybrid"])
def test_micro_batches_of_every_shape_are_bit_identical_and_big_ones_never_evict(qwen3_model, rpc_server, mode):
    """Decode in micro-batches of 1 to 512 tokens: every batch's logits equal the all-resident run's.
    Batches of up to 32 tokens use the pool: hybrid mode any of them (the CPU computes what the slots
    do not hold), copy mode those whose tokens x top-k fit the slots. Bigger batches take the stock
    path and neither evict nor upload. The counters split lookups by batch size."""
    tokens = token_stream(SPEC, StreamSpec(n_tokens=sum(BATCH_SHAPES), seed=5))
    resident = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint])
    ref, *_ = decode_in_batches(resident, None, tokens)
    resident.close()
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    got, before_big, c = decode_in_batches(model, PoolConfig(slots=8, device_mib=65536, mode=mode), tokens)
    model.close()
    for n, a, b in zip(BATCH_SHAPES, ref, got):
        assert np.array_equal(a, b), f"{mode}: the {n}-token batch changed the logits"
    pooled = [n for n in BATCH_SHAPES if n <= 32 and (mode == "hybrid" or n * SPEC.n_expert_used <= 8)]
    assert c.steps == len(pooled) and c.bypassed_steps == len(BATCH_SHAPES) - len(pooled)
    # 1 | 2-8 | 9-32 | 33+ tokens
    used = [any(n == 1 for n in pooled), any(2 <= n <= 8 for n in pooled), any(9 <= n <= 32 for n in pooled), False]
    assert [n > 0 for n in c.batch_lookups] == used
    assert sum(c.batch_lookups) == c.lookups and sum(c.batch_hits) == c.hits
    assert (c.evictions, c.uploads) == (before_big.evictions, before_big.uploads)


def test_the_batch_limit_comes_from_the_config_or_the_environment(qwen3_model, rpc_server, monkeypatch):
    tokens = token_stream(SPEC, StreamSpec(n_tokens=40, seed=5))
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    steps = {}
    for name, pool, env in (("default", PoolConfig(slots=8, device_mib=65536), None),
                            ("config", PoolConfig(slots=8, device_mib=65536, max_batch=4), None),
                            ("env", PoolConfig(slots=8, device_mib=65536), "4")):
        if env:
            monkeypatch.setenv("LLAMA_MOE_POOL_MAX_BATCH", env)
        ctx = Context(model, pool=pool)
        ctx.decode(tokens[:8])   # 8 tokens: within 32, beyond 4
        ctx.decode(tokens[8:9])
        steps[name] = ctx.pool_counters().steps
        ctx.close()
    monkeypatch.setenv("LLAMA_MOE_POOL_MAX_BATCH", "lots")
    with pytest.raises(PoolConfigError, match="LLAMA_MOE_POOL_MAX_BATCH=lots is invalid"):
        Context(model, pool=PoolConfig(slots=8, device_mib=65536))
    model.close()
    assert steps == {"default": 2, "config": 1, "env": 1}
    with pytest.raises(PoolConfigError, match="max_batch=0 is invalid"):
        PoolConfig(slots=8, max_batch=0).validate()


@pytest.mark.parametrize("mode", ["copy", "hybrid"])
def test_four_sequences_in_one_batch_stay_bit_identical(qwen3_model, rpc_server, stream, mode):
    """Like llama-server with -np 4: each step decodes one token of each of four sequences (copy mode
    pools them when 4 x top-4 fit its 16 slots; hybrid mode whatever its slots)."""
    slots = 16 if mode == "copy" else 6
    ref, got, counters = sequences_against_resident(qwen3_model, rpc_server,
                                                    PoolConfig(slots=slots, device_mib=65536, mode=mode),
                                                    [stream[i * 18:(i + 1) * 18] for i in range(4)], n_prompt=2)
    assert counters.steps >= 16 and counters.hits > 0 and counters.batch_lookups[1] == counters.lookups
    for r, g in zip(ref, got):
        assert all(np.array_equal(a, b) for a, b in zip(r, g))


def test_without_host_experts_on_an_accelerator_the_pool_says_so(qwen3_model, rpc_server):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint])  # experts resident
    ctx = Context(model, pool=PoolConfig(slots=8))
    assert ctx.pool_status().reason == "no-offloaded-experts"
    ctx.close(); model.close()
    model = Model(qwen3_model)                                              # CPU only
    ctx = Context(model, pool=PoolConfig(slots=8))
    assert ctx.pool_status().reason == "no-offloaded-experts"
    ctx.close(); model.close()


# every expert type the testbed makes (the quant types people download among them); with llama.cpp's
# defaults (repack on) the CPU backend repacks several into layouts of its own, and the pool then
# uploads those experts from the model file
def user_type_model(make_model, expert_type: str):
    block = block_size(expert_type)
    wide = {"n_embd": block, "n_ff_exp": block} if block > 128 else {}
    return make_model(expert_type=expert_type, **wide)


@pytest.mark.parametrize("expert_type", EXPERT_TYPES)
def test_default_flags_pool_every_expert_type_bit_identically(make_model, rpc_server, stream, expert_type):
    path = user_type_model(make_model, expert_type)
    # a one-token prompt: every step is decode-sized and pooled. (A bypassed prefill computes its
    # experts with the CPU's repacked kernels, which round differently from the device's, as the
    # stock --n-cpu-moe path does: that run is not comparable with the all-resident one.)
    ref = resident_run(path, rpc_server, stream, n_prompt=1)
    runs = [("copy", True, True), ("copy", False, True),   # llama.cpp's default, and --no-mmap (-lm none)
            ("hybrid", True, False), ("hybrid", True, True)]
    for mode, use_mmap, repack in runs:
        model = Model(path, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99, use_mmap=use_mmap,
                      repack=repack)
        repacked = cpu_repacks_weights(model)
        result, report, status, _ = decode(model, stream, PoolConfig(slots=4, device_mib=65536, mode=mode),
                                           n_prompt=1)
        model.close()
        what = f"{expert_type} {mode} mmap={use_mmap} repacked={repacked}"
        assert status.enabled, f"{what}: {status.reason}"
        assert report.counters.evictions > 0 and report.counters.device_experts > 0, what
        # the pool reads exactly the experts the CPU repacked from the file, and only those
        assert all(info.from_file == repacked for info in report.pools), what
        if mode == "hybrid" and repacked:
            # the CPU computes the misses with its repacked kernels, which round differently from
            # the device's: each expert is what its backend makes of it, close to the resident run
            assert report.counters.cpu_experts > 0, what
            assert all(np.abs(a - b).max() < 1e-2 * (np.ptp(b) + 1e-6) for a, b in zip(result.logits, ref.logits))
        else:
            # copy mode, and hybrid with the CPU's plain kernels, which are the device's here
            assert identical(result, ref), f"{what} changed the logits"


def cpu_repacks_weights(model: Model) -> bool:
    """Whether the model holds weights in a repacked CPU buffer (CPU_REPACK and the like)."""
    probe = Context(model, n_ctx=64)
    rows = probe.memory()
    probe.close()
    return any("REPACK" in r.buffer_type and r.model > 0 for r in rows)


def test_this_cpu_repacks_q4_0_experts(make_model, rpc_server):
    """Guards the test above: if nothing were repacked here, the file path would go untested."""
    model = Model(user_type_model(make_model, "Q4_0"), n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    repacked = cpu_repacks_weights(model)
    model.close()
    assert repacked, "this CPU does not repack Q4_0: the repacked-upload path is not exercised"


# hybrid on RPC: the zero slot (the RPC backend does not skip ids), then the padding
@pytest.mark.parametrize("mode,pad", [("copy", 1), ("hybrid", 2)])
def test_pools_are_padded_past_the_last_usable_slot(qwen3_model, rpc_server, mode, pad):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    ctx = Context(model, pool=PoolConfig(slots=6, device_mib=65536, mode=mode))
    report = ctx.pool_report(per_pool=True)
    status = ctx.pool_status()
    pool_bytes = sum(r.pool for r in ctx.memory())
    ctx.close()
    model.close()
    assert report.pools and all(i.slots == 6 and i.slots_alloc == 6 + pad for i in report.pools)
    # the padding is in the admitted bytes and in what was allocated
    assert status.bytes == sum(i.slots_alloc * i.slot_bytes for i in report.pools)
    assert status.bytes <= pool_bytes <= status.bytes + len(report.pools) * 256


def test_hybrid_layers_whose_device_does_not_skip_ids_say_they_use_the_zero_slot(qwen3_model, rpc_server, stream):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    *_, lines = decode(model, stream, PoolConfig(slots=6, device_mib=65536, mode="hybrid"))
    model.close()
    line = next(l for l in lines if l.startswith("expert pool layers mode=hybrid reason=zero-slot"))
    assert f"count={SPEC.n_layer}" in line


def test_a_request_below_top_k_says_so_however_much_room_there_is(qwen3_model, rpc_server):
    statuses, lines, counters, _ = pool_status(qwen3_model, [rpc_server.endpoint],
                                               PoolConfig(slots=SPEC.n_expert_used - 1, device_mib=65536))
    assert not statuses[0].enabled and statuses[0].reason == "below-top-k"
    assert any("status=disabled reason=below-top-k" in l for l in lines)
    assert counters.lookups == 0


@pytest.mark.parametrize("pool,needle", [
    (PoolConfig(slots=(4, 4), device_mib=65536), "--moe-expert-cache has 2 values but the model uses 1 device"),
    (PoolConfig(slots=4, device_mib=(65536, 65536, 65536)), "device_mib has 3 values but the model uses 1 device"),
])
def test_per_device_lists_must_match_the_device_count(qwen3_model, rpc_server, caplog, pool, needle):
    statuses, *_ = pool_status(qwen3_model, [rpc_server.endpoint], pool)
    assert not statuses[0].enabled and statuses[0].reason == "invalid-config"
    assert needle in caplog.text


def test_a_device_size_list_from_the_environment_must_match_too(qwen3_model, rpc_server, caplog, monkeypatch):
    monkeypatch.setenv("LLAMA_MOE_POOL_DEVICE_MIB", "65536,65536")
    statuses, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=4))
    assert statuses[0].reason == "invalid-config"
    assert "device_mib has 2 values but the model uses 1 device" in caplog.text


def test_a_second_context_on_the_model_counts_the_first_ones_pool(qwen3_model, rpc_server):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    tight = PoolConfig(slots=-1, device_mib=1040, rail_mib=1024)   # a 16 MiB ceiling
    first = Context(model, pool=tight)
    second = Context(model, pool=tight)
    s1, s2 = first.pool_status(), second.pool_status()
    first.close()
    third = Context(model, pool=tight)
    s3 = third.pool_status()
    second.close(); third.close(); model.close()
    assert s1.enabled and s1.bytes > 0
    # the second context sees the first one's pool (and its buffers) as memory in use
    assert s2.cap <= s1.cap - s1.bytes
    # once the first context is gone, its memory is free again for the next one
    assert s3.cap > s2.cap


def test_a_draft_context_gets_no_pool_and_the_target_keeps_its_own(qwen3_model, rpc_server):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    target = Context(model, pool=PoolConfig(slots=8, device_mib=65536))
    draft = Context(model, pool=PoolConfig(slots=8, device_mib=65536), draft_of=target)
    assert target.pool_status().enabled
    assert not draft.pool_status().enabled and draft.pool_status().reason == "draft-context"
    assert any("status=disabled reason=draft-context" in l for l in draft.pool_lines())
    draft.close(); target.close(); model.close()


@pytest.mark.parametrize("var,value", [("LLAMA_MOE_POOL_CAP_MIB", "0"), ("LLAMA_MOE_POOL_RAIL_MIB", "lots"),
                                       ("LLAMA_MOE_POOL_DEVICE_MIB", "-4"), ("LLAMA_MOE_POOL_POLICY", "mru"),
                                       ("LLAMA_MOE_POOL_GATE", "on"), ("LLAMA_MOE_POOL_MODE", "turbo"),
                                       ("LLAMA_MOE_POOL_UPLOADS", "fast"), ("LLAMA_MOE_POOL_STAGING_MIB", "0"),
                                       ("LLAMA_MOE_POOL_PREFETCH", "always"), ("LLAMA_MOE_POOL_BANK", "shared")])
def test_bad_environment_values_are_refused_naming_the_variable(qwen3_model, monkeypatch, var, value):
    """The Python layer and llama.cpp's tools (common) read the same knobs, and refuse the same values
    before anything is loaded; libllama itself reads no environment."""
    monkeypatch.setenv(var, value)
    with pytest.raises(PoolConfigError, match=f"{var}={value} is invalid"):
        PoolConfig(slots=8).with_environment()
    result = subprocess.run([str(tool_path("llama-server")), "-m", str(qwen3_model), "-mec", "8"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and var in result.stderr and repr(value)[1:-1] in result.stderr
    if var == "LLAMA_MOE_POOL_POLICY":
        assert "expected lru or adaptive" in result.stderr
    if var == "LLAMA_MOE_POOL_GATE":
        assert "expected off, yield or auto" in result.stderr
    if var == "LLAMA_MOE_POOL_UPLOADS":
        assert "expected stream or inline" in result.stderr
    if var == "LLAMA_MOE_POOL_PREFETCH":
        assert "expected auto, off or on" in result.stderr
    if var == "LLAMA_MOE_POOL_BANK":
        assert "expected off or on" in result.stderr


def test_the_default_policy_is_adaptive_and_lru_stays_selectable(qwen3_model, rpc_server, monkeypatch):
    statuses, lines, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=8, device_mib=65536))
    assert statuses[0].policy == "adaptive" and "policy=adaptive" in lines[0]
    statuses, lines, *_ = pool_status(qwen3_model, [rpc_server.endpoint],
                                      PoolConfig(slots=8, device_mib=65536, policy="lru"))
    assert statuses[0].policy == "lru" and "policy=lru" in lines[0]
    monkeypatch.setenv("LLAMA_MOE_POOL_POLICY", "lru")
    statuses, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=8, device_mib=65536))
    assert statuses[0].policy == "lru"


def test_environment_knobs_are_read_when_the_config_leaves_them_unset(qwen3_model, rpc_server, monkeypatch):
    monkeypatch.setenv("LLAMA_MOE_POOL_DEVICE_MIB", "65536")
    monkeypatch.setenv("LLAMA_MOE_POOL_CAP_MIB", "4")
    statuses, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=16))
    assert statuses[0].limited_by == "cap"


def test_weighted_profile_shares_the_same_bytes(qwen3_model, rpc_server, tmp_path):
    profile = tmp_path / "profile.txt"
    profile.write_text("blk.0 0.5\nblk.1 1\nblk.2 2\nblk.3 4\nbogus line\n")
    statuses, lines, _, _ = pool_status(qwen3_model, [rpc_server.endpoint],
                                        PoolConfig(mode="copy", slots=8, device_mib=65536, profile=profile))
    s = statuses[0]
    assert s.enabled and s.alloc == "weighted" and s.profile == str(profile)
    assert s.slots_min == 4 and s.slots_max == 16 and s.slots_min < s.slots_med
    assert s.bytes <= (8 + 1) * 12 * 128 * 128 * 2  # the uniform plan's bytes, padding included
    equal = tmp_path / "equal.txt"
    equal.write_text("".join(f"blk.{i} 3\n" for i in range(4)))
    statuses_eq, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(mode="copy", slots=8, device_mib=65536, profile=equal))
    statuses_u, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(mode="copy", slots=8, device_mib=65536))
    assert (statuses_eq[0].bytes, statuses_eq[0].total_slots) == (statuses_u[0].bytes, statuses_u[0].total_slots)


def test_a_profile_is_read_into_layer_weights_and_its_bad_lines_weigh_one():
    weights, problems = parse_layer_profile("# weights\nblk.2 2.5  # hot\nblk.0 -1\nblk.x 3\nblk.1 0.5 extra\n"
                                            "blk.3 1e39\r\nblk.4 1e-50\n\nblk.2 4\n")
    assert weights == [1.0, 1.0, 4.0, 1.0, 1.0]  # listed again: the last weight wins; blk.1 was ignored
    assert [p.split(":")[0] for p in problems] == ["line 3", "line 4", "line 5", "line 6", "line 7", "line 9"]
    assert "listed again" in problems[-1] and "\\r" not in problems[4]
    assert parse_layer_profile("# nothing\n") == ([1.0], [])


def test_the_pool_takes_layer_weights_not_a_file_name(qwen3_model, rpc_server, tmp_path):
    # libllama reads no profile file: a profile named without its weights is refused, not ignored
    class NameOnly(PoolConfig):
        def to_c(self, ffi, keep, model_path=None):
            params = super().to_c(ffi, keep, model_path)
            params.layer_weights, params.n_layer_weights = ffi.NULL, 0
            return params

    profile = tmp_path / "profile.txt"
    profile.write_text("blk.0 2\n")
    statuses, lines, _, _ = pool_status(qwen3_model, [rpc_server.endpoint],
                                        NameOnly(mode="copy", slots=8, device_mib=65536, profile=profile))
    assert not statuses[0].enabled and statuses[0].reason == "invalid-config"
    named, *_ = pool_status(qwen3_model, [rpc_server.endpoint],
                            PoolConfig(mode="copy", slots=8, device_mib=65536, profile=profile))
    assert named[0].enabled and named[0].alloc == "weighted" and named[0].profile == str(profile)


def test_a_profile_can_come_from_the_environment(qwen3_model, rpc_server, tmp_path, monkeypatch):
    profile = tmp_path / "profile.txt"
    profile.write_text("blk.0 0.5\nblk.1 1\nblk.2 2\nblk.3 4\n")
    by_config, *_ = pool_status(qwen3_model, [rpc_server.endpoint],
                                PoolConfig(slots=8, device_mib=65536, profile=profile))
    monkeypatch.setenv("LLAMA_MOE_POOL_PROFILE", str(profile))
    by_env, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=8, device_mib=65536))
    assert by_env[0].alloc == "weighted" and by_env[0].profile == str(profile)
    assert by_env[0] == by_config[0]


def test_the_default_rail_is_2879_mib(qwen3_model, rpc_server):
    def cap(rail_mib=None):
        statuses, *_ = pool_status(qwen3_model, [rpc_server.endpoint],
                                   PoolConfig(slots=16, device_mib=4096, rail_mib=rail_mib))
        return statuses[0].cap

    default = cap()
    assert default == cap(2879)
    assert default - cap(2880) == 2**20


def test_pool_stats_add_a_line_per_pool_at_teardown(qwen3_model, rpc_server, stream, monkeypatch):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    *_, lines = decode(model, stream[:24], PoolConfig(slots=6, device_mib=65536))
    assert any("expert pool runtime" in l for l in lines)
    assert not [l for l in lines if "expert pool pool=" in l]
    monkeypatch.setenv("GGML_MOE_POOL_STATS", "1")
    _, report, _, lines = decode(model, stream[:24], PoolConfig(slots=6, device_mib=65536))
    model.close()
    per_pool = [l for l in lines if "expert pool pool=" in l]
    assert len(per_pool) == len(report.pools) == 12
    for info, pc, line in zip(report.pools, report.pool_counters, per_pool):
        for field in (f"pool={info.tensor} ", f"slots={info.slots} ", f"hits={pc.hits} ", f"misses={pc.misses} ",
                      f"evictions={pc.evictions} ", f"copy_bytes={pc.copy_bytes}"):
            assert field in line, (field, line)


def test_two_devices_have_two_ledgers_and_per_device_requests(qwen3_model, rpc_servers):
    servers = rpc_servers(2)
    statuses, lines, counters, memory = pool_status(
        qwen3_model, [s.endpoint for s in servers], PoolConfig(slots=(8, 4), device_mib=65536))
    names = [s.device for s in statuses]
    assert len(set(names)) == 2 and all(n.startswith("RPC") for n in names)
    assert [s.actual_slots for s in statuses] == [8, 4]
    assert sum("status=enabled" in l for l in lines) == 2
    assert [l.split("device=")[1] for l in lines if "status=" in l] == names
    assert {r.device for r in memory if r.pool} == set(names)


def test_two_devices_of_different_sizes_are_sized_separately(qwen3_model, rpc_servers):
    servers = rpc_servers(2)
    # a roomy card and a tight one: each is sized from its own ledger
    statuses, *_ = pool_status(qwen3_model, [s.endpoint for s in servers],
                               PoolConfig(slots=16, device_mib=(65536, 1028), rail_mib=1024))
    big, small = statuses
    assert big.enabled and big.limited_by == "slots" and big.actual_slots == 16
    assert small.enabled and small.limited_by == "rail" and small.ceiling == 4 * 1024 * 1024
    assert small.actual_slots < 16
    assert small.bytes <= small.cap < big.cap


def test_the_cap_is_shared_across_devices_in_proportion_to_their_budgets(qwen3_model, rpc_servers):
    servers = rpc_servers(2)
    statuses, *_ = pool_status(qwen3_model, [s.endpoint for s in servers],
                               PoolConfig(slots=16, device_mib=(8192, 4096), rail_mib=1024, cap_mib=4))
    big, small = statuses
    assert big.limited_by == "cap" and small.limited_by == "cap"
    assert big.cap + small.cap <= 4 * 1024 * 1024
    assert big.cap > small.cap


def test_auto_size_fills_what_the_ledger_allows(qwen3_model, rpc_server):
    statuses, lines, counters, _ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=-1, device_mib=65536))
    roomy = statuses[0]
    assert roomy.enabled and roomy.requested_slots == -1 and roomy.actual_slots == SPEC.n_expert
    assert any("requested_slots=-1" in l for l in lines) and counters.lookups > 0
    statuses, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=-1, device_mib=65536, cap_mib=4))
    capped = statuses[0]
    assert capped.enabled and capped.limited_by == "cap" and 0 < capped.actual_slots < SPEC.n_expert


# --------------------------------------------------------------------------------------------
# config validation and the policy on its own


@pytest.mark.parametrize("config,needle", [
    (PoolConfig(slots=-2), "slots"), (PoolConfig(slots=(8, -3)), "-3"), (PoolConfig(slots=8, cap_mib=0), "cap_mib"),
    (PoolConfig(slots=8, rail_mib=-1), "rail_mib"), (PoolConfig(slots=8, profile="/no/such/profile"), "does not exist"),
    (PoolConfig(slots=tuple(range(17))), "1 to 16"), (PoolConfig(slots=8, policy="fifo"), "adaptive, lru"),
    (PoolConfig(slots=8, gate="on"), "off, yield"), (PoolConfig(slots=8, prefetch="always"), "auto, off, on"),
])
def test_bad_pool_configs_are_rejected_in_python(config, needle):
    with pytest.raises(PoolConfigError, match=needle):
        config.validate()


def test_policy_replay_api_reports_misses_and_refuses_overfull_steps():
    policy = Policy(n_expert=8, n_slots=4)
    slots, missed = policy.step([1, 2, 1, 3])
    assert missed == [True, True, True, True] and slots[0] == slots[2]
    slots, missed = policy.step([1, 5])
    assert missed == [False, True]
    assert policy.step([0, 1, 2, 3, 4]) is None
    c = policy.counters()
    assert (c.lookups, c.hits, c.misses) == (5, 1, 4)


# --------------------------------------------------------------------------------------------
# the live pool and its policy replayed offline agree exactly


@pytest.mark.parametrize("slots,policy", [(4, None), (6, None), (10, None), (6, "lru")])
def test_replaying_a_recorded_trace_gives_the_live_pool_counters(qwen3_model, rpc_server, stream, slots, policy):
    from pyllamapool.lab.policies import adaptive, recency
    from pyllamapool.lab.replay import replay_product
    from pyllamapool.run.trace import PoolTraceRecorder, expert_bytes_from_gguf

    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    ctx = Context(model, pool=PoolConfig(mode="copy", slots=slots, device_mib=65536, policy=policy))
    recorder = PoolTraceRecorder(ctx)
    ctx.decode(stream[:8])                        # prefill: bypassed, not seen
    for tok in stream[8:]:
        ctx.decode([tok])
        recorder.end_step()
    live = ctx.pool_counters()
    recorder.detach()
    ctx.close()
    model.close()
    trace = recorder.trace(SPEC.n_expert, SPEC.n_expert_used, expert_bytes_from_gguf(qwen3_model))
    replay = replay_product(trace, slots, policy or "adaptive")
    assert (replay.counters.lookups, replay.counters.hits, replay.counters.misses, replay.counters.evictions,
            replay.counters.copy_bytes) == (live.lookups, live.hits, live.misses, live.evictions, live.copy_bytes)
    assert np.array_equal(replay.miss, trace.miss)
    # and an independent reference: the policy re-derived in Python predicts every live miss
    assert live.evictions > 0
    for li, layer in enumerate(trace.layers):
        record: list = []
        (recency if policy == "lru" else adaptive)(trace.ids[:, li, :].tolist(), slots, SPEC.n_expert, record=record)
        assert np.array_equal(np.array([r.miss for r in record], bool), trace.miss[:, li, :]), f"layer {layer}"


def test_a_trace_recorded_with_prefetch_carries_the_predictions_the_pool_scored(qwen3_model, rpc_server, stream,
                                                                               tmp_path):
    """The routing observer reports, with each hybrid step, what the previous layer's step predicted
    for it; a trace keeps those predictions (and round-trips them through its file), and the lab
    scores them exactly as the pool did, layer by layer."""
    from pyllamapool.lab import prefetch
    from pyllamapool.run.trace import PoolTraceRecorder, Trace

    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    ctx = Context(model, pool=PoolConfig(mode="hybrid", slots=4, device_mib=65536, prefetch="on"))
    recorder = PoolTraceRecorder(ctx)
    for tok in stream:
        ctx.decode([tok])
        recorder.end_step()
    per_pool = ctx.pool_report(per_pool=True)
    recorder.detach()
    ctx.close()
    model.close()
    trace = Trace.load(recorder.trace(SPEC.n_expert, SPEC.n_expert_used).save(tmp_path / "t.npz"))
    assert trace.predicted is not None and trace.predicted.shape == trace.ids.shape
    # the first pooled layer has no layer before it: nothing is predicted for it
    assert (trace.predicted[:, 0] == -1).all() and (trace.predicted[:, 1:] >= 0).all()
    scored = prefetch.scores(trace)
    for info, c in zip(per_pool.pools, per_pool.pool_counters):
        s = scored[info.layer]
        assert (s.predicted, s.used, s.lookups) == (c.predicted, c.predicted_used, c.predicted_lookups), info.tensor
    assert prefetch.recorded(trace, 1) and all(len(row) == SPEC.n_expert_used for row in prefetch.recorded(trace, 1))


# --------------------------------------------------------------------------------------------
# other expert layouts from llama.cpp's own test-llama-archs: fused gate_up experts with per-expert
# scales (cohere2moe), per-expert biases and scales (gpt-oss). Its models have two experts, which
# leaves a pool nothing to evict; they are widened to eight, top-k stays two.


@pytest.mark.parametrize("arch, weights, extras", [
    ("cohere2moe", {"ffn_gate_up_exps", "ffn_down_exps"}, {"ffn_down_exps.scale"}),
    ("gpt-oss", {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"},
     {f"ffn_{w}_exps.{k}" for w in ("gate", "up", "down") for k in ("bias", "scale")}),
])
def test_expert_biases_and_scales_travel_with_their_weights(archs_model, rpc_server, arch, weights, extras):
    import gguf

    from pyllamapool.run.trace import expert_bytes_from_gguf

    path = archs_model(arch)
    layer = 1
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors if re.search(r"_exps\.(weight|bias|scale)$", t.name)}
    assert {n.split(".", 2)[2] for n in tensors if n.startswith(f"blk.{layer}.")} == \
        {w + ".weight" for w in weights} | extras
    stream = [(7 * i) % 97 + 3 for i in range(48)]
    ref = resident_run(path, rpc_server, stream)
    model = Model(path, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    result, report, status, _ = decode(model, stream, PoolConfig(slots=3, device_mib=65536))
    model.close()
    assert status.enabled
    # one pool per weight; a slot carries the weight's bias and scale, so a pooled layer reads no
    # host expert tensor
    pools = {i.tensor: i for i in report.pools if i.layer == layer}
    assert set(pools) == {f"blk.{layer}.{w}.weight" for w in weights}
    for name, info in pools.items():
        stem = name[: -len(".weight")]
        assert info.slot_bytes == sum(int(t.n_bytes) // int(t.shape[-1]) for n, t in tensors.items()
                                      if n.startswith(stem + "."))
        assert info.slot_bytes == expert_bytes_from_gguf(path)[layer][stem.split(".", 2)[2]]
    assert report.counters.evictions > 0
    assert identical(result, ref)


def test_a_failed_allocation_releases_every_pool_and_decode_goes_on(qwen3_model, rpc_servers, caplog):
    """The second device refuses the pool's buffer as a device out of memory does (a proxy in front of
    its RPC server answers that one allocation itself): the first device's pool is released too."""
    first, second = rpc_servers(2)
    proxy = AllocRefusingProxy(second.endpoint)
    try:
        model = Model(qwen3_model, n_gpu_layers=99, rpc=[first.endpoint, proxy.endpoint], n_cpu_moe=99)
        probe = Context(model, pool=PoolConfig(slots=8, device_mib=65536))
        planned = probe.pool_status(1)
        probe.close()
        assert planned.enabled and planned.bytes > 0
        proxy.refuse = lambda size: size == planned.bytes
        ctx = Context(model, pool=PoolConfig(slots=8, device_mib=65536))
        status = ctx.pool_status()
        assert proxy.refused == [planned.bytes]
        assert not status.enabled and status.reason == "alloc-failed"
        assert not any(r.pool for r in ctx.memory())
        assert "all pool memory released" in caplog.text and planned.device in caplog.text
        ctx.decode([1, 2, 3])
        ctx.decode([4])
        assert ctx.pool_counters().lookups == 0
        ctx.close()
        model.close()
    finally:
        proxy.close()


# --------------------------------------------------------------------------------------------
# the admission gate


def recorded_run(model, tokens, pool: PoolConfig, keep_logits: bool = False):
    """Decode `tokens` one by one after an 8-token prefill, recording routing for every step (the
    eval callback sees gated steps too, which the pool's own observer does not)."""
    from pyllamapool.run.trace import TraceRecorder

    recorder = TraceRecorder()
    ctx = Context(model, pool=pool, observe=recorder.wants, observer=recorder)
    recorder.enabled = False
    ctx.decode(tokens[:8])
    recorder.enabled = True
    logits = []
    for tok in tokens[8:]:
        ctx.decode([tok])
        recorder.end_step()
        if keep_logits:
            logits.append(ctx.logits().copy())
    counters, status = ctx.pool_counters(), ctx.pool_status()
    ctx.close()
    return recorder.trace(SPEC.n_expert, SPEC.n_expert_used), counters, status, logits


@pytest.fixture
def churn():
    """Tokens drawn uniformly: no topic, so routing spreads over every expert."""
    return np.random.default_rng(0).integers(0, SPEC.n_vocab, size=300).tolist()


def test_under_churn_the_gate_stands_layers_down_and_replays_exactly(qwen3_model, rpc_server, churn):
    from pyllamapool.lab.replay import replay_product
    from pyllamapool.run.trace import expert_bytes_from_gguf

    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    _, ungated, *_ = recorded_run(model, churn, PoolConfig(mode="copy", slots=6, device_mib=65536))
    trace, gated, status, _ = recorded_run(model, churn, PoolConfig(mode="copy", slots=6, device_mib=65536, gate="yield"))
    model.close()
    assert status.gate == "yield"
    assert ungated.misses > ungated.hits  # the pool moves more than it serves: churn
    assert gated.gate_closures > 0 and gated.gated_steps > 0
    assert gated.copy_bytes < 0.5 * ungated.copy_bytes
    trace.bytes_per_expert = expert_bytes_from_gguf(qwen3_model)
    replay = replay_product(trace, 6, gate=True)
    keys = ("lookups", "hits", "misses", "evictions", "copy_bytes", "gated_steps", "gate_closures")
    assert {k: getattr(replay.counters, k) for k in keys} == {k: getattr(gated, k) for k in keys}
    # per layer, what the gate lets the pool lose is bounded: the fill, and one window per closure
    # plus the one still open
    for c in replay.per_layer.values():
        assert c.misses - c.hits <= 6 + 4 * 6 * (c.gate_closures + 1)


def test_where_the_gate_closes_every_step_equals_the_stock_path_on_the_backend_that_ran_it(qwen3_model, rpc_server,
                                                                                         churn):
    """Gated steps run the stock --cpu-moe path (experts on the CPU), pooled steps run the experts on the
    device. Both are ggml-cpu kernels on this testbed, so each step equals the stock run's step, and
    the all-resident run's."""
    stream = churn[:160]
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    stock, *_ = decode(model, stream)
    gated, report, status, _ = decode(model, stream, PoolConfig(mode="copy", slots=6, device_mib=65536, gate="yield"))
    model.close()
    c = report.counters
    assert status.gate == "yield" and c.gate_closures > 0 and c.gated_steps > 0 and c.steps > 0
    assert identical(gated, stock)
    assert identical(gated, resident_run(qwen3_model, rpc_server, stream))


def test_the_runtime_line_reports_what_the_gate_did(qwen3_model, rpc_server, churn):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    _, report, status, lines = decode(model, churn, PoolConfig(mode="copy", slots=6, device_mib=65536, gate="yield"))
    model.close()
    c = report.counters
    assert status.gate == "yield" and c.gate_closures > 0 and c.gated_steps > 0
    runtime = [l for l in lines if "expert pool runtime" in l]
    assert len(runtime) == 1
    assert f" gated_steps={c.gated_steps} " in runtime[0] and f" gate_closures={c.gate_closures} " in runtime[0]


def test_a_closed_gate_cools_down_32_steps_doubling_after_each_failed_probe_up_to_1024():
    """Uniform routing over 64 experts with 4 slots: every probe fails, so every reopening closes again."""
    rng = np.random.default_rng(0)
    policy = Policy(64, 4, "lru", gate=True)
    closed, run, lookups_before_first = [], 0, None
    for _ in range(12000):
        if policy.feed([int(rng.integers(64))]) is None:
            if lookups_before_first is None:
                lookups_before_first = policy.counters().lookups
            run += 1
        elif run:
            closed.append(run)
            run = 0
    assert closed[:7] == [32, 64, 128, 256, 512, 1024, 1024]
    assert set(closed[6:]) == {1024}
    # it closes only once the pool is full and a window of 4 x slots lookups has been judged
    assert lookups_before_first >= 4 + 4 * 4
    assert policy.counters().gate_closures == len(closed) + (run > 0)


def test_where_the_pool_pays_the_gate_never_closes_and_parity_holds(qwen3_model, rpc_server, stream):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    _, off, _, ref = recorded_run(model, stream, PoolConfig(slots=10, device_mib=65536, mode="copy"), keep_logits=True)
    _, on, _, got = recorded_run(model, stream, PoolConfig(slots=10, device_mib=65536, gate="yield", mode="copy"),
                                 keep_logits=True)
    model.close()
    assert on.hits > on.misses and on.gate_closures == 0 and on.gated_steps == 0
    assert (on.hits, on.misses, on.copy_bytes) == (off.hits, off.misses, off.copy_bytes)
    assert all(np.array_equal(a, b) for a, b in zip(ref, got)) and len(ref) == len(got) > 0


# --------------------------------------------------------------------------------------------
# hybrid mode: the device computes the experts its slots hold, the CPU the misses


def stock_cpu_moe_run(model_path, rpc_server, stream):
    """Stock --cpu-moe: every routed expert computed by the CPU from the host weights."""
    model = Model(model_path, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    ref, *_ = decode(model, stream)
    model.close()
    return ref


def test_hybrid_decode_is_bit_identical_to_stock_and_to_all_resident(arch_model, rpc_server, stream,
                                                                      resident_reference):
    """On the testbed both sides run ggml-cpu kernels: whichever side computes an expert, its output
    is the same bits, so hybrid equals the all-resident run and stock --cpu-moe at any slot count."""
    stock = stock_cpu_moe_run(arch_model, rpc_server, stream)
    assert identical(stock, resident_reference)
    model = Model(arch_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    for slots in (4, 6, 8, 16):
        result, report, status, lines = decode(model, stream, PoolConfig(slots=slots, device_mib=65536, mode="hybrid"))
        assert status.enabled and status.mode == "hybrid"
        assert any("mode=hybrid" in l for l in lines if l.startswith("expert pool status="))
        assert identical(result, resident_reference), f"{slots} slots changed the logits"
        c = report.counters
        # the CPU computed the misses, the device the hits; misses were admitted after serving
        assert c.hits + c.misses == c.lookups and c.hits > 0 and c.misses > 0
        assert (c.evictions > 0) == (slots < SPEC.n_expert)
        assert c.steps > 0
    model.close()


def test_hybrid_keeps_two_sequences_per_batch_bit_identical(qwen3_model, rpc_server, stream):
    ref, got, counters = sequences_against_resident(qwen3_model, rpc_server,
                                                    PoolConfig(slots=8, device_mib=65536, mode="hybrid"),
                                                    [stream[:36], stream[36:72]], n_prompt=4)
    assert counters.steps >= 32 and counters.evictions > 0 and counters.hits > 0
    assert len(got) == len(ref) == 32
    for (ra, rb), (ga, gb) in zip(ref, got):
        assert np.array_equal(ra, ga) and np.array_equal(rb, gb)


@pytest.mark.parametrize("placement", ["cpu", "device"])
def test_without_a_budget_hybrid_admits_what_copy_mode_admits(qwen3_model, rpc_server, stream, placement):
    """The same policy sees the same steps: an expert copy mode copies in before its matmul, hybrid
    computes on the CPU and uploads after (placement cpu), or uploads in the step for the device to
    compute (placement device), so the counts agree. (A one-token prompt: no prefill, so no warm
    start, which copy mode does not have.)"""
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    _, copy_report, _, _ = decode(model, stream, PoolConfig(slots=6, device_mib=65536, mode="copy"), n_prompt=1)
    _, hyb_report, status, _ = decode(model, stream, PoolConfig(slots=6, device_mib=65536, mode="hybrid",
                                                               upload_frac=0, placement=placement), n_prompt=1)
    model.close()
    assert status.mode == "hybrid"
    a, b = copy_report.counters, hyb_report.counters
    assert (a.lookups, a.hits, a.misses, a.evictions, a.copy_bytes) == (b.lookups, b.hits, b.misses, b.evictions,
                                                                      b.copy_bytes)
    # copy mode: the device computes every expert and every miss is an upload; hybrid: the CPU
    # computes the misses
    assert (a.device_experts, a.cpu_experts, a.uploads) == (a.lookups, 0, a.misses)
    if placement == "cpu":
        assert (b.device_experts, b.cpu_experts, b.uploads, b.deferred, b.placed) == (b.hits, b.misses, b.misses, 0, 0)
    else:
        # every miss fits a slot (six slots, top-4, one token): the device computes it in its step
        assert (b.device_experts, b.cpu_experts, b.uploads, b.deferred, b.placed) == (b.lookups, 0, b.misses, 0,
                                                                                      b.misses)


@pytest.mark.parametrize("placement", ["cost", "device"])
def test_misses_placed_on_the_device_keep_hybrid_bit_identical(qwen3_model, rpc_server, stream, placement):
    """Placement changes where a miss is computed, never what: with misses uploaded in their own step
    for the device (every one that fits, or as many as the measured costs ask for) and slots turning
    over, the logits stay the resident run's, and the runtime line counts the placed misses."""
    reference = resident_run(qwen3_model, rpc_server, stream)
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    result, report, _, lines = decode(model, stream, PoolConfig(slots=6, device_mib=65536, mode="hybrid",
                                                               placement=placement))
    model.close()
    c = report.counters
    assert identical(result, reference)
    assert c.evictions > 0 and c.placed <= c.misses and c.device_experts == c.hits + c.placed
    if placement == "device":
        assert c.placed > 0
    runtime = next(l for l in lines if l.startswith("expert pool runtime"))
    assert f"placed={c.placed} " in runtime, runtime


def test_prefetch_keeps_hybrid_bit_identical_and_scores_its_predictions(arch_model, rpc_server, stream,
                                                                       resident_reference):
    """Prefetch changes when an expert's bytes go up, never what is computed: with every predicted
    expert a slot can take uploaded ahead of its step (prefetch on: the RPC device's inline path
    would not prefetch by itself), the logits stay the resident run's. With the CPU computing every
    miss and no upload budget both runs are deterministic, so what the prefetch did shows in the
    counts: experts the device computed that it would not have held."""
    model = Model(arch_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    runs = {pf: decode(model, stream, PoolConfig(slots=4, device_mib=65536, mode="hybrid", placement="cpu",
                                                 upload_frac=0, prefetch=pf)) for pf in ("off", "on")}
    model.close()
    for pf, (result, _, status, _) in runs.items():
        assert status.prefetch == pf and identical(result, resident_reference), pf
    off, on = runs["off"][1], runs["on"][1]
    c, o = on.counters, off.counters
    assert o.predicted == o.prefetched == o.prefetch_hits == 0
    # every layer after the first is predicted for in every step: the prediction names top-k experts
    assert c.predicted_lookups > 0 and 0 < c.predicted_used <= min(c.predicted, c.predicted_lookups)
    assert 0 < c.prefetch_hits <= c.prefetched <= c.uploads
    assert c.hits > o.hits and c.hits + c.misses == o.hits + o.misses
    for info, pc in zip(on.pools, on.pool_counters):
        # the first pooled layer has no layer before it to predict for it
        assert (pc.predicted == 0) == (info.layer == min(i.layer for i in on.pools)), info.tensor
        assert pc.prefetch_wasted_bytes == (pc.prefetched - pc.prefetch_hits) * info.slot_bytes, info.tensor
    line = next(l for l in runs["on"][3] if l.startswith("expert pool prefetch reason=shutdown"))
    assert (f"prefetch=on side=- predicted={c.predicted} predicted_used={c.predicted_used} " in line and
            f"prefetched={c.prefetched} prefetch_hits={c.prefetch_hits} "
            f"prefetch_wasted_bytes={c.prefetch_wasted_bytes}" in line), line
    assert f"precision={c.prefetch_precision:.4f} recall={c.prefetch_recall:.4f}" in line


def test_prefetch_auto_waits_for_uploads_that_run_beside_compute(qwen3_model, rpc_server, stream, monkeypatch):
    """The default, auto, prefetches only where uploads run beside compute (the stream path): on the
    RPC device's inline path a prefetch would hold up the compute queue, so nothing is predicted (the
    graph has no prediction to compute). LLAMA_MOE_POOL_PREFETCH sets it as the other knobs do."""
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    _, report, status, lines = decode(model, stream, PoolConfig(slots=4, device_mib=65536, mode="hybrid"))
    assert status.prefetch == "auto" and status.uploads == "inline"
    assert "uploads=inline prefetch=auto" in next(l for l in lines if l.startswith("expert pool status="))
    assert report.counters.predicted == report.counters.prefetched == 0
    monkeypatch.setenv("LLAMA_MOE_POOL_PREFETCH", "on")
    _, report, status, _ = decode(model, stream, PoolConfig(slots=4, device_mib=65536, mode="hybrid"))
    model.close()
    assert status.prefetch == "on" and report.counters.prefetched > 0


def test_the_upload_budget_defers_uploads_and_parity_holds(qwen3_model, rpc_server, stream):
    """A budget of 0.01% of a token admits fewer uploads than misses: the rest wait (deferred) and
    the CPU keeps computing them, bit-identically. The uploads are those of the first steps, before
    both costs are measured (the pool fills freely then). The budget is measured time: at 1% a host
    loaded enough to make a token 1,600 uploads long let every admission through. (A one-token
    prompt: no warm start; placement cpu, so that no miss is uploaded in its own step.)"""
    reference = resident_run(qwen3_model, rpc_server, stream, n_prompt=1)
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    result, report, status, lines = decode(model, stream, PoolConfig(slots=6, device_mib=65536, mode="hybrid",
                                                                    upload_frac=0.0001, placement="cpu"), n_prompt=1)
    model.close()
    c = report.counters
    assert identical(result, reference)
    assert c.deferred > 0 and 0 < c.uploads < c.misses
    assert c.cpu_experts == c.misses and c.device_experts == c.hits > 0
    runtime = next(l for l in lines if l.startswith("expert pool runtime"))
    for key in ("mode=hybrid", f"cpu_experts={c.cpu_experts}", f"uploads={c.uploads}", f"deferred={c.deferred}",
                f"upload_bytes={c.copy_bytes}", "syncs_per_token="):
        assert key in runtime, (key, runtime)


def test_hybrid_uploads_only_experts_that_pay_back(qwen3_model, rpc_server, stream):
    """With a budget, a full pool takes a missed expert only when its uses over the recent steps beat
    the least used resident's by the pay-back margin (upload ms / CPU ms per expert, at least one
    use): churn that copy mode would upload stays on the CPU. Without a budget (0) every miss is
    uploaded. Either way the logits are the resident run's."""
    reference = resident_run(qwen3_model, rpc_server, stream, n_prompt=1)
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    runs = {}
    for frac in (0.0, 1.0):
        result, report, _, _ = decode(model, stream, PoolConfig(slots=6, device_mib=65536, mode="hybrid",
                                                               upload_frac=frac, placement="cpu"), n_prompt=1)
        assert identical(result, reference), f"upload_frac={frac} changed the logits"
        runs[frac] = report.counters
    model.close()
    every, paying = runs[0.0], runs[1.0]
    assert every.uploads == every.misses and every.evictions > 0
    assert 0 < paying.uploads < every.uploads and paying.evictions < every.evictions
    assert paying.device_experts > 0 and paying.cpu_experts == paying.misses


def test_hybrid_adds_no_host_synchronization_over_stock(qwen3_model, rpc_server, stream):
    """The scheduler counts the host's waits for the device. Hybrid copies the CPU's inputs before
    the device's share is queued, and the CPU's chain then runs without waiting for the device: it
    waits no more often than stock --cpu-moe. The counters report the same waits per token."""
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    waits = {}
    for name, pool in (("stock", None), ("hybrid", PoolConfig(slots=6, device_mib=65536, mode="hybrid")),
                       ("copy", PoolConfig(slots=6, device_mib=65536, mode="copy"))):
        ctx = Context(model, pool=pool)
        run_context(ctx, stream[:8], 0, teacher_tokens=stream[8:24])
        waits[name] = ctx.host_syncs()
        if pool:
            c = ctx.pool_counters()
            # 16 decode steps; hybrid also pools the 8-token prompt (copy: 8 x top-4 > 6 slots)
            assert c.syncs > 0 and c.tokens == (24 if name == "hybrid" else 16)
        ctx.close()
    model.close()
    assert 0 < waits["hybrid"] <= waits["stock"], waits


def test_the_pool_mode_is_hybrid_by_default_and_copy_comes_from_the_config_or_the_environment(
        qwen3_model, rpc_server, monkeypatch):
    statuses, lines, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=8, device_mib=65536))
    assert statuses[0].mode == "hybrid" and "mode=hybrid" in lines[0]
    statuses, lines, *_ = pool_status(qwen3_model, [rpc_server.endpoint],
                                      PoolConfig(slots=8, device_mib=65536, mode="copy"))
    assert statuses[0].mode == "copy" and "mode=copy" in lines[0]
    monkeypatch.setenv("LLAMA_MOE_POOL_MODE", "copy")
    statuses, *_ = pool_status(qwen3_model, [rpc_server.endpoint], PoolConfig(slots=8, device_mib=65536))
    assert statuses[0].mode == "copy"
    with pytest.raises(PoolConfigError, match="mode 'fast' is unknown: expected one of copy, hybrid"):
        PoolConfig(slots=8, mode="fast").validate()


@pytest.mark.parametrize("placement", ["cpu", "cost", "device"])
def test_in_hybrid_mode_the_cpu_computes_exactly_the_misses_not_placed(qwen3_model, rpc_server, stream, placement):
    """The CPU side's ids, seen in the graph: an entry the device's slots hold is skipped (-1), every
    other one is computed on the CPU, and those are exactly the pool's misses that were not placed on
    the device (placement cpu: all of them; device: none, every miss fits the slots here; cost: what
    the measured costs give)."""
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    seen: list[np.ndarray] = []
    ctx = Context(model, pool=PoolConfig(slots=6, device_mib=65536, mode="hybrid", placement=placement),
                  observe=lambda n: n.startswith("ffn_moe_hybrid_cpu_ids"), observer=lambda n, a: seen.append(a.copy()))
    # one-token steps: each entry is a distinct expert of its step, as the counters count them
    run_context(ctx, stream[:1], 0, teacher_tokens=stream[1:40])
    report = ctx.pool_report(per_pool=True)
    ctx.close()
    model.close()
    c = report.counters
    ids = np.concatenate([a.ravel() for a in seen])
    assert len(seen) == c.steps * SPEC.n_layer  # one table lookup per pooled layer and step
    # each layer counted once, though gate, up and down are three pools
    assert len(report.pools) == 3 * SPEC.n_layer
    assert (ids >= 0).sum() == c.cpu_experts == c.misses - c.placed
    assert (ids < 0).sum() == c.device_experts == c.hits + c.placed
    assert c.hits > 0 and c.misses > 0 and c.device_experts + c.cpu_experts == c.lookups
    assert c.placed <= c.uploads
    if placement == "cpu":
        assert c.placed == 0
    elif placement == "device":
        assert c.placed == c.misses


def test_a_layer_made_resident_by_placed_misses_keeps_its_counts_in_copy_modes_graph(qwen3_model, rpc_server,
                                                                                    stream):
    """A full pool whose misses are all placed on the device: once a layer runs copy mode's graph, its
    steps count every expert a hit again (the last split's placed misses are not carried over), the
    hits by batch size stay within the lookups, and the logits stay the resident run's."""
    reference = resident_run(qwen3_model, rpc_server, stream, n_prompt=1)
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    result, report, _, _ = decode(model, stream, PoolConfig(slots=SPEC.n_expert, device_mib=65536, upload_frac=0,
                                                           placement="device"), n_prompt=1)
    model.close()
    c = report.counters
    assert identical(result, reference)
    assert c.placed == c.misses > 0 and c.cpu_experts == 0 and c.evictions == 0
    assert all(h <= n for h, n in zip(c.batch_hits, c.batch_lookups))
    assert sum(c.batch_hits) == c.hits and sum(c.batch_lookups) == c.lookups


def test_a_hybrid_layer_holding_every_expert_runs_copy_modes_graph(qwen3_model, rpc_server, stream):
    """A pool with a slot for every expert: hybrid splits a layer's steps until its last upload has
    landed; then the CPU has nothing left and the layer runs copy mode's graph (slot ids, the pooled
    matmuls alone) for good. The logits stay the resident run's, and a token then waits for the
    device as often as in copy mode."""
    reference = resident_run(qwen3_model, rpc_server, stream, n_prompt=1)
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    full = dict(slots=SPEC.n_expert, device_mib=65536, upload_frac=0, placement="cpu")
    steps: list[dict[int, str]] = []  # per step: layer -> the graph's id tensor for it

    def seen(name, _):
        kind, il = name.rsplit("-", 1)
        if il == "0":  # layers run in order: layer 0 starts a step
            steps.append({})
        steps[-1][int(il)] = kind

    ctx = Context(model, pool=PoolConfig(mode="hybrid", **full), observer=seen,
                  observe=lambda n: n.startswith(("ffn_moe_hybrid_cpu_ids-", "ffn_moe_pool_slots-")))
    result = run_context(ctx, stream[:1], 0, teacher_tokens=stream[1:], keep_logits=True)
    c = ctx.pool_counters()
    ctx.close()
    assert identical(result, reference)
    assert len(steps) == len(stream)  # the prompt's step and one per teacher token
    for il in range(SPEC.n_layer):
        kinds = [step[il] for step in steps]
        switch = kinds.index("ffn_moe_pool_slots") if "ffn_moe_pool_slots" in kinds else len(kinds)
        assert 0 < switch < len(kinds), f"layer {il} never held every expert: {kinds}"
        assert set(kinds[:switch]) == {"ffn_moe_hybrid_cpu_ids"} and set(kinds[switch:]) == {"ffn_moe_pool_slots"}
    # the CPU computed the misses, all before the switch; every expert was uploaded once into a slot
    # of its own, those no step had asked for too, and none was evicted
    assert c.cpu_experts == c.misses > 0 and c.evictions == 0
    assert c.uploads == SPEC.n_expert * SPEC.n_layer

    # the last token's waits, without an observer (which adds its own)
    waits = {}
    for mode in ("hybrid", "copy"):
        ctx = Context(model, pool=PoolConfig(mode=mode, **full))
        assert identical(run_context(ctx, stream[:1], 0, teacher_tokens=stream[1:], keep_logits=True), reference)
        waits[mode] = ctx.host_syncs()
        ctx.close()
    model.close()
    assert 0 < waits["hybrid"] == waits["copy"], waits


def test_hybrid_with_fused_gate_up_experts_is_bit_identical(archs_model, rpc_server, tmp_path):
    """qwen35moe ships ffn_gate_up_exps (one pooled tensor for gate and up, split by views on both
    sides) and shared experts; test-llama-archs gives it optional scales, dropped here so that its
    pools hold weights only."""
    from pyllamapool.run.testmodel import without_tensors

    path = without_tensors(archs_model("qwen35moe"), tmp_path / "qwen35moe-plain.gguf", r"\.(scale|input_scale)$")
    stream = [(7 * i) % 97 + 3 for i in range(48)]
    ref = resident_run(path, rpc_server, stream)
    model = Model(path, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    result, report, status, _ = decode(model, stream, PoolConfig(slots=3, device_mib=65536, mode="hybrid"))
    model.close()
    assert status.mode == "hybrid"
    assert {i.tensor.split(".", 2)[2] for i in report.pools} == {"ffn_gate_up_exps.weight", "ffn_down_exps.weight"}
    c = report.counters
    assert c.cpu_experts > 0 and c.device_experts > 0 and c.evictions > 0
    assert identical(result, ref)


def test_hybrid_warm_starts_from_the_experts_the_prompt_selected(qwen3_model, rpc_server, stream):
    """Prefill runs the stock path; hybrid mode notes the prompt's experts over all its micro-batches
    and queues the most used ones for the fill, which uploads them a few at a time, so the first
    decode token does not wait for them: that token's uploads are what its own step selected (which
    go up as its admissions do), and the tokens after it find the prompt's experts on the device."""
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    ctx = Context(model, n_batch=72, n_ubatch=36, pool=PoolConfig(slots=6, device_mib=65536, mode="hybrid"))
    ctx.decode(stream[:72])  # two micro-batches of 36 tokens, beyond the pool's batches: the stock path
    after_prefill = ctx.pool_counters()
    ctx.decode([stream[0]])
    first = ctx.pool_counters()
    for t in stream[1:9]:
        ctx.decode([t])
    later = ctx.pool_counters()
    ctx.close()
    model.close()
    assert after_prefill.bypassed_steps == 2 and after_prefill.lookups == 0
    assert after_prefill.uploads == 0  # nothing yet: the prompt's last micro-batch counts too
    assert first.steps == 1 and first.hits == 0  # nothing was uploaded before the first token
    assert 0 < first.uploads <= first.misses  # its own selections, no fill beyond them
    assert later.hits > 0 and later.uploads > first.uploads


def test_counters_read_from_another_thread_while_decoding_are_whole_steps(qwen3_model, rpc_server, stream):
    """A monitor thread reads (and once resets) the counters while the main thread decodes: every read
    is a consistent snapshot of finished micro-batches (hits + misses = lookups, one lookup set per
    layer and step, never going backwards between resets), and the last read equals what the
    decoding thread sees at the end."""
    import threading

    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    ctx = Context(model, pool=PoolConfig(slots=6, device_mib=65536, mode="hybrid"))
    reads, done = [], threading.Event()

    def monitor():
        # reads until decoding ends (however slow it runs: under ThreadSanitizer it is); past 20000
        # reads only the newest is kept, which is still in order after the ones before it
        reset_done = False
        while not done.is_set():
            c = ctx.pool_counters()
            if len(reads) < 20000 or reads[-1] is None:
                reads.append(c)
            else:
                reads[-1] = c
            if not reset_done and c.steps >= 10:
                ctx.pool_reset()
                reads.append(None)  # a reset: the counts start again from zero
                reset_done = True

    thread = threading.Thread(target=monitor)
    thread.start()
    try:
        ctx.decode(stream[:1])
        for token in stream[1:60]:
            ctx.decode([token])
    finally:
        done.set()
        thread.join(timeout=60)
    final = ctx.pool_counters()
    ctx.close()
    model.close()
    assert not thread.is_alive() and None in reads and len(reads) > 20
    prev = None
    for c in reads:
        if c is None:
            prev = None
            continue
        assert c.hits + c.misses == c.lookups
        assert c.device_experts + c.cpu_experts == c.lookups
        if prev is not None:
            assert c.lookups >= prev.lookups and c.steps >= prev.steps
        prev = c
    assert final.steps > 0 and final.lookups >= prev.lookups


@pytest.mark.parametrize("mode", ["copy", "hybrid"])
def test_rpc_takes_the_inline_upload_path_and_either_path_is_bit_identical(qwen3_model, rpc_server, stream, mode):
    """RPC has events but no pinned host memory, and its client sends every command on one connection:
    a second backend instance is no second queue, so uploads go inline unless stream is asked for.
    Heavy eviction (slots at top-k) on both paths gives the all-resident logits."""
    resident_reference = resident_run(qwen3_model, rpc_server, stream)
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    runs = {uploads: decode(model, stream, PoolConfig(slots=4, device_mib=65536, mode=mode, uploads=uploads))
            for uploads in (None, "stream")}
    model.close()
    (default, d_report, d_status, _), (streamed, s_report, s_status, _) = runs[None], runs["stream"]
    assert d_status.uploads == "inline" and s_status.uploads == "stream"
    assert d_report.counters.uploads > 0 and s_report.counters.uploads > 0
    assert identical(default, resident_reference) and identical(streamed, resident_reference)


# --------------------------------------------------------------------------------------------
# -mec auto: the pool stands down where decode is faster without it


@pytest.mark.parametrize("mode", ["hybrid", "copy"])
def test_auto_times_both_sides_and_every_step_equals_the_stock_path(qwen3_model, rpc_server, stream, mode):
    """slots="auto" (`-mec auto`): sized as -1, and decode steps are timed on the stock path first,
    then on the pool, whichever way the clock goes. Each step ran one side, so the steps add up, and
    on this testbed both sides are ggml-cpu kernels: every step equals the stock run's."""
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    stock, *_ = decode(model, stream)
    auto, report, status, lines = decode(model, stream, PoolConfig(slots="auto", mode=mode, device_mib=65536))
    model.close()
    c = report.counters
    assert status.enabled and status.gate == "auto" and status.requested_slots == -1 and status.mode == mode
    assert any("gate=auto" in l and "requested_slots=-1" in l for l in lines)
    # every micro-batch the pool serves ran one side: the decode steps, and the 8-token prompt (a
    # batch this small is one the pool serves); stock's are stood-down steps, not bypassed ones
    assert c.stood_down_steps + c.steps == len(stream) - 8 + 1 and c.bypassed_steps == 0, c
    assert c.stood_down_steps >= 10 and c.steps >= 7  # stock's warm-up and sample, then the pool's probe
    verdict = [l for l in lines if re.match(r"expert pool auto=(pool|stock) reason=", l)]
    assert verdict and "pool_ms_per_token=" in verdict[0] and "verdicts=1" in verdict[0]
    shutdown = next(l for l in lines if l.startswith("expert pool auto reason=shutdown"))
    assert f" stood_down_steps={c.stood_down_steps} " in shutdown
    assert identical(auto, stock)


def test_auto_is_only_a_slot_count_of_its_own(qwen3_model):
    assert PoolConfig(slots="auto").slot_list == (-1,) and PoolConfig(slots="auto").gate_asked == "auto"
    assert PoolConfig(slots="auto", gate="off").gate_asked == "off"  # a gate asked for is kept
    with pytest.raises(PoolConfigError, match="'automatic' is invalid"):
        PoolConfig(slots="automatic").validate()
    with pytest.raises(PoolConfigError, match="'auto'"):
        PoolConfig(slots=(8, "auto")).validate()
    result = subprocess.run([str(tool_path("llama-server")), "-m", str(qwen3_model), "-mec", "auto,8"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "invalid slot count 'auto'" in result.stderr + result.stdout



def hot_run(model: Model, stream, pool: PoolConfig):
    """A teacher-forced run of 17 one-token steps: (hits of the first, every step's logits, the pool
    lines). The first step's hits are what the pool held before any step ran."""
    ctx = Context(model, pool=pool)
    ctx.decode([stream[0]])
    hits = ctx.pool_counters().hits
    logits = [ctx.logits()]
    for tok in stream[1:17]:
        ctx.decode([tok])
        logits.append(ctx.logits())
    ctx.close()
    return hits, logits, ctx.pool_lines()


def hot_lines(lines) -> list[str]:
    return [line for line in lines if line.startswith("expert pool hotset=")]


@pytest.mark.parametrize("mode", ["copy", "hybrid"])
def test_a_hot_set_file_warm_starts_the_next_run_bit_identically(qwen3_model, rpc_server, stream, tmp_path, mode):
    """The first run starts cold and writes each layer's most used experts at teardown; the next
    starts with them in its slots (its first step hits where the first run's missed), computes the
    same logits, and merges its own uses into the file."""
    path = tmp_path / "hot.txt"
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    pool = PoolConfig(mode=mode, slots=6, device_mib=65536, hotset=path)
    cold_hits, cold, cold_lines = hot_run(model, stream, pool)
    assert hot_lines(cold_lines)[0].startswith("expert pool hotset=cold reason=no-file")
    assert cold_hits == 0
    text = path.read_text()
    header = re.search(r"^\[hotset model=(\S+) slots=(\d+)\]$", text, re.M)
    assert header and header.group(1).startswith("qwen3moe/") and int(header.group(2)) == 4 * 6
    layers = re.findall(r"^blk\.(\d+) (.*)$", text, re.M)
    assert [int(il) for il, _ in layers] == [0, 1, 2, 3]
    uses = [[int(item.split(":")[1]) for item in rest.split()] for _, rest in layers]
    assert all(u == sorted(u, reverse=True) and len(u) >= 6 for u in uses)  # most used first
    assert sum(uses[0]) == 17 * SPEC.n_expert_used  # every selection of every pooled step

    warm_hits, warm, warm_lines = hot_run(model, stream, pool)
    model.close()
    loaded = hot_lines(warm_lines)[0]
    assert loaded.startswith("expert pool hotset=loaded") and " layers=4 experts=24 " in loaded
    assert warm_hits > 0
    assert len(warm) == len(cold) and all(np.array_equal(a, b) for a, b in zip(warm, cold))
    again = [[int(item.split(":")[1]) for item in rest.split()]
             for _, rest in re.findall(r"^blk\.(\d+) (.*)$", path.read_text(), re.M)]
    assert sum(again[0]) == sum(uses[0]) + sum(u // 2 for u in uses[0])  # this run's, plus the last halved
    assert hot_lines(warm_lines)[-1].startswith("expert pool hotset=saved")


def test_a_hot_set_file_keeps_other_models_sections_and_reports_what_it_skipped(qwen3_model, rpc_server, stream,
                                                                                 tmp_path, monkeypatch, caplog):
    """One file serves several models: another model's section is left as it was; a line that does
    not parse is named in a warning and dropped when the file is rewritten; the file can come from
    LLAMA_MOE_POOL_HOTSET; a context that served fewer selections than its pool has slots (a warm-up
    decode, here none at all) leaves the file as it was."""
    path = tmp_path / "hot.txt"
    other = "[hotset model=llama4/Other/123 slots=8]\nblk.0 3:9 1:2\n"
    path.write_text(other + "blk.1 nonsense\n")
    monkeypatch.setenv("LLAMA_MOE_POOL_HOTSET", str(path))
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], cpu_moe=True)
    idle = Context(model, pool=PoolConfig(slots=6, device_mib=65536))
    idle.close()
    assert path.read_text() == other + "blk.1 nonsense\n"
    assert any(line.startswith("expert pool hotset=unchanged reason=short-run") for line in idle.pool_lines())
    hits, _, lines = hot_run(model, stream, PoolConfig(slots=6, device_mib=65536))
    model.close()
    assert hot_lines(lines)[0].startswith("expert pool hotset=cold reason=no-section")
    assert "line 3: `nonsense` is not <expert>:<uses>" in caplog.text
    text = path.read_text()
    assert other in text and "nonsense" not in text and text.count("[hotset ") == 2


@pytest.mark.parametrize("hotset", ["", "."])
def test_a_hot_set_must_be_a_file_path(hotset):
    with pytest.raises(PoolConfigError, match="hotset"):
        PoolConfig(slots=4, hotset=hotset).validate()
