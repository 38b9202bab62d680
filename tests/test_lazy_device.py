"""The expert pool on the lazy-copy test device (tests/ggml-lazy-copy.cpp of the patched tree).

That device behaves as a GPU's queue and DMA engine do: a copy or a graph handed to it runs only
when the host synchronizes it (or waits on one of its events), and reads its source then. A host
buffer the pool reuses before the device read it (a staging buffer, the slot table's host copy), a
slot published before its bytes were queued, or a split that overwrites host memory a queued copy
still has to read, gives a wrong result here, deterministically, where the synchronous RPC device
cannot tell. The device computes with ggml-cpu's kernels, so every run must equal the all-resident
run on the same device bit for bit.

The device has events but no host buffer type; the pool pins the mapped experts in place with its
registration hook, so by default the device serves each step itself (the device-side path: its own
tests are at the end). The host's paths are asked for explicitly: the stream path (staging, an upload
queue of its own, events), which is what GPUs take, and the heavy-eviction test runs both.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from pyllamapool.binding.llama import Context, Model, lazy_copy_device, lazy_copy_registered
from pyllamapool.binding.pool import PoolConfig
from pyllamapool.run.testmodel import ModelSpec, StreamSpec, token_stream
from pyllamapool.run.trace import PoolTraceRecorder
from test_pool import (BATCH_SHAPES, cpu_repacks_weights, decode, decode_in_batches, decode_sequences,
                       identical, user_type_model)

SPEC = ModelSpec()
MODES = ["copy", "hybrid"]
PATHS = ["stream", "inline"]


def pool(**kw) -> PoolConfig:
    """The pool on the lazy device, served by the host (the device-side path has tests of its own below):
    an emulated size, stream uploads unless asked otherwise."""
    return PoolConfig(**{"device_mib": 65536, "uploads": "stream", "serve": "host", **kw})


def on_device(**kw) -> PoolConfig:
    """The device-side path: the device finds and fetches each step's misses itself."""
    return PoolConfig(**{"device_mib": 65536, **kw})


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


@pytest.mark.parametrize("pin", ["on", "off"])
@pytest.mark.parametrize("uploads", PATHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("expert_type", ["F16", "Q4_0"])
def test_heavy_eviction_is_bit_identical(make_model, stream, mode, expert_type, uploads, pin):
    """Slots at top-k: every step evicts and uploads; with Q4_0 the CPU repacks the host copy and
    misses are read from the model file into staging, which must outlive the device's read. Mapped
    experts are read from their pinned pages (pin on) or gathered into staging, on several threads
    where that pays (pin off)."""
    path = user_type_model(make_model, expert_type)
    ref = resident(path, stream, n_prompt=1)
    model = on_lazy(path, cpu_moe=True, repack=mode == "copy")
    repacked = cpu_repacks_weights(model)
    result, report, status, _ = decode(model, stream, pool(slots=4, mode=mode, uploads=uploads, pin=pin,
                                                           gather_threads=2 if pin == "off" else None), n_prompt=1)
    model.close()
    c = report.counters
    assert status.enabled and status.mode == mode and status.uploads == uploads
    assert status.experts == ("file" if repacked and mode == "copy" else "registered" if pin == "on" else "mapped")
    assert status.gather_threads == (2 if status.experts == "mapped" and uploads == "stream" else 0)
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


def test_mapped_experts_are_pinned_in_place_and_take_the_stream_path(qwen3_model, stream, monkeypatch):
    """The default load maps the experts from the file. Where the device offers a host registration
    hook (CUDA's, which the lazy device exports too), the pool pins those pages in place when it is
    made: its copies then read them directly, on the stream path, as experts in pinned memory are.
    The ranges are released when the context goes, before the model that maps them can be (the
    lazy device aborts if a range is unregistered after its pages were unmapped)."""
    ref = resident(qwen3_model, stream[:24], n_prompt=1)
    model = on_lazy(qwen3_model, cpu_moe=True)
    ctx = Context(model, pool=pool(slots=4, uploads=None))
    held = lazy_copy_registered()
    status = ctx.pool_status(0)
    ctx.close()
    released = lazy_copy_registered()
    result, _, _, lines = decode(model, stream[:24], pool(slots=4, uploads=None), n_prompt=1)
    model.close()
    assert status.experts == "registered" and status.experts_reason == "" and status.uploads == "stream"
    assert held[0] > 0 and held[1] == 0 and released == (0, 0)
    assert any(l.startswith("expert pool status=enabled") and " experts=registered" in l for l in lines)
    assert lazy_copy_registered() == (0, 0)
    assert identical(result, ref), "uploads from the pinned pages changed the logits"


def test_two_contexts_share_the_pinned_ranges_and_the_last_releases_them(qwen3_model):
    """A driver refuses a range that overlaps a registered one: a second context on the same model
    takes the first one's registrations, and only the last context to go unregisters them."""
    model = on_lazy(qwen3_model, cpu_moe=True)
    first = Context(model, pool=pool(slots=4))
    alone = lazy_copy_registered()
    second = Context(model, pool=pool(slots=6))
    both = lazy_copy_registered()
    statuses = (first.pool_status(0), second.pool_status(0))
    first.close()
    after_first = lazy_copy_registered()
    second.close()
    model.close()
    assert all(s.experts == "registered" for s in statuses)
    assert alone[0] > 0 and both == alone and after_first == alone
    assert lazy_copy_registered() == (0, 0)


def test_a_refused_registration_falls_back_to_the_mapped_pages(qwen3_model, stream, monkeypatch):
    """A device that refuses to pin the pages (a memlock limit, WSL, GGML_CUDA_NO_PINNED) leaves the
    pool on the mapped pages with one warning that says so, and decodes exactly as before; asked to
    leave them (pin="off"), it does not try. Either way the default path is inline, as for mapped
    pages it was measured faster, unless stream is asked for (LLAMA_MOE_POOL_UPLOADS too)."""
    ref = resident(qwen3_model, stream[:24], n_prompt=1)
    model = on_lazy(qwen3_model, cpu_moe=True)
    monkeypatch.setenv("GGML_LAZY_COPY_REGISTER", "refuse")
    ctx = Context(model, pool=pool(slots=4, uploads=None))
    warnings = [l for l in ctx.init_log if "refused to pin the mapped experts" in l]
    ctx.close()
    refused, _, status, lines = decode(model, stream[:24], pool(slots=4, uploads=None), n_prompt=1)
    monkeypatch.delenv("GGML_LAZY_COPY_REGISTER")
    _, _, off, _ = decode(model, stream[:24], pool(slots=4, uploads=None, pin="off"), n_prompt=1)
    monkeypatch.setenv("LLAMA_MOE_POOL_UPLOADS", "stream")
    streamed, _, from_env, _ = decode(model, stream[:24], pool(slots=4, uploads=None, pin="off"), n_prompt=1)
    model.close()
    assert (status.experts, status.experts_reason, status.uploads) == ("mapped", "refused", "inline")
    assert (off.experts, off.experts_reason, off.uploads) == ("mapped", "off", "inline")
    assert from_env.uploads == "stream" and from_env.experts == "mapped"
    assert len(warnings) == 1, warnings
    assert any(" experts=mapped(refused) " in l for l in lines if l.startswith("expert pool status="))
    assert identical(refused, ref) and identical(streamed, ref)


@pytest.mark.parametrize("mode", MODES)
def test_staging_smaller_than_a_step_waits_for_its_copies_and_stays_bit_identical(make_model, stream, mode):
    """1 MiB of staging and experts of 512 KiB per tensor: one step's uploads wrap the ring, so the
    pool has to wait for copies that still read the staging it reuses (the device aborts if a queued
    copy's source changes first). Those waits are the pool's own: they count in syncs_per_token."""
    path = make_model(n_embd=512, n_ff_exp=512)
    ref = resident(path, stream[:32], n_prompt=1)
    model = on_lazy(path, cpu_moe=True)
    # the pages stay pageable (pin off): pinned ones would be copied without staging
    small, small_report, status, _ = decode(model, stream[:32], pool(slots=4, mode=mode, staging_mib=1, pin="off"),
                                            n_prompt=1)
    _, roomy_report, _, _ = decode(model, stream[:32], pool(slots=4, mode=mode, pin="off"), n_prompt=1)
    model.close()
    assert status.uploads == "stream" and small_report.counters.uploads > 0
    assert identical(small, ref), f"{mode}: reused staging changed the logits"
    assert small_report.counters.syncs > roomy_report.counters.syncs, (small_report.counters, roomy_report.counters)



LAYOUTS = ["one queue", "transfer queue"]


def queue_layout(layout: str, monkeypatch) -> None:
    """The lazy device's backends made from here on have one queue, or send their async copies from
    host memory to a transfer queue of their own (GGML_LAZY_COPY_TRANSFER_QUEUE, at the end of this file)."""
    if layout == "transfer queue":
        monkeypatch.setenv("GGML_LAZY_COPY_TRANSFER_QUEUE", "1")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("uploads", PATHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("expert_type", ["F16", "Q4_0"])
def test_a_hot_set_warm_start_lands_before_the_first_step_reads_it(make_model, stream, tmp_path, mode, expert_type,
                                                                   uploads, layout, monkeypatch):
    """A context's warm start uploads a hot set file's experts while it is created. Here the file
    holds exactly what the first token selects, so that step uploads nothing and waits for no copy of
    its own: its matmuls (and, in hybrid mode, its slot table) must still find the bytes there,
    including experts read from the model file into staging where the CPU repacked the host copy."""
    queue_layout(layout, monkeypatch)
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


def stepwise(model, stream, config, n_prompt: int):
    """Teacher-forced, one token a step: the logits and the pool's counters after the prompt and each step."""
    ctx = Context(model, pool=config)
    ctx.decode(stream[:n_prompt])
    logits, counters = [ctx.logits()], [ctx.pool_counters()]
    for tok in stream[n_prompt:]:
        ctx.decode([tok])
        logits.append(ctx.logits())
        counters.append(ctx.pool_counters())
    ctx.close()
    return logits, counters


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("uploads", PATHS)
@pytest.mark.parametrize("slots", [SPEC.n_expert, 8])
def test_a_fill_goes_beside_the_steps_and_never_before_the_first_token(qwen3_model, stream, slots, uploads, layout,
                                                                       monkeypatch):
    """The uploads no step asked for are a fill, a one-off that goes a few uploads a step beside the
    steps' own admissions: with a slot for every expert (a card where everything fits, the H200's
    24 GB case) the experts no step selected yet, which also serves the prompt; with fewer, the prompt's
    most used experts (its batch is the stock path's), queued by the warm start. The prompt and the
    first token after it upload only what they selected, the steps that carry a fill are counted (the
    arbiters leave them untimed), and a pool for every expert ends with no step missing. Every step equals the all-resident run, on either queue layout."""
    queue_layout(layout, monkeypatch)
    n_prompt = 40  # beyond the pool's batches unless the pool holds every expert
    resident_model = on_lazy(qwen3_model)
    ref, _ = stepwise(resident_model, stream, None, n_prompt)
    resident_model.close()
    model = on_lazy(qwen3_model, cpu_moe=True)
    logits, counters = stepwise(model, stream, pool(slots=slots, mode="hybrid", uploads=uploads), n_prompt)
    model.close()
    assert len(logits) == len(ref) and all(np.array_equal(a, b) for a, b in zip(logits, ref)), \
        f"{slots} slots, {uploads}, {layout}: the fill changed the logits"
    keys = ("steps", "uploads", "misses", "cpu_experts", "fill_steps")
    step = [{k: getattr(c, k) for k in keys} for c in counters[:1]]
    step += [{k: getattr(b, k) - getattr(a, k) for k in keys} for a, b in zip(counters, counters[1:])]
    assert step[0]["steps"] == (1 if slots == SPEC.n_expert else 0), step[0]  # the prompt
    assert all(d["uploads"] <= d["misses"] for d in step[:2]), step[:2]
    # the steps that carried fill uploads, beside their own admissions: none before the first token
    # has been timed
    fills = [i for i, d in enumerate(step) if d["fill_steps"]]
    assert len(fills) >= 2 and fills[0] >= 2 and counters[-1].fill_steps == len(fills), step
    assert any(d["uploads"] > d["misses"] for d in step if d["fill_steps"]), step
    if slots == SPEC.n_expert:
        # filled: the last steps find every expert on the device
        assert fills[-1] < len(step) - 4 and all(d["misses"] == 0 and d["cpu_experts"] == 0 for d in step[-4:]), step


@pytest.mark.parametrize("layout", LAYOUTS)
def test_auto_probes_the_pool_within_the_upload_budget_behind_a_slow_link(qwen3_model, stream, layout, monkeypatch):
    """-mec auto times the stock path first, so when it first probes the pool no pooled decode step
    has been timed. Its first pooled steps take the upload budget from the stock path's token time and
    the upload queue's calibrated rate instead of uploading every admission at once: behind a 1 MB/s
    link a top-k's worth of uploads costs many stock tokens, where the budget holds a pooled step to
    at most one upload a layer. Every step equals the all-resident run."""
    queue_layout(layout, monkeypatch)
    n_prompt = 8
    resident_model = on_lazy(qwen3_model)
    ref, _ = stepwise(resident_model, stream, None, n_prompt)
    resident_model.close()
    monkeypatch.setenv("GGML_LAZY_COPY_LINK_MB_S", "1")
    model = on_lazy(qwen3_model, cpu_moe=True)
    logits, counters = stepwise(model, stream, pool(slots=4, mode="hybrid", gate="auto"), n_prompt)
    model.close()
    assert len(logits) == len(ref) and all(np.array_equal(a, b) for a, b in zip(logits, ref)), \
        f"{layout}: the probe changed the logits"
    keys = ("steps", "uploads", "stood_down_steps", "misses")
    step = [{k: getattr(b, k) - getattr(a, k) for k in keys} for a, b in zip(counters, counters[1:])]
    pooled = [i for i, d in enumerate(step) if d["steps"] and not d["stood_down_steps"]]
    # stock's sample first, then the pool's probe, whose steps miss more than the budget uploads
    assert pooled and pooled[0] > 0 and all(d["stood_down_steps"] for d in step[:pooled[0]]), step
    assert sum(step[i]["misses"] for i in pooled) > SPEC.n_layer, step
    assert all(step[i]["uploads"] <= SPEC.n_layer for i in pooled), [step[i] for i in pooled]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("prefetch", ["auto", "on"])
@pytest.mark.parametrize("expert_type", ["F16", "Q4_0"])
def test_prefetched_experts_are_read_only_after_their_copies_land(make_model, stream, prefetch, expert_type, layout,
                                                                  monkeypatch):
    """Prefetch: a hybrid layer's step uploads the next layer's predicted experts on the upload queue,
    into slots whose old experts the next layer's device table still points at. The next layer's step
    must point its table away from those victims and have the compute queue wait for the copies of
    the experts it computes. The lazy device runs the copies only when something waits for them, so a
    missing wait, or a table that still maps a victim, is a wrong result here. auto times decode steps
    with and without prefetching on the stream path, and says which side it keeps once it has timed
    both; whichever it keeps, the steps of both were computed. The CPU keeps its plain kernels (no
    repacking), so that both sides compute as the resident run does."""
    queue_layout(layout, monkeypatch)
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


# --------------------------------------------------------------------------------------------
# the device-side path: the device finds each step's misses and copies them from the host experts
# it reads in place (GGML_OP_MOE_FETCH), so a decode step never waits for the host


def counted_decode(model, stream, config, n_prompt: int = 1):
    """A teacher-forced run that also counts the scheduler's host waits in each decode token."""
    ctx = Context(model, pool=config)
    ctx.decode(stream[:n_prompt])
    logits, waits = [ctx.logits()], []
    for tok in stream[n_prompt:]:
        ctx.decode([tok])
        waits.append(ctx.host_syncs())
        logits.append(ctx.logits())
    report = ctx.pool_report(per_pool=True)
    status = ctx.pool_status()
    lines = ctx.pool_lines()
    ctx.close()
    return logits, waits, report, status, lines


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("expert_type", ["F16", "Q4_0"])
def test_the_device_serves_every_step_bit_identically_with_one_host_wait(make_model, stream, mode, expert_type):
    """Slots at top-k: every step evicts and fetches on the device. Either mode asked for, the device
    serves the layers as copy mode does (it fetches every miss), the logits equal the all-resident
    run's, and a decode token waits for the host once (the scheduler's copy of the token's inputs),
    where the host's path waits in every pooled layer."""
    path = user_type_model(make_model, expert_type)
    ref = resident(path, stream, n_prompt=1)
    model = on_lazy(path, cpu_moe=True, repack=False)
    logits, waits, report, status, lines = counted_decode(model, stream, on_device(slots=4, mode=mode, serve="device"))
    _, host_waits, *_ = counted_decode(model, stream, pool(slots=4, mode=mode))
    model.close()
    c = report.counters
    assert status.serve == "device" and status.serve_reason == "" and status.experts == "registered"
    assert any(" serve=device" in l for l in lines if l.startswith("expert pool status=enabled"))
    assert len(logits) == len(ref.logits) and all(np.array_equal(a, b) for a, b in zip(logits, ref.logits)), \
        f"{mode} {expert_type}: the device's path changed the logits"
    assert max(waits) <= 2 and sum(waits) / len(waits) < sum(host_waits) / len(host_waits), (waits, host_waits)
    # the device's own counts, once per layer: every lookup a hit or a miss, every miss fetched
    assert c.steps == len(stream) and c.lookups == c.hits + c.misses == SPEC.n_layer * SPEC.n_expert_used * c.steps
    assert c.misses > 0 and c.evictions > 0 and c.uploads == c.misses
    assert c.copy_bytes == sum(pc.copy_bytes for pc in report.pool_counters) > 0


@pytest.mark.parametrize("expert_type,link_mb_s", [("F16", 0), ("Q4_0", 0), ("F16", 4)])
def test_serve_auto_times_hybrid_against_the_device_and_hands_the_slots_over(make_model, stream, monkeypatch,
                                                                              expert_type, link_mb_s):
    """serve auto in hybrid mode: decode steps run hybrid's host path first, then the device's, in turns
    as -mec auto's arbiter times them, and the side that wins serves. At each switch the slots change
    hands with what they hold: the device is told which experts hybrid's copies left in them, hybrid's
    policy adopts what the device's LRU left. A slot either side got wrong is a wrong result: every
    step equals the all-resident run. The steps the device served wait for the host once, hybrid's in
    every layer. Over a slow link (the lazy device's queue holds it for each byte it reads from host
    memory) fetching every miss costs many of hybrid's steps: hybrid's misses at the upload queue's
    calibrated rate price the device's steps beyond any chance, so the device is never probed and
    every step stays hybrid's."""
    path = user_type_model(make_model, expert_type)
    ref = resident(path, stream, n_prompt=1)
    model = on_lazy(path, cpu_moe=True, repack=False)
    monkeypatch.setenv("GGML_LAZY_COPY_LINK_MB_S", str(link_mb_s))
    logits, waits, report, status, lines = counted_decode(model, stream, on_device(slots=4, mode="hybrid", serve="auto"))
    model.close()
    c = report.counters
    assert status.serve == "auto" and status.mode == "hybrid", status
    assert any(" serve=auto" in l for l in lines if l.startswith("expert pool status=enabled"))
    assert len(logits) == len(ref.logits) and all(np.array_equal(a, b) for a, b in zip(logits, ref.logits)), \
        f"{expert_type}: handing the slots between the paths changed the logits"
    if link_mb_s:
        priced = [l for l in lines if l.startswith("expert pool serve=auto side=host reason=device-priced-out")]
        floor = priced and re.search(r"device_floor_ms_per_token=([\d.]+) host_ms_per_token=([\d.]+)", priced[0])
        assert floor and float(floor[1]) > 4 * float(floor[2]), lines
        assert not any(l.startswith("expert pool serve=auto side=device") for l in lines), lines
        assert all(w > 2 for w in waits[1:]) and c.device_experts == c.hits and c.cpu_experts > 0, (waits, c)
        return
    verdict = next((l for l in lines if l.startswith("expert pool serve=auto side=")), None)
    timed = verdict and re.search(r"side=(\w+) reason=(\w+)-(faster|not-slower) device_ms_per_token=([\d.]+) "
                                  r"host_ms_per_token=([\d.]+) verdicts=1", verdict)
    assert timed, lines
    side, who, how, device_ms, host_ms = timed.groups()
    # the reason names the side kept, and says whether its steps timed faster than the other's
    assert who == side and (how == "faster") == (float(device_ms if side == "device" else host_ms) <
                                                  float(host_ms if side == "device" else device_ms)), verdict
    # runs of steps by where they were served: hybrid's warm-up and sample, then the device's probe
    served = [w <= 2 for w in waits]
    runs = [k for i, k in enumerate(served) if i == 0 or k != served[i - 1]]
    assert runs[:2] == [False, True], waits
    assert c.hits + c.misses == c.lookups and c.uploads > 0 and c.device_experts > 0 and c.cpu_experts > 0, c
    # each side's fills of empty slots are counted once, across the switches: a span counted twice
    # would take evictions below the misses that found every slot taken (4 slots, top-k 4: most do).
    # Every eviction admits a miss or, where prefetch=auto's clock kept prefetching on, a predicted
    # expert that no step had missed yet
    assert 0 < c.evictions <= c.misses + c.prefetched, c


@pytest.mark.parametrize("mode", MODES)
def test_the_device_serves_micro_batches_of_every_shape_bit_identically(qwen3_model, mode):
    """Batches of 1 to 32 tokens fit the slots and are served on the device; 33 and 512 take the stock
    path (the host computes or the scheduler offloads them, reading host experts), never evicting."""
    tokens = token_stream(SPEC, StreamSpec(n_tokens=sum(BATCH_SHAPES), seed=5))
    ref_model = on_lazy(qwen3_model)
    ref, *_ = decode_in_batches(ref_model, None, tokens)
    ref_model.close()
    model = on_lazy(qwen3_model, cpu_moe=True)
    got, before_big, c = decode_in_batches(model, on_device(slots=SPEC.n_expert, mode=mode), tokens)
    model.close()
    for n, a, b in zip(BATCH_SHAPES, ref, got):
        assert np.array_equal(a, b), f"{mode}: the {n}-token batch changed the logits"
    assert c.steps > 0 and c.misses > 0


@pytest.mark.parametrize("mode", MODES)
def test_the_device_serves_two_sequences_in_one_batch_bit_identically(qwen3_model, stream, mode):
    seqs = [stream[:36], stream[36:72]]
    ref_model = on_lazy(qwen3_model)
    ref, _ = decode_sequences(ref_model, None, seqs, n_prompt=4)
    ref_model.close()
    model = on_lazy(qwen3_model, cpu_moe=True)
    got, counters = decode_sequences(model, on_device(slots=8, mode=mode), seqs, n_prompt=4)
    model.close()
    assert counters.steps > 0 and counters.evictions > 0
    for r, g in zip(ref, got):
        assert all(np.array_equal(a, b) for a, b in zip(r, g))


def test_experts_the_device_cannot_read_in_place_are_served_by_the_host(qwen3_model, stream, monkeypatch):
    """Refused registration leaves the experts in pageable pages, which a GPU cannot read in place: the
    host serves those layers and the status says why; asked for the device's path, the pool warns.
    The host serves a step of experts the CPU repacked too (they are read from the model file)."""
    model = on_lazy(qwen3_model, cpu_moe=True)
    monkeypatch.setenv("GGML_LAZY_COPY_REGISTER", "refuse")
    asked = Context(model, pool=on_device(slots=4, serve="device"))
    warned = [l for l in asked.init_log if "serves none of its layers itself (not-pinned)" in l]
    status = asked.pool_status()
    asked.close()
    model.close()
    assert (status.serve, status.serve_reason, status.experts) == ("host", "not-pinned", "mapped")
    assert len(warned) == 1, asked.init_log


# ---------------------------------------------------------------------------------------------
# A transfer queue of its own (GGML_LAZY_COPY_TRANSFER_QUEUE=1): ggml-vulkan on discrete AMD GPUs
# sends async copies from host memory to a transfer queue, which waits for compute only where an
# event is waited on the backend. The lazy device runs that queue first at a synchronize, as an idle
# copy engine would, so a slot upload or a slot table queued behind the device's share of a step
# without that event lands before the share reads the old bytes, and the logits change.

@pytest.mark.parametrize("uploads", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_a_transfer_queue_of_its_own_keeps_heavy_eviction_bit_identical(qwen3_model, stream, mode, uploads,
                                                                       monkeypatch):
    queue_layout("transfer queue", monkeypatch)
    ref = resident(qwen3_model, stream, n_prompt=1)
    model = on_lazy(qwen3_model, cpu_moe=True)
    result, report, status, _ = decode(model, stream, pool(slots=4, mode=mode, uploads=uploads), n_prompt=1)
    model.close()
    c = report.counters
    assert status.enabled and status.mode == mode and status.uploads == uploads
    assert c.evictions > 0 and c.uploads > 0
    assert identical(result, ref), f"{mode} {uploads}: the logits changed with a transfer queue"


@pytest.mark.parametrize("mode", MODES)
def test_a_transfer_queue_of_its_own_keeps_micro_batches_and_two_sequences_bit_identical(qwen3_model, stream, mode,
                                                                                        monkeypatch):
    queue_layout("transfer queue", monkeypatch)
    tokens = token_stream(SPEC, StreamSpec(n_tokens=sum(BATCH_SHAPES), seed=5))
    seqs = [stream[:36], stream[36:72]]
    ref_model = on_lazy(qwen3_model)
    ref_batches, *_ = decode_in_batches(ref_model, None, tokens)
    ref_seqs, _ = decode_sequences(ref_model, None, seqs, n_prompt=4)
    ref_model.close()
    model = on_lazy(qwen3_model, cpu_moe=True)
    got_batches, _, c = decode_in_batches(model, pool(slots=8, mode=mode, uploads="inline"), tokens)
    got_seqs, c2 = decode_sequences(model, pool(slots=8 if mode == "copy" else 6, mode=mode, uploads="inline"), seqs,
                                    n_prompt=4)
    model.close()
    assert c.uploads > 0 and c2.evictions > 0
    for n, a, b in zip(BATCH_SHAPES, ref_batches, got_batches):
        assert np.array_equal(a, b), f"{mode}: the {n}-token batch changed the logits with a transfer queue"
    for r, g in zip(ref_seqs, got_seqs):
        assert all(np.array_equal(a, b) for a, b in zip(r, g)), f"{mode}: two sequences changed with a transfer queue"


@pytest.mark.parametrize("mode", MODES)
def test_a_transfer_queue_of_its_own_keeps_the_devices_path_bit_identical(qwen3_model, stream, mode, monkeypatch):
    """The device's own fetch copies nothing through the transfer queue in a step; its state's warm
    start and the counters' read-back still cross it."""
    queue_layout("transfer queue", monkeypatch)
    ref = resident(qwen3_model, stream, n_prompt=1)
    model = on_lazy(qwen3_model, cpu_moe=True)
    result, report, status, _ = decode(model, stream, on_device(slots=4, mode=mode, serve="device"), n_prompt=1)
    model.close()
    assert status.serve == "device" and report.counters.evictions > 0
    assert identical(result, ref), f"{mode}: the device's path changed the logits with a transfer queue"


# ---------------------------------------------------------------------------------------------
# Two devices in one process: the layers split between LAZY0 and LAZY1, a pool and a ledger on each,
# and the activations copied between them on the source's queue, as ggml-cuda copies between GPUs
# (nothing orders such a copy after the destination's own queued work).

def on_two_lazy(path, **args) -> Model:
    return Model(path, n_gpu_layers=99, lazy_copy=2, **args)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("uploads", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_two_devices_keep_heavy_eviction_bit_identical(qwen3_model, stream, mode, uploads, layout, monkeypatch):
    queue_layout(layout, monkeypatch)
    ref_model = on_two_lazy(qwen3_model)
    ref, *_ = decode(ref_model, stream, n_prompt=1)
    ref_model.close()
    model = on_two_lazy(qwen3_model, cpu_moe=True)
    result, report, status, _ = decode(model, stream, pool(slots=4, mode=mode, uploads=uploads), n_prompt=1)
    model.close()
    assert {info.device for info in report.pools} == {0, 1}, "the pools are not on both devices"
    assert len(report.devices) == 2 and all(d.enabled for d in report.devices)
    assert report.counters.evictions > 0
    assert identical(result, ref), f"{mode} {uploads} {layout}: the logits changed on two devices"


@pytest.mark.parametrize("mode", MODES)
def test_two_devices_keep_two_sequences_and_the_devices_path_bit_identical(qwen3_model, stream, mode):
    seqs = [stream[:36], stream[36:72]]
    ref_model = on_two_lazy(qwen3_model)
    ref_seqs, _ = decode_sequences(ref_model, None, seqs, n_prompt=4)
    ref, *_ = decode(ref_model, stream, n_prompt=1)
    ref_model.close()
    model = on_two_lazy(qwen3_model, cpu_moe=True)
    got_seqs, c = decode_sequences(model, pool(slots=8 if mode == "copy" else 6, mode=mode), seqs, n_prompt=4)
    served, _, status, _ = decode(model, stream, on_device(slots=4, mode=mode, serve="device"), n_prompt=1)
    model.close()
    assert c.evictions > 0 and status.serve == "device"
    for r, g in zip(ref_seqs, got_seqs):
        assert all(np.array_equal(a, b) for a, b in zip(r, g)), f"{mode}: two sequences changed on two devices"
    assert identical(served, ref), f"{mode}: the device's path changed the logits on two devices"


def test_the_auto_benchmark_reports_cold_and_warm_halves_over_a_slow_link(tmp_path):
    """benchmarks/auto.py's short mode on the lazy device behind an emulated slow link: every design
    runs on one token stream, each row has its cold and warm half, the pooled runs are bit-identical
    to stock, and auto's rows say how many steps it left to the stock path."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "auto.json"
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "auto.py"), "--device", "lazy", "--short",
                             "--link-mb-s", "50", "--json", str(out)], capture_output=True, text=True, timeout=900,
                            cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["design"] for r in rows] == ["stock", "copy", "hybrid", "auto", "auto (-mec auto)"]
    assert all(r["parity"] and r["cold"] > 0 and r["warm"] > 0 for r in rows), rows
    assert all(0.0 <= r["stock_share"] <= 1.0 for r in rows if r["design"].startswith("auto"))
    assert "| cold half t/s | warm half t/s |" in result.stdout
    bad = subprocess.run([sys.executable, str(root / "benchmarks" / "auto.py"), "--device", "rpc", "--link-mb-s", "50"],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert bad.returncode == 2 and "--link-mb-s 50: expected a rate > 0 with --device lazy" in bad.stderr


# One bank for a device's layers (LLAMA_MOE_POOL_BANK=on): the device's LRU runs over (layer, expert)
# and hands out any slot of the bank to any layer, so a layer's matmuls read the whole bank.

def banked(**kw) -> PoolConfig:
    return on_device(**{"mode": "copy", "serve": "device", "bank": "on", **kw})


@pytest.mark.parametrize("expert_type", ["F16", "Q4_0"])
def test_a_bank_shared_by_the_layers_serves_every_step_bit_identically(make_model, stream, expert_type):
    """Slots at top-k a layer, one bank of them on the device: every step evicts, often another
    layer's expert; the logits equal the all-resident run's, each layer's counts add up to its
    lookups, and a token still waits for the host once."""
    path = user_type_model(make_model, expert_type)
    ref = resident(path, stream, n_prompt=1)
    model = on_lazy(path, cpu_moe=True, repack=False)
    logits, waits, report, status, lines = counted_decode(model, stream, banked(slots=4))
    model.close()
    assert status.bank == "on" and status.bank_reason == "" and status.serve == "device"
    assert any(" bank=on" in l for l in lines if l.startswith("expert pool status=enabled"))
    assert all(np.array_equal(a, b) for a, b in zip(logits, ref.logits)) and len(logits) == len(ref.logits), \
        f"{expert_type}: the bank changed the logits"
    assert max(waits) <= 2
    c = report.counters
    assert c.steps == len(stream) and c.lookups == c.hits + c.misses == SPEC.n_layer * SPEC.n_expert_used * c.steps
    assert c.misses > 0 and c.evictions > 0 and c.uploads == c.misses
    per_layer = [p for p in report.pool_counters]
    assert sum(p.copy_bytes for p in per_layer) == c.copy_bytes > 0


@pytest.mark.parametrize("serve", ["device", "host"])
def test_a_bank_serves_micro_batches_and_two_sequences_bit_identically(qwen3_model, stream, serve):
    tokens = token_stream(SPEC, StreamSpec(n_tokens=sum(BATCH_SHAPES), seed=5))
    seqs = [stream[:36], stream[36:72]]
    ref_model = on_lazy(qwen3_model)
    ref, *_ = decode_in_batches(ref_model, None, tokens)
    ref_seqs, _ = decode_sequences(ref_model, None, seqs, n_prompt=4)
    ref_model.close()
    model = on_lazy(qwen3_model, cpu_moe=True)
    got, _, c = decode_in_batches(model, BANKED[serve](slots=SPEC.n_expert // 2), tokens)
    got_seqs, c2 = decode_sequences(model, BANKED[serve](slots=8), seqs, n_prompt=4)
    model.close()
    for n, a, b in zip(BATCH_SHAPES, ref, got):
        assert np.array_equal(a, b), f"the {n}-token batch changed the logits over a bank ({serve})"
    assert c.steps > 0 and c.misses > 0 and c2.evictions > 0
    for r, g in zip(ref_seqs, got_seqs):
        assert all(np.array_equal(a, b) for a, b in zip(r, g)), f"two sequences changed over a bank ({serve})"


def host_banked(**kw) -> PoolConfig:
    """A bank the host serves (as on RPC and Vulkan, which do not fetch on the device): the pool's
    policy runs over (layer, expert) and each layer's remap op hands out any slot of the bank."""
    return pool(**{"mode": "copy", "bank": "on", **kw})


BANKED = {"device": banked, "host": host_banked}


def bank_slots(report) -> int:
    """The slots of the layers' shares of the bank, each layer counted once."""
    return sum({info.layer: info.slots for info in report.pools}.values())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("uploads", PATHS)
@pytest.mark.parametrize("expert_type", ["F16", "Q4_0"])
def test_a_bank_the_host_serves_is_bit_identical_under_heavy_eviction(make_model, stream, expert_type, uploads, layout,
                                                                      monkeypatch):
    """Slots at top-k a layer in one bank the host serves: a step's misses take slots other layers'
    experts held, uploaded on either path and queue layout; the logits equal the all-resident run's.
    Every miss that found the bank full evicted one expert, counted once, for the layer that lost it."""
    queue_layout(layout, monkeypatch)
    path = user_type_model(make_model, expert_type)
    ref = resident(path, stream, n_prompt=1)
    model = on_lazy(path, cpu_moe=True, repack=False)
    result, report, status, lines = decode(model, stream, host_banked(slots=4, uploads=uploads), n_prompt=1)
    model.close()
    assert (status.bank, status.bank_reason, status.serve) == ("on", "", "host")
    assert any(" bank=on" in l for l in lines if l.startswith("expert pool status=enabled"))
    assert identical(result, ref), f"{expert_type}, {uploads}, {layout}: the host's bank changed the logits"
    c = report.counters
    assert c.steps == len(stream) and c.lookups == c.hits + c.misses == SPEC.n_layer * SPEC.n_expert_used * c.steps
    assert c.uploads == c.misses and c.evictions == c.misses - bank_slots(report) > 0
    assert sum(p.copy_bytes for p in report.pool_counters) == c.copy_bytes > 0


@pytest.mark.parametrize("policy", ["adaptive", "lru"])
def test_a_host_banks_misses_are_the_labs_bank_on_the_same_routing(qwen3_model, stream, policy):
    """The host's bank of 6 slots a layer misses what the lab's bank (policies.bank, the product's
    policy over (layer, expert) written again in Python) misses on the routing recorded from a pool
    holding every expert; a pool per layer at equal memory misses otherwise."""
    from pyllamapool.lab.policies import bank
    from pyllamapool.run.decode import run_context

    model = on_lazy(qwen3_model, cpu_moe=True)
    ctx = Context(model, pool=pool(slots=SPEC.n_expert, mode="copy"))
    recorder = PoolTraceRecorder(ctx)
    run_context(ctx, stream[:1], 0, teacher_tokens=stream[1:])
    ctx.close()
    steps = [step for step in (recorder.steps + [recorder._current]) if step]
    layers = [[step[il][0].ravel().tolist() for step in steps] for il in sorted(steps[0])]
    _, report, status, _ = decode(model, stream, host_banked(slots=6, policy=policy), n_prompt=1)
    _, per_layer, _, _ = decode(model, stream, pool(slots=6, mode="copy", policy=policy), n_prompt=1)
    model.close()
    expected = bank(layers, 6 * SPEC.n_layer, policy)
    c = report.counters
    assert status.bank == "on" and c.steps == len(steps)
    assert (c.lookups, c.misses) == (expected.lookups, expected.uploads)
    assert per_layer.counters.misses != c.misses


@pytest.mark.parametrize("serve", ["device", "host"])
def test_a_prompt_batch_leaves_a_bank_alone_even_where_a_layers_share_holds_every_expert(qwen3_model, tmp_path,
                                                                                         stream, serve):
    """A pool of its own that holds every expert serves any batch without evicting; in a bank a layer
    holds only what the others leave it, so an 8-token prompt takes the stock path in every layer,
    even in one whose weighted share is all 16 experts. The same share in per-layer pools serves it."""
    profile = tmp_path / "profile.txt"
    profile.write_text("blk.0 6\nblk.1 1\nblk.2 1\nblk.3 1\n")
    model = on_lazy(qwen3_model, cpu_moe=True)
    seen = {}
    for bank in ("on", "off"):
        ctx = Context(model, pool=BANKED[serve](slots=8, profile=profile, bank=bank))
        ctx.decode(stream[:8])
        ctx.logits()
        report = ctx.pool_report(per_pool=True)
        ctx.close()
        shares = {info.layer: info.slots for info in report.pools}
        seen[bank] = {info.layer: c.lookups for info, c in zip(report.pools, report.pool_counters)}
        assert shares[0] == SPEC.n_expert and sum(shares.values()) < SPEC.n_layer * SPEC.n_expert, shares
    model.close()
    assert set(seen["on"].values()) == {0}, seen
    assert seen["off"][0] > 0 and seen["off"][1] == 0, seen


@pytest.mark.parametrize("config,reason", [({"mode": "hybrid", "serve": "auto"}, "hybrid"),
                                           ({"gate": "yield"}, "gate")])
def test_a_bank_the_layers_cannot_share_is_a_pool_per_layer_and_says_why(qwen3_model, stream, config, reason):
    """Hybrid mode keeps a table per layer it runs (every layer of this model: only layers that run
    copy mode share banks), and the admission gate judges one layer's pool: with either, the bank is
    off, the status line says why, and the run is the per-layer pools' bit for bit (each layer keeps
    its stretch of the bank tensor as its slots)."""
    ref = resident(qwen3_model, stream, n_prompt=1)
    model = on_lazy(qwen3_model, cpu_moe=True)
    result, report, status, lines = decode(model, stream, banked(slots=4, **config), n_prompt=1)
    # asked for and not made: a warning too, once, saying what would make one where something can
    ctx = Context(model, pool=banked(slots=4, **config))
    warned = [line for line in ctx.init_log if "no slot bank on" in line]
    ctx.close()
    model.close()
    assert status.bank == "off" and status.bank_reason == reason
    assert any(f" bank=off({reason})" in l for l in lines if l.startswith("expert pool status=enabled"))
    assert report.counters.evictions > 0
    assert identical(result, ref), f"{config}: the logits changed"
    assert len(warned) == 1 and f"({reason})" in warned[0], warned
    assert ("--moe-pool-mode copy" in warned[0]) == (reason == "hybrid"), warned


# A Q4_K_M file gives some layers' ffn_down_exps more bits (Q6_K), so its layers have two layouts and
# one tensor cannot hold every layer's slots: the layers of each layout share a bank of their own.
MIXED = [(("F16", "Q8_0", "Q8_0"), 5, 2, 0),  # F16 down in layers 0 and 3, Q8_0 in 1, 2 and 4
         (("F16", "F16", "F16", "Q8_0"), 4, 1, 1)]  # layer 3 alone in its layout: a pool of its own


@pytest.mark.parametrize("down_types,n_layer,n_banks,n_own", MIXED)
@pytest.mark.parametrize("serve", ["device", "host"])
def test_layers_of_different_layouts_share_a_bank_per_layout_bit_identically(make_model, stream, serve, down_types,
                                                                             n_layer, n_banks, n_own):
    """Slots at top-k a layer: each layout's bank evicts across its own layers only; the status line
    counts the banks and the layers left a pool of their own, and the logits equal the all-resident
    run's. Every miss that found its bank (or its own pool) full evicted one expert, counted once."""
    path = make_model(n_layer=n_layer, down_types=down_types)
    ref = resident(path, stream, n_prompt=1)
    model = on_lazy(path, cpu_moe=True, repack=False)
    result, report, status, lines = decode(model, stream, BANKED[serve](slots=4), n_prompt=1)
    model.close()
    assert (status.bank, status.bank_reason, status.serve) == ("on", "", serve)
    line = next(l for l in lines if l.startswith("expert pool status=enabled"))
    assert f" bank=on banks={n_banks} own_pools={n_own}" in line, line
    assert identical(result, ref), f"{down_types}, {serve}: a bank per layout changed the logits"
    c = report.counters
    assert c.lookups == c.hits + c.misses == n_layer * SPEC.n_expert_used * c.steps
    assert c.uploads == c.misses and c.evictions == c.misses - bank_slots(report) > 0


def test_a_layout_the_cpu_repacks_is_banked_on_the_host_beside_a_bank_the_device_serves(make_model, stream):
    """The CPU repacks Q4_0: layers whose ffn_down is Q4_0 are read from the model file, on the host's
    path, and the device serves the F16 layers itself. Each bank is served whole by one side, the
    device's LRU or the host's policy, and the logits equal the all-resident run's."""
    path = make_model(n_layer=4, down_types=("F16", "F16", "Q4_0", "Q4_0"))
    ref = resident(path, stream, n_prompt=1)
    model = on_lazy(path, cpu_moe=True, repack=True)
    if not cpu_repacks_weights(model):
        model.close()
        pytest.skip("this CPU repacks no Q4_0 weights")
    result, report, status, lines = decode(model, stream, banked(slots=4), n_prompt=1)
    model.close()
    assert (status.bank, status.bank_reason, status.serve) == ("on", "", "mixed")
    line = next(l for l in lines if l.startswith("expert pool status=enabled"))
    assert " bank=on banks=2 own_pools=0" in line, line
    assert {info.layer for info in report.pools if info.from_file} == {2, 3}
    assert identical(result, ref), "a bank on each path changed the logits"
    c = report.counters
    assert c.lookups == c.hits + c.misses == 4 * SPEC.n_expert_used * c.steps
    assert c.uploads == c.misses and c.evictions == c.misses - bank_slots(report) > 0


def test_layers_that_share_no_layout_keep_a_pool_each_and_say_why(make_model, stream):
    """Two layers whose ffn_down types differ: no two layers can share a tensor, so no bank."""
    path = make_model(n_layer=2, down_types=("F16", "Q8_0"))
    model = on_lazy(path, cpu_moe=True, repack=False)
    _, _, status, lines = decode(model, stream[:8], host_banked(slots=4), n_prompt=1)
    model.close()
    assert (status.bank, status.bank_reason) == ("off", "layout")
    assert any(" bank=off(layout)" in l for l in lines if l.startswith("expert pool status=enabled"))


@pytest.mark.parametrize("serve", ["device", "host"])
def test_two_devices_each_bank_their_own_layers_bit_identically(make_model, stream, serve):
    """Six layers over two devices: each device's bank holds the layers placed there, and says so,
    on the device's path and on the host's."""
    path = make_model(n_layer=6)
    ref_model = on_two_lazy(path)
    ref, *_ = decode(ref_model, stream, n_prompt=1)
    ref_model.close()
    model = on_two_lazy(path, cpu_moe=True)
    result, report, status, _ = decode(model, stream, BANKED[serve](slots=4), n_prompt=1)
    model.close()
    assert [(d.bank, d.bank_reason, d.serve) for d in report.devices] == [("on", "", serve)] * 2
    assert status.bank == "on" and {info.device for info in report.pools} == {0, 1}
    assert report.counters.evictions > 0
    assert identical(result, ref), f"a bank per device changed the logits on two devices ({serve})"


def _lru_bank_misses(steps: list[dict[int, np.ndarray]], n_expert: int, n_slots: int) -> dict[int, int]:
    """GGML_OP_MOE_FETCH's rule over one bank, re-derived: each layer's step in turn, a hit keeps its
    slot, each miss (in the order the ids first name it) takes the empty slot or the one least
    recently used by earlier steps, ties to the lowest index, never a slot this step uses."""
    owner = [-1] * n_slots
    last = [0] * n_slots
    slot_of: dict[int, int] = {}
    misses: dict[int, int] = {}
    clock = 0
    for step in steps:
        for layer in sorted(step):
            clock += 1
            keys = [layer * n_expert + int(e) for e in dict.fromkeys(step[layer].tolist())]
            used = {slot_of[k] for k in keys if k in slot_of}
            for k in keys:
                if k not in slot_of:
                    misses[layer] = misses.get(layer, 0) + 1
                    s = min((s for s in range(n_slots) if s not in used), key=lambda s: (owner[s] >= 0, last[s], s))
                    if owner[s] >= 0:
                        del slot_of[owner[s]]
                    owner[s], slot_of[k] = k, s
                used.add(slot_of[k])
            for k in keys:
                last[slot_of[k]] = clock
    return misses


def test_a_banks_misses_are_those_of_one_lru_over_every_layer(qwen3_model, stream):
    """The device's counts over a bank of 6 slots a layer are what one LRU over (layer, expert) with
    24 slots misses on the same routing (recorded from the host's path, which routes alike: the logits
    are the same), layer by layer; a pool per layer misses otherwise."""
    model = on_lazy(qwen3_model, cpu_moe=True)
    ctx = Context(model, pool=pool(slots=SPEC.n_expert, mode="copy"))
    recorder = PoolTraceRecorder(ctx)
    from pyllamapool.run.decode import run_context
    run_context(ctx, stream[:1], 0, teacher_tokens=stream[1:])
    ctx.close()
    steps = [{layer: ids for layer, (ids, _) in step.items()} for step in (recorder.steps + [recorder._current])
             if step]
    _, report, status, _ = decode(model, stream, banked(slots=6), n_prompt=1)
    _, per_layer_report, _, _ = decode(model, stream, on_device(slots=6, mode="copy", serve="device"), n_prompt=1)
    model.close()
    assert status.bank == "on" and len(steps) == report.counters.steps
    expected = _lru_bank_misses(steps, SPEC.n_expert, 6 * SPEC.n_layer)
    got = {info.layer: c.misses for info, c in zip(report.pools, report.pool_counters)}
    per_layer = {info.layer: c.misses for info, c in zip(per_layer_report.pools, per_layer_report.pool_counters)}
    assert got == expected and report.counters.misses == sum(expected.values())
    assert got != per_layer


@pytest.mark.parametrize("serve", ["device", "host"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_hot_set_warm_starts_a_bank_before_its_first_step(qwen3_model, stream, tmp_path, layout, serve, monkeypatch):
    """A warm start fills the bank's empty slots with each layer's experts, and the device's state or
    the host's policy says so: the first token, which selects exactly the file's experts, misses
    nothing, the run equals the all-resident one, and the evictions count every miss that found no
    empty slot."""
    queue_layout(layout, monkeypatch)
    ref = resident(qwen3_model, stream, n_prompt=1)
    model = on_lazy(qwen3_model, cpu_moe=True)
    hot = tmp_path / "hot.txt"
    first = Context(model, pool=pool(slots=6, mode="copy", hotset=hot))
    recorder = PoolTraceRecorder(first)
    first.decode([stream[0]])
    recorder.end_step()
    first.close()
    key = re.search(r"hotset=cold reason=no-file .* model=(\S+) slots=(\d+)", "\n".join(first.pool_lines()))
    hot.write_text(f"[hotset model={key.group(1)} slots={key.group(2)}]\n" + "".join(
        f"blk.{il} " + " ".join(f"{e}:1" for e in dict.fromkeys(ids.tolist())) + "\n"
        for il, (ids, _) in sorted(recorder.steps[0].items())))
    ctx = Context(model, pool=BANKED[serve](slots=6, hotset=hot))
    ctx.decode([stream[0]])
    logits = [ctx.logits()]  # the context has synchronized: the device's counts are the host's now
    c = ctx.pool_counters()
    for tok in stream[1:]:
        ctx.decode([tok])
        logits.append(ctx.logits())
    status, end = ctx.pool_status(), ctx.pool_counters()
    ctx.close()
    model.close()
    assert status.bank == "on" and any(l.startswith("expert pool hotset=loaded") for l in ctx.pool_lines())
    assert c.lookups > 0 and c.misses == 0  # the premise: a first step of hits only
    # the warm start filled 4 of each layer's 6 slots: the bank's misses filled its 8 empty slots and
    # evicted otherwise, whichever layer's expert they evicted
    warm = sum(len(set(ids.tolist())) for ids, _ in recorder.steps[0].values())
    assert end.misses > 6 * SPEC.n_layer and end.evictions == end.misses - (6 * SPEC.n_layer - warm)
    assert len(logits) == len(ref.logits) and all(np.array_equal(a, b) for a, b in zip(logits, ref.logits))


@pytest.mark.parametrize("serve", ["device", "host"])
def test_mec_auto_and_a_weighted_plan_run_over_a_bank_bit_identically(qwen3_model, stream, tmp_path, serve):
    """-mec auto's arbiter stands the bank down or keeps it as it does per-layer pools, and a weighted
    plan's per-layer shares add up to the bank: both stay the all-resident run's, on either path."""
    ref = resident(qwen3_model, stream, n_prompt=1)
    profile = tmp_path / "profile.txt"
    profile.write_text("blk.0 3\nblk.1 1\nblk.2 1\nblk.3 1\n")
    model = on_lazy(qwen3_model, cpu_moe=True)
    for config in (BANKED[serve](slots=4, gate="auto"), BANKED[serve](slots=6, profile=profile)):
        result, report, status, _ = decode(model, stream, config, n_prompt=1)
        assert status.bank == "on" and report.counters.steps > 0, config
        assert identical(result, ref), f"{config}: the logits changed over a bank"
    model.close()
