"""Per-miss placement by cost, the rule hybrid mode is to get (issue 27), played over one layer's routing.

Today's hybrid computes every miss on the CPU and uploads only off the critical path (within a budget,
when the expert's recent uses pay the upload back). The rule here also weighs, for each step, uploading
some misses now for the device to compute: the device then does its hits plus those uploads (each an
upload and a matmul), the CPU the rest, and the two sides run side by side, so the step takes the
slower side's time. With a fast link and a slow host that uploads most misses (copy mode's behaviour),
with a slow link none (today's hybrid), and in between it splits. Misses uploaded now are the ones used
most lately, and they take a slot like any admitted expert.

This is the lab's estimate of what the engine would reach: it is not in the engine yet.
"""
from __future__ import annotations

from .policies import HybridStats, Steps, hybrid_admission


def uploads_now(hits: int, misses: int, cpu_ms: float, dev_ms: float, up_ms: float, host_ms: float = 0.0) -> int:
    """How many of a step's misses to upload for the device, so that the slower of the device's side
    (hits and the uploaded misses, each an upload and a matmul) and the CPU's (the rest) is fastest;
    the fewest uploads among equals. `host_ms`: the gather of one expert into staging, which both
    sides wait for (0 where the experts sit in pinned memory and are copied from there)."""
    best, best_ms = 0, max(hits * dev_ms, misses * cpu_ms)
    for u in range(1, misses + 1):
        ms = u * host_ms + max(hits * dev_ms + u * (up_ms + dev_ms), (misses - u) * cpu_ms)
        if ms < best_ms:
            best, best_ms = u, ms
    return best


def cost_placement(steps: Steps, n_slots: int, cpu_ms: float, dev_ms: float, up_ms: float,
                   upload_per_step: float, payback_uses: float, window: int = 16, prefetch=None,
                   host_ms: float = 0.0) -> HybridStats:
    """Hybrid admission with each step's misses placed by cost first (`uploads_now`), and with
    `prefetch` (`lab.prefetch.Prefetch`) each step's predicted misses uploaded ahead of it."""
    return hybrid_admission(steps, n_slots, upload_per_step, payback_uses, window,
                            now=lambda hits, misses: uploads_now(hits, misses, cpu_ms, dev_ms, up_ms, host_ms),
                            prefetch=prefetch)
