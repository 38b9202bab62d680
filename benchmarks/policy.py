#!/usr/bin/env python3
"""Policy benchmark: how many bytes each slot policy moves on calibrated routing traces, and how far
that is from Belady's offline optimum. Machine-independent: it counts bytes, it does not time a GPU.

    python benchmarks/policy.py                 # all presets, table + plot
    python benchmarks/policy.py --json          # rows: preset, slots, policy, hit_rate,
                                                #       copy_bytes_per_token, vs_opt, vs_lru, ...
    python benchmarks/policy.py --readme        # docs/policy-lab.md's tables, regenerated
    python benchmarks/policy.py --bank          # docs/policy-lab.md's bank tables: a pool per layer, one
                                                # bank over every layer, llama.cpp's LRU and LRFU banks
    python benchmarks/policy.py --bank a.npz    # the same four on routing recorded by `pyllamapool trace`
    python benchmarks/policy.py --modes results/modes-rtx3090.json
                                                # every mode side by side (ours, upstream's, OPT): MiB
                                                # uploaded and CPU experts per token, priced on an RTX 3090
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from pyllamapool.lab import bench  # noqa: E402
from pyllamapool.lab.synth import PRESETS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", choices=list(PRESETS), help="default: all")
    parser.add_argument("--fractions", default="0.125,0.25,0.5", help="slots as fractions of the experts")
    parser.add_argument("--tokens", type=int, help="tokens per trace (preset default 1200)")
    parser.add_argument("--layers", type=int, help="layers per trace (preset default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", default="policy-benchmark.png")
    parser.add_argument("--readme", action="store_true",
                        help="print docs/policy-lab.md's two tables (every preset, seeds 0-2) and nothing else")
    parser.add_argument("--modes", type=Path, metavar="JSON",
                        help="every mode side by side on every preset and slot fraction (bench.modes_rows): "
                             "write the rows here and print docs/policy-lab.md's table")
    parser.add_argument("--bank", nargs="*", type=Path, metavar="TRACE",
                        help="the bank tables: every preset (no TRACE) or these recorded traces (.npz)")
    args = parser.parse_args()
    if args.bank is not None:
        from pyllamapool.run.trace import Trace
        fractions = tuple(float(f) for f in args.fractions.split(","))
        if args.bank:
            print(bench.bank_trace_table({path.name: Trace.load(path) for path in args.bank}, fractions))
        else:
            print(bench.bank_table(args.seed, fractions))
            print(bench.bank_calibration_table(args.seed))
        return 0
    if args.readme:
        for table in bench.readme_tables():
            print(table)
        return 0
    if args.modes:
        rows = bench.modes_rows(args.preset, tuple(float(f) for f in args.fractions.split(",")), seed=args.seed)
        args.modes.write_text(json.dumps({"profile": bench.MODES_PROFILE, "host_layers": bench.MODES_HOST_LAYERS,
                                          "dense_ms": bench.MODES_DENSE_MS, "seed": args.seed,
                                          "rows": [r.__dict__ for r in rows]}, indent=1) + "\n")
        print(bench.modes_markdown(rows))
        return 0
    presets = args.preset or list(PRESETS)
    fractions = tuple(float(f) for f in args.fractions.split(","))
    console = Console(stderr=args.json, width=max(Console().width, 120))

    rows, timing = bench.run(presets, fractions, seed=args.seed, n_tokens=args.tokens, n_layer=args.layers)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=1, default=lambda x: None))
    else:
        cal = Table(title="calibration: per-layer LRU hit rate, published vs synthetic preset")
        for col in ("preset", "slots", "published", "synthetic LRU"):
            cal.add_column(col, justify="right")
        for name, slots, published, synthetic in bench.lru_calibration(presets, args.seed):
            cal.add_row(name, str(slots), f"{published:.1%}", f"{synthetic:.1%}")
        console.print(cal)
        for preset in presets:
            table = Table(title=f"{preset}: {PRESETS[preset].source}")
            for col in ("slots", "policy", "hit rate", "MiB/token", "uploads", "evictions", "yield", "vs opt", "vs lru"):
                table.add_column(col, justify="right")
            for r in rows:
                if r.preset != preset:
                    continue
                table.add_row(str(r.slots), r.policy, f"{r.hit_rate:.1%}", f"{r.copy_bytes_per_token / 2**20:.2f}",
                              str(r.uploads), str(r.evictions), "inf" if math.isinf(r.yield_) else f"{r.yield_:.2f}",
                              f"{r.vs_opt:.2f}x", f"{r.vs_lru:.2f}x")
            console.print(table)
    for preset, s in bench.summary(rows).items():
        console.print(f"{preset}: the default policy ({bench.DEFAULT}) copies {s['vs_opt']:.2f}x OPT's bytes and "
                      f"{s['vs_lru']:.3f}x LRU's (geometric mean over slot counts)")
    for preset, g in bench.gate_summary(rows).items():
        console.print(f"{preset}: the admission gate copies {g['bytes_min']:.2f}-{g['bytes_max']:.2f}x the default's "
                      f"bytes; worst excess (moved beyond served) {g['excess_default'] / 2**20:.1f} -> "
                      f"{g['excess_gated'] / 2**20:.1f} MiB/token")
    if timing["product_lookups"]:
        console.print(f"default policy: {1e9 * timing['product_seconds'] / timing['product_lookups']:.0f} ns per "
                      "lookup, including one Python->C call per step")
    if args.plot:
        bench.plot(rows, args.plot)
        console.print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
