#!/usr/bin/env python3
"""Hit rates per micro-batch size on the loopback RPC testbed, as speculative verification and several
sequences produce them, for copy and hybrid mode; prints docs/batches.md's Markdown table.

One sequence is decoded in micro-batches that cycle through 1, 4, 8, 16, 32 and 48 tokens (a draft of
k tokens is verified in a batch of k + 1). Batches of up to LLAMA_MOE_POOL_MAX_BATCH (32) use the pool;
the 48-token ones take the stock path. Counts, not speeds: the loopback "device" shares the cores.

    python benchmarks/batches.py [--tokens 1000] [--slots 8,16]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyllamapool.binding.llama import Context, Model, add_rpc_server  # noqa: E402
from pyllamapool.binding.pool import BATCH_CLASSES, PoolConfig  # noqa: E402
from pyllamapool.run.rpc import start_rpc_server  # noqa: E402
from pyllamapool.run.testmodel import ModelSpec, StreamSpec, cached_model, token_stream  # noqa: E402

SPEC = ModelSpec(n_expert=32, n_expert_used=4, n_embd=256, n_ff_exp=256)
CYCLE = (1, 4, 8, 16, 32, 48)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--slots", default="8,16", help="slot counts to measure (comma-separated)")
    args = parser.parse_args()
    slot_counts = [int(s) for s in args.slots.split(",")]
    path = cached_model(SPEC)
    stream = token_stream(SPEC, StreamSpec(n_tokens=args.tokens, seed=3))
    lines = ["| mode | slots | " + " | ".join(f"{c} tok: hit rate (lookups)" for c in BATCH_CLASSES) +
             " | stock-path batches | uploads |",
             "| --- | ---: | " + " | ".join("---:" for _ in BATCH_CLASSES) + " | ---: | ---: |"]
    with start_rpc_server() as server:
        add_rpc_server(server.endpoint)
        model = Model(path, n_gpu_layers=99, rpc=[server.endpoint], cpu_moe=True)
        for slots in slot_counts:
            for mode in ("copy", "hybrid"):
                ctx = Context(model, n_ctx=args.tokens + 64, n_batch=64, n_ubatch=64,
                              pool=PoolConfig(slots=slots, device_mib=65536, mode=mode))
                pos, i = 0, 0
                while pos < len(stream):
                    n = CYCLE[i % len(CYCLE)]
                    ctx.decode(stream[pos:pos + n])
                    pos, i = pos + n, i + 1
                c = ctx.pool_counters()
                ctx.close()
                cells = [f"{h / n:.1%} ({n})" if n else "-" for n, h in zip(c.batch_lookups, c.batch_hits)]
                lines.append(f"| {mode} | {slots} | " + " | ".join(cells) + f" | {c.bypassed_steps} | {c.uploads} |")
        model.close()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
