#!/usr/bin/env python3
"""The GPU check: what the expert pool does on a real card, measured side by side in one process.

On a CUDA or ROCm machine, two commands (each fits a 10-minute slot on 16 cores):

    python benchmarks/gpu_check.py build --target cuda --arch 90      # or --target hip --arch gfx906
    python benchmarks/gpu_check.py run --out gpu-check.json           # a few-GB synthetic MoE

`build` makes a trimmed build (no FlashAttention kernels) into build/gpu-check. `run` generates a
synthetic MoE at a realistic geometry (default 24 layers, 128 experts, top-8, Q4_K experts) and measures:
host -> device upload bandwidth (pageable and pinned) and per-copy latency; decode t/s of the stock
--n-cpu-moe path and of copy mode at several -mec on emulated 16 GB and 24 GB cards
(LLAMA_MOE_POOL_DEVICE_MIB), with hit rate and bytes copied per token; the host's cost per expert
computed on the CPU; and parity (pool vs the stock host-copy path on the GPU, bit for bit). It writes one
JSON file (schema pyllamapool.gpu-check/1) and prints a table.

    python benchmarks/gpu_check.py run --testbed --geometry tiny      # CPU-only: the loopback RPC device

The testbed mode runs the same code on the RPC device (CI runs it, so the script is never untested);
its timings are loopback and shared cores, not a GPU. Copy and hybrid mode are measured at each -mec,
and beside them llama.cpp's own expert cache (--moe-cache-mib) given the copy-mode pool's device bytes
(rounded up to whole MiB), so the four designs meet at equal memory in one process.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PREFIX = ROOT / "build" / "gpu-check"
SCHEMA = "pyllamapool.gpu-check/1"

GEOMETRIES = {
    # name: ModelSpec changes; "realistic" is ~5 GB of Q4_K experts (a 30B-A3B-like layer shape)
    "realistic": dict(n_layer=24, n_embd=2048, n_head=16, n_head_kv=4, n_expert=128, n_expert_used=8,
                      n_ff_exp=512, n_vocab=4096, expert_type="Q4_K"),
    # ~2 GB of Q4_K experts of a 30B-A3B expert's size (2.6 MB each): made in about a minute on 16 cores
    "medium": dict(n_layer=12, n_embd=2048, n_head=16, n_head_kv=4, n_expert=64, n_expert_used=8,
                   n_ff_exp=768, n_vocab=4096, expert_type="Q4_K"),
    "small": dict(n_layer=8, n_embd=1024, n_head=8, n_head_kv=2, n_expert=64, n_expert_used=8,
                  n_ff_exp=256, n_vocab=2048, expert_type="Q4_K"),
    "tiny": dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_expert=16, n_expert_used=4,
                 n_ff_exp=256, n_vocab=512, expert_type="Q4_K"),
}


def build(args) -> int:
    argv = [sys.executable, str(ROOT / "build.py"), "--target", args.target, "--prefix", str(PREFIX),
            "--build-dir", str(ROOT / "build" / f"gpu-check-{args.target}")]
    if args.arch:
        argv += ["--arch", args.arch]
    if args.jobs:
        argv += ["--jobs", str(args.jobs)]
    if args.source:
        argv += ["--source", args.source]
    if args.target == "cuda":
        argv += ["-D", "GGML_CUDA_FA=OFF"]  # the check needs no FlashAttention kernels: half the build
    print("$", " ".join(argv), flush=True)
    return subprocess.call(argv)


# --------------------------------------------------------------------------------------------
# measurements


def upload_bandwidth(device_name: str, mib: int = 256, repeats: int = 5) -> dict:
    """Host -> device copies through the backend API: big copies from pageable and from pinned host
    memory (GB/s), and the latency of one small copy."""
    import numpy as np

    from pyllamapool.llama import backend

    ffi, lib = backend()
    dev = lib.ggml_backend_dev_by_name(device_name.encode())
    size = mib << 20
    buf = lib.ggml_backend_buft_alloc_buffer(lib.ggml_backend_dev_buffer_type(dev), size)
    ctx = lib.ggml_init({"mem_size": 4 * lib.ggml_tensor_overhead(), "mem_buffer": ffi.NULL, "no_alloc": True})
    tensor = lib.ggml_new_tensor_1d(ctx, lib.GGML_TYPE_I8, size)
    lib.ggml_backend_tensor_alloc(buf, tensor, lib.ggml_backend_buffer_get_base(buf))
    pageable = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    sources = {"pageable": ffi.cast("void *", pageable.ctypes.data)}
    host_buft = lib.ggml_backend_dev_host_buffer_type(dev)
    pinned_buf = lib.ggml_backend_buft_alloc_buffer(host_buft, size) if host_buft != ffi.NULL else ffi.NULL
    if pinned_buf != ffi.NULL:
        base = lib.ggml_backend_buffer_get_base(pinned_buf)
        ffi.memmove(base, ffi.from_buffer(pageable), size)
        sources["pinned"] = base
    out: dict = {"mib": mib}
    for name, src in sources.items():
        lib.ggml_backend_tensor_set(tensor, src, 0, size)  # first touch
        t = time.perf_counter()
        for _ in range(repeats):
            lib.ggml_backend_tensor_set(tensor, src, 0, size)
        out[f"{name}_gb_s"] = repeats * size / (time.perf_counter() - t) / 1e9
    small, n = 64 << 10, 200
    t = time.perf_counter()
    for i in range(n):
        lib.ggml_backend_tensor_set(tensor, sources["pageable"], (i * small) % (size - small), small)
    out["copy_latency_us_64k"] = (time.perf_counter() - t) / n * 1e6
    if pinned_buf != ffi.NULL:
        lib.ggml_backend_buffer_free(pinned_buf)
    lib.ggml_free(ctx)
    lib.ggml_backend_buffer_free(buf)
    return out


def teacher_run(session, stream, pool, moe_cache_mib: int = 0):
    from pyllamapool.pool import PoolConfig

    run = session.run(stream[:8], 0, pool=pool or PoolConfig(), teacher_tokens=stream[8:],
                      keep_logits=pool is not None, moe_cache_mib=moe_cache_mib)
    return run


def upstream_row(run, n_tokens: int, card_mib: int, cache_mib: int, slots: int) -> dict:
    """llama.cpp's own cache: its figures come from its log (hits, misses, MiB uploaded)."""
    st = run.moe_cache
    return {"mode": "upstream", "card_mib": card_mib, "slots": slots, "cache_mib": cache_mib,
            "status": "enabled" if st else "disabled", "reason": "" if st else "no cache in the log",
            "actual_slots": st.slots if st else 0, "limited_by": f"{cache_mib} MiB",
            "decode_tps": run.decode.decode_tokens_per_s, "hit_rate": st.hit_rate if st else 0.0,
            "copy_bytes_per_token": (st.uploaded_mib * 2**20 / max(1, n_tokens)) if st else 0.0,
            "evictions": 0, "cpu_experts": 0, "deferred": 0, "syncs_per_token": 0.0}


def decode_row(label: str, run, n_tokens: int, card_mib: int | None) -> dict:
    c, s = run.counters, run.status
    return {"mode": label, "card_mib": card_mib, "slots": run.config.slot_list[0] if run.config.slots else 0,
            "status": "enabled" if s.enabled else "disabled", "reason": s.reason, "actual_slots": s.actual_slots,
            "limited_by": s.limited_by, "decode_tps": run.decode.decode_tokens_per_s, "hit_rate": c.hit_rate,
            "copy_bytes_per_token": c.copy_bytes / max(1, n_tokens), "evictions": c.evictions,
            "cpu_experts": c.cpu_experts, "deferred": c.deferred, "syncs_per_token": c.syncs_per_token,
            "uploads": s.uploads, "block_ms_per_token": c.block_us_per_token / 1000.0}


def parity(args) -> dict:
    import numpy as np

    from pyllamapool.llama import add_rpc_server
    from pyllamapool.offload import Offload
    from pyllamapool.pool import PoolConfig
    from pyllamapool.rpc import start_rpc_server
    from pyllamapool.session import PoolSession
    from pyllamapool.testmodel import ModelSpec, StreamSpec, cached_model, token_stream

    spec = ModelSpec(**{**GEOMETRIES[args.geometry], **({"expert_type": args.expert_type} if args.expert_type else {})})
    model_path = cached_model(spec)
    stream = token_stream(spec, StreamSpec(n_tokens=args.tokens + 8, seed=11))
    heavy = PoolConfig(slots=spec.n_expert_used, device_mib=max(args.card_mib), mode="copy")
    with ExitStack() as stack:
        rpc: tuple[str, ...] = ()
        if args.testbed:
            server = stack.enter_context(start_rpc_server())
            rpc = (server.endpoint,)
            add_rpc_server(server.endpoint)
        with PoolSession(model_path, Offload(rpc=rpc, cpu_moe=True, n_ctx=2048)) as offloaded:
            pooled = offloaded.run(stream[:8], 0, pool=heavy, teacher_tokens=stream[8:], keep_logits=True)
            reference = None if args.testbed else offloaded.run(stream[:8], 0, teacher_tokens=stream[8:],
                                                               keep_logits=True)
        if reference is None:
            with PoolSession(model_path, Offload(rpc=rpc, n_ctx=2048)) as resident_session:
                reference = resident_session.run(stream[:8], 0, teacher_tokens=stream[8:], keep_logits=True)
    a, b = pooled.decode.logits, reference.decode.logits
    return {
        "against": "all-resident (testbed)" if args.testbed else "stock host-copy path on the device",
        "bit_identical": len(a) == len(b) > 0 and all(np.array_equal(x, y) for x, y in zip(a, b)),
        "max_abs_diff": float(max(np.max(np.abs(x - y)) for x, y in zip(a, b))) if len(a) == len(b) else None,
        "evictions": pooled.counters.evictions, "steps": len(a), "expert_type": spec.expert_type}


def parity_in_subprocess(args, geometry: str, expert_type: str | None = None, **env: str) -> dict:
    argv = [sys.executable, __file__, "run", "--parity-only", "--geometry", geometry,
            "--tokens", str(args.tokens), "--card-mib", ",".join(map(str, args.card_mib))]
    argv += ["--testbed"] if args.testbed else []
    argv += ["--expert-type", expert_type] if expert_type else []
    result = subprocess.run(argv, capture_output=True, text=True,
                            env={**os.environ, "GGML_OP_OFFLOAD_MIN_BATCH": "1", **env})
    if result.returncode != 0:
        return {"against": None, "bit_identical": False, "expert_type": expert_type, "error": result.stderr[-2000:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def parity_by_type(args) -> list[dict]:
    """Every expert type on the tiny geometry. A type that differs is run again with the CUDA
    backend's op fusion off: on the H200, F16/F32 experts differed (quantized ones did not), and the
    suspect is the gate/up MUL_MAT_ID + GLU fusion, which picks another kernel for float types
    (mmvf fused, mmf alone) and may apply to one path only."""
    rows = []
    for expert_type in args.parity_types:
        row = parity_in_subprocess(args, "tiny", expert_type)
        if not row["bit_identical"] and not args.testbed:
            row["fusion_off"] = parity_in_subprocess(args, "tiny", expert_type, GGML_CUDA_DISABLE_FUSION="1")
        rows.append(row)
    return rows


def run(args) -> int:
    if not args.testbed and (PREFIX / "pyllamapool" / "lib" / "libllama.so").exists():
        os.environ.setdefault("PYLLAMAPOOL_LIB_DIR", str(PREFIX / "pyllamapool" / "lib"))
    from rich.console import Console
    from rich.table import Table

    from pyllamapool.llama import add_rpc_server, devices
    from pyllamapool.offload import Offload
    from pyllamapool.pool import PoolConfig
    from pyllamapool.rpc import start_rpc_server
    from pyllamapool.moecache import equal_memory_mib
    from pyllamapool.session import PoolSession, has_accelerator
    from pyllamapool.testmodel import ModelSpec, StreamSpec, cached_model, token_stream

    console = Console(stderr=True)
    spec = ModelSpec(**GEOMETRIES[args.geometry])
    t = time.perf_counter()
    model_path = cached_model(spec)
    console.print(f"model {model_path} ({model_path.stat().st_size / 2**30:.2f} GiB, made in "
                  f"{time.perf_counter() - t:.0f} s)")
    stream = token_stream(spec, StreamSpec(n_tokens=args.tokens + 8, seed=11))
    n = len(stream) - 8
    report: dict = {"schema": SCHEMA, "geometry": args.geometry, "spec": spec.__dict__, "tokens": n,
                    "testbed": args.testbed}
    with ExitStack() as stack:
        if args.testbed:
            server = stack.enter_context(start_rpc_server())
            rpc: tuple[str, ...] = (server.endpoint,)
            add_rpc_server(server.endpoint)
        else:
            if not has_accelerator():
                console.print("[red]no GPU visible to this build[/red]: build one with `gpu_check.py build`, "
                              "or use --testbed")
                return 2
            rpc = ()
        device = next(d for d in devices() if d.kind in ("gpu", "igpu") and (args.testbed or not d.name.startswith("RPC")))
        report["device"] = {"name": device.name, "description": device.description, "total_bytes": device.total_bytes}
        console.print(f"device {device.name}: {device.description}")
        report["upload"] = upload_bandwidth(device.name, mib=args.upload_mib)
        console.print(f"upload: {report['upload']}")

        rows = []
        # upstream's cache caches only experts in plain host buffers: where the CPU repacks the expert
        # type (Q4_0, Q4_K, IQ4_NL, ... on x86) it runs on a second load with --no-repack, as its
        # users must (the pool uploads repacked experts from the model file instead)
        unrepacked: list = []

        def upstream_session():
            if not unrepacked:
                unrepacked.append(stack.enter_context(
                    PoolSession(model_path, Offload(rpc=rpc, cpu_moe=True, n_ctx=2048, repack=False))))
            return unrepacked[0]

        # stock --n-cpu-moe (pool off), then copy mode at each -mec on each emulated card
        with PoolSession(model_path, Offload(rpc=rpc, cpu_moe=True, n_ctx=2048)) as offloaded:
            stock = teacher_run(offloaded, stream, None)
            rows.append(decode_row("stock", stock, n, None))
            for card in args.card_mib:
                for mec in args.mec:
                    pool_bytes = 0
                    # on the first card both upload paths side by side (stream is the default where the
                    # device has events and pinned memory, a GPU's case; the testbed asks for it); on the
                    # others the device's default
                    paths = ("stream", "inline") if card == args.card_mib[0] else (None,)
                    for mode in ("copy", "hybrid"):
                        for uploads in paths:
                            pooled = teacher_run(offloaded, stream, PoolConfig(slots=mec, device_mib=card, mode=mode,
                                                                               uploads=uploads))
                            rows.append(decode_row(mode, pooled, n, card))
                            if mode == "copy" and uploads in (None, "stream"):
                                pool_bytes = sum(m.pool for m in pooled.memory)
                            console.print(f"  card {card} MiB -mec {mec} {mode} ({rows[-1]['uploads']} uploads): "
                                          f"{rows[-1]['decode_tps']:.1f} t/s, {rows[-1]['status']} "
                                          f"({rows[-1]['limited_by']}), host blocked "
                                          f"{rows[-1]['block_ms_per_token']:.3f} ms/token")
                    cache_mib = equal_memory_mib(pool_bytes)   # upstream's cache at the copy pool's bytes
                    if cache_mib > 0:
                        cached = teacher_run(offloaded, stream, None, moe_cache_mib=cache_mib)
                        no_repack = cached.moe_cache is None
                        if no_repack:
                            cached = teacher_run(upstream_session(), stream, None, moe_cache_mib=cache_mib)
                        rows.append(upstream_row(cached, n, card, cache_mib, mec))
                        rows[-1]["no_repack"] = no_repack
                        console.print(f"  card {card} MiB upstream cache {cache_mib} MiB: "
                                      f"{rows[-1]['decode_tps']:.1f} t/s, hit rate {rows[-1]['hit_rate']:.1%}")
        # every expert on the device, when the device holds them: the bound, and the host's cost per
        # CPU-computed expert (stock time minus resident time, per expert computation)
        resident_tps = None
        if args.testbed or device.total_bytes > 2 * model_path.stat().st_size:
            with PoolSession(model_path, Offload(rpc=rpc, n_ctx=2048)) as resident_session:
                resident = teacher_run(resident_session, stream, None)
            resident_tps = resident.decode.decode_tokens_per_s
            rows.append(decode_row("resident", resident, n, None))
        report["rows"] = rows
        per_token_cpu_experts = spec.n_layer * spec.n_expert_used
        if resident_tps:
            gap_ms = 1000.0 / stock.decode.decode_tokens_per_s - 1000.0 / resident_tps
            report["host_expert_ms"] = max(0.0, gap_ms) / per_token_cpu_experts
        # parity: the heaviest-eviction pool against the stock path with every expert computed on the
        # device (GPU: host-copy offload even for one token, which a backend reads from
        # GGML_OP_OFFLOAD_MIN_BATCH when it initialises: hence a process of its own; testbed: the
        # all-resident run)
        report["parity"] = parity_in_subprocess(args, args.geometry)
        report["parity_by_type"] = parity_by_type(args)

    table = Table(title=f"GPU check: {report['device']['name']} ({report['device']['description']}), "
                        f"{args.geometry} geometry, {n} decode tokens")
    for col in ("mode", "uploads", "card MiB", "-mec", "status", "slots", "t/s", "x stock", "hit rate",
                "MiB copied/token", "blocked ms/token"):
        table.add_column(col, justify="right")
    stock_tps = rows[0]["decode_tps"]
    for r in rows:
        why = r["limited_by"] if r["status"] == "enabled" else r["reason"]
        blocked = r.get("block_ms_per_token")
        table.add_row(r["mode"], r.get("uploads") if r["mode"] in ("copy", "hybrid") else "-",
                      str(r["card_mib"] or "-"), str(r["slots"]), f"{r['status']} ({why})",
                      str(r["actual_slots"]), f"{r['decode_tps']:.1f}", f"{r['decode_tps'] / stock_tps:.2f}",
                      f"{r['hit_rate']:.1%}", f"{r['copy_bytes_per_token'] / 2**20:.2f}",
                      f"{blocked:.3f}" if blocked is not None and r["mode"] in ("copy", "hybrid") else "-")
    out = Console(width=160)
    out.print(table)
    up = report["upload"]
    out.print(f"upload: {up.get('pageable_gb_s', 0):.1f} GB/s pageable, {up.get('pinned_gb_s', 0):.1f} GB/s "
                    f"pinned, {up['copy_latency_us_64k']:.0f} us per 64 KiB copy; host cost per CPU expert: "
                    f"{report.get('host_expert_ms', float('nan')):.3f} ms; parity vs {report['parity']['against']}: "
                    f"{'bit-identical' if report['parity']['bit_identical'] else 'DIFFERS'}")
    by_type = report["parity_by_type"]
    if by_type:
        def verdict(r: dict) -> str:
            if r.get("error"):
                return "ERROR"
            if r["bit_identical"]:
                return "="
            off = r.get("fusion_off")
            return f"DIFFERS ({r['max_abs_diff']:.3g}" + (
                f"; fusion off: {'=' if off['bit_identical'] else 'still differs'})" if off else ")")
        out.print("parity by expert type (tiny geometry): " + ", ".join(f"{r['expert_type']} {verdict(r)}" for r in by_type))
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    out.print(f"written to {args.out}" + (" (testbed: loopback copies on shared cores, not a GPU)" if args.testbed else ""))
    return 0 if report["parity"]["bit_identical"] and all(r["bit_identical"] for r in by_type) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="a trimmed build for this GPU into build/gpu-check")
    b.add_argument("--target", choices=("cuda", "hip", "vulkan"), required=True)
    b.add_argument("--arch")
    b.add_argument("--jobs", type=int)
    b.add_argument("--source", help="a local pristine llama.cpp tree at the pin (machines without network)")
    r = sub.add_parser("run", help="measure and write the JSON report")
    r.add_argument("--testbed", action="store_true", help="the loopback RPC device instead of a GPU (CPU-only CI)")
    r.add_argument("--geometry", choices=list(GEOMETRIES), default="realistic")
    r.add_argument("--mec", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="slot counts for copy mode (default: top-k, 1/4, 1/2 and all of the experts)")
    r.add_argument("--card-mib", type=lambda s: [int(x) for x in s.split(",")], default=[16384, 24576],
                   help="emulated card sizes (LLAMA_MOE_POOL_DEVICE_MIB)")
    r.add_argument("--tokens", type=int, default=64, help="teacher-forced decode tokens per run")
    r.add_argument("--upload-mib", type=int, default=256)
    r.add_argument("--out", default="gpu-check.json")
    r.add_argument("--parity-types", type=lambda s: [t for t in s.split(",") if t], default=None,
                   help="expert types whose pooled decode is compared bit for bit on the tiny geometry "
                        "(default: every type the test models come in; '' for none)")
    r.add_argument("--parity-only", action="store_true", help=argparse.SUPPRESS)
    r.add_argument("--expert-type", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.command == "build":
        return build(args)
    from pyllamapool.testmodel import EXPERT_TYPES
    if args.parity_types is None:
        args.parity_types = list(EXPERT_TYPES)
    bad = [t for t in args.parity_types if t not in EXPERT_TYPES]
    if bad:
        parser.error(f"--parity-types: unknown {', '.join(bad)}")
    if args.parity_only:
        if not args.testbed and (PREFIX / "pyllamapool" / "lib" / "libllama.so").exists():
            os.environ.setdefault("PYLLAMAPOOL_LIB_DIR", str(PREFIX / "pyllamapool" / "lib"))
        print(json.dumps(parity(args)))
        return 0
    if args.mec is None:
        g = GEOMETRIES[args.geometry]
        args.mec = sorted({g["n_expert_used"], g["n_expert"] // 4, g["n_expert"] // 2, g["n_expert"]})
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
