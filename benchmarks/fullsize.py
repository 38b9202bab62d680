#!/usr/bin/env python3
"""How fast a full-size model is written, and whether its routing has the locality of the preset.

    python benchmarks/fullsize.py                          # qwen3-30b-a3b: 17 GB, then deleted
    python benchmarks/fullsize.py --trace 128 --json out.json

Writes the shape's model (pyllamapool.run.fullsize) into --dir, and reports seconds per GB (into the page
cache, as the GPU check writes it; `--fsync` adds the disk's own flush). With --trace N it decodes N
teacher-forced tokens on the CPU (llama.cpp, every expert on the host), records the router's picks and
replays them through a per-layer LRU at the slot counts the calibrated preset was published with.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from pyllamapool.run.fullsize import SHAPES, shape, write_fullsize_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--dir", default="/tmp", help="where the model is written (deleted afterwards)")
    parser.add_argument("--trace", type=int, default=0, help="decode tokens to trace (0: only write)")
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="the routing preset to compare against")
    parser.add_argument("--fsync", action="store_true", help="also time flushing the file to the disk")
    parser.add_argument("--keep", action="store_true", help="keep the model")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.trace < 0:
        parser.error(f"--trace {args.trace}: expected 0 or more tokens")

    spec = shape(args.shape)
    path = Path(args.dir) / f"fullsize-{args.shape}.gguf"
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if time.perf_counter() - last[0] > 5 or done == total:
            last[0] = time.perf_counter()
            print(f"  {done / 1e9:5.1f} / {total / 1e9:.1f} GB", file=sys.stderr, flush=True)

    stats = write_fullsize_model(spec, path, progress=progress)
    out: dict = {"shape": args.shape, "spec": spec.__dict__, "bytes": stats.bytes, "seconds": round(stats.seconds, 2),
                 "s_per_gb": round(stats.seconds_per_gb, 3), "gb_per_s": round(stats.bytes / stats.seconds / 1e9, 3),
                 "cores": os.cpu_count()}
    if args.fsync:
        t = time.perf_counter()
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        out["fsync_s"] = round(time.perf_counter() - t, 2)
    print(f"{args.shape}: {stats.bytes / 1e9:.1f} GB in {stats.seconds:.1f} s = {stats.seconds_per_gb:.2f} s/GB "
          f"({out['gb_per_s']:.2f} GB/s) on {os.cpu_count()} cores")
    try:
        if args.trace:
            out["routing"] = trace_routing(path, spec, args.trace, args.preset)
    finally:
        if not args.keep:
            path.unlink()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def trace_routing(path: Path, spec, n_tokens: int, preset_name: str) -> dict:
    import numpy as np

    from pyllamapool.lab import policies
    from pyllamapool.lab.synth import PRESETS
    from pyllamapool.binding.llama import Model
    from pyllamapool.run.testmodel import StreamSpec, token_stream
    from pyllamapool.run.trace import locality, record_trace

    stream = token_stream(spec, StreamSpec(n_tokens=n_tokens + 8, seed=11))
    t = time.perf_counter()
    model = Model(path, n_gpu_layers=0)
    try:
        trace = record_trace(model, stream[:8], stream[8:], n_ctx=max(512, n_tokens + 16))
    finally:
        model.close()
    seconds = time.perf_counter() - t
    preset = PRESETS[preset_name]
    rows = []
    for slots, published in preset.published:
        stats = [policies.lru(policies.layer_steps(trace.ids, i), slots) for i in range(trace.ids.shape[1])]
        hit = sum(s.hits for s in stats) / sum(s.lookups for s in stats)
        rows.append({"slots": slots, "lru_hit_rate": round(hit, 4), "published": published})
        print(f"  LRU {slots:3d} slots: {hit:.1%} (the preset's source: {published:.0%})")
    loc = locality(trace)
    return {"tokens": n_tokens, "trace_s": round(seconds, 1), "preset": preset_name, "source": preset.source,
            "lru": rows, "reuse_prev": round(loc.reuse_prev, 4), "reuse_window": round(loc.reuse_window, 4),
            "top_quarter_share_mean": round(float(np.mean(loc.top_quarter_share)), 4)}


if __name__ == "__main__":
    sys.exit(main())
