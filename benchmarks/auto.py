#!/usr/bin/env python3
"""`-mec auto` against stock and the pool's fixed modes, in one process, on one model and one token
stream: stock `--cpu-moe`, copy and hybrid at each pool size, and auto (hybrid, standing down where
decode is faster without the pool) at the same sizes and sized by itself (-1).

    python benchmarks/auto.py [--device rpc|vulkan|lazy] [--tokens 192] [--repeats 3] [--slots 4,8,16]
        [--link-mb-s MB] [--json out.json] [--short]

--link-mb-s (lazy device): its queue holds for each byte it reads from host memory at that rate, a
slow link where the pool cannot win: auto has to stay at stock's speed within its probes' cost.

Per run: decode t/s (median over repeats, taken in rounds over every design), x stock, the slowest and
fastest repeat as multiples of stock's median (stock's own spread is the noise), the cold (first) and
warm (second) half's t/s, hit rate, the share of decode steps auto ran on the stock path, and parity
with the stock run (bit-identical on the loopback devices, where every
side runs the CPU's kernels; on Vulkan, pooled steps run the device's kernels). auto decides from
timed steps, so a run is only as long as it needs to be to judge: its first ~20 steps time both
sides, and probing costs a few percent after that; short runs show more of it.

Loopback devices and lavapipe share the host's cores: on them the pool is often slower than stock,
which is exactly where auto has to stand down.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from upstream import check_run_args, open_model, run_args, run_side_by_side, same_logits, spec  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = run_args(__doc__, "rpc", 192, "4,8,16")
    parser.add_argument("--short", action="store_true", help="a quick run: 40 tokens, 1 repeat, 8 slots")
    parser.add_argument("--link-mb-s", type=int, default=0,
                        help="lazy device: emulate a link this slow (MB/s; 0 = the host's memory speed)")
    args = parser.parse_args(argv)
    if args.link_mb_s < 0 or (args.link_mb_s and args.device != "lazy"):
        parser.error(f"--link-mb-s {args.link_mb_s}: expected a rate > 0 with --device lazy (0 = no limit)")
    check_run_args(parser, args, spec().n_expert_used)  # copy mode needs top-k slots
    if args.short:
        args.tokens, args.repeats, args.slot_list = 40, 1, [8]
    return args


def one_run(model, stream, pool) -> dict:
    from pyllamapool.run.decode import run_context
    from pyllamapool.binding.llama import Context

    ctx = Context(model, pool=pool)
    result = run_context(ctx, stream[:8], 0, teacher_tokens=stream[8:], keep_logits=True)
    half = len(result.step_latency_ms) // 2
    row = {"tps": result.decode_tokens_per_s, "logits": result.logits, "hit": 0.0, "stock_share": 1.0,
           "cold": result.tokens_per_s(0, half), "warm": result.tokens_per_s(half)}
    if pool is not None:
        c = ctx.pool_counters()
        ran = c.steps + c.stood_down_steps
        row.update(hit=c.hit_rate, stock_share=c.stood_down_steps / ran if ran else 0.0,
                   slots=ctx.pool_status().actual_slots)
    ctx.close()
    return row


def measure(args: argparse.Namespace) -> list[dict]:
    from pyllamapool.binding.pool import PoolConfig
    from pyllamapool.run.testmodel import StreamSpec, cached_model, token_stream

    if args.link_mb_s:
        os.environ["GGML_LAZY_COPY_LINK_MB_S"] = str(args.link_mb_s)
    path = cached_model(spec())
    stream = token_stream(spec(), StreamSpec(n_tokens=args.tokens + 8, seed=3))
    model, server, device_mib = open_model(args.device, path)
    sized = {"device_mib": device_mib} if device_mib else {}
    try:
        designs = [("stock", 0, None)]
        for slots in args.slot_list:
            designs += [(mode, slots, PoolConfig(slots=slots, mode=mode, **sized)) for mode in ("copy", "hybrid")]
            designs.append(("auto", slots, PoolConfig(slots=slots, gate="auto", **sized)))
        designs.append(("auto (-mec auto)", -1, PoolConfig(slots="auto", **sized)))
        # rounds over every design rather than one design's repeats back to back: a loopback device's
        # speed drifts between runs by more than the designs differ, and a round sees one drift
        runs: list[list[dict]] = [[] for _ in designs]
        for _ in range(args.repeats):
            for i, (_, _, pool) in enumerate(designs):
                runs[i].append(one_run(model, stream, pool))
        rows = []
        for (design, slots, _), done in zip(designs, runs):
            row = {**{k: v for k, v in done[0].items() if k != "logits"}, "design": design, "slots": slots,
                   "tps": statistics.median(r["tps"] for r in done),
                   "tps_min": min(r["tps"] for r in done), "tps_max": max(r["tps"] for r in done),
                   "cold": statistics.median(r["cold"] for r in done),
                   "warm": statistics.median(r["warm"] for r in done),
                   "stock_share": statistics.median(r["stock_share"] for r in done), "logits": done[0]["logits"]}
            print({k: v for k, v in row.items() if k != "logits"}, file=sys.stderr, flush=True)
            rows.append(row)
        reference = rows[0]["logits"]
        for r in rows:
            r["parity"] = same_logits(r["logits"], reference)
            del r["logits"]
    finally:
        model.close()
        if server is not None:
            server.stop()
    return rows


def table(rows: list[dict], device: str) -> str:
    stock = rows[0]["tps"] or 1.0
    out = [f"| design ({device}) | slots | t/s | x stock | runs, x stock | cold half t/s | warm half t/s | hit rate | "
           "steps on stock | parity with stock |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        slots = "-" if r["design"] == "stock" else f"{r['slots']}" if r["slots"] >= 0 else "auto"
        share = f"{r['stock_share']:.0%}" if r["design"].startswith("auto") else "-"
        out.append(f"| {r['design']} | {slots} | {r['tps']:.0f} | {r['tps'] / stock:.2f} | "
                   f"{r['tps_min'] / stock:.2f}-{r['tps_max'] / stock:.2f} | {r['cold']:.0f} | {r['warm']:.0f} | "
                   f"{r['hit']:.1%} | "
                   f"{share} | {'bit-identical' if r['parity'] else 'differs'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    return run_side_by_side(__file__, parse_args(argv), argv, measure, table)


if __name__ == "__main__":
    sys.exit(main())
