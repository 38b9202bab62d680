"""llama.cpp's own expert cache (`--moe-cache-mib`, upstream since b11480): what it reports.

Upstream's cache has no API for its figures; it logs its size when a context is created and its hits,
misses and uploaded MiB when the context is freed. This module reads those lines, so that a run with
upstream's cache can be set beside one with the expert pool.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

_SIZE = re.compile(r"MoE cache size = +([0-9.]+) MiB for ([0-9.]+) MiB of host experts")
_SLOTS = re.compile(r"(\d+) layers, \S+: +(\d+) slots")
_STATS = re.compile(r"llama_moe_cache: ubatch +(<=|>) 8: hits = (\d+), misses = (\d+), "
                    r"hit rate = [0-9.]+%, uploaded = ([0-9.]+) MiB")
_COPIED = re.compile(r"llama_moe_cache: large batches: (\d+) experts copied from the cache, ([0-9.]+) MiB")


@dataclass(frozen=True)
class MoeCacheStats:
    """What upstream's cache logged for one context (hits and misses count (layer, expert) pairs
    per micro-batch, summed over micro-batch sizes)."""
    size_mib: float          # device memory of the cache, over all devices
    host_expert_mib: float   # the host-resident experts it caches
    slots: int               # expert slots, over all layer groups
    hits: int
    misses: int
    uploaded_mib: float
    copied_experts: int = 0  # experts large batches copied device to device from the cache

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def equal_memory_mib(pool_bytes: int) -> int:
    """The `--moe-cache-mib` that gives upstream's cache a pool's device bytes: whole MiB (what the
    flag takes), rounded up so that it never gets less; 0 for a pool that holds nothing."""
    return math.ceil(pool_bytes / 2**20) if pool_bytes > 0 else 0


def parse_stats(lines: Iterable[str]) -> MoeCacheStats | None:
    """The cache's figures from a context's log (creation and free), None if it had no cache."""
    size = host = uploaded = 0.0
    slots = hits = misses = copied = 0
    seen = False
    for line in lines:
        if m := _SIZE.search(line):
            size += float(m.group(1))
            host += float(m.group(2))
            seen = True
        elif m := _SLOTS.search(line):
            slots += int(m.group(2))
        elif m := _STATS.search(line):
            hits += int(m.group(2))
            misses += int(m.group(3))
            uploaded += float(m.group(4))
        elif m := _COPIED.search(line):
            copied += int(m.group(1))
    if not seen:
        return None
    return MoeCacheStats(size_mib=size, host_expert_mib=host, slots=slots, hits=hits, misses=misses,
                         uploaded_mib=uploaded, copied_experts=copied)
