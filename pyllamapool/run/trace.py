"""Routing traces: which experts each MoE layer selected for each token, and locality statistics.

Format (`.npz`): `ids` int32 [tokens, moe_layers, top_k] (expert ids, -1 = none), `layers` int32
[moe_layers] (the model's layer index of each column), and `meta` (a JSON string): model, n_expert,
top_k, bytes_per_expert ({layer: {tensor: bytes}}), source ("recorded" or "synthetic"), and for
synthetic traces preset and seed. Recorded through the live pool, also `miss` bool [tokens,
moe_layers, top_k] and, where hybrid mode's prefetch predicted experts, `predicted` int32 [tokens,
moe_layers, top_k] (what the previous layer's step predicted for each step, -1 = no prediction).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import PyllamapoolError

TOPK_TENSOR = re.compile(r"^ffn_moe_topk-(\d+)$")


@dataclass
class Trace:
    ids: np.ndarray                     # [tokens, layers, top_k]
    layers: list[int]
    n_expert: int
    top_k: int
    bytes_per_expert: dict[int, dict[str, int]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    #: the live pool's view, when recorded through it: True where the lookup missed (was copied in)
    miss: np.ndarray | None = None
    #: hybrid mode's prefetch, when recorded through the pool: what the previous layer's step predicted
    #: for each step ([tokens, layers, top_k], -1 where nothing was)
    predicted: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        meta = {**self.meta, "n_expert": self.n_expert, "top_k": self.top_k,
                "bytes_per_expert": {str(k): v for k, v in self.bytes_per_expert.items()}}
        arrays = {"ids": self.ids.astype(np.int32), "layers": np.asarray(self.layers, np.int32),
                  "meta": np.asarray(json.dumps(meta, sort_keys=True))}
        if self.miss is not None:
            arrays["miss"] = self.miss.astype(bool)
        if self.predicted is not None:
            arrays["predicted"] = self.predicted.astype(np.int32)
        np.savez_compressed(path, **arrays)
        return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                ids, layers = data["ids"], data["layers"].tolist()
                miss = data["miss"] if "miss" in data.files else None
                predicted = data["predicted"] if "predicted" in data.files else None
        except (OSError, KeyError, ValueError) as exc:
            raise PyllamapoolError(f"{path} is not a routing trace: {exc}") from None
        bpe = {int(k): v for k, v in meta.pop("bytes_per_expert", {}).items()}
        return cls(ids, layers, int(meta.pop("n_expert")), int(meta.pop("top_k")), bpe, meta, miss, predicted)


def expert_bytes_from_gguf(path: str | Path) -> dict[int, dict[str, int]]:
    """Bytes of one expert in each routed-expert pool, per layer, read from the GGUF header: a weight
    and the per-expert bias and scale that travel with it in the pool's slots (a fused gate_up
    weight carries the up scale, as the graph applies it)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    parts: dict[int, dict[tuple[str, str], int]] = {}
    for tensor in reader.tensors:
        m = re.match(r"^blk\.(\d+)\.(ffn_\w+_exps)\.(weight|bias|scale)$", tensor.name)
        if m:
            n_expert = int(tensor.shape[-1])  # gguf reader shapes are ggml order: ne0 first
            parts.setdefault(int(m.group(1)), {})[(m.group(2), m.group(3))] = int(tensor.n_bytes) // n_expert
    out: dict[int, dict[str, int]] = {}
    for layer, sizes in parts.items():
        weights = {stem for stem, kind in sizes if kind == "weight"}
        pools = out.setdefault(layer, {})
        for (stem, kind), n in sorted(sizes.items(), key=lambda kv: kv[0][1] != "weight"):
            if stem == "ffn_up_exps" and stem not in weights and "ffn_gate_up_exps" in weights and kind == "scale":
                stem = "ffn_gate_up_exps"
            if stem in weights:
                pools[stem] = pools.get(stem, 0) + n
    return out


class TraceRecorder:
    """An observer for Context(observe=..., observer=...) collecting the router's top-k per token."""

    def __init__(self) -> None:
        self._steps: list[dict[int, np.ndarray]] = []
        self._current: dict[int, np.ndarray] = {}
        self.enabled = True

    @staticmethod
    def wants(name: str) -> bool:
        return bool(TOPK_TENSOR.match(name))

    def __call__(self, name: str, rows: np.ndarray) -> None:
        if not self.enabled:
            return
        layer = int(TOPK_TENSOR.match(name).group(1))
        if layer in self._current:      # a new decode call started
            self.end_step()
        self._current[layer] = rows.copy()

    def end_step(self) -> None:
        if self._current:
            self._steps.append(self._current)
            self._current = {}

    def reset(self) -> None:
        self._steps, self._current = [], {}

    def trace(self, n_expert: int, top_k: int, bytes_per_expert=None, meta=None) -> Trace:
        self.end_step()
        if not self._steps:
            raise PyllamapoolError("no routing was observed (is this a MoE model?)")
        layers = sorted(self._steps[0])
        tokens = []
        for step in self._steps:
            n = step[layers[0]].shape[0]
            for t in range(n):
                tokens.append(np.stack([step[il][t][:top_k] for il in layers]))
        ids = np.stack(tokens).astype(np.int32)
        return Trace(ids, layers, n_expert, top_k, bytes_per_expert or {},
                     {"source": "recorded", **(meta or {})})


# ---------------------------------------------------------------------------------------------
# locality statistics


@dataclass(frozen=True)
class Locality:
    #: per layer: share of all selections taken by the most-used 25% of experts (uniform: 0.25)
    top_quarter_share: list[float]
    #: share of a token's experts that the previous token also used (per layer, then mean)
    reuse_prev: float
    #: share of a token's experts used within the previous `window` tokens
    reuse_window: float
    window: int


def locality(trace: Trace, window: int = 8) -> Locality:
    ids = trace.ids
    n_tok, n_layers, _ = ids.shape
    quarter = max(1, trace.n_expert // 4)
    shares = []
    for li in range(n_layers):
        counts = np.bincount(ids[:, li].ravel()[ids[:, li].ravel() >= 0], minlength=trace.n_expert)
        shares.append(float(np.sort(counts)[::-1][:quarter].sum() / max(1, counts.sum())))
    prev_hits = win_hits = total = 0
    for t in range(1, n_tok):
        for li in range(n_layers):
            cur = set(ids[t, li].tolist())
            prev = set(ids[t - 1, li].tolist())
            recent = set(ids[max(0, t - window):t, li].ravel().tolist())
            prev_hits += len(cur & prev)
            win_hits += len(cur & recent)
            total += len(cur)
    return Locality(shares, prev_hits / max(1, total), win_hits / max(1, total), window)


def record_trace(model, prompt: Sequence[int], stream: Sequence[int], *, n_ctx: int = 2048,
                 n_threads: int | None = None, meta: dict | None = None) -> Trace:
    """Teacher-force `stream` after `prompt` through `model` (a llama.Model) and record routing.

    Only decode steps are recorded (the prompt's prefill is not), one row per streamed token.
    """
    from ..binding.llama import Context

    recorder = TraceRecorder()
    with Context(model, n_ctx=n_ctx, n_threads=n_threads, observe=recorder.wants,
                 observer=recorder) as ctx:
        recorder.enabled = False
        ctx.decode(list(prompt))
        recorder.enabled = True
        for tok in stream:
            ctx.decode([tok])
            recorder.end_step()
    bpe = expert_bytes_from_gguf(model.path)
    return recorder.trace(model.n_expert, model.n_expert_used, bpe,
                          {"model": str(model.path), "prompt_tokens": len(prompt), **(meta or {})})


class PoolTraceRecorder:
    """Records routing through the live pool's observer: per decode step and pooled layer, the
    selected experts and whether each lookup missed. Only pooled (decode-shaped) steps are seen."""

    def __init__(self, ctx) -> None:
        from ..binding import _ffi
        ffi, lib, _ = _ffi.load()
        self.steps: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []
        self._current: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._predicted: dict[tuple[int, int], np.ndarray] = {}  # (step, layer) -> predicted ids

        @ffi.callback("void(int32_t, const int32_t *, const int32_t *, const uint8_t *, int32_t, "
                      "const int32_t *, int32_t, void *)")
        def observe(layer, ids, slots, miss, n, predicted, n_predicted, _user):
            try:
                if layer in self._current:
                    self.end_step()
                self._current[layer] = (np.frombuffer(ffi.buffer(ids, 4 * n), dtype=np.int32).copy(),
                                        np.frombuffer(ffi.buffer(miss, n), dtype=np.uint8).astype(bool))
                if n_predicted:
                    self._predicted[(len(self.steps), layer)] = np.frombuffer(
                        ffi.buffer(predicted, 4 * n_predicted), dtype=np.int32).copy()
            except Exception as e:  # never unwind into C: the context's next decode raises it
                if ctx.callback_error is None:
                    ctx.callback_error = e

        ctx.set_pool_observer(observe)   # the context keeps the callback alive and removes it on close
        self._ctx = ctx

    def end_step(self) -> None:
        if self._current:
            self.steps.append(self._current)
            self._current = {}

    def detach(self) -> None:
        self._ctx.set_pool_observer(None)

    def trace(self, n_expert: int, top_k: int, bytes_per_expert=None, meta=None) -> Trace:
        self.end_step()
        if not self.steps:
            raise PyllamapoolError("the pool saw no decode step (is it enabled? see its status line)")
        layers = sorted(self.steps[0])
        ids, miss, predicted = [], [], []
        for si, step in enumerate(self.steps):
            n_tok = max(len(step[il][0]) for il in layers) // top_k
            for t in range(n_tok):
                id_row = np.full((len(layers), top_k), -1, dtype=np.int32)
                miss_row = np.zeros((len(layers), top_k), dtype=bool)
                pred_row = np.full((len(layers), top_k), -1, dtype=np.int32)
                for li, il in enumerate(layers):
                    # a prompt's last layer keeps only its output rows, the batch's last tokens
                    first = n_tok - len(step[il][0]) // top_k
                    if t < first:
                        continue
                    sl = slice((t - first) * top_k, (t - first + 1) * top_k)
                    id_row[li], miss_row[li] = step[il][0][sl], step[il][1][sl]
                    named = self._predicted.get((si, il))
                    if named is not None and len(named) == len(step[il][0]):
                        pred_row[li] = named[sl]
                ids.append(id_row)
                miss.append(miss_row)
                predicted.append(pred_row)
        return Trace(np.stack(ids).astype(np.int32), layers, n_expert, top_k, bytes_per_expert or {},
                     {"source": "recorded", "view": "pool", **(meta or {})}, np.stack(miss),
                     np.stack(predicted) if self._predicted else None)
