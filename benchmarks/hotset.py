#!/usr/bin/env python3
"""A cold start against a warm start from a hot set file (LLAMA_MOE_POOL_HOTSET), side by side.

    python benchmarks/hotset.py [--device rpc|vulkan|lazy] [--tokens 64] [--repeats 3] [--slots 8,16] [--json out.json]

Each repeat writes a hot set from a run over another token stream of the same model (the same topics,
other tokens: what an earlier session of the same workload leaves), then decodes the measured stream
twice in each mode, cold and warm from that file, after a 64-token prompt (prefill takes the stock
path; hybrid mode's own warm start from the prompt's experts runs in both). Per run: device hits over
the first 16 decode steps and over the run, bytes uploaded per token over the first 16 steps, decode
t/s over the first 16 steps and over the run. Ratios are warm over cold within a repeat, as loopback
devices and lavapipe drift between minutes. The generated models' routing is synthetic (Zipf-popular
experts per layer, topic locality): the figures say what a hot set changes, not how much a real
model's first tokens gain.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from upstream import check_run_args, opened_model, run_args, run_side_by_side, spec  # noqa: E402

EARLY = 16   # decode steps that make "the first tokens"
PROMPT = 64  # a prompt longer than the pool's micro-batches: prefill on the stock path


def parse_args(argv=None):
    parser = run_args(__doc__, "rpc", 64, "8,16")
    args = parser.parse_args(argv)
    check_run_args(parser, args, 4)
    if args.tokens <= EARLY:
        parser.error(f"--tokens must be more than {EARLY}: the first {EARLY} steps are measured apart")
    return args


def one_run(model, pool, stream) -> dict:
    from pyllamapool.run.decode import run_context
    from pyllamapool.binding.llama import Context

    ctx = Context(model, pool=pool)
    early = {}

    def note(i: int) -> None:
        if i == EARLY - 1:
            early["counters"] = ctx.pool_counters()

    result = run_context(ctx, stream[:PROMPT], 0, teacher_tokens=stream[PROMPT:], on_step=note)
    c = ctx.pool_counters()
    lines = ctx.pool_lines()
    ctx.close()
    e = early["counters"]
    steps = result.step_latency_ms
    return dict(early_hit_rate=e.hits / e.lookups if e.lookups else 0.0, hit_rate=c.hits / c.lookups if c.lookups else 0.0,
                early_bytes_per_token=e.copy_bytes / EARLY, early_tps=1000.0 * EARLY / sum(steps[:EARLY]),
                tps=result.decode_tokens_per_s,
                loaded=any(line.startswith("expert pool hotset=loaded") for line in lines))


def measure(args) -> list[dict]:
    from pyllamapool.binding.pool import PoolConfig
    from pyllamapool.run.testmodel import StreamSpec, cached_model, token_stream

    s = spec()
    measured = token_stream(s, StreamSpec(n_tokens=PROMPT + args.tokens, seed=3))
    earlier = token_stream(s, StreamSpec(n_tokens=PROMPT + args.tokens, seed=11))
    rows = []
    with opened_model(args.device, cached_model(s)) as (model, device_mib):
        sized = {"device_mib": device_mib} if device_mib else {}
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):
                for slots in args.slot_list:
                    for mode in ("copy", "hybrid"):
                        hot = Path(tmp) / f"hot-{repeat}-{slots}-{mode}.txt"
                        one_run(model, PoolConfig(slots=slots, mode=mode, hotset=hot, **sized), earlier)
                        cold = one_run(model, PoolConfig(slots=slots, mode=mode, **sized), measured)
                        # a copy of the file: the warm run rewrites it, the next repeat writes its own
                        warm_file = hot.with_suffix(".warm.txt")
                        warm_file.write_text(hot.read_text())
                        warm = one_run(model, PoolConfig(slots=slots, mode=mode, hotset=warm_file, **sized), measured)
                        if not warm["loaded"]:
                            raise RuntimeError(f"{mode} at {slots} slots: the warm run did not load {warm_file}")
                        rows.append(dict(repeat=repeat, slots=slots, mode=mode, cold=cold, warm=warm,
                                         early_tps_ratio=warm["early_tps"] / cold["early_tps"],
                                         tps_ratio=warm["tps"] / cold["tps"]))
                        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], device: str) -> str:
    out = [f"| slots ({device}, of {spec().n_expert}) | mode | first {EARLY} steps' device hits, cold → warm "
           f"| whole run's hits, cold → warm | MiB uploaded / token, first {EARLY}, cold → warm "
           f"| t/s first {EARLY}, warm / cold | t/s whole run, warm / cold |",
           "| ---: | --- | --- | --- | --- | ---: | ---: |"]
    keys = sorted({(r["slots"], r["mode"]) for r in rows})
    for slots, mode in keys:
        rs = [r for r in rows if (r["slots"], r["mode"]) == (slots, mode)]

        def med(side: str, key: str) -> float:
            return statistics.median(r[side][key] for r in rs)

        out.append(f"| {slots} | {mode} | {med('cold', 'early_hit_rate'):.0%} → {med('warm', 'early_hit_rate'):.0%} | "
                   f"{med('cold', 'hit_rate'):.0%} → {med('warm', 'hit_rate'):.0%} | "
                   f"{med('cold', 'early_bytes_per_token') / 2**20:.2f} → {med('warm', 'early_bytes_per_token') / 2**20:.2f} | "
                   f"{statistics.median(r['early_tps_ratio'] for r in rs):.2f} | "
                   f"{statistics.median(r['tps_ratio'] for r in rs):.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    return run_side_by_side(__file__, parse_args(argv), argv, measure, table)


if __name__ == "__main__":
    sys.exit(main())
