"""Sweeps: the same teacher-forced workload over a grid of pool settings, side by side.

Every configuration runs in a fresh context (nothing leaks between runs), `repeats` times; decode
speed is reported as median with min-max, counters come from the telemetry (identical across repeats
under teacher forcing). Output: a rich table, JSON (schema below) and a PNG plot.
"""
from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..binding.pool import PoolConfig
from .offload import Offload
from .session import PoolSession

SCHEMA_ID = "pyllamapool.sweep/1"

#: JSON Schema of `pyllamapool sweep --json` (keys follow the telemetry names)
SWEEP_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": SCHEMA_ID,
    "type": "object",
    "required": ["schema", "model", "offload", "prompt_tokens", "decode_tokens", "repeats", "rows"],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "model": {"type": "string"},
        "offload": {"type": "object"},
        "prompt_tokens": {"type": "integer", "minimum": 1},
        "decode_tokens": {"type": "integer", "minimum": 1},
        "repeats": {"type": "integer", "minimum": 1},
        "rows": {"type": "array", "items": {
            "type": "object",
            "required": ["slots", "rail_mib", "cap_mib", "profile", "status", "reason", "actual_slots",
                         "limited_by", "bytes", "lookups", "hits", "misses", "evictions", "copy_bytes",
                         "hit_rate", "copy_bytes_per_token", "steps", "bypassed_steps", "decode_tps",
                         "tokens_match_first_row"],
            "properties": {
                "slots": {"type": "integer", "minimum": -1},
                # counts and byte totals
                **{name: {"type": "integer", "minimum": 0} for name in (
                    "actual_slots", "bytes", "lookups", "hits", "misses", "evictions", "copy_bytes", "steps",
                    "bypassed_steps", "gated_steps", "cpu_experts", "uploads", "deferred", "prefill_device_bytes",
                    "prefill_host_bytes")},
                "rail_mib": {"type": ["integer", "null"]},
                "cap_mib": {"type": ["integer", "null"]},
                "profile": {"type": ["string", "null"]},
                "policy": {"enum": ["adaptive", "lru"]},
                "gate": {"enum": ["off", "yield"]},
                "mode": {"enum": ["copy", "hybrid"]},
                "syncs_per_token": {"type": "number", "minimum": 0},
                "uploads_path": {"enum": ["stream", "inline"]},
                "block_us_per_token": {"type": "number", "minimum": 0},
                # hits and misses per micro-batch size ("1", "2-8", "9-32", "33+"): classes with lookups
                "by_batch": {"type": "object", "additionalProperties": {
                    "type": "object", "required": ["lookups", "hits", "misses", "hit_rate"]}},
                "status": {"enum": ["enabled", "disabled"]},
                "reason": {"type": "string"},
                "limited_by": {"enum": ["slots", "rail", "cap"]},
                "hit_rate": {"type": "number", "minimum": 0, "maximum": 1},
                "copy_bytes_per_token": {"type": "number", "minimum": 0},
                "predicted_tps": {"type": "number", "exclusiveMinimum": 0},  # sweep --predict
                "decode_tps": {"type": "object", "required": ["median", "min", "max"],
                               "properties": {k: {"type": "number"} for k in ("median", "min", "max")}},
                "tokens_match_first_row": {"type": "boolean"},
            },
        }},
    },
}


@dataclass(frozen=True)
class SweepGrid:
    slots: Sequence[int] = (0, 8, 16)
    rail_mib: Sequence[int | None] = (None,)
    cap_mib: Sequence[int | None] = (None,)
    profile: Sequence[str | None] = (None,)
    device_mib: int | tuple[int, ...] | None = None
    policy: Sequence[str | None] = (None,)
    gate: Sequence[str | None] = (None,)
    mode: Sequence[str | None] = (None,)
    upload_frac: float | None = None

    def configs(self) -> list[PoolConfig]:
        out = []
        for slots, rail, cap, profile, policy, gate, mode in itertools.product(
                self.slots, self.rail_mib, self.cap_mib, self.profile, self.policy, self.gate, self.mode):
            if slots == 0 and (policy, gate, mode) != (self.policy[0], self.gate[0], self.mode[0]):
                continue  # the pool is off: policy, gate and mode change nothing
            cfg = PoolConfig(slots=slots, rail_mib=rail, cap_mib=cap, device_mib=self.device_mib, profile=profile,
                             policy=policy, gate=gate, mode=mode, upload_frac=self.upload_frac)
            cfg.validate()
            out.append(cfg)
        return out


@dataclass
class SweepResult:
    model: str
    offload: Offload
    prompt_tokens: int
    decode_tokens: int
    repeats: int
    rows: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"schema": SCHEMA_ID, "model": self.model, "offload": asdict(self.offload),
                "prompt_tokens": self.prompt_tokens, "decode_tokens": self.decode_tokens,
                "repeats": self.repeats, "rows": self.rows}


def run_sweep(model: str | Path, offload: Offload, grid: SweepGrid, prompt: Sequence[int],
              stream: Sequence[int], *, repeats: int = 3, console: Console | None = None,
              progress: bool = True) -> SweepResult:
    configs = grid.configs()
    result = SweepResult(str(model), offload, len(prompt), len(stream), repeats)
    first_tokens: list[int] | None = None
    with PoolSession(model, offload) as session, Progress(
            TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("[dim]{task.description}"), console=console or Console(stderr=True),
            transient=True, disable=not progress) as bar:
        task = bar.add_task("", total=len(configs) * repeats)
        for cfg in configs:
            speeds = []
            run = None
            for _ in range(repeats):
                bar.update(task, description=f"slots={cfg.slots}")
                run = session.run(prompt, 0, pool=cfg, teacher_tokens=stream)
                speeds.append(run.decode.decode_tokens_per_s)
                bar.advance(task)
            assert run is not None
            if first_tokens is None:
                first_tokens = run.decode.tokens
            c, s = run.counters, run.status
            result.rows.append({
                "slots": cfg.slot_list[0], "rail_mib": cfg.rail_mib, "cap_mib": cfg.cap_mib,
                "profile": str(cfg.profile) if cfg.profile else None,
                "policy": s.policy, "gate": s.gate, "gated_steps": c.gated_steps, "mode": s.mode,
                "cpu_experts": c.cpu_experts, "uploads": c.uploads, "deferred": c.deferred,
                "syncs_per_token": c.syncs_per_token, "by_batch": c.by_batch(),
                "uploads_path": s.uploads, "block_us_per_token": c.block_us_per_token,
                "prefill_device_bytes": c.prefill_device_bytes, "prefill_host_bytes": c.prefill_host_bytes,
                "status": "enabled" if s.enabled else "disabled", "reason": s.reason,
                "actual_slots": s.actual_slots, "limited_by": s.limited_by, "bytes": s.bytes,
                "lookups": c.lookups, "hits": c.hits, "misses": c.misses, "evictions": c.evictions,
                "copy_bytes": c.copy_bytes, "hit_rate": c.hit_rate,
                "copy_bytes_per_token": c.copy_bytes / max(1, len(stream)),
                "steps": c.steps, "bypassed_steps": c.bypassed_steps,
                "decode_tps": {"median": statistics.median(speeds), "min": min(speeds), "max": max(speeds)},
                "tokens_match_first_row": run.decode.tokens == first_tokens,
                "lines": run.lines,
            })
    return result


def sweep_table(result: SweepResult, title: str = "expert pool sweep") -> Table:
    """One row per configuration; `limit` is limited_by for an admitted pool, else why it is off."""
    table = Table(title=title)
    predicted = all("predicted_tps" in r for r in result.rows) and result.rows
    for col in ("-mec", "policy", "limit", "MiB", "hits", "copy/tok", "evict", "gated", "t/s (min-max)", "vs off",
                *(("predicted t/s",) if predicted else ())):
        table.add_column(col, justify="left" if col == "limit" else "right", no_wrap=True)
    base = next((r["decode_tps"]["median"] for r in result.rows if r["slots"] == 0), None)
    for r in result.rows:
        t = r["decode_tps"]
        limit = "off" if r["slots"] == 0 else (r["limited_by"] if r["status"] == "enabled" else r["reason"])
        table.add_row(
            str(r["slots"]), "-" if r["slots"] == 0 else r["policy"] + ("+gate" if r["gate"] == "yield" else "")
            + ("+hybrid" if r.get("mode") == "hybrid" else ""),
            limit, f"{r['bytes'] / 2**20:.1f}", f"{r['hit_rate']:.1%}" if r["lookups"] else "-",
            f"{r['copy_bytes_per_token'] / 1024:.0f}K", str(r["evictions"]), str(r["gated_steps"]),
            f"{t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f})", f"{t['median'] / base:.2f}x" if base else "-",
            *((f"{r['predicted_tps']:.0f}",) if predicted else ()))
    return table


def write_json(result: SweepResult, path: Path | None) -> str:
    data = result.to_json()
    for row in data["rows"]:
        row.pop("lines", None)
    text = json.dumps(data, indent=2)
    if path:
        Path(path).write_text(text + "\n")
    return text


def plot(result: SweepResult, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(result.rows, key=lambda r: r["slots"])
    x = [r["slots"] for r in rows]
    med = [r["decode_tps"]["median"] for r in rows]
    lo = [m - r["decode_tps"]["min"] for m, r in zip(med, rows)]
    hi = [r["decode_tps"]["max"] - m for m, r in zip(med, rows)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3)
    axes[0].set_title("decode tokens/s (median, min-max)")
    pooled = [r for r in rows if r["lookups"]]  # slots=0: no pool, no hit rate
    axes[1].plot([r["slots"] for r in pooled], [100 * r["hit_rate"] for r in pooled], marker="o", color="tab:green")
    axes[1].set_title("hit rate %")
    axes[1].set_ylim(0, 100)
    axes[2].plot(x, [r["copy_bytes_per_token"] / 1024 for r in rows], marker="o", color="tab:red")
    axes[2].set_title("copy_bytes per token (KiB)")
    for ax in axes:
        ax.set_xlabel("slots per offloaded tensor (-mec)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(result.model).name}: expert pool sweep ({result.decode_tokens} teacher-forced tokens, "
                 f"{result.repeats} repeats)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
