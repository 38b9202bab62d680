"""What-if admission: what would the pool admit on a card of a given size, without that card?

The model is loaded without allocating anything (llama.cpp's own estimate of weights, KV cache and
compute buffers), the context is made with the pool settings, and the same ledger and planner that
size real pools report the plan. Without an accelerator, a loopback RPC device stands in for the card
(nothing is allocated on it either), so the answer is what a real run with the same inputs admits.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from ..errors import PyllamapoolError
from ..binding.pool import PoolConfig
from ..run.rpc import start_rpc_server
from ..run.offload import Offload
from ..run.session import PoolRun, PoolSession, has_accelerator


@dataclass
class Plan:
    run: PoolRun

    @property
    def status_lines(self) -> list[str]:
        return [line for line in self.run.lines if "status=" in line]

    def layer_table(self) -> Table:
        table = Table(title="planned pools per layer")
        for col in ("layer", "device", "tensors", "slots", "experts", "bytes/slot", "pool MiB"):
            table.add_column(col, justify="right")
        by_layer: dict[int, list] = {}
        for info in self.run.pools:
            by_layer.setdefault(info.layer, []).append(info)
        names = [d.device for d in self.run.devices]
        for layer, infos in sorted(by_layer.items()):
            slot_bytes = sum(i.slot_bytes for i in infos)
            table.add_row(str(layer), names[infos[0].device] if infos[0].device < len(names) else "?",
                          str(len(infos)), str(infos[0].slots), str(infos[0].n_expert), f"{slot_bytes:,}",
                          f"{slot_bytes * infos[0].slots / 2**20:.1f}")
        return table


def plan(model: str | Path, offload: Offload, pool: PoolConfig) -> Plan:
    if not pool.enabled:
        raise PyllamapoolError("plan needs -mec N with N > 0 (0 = pool off)")
    with ExitStack() as stack:
        if not offload.rpc and not has_accelerator():
            if pool.device_mib is None:
                raise PyllamapoolError("no accelerator here: give --device-mib (the card to plan for)")
            server = stack.enter_context(start_rpc_server())
            offload = Offload(**{**offload.__dict__, "rpc": (server.endpoint,)})
        session = stack.enter_context(PoolSession(model, offload, no_alloc=True))
        return Plan(session.plan(pool))
