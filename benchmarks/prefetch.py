#!/usr/bin/env python3
"""Hybrid's prefetch side by side: off, auto (the default: where uploads run beside compute, as many
as the link carries before the next layer's step) and on (every predicted expert a slot can take), with
stock, at pools smaller than the layer.

    python benchmarks/prefetch.py [--device rpc|vulkan|lazy] [--slots 4,8,16] [--tokens 96] [--repeats 3]

Each repeat runs every design once, in turn, and the ratios are taken within a repeat (the testbeds'
"device" shares the host's cores, and their speed drifts between minutes). The model is the
generated one of the other side-by-side benchmarks: its routers are random, and how well one layer's
router predicts the next layer's experts from the previous hidden state (the precision column) is that
model's, not a trained model's. Uploads take the stream path wherever the device has events (asked for:
the default takes it only for pinned experts); RPC has none, and there auto does not prefetch.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from upstream import check_run_args, one_run, opened_model, run_args, run_side_by_side, same_logits, spec  # noqa: E402

#: (design, prefetch)
DESIGNS = (("hybrid, prefetch off", "off"), ("hybrid, prefetch auto", "auto"), ("hybrid, prefetch on", "on"))


def parse_args(argv=None):
    parser = run_args(__doc__, "vulkan", 96, "4,8,16")
    args = parser.parse_args(argv)
    check_run_args(parser, args, 1)
    return args


def measure(args) -> list[dict]:
    from pyllamapool.binding.pool import PoolConfig
    from pyllamapool.run.testmodel import StreamSpec, cached_model, token_stream

    s = spec()
    stream = token_stream(s, StreamSpec(n_tokens=args.tokens + 8, seed=3))
    rows: list[dict] = []
    with opened_model(args.device, cached_model(s)) as (model, device_mib):
        size = {"device_mib": device_mib} if device_mib else {}
        for slots in args.slot_list:
            runs: dict[str, list[dict]] = {"stock": [], **{name: [] for name, _ in DESIGNS}}
            for _ in range(args.repeats):
                runs["stock"].append(one_run(model, stream))
                for name, prefetch in DESIGNS:
                    run = one_run(model, stream, pool=PoolConfig(slots=slots, mode="hybrid", prefetch=prefetch,
                                                                         uploads="stream", **size))
                    runs[name].append(run)
                    print({"slots": slots, "design": name, "tps": round(run["tps"], 1),
                           "prefetched": round(run["prefetched"], 2)}, file=sys.stderr, flush=True)
            reference = runs["stock"][0]["logits"]
            for name in runs:
                first = runs[name][0]
                row = {k: v for k, v in first.items() if k != "logits"}
                row.update(design=name, slots=slots if name != "stock" else 0,
                           tps=statistics.median(r["tps"] for r in runs[name]),
                           vs_off=statistics.median(r["tps"] / c["tps"] for r, c in
                                                    zip(runs[name], runs["hybrid, prefetch off"])),
                           vs_stock=statistics.median(r["tps"] / c["tps"] for r, c in zip(runs[name], runs["stock"])),
                           parity=same_logits(first["logits"], reference))
                rows.append(row)
    return rows


def table(rows: list[dict], device: str) -> str:
    out = [f"| design ({device}) | slots | t/s | x stock | x prefetch off | hit rate | CPU experts / token | "
           "prefetched / token | used in their step | precision | recall | KiB uploaded / token | parity |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        used = f"{r['prefetch_hits'] / r['prefetched']:.0%}" if r.get("prefetched") else "-"
        out.append(f"| {r['design']} | {r['slots'] or '-'} | {r['tps']:.0f} | {r['vs_stock']:.2f} | "
                   f"{r['vs_off']:.2f} | {r['hit']:.1%} | {r['cpu']:.1f} | {r.get('prefetched', 0):.2f} | {used} | "
                   f"{r.get('precision', 0):.0%} | {r.get('recall', 0):.0%} | {r['kib']:.0f} | "
                   f"{'bit-identical' if r['parity'] else 'differs'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    return run_side_by_side(__file__, parse_args(argv), argv, measure, table)


if __name__ == "__main__":
    sys.exit(main())
