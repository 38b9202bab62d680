"""Pool checks on a real GPU backend, run in a process of their own with the Vulkan build loaded
(PYLLAMAPOOL_LIB_DIR) on Mesa's lavapipe: `python tests/vulkan_worker.py CHECK MODEL` prints one JSON
object. test_vulkan.py runs each check and asserts on what it reports.

Every comparison is against the stock host-copy path on the same device: experts in host memory,
copied to the device and computed there for every step (GGML_OP_OFFLOAD_MIN_BATCH=1 offloads even
one-token steps). That is what a pooled expert must equal bit for bit: the same kernels on the same
device, only the copy skipped. The all-resident run is reported beside it.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

os.environ["GGML_OP_OFFLOAD_MIN_BATCH"] = "1"

from pyllamapool.run.decode import run_context  # noqa: E402
from pyllamapool.binding.llama import Context, Model, devices  # noqa: E402
from pyllamapool.binding.pool import PoolConfig  # noqa: E402
from pyllamapool.run.testmodel import ModelSpec, StreamSpec, token_stream  # noqa: E402

STREAM = token_stream(ModelSpec(), StreamSpec(n_tokens=48, seed=3))
CHURN = np.random.default_rng(0).integers(0, ModelSpec().n_vocab, size=120).tolist()


def same(a: list, b: list) -> bool:
    return len(a) == len(b) > 0 and all(np.array_equal(x, y) for x, y in zip(a, b))


def greedy(model: Model, stream, pool: PoolConfig | None = None):
    ctx = Context(model, pool=pool)
    result = run_context(ctx, stream[:8], 0, teacher_tokens=stream[8:], keep_logits=True)
    counters, status = ctx.pool_counters(), ctx.pool_status(0) if pool else None
    ctx.close()
    return result.logits, counters, status


def sequences(model: Model, seqs, pool: PoolConfig | None = None):
    ctx = Context(model, n_seq_max=len(seqs), pool=pool)
    out = []
    for i in range(len(seqs[0])):
        ctx.decode_batch([s[i] for s in seqs], [i] * len(seqs), list(range(len(seqs))), [True] * len(seqs))
        out.append(np.concatenate([ctx.logits(q) for q in range(len(seqs))]))
    counters = ctx.pool_counters()
    ctx.close()
    return out, counters


def report(counters, status=None) -> dict:
    out = {"lookups": counters.lookups, "misses": counters.misses, "evictions": counters.evictions,
           "steps": counters.steps, "gated_steps": counters.gated_steps, "gate_closures": counters.gate_closures}
    if status is not None:
        out.update(enabled=status.enabled, reason=status.reason, device=status.device)
    return out


def check_parity(path: str) -> dict:
    host_copy = Model(path, n_gpu_layers=99, n_cpu_moe=99)
    stock, *_ = greedy(host_copy, STREAM)
    pooled, counters, status = greedy(host_copy, STREAM, PoolConfig(slots=4, mode="copy"))
    host_copy.close()
    resident = Model(path, n_gpu_layers=99)
    ref, *_ = greedy(resident, STREAM)
    resident.close()
    return {"devices": [d.name for d in devices()], "pooled_equals_host_copy": same(pooled, stock),
            "resident_equals_host_copy": same(ref, stock), "n_steps": len(pooled), **report(counters, status)}


def check_pinned(path: str) -> dict:
    """-lm none: host experts in Vulkan_Host (pinned) memory, which the stream path, the default for them,
    copies from without a gather into staging; with the copy from the pinned host tensors at the same place in the upload
    queue's order, copy mode stays the host-copy path's bits."""
    model = Model(path, n_gpu_layers=99, n_cpu_moe=99, use_mmap=False)
    stock, *_ = greedy(model, STREAM)
    pooled, counters, status = greedy(model, STREAM, PoolConfig(slots=4, mode="copy"))
    model.close()
    return {"pooled_equals_host_copy": same(pooled, stock), "uploads_path": status.uploads,
            "uploads": counters.uploads, **report(counters, status)}


def check_two_sequences(path: str) -> dict:
    model = Model(path, n_gpu_layers=99, n_cpu_moe=99)
    seqs = [STREAM[:24], STREAM[24:48]]
    stock, _ = sequences(model, seqs)
    pooled, counters = sequences(model, seqs, PoolConfig(slots=8, mode="copy"))
    model.close()
    return {"pooled_equals_host_copy": same(pooled, stock), **report(counters)}


def check_gate(path: str) -> dict:
    """Churn closes the gate: gated steps take the stock path, the graph is rebuilt on each verdict."""
    model = Model(path, n_gpu_layers=99, n_cpu_moe=99)
    stock, *_ = greedy(model, CHURN)
    gated, counters, status = greedy(model, CHURN, PoolConfig(slots=6, gate="yield", mode="copy"))
    model.close()
    return {"pooled_equals_host_copy": same(gated, stock), **report(counters, status)}


def check_two_contexts(path: str) -> dict:
    model = Model(path, n_gpu_layers=99, n_cpu_moe=99)
    stock, *_ = greedy(model, STREAM)
    c1 = Context(model, pool=PoolConfig(slots=4, mode="copy"))
    c2 = Context(model, pool=PoolConfig(slots=8, mode="copy"))
    r1, r2 = [], []
    for ctx, out in ((c1, r1), (c2, r2)):
        ctx.decode(STREAM[:8])
        out.append(ctx.logits())
    for tok in STREAM[8:]:  # interleaved: one context, then the other
        for ctx, out in ((c1, r1), (c2, r2)):
            ctx.decode([tok])
            out.append(ctx.logits())
    counters = [c1.pool_counters(), c2.pool_counters()]
    c1.close()
    c2.close()
    model.close()
    return {"pooled_equals_host_copy": same(r1, stock) and same(r2, stock),
            "evictions": [c.evictions for c in counters]}


def check_hybrid(path: str) -> dict:
    """Hybrid mode on a real GPU backend: the device's share runs in Vulkan shaders (slot table
    lookup, the zero padding slot), the CPU's share in ggml-cpu, pinned there even though
    GGML_OP_OFFLOAD_MIN_BATCH=1 would offload it. The two sides' numerics differ, so the logits
    are compared with the host-copy path within a tolerance: an expert counted twice, or a padding
    slot that is not zero, is far outside it."""
    model = Model(path, n_gpu_layers=99, n_cpu_moe=99)
    stock, *_ = greedy(model, STREAM)
    hybrid, counters, status = greedy(model, STREAM, PoolConfig(slots=6, mode="hybrid"))
    model.close()
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(hybrid, stock)]
    scale = float(np.mean([np.std(a) for a in stock]))
    return {"mode": status.mode, "n_steps": len(hybrid), "max_abs_diff": max(diffs), "logit_std": scale,
            "finite": all(bool(np.isfinite(a).all()) for a in hybrid),
            "argmax_equal": sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(hybrid, stock)),
            "cpu_experts": counters.cpu_experts, "device_experts": counters.device_experts,
            "uploads": counters.uploads, **report(counters, status)}


def check_prefill(path: str) -> dict:
    """A prompt batch takes the stock path, whose offloaded MUL_MAT_IDs the scheduler feeds by copying
    the used experts to the device: the ones the pool holds come from its slots, device to device. The
    bytes are the host's, so every logit equals the run without the pool."""
    model = Model(path, n_gpu_layers=99, n_cpu_moe=99)
    runs = {}
    for name, pool in (("stock", None), ("pooled", PoolConfig(slots=8, mode="copy"))):
        ctx = Context(model, n_ctx=256, pool=pool)
        logits = []
        for tok in STREAM[:12]:               # decode fills the slots
            ctx.decode([tok])
            logits.append(ctx.logits())
        before = ctx.pool_counters() if pool else None
        ctx.decode(STREAM[12:48])             # 36 tokens: beyond the pool's batches, the stock path
        logits.append(ctx.logits())
        runs[name] = (logits, before, ctx.pool_counters() if pool else None)
        ctx.close()
    model.close()
    (stock, _, _), (pooled, before, after) = runs["stock"], runs["pooled"]
    return {"pooled_equals_host_copy": same(pooled, stock), "bypassed": after.bypassed_steps - before.bypassed_steps,
            "evictions_in_prefill": after.evictions - before.evictions,
            "prefill_device_bytes": after.prefill_device_bytes, "prefill_host_bytes": after.prefill_host_bytes}


def check_uploads(path: str) -> dict:
    """Both upload paths at heavy eviction (slots at top-k). Copy mode computes every expert on the
    device, so either path must equal the host-copy path bit for bit; hybrid mode's split between the
    CPU and the device follows when uploads land, so it is checked within the two backends' rounding."""
    model = Model(path, n_gpu_layers=99, n_cpu_moe=99)
    stock, *_ = greedy(model, STREAM)
    out = {}
    for mode in ("copy", "hybrid"):
        for uploads in (None, "inline", "stream"):
            logits, counters, status = greedy(model, STREAM, PoolConfig(slots=4, mode=mode, uploads=uploads))
            key = f"{mode}-{uploads or 'default'}"
            out[key] = {"path": status.uploads, "equals_host_copy": same(logits, stock),
                        "max_abs_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(logits, stock)),
                        "block_us": counters.block_us, "tokens": counters.tokens, "syncs": counters.syncs,
                        "uploads": counters.uploads, **report(counters, status)}
    model.close()
    out["logit_std"] = float(np.mean([np.std(a) for a in stock]))
    return out


def check_prefetch(path: str) -> dict:
    """Hybrid's prefetch on a real GPU backend: Vulkan has events, so uploads asked for on the stream
    path take it, and auto prefetches by itself; on uploads every predicted expert a slot can take. The
    prefetched experts' copies run on a queue of their own while lavapipe computes: a step that read a
    slot before its copy landed, or through a table still pointing at a victim, computes with another
    expert's weights, far outside the two backends' rounding."""
    model = Model(path, n_gpu_layers=99, n_cpu_moe=99)
    stock, *_ = greedy(model, STREAM)
    out = {"logit_std": float(np.mean([np.std(a) for a in stock]))}
    for prefetch in ("auto", "on"):
        ctx = Context(model, pool=PoolConfig(slots=6, mode="hybrid", prefetch=prefetch, uploads="stream"))
        logits = run_context(ctx, STREAM[:8], 0, teacher_tokens=STREAM[8:], keep_logits=True).logits
        c, status = ctx.pool_counters(), ctx.pool_status(0)
        ctx.close()
        out[prefetch] = {"uploads_path": status.uploads, "prefetch": status.prefetch, "prefetched": c.prefetched,
                         "verdict": next((l for l in ctx.pool_lines() if l.startswith("expert pool prefetch=auto")), ""),
                         "prefetch_hits": c.prefetch_hits, "predicted": c.predicted, "precision": c.prefetch_precision,
                         "finite": all(bool(np.isfinite(a).all()) for a in logits),
                         "max_abs_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(logits, stock)),
                         **report(c, status)}
    model.close()
    return out


def check_bank(path: str) -> dict:
    """One bank for the layers: Vulkan runs no GGML_OP_MOE_FETCH, so the host's policy serves it, its
    uploads on either path, a step's misses taking slots other layers' experts held; then two sequences
    a batch over it."""
    model = Model(path, n_gpu_layers=99, n_cpu_moe=99)
    stock, *_ = greedy(model, STREAM)
    out = {}
    for uploads in ("inline", "stream"):
        ctx = Context(model, pool=PoolConfig(slots=4, mode="copy", bank="on", uploads=uploads))
        result = run_context(ctx, STREAM[:8], 0, teacher_tokens=STREAM[8:], keep_logits=True)
        rep, status = ctx.pool_report(per_pool=True), ctx.pool_status(0)
        ctx.close()
        out[uploads] = {"equals_host_copy": same(result.logits, stock), "bank": status.bank, "serve": status.serve,
                        "path": status.uploads,
                        "bank_slots": sum({info.layer: info.slots for info in rep.pools}.values()),
                        **report(rep.counters, status)}
    seqs = [STREAM[:24], STREAM[24:48]]
    stock_seqs, _ = sequences(model, seqs)
    pooled_seqs, counters = sequences(model, seqs, PoolConfig(slots=8, mode="copy", bank="on"))
    model.close()
    out["two-sequences"] = {"equals_host_copy": same(pooled_seqs, stock_seqs), **report(counters)}
    return out


CHECKS = {"bank": check_bank, "prefetch": check_prefetch, "uploads": check_uploads, "parity": check_parity, "prefill": check_prefill, "hybrid": check_hybrid, "pinned": check_pinned, "two-sequences": check_two_sequences,
          "gate": check_gate, "two-contexts": check_two_contexts}

if __name__ == "__main__":
    print(json.dumps(CHECKS[sys.argv[1]](sys.argv[2])))
