#!/usr/bin/env python3
"""Uploads from a mapped model: gathered into pinned staging on 1..N host threads, or read straight from
the mapped pages pinned in place (where the device offers host registration), side by side in one
process, on one model (experts of 2 MiB per tensor, mapped from the file), one token stream and one
device, at heavy eviction (slots at top-k: every step uploads).

    python benchmarks/gather.py [--device lazy|vulkan] [--tokens 32] [--repeats 3] [--threads 1,2,4,8]
        [--json out.json] [--short]

Each row is copy mode served by the host on the stream path, decode t/s (median over repeats, warm:
the last half), the host's time blocked in the pool's uploads per token, uploads per token, and what
the pool's calibration measured: the gather rate at each thread count it timed (MB/s, one 32 MiB
gather from the mapped experts). `registered` is the same run with the pages pinned in place (the
default where the device has the hook: CUDA, HIP, the lazy-copy test device): no gather at all.
Every row's logits must equal the first one's bit for bit.

On the loopback devices the "link" is a memcpy on the same cores, so the registered row saves what
the gather costs, and more gather threads pay only as far as the host's memory bandwidth and free
cores allow (CI machines have two). An H200's host gathered 5.2 / 19.2 / 27.2 / 29.7 GB/s with 1 / 4 /
8 / 16 threads, and its registered pages copied at 51-55 GB/s (docs/uploads.md).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from upstream import opened_model, relaunch_on_vulkan, same_logits  # noqa: E402


def spec():
    from pyllamapool.run.testmodel import ModelSpec
    # 1024 x 1024 F16: 2 MiB per expert and tensor, 6 MiB an expert, 384 MiB of experts in all
    return ModelSpec(n_expert=16, n_expert_used=4, n_embd=1024, n_ff_exp=1024, n_ff_shexp=256, n_vocab=512)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("lazy", "vulkan"), default="lazy")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps (teacher-forced)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2,4,8", help="gather thread counts to run (LLAMA_MOE_POOL_GATHER_THREADS)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--short", action="store_true", help="a quick run: 8 tokens, 1 repeat, 1 and 2 threads")
    args = parser.parse_args(argv)
    try:
        args.thread_list = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--threads {args.threads!r}: expected whole numbers separated by commas")
    if not args.thread_list or min(args.thread_list) < 1 or max(args.thread_list) > 256:
        parser.error(f"--threads {args.threads!r}: each count must be from 1 to 256")
    if args.tokens < 2 or args.repeats < 1:
        parser.error("--tokens must be at least 2 and --repeats at least 1")
    if args.short:
        args.tokens, args.repeats, args.thread_list = 8, 1, [1, 2]
    return args


def one_run(model, stream, pool) -> dict:
    from pyllamapool.binding.llama import Context
    from pyllamapool.run.decode import run_context

    ctx = Context(model, pool=pool)
    result = run_context(ctx, stream[:4], 0, teacher_tokens=stream[4:], keep_logits=True)
    c, s = ctx.pool_counters(), ctx.pool_status(0)
    ctx.close()
    n = len(result.step_latency_ms)
    timed = next((m.group(1) for line in ctx.pool_lines() for m in [re.search(r"gather .*timed_mb_s=(\S+)", line)] if m), "")
    return {"tps": result.tokens_per_s(n // 2), "block_ms": c.block_us_per_token / 1000.0, "uploads": c.uploads / n,
            "experts": s.experts, "uploads_path": s.uploads, "gather_threads": s.gather_threads,
            "timed_mb_s": dict(kv.split(":") for kv in timed.split(",")) if timed else {}, "logits": result.logits}


def measure(args: argparse.Namespace) -> list[dict]:
    from pyllamapool.binding.pool import PoolConfig
    from pyllamapool.run.testmodel import StreamSpec, cached_model, token_stream

    path = cached_model(spec())
    stream = token_stream(spec(), StreamSpec(n_tokens=args.tokens + 4, seed=3))
    rows = []
    with opened_model(args.device, path) as (model, device_mib):
        size = {"device_mib": device_mib} if device_mib else {}
        base = dict(slots=spec().n_expert_used, mode="copy", serve="host", uploads="stream", **size)
        configs = [(f"gather x{n}", PoolConfig(pin="off", gather_threads=n, **base)) for n in args.thread_list]
        configs.append(("registered", PoolConfig(**base)))
        for name, pool in configs:
            runs = [one_run(model, stream, pool) for _ in range(args.repeats)]
            row = {**runs[0], "name": name, "tps": statistics.median(r["tps"] for r in runs),
                   "block_ms": statistics.median(r["block_ms"] for r in runs)}
            print({k: v for k, v in row.items() if k != "logits"}, file=sys.stderr, flush=True)
            rows.append(row)
    for r in rows:
        r["identical"] = same_logits(r["logits"], rows[0]["logits"])
    for r in rows:
        del r["logits"]
    return rows


def table(rows: list[dict], device: str) -> str:
    out = [f"| uploads ({device}) | experts | gather threads | warm t/s | host blocked ms / token | uploads / token | "
           "calibrated gather MB/s (threads: rate) | logits |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        timed = ", ".join(f"{k}: {v}" for k, v in r["timed_mb_s"].items()) or "-"
        out.append(f"| {r['name']} | {r['experts']} | {r['gather_threads'] or '-'} | {r['tps']:.1f} | {r['block_ms']:.3f} | "
                   f"{r['uploads']:.1f} | {timed} | {'identical' if r['identical'] else 'DIFFER'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    import json

    args = parse_args(argv)
    if args.device == "vulkan":
        rc = relaunch_on_vulkan(__file__, argv)
        if rc is not None:
            return rc
    rows = measure(args)
    text = table(rows, "lavapipe" if args.device == "vulkan" else "lazy-copy device")
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "tokens": args.tokens, "repeats": args.repeats,
                                         "rows": rows}, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
