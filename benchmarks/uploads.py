#!/usr/bin/env python3
"""The pool's two upload paths side by side, in one process, on one model and one token stream:
`stream` (misses gathered into pinned staging, copied on an upload queue of their own, ordered with
events) and `inline` (copies on the compute queue from the mapped weights), for copy and hybrid mode,
at heavy eviction (slots at top-k) and above.

    python benchmarks/uploads.py [--device vulkan|lazy|rpc] [--tokens 64] [--repeats 3] [--slots 4,8]
        [--json out.json] [--short]

Per run: decode t/s (median over repeats), the host's time blocked inside the device API in the pool's
ops per token (`block_us` / tokens: copies that wait, waits for staging) and as a share of the token,
host waits per token (the scheduler's and the pool's), uploads per token and parity. On every device
the two paths must give the same logits bit for bit (same kernels, same bytes); on the loopback devices
every run also equals stock, since all experts run the CPU's kernels.

On lavapipe (--device vulkan) an async copy from pageable memory makes ggml-vulkan synchronize its
queue inside the call, which is what inline uploads from the mapped weights do; from pinned staging it
does not. On the lazy-copy device a copy's cost in the call is the device hashing its source (to catch
reuse). RPC queues every command on its client thread, so both paths behave alike there.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from upstream import check_run_args, open_model, run_args, run_side_by_side, spec  # noqa: E402

PATHS = ("inline", "stream")
MODES = ("copy", "hybrid")


def parse_args(argv=None) -> argparse.Namespace:
    parser = run_args(__doc__, "vulkan", 64, "4,8")
    parser.add_argument("--short", action="store_true", help="a quick run: 12 tokens, 1 repeat, 4 slots")
    args = parser.parse_args(argv)
    check_run_args(parser, args, spec().n_expert_used)  # copy mode needs top-k slots
    if args.short:
        args.tokens, args.repeats, args.slot_list = 12, 1, [spec().n_expert_used]
    return args


def one_run(model, stream, pool) -> dict:
    from pyllamapool.run.decode import run_context
    from pyllamapool.binding.llama import Context

    ctx = Context(model, pool=pool)
    waits = []
    result = run_context(ctx, stream[:8], 0, teacher_tokens=stream[8:], keep_logits=True,
                         on_step=lambda _i: waits.append(ctx.host_syncs()))
    n = len(result.step_latency_ms)
    row = {"tps": result.decode_tokens_per_s, "waits": sum(waits) / n, "logits": result.logits}
    if pool is not None:
        c, s = ctx.pool_counters(), ctx.pool_status(0)
        token_ms = 1000.0 / row["tps"] if row["tps"] else 0.0
        row.update(path=s.uploads, mode=s.mode, hit=c.hit_rate, uploads=c.uploads / n,
                   block_ms=c.block_us_per_token / 1000.0,
                   block_share=c.block_us_per_token / 1000.0 / token_ms if token_ms else 0.0)
    ctx.close()
    return row


def measure(args: argparse.Namespace) -> list[dict]:
    import numpy as np

    from pyllamapool.binding.pool import PoolConfig
    from pyllamapool.run.testmodel import StreamSpec, cached_model, token_stream

    path = cached_model(spec())
    stream = token_stream(spec(), StreamSpec(n_tokens=args.tokens + 8, seed=3))
    model, server, device_mib = open_model(args.device, path)
    size = {"device_mib": device_mib} if device_mib else {}
    try:
        def repeat(pool) -> dict:
            runs = [one_run(model, stream, pool) for _ in range(args.repeats)]
            row = {k: v for k, v in runs[0].items()}
            for k in ("tps", "block_ms", "block_share", "waits"):
                if k in row:
                    row[k] = statistics.median(r[k] for r in runs)
            print({k: v for k, v in row.items() if k != "logits"}, file=sys.stderr, flush=True)
            return row

        stock = dict(repeat(None), mode="stock", path="-", slots=0)
        rows = [stock]
        for mode in MODES:
            for slots in args.slot_list:
                by_path = {p: dict(repeat(PoolConfig(slots=slots, mode=mode, uploads=p, **size)), slots=slots)
                           for p in PATHS}
                for p in PATHS:
                    r = by_path[p]
                    pairs = list(zip(r["logits"], by_path["inline"]["logits"]))
                    r["equals_inline"] = all(np.array_equal(a, b) for a, b in pairs)
                    r["max_diff_inline"] = float(max(np.max(np.abs(a - b)) for a, b in pairs))
                    r["equals_stock"] = all(np.array_equal(a, b) for a, b in zip(r["logits"], stock["logits"]))
                    rows.append(r)
        for r in rows:
            del r["logits"]
    finally:
        model.close()
        if server is not None:
            server.stop()
    return rows


def vs_inline(r: dict) -> str:
    # hybrid's split between the CPU and the device follows when uploads land: on a device whose kernels
    # round differently from the CPU's the two paths' logits differ by that rounding, nothing more
    if r["path"] == "inline":
        return "-"
    return "identical" if r["equals_inline"] else f"max diff {r['max_diff_inline']:.2g}"


def table(rows: list[dict], device: str) -> str:
    stock = rows[0]["tps"] or 1.0
    out = [f"| mode ({device}) | slots | uploads | t/s | x stock | host blocked ms / token | share of the token | "
           "host waits / token | uploads / token | hit rate | logits vs inline |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if r["mode"] == "stock":
            out.append(f"| stock | - | - | {r['tps']:.0f} | 1.00 | - | - | {r['waits']:.1f} | - | - | - |")
            continue
        out.append(f"| {r['mode']} | {r['slots']} | {r['path']} | {r['tps']:.0f} | {r['tps'] / stock:.2f} | "
                   f"{r['block_ms']:.3f} | {r['block_share']:.1%} | {r['waits']:.1f} | {r['uploads']:.1f} | "
                   f"{r['hit']:.1%} | {vs_inline(r)} |")
    return "\n".join(out)


def main(argv=None) -> int:
    return run_side_by_side(__file__, parse_args(argv), argv, measure, table)


if __name__ == "__main__":
    sys.exit(main())
