#!/usr/bin/env python3
"""Hybrid against copy mode with a pool that holds every expert, in alternating pairs of runs: the
figure issue 27 asks for ("hybrid at full residency within 10% of copy at full residency").

    python benchmarks/residency.py [--device vulkan|rpc|lazy] [--tokens 128] [--repeats 5] [--json out.json]

Each repeat runs copy mode, then hybrid, on the same model and token stream, and takes the ratio of the
two: loopback devices and lavapipe share the host's cores, and their speed drifts between minutes by
more than the difference measured, so only ratios of neighbouring runs mean anything. Two ratios per
pair: decode t/s over the whole run (hybrid's first steps split the layer while the pool fills), and
the median step over the last half (once every layer runs copy mode's graph). Also per mode: host
waits per token and CPU experts per token.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from upstream import open_model, run_args, run_side_by_side, spec  # noqa: E402


def parse_args(argv=None):
    parser = run_args(__doc__, "vulkan", 128, "")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.repeats < 1:
        parser.error("--tokens must be at least 2 and --repeats at least 1")
    if args.slots:
        parser.error("--slots: this benchmark sizes the pool for every expert")
    return args


def measure(args) -> list[dict]:
    from pyllamapool.run.decode import run_context
    from pyllamapool.binding.llama import Context
    from pyllamapool.binding.pool import PoolConfig
    from pyllamapool.run.testmodel import StreamSpec, cached_model, token_stream

    s = spec()
    stream = token_stream(s, StreamSpec(n_tokens=args.tokens + 8, seed=3))
    model, server, device_mib = open_model(args.device, cached_model(s))
    rows = []
    try:
        for repeat in range(args.repeats):
            pair = {}
            for mode in ("copy", "hybrid"):
                pool = PoolConfig(slots=s.n_expert, mode=mode, **({"device_mib": device_mib} if device_mib else {}))
                ctx = Context(model, pool=pool)
                waits = []
                result = run_context(ctx, stream[:8], 0, teacher_tokens=stream[8:],
                                     on_step=lambda _i: waits.append(ctx.host_syncs()))
                c = ctx.pool_counters()
                per_layer = len(ctx.pool_report(per_pool=True).pools) // s.n_layer
                ctx.close()
                late = result.step_latency_ms[len(result.step_latency_ms) // 2:]
                pair[mode] = dict(tps=result.decode_tokens_per_s, late_ms=statistics.median(late),
                                  waits=sum(waits) / len(waits),
                                  cpu=c.cpu_experts / per_layer / len(result.step_latency_ms))
            rows.append(dict(repeat=repeat, copy=pair["copy"], hybrid=pair["hybrid"],
                             run_ratio=pair["hybrid"]["tps"] / pair["copy"]["tps"],
                             late_ratio=pair["copy"]["late_ms"] / pair["hybrid"]["late_ms"]))
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        model.close()
        if server is not None:
            server.stop()
    return rows


def table(rows: list[dict], device: str) -> str:
    out = [f"| pair ({device}) | copy t/s | hybrid t/s | hybrid / copy, whole run | hybrid / copy, last half "
           "| host waits / token (copy, hybrid) | CPU experts / token (hybrid) |",
           "| ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        out.append(f"| {r['repeat'] + 1} | {r['copy']['tps']:.0f} | {r['hybrid']['tps']:.0f} | {r['run_ratio']:.2f} | "
                   f"{r['late_ratio']:.2f} | {r['copy']['waits']:.1f}, {r['hybrid']['waits']:.1f} | "
                   f"{r['hybrid']['cpu']:.2f} |")
    out.append(f"| median | | | {statistics.median(r['run_ratio'] for r in rows):.2f} | "
               f"{statistics.median(r['late_ratio'] for r in rows):.2f} | | |")
    return "\n".join(out)


def main(argv=None) -> int:
    return run_side_by_side(__file__, parse_args(argv), argv, measure, table)


if __name__ == "__main__":
    sys.exit(main())
