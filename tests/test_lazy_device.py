"""The expert pool on the lazy-copy test device (tests/ggml-lazy-copy.cpp of the patched tree).

That device behaves as a GPU's queue and DMA engine do: a copy or a graph handed to it runs only
when the host synchronizes it (or waits on one of its events), and reads its source then. A host
buffer the pool reuses before the device read it (a staging buffer, the slot table's host copy), a
slot published before its bytes were queued, or a split that overwrites host memory a queued copy
still has to read, gives a wrong result here, deterministically, where the synchronous RPC device
cannot tell. The device computes with ggml-cpu's kernels, so every run must equal the all-resident
run on the same device bit for bit.

The device has events but no host buffer type, so by default the pool would take the inline upload
path here; these tests ask for the stream path (staging, an upload queue of its own, events), which is
what GPUs take, and the heavy-eviction test runs both.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from pyllamapool.binding.llama import Context, Model, lazy_copy_device
from pyllamapool.binding.pool import PoolConfig
from pyllamapool.run.testmodel import ModelSpec, StreamSpec, token_stream
from pyllamapool.run.trace import PoolTraceRecorder
from test_pool import (BATCH_SHAPES, cpu_repacks_weights, decode, decode_in_batches, decode_sequences,
                       identical, user_type_model)

SPEC = ModelSpec()
MODES = ["copy", "hybrid"]
PATHS = ["stream", "inline"]


def pool(**kw) -> PoolConfig:
    """The pool on the lazy device: an emulated size, stream uploads unless asked otherwise."""
    return PoolConfig(**{"device_mib": 65536, "uploads": "stream", **kw})


@pytest.fixture(scope="module", autouse=True)
def lazy_device():
    try:
        return lazy_copy_device()
    except Exception as exc:  # the device is part of every build: its absence is a failure
        pytest.fail(f"the lazy-copy test device is not available: {exc}")


def on_lazy(path, **args) -> Model:
    return Model(path, n_gpu_layers=99, lazy_copy=True, **args)


def resident(path, stream, n_prompt: int = 8):
    model = on_lazy(path)
    ref, *_ = decode(model, stream, n_prompt=n_prompt)
    model.close()
    return ref


def test_the_model_runs_on_the_lazy_device(qwen3_model):
    """Guards the others: the layers and the pool really are on the lazy device."""
    model = on_lazy(qwen3_model, cpu_moe=True)
    ctx = Context(model, pool=PoolConfig(slots=4, device_mib=65536))
    status = ctx.pool_status(0)
    ctx.close()
    model.close()
    assert status.enabled and status.device.startswith("LAZY")


def test_where_the_device_skips_ids_hybrid_allocates_no_zero_slot(qwen3_model, stream):
    """The device skips the CPU's rows itself: a miss maps to -1, and the pools carry only the padding."""
    model = on_lazy(qwen3_model, cpu_moe=True)
    ctx = Context(model, pool=pool(slots=6, mode="hybrid"))
    report = ctx.pool_report(per_pool=True)
    status = ctx.pool_status(0)
    ctx.close()
    model.close()
    assert status.mode == "hybrid"
    assert report.pools and all(i.slots == 6 and i.slots_alloc == 7 for i in report.pools)
    assert status.bytes == sum(i.slots_alloc * i.slot_bytes for i in report.pools)


@pytest.mark.parametrize("uploads", PATHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("expert_type", ["F16", "Q4_0"])
def test_heavy_eviction_is_bit_identical(make_model, stream, mode, expert_type, uploads):
    """Slots at top-k: every step evicts and uploads; with Q4_0 the CPU repacks the host copy and
    misses are read from the model file into staging, which must outlive the device's read."""
    path = user_type_model(make_model, expert_type)
    ref = resident(path, stream, n_prompt=1)
    model = on_lazy(path, cpu_moe=True, repack=mode == "copy")
    repacked = cpu_repacks_weights(model)
    result, report, status, _ = decode(model, stream, pool(slots=4, mode=mode, uploads=uploads), n_prompt=1)
    model.close()
    c = report.counters
    assert status.enabled and status.mode == mode and status.uploads == uploads
    assert c.evictions > 0 and c.uploads > 0 and c.device_experts > 0
    if mode == "hybrid":
        assert c.cpu_experts > 0
    if expert_type == "Q4_0" and mode == "copy":
        assert repacked and all(info.from_file for info in report.pools)
    assert identical(result, ref), f"{mode} {expert_type}: the logits changed"


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_of_every_shape_are_bit_identical(qwen3_model, mode):
    """Batches of 1 to 512 tokens; the device's offload rule takes batches of 32 and more through
    the scheduler's host-copy path, which reads the experts the pool holds from its slots."""
    tokens = token_stream(SPEC, StreamSpec(n_tokens=sum(BATCH_SHAPES), seed=5))
    ref_model = on_lazy(qwen3_model)
    ref, *_ = decode_in_batches(ref_model, None, tokens)
    ref_model.close()
    model = on_lazy(qwen3_model, cpu_moe=True)
    got, _, c = decode_in_batches(model, pool(slots=8, mode=mode), tokens)
    model.close()
    for n, a, b in zip(BATCH_SHAPES, ref, got):
        assert np.array_equal(a, b), f"{mode}: the {n}-token batch changed the logits"
    assert c.steps > 0 and c.uploads > 0
    assert c.prefill_device_bytes > 0, "no offloaded batch read an expert from the slots"


@pytest.mark.parametrize("mode", MODES)
def test_two_sequences_in_one_batch_are_bit_identical(qwen3_model, stream, mode):
    seqs = [stream[:36], stream[36:72]]
    ref_model = on_lazy(qwen3_model)
    ref, _ = decode_sequences(ref_model, None, seqs, n_prompt=4)
    ref_model.close()
    model = on_lazy(qwen3_model, cpu_moe=True)
    # copy mode pools a step when 2 x top-4 experts fit its slots; hybrid mode any step
    slots = 8 if mode == "copy" else 6
    got, counters = decode_sequences(model, pool(slots=slots, mode=mode), seqs, n_prompt=4)
    model.close()
    assert counters.steps > 0 and counters.evictions > 0
    for r, g in zip(ref, got):
        assert all(np.array_equal(a, b) for a, b in zip(r, g))


def test_without_pinned_memory_the_default_upload_path_is_inline(qwen3_model, stream, monkeypatch):
    """By default stream uploads go only where the experts already sit in the device's pinned memory;
    the lazy device has events but no host buffer type, so its experts never do, and the pool takes the
    inline path unless asked (a setting, or LLAMA_MOE_POOL_UPLOADS), and says so."""
    model = on_lazy(qwen3_model, cpu_moe=True)
    _, _, status, lines = decode(model, stream[:24], pool(slots=4, uploads=None), n_prompt=1)
    _, _, asked, asked_lines = decode(model, stream[:24], pool(slots=4), n_prompt=1)
    monkeypatch.setenv("LLAMA_MOE_POOL_UPLOADS", "stream")
    _, _, from_env, _ = decode(model, stream[:24], pool(slots=4, uploads=None), n_prompt=1)
    model.close()
    assert status.uploads == "inline" and asked.uploads == "stream" and from_env.uploads == "stream"
    assert any(line.startswith("expert pool status=enabled") and " uploads=inline" in line for line in lines)
    assert any(line.startswith("expert pool status=enabled") and " uploads=stream" in line for line in asked_lines)


@pytest.mark.parametrize("mode", MODES)
def test_staging_smaller_than_a_step_waits_for_its_copies_and_stays_bit_identical(make_model, stream, mode):
    """1 MiB of staging and experts of 512 KiB per tensor: one step's uploads wrap the ring, so the
    pool has to wait for copies that still read the staging it reuses (the device aborts if a queued
    copy's source changes first). Those waits are the pool's own: they count in syncs_per_token."""
    path = make_model(n_embd=512, n_ff_exp=512)
    ref = resident(path, stream[:32], n_prompt=1)
    model = on_lazy(path, cpu_moe=True)
    small, small_report, status, _ = decode(model, stream[:32], pool(slots=4, mode=mode, staging_mib=1), n_prompt=1)
    _, roomy_report, _, _ = decode(model, stream[:32], pool(slots=4, mode=mode), n_prompt=1)
    model.close()
    assert status.uploads == "stream" and small_report.counters.uploads > 0
    assert identical(small, ref), f"{mode}: reused staging changed the logits"
    assert small_report.counters.syncs > roomy_report.counters.syncs, (small_report.counters, roomy_report.counters)



@pytest.mark.parametrize("uploads", PATHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("expert_type", ["F16", "Q4_0"])
def test_a_hot_set_warm_start_lands_before_the_first_step_reads_it(make_model, stream, tmp_path, mode, expert_type,
                                                                   uploads):
    """A context's warm start uploads a hot set file's experts while it is created. Here the file
    holds exactly what the first token selects, so that step uploads nothing and waits for no copy of
    its own: its matmuls (and, in hybrid mode, its slot table) must still find the bytes there,
    including experts read from the model file into staging where the CPU repacked the host copy."""
    path = user_type_model(make_model, expert_type)
    ref = resident(path, stream, n_prompt=1)
    model = on_lazy(path, cpu_moe=True, repack=mode == "copy")
    hot = tmp_path / "hot.txt"
    config = pool(slots=6, mode=mode, uploads=uploads, hotset=hot)
    first = Context(model, pool=config)
    recorder = PoolTraceRecorder(first)
    first.decode([stream[0]])
    recorder.end_step()
    first.close()  # one token is too short a run to save: the file is written here by hand
    key = re.search(r"hotset=cold reason=no-file .* model=(\S+) slots=(\d+)", "\n".join(first.pool_lines()))
    assert key and not hot.exists()
    hot.write_text(f"[hotset model={key.group(1)} slots={key.group(2)}]\n" + "".join(
        f"blk.{il} " + " ".join(f"{e}:1" for e in dict.fromkeys(ids.tolist())) + "\n"
        for il, (ids, _) in sorted(recorder.steps[0].items())))
    ctx = Context(model, pool=config)
    ctx.decode([stream[0]])
    c = ctx.pool_counters()
    logits = [ctx.logits()]
    for tok in stream[1:]:
        ctx.decode([tok])
        logits.append(ctx.logits())
    status = ctx.pool_status()
    ctx.close()
    model.close()
    assert c.lookups > 0 and c.misses == 0 and c.uploads == 0  # the premise: a first step of hits only
    assert any(line.startswith("expert pool hotset=loaded") for line in ctx.pool_lines())
    assert status.enabled and status.mode == mode and status.uploads == uploads
    assert len(logits) == len(ref.logits) and all(np.array_equal(a, b) for a, b in zip(logits, ref.logits)), \
        f"{mode} {expert_type} {uploads}: the warm start changed the logits"


@pytest.mark.parametrize("prefetch", ["auto", "on"])
@pytest.mark.parametrize("expert_type", ["F16", "Q4_0"])
def test_prefetched_experts_are_read_only_after_their_copies_land(make_model, stream, prefetch, expert_type):
    """Prefetch: a hybrid layer's step uploads the next layer's predicted experts on the upload queue,
    into slots whose old experts the next layer's device table still points at. The next layer's step
    must point its table away from those victims and have the compute queue wait for the copies of
    the experts it computes. The lazy device runs the copies only when something waits for them, so a
    missing wait, or a table that still maps a victim, is a wrong result here. auto times decode steps
    with and without prefetching on the stream path, and says which side it keeps once it has timed
    both; whichever it keeps, the steps of both were computed. The CPU keeps its plain kernels (no
    repacking), so that both sides compute as the resident run does."""
    path = user_type_model(make_model, expert_type)
    ref = resident(path, stream)
    model = on_lazy(path, cpu_moe=True, repack=False)
    result, report, status, lines = decode(model, stream, pool(slots=4, mode="hybrid", prefetch=prefetch))
    model.close()
    c = report.counters
    assert status.enabled and status.uploads == "stream" and status.prefetch == prefetch
    if prefetch == "on":
        assert c.prefetched > 0 and 0 < c.prefetch_hits <= c.prefetched, c
    else:
        verdict = next((l for l in lines if l.startswith("expert pool prefetch=auto side=")), None)
        assert verdict and re.search(r"on_ms_per_token=[\d.]+ off_ms_per_token=[\d.]+ verdicts=1", verdict), lines
        assert c.predicted > 0, "the steps timed with prefetching predicted nothing"
    assert identical(result, ref), f"{prefetch} {expert_type}: prefetched experts changed the logits"
