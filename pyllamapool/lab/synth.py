"""Synthetic routing traces calibrated to published measurements (shared/design/routing-locality.md).

Per layer: a Zipf popularity over a random permutation of the experts (flatter in early layers), and a
topic that changes at request boundaries and boosts its own subset of experts. For each of a token's
k picks: reuse one of the previous token's experts (p_prev), else one from the previous `window`
tokens (p_window), else draw from the topic-weighted popularity; no duplicates within a token.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from ..errors import PyllamapoolError
from ..run.trace import Trace


@dataclass(frozen=True)
class Preset:
    name: str
    n_expert: int
    top_k: int
    n_layer: int = 4
    n_tokens: int = 1200
    zipf: float = 0.5            # popularity exponent of the last layer
    early_flat: int = 2          # the first layers route flatter (exponent scaled down)
    p_prev: float = 0.45         # reuse of one of the previous token's experts, per pick
    p_window: float = 0.25       # reuse of one from the previous `window` tokens, per pick
    window: int = 8
    topic_boost: float = 4.0     # weight multiplier of the current topic's experts
    topic_share: float = 0.15    # share of experts a topic boosts
    request_length: int = 0      # topic change every this many tokens (0 = one request)
    uniform: bool = False        # i.i.d. uniform: the sanity check
    bytes_per_slot: int = 3 * 1_622_016  # gate + up + down of one expert (~IQ4_XS, 2048x768)
    #: the published figures this preset is calibrated on: {slots: hit rate} of a per-layer LRU
    published: tuple[tuple[int, float], ...] = ()
    source: str = ""


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("qwen3-30b-a3b", 128, 8, zipf=0.6, p_prev=0.25, p_window=0.45, window=8, topic_boost=8.0,
           topic_share=0.15,
           published=((8, 0.37), (24, 0.74), (49, 0.89), (81, 0.96)),
           source="Qwen3-30B-A3B, 3 prompts x 512 tokens: LRU 8/24/49/81 experts -> 37/74/89/96%"),
    Preset("qwen3.8-flash-next", 512, 10, zipf=0.6, p_prev=0.15, p_window=0.10, window=8, topic_boost=4.0,
           topic_share=0.15,
           published=((93, 0.435), (186, 0.62), (279, 0.72), (372, 0.789)),
           source="Qwen3.8-Flash-Next, 54k-record mixed workload: LRU 93/186/279/372 -> 43.5/62/72/78.9%"),
    Preset("qwen3.8-flash-next-hot", 512, 10, zipf=0.6, p_prev=0.3, p_window=0.3, window=8, topic_boost=10.0,
           topic_share=0.15,
           published=((66, 0.729), (80, 0.771), (128, 0.85), (256, 0.92)),
           source="Qwen3.8-Flash-Next, single-workload runs: the gfx906 fork's 66/80 slots per tensor -> "
                  "72.9/77.1%; another workload's 128/256 -> ~85/92%"),
    Preset("glm-chat-shift", 288, 8, zipf=0.3, p_prev=0.15, p_window=0.05, window=8, topic_boost=10.0,
           topic_share=0.5, request_length=300,
           published=((100, 0.66),),
           source="GLM-5.3-Flash chat replies, ~100 slots/layer: 66%; 44% after an unrelated prompt, "
                  "recovering over ~100 tokens"),
    Preset("long-form-hard", 256, 6, zipf=0.25, p_prev=0.08, p_window=0.06, window=8, topic_boost=1.5,
           topic_share=0.3, request_length=150,
           published=((11, 0.13),),
           source="DeepSeek-V4-Flash long-form text, ~11 slots/layer: 8-18%"),
    Preset("uniform", 64, 4, uniform=True, published=(),
           source="i.i.d. uniform: any online policy's hit rate = slots / experts"),
)}


def _popularity(rng: np.random.Generator, n: int, exponent: float) -> np.ndarray:
    ranks = rng.permutation(n) + 1.0
    w = ranks ** -exponent
    return w / w.sum()


def generate(preset: Preset | str, seed: int = 0, **changes) -> Trace:
    """A synthetic trace: ids [tokens, layers, top_k]; deterministic for a preset, seed and changes."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise PyllamapoolError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    preset = replace(preset, **changes) if changes else preset
    if preset.top_k > preset.n_expert:
        raise PyllamapoolError(f"top-k {preset.top_k} exceeds {preset.n_expert} experts")
    rng = np.random.default_rng(seed)
    T, L, E, k = preset.n_tokens, preset.n_layer, preset.n_expert, preset.top_k
    ids = np.empty((T, L, k), dtype=np.int32)
    for li in range(L):
        if preset.uniform:
            for t in range(T):
                ids[t, li] = rng.choice(E, size=k, replace=False)
            continue
        flat = 0.4 if li < preset.early_flat else 1.0
        base = _popularity(rng, E, preset.zipf * flat)
        topic_weights = None
        history: list[np.ndarray] = []
        for t in range(T):
            if topic_weights is None or (preset.request_length and t % preset.request_length == 0):
                boosted = rng.choice(E, size=max(k, int(preset.topic_share * E)), replace=False)
                topic_weights = base.copy()
                topic_weights[boosted] *= preset.topic_boost
                topic_weights /= topic_weights.sum()
                if t:
                    history = []  # a new request: nothing recent to reuse
            chosen: list[int] = []
            prev = history[-1] if history else np.empty(0, dtype=np.int32)
            recent = np.unique(np.concatenate(history[-preset.window:])) if history else np.empty(0, dtype=np.int32)
            while len(chosen) < k:
                u = rng.random()
                if u < preset.p_prev and len(prev):
                    pool = [e for e in prev if e not in chosen]
                elif u < preset.p_prev + preset.p_window and len(recent):
                    pool = [e for e in recent if e not in chosen]
                else:
                    pool = []
                if pool:
                    chosen.append(int(pool[rng.integers(len(pool))]))
                    continue
                w = topic_weights.copy()
                w[chosen] = 0.0
                chosen.append(int(rng.choice(E, p=w / w.sum())))
            ids[t, li] = chosen
            history.append(ids[t, li].copy())
            if len(history) > preset.window:
                history.pop(0)
    bpe = {li: {"ffn_gate_exps": preset.bytes_per_slot // 3, "ffn_up_exps": preset.bytes_per_slot // 3,
                "ffn_down_exps": preset.bytes_per_slot - 2 * (preset.bytes_per_slot // 3)} for li in range(L)}
    meta = {"source": "synthetic", "preset": preset.name, "seed": seed, "params": asdict(preset)}
    meta["params"]["published"] = [list(p) for p in preset.published]
    return Trace(ids, list(range(L)), E, k, bpe, meta)
