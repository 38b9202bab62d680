"""Reference slot policies in Python, and Belady's offline optimum, over one layer's routing.

Each policy sees one step at a time (the step's distinct experts must all be resident to run it on
the device) and decides what to evict; a gated policy may refuse to admit a missed expert (it then
runs on the CPU: a miss that copies nothing). Results count lookups, hits, misses and uploads.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass
class PolicyStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    uploads: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


Steps = Sequence[Sequence[int]]


def _distinct(step: Sequence[int]) -> list[int]:
    seen: list[int] = []
    for e in step:
        if e not in seen:
            seen.append(e)
    return seen


def lru(steps: Steps, n_slots: int) -> PolicyStats:
    """Evict the least recently used expert not used in this step. Experts used in the same step
    age in the order they were used; the product breaks that tie by slot instead (`recency`)."""
    cache: OrderedDict[int, None] = OrderedDict()
    s = PolicyStats()
    for step in steps:
        want = _distinct(step)
        s.lookups += len(want)
        for e in want:
            if e in cache:
                s.hits += 1
                cache.move_to_end(e)
        for e in want:
            if e in cache:
                continue
            s.misses += 1
            s.uploads += 1
            if len(cache) >= n_slots:
                for victim in cache:
                    if victim not in want:
                        del cache[victim]
                        s.evictions += 1
                        break
            cache[e] = None
            cache.move_to_end(e)
    return s


def _scored(steps: Steps, n_slots: int, score: Callable[[int, dict, int], float],
            on_use: Callable[[int, int, dict], None], gate: Callable[[int, int, dict], bool] | None = None
            ) -> PolicyStats:
    """Generic: evict the resident expert (not used this step) with the lowest score."""
    cache: set[int] = set()
    state: dict = {"last": {}, "freq": {}, "score": {}, "touch": {}}
    s = PolicyStats()
    for t, step in enumerate(steps):
        want = _distinct(step)
        s.lookups += len(want)
        for e in want:
            if e in cache:
                s.hits += 1
        for e in want:
            if e in cache:
                continue
            s.misses += 1
            if gate is not None and not gate(e, t, state):
                continue
            if len(cache) >= n_slots:
                victims = [c for c in cache if c not in want]
                victim = min(victims, key=lambda c: (score(c, state, t), state["last"].get(c, -1), c))
                cache.remove(victim)
                s.evictions += 1
            cache.add(e)
            s.uploads += 1
        for e in want:
            on_use(e, t, state)
    return s


def lfu(steps: Steps, n_slots: int) -> PolicyStats:
    def use(e, t, st):
        st["freq"][e] = st["freq"].get(e, 0) + 1
        st["last"][e] = t
    return _scored(steps, n_slots, lambda c, st, t: st["freq"].get(c, 0), use)


def decayed(steps: Steps, n_slots: int, half_life: float = 16.0) -> PolicyStats:
    """Score = sum of uses, each decayed by 2^(-age / half_life)."""
    lam = math.log(2) / half_life

    def use(e, t, st):
        old, when = st["score"].get(e, (0.0, t))
        st["score"][e] = (old * math.exp(-lam * (t - when)) + 1.0, t)
        st["last"][e] = t

    def score(c, st, t):
        val, when = st["score"].get(c, (0.0, t))
        return val * math.exp(-lam * (t - when))
    return _scored(steps, n_slots, score, use)


def second_touch(steps: Steps, n_slots: int, window: int = 8) -> PolicyStats:
    """LRU eviction, but an expert is admitted (copied) only on its second use within `window` steps;
    a first touch runs on the CPU. Under churn this bounds bytes moved by what is reused."""
    def use(e, t, st):
        st["last"][e] = t
        st["touch"][e] = t

    def gate(e, t, st):
        prev = st["touch"].get(e)
        return prev is not None and t - prev <= window
    return _scored(steps, n_slots, lambda c, st, t: st["last"].get(c, -1), use, gate)


class _Residency:
    """Which expert is in which slot; victims are the lowest key among slots unused this step,
    an empty slot first, ties to the lowest slot (the product's rule)."""

    def __init__(self, n_expert: int, n_slots: int):
        self.slot_of = [-1] * n_expert
        self.expert_in = [-1] * n_slots

    def run(self, want: list[int], key: Callable[[int], tuple]) -> list[int]:
        """Make every expert of the step resident; returns the ones uploaded (the misses)."""
        pinned = {self.slot_of[e] for e in want if self.slot_of[e] >= 0}
        uploaded: list[int] = []
        for e in want:
            if self.slot_of[e] >= 0:
                continue
            free = [s for s in range(len(self.expert_in)) if s not in pinned]
            empty = [s for s in free if self.expert_in[s] < 0]
            slot = empty[0] if empty else min(free, key=lambda s: (key(self.expert_in[s]), s))
            if self.expert_in[slot] >= 0:
                self.slot_of[self.expert_in[slot]] = -1
            self.expert_in[slot], self.slot_of[e] = e, slot
            pinned.add(slot)
            uploaded.append(e)
        return uploaded


@dataclass
class PolicyStep:
    """One step of a re-derived product policy, in the product's per-id form."""
    slots: list[int]   # slot of each id of the step, in order
    miss: list[bool]   # the id's expert was uploaded in this step
    rule: int          # the rule that chose victims: 0 recency (LRU), 1 use count


def adaptive(steps: Steps, n_slots: int, n_expert: int | None = None, age_lookups: int = 4,
             duel_lookups: int = 8, record: list[PolicyStep] | None = None) -> PolicyStats:
    """The product's default, re-derived: evict by recency (LRU) or by use count (halved every
    age_lookups x slots lookups; recency breaks ties), whichever rule missed less lately. Each rule
    runs as a shadow over the same steps; their miss tallies halve every duel_lookups x slots.
    With `record`, each step's slots, miss mask and leading rule are appended to it."""
    n_expert = n_expert or 1 + max((max(s) for s in steps if len(s)), default=0)
    last = [0] * n_expert
    count = [0] * n_expert
    rules = [lambda e: (last[e],), lambda e: (count[e], last[e])]
    real = _Residency(n_expert, n_slots)
    shadows = [_Residency(n_expert, n_slots), _Residency(n_expert, n_slots)]
    shadow_misses = [0, 0]
    since_age = since_duel = 0
    s = PolicyStats()
    for t, step in enumerate(steps, 1):
        want = _distinct(step)
        rule = 1 if shadow_misses[1] < shadow_misses[0] else 0
        uploaded = real.run(want, rules[rule])
        m = len(uploaded)
        if record is not None:
            record.append(PolicyStep([real.slot_of[e] for e in step], [e in uploaded for e in step], rule))
        s.lookups += len(want)
        s.misses += m
        s.uploads += m
        s.hits += len(want) - m
        for i in (0, 1):
            shadow_misses[i] += len(shadows[i].run(want, rules[i]))
        for e in want:
            last[e] = t
            count[e] += 1
        since_age += len(want)
        since_duel += len(want)
        if since_age >= age_lookups * n_slots:
            since_age = 0
            count[:] = [c >> 1 for c in count]
        if since_duel >= duel_lookups * n_slots:
            since_duel = 0
            shadow_misses = [m >> 1 for m in shadow_misses]
    s.evictions = s.misses - (n_slots - real.expert_in.count(-1))  # every other miss filled an empty slot
    return s


def recency(steps: Steps, n_slots: int, n_expert: int | None = None,
            record: list[PolicyStep] | None = None) -> PolicyStats:
    """The product's LRU, re-derived: the victim is the expert used longest ago, and among experts
    last used in the same step, the one in the lowest slot."""
    n_expert = n_expert or 1 + max((max(s) for s in steps if len(s)), default=0)
    last = [0] * n_expert
    real = _Residency(n_expert, n_slots)
    s = PolicyStats()
    for t, step in enumerate(steps, 1):
        want = _distinct(step)
        uploaded = real.run(want, lambda e: (last[e],))
        if record is not None:
            record.append(PolicyStep([real.slot_of[e] for e in step], [e in uploaded for e in step], 0))
        s.lookups += len(want)
        s.misses += len(uploaded)
        s.uploads += len(uploaded)
        s.hits += len(want) - len(uploaded)
        for e in want:
            last[e] = t
    s.evictions = s.misses - (n_slots - real.expert_in.count(-1))
    return s


def global_lru(layers: Sequence[Steps], n_slots_total: int) -> PolicyStats:
    """A copy-on-miss cache shaped like llama.cpp's merged one (`--moe-cache-mib`): one LRU over
    (layer, expert) for all layers that share a device, so the budget moves between layers by
    itself. Layers run in order within a token: the LRU sees one step per layer and token."""
    n_tokens = min(len(steps) for steps in layers) if layers else 0
    return lru([[(li, e) for e in steps[t]] for t in range(n_tokens) for li, steps in enumerate(layers)],
               n_slots_total)


@dataclass
class HybridStats(PolicyStats):
    """Hybrid mode: a miss runs on the CPU in its step; uploads are separate admission decisions."""
    deferred: int = 0    # admitted (it would pay back) but over the upload budget


def hybrid_admission(steps: Steps, n_slots: int, upload_per_step: float, payback_uses: float,
                     window: int = 16) -> PolicyStats:
    """Hybrid admission over one layer. A miss runs on the CPU in its step; an upload happens off the
    critical path, within the upload budget (`upload_per_step` uploads per step, accumulated: a
    fraction of the token time over the upload time). An empty slot takes any missed expert. A full
    pool replaces its least used resident (uses in the last `window` steps, then least recently
    used) only when the candidate's uses beat the victim's by `payback_uses` (the uses that save
    more CPU time than the upload costs: upload ms / CPU ms per expert), so churn cannot cost more
    than it saves. Admitted but over budget counts as `deferred`. The upload lands for the next step.
    """
    resident: set[int] = set()
    recent: deque[list[int]] = deque(maxlen=window)
    uses: dict[int, int] = {}
    last: dict[int, int] = {}
    credit = 0.0
    s = HybridStats()
    for t, step in enumerate(steps):
        want = _distinct(step)
        s.lookups += len(want)
        missed = [e for e in want if e not in resident]
        s.hits += len(want) - len(missed)
        s.misses += len(missed)
        if len(recent) == recent.maxlen:
            for e in recent[0]:
                uses[e] -= 1
        recent.append(want)
        for e in want:
            uses[e] = uses.get(e, 0) + 1
            last[e] = t
        credit = min(credit + upload_per_step, max(1.0, upload_per_step))
        for e in sorted(missed, key=lambda e: -uses[e]):
            victim = None
            if len(resident) >= n_slots:
                victim = min(resident, key=lambda c: (uses.get(c, 0), last.get(c, -1), c))
                if uses[e] - uses.get(victim, 0) < payback_uses:
                    continue
            if credit < 1.0:
                s.deferred += 1
                continue
            if victim is not None:
                resident.remove(victim)
                s.evictions += 1
            resident.add(e)
            s.uploads += 1
            credit -= 1.0
    return s


def belady(steps: Steps, n_slots: int) -> PolicyStats:
    """Offline optimum: evict the resident expert whose next use is farthest in the future."""
    next_use: list[dict[int, int]] = [dict() for _ in steps]
    upcoming: dict[int, int] = {}
    for t in range(len(steps) - 1, -1, -1):
        next_use[t] = dict(upcoming)
        for e in steps[t]:
            upcoming[e] = t

    def use(e, t, st):
        st["last"][e] = t
    return _scored(steps, n_slots, lambda c, st, t: -next_use[t].get(c, math.inf), use)


def brute_force_min_misses(steps: Steps, n_slots: int) -> int:
    """Exact minimum misses over every eviction choice (tiny traces only)."""
    steps = [tuple(_distinct(s)) for s in steps]
    memo: dict[tuple[int, frozenset], int] = {}

    def best(t: int, cache: frozenset) -> int:
        if t == len(steps):
            return 0
        key = (t, cache)
        if key in memo:
            return memo[key]
        want = steps[t]
        missing = [e for e in want if e not in cache]
        keep = cache & frozenset(want)
        others = sorted(cache - keep)
        room = n_slots - len(keep) - len(missing)
        from itertools import combinations
        result = math.inf
        # keep any `room`-sized subset of the other residents (more kept is never worse, but be exact)
        for r in range(min(room, len(others)), -1, -1):
            for kept in combinations(others, r):
                result = min(result, len(missing) + best(t + 1, keep | frozenset(missing) | frozenset(kept)))
        memo[key] = result
        return result

    return best(0, frozenset())


POLICIES: dict[str, Callable[[Steps, int], PolicyStats]] = {
    "lru": lru, "adaptive": adaptive, "lfu": lfu, "decayed": decayed, "second-touch": second_touch,
    "opt": belady,
}


def layer_steps(ids: np.ndarray, layer_index: int) -> list[list[int]]:
    return [row.tolist() for row in ids[:, layer_index, :]]
