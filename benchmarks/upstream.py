#!/usr/bin/env python3
"""The expert pool against llama.cpp's own expert cache (`--moe-cache-mib`), in one binary, on one
device, over one model and one token stream: stock `--cpu-moe`, upstream's cache at several sizes, and
the pool's copy and hybrid modes and its bank (one bank of slots for the layers the device serves,
`LLAMA_MOE_POOL_BANK=on`: the device's path serves it where the device can, else the host's) given
the same device memory.

Equal memory: each pool size is set in slots per expert tensor; the pool's own bytes (its memory
breakdown) are converted to MiB and upstream's cache is given that, rounded up to a whole MiB (its
flag takes MiB), so upstream never gets less.

    python benchmarks/upstream.py [--device rpc|vulkan|lazy] [--tokens 96] [--repeats 3] [--slots 4,8,16]
        [--json out.json] [--plot out.png] [--short]

Per run: decode t/s (median over repeats), hit rate, KiB uploaded per token, host waits per token (every
wait of the decoding thread for a device, in the scheduler and in its copy callback), and the host ms per
token spent in the copy callback, where upstream's cache reads the router's ids and uploads its misses.
`parity` says whether every step's logits equal the stock run's bit for bit, else how far they are
(max |logit difference|). On the loopback devices every design must be bit-identical: all experts run
the CPU's kernels. On Vulkan stock computes the experts on the CPU and the caches on the device, with
the device's kernels, so small differences are expected there; pooled experts against the stock
host-copy path on the same device are checked bit for bit in tests/test_vulkan.py. The pool's own ops
run inside the graph; their time is in t/s, not in the callback column.

--device vulkan needs the Vulkan build (python build.py --target vulkan --prefix build/vulkan-install)
and runs on Mesa's lavapipe in a process of its own. Loopback devices share the host's cores and
memory bandwidth: the figures rank designs by what they do (uploads, waits), not by PCIe speed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VULKAN_LIB = ROOT / "build" / "vulkan-install" / "pyllamapool" / "lib"


def run_args(doc: str, device: str, tokens: int, slots: str) -> argparse.ArgumentParser:
    """The options both side-by-side benchmarks take (device, tokens, repeats, slots, JSON out)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("rpc", "vulkan", "lazy"), default=device)
    parser.add_argument("--tokens", type=int, default=tokens, help="decode steps (teacher-forced)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slots", default=slots, help="pool sizes, slots per expert tensor")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    return parser


def check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace, min_slots: int) -> None:
    """--slots into args.slot_list, each at least min_slots; tokens and repeats at least 1."""
    try:
        args.slot_list = [int(s) for s in args.slots.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--slots {args.slots!r}: expected whole numbers separated by commas, e.g. 4,8,16")
    if not args.slot_list or min(args.slot_list) < min_slots:
        parser.error(f"--slots {args.slots!r}: every size must be at least {min_slots} slot(s)")
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be at least 1")


def parse_args(argv=None) -> argparse.Namespace:
    parser = run_args(__doc__, "rpc", 96, "4,8,16")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here")
    parser.add_argument("--short", action="store_true", help="a quick run: 16 tokens, 1 repeat, 8 slots")
    args = parser.parse_args(argv)
    check_run_args(parser, args, 1)
    if args.short:
        args.tokens, args.repeats, args.slot_list = 16, 1, [8]
    return args


def spec():
    from pyllamapool.run.testmodel import ModelSpec
    return ModelSpec(n_expert=32, n_expert_used=4, n_embd=256, n_ff_exp=256)


def open_model(device: str, path):
    """The model with its experts in host memory and every layer on `device` (rpc, lazy or vulkan):
    (model, RPC server or None, the device size to emulate in MiB or 0 for the device's own)."""
    from pyllamapool.binding.llama import Model, add_rpc_server, lazy_copy_device
    from pyllamapool.run.rpc import start_rpc_server

    if device == "rpc":
        server = start_rpc_server()
        add_rpc_server(server.endpoint)
        return Model(path, n_gpu_layers=99, rpc=[server.endpoint], cpu_moe=True), server, 65536
    if device == "lazy":
        lazy_copy_device()
        return Model(path, n_gpu_layers=99, cpu_moe=True, lazy_copy=True), None, 65536
    return Model(path, n_gpu_layers=99, cpu_moe=True), None, 0


@contextlib.contextmanager
def opened_model(device: str, path):
    """open_model as a context: (model, device size to emulate in MiB or 0), the model closed and
    its RPC server stopped on leaving."""
    model, server, device_mib = open_model(device, path)
    try:
        yield model, device_mib
    finally:
        model.close()
        if server is not None:
            server.stop()


def relaunch_on_vulkan(script: str, argv) -> int | None:
    """--device vulkan needs the Vulkan build's libraries: run `script` again in a process of its own
    with them loaded. None: this process already has them."""
    if os.environ.get("PYLLAMAPOOL_LIB_DIR") == str(VULKAN_LIB):
        return None
    if not (VULKAN_LIB / "libllama.so").exists():
        print(f"no Vulkan build in {VULKAN_LIB}: python build.py --target vulkan --prefix build/vulkan-install",
              file=sys.stderr)
        return 2
    env = {**os.environ, "PYLLAMAPOOL_LIB_DIR": str(VULKAN_LIB), "GGML_VK_VISIBLE_DEVICES": "0",
           "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, script, *(argv if argv is not None else sys.argv[1:])],
                          env=env).returncode


def same_logits(a: list, b: list) -> bool:
    """Two runs' logits are bit-identical, step by step (and they ran as many steps)."""
    import numpy as np
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def one_run(model, stream, *, pool=None, cache_mib: int = 0) -> dict:
    """One context, prompt then teacher-forced decode; what it did and its logits."""
    from pyllamapool.run.decode import run_context
    from pyllamapool.binding.llama import Context

    ctx = Context(model, pool=pool, moe_cache_mib=cache_mib)
    waits, callback_ms = [], []

    def on_step(_i):
        waits.append(ctx.host_syncs())
        callback_ms.append(ctx.copy_callback_ms())

    result = run_context(ctx, stream[:8], 0, teacher_tokens=stream[8:], keep_logits=True, on_step=on_step)
    n = len(result.step_latency_ms)
    row = {"tps": result.decode_tokens_per_s, "waits": sum(waits) / n, "callback_ms": sum(callback_ms) / n}
    if pool is not None:
        c = ctx.pool_counters()
        status = ctx.pool_status()
        row["bank"] = status.bank if status.bank == "on" else f"off({status.bank_reason})" if status.bank_reason else "off"
        pool_bytes = sum(r.pool for r in ctx.memory())
        per_layer = len(ctx.pool_report(per_pool=True).pools) // spec().n_layer  # gate, up, down: a lookup each
        row.update(hit=c.hit_rate, kib=c.copy_bytes / n / 1024, pool_bytes=pool_bytes, pool_mib=pool_bytes / 2**20,
                   cpu=c.cpu_experts / per_layer / n, placed=c.placed / per_layer / n,
                   prefetched=c.prefetched / per_layer / n, prefetch_hits=c.prefetch_hits / per_layer / n,
                   precision=c.prefetch_precision, recall=c.prefetch_recall)
        ctx.close()
    else:
        ctx.close()
        stats = ctx.moe_cache_stats()
        row.update(cpu=float(spec().n_layer * spec().n_expert_used) if not stats else 0.0, placed=0.0,
                   hit=stats.hit_rate if stats else 0.0,
                   kib=stats.uploaded_mib * 1024 / n if stats else 0.0,
                   pool_mib=stats.size_mib if stats else 0.0)
    row["logits"] = result.logits
    return row


def measure(args: argparse.Namespace) -> list[dict]:
    import numpy as np

    from pyllamapool.binding.moecache import equal_memory_mib
    from pyllamapool.binding.pool import PoolConfig
    from pyllamapool.run.testmodel import StreamSpec, cached_model, token_stream

    path = cached_model(spec())
    stream = token_stream(spec(), StreamSpec(n_tokens=args.tokens + 8, seed=3))
    model, server, device_mib = open_model(args.device, path)
    try:
        def repeat(label, **kw) -> dict:
            runs = [one_run(model, stream, **kw) for _ in range(args.repeats)]
            row = {k: v for k, v in runs[0].items() if k != "logits"}
            row["tps"] = statistics.median(r["tps"] for r in runs)
            row["logits"] = runs[0]["logits"]
            row["label"] = label
            print({k: v for k, v in row.items() if k != "logits"}, file=sys.stderr, flush=True)
            return row

        rows = [dict(repeat("stock"), design="stock", slots=0, cache_mib=0)]
        for slots in args.slot_list:
            pooled = {}
            for mode in ("copy", "hybrid"):
                pool = PoolConfig(slots=slots, mode=mode, **({"device_mib": device_mib} if device_mib else {}))
                pooled[mode] = dict(repeat(f"pool {mode} {slots}", pool=pool), design=f"pool {mode}",
                                    slots=slots, cache_mib=0)
            # one bank for the layers (patch 0046), on whichever path serves the device; a refusal says why
            bank = PoolConfig(slots=slots, mode="copy", bank="on", **({"device_mib": device_mib} if device_mib else {}))
            banked = repeat(f"pool bank {slots}", pool=bank)
            banked = dict(banked, design="pool bank" if banked["bank"] == "on" else f"pool bank {banked['bank']}",
                          slots=slots, cache_mib=0)
            mib = equal_memory_mib(pooled["copy"]["pool_bytes"])
            rows.append(dict(repeat(f"upstream {mib} MiB", cache_mib=mib), design="upstream cache",
                             slots=slots, cache_mib=mib))
            rows += [pooled["copy"], pooled["hybrid"], banked]
        reference = rows[0]["logits"]
        for r in rows:
            same_steps = len(r["logits"]) == len(reference)
            r["parity"] = same_logits(r["logits"], reference)
            r["max_abs_diff"] = float(max(np.max(np.abs(a - b)) for a, b in zip(r["logits"], reference))) \
                if same_steps else float("inf")
        for r in rows:
            del r["logits"]
    finally:
        model.close()
        if server is not None:
            server.stop()
    return rows


def verdict(r: dict) -> str:
    return "bit-identical" if r["parity"] else f"max diff {r['max_abs_diff']:.2g}"


def table(rows: list[dict], device: str) -> str:
    stock = rows[0]["tps"] or 1.0
    out = [f"| design ({device}) | slots | device MiB | t/s | x stock | hit rate | KiB uploaded / token | "
           "host waits / token | callback ms / token | parity |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        out.append(f"| {r['design']} | {r['slots'] or '-'} | {r['pool_mib']:.1f} | {r['tps']:.0f} | "
                   f"{r['tps'] / stock:.2f} | {r['hit']:.1%} | {r['kib']:.0f} | {r['waits']:.1f} | "
                   f"{r['callback_ms']:.2f} | {verdict(r)} |")
    return "\n".join(out)


def plot(rows: list[dict], device: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    stock = rows[0]["tps"]
    for design, marker in (("upstream cache", "o"), ("pool copy", "s"), ("pool hybrid", "^")):
        pts = [r for r in rows if r["design"] == design]
        ax1.plot([r["pool_mib"] for r in pts], [r["tps"] / stock for r in pts], marker=marker, label=design)
        ax2.plot([r["pool_mib"] for r in pts], [r["kib"] for r in pts], marker=marker, label=design)
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--", label="stock")
    ax1.set(xlabel="device MiB", ylabel="decode t/s / stock", title=f"speed ({device})")
    ax2.set(xlabel="device MiB", ylabel="KiB uploaded / token", title="uploads")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run_side_by_side(script: str, args: argparse.Namespace, argv, measure, table, then=None) -> int:
    """What each side-by-side benchmark's main does: on --device vulkan run `script` again with the
    Vulkan build's libraries, else measure, print the table, write --json, then `then(rows)`."""
    if args.device == "vulkan":
        rc = relaunch_on_vulkan(script, argv)
        if rc is not None:
            return rc
    rows = measure(args)
    print(table(rows, args.device))
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "tokens": args.tokens, "repeats": args.repeats,
                                         "rows": rows}, indent=2) + "\n")
    if then is not None:
        then(rows)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_side_by_side(__file__, args, argv, measure, table,
                            lambda rows: plot(rows, args.device, args.plot) if args.plot else None)


if __name__ == "__main__":
    sys.exit(main())
