#!/usr/bin/env python3
"""Hybrid's placement rules side by side with copy mode and stock, at pools smaller than the layer: the
CPU computes every miss (`placement=cpu`, the rule before issue 27), the measured costs decide how many
misses the device computes in their own step (`cost`, the default), or every miss is uploaded for the
device (`device`, copy mode's uploads in hybrid's graph).

    python benchmarks/placement.py [--device rpc|vulkan|lazy] [--slots 4,8,16] [--tokens 96] [--repeats 3]

Each repeat runs every design once, in turn, on one model and token stream, and the ratios are taken
within a repeat: loopback devices and lavapipe share the host's cores, and their speed drifts between
minutes by more than some of the differences measured. The figures are a testbed's, whose "device"
is the same cores: what they show is how many misses each rule puts where, and that each run stays
bit-identical to stock (RPC, lazy) or rounds as the device does (Vulkan).
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from upstream import check_run_args, one_run, open_model, run_args, run_side_by_side, same_logits, spec  # noqa: E402

#: (design, pool mode, placement)
DESIGNS = (("copy", "copy", None), ("hybrid, placement cpu", "hybrid", "cpu"),
           ("hybrid, placement cost", "hybrid", "cost"), ("hybrid, placement device", "hybrid", "device"))


def parse_args(argv=None):
    parser = run_args(__doc__, "rpc", 96, "4,8,16")
    args = parser.parse_args(argv)
    check_run_args(parser, args, 1)
    return args


def measure(args) -> list[dict]:
    from pyllamapool.binding.pool import PoolConfig
    from pyllamapool.run.testmodel import StreamSpec, cached_model, token_stream

    s = spec()
    stream = token_stream(s, StreamSpec(n_tokens=args.tokens + 8, seed=3))
    model, server, device_mib = open_model(args.device, cached_model(s))
    size = {"device_mib": device_mib} if device_mib else {}
    try:
        rows: list[dict] = []
        for slots in args.slot_list:
            runs: dict[str, list[dict]] = {"stock": [], **{name: [] for name, _, _ in DESIGNS}}
            for _ in range(args.repeats):
                runs["stock"].append(one_run(model, stream))
                for name, mode, placement in DESIGNS:
                    run = one_run(model, stream, pool=PoolConfig(slots=slots, mode=mode, placement=placement, **size))
                    runs[name].append(run)
                    print({"slots": slots, "design": name, "tps": round(run["tps"], 1)}, file=sys.stderr, flush=True)
            reference = runs["stock"][0]["logits"]
            for name in runs:
                first = runs[name][0]
                row = {k: v for k, v in first.items() if k != "logits"}
                row.update(design=name, slots=slots if name != "stock" else 0,
                           tps=statistics.median(r["tps"] for r in runs[name]),
                           # within each repeat, against that repeat's run of the CPU rule and of stock
                           vs_cpu=statistics.median(r["tps"] / c["tps"] for r, c in
                                                    zip(runs[name], runs["hybrid, placement cpu"])),
                           vs_stock=statistics.median(r["tps"] / c["tps"] for r, c in zip(runs[name], runs["stock"])),
                           parity=same_logits(first["logits"], reference))
                rows.append(row)
    finally:
        model.close()
        if server is not None:
            server.stop()
    return rows


def table(rows: list[dict], device: str) -> str:
    out = [f"| design ({device}) | slots | t/s | x stock | x placement cpu | hit rate | CPU experts / token | "
           "placed / token | KiB uploaded / token | host waits / token | parity |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        out.append(f"| {r['design']} | {r['slots'] or '-'} | {r['tps']:.0f} | {r['vs_stock']:.2f} | {r['vs_cpu']:.2f} | "
                   f"{r['hit']:.1%} | {r['cpu']:.1f} | {r['placed']:.1f} | {r['kib']:.0f} | {r['waits']:.1f} | "
                   f"{'bit-identical' if r['parity'] else 'differs'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    return run_side_by_side(__file__, parse_args(argv), argv, measure, table)


if __name__ == "__main__":
    sys.exit(main())
