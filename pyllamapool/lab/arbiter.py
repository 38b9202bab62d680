"""`-mec auto`'s arbiter, as a model: which side runs each decode step when the times are known.

The runtime (src/llama-moe-pool-arbiter.h in the patch series) times decode steps on the stock path
and on the pool in turns and lets the faster side run; this module plays the same rules with fixed
step times, so that `predict` can say what `auto` costs against the faster side and how far below
stock it can fall. The constants are the runtime's, under the same names.
"""
from __future__ import annotations

from dataclasses import dataclass

WARM_POOL, WARM_STOCK, SAMPLE = 4, 2, 8
EARLY_STEPS, EARLY_LOSS = 3, 0.25
HOLD_FIRST, HOLD_MAX = 32, 4096
PROBE_COST, MARGIN = 0.03, 0.02
#: the decode length `predict` judges auto over: a reply of a few hundred tokens
GENERATION = 512


@dataclass(frozen=True)
class AutoRun:
    ms_per_token: float  # mean over the generation
    stock_share: float   # share of the steps the stock path ran
    holder: str          # the side the last verdict chose


def play(pool_ms: float, stock_ms: float, n_steps: int = GENERATION) -> AutoRun:
    """The arbiter over n_steps decode steps whose times are pool_ms and stock_ms per token."""
    if pool_ms <= 0 or stock_ms <= 0 or n_steps <= 0:
        raise ValueError(f"times and steps must be > 0 (got {pool_ms}, {stock_ms}, {n_steps})")
    ms = {"pool": pool_ms, "stock": stock_ms}
    other = {"pool": "stock", "stock": "pool"}
    cur = holder = "stock"
    first, phase = True, "timed"
    warm, probed, left, hold, verdicts = WARM_STOCK, 0, 0, HOLD_FIRST, 0
    timed = {"pool": 0, "stock": 0}
    total, stock_steps = 0.0, 0

    def start_probe(side: str) -> None:
        nonlocal cur, phase, warm, probed
        cur, phase, warm, probed = side, "timed", WARM_POOL if side == "pool" else WARM_STOCK, 0
        timed[side] = 0

    for _ in range(n_steps):
        total += ms[cur]
        stock_steps += cur == "stock"
        probed += 1
        was_timed = warm == 0
        warm = max(0, warm - 1)
        if was_timed:
            timed[cur] = min(SAMPLE, timed[cur] + 1)
        if phase == "hold":
            left -= 1
            if left <= 0:
                start_probe(other[cur])
            continue
        if not was_timed:
            continue
        if first:
            if timed[cur] == SAMPLE:
                first = False
                start_probe("pool")
            continue
        lost_early = timed[cur] >= EARLY_STEPS and ms[cur] > ms[holder] * (1 + EARLY_LOSS)
        if timed[cur] < SAMPLE and not lost_early:
            continue
        verdicts += 1
        challenger = other[holder]
        winner = challenger if ms[challenger] < ms[holder] * (1 - MARGIN) else holder
        if winner != holder:
            hold = HOLD_FIRST
        else:
            hold = min(2 * hold, HOLD_MAX) if verdicts > 1 else hold
            loss = ms[challenger] / ms[holder] - 1
            if loss > 0:
                hold = max(hold, min(HOLD_MAX, int(loss * probed / PROBE_COST)))
        holder = winner
        if winner != cur:
            cur, warm = winner, WARM_POOL if winner == "pool" else WARM_STOCK
        phase, left = "hold", hold
    return AutoRun(total / n_steps, stock_steps / n_steps, holder)
