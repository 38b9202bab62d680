"""Replay a routing trace through the product's own slot policy (the C++ in the patch series)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..binding.pool import DEFAULT_POLICY, PoolCounters, Policy
from ..run.trace import Trace


@dataclass(frozen=True)
class ReplayResult:
    """Counters summed over layers (each counted once, bytes over its pools), as the live pool's
    runtime line reports them."""
    counters: PoolCounters
    per_layer: dict[int, PoolCounters]
    miss: np.ndarray          # [tokens, layers, top_k] True where the lookup missed


def layer_slot_bytes(trace: Trace, layer: int) -> tuple[int, int]:
    """(pools in this layer, bytes of one slot summed over them)."""
    per = trace.bytes_per_expert.get(layer, {})
    return (len(per) or 1, sum(per.values()))


def replay_product(trace: Trace, n_slots: int | dict[int, int], policy: str | int = DEFAULT_POLICY,
                   gate: bool = False) -> ReplayResult:
    """One policy per layer (gate/up/down share a slot table), stepped token by token. With the
    admission gate, a token the closed gate sends to the stock path is skipped (no lookup, no copy)."""
    per_layer: dict[int, PoolCounters] = {}
    miss = np.zeros(trace.ids.shape, dtype=bool)
    totals = dict(lookups=0, hits=0, misses=0, evictions=0, copy_bytes=0, gated_steps=0, gate_closures=0)
    for li, layer in enumerate(trace.layers):
        slots = n_slots[layer] if isinstance(n_slots, dict) else n_slots
        replayer = Policy(trace.n_expert, slots, policy, gate=gate)
        for t in range(trace.n_tokens):
            try:
                missed = replayer.feed(trace.ids[t, li].tolist())
            except ValueError as exc:
                raise ValueError(f"token {t} layer {layer}: {exc}") from None
            if missed is not None:
                miss[t, li] = missed
        c = replayer.counters()
        _, slot_bytes = layer_slot_bytes(trace, layer)
        c = PoolCounters(c.lookups, c.hits, c.misses, c.evictions, c.misses * slot_bytes, c.steps, 0,
                         c.gated_steps, c.gate_closures)
        per_layer[layer] = c
        totals["lookups"] += c.lookups
        totals["hits"] += c.hits
        totals["misses"] += c.misses
        totals["evictions"] += c.evictions
        totals["copy_bytes"] += c.copy_bytes
        totals["gated_steps"] += c.gated_steps
        totals["gate_closures"] += c.gate_closures
    steps = trace.n_tokens
    return ReplayResult(PoolCounters(**totals, steps=steps, bypassed_steps=0), per_layer, miss)
