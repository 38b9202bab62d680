"""Reference slot policies in Python, and Belady's offline optimum, over one layer's routing.

Each policy sees one step at a time (the step's distinct experts must all be resident to run it on
the device) and decides what to evict; a gated policy may refuse to admit a missed expert (it then
runs on the CPU: a miss that copies nothing). Results count lookups, hits, misses and uploads.
"""
from __future__ import annotations

import heapq
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
    """Which expert is in which slot; victims are the lowest score among slots unused this step,
    an empty slot first, ties to the lowest slot (the product's rule)."""

    def __init__(self, n_expert: int, n_slots: int):
        self.slot_of = [-1] * n_expert
        self.expert_in = np.full(n_slots, -1, dtype=np.int64)

    def run(self, want: list[int], score: np.ndarray) -> list[int]:
        """Make every expert of the step resident (score: per expert, the lowest is evicted first);
        returns the ones uploaded (the misses). Taking victims one miss at a time, each pinned once
        taken, is taking the step's misses' worth of victims in one order: so it is sorted once."""
        uploaded = [e for e in want if self.slot_of[e] < 0]
        if not uploaded:
            return uploaded
        free = np.ones(len(self.expert_in), dtype=bool)
        free[[self.slot_of[e] for e in want if self.slot_of[e] >= 0]] = False
        slots = np.flatnonzero(free)
        held = self.expert_in[slots]
        keys = np.where(held < 0, -np.inf, score[np.maximum(held, 0)])
        order = slots[np.lexsort((slots, keys))]
        if len(uploaded) > len(order):
            raise ValueError(f"a step of {len(want)} distinct experts does not fit {len(self.expert_in)} slots")
        for e, slot in zip(uploaded, order.tolist()):
            old = self.expert_in[slot]
            if old >= 0:
                self.slot_of[old] = -1
            self.expert_in[slot], self.slot_of[e] = e, slot
        return uploaded

    @property
    def n_empty(self) -> int:
        return int((self.expert_in < 0).sum())


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
    last = np.zeros(n_expert)
    count = np.zeros(n_expert, dtype=np.int64)
    # the rules' keys as one score each: by use count (last use breaks ties: last <= len(steps)) or by last use
    span = len(steps) + 1
    real = _Residency(n_expert, n_slots)
    shadows = [_Residency(n_expert, n_slots), _Residency(n_expert, n_slots)]
    shadow_misses = [0, 0]
    since_age = since_duel = 0
    s = PolicyStats()
    for t, step in enumerate(steps, 1):
        want = _distinct(step)
        rule = 1 if shadow_misses[1] < shadow_misses[0] else 0
        scores = (last, count * span + last)
        uploaded = real.run(want, scores[rule])
        m = len(uploaded)
        if record is not None:
            record.append(PolicyStep([real.slot_of[e] for e in step], [e in uploaded for e in step], rule))
        s.lookups += len(want)
        s.misses += m
        s.uploads += m
        s.hits += len(want) - m
        for i in (0, 1):
            shadow_misses[i] += len(shadows[i].run(want, scores[i]))
        last[want] = t
        count[want] += 1
        since_age += len(want)
        since_duel += len(want)
        if since_age >= age_lookups * n_slots:
            since_age = 0
            count >>= 1
        if since_duel >= duel_lookups * n_slots:
            since_duel = 0
            shadow_misses = [m >> 1 for m in shadow_misses]
    s.evictions = s.misses - (n_slots - real.n_empty)  # every other miss filled an empty slot
    return s


def recency(steps: Steps, n_slots: int, n_expert: int | None = None,
            record: list[PolicyStep] | None = None) -> PolicyStats:
    """The product's LRU, re-derived: the victim is the expert used longest ago, and among experts
    last used in the same step, the one in the lowest slot."""
    n_expert = n_expert or 1 + max((max(s) for s in steps if len(s)), default=0)
    last = np.zeros(n_expert)
    real = _Residency(n_expert, n_slots)
    s = PolicyStats()
    for t, step in enumerate(steps, 1):
        want = _distinct(step)
        uploaded = real.run(want, last)
        if record is not None:
            record.append(PolicyStep([real.slot_of[e] for e in step], [e in uploaded for e in step], 0))
        s.lookups += len(want)
        s.misses += len(uploaded)
        s.uploads += len(uploaded)
        s.hits += len(want) - len(uploaded)
        last[want] = t
    s.evictions = s.misses - (n_slots - real.n_empty)
    return s


def global_lru(layers: Sequence[Steps], n_slots_total: int) -> PolicyStats:
    """A copy-on-miss cache shaped like llama.cpp's merged one (`--moe-cache-mib`): one LRU over
    (layer, expert) for all layers that share a device, so the budget moves between layers by
    itself. Layers run in order within a token: the LRU sees one step per layer and token."""
    n_tokens = min(len(steps) for steps in layers) if layers else 0
    return lru([[(li, e) for e in steps[t]] for t in range(n_tokens) for li, steps in enumerate(layers)],
               n_slots_total)


def bank(layers: Sequence[Steps], n_slots_total: int, policy: str = "adaptive") -> PolicyStats:
    """One slot bank shared by every layer of a device: the product's policy over (layer, expert)
    entries, fed each layer's step in turn within a token, so a slot belongs to no layer and the
    memory goes to the layers whose routing is less local. A victim is never an expert the current
    step of its layer reads (the policy's rule for a step's own experts). `policy` is the product's
    default, "adaptive" (its use counts age over the bank's lookups and slots, the same cadence per
    token as a layer's), or "lru"."""
    if policy not in ("adaptive", "lru"):
        raise ValueError(f"policy {policy!r}: accepted are 'adaptive' and 'lru'")
    n_tokens = min(len(steps) for steps in layers) if layers else 0
    width = 1 + max((e for steps in layers for step in steps for e in step), default=0)
    flat = [[li * width + e for e in steps[t]] for t in range(n_tokens) for li, steps in enumerate(layers)]
    run = adaptive if policy == "adaptive" else recency
    return run(flat, n_slots_total, len(layers) * width)


@dataclass
class SharedCacheStats(PolicyStats):
    """A cache shared by every layer of a device: `cpu` counts misses the CPU computed (not uploaded)."""
    cpu: int = 0


#: upstream's LRFU policy (llama.cpp #31233): a recency-frequency score with this half-life in tokens,
#: bucketed into this many frequency classes
LRFU_HALF_LIFE = 128.0
LRFU_CLASSES = 8


def lrfu(layers: Sequence[Steps], n_slots_total: int, cpu_share: float = 0.0,
         half_life: float = LRFU_HALF_LIFE, n_classes: int = LRFU_CLASSES) -> SharedCacheStats:
    """llama.cpp's merged cache as it stands after the pin, re-derived from its release notes (not its
    code): one cache over (layer, expert) for all layers of a device, evicting by frequency class and
    then by recency. Each use adds 1 to an expert's score, which halves every `half_life` tokens; its
    class is floor(log2(score)), capped at n_classes - 1; the victim is the lowest class's least
    recently used entry that the step does not need. `cpu_share` is `--moe-cache-cpu-share F`: once the
    cache is full the CPU computes a share F of the misses (spread evenly: every miss adds F to a
    credit, and a whole credit sends that miss to the CPU), the device uploads the rest."""
    if not 0.0 <= cpu_share <= 1.0:
        raise ValueError(f"cpu_share {cpu_share}: accepted is 0 <= F <= 1")
    n_tokens = min(len(steps) for steps in layers) if layers else 0
    width = 1 + max((e for steps in layers for step in steps for e in step), default=0)
    n = len(layers) * width
    # per (layer, expert): log2 of the score at its last use, that use's token, a use counter for recency
    log_score = np.full(n, -np.inf)
    used_at = np.zeros(n)
    recency = np.zeros(n)
    resident = np.zeros(n, dtype=bool)
    n_resident, credit, clock = 0, 0.0, 0
    s = SharedCacheStats()
    for t in range(n_tokens):
        for li, steps in enumerate(layers):
            want = [li * width + e for e in _distinct(steps[t])]
            s.lookups += len(want)
            missed = [key for key in want if not resident[key]]
            s.hits += len(want) - len(missed)
            s.misses += len(missed)
            admit = []
            for key in missed:
                if n_resident + len(admit) >= n_slots_total:
                    credit += cpu_share
                    if credit >= 1.0:
                        credit -= 1.0
                        s.cpu += 1
                        continue
                admit.append(key)
            # the step's evictions: the lowest classes, then the least recently used among equals
            # (recency < 1 keeps the order inside a class); what the step uses is not a candidate
            n_evict = max(0, n_resident + len(admit) - n_slots_total)
            if n_evict:
                klass = np.clip(np.floor(log_score - (t - used_at) / half_life), 0, n_classes - 1)
                rank = np.where(resident, klass + recency / (clock + 1.0), np.inf)
                rank[want] = np.inf
                n_candidates = int(np.isfinite(rank).sum())
                if n_candidates < n_evict:
                    # the step needs more entries than the cache holds: the rest stay on the host
                    s.cpu += n_evict - n_candidates
                    admit = admit[:len(admit) - (n_evict - n_candidates)]
                    n_evict = n_candidates
                victims = np.argpartition(rank, n_evict - 1)[:n_evict] if n_evict else []
                resident[victims] = False
                n_resident -= n_evict
                s.evictions += n_evict
            resident[admit] = True
            n_resident += len(admit)
            s.uploads += len(admit)
            for key in want:
                now = 2.0 ** (log_score[key] - (t - used_at[key]) / half_life)
                log_score[key] = math.log2(now + 1.0)
                used_at[key] = t
                clock += 1
                recency[key] = clock
    return s


@dataclass
class HybridStats(PolicyStats):
    """Hybrid mode: a miss runs on the CPU in its step; uploads are separate admission decisions."""
    deferred: int = 0      # admitted (it would pay back) but over the upload budget
    uploaded_now: int = 0  # misses uploaded in their own step for the device to compute (`now`)
    cpu: int = 0           # misses the CPU computed
    # prefetch (`lab.prefetch`): experts predicted for a step, how many of them the step used, the
    # ones uploaded ahead of it (counted in uploads), and of those the ones the step used (device hits
    # that only the prefetch made)
    predicted: int = 0
    predicted_used: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0


def hybrid_admission(steps: Steps, n_slots: int, upload_per_step: float, payback_uses: float,
                     window: int = 16, now: Callable[[int, int], int] | None = None,
                     prefetch=None) -> HybridStats:
    """Hybrid admission over one layer. A miss runs on the CPU in its step; an upload happens off the
    critical path, within the upload budget (`upload_per_step` uploads per step, accumulated: a
    fraction of the token time over the upload time). An empty slot takes any missed expert. A full
    pool replaces its least used resident (uses in the last `window` steps, then least recently
    used) only when the candidate's uses beat the victim's by `payback_uses` (the uses that save
    more CPU time than the upload costs: upload ms / CPU ms per expert), so churn cannot cost more
    than it saves. Admitted but over budget counts as `deferred`. The upload lands for the next step.

    `now(hits, misses)` (`lab.placement`): how many of the step's misses, the most used lately, are
    uploaded in the step for the device to compute, each taking the slot of the least used resident
    the step does not need; None: none (today's rule).

    `prefetch` (`lab.prefetch`): before each step, experts predicted for it that are not resident are
    uploaded ahead, as many as the link's idle time allows, into empty slots or those of residents used
    no more lately than the candidate; None: no prefetch.
    """
    resident: set[int] = set()
    recent: deque[list[int]] = deque(maxlen=window)
    uses: dict[int, int] = {}
    last: dict[int, int] = {}
    credit = 0.0
    s = HybridStats()

    def key(c: int) -> tuple[int, int, int]:
        return uses.get(c, 0), last.get(c, -1), c

    link_prev = 0  # uploads the link carried for this layer's previous step
    for t, step in enumerate(steps):
        want = _distinct(step)
        ahead: set[int] = set()
        if prefetch is not None:
            ahead = prefetch.run(t, want, resident, uses, last, n_slots, link_prev, s)
        s.lookups += len(want)
        missed = [e for e in want if e not in resident]
        s.hits += len(want) - len(missed)
        s.misses += len(missed)
        used_ahead = sum(1 for e in want if e in ahead)
        s.prefetch_hits += used_ahead
        uploads_before = s.uploads - len(ahead)
        if len(recent) == recent.maxlen:
            for e in recent[0]:
                uses[e] -= 1
        recent.append(want)
        for e in want:
            uses[e] = uses.get(e, 0) + 1
            last[e] = t
        ranked = sorted(missed, key=lambda e: -uses[e])
        n_now = now(len(want) - len(missed), len(missed)) if now is not None and missed else 0
        if n_now:
            room = max(0, n_slots - len(resident))
            victims = heapq.nsmallest(max(0, n_now - room), (key(c) for c in resident if c not in want))
            n_now = min(n_now, room + len(victims))
            resident.difference_update(v[2] for v in victims)
            s.evictions += len(victims)
            resident.update(ranked[:n_now])
            s.uploaded_now += n_now
            s.uploads += n_now
        s.cpu += len(missed) - n_now
        credit = min(credit + upload_per_step, max(1.0, upload_per_step))
        # victims in key order; keys do not change while the step's uploads are decided
        heap: list[tuple[int, int, int]] | None = None
        for e in ranked[n_now:]:
            if len(resident) >= n_slots:
                if heap is None:
                    heap = [key(c) for c in resident]
                    heapq.heapify(heap)
                if uses[e] - heap[0][0] < payback_uses:
                    continue
            if credit < 1.0:
                s.deferred += 1
                continue
            if len(resident) >= n_slots:
                resident.remove(heapq.heappop(heap)[2])
                s.evictions += 1
            resident.add(e)
            if heap is not None:
                heapq.heappush(heap, key(e))
            s.uploads += 1
            credit -= 1.0
        link_prev = s.uploads - uploads_before
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
