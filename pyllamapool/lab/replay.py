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


def replay_bank(trace: Trace, n_slots_total: int, policy: str | int = DEFAULT_POLICY) -> ReplayResult:
    """One bank shared by every layer of the trace, through the product's own slot policy: the policy
    over (layer, expert) entries, each layer's step fed in turn within a token, so that a slot belongs
    to no layer and a victim is never an entry the layer's current step reads (the policy's rule for
    a step's own ids). Per-layer counters are the layer's share of the bank's lookups and misses."""
    width = trace.n_expert
    replayer = Policy(len(trace.layers) * width, n_slots_total, policy)
    miss = np.zeros(trace.ids.shape, dtype=bool)
    for t in range(trace.n_tokens):
        for li, layer in enumerate(trace.layers):
            try:
                missed = replayer.feed((trace.ids[t, li] + li * width).tolist())
            except ValueError as exc:
                raise ValueError(f"token {t} layer {layer}: {exc}") from None
            miss[t, li] = missed
    c = replayer.counters()
    per_layer: dict[int, PoolCounters] = {}
    copy_bytes = 0
    for li, layer in enumerate(trace.layers):
        lookups = sum(len(set(trace.ids[t, li].tolist())) for t in range(trace.n_tokens))
        # a step's repeated id misses once: count distinct missed experts per step
        misses = sum(len(set(trace.ids[t, li][miss[t, li]].tolist())) for t in range(trace.n_tokens))
        _, slot_bytes = layer_slot_bytes(trace, layer)
        per_layer[layer] = PoolCounters(lookups, lookups - misses, misses, 0, misses * slot_bytes, trace.n_tokens, 0, 0, 0)
        copy_bytes += misses * slot_bytes
    totals = PoolCounters(c.lookups, c.hits, c.misses, c.evictions, copy_bytes, trace.n_tokens, 0, 0, 0)
    return ReplayResult(totals, per_layer, miss)
