#!/usr/bin/env python3
"""Stock, copy and hybrid mode side by side on the loopback RPC testbed, and prints docs/hybrid.md's Markdown
table. It is a proxy: the "device" is the same cores, and every CPU split costs RPC round trips.

    python benchmarks/hybrid.py [--tokens 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyllamapool.run.decode import run_context  # noqa: E402
from pyllamapool.binding.llama import Context, Model, add_rpc_server  # noqa: E402
from pyllamapool.binding.pool import PoolConfig  # noqa: E402
from pyllamapool.run.rpc import start_rpc_server  # noqa: E402
from pyllamapool.run.testmodel import ModelSpec, StreamSpec, cached_model, token_stream  # noqa: E402

SPEC = ModelSpec(n_expert=32, n_expert_used=4, n_embd=256, n_ff_exp=256)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = cached_model(SPEC)
    stream = token_stream(SPEC, StreamSpec(n_tokens=args.tokens + 8, seed=3))
    n = len(stream) - 8
    rows = []
    with start_rpc_server() as server:
        add_rpc_server(server.endpoint)
        model = Model(path, n_gpu_layers=99, rpc=[server.endpoint], cpu_moe=True)
        runs = [("stock", 0)] + [(m, s) for s in (4, 8, 16, 32) for m in ("copy", "hybrid")]
        for mode, slots in runs:
            speeds, report, waits = [], None, 0
            for _ in range(args.repeats):
                pool = PoolConfig(slots=slots, device_mib=65536, mode=mode) if slots else None
                ctx = Context(model, pool=pool)
                result = run_context(ctx, stream[:8], 0, teacher_tokens=stream[8:])
                report = ctx.pool_report(per_pool=True) if slots else None
                waits = ctx.host_syncs()
                ctx.close()
                speeds.append(result.decode_tokens_per_s)
            if report:
                c = report.counters
                per_layer = len(report.pools) // SPEC.n_layer  # gate, up and down each count a lookup
                row = dict(hit=c.hit_rate, cpu=c.cpu_experts / per_layer / n, dev=c.device_experts / per_layer / n,
                           kib=c.copy_bytes / n / 1024, deferred=c.deferred / per_layer)
            else:
                row = dict(hit=0.0, cpu=float(SPEC.n_layer * SPEC.n_expert_used), dev=0.0, kib=0.0, deferred=0)
            rows.append(dict(mode=mode, slots=slots, tps=statistics.median(speeds), syncs=waits, **row))
            print(rows[-1], file=sys.stderr, flush=True)
        model.close()
    stock = rows[0]["tps"]
    print("| mode | -mec | t/s (loopback) | x stock | hit rate | CPU experts / token | device experts / token | "
          "KiB uploaded / token | deferred | host syncs / token |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['slots'] or '-'} | {r['tps']:.0f} | {r['tps'] / stock:.2f} | {r['hit']:.1%} | "
              f"{r['cpu']:.1f} | {r['dev']:.1f} | {r['kib']:.0f} | {r['deferred']:.0f} | {r['syncs']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
