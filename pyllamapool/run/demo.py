"""`pyllamapool demo`: the pool end to end on whatever this machine has.

With a GPU build it uses the GPU; on a CPU build it starts a loopback RPC device (a separate device
with its own memory, reached as a GPU is over PCIe), generates (or reuses) the default tiny MoE
model, checks parity (pool on vs the stock path on the same backend: identical tokens and logits),
and sweeps from pool off to every expert resident.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console

from ..native.paths import cache_dir
from ..binding.pool import PoolConfig
from .rpc import start_rpc_server
from .offload import Offload
from .session import PoolSession, has_accelerator
from .sweep import SweepGrid, plot, run_sweep, sweep_table, write_json
from .testmodel import ModelSpec, StreamSpec, cached_model, token_stream


@dataclass
class DemoResult:
    parity: bool
    plot_path: Path
    json_path: Path
    rows: list[dict]


def run_demo(console: Console, *, out_dir: Path | None = None, n_tokens: int = 160, repeats: int = 3,
             spec: ModelSpec = ModelSpec()) -> DemoResult:
    out_dir = Path(out_dir or cache_dir() / "demo")
    out_dir.mkdir(parents=True, exist_ok=True)
    model = cached_model(spec)
    console.print(f"[bold]model[/bold] {model} ({spec.arch}, {spec.n_layer} layers, {spec.n_expert} experts, "
                  f"top-{spec.n_expert_used}, {spec.expert_type} experts)")
    stream = token_stream(spec, StreamSpec(n_tokens=n_tokens + 8, seed=11))
    prompt, forced = stream[:8], stream[8:]

    with ExitStack() as stack:
        if has_accelerator():
            console.print("[bold]device[/bold] the build's GPU")
            rpc: tuple[str, ...] = ()
            device_mib = None
        else:
            server = stack.enter_context(start_rpc_server())
            console.print(f"[bold]device[/bold] loopback RPC device {server.endpoint} (no GPU here: "
                          "layers run there, experts stay in this process's memory)")
            rpc = (server.endpoint,)
            device_mib = 16384  # the RPC device reports host RAM: give it a card's size
        resident = Offload(n_gpu_layers=99, rpc=rpc)
        offloaded = Offload(n_gpu_layers=99, rpc=rpc, cpu_moe=True)

        # parity: pool on vs the stock path with every expert resident on the same device
        with PoolSession(model, resident) as session:
            ref = session.run(prompt, 0, teacher_tokens=forced[:48], keep_logits=True)
        with PoolSession(model, offloaded) as session:
            pooled = session.run(prompt, 0, teacher_tokens=forced[:48], keep_logits=True,
                                 pool=PoolConfig(slots=spec.n_expert_used + 2, device_mib=device_mib))
        same_tokens = ref.decode.tokens == pooled.decode.tokens
        same_logits = len(ref.decode.logits) == len(pooled.decode.logits) and \
            all(np.array_equal(a, b) for a, b in zip(ref.decode.logits, pooled.decode.logits))
        evictions = pooled.counters.evictions
        # a run that never evicted would prove nothing about slot reuse
        parity = same_tokens and same_logits and evictions > 0
        console.print(f"[bold]parity[/bold] pool ({spec.n_expert_used + 2} slots, {evictions} evictions) vs stock "
                      f"path on the same device: tokens {'identical' if same_tokens else 'DIFFER'}, logits "
                      f"{'bit-identical' if same_logits else 'DIFFER'} over {len(ref.decode.tokens)} steps")

        slots = sorted({0, spec.n_expert_used, spec.n_expert // 2, 3 * spec.n_expert // 4, spec.n_expert})
        grid = SweepGrid(slots=tuple(slots), device_mib=device_mib)
        result = run_sweep(model, offloaded, grid, prompt, forced, repeats=repeats, console=console)

    console.print("[bold]admission[/bold]")
    for row in result.rows:
        for line in row["lines"]:
            if "status=" in line:
                console.print(f"  -mec {row['slots']:<3} {line}", soft_wrap=True)
    console.print("  -mec 0   (pool off: stock --cpu-moe path, no pool lines)")
    console.print(sweep_table(result, title=f"expert pool sweep: {n_tokens} teacher-forced decode tokens"))
    plot_path = plot(result, out_dir / "sweep.png")
    json_path = out_dir / "sweep.json"
    write_json(result, json_path)
    console.print(f"plot written to {plot_path}")
    console.print(f"sweep JSON written to {json_path}")
    console.print("[dim]t/s on the RPC testbed measures loopback copies on shared CPU cores, not a GPU: "
                  "read hit rate and copy_bytes here; measure speed on your card with `pyllamapool sweep`.[/dim]")
    return DemoResult(parity, plot_path, json_path, result.rows)
