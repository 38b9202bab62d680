"""Prefetch: uploading a layer's predicted experts before its step, played over one layer's routing.

In the engine, hybrid layer L's first CPU op receives, beside its own router's ids, the experts layer
L+1's router picks from layer L's hidden state (computed on the device with L's router, copied to the
host in the same synchronisation). It uploads those L+1 does not hold on the upload queue while layer
L computes and L+1's attention runs; L+1's step computes the ones it selected on the device, waiting
on the device for their bytes. The rule here is the engine's:

- **how many**: as many as the link can carry before the next layer's step, after what it already
  carries (the placed and admitted uploads of the step before);
- **whether at all**: where the prediction's precision times what a CPU expert costs exceeds the
  gather of one expert into staging (nothing where the experts sit in pinned memory);
- **into which slots**: an empty one, or the one of a resident used no more often over the admission
  window than the candidate and not predicted itself (the prediction counts as one more use, so a wrong
  guess evicts only experts nobody used more lately);
- **which first**: the candidates used most lately.

A prediction's quality is the share of a step's selected experts it names (`overlap`: 0.61 for
GLM-5.3-Flash's next-layer router on the current hidden state, ~0.97 in the Fate paper). Synthetic
traces route each layer independently, so the lab draws predictions from the true selection at that
overlap (`synthetic`); a recorded trace carries the engine's own predictions (`Trace.predicted`).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .policies import HybridStats, Steps, _distinct

#: next-layer router on the current hidden state, top-8 overlap on GLM-5.3-Flash (routing-locality.md)
PUBLISHED_OVERLAP = 0.61


def synthetic(steps: Steps, overlap: float, n_expert: int, seed: int = 0) -> list[list[int]]:
    """Predictions for `steps` with the given overlap: each selected expert is named with probability
    `overlap`, and the prediction is filled to the step's size with experts the step does not use,
    drawn uniformly (a wrong guess is most likely not resident: the pessimistic case for waste)."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap {overlap}: accepted is 0 <= overlap <= 1")
    rng = np.random.default_rng(seed)
    out = []
    for step in steps:
        want = _distinct(step)
        right = [e for e in want if rng.random() < overlap]
        others = np.setdiff1d(np.arange(n_expert), want)
        n_wrong = min(len(want) - len(right), len(others))
        wrong = rng.choice(others, size=n_wrong, replace=False).tolist() if n_wrong else []
        out.append(right + [int(e) for e in wrong])
    return out


@dataclass
class Prefetch:
    """One layer's predictions (`predicted[t]`: the experts named for step t) and the link's room:
    `window_uploads` uploads fit in the time between the previous layer's step and this one's, less
    what the link carried for this layer's previous step. None: no limit (prefetch forced on)."""
    predicted: Sequence[Sequence[int]]
    window_uploads: float | None = None
    #: the engine's auto rule: a prefetched expert saves the step a CPU expert when the prediction is
    #: right, and costs its gather into staging now; False: predictions are scored, nothing is fetched
    on: bool = True

    def room(self, link_prev: int) -> int:
        if self.window_uploads is None:
            return 1 << 30
        return max(0, math.floor(self.window_uploads - link_prev))

    def run(self, t: int, want: Sequence[int], resident: set[int], uses: dict[int, int], last: dict[int, int],
            n_slots: int, link_prev: int, s: HybridStats) -> set[int]:
        """Upload the predicted misses of step t (which selects `want`) into `resident`, as the step
        before it ends; returns the experts uploaded. `uses` and `last` are the admission's window."""
        named = _distinct(self.predicted[t]) if t < len(self.predicted) else []
        s.predicted += len(named)
        s.predicted_used += len(set(named) & set(want))
        if not self.on:
            return set()
        candidates = sorted((e for e in named if e not in resident), key=lambda e: -uses.get(e, 0))
        ahead: set[int] = set()
        heap: list[tuple[int, int, int]] | None = None
        for e in candidates[:self.room(link_prev)]:
            if len(resident) >= n_slots:
                if heap is None:
                    # a resident the prediction names stays: the step is expected to use it
                    heap = [(uses.get(c, 0), last.get(c, -1), c) for c in resident if c not in named]
                    heapq.heapify(heap)
                if not heap or heap[0][0] > uses.get(e, 0):
                    break  # candidates come most used first: a later one clears no lower bar
                resident.remove(heapq.heappop(heap)[2])
                s.evictions += 1
            resident.add(e)
            ahead.add(e)
        s.prefetched += len(ahead)
        s.uploads += len(ahead)
        return ahead


@dataclass(frozen=True)
class Score:
    """How well a layer's predictions named what its steps selected (distinct experts per step)."""
    predicted: int
    used: int
    lookups: int

    @property
    def precision(self) -> float:
        return self.used / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.used / self.lookups if self.lookups else 0.0


def scores(trace) -> dict[int, Score]:
    """Per layer of a trace recorded through the pool with prefetch (`Trace.predicted`): the prediction
    made for each step against what the step selected, counted as the pool counts it (steps without a
    prediction are left out)."""
    if trace.predicted is None:
        raise ValueError("the trace has no predictions: record it through the pool with prefetch on")
    out = {}
    for li, layer in enumerate(trace.layers):
        predicted = used = lookups = 0
        for t in range(trace.n_tokens):
            named = set(int(e) for e in trace.predicted[t, li] if e >= 0)
            if not named:
                continue
            want = set(int(e) for e in trace.ids[t, li] if e >= 0)
            predicted += len(named)
            used += len(named & want)
            lookups += len(want)
        out[layer] = Score(predicted, used, lookups)
    return out


def precision(predicted: Sequence[Sequence[int]], steps: Steps) -> float:
    """The share of the experts named for each step that the step selected."""
    named = used = 0
    for p, step in zip(predicted, steps):
        distinct = set(_distinct(p))
        named += len(distinct)
        used += len(distinct & set(step))
    return used / named if named else 0.0


def recorded(trace, layer_index: int) -> list[list[int]]:
    """A recorded trace's predictions for one layer, as `Prefetch.predicted` takes them."""
    if trace.predicted is None:
        raise ValueError("the trace has no predictions: record it through the pool with prefetch on")
    return [[int(e) for e in row if e >= 0] for row in trace.predicted[:, layer_index]]
