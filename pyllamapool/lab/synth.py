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
    #: popularity that concentrates with depth: layer i of L draws with the zipf exponent scaled by
    #: 1 - ramp x (1 - i / (L - 1)), so the first layer routes flattest and the last as given (0: every
    #: layer alike). Real models differ per layer (Qwen3.6: per-layer LRU-16 61-87%), and that
    #: difference is what a bank shared by the layers feeds on
    locality_ramp: float = 0.0
    bytes_per_slot: int = 3 * 1_622_016  # gate + up + down of one expert (~IQ4_XS, 2048x768)
    #: the published figures this preset is calibrated on: {slots: hit rate} of a per-layer LRU
    published: tuple[tuple[int, float], ...] = ()
    source: str = ""
    #: figures measured on a GPU that a layered preset is calibrated on: (slots per layer, hit rate of
    #: the pool's per-layer pools with the default policy, hit rate of llama.cpp's cache at the pin,
    #: one LRU bank over (layer, expert) at equal memory)
    measured: tuple[tuple[int, float, float], ...] = ()


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


#: presets whose layers route unlike each other, at a real model's depth: the bank's case (issue 45).
#: Kept apart from PRESETS, whose 4 layers route alike, because a 48-layer replay of every mode and
#: machine (the predict and modes tables) would take minutes for what the bank table alone needs
LAYERED_PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("qwen3-30b-a3b-layered", 128, 8, n_layer=48, n_tokens=256, zipf=3.0, early_flat=0, p_prev=0.3,
           p_window=0.3, window=8, topic_boost=8.0, topic_share=0.15, locality_ramp=0.9,
           bytes_per_slot=3 * 884_736,  # gate + up + down of one expert, Q4_K, 2048x768
           measured=((64, 0.952, 0.963), (32, 0.885, 0.881)),
           source="Qwen3-30B-A3B (48 layers) on an H200, 256 teacher-forced tokens at equal memory: the "
                  "pool's copy mode 95.2% / 88.5% hits at 64 / 32 slots a layer, llama.cpp's cache at the "
                  "pin (an LRU bank over every layer) 96.3% / 88.1%"),
)}


def _preset(name: str) -> Preset:
    if name in PRESETS:
        return PRESETS[name]
    if name in LAYERED_PRESETS:
        return LAYERED_PRESETS[name]
    raise PyllamapoolError(f"unknown preset {name!r}; presets: {', '.join([*PRESETS, *LAYERED_PRESETS])}")


def _popularity(rng: np.random.Generator, n: int, exponent: float) -> np.ndarray:
    ranks = rng.permutation(n) + 1.0
    w = ranks ** -exponent
    return w / w.sum()


def generate(preset: Preset | str, seed: int = 0, **changes) -> Trace:
    """A synthetic trace: ids [tokens, layers, top_k]; deterministic for a preset, seed and changes."""
    if isinstance(preset, str):
        preset = _preset(preset)
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
        depth = 1.0 - preset.locality_ramp * (1.0 - li / (L - 1)) if L > 1 else 1.0
        base = _popularity(rng, E, preset.zipf * flat * depth)
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
    meta["params"]["measured"] = [list(p) for p in preset.measured]
    return Trace(ids, list(range(L)), E, k, bpe, meta)
