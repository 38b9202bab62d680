"""`pyllamapool tune MODEL.gguf`: what to run on this machine, and the command line that runs it.

It reads the model's header, plans what the pool can hold on this machine's device (or on a card of
`--device-mib`), measures what one expert costs this CPU and, where there is a device, what the link
moves; then it times a short teacher-forced decode of stock `--cpu-moe` and of each mode at a few slot
counts on the device. Without a device it predicts those with the cost model instead, from the host
figure it measured and a profile's link and device. Every figure says whether it was measured or
predicted. The recommendation is the pool only where it beats stock by more than noise.
"""
from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..errors import PyllamapoolError
from ..run.offload import Offload
from ..binding.pool import PoolConfig

#: a pool is recommended only when its measured (or predicted) t/s beats stock by this much: below it
#: a short run cannot tell the two apart, and stock is the safer default
MARGIN = 0.05


@dataclass
class Choice:
    mode: str                 # stock, copy or hybrid
    slots: int                # per layer; 0 for stock
    tokens_per_s: float
    source: str               # measured or predicted
    hit_rate: float | None = None
    status: str = ""          # admission, for pooled choices ("enabled", or "disabled: reason")

    @property
    def label(self) -> str:
        return "stock --cpu-moe" if self.mode == "stock" else f"{self.mode}, -mec {self.slots}"


@dataclass
class TuneResult:
    model: str
    device: str
    device_mib: int | None
    auto_slots: int           # what -mec -1 admits here
    host: dict                # the CPU's cost per expert (measured)
    link: dict | None         # host -> device (measured where there is a device)
    choices: list[Choice]
    best: Choice
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def command_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.command)

    def to_json(self) -> dict:
        out = asdict(self)
        out["schema"] = "pyllamapool.tune/1"
        out["command_line"] = self.command_line
        return out


def _expert_shape(path: str | Path) -> tuple[str, int, int]:
    """(type, n_embd, n_ff) of the model's routed experts, from the first layer that has them."""
    import gguf

    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name.endswith("ffn_up_exps.weight"):
            return t.tensor_type.name, int(t.shape[0]), int(t.shape[1])
    raise PyllamapoolError(f"{path}: no routed experts (blk.N.ffn_up_exps): not a MoE model pyllamapool can tune")


def _candidates(auto_slots: int, top_k: int, n_expert: int) -> list[int]:
    """A few slot counts from top-k up to what fits: the curve's ends and its middle."""
    top = min(auto_slots, n_expert)
    return sorted({s for s in (top_k, (top_k + top) // 2, top) if top_k <= s <= top}) if top >= top_k else []


def server_command(model: str | Path, offload: Offload, best: Choice,
                   device_mib: int | tuple[int, ...] | None) -> tuple[list[str], dict]:
    """The `pyllamapool server` (the patched llama-server) command for a choice, and its environment:
    the context size and threads it was planned and timed with (llama-server's own default context is
    the model's training length, whose KV cache can leave no room for the slots)."""
    argv = ["pyllamapool", "server", "-m", str(model), "-ngl", str(offload.n_gpu_layers), "-c", str(offload.n_ctx)]
    if offload.n_threads:
        argv += ["-t", str(offload.n_threads)]
    argv += ["--n-cpu-moe", str(offload.n_cpu_moe)] if offload.n_cpu_moe else ["--cpu-moe"]
    if offload.rpc:
        argv += ["--rpc", ",".join(offload.rpc)]
    if best.mode == "stock":
        argv += ["-mec", "0"]
    else:
        argv += ["-mec", str(best.slots), "--moe-pool-mode", best.mode]
    if isinstance(device_mib, (tuple, list)):
        device_mib = ",".join(map(str, device_mib))  # one size per device, as the variable takes them
    env = {"LLAMA_MOE_POOL_DEVICE_MIB": str(device_mib)} if device_mib else {}
    return argv, env


def tune(model: str | Path, offload: Offload, *, device_mib: int | tuple[int, ...] | None = None,
         modes: tuple[str, ...] = ("hybrid", "copy"), n_tokens: int = 64, profile: str = "rtx3090-pcie4",
         console=None) -> TuneResult:
    from . import predict as P
    from ..binding.llama import devices
    from ..run.measure import measure_host, measure_link
    from .plan import plan
    from ..run.session import has_accelerator
    from ..run.sweep import SweepGrid, run_sweep
    from ..run.testmodel import StreamSpec, spec_of, token_stream

    bad = [m for m in modes if m not in ("hybrid", "copy")]
    if bad or not modes:
        raise PyllamapoolError(f"--mode {','.join(modes)}: expected hybrid, copy or both")
    say = console.print if console is not None else (lambda *a, **k: None)
    offload = replace(offload, cpu_moe=offload.cpu_moe or not offload.n_cpu_moe)
    expert_type, n_embd, n_ff = _expert_shape(model)
    notes: list[str] = []

    say(f"[bold]model[/bold] {Path(model).name}: {expert_type} experts of {n_embd} x {n_ff}")
    planned = plan(model, offload, PoolConfig(slots=-1, device_mib=device_mib)).run
    auto_slots = planned.status.actual_slots if planned.status.enabled else 0
    say(f"[bold]plan[/bold] -mec -1 admits {auto_slots} slots per layer"
        + ("" if planned.status.enabled else f" (pool off: {planned.status.reason})"))
    if not planned.status.enabled:
        notes.append(f"the planner admits no pool here ({planned.status.reason}): stock is the only choice")

    say("[bold]host[/bold] timing one expert on the CPU ...")
    host = asdict(measure_host(expert_type, n_embd, n_ff, threads=offload.n_threads, seconds=1.0))
    say(f"[bold]host[/bold] {host['ms_per_expert']:.3f} ms per expert, {host['gb_per_s']:.1f} GB/s (measured)")

    measured = bool(offload.rpc) or has_accelerator()
    link = None
    device_name = "none (predicted with profile " + profile + ")"
    if measured:
        device = next(d for d in devices() if d.kind in ("gpu", "igpu")
                      and (d.name.startswith("RPC") if offload.rpc else not d.name.startswith("RPC")))
        device_name = f"{device.name} ({device.description})"
        link = measure_link(device.name, mib=64)
        say(f"[bold]link[/bold] {device_name}: {link['pageable_gb_s']:.1f} GB/s pageable"
            + (f", {link['pinned_gb_s']:.1f} pinned" if "pinned_gb_s" in link else "") + " (measured)")

    spec = spec_of(model)
    geometry_profile = replace(P.parse_profile(profile), host_expert_gb_s=host["gb_per_s"])
    g = P.geometry_from_gguf(model, geometry_profile)
    slots = _candidates(auto_slots, g.top_k, g.n_expert)
    choices: list[Choice] = []
    if measured:
        stream = token_stream(spec, StreamSpec(n_tokens=n_tokens + 8, seed=0))
        grid = SweepGrid(slots=(0, *slots), device_mib=device_mib, mode=modes)
        sweep_offload = replace(offload, n_ctx=max(offload.n_ctx, n_tokens + 16))
        result = run_sweep(model, sweep_offload, grid, stream[:8], stream[8:], repeats=1, console=console)
        # the mode asked for (a disabled pool's status reports no mode of its own)
        for cfg, r in zip(grid.configs(), result.rows):
            pooled = r["slots"] != 0
            choices.append(Choice(cfg.mode if pooled else "stock", r["actual_slots"] if pooled else r["slots"],
                                  r["decode_tps"]["median"], "measured", r["hit_rate"] if pooled else None,
                                  (r["status"] if r["status"] == "enabled" else f"disabled: {r['reason']}")
                                  if pooled else ""))
    else:
        notes.append(f"no device here: t/s predicted by `pyllamapool predict` with profile {profile}'s link and "
                     "device and this CPU's measured cost per expert")
        routing = P.Routing.from_preset("qwen3-30b-a3b", 0, n_expert=g.n_expert, top_k=g.top_k)
        stock = P.predict(g, geometry_profile, routing, 0, modes=("stock",))[0]
        choices.append(Choice("stock", 0, stock.tokens_per_s, "predicted"))
        for s in slots:
            for mode in modes:
                r = P.predict(g, geometry_profile, routing, s, modes=(mode,))[0]
                choices.append(Choice(mode, s, r.tokens_per_s, "predicted", r.hit_rate, "planned"))
    stock_choice = next(c for c in choices if c.mode == "stock")
    usable = [c for c in choices if c.mode != "stock" and not c.status.startswith("disabled")]
    best = max(usable, key=lambda c: c.tokens_per_s, default=stock_choice)
    if best.tokens_per_s < stock_choice.tokens_per_s * (1 + MARGIN):
        if best is not stock_choice:
            notes.append(f"the best pool ({best.label}, {best.tokens_per_s:.1f} t/s) is not {MARGIN:.0%} faster than "
                         f"stock ({stock_choice.tokens_per_s:.1f} t/s): stock is recommended")
        best = stock_choice
    command, env = server_command(model, offload, best, device_mib)
    return TuneResult(str(model), device_name, device_mib, auto_slots, host, link, choices, best, command, env, notes)


def tune_table(result: TuneResult):
    from rich.table import Table

    table = Table(title=f"pyllamapool tune: {Path(result.model).name} on {result.device}")
    for col in ("choice", "-mec", "t/s", "x stock", "hit rate", "admission", "figure"):
        table.add_column(col, justify="right")
    stock = next(c for c in result.choices if c.mode == "stock").tokens_per_s
    for c in result.choices:
        mark = " ←" if c is result.best else ""
        table.add_row(c.label + mark, str(c.slots) if c.slots else "-", f"{c.tokens_per_s:.1f}",
                      f"{c.tokens_per_s / stock:.2f}", "-" if c.hit_rate is None else f"{c.hit_rate:.1%}",
                      c.status or "-", c.source)
    return table
