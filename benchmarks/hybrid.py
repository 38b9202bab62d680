#!/usr/bin/env python3
"""Stock, copy and hybrid mode side by side on the loopback RPC testbed (a proxy: the "device" is the
same cores, and every CPU split costs RPC round trips). Prints the README's Markdown table.

    python benchmarks/hybrid.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import statistics
from pyllamapool.llama import Context, Model, add_rpc_server
from pyllamapool.rpc import start_rpc_server
from pyllamapool.pool import PoolConfig
from pyllamapool.testmodel import ModelSpec, cached_model, token_stream, StreamSpec
from pyllamapool.decode import run_context
spec = ModelSpec(n_expert=32, n_expert_used=4, n_embd=256, n_ff_exp=256)
path = cached_model(spec)
stream = token_stream(spec, StreamSpec(n_tokens=136, seed=3))
with start_rpc_server() as srv:
    add_rpc_server(srv.endpoint)
    model = Model(path, n_gpu_layers=99, rpc=[srv.endpoint], cpu_moe=True)
    rows = []
    for mode, slots in [("stock", 0)] + [(m, s) for s in (4, 8, 16, 32) for m in ("copy", "hybrid")]:
        speeds, c = [], None
        for _ in range(3):
            ctx = Context(model, pool=PoolConfig(slots=slots, device_mib=65536, mode=None if mode == "stock" else mode))
            r = run_context(ctx, stream[:8], 0, teacher_tokens=stream[8:])
            rep = ctx.pool_report(per_pool=True) if slots else None
            ctx.close()
            speeds.append(r.decode_tokens_per_s)
        n = len(stream) - 8
        if rep:
            cc = rep.counters; per_layer = len(rep.pools) // spec.n_layer
            cpu = (cc.misses / per_layer) / n if mode == "hybrid" else 0.0
            dev = (cc.hits / per_layer) / n if mode == "hybrid" else (cc.lookups / per_layer) / n
            up = cc.copy_bytes / n / 1024
            hit = cc.hit_rate
        else:
            cpu, dev, up, hit = spec.n_layer * spec.n_expert_used, 0.0, 0.0, 0.0
        rows.append((mode, slots, statistics.median(speeds), hit, cpu, dev, up))
        print(rows[-1], flush=True)
    model.close()
stock = rows[0][2]
print("| mode | -mec | t/s (loopback) | x stock | hit rate | CPU experts / token | device experts / token | KiB uploaded / token |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for mode, slots, tps, hit, cpu, dev, up in rows:
    print(f"| {mode} | {slots or '-'} | {tps:.0f} | {tps/stock:.2f} | {hit:.1%} | {cpu:.1f} | {dev:.1f} | {up:.0f} |")
