"""Scripted decode runs: free generation, or teacher-forced replay of a token stream.

Teacher forcing feeds a given stream one token per step whatever the model predicts, so routing is
controlled and two runs (pool on / off, different slot counts) see exactly the same inputs.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import PyllamapoolError
from ..binding.llama import Context, Model, Sampler
from .offload import Offload


@dataclass
class RunResult:
    mode: str                          # "generate" or "teacher-forced"
    prompt_tokens: list[int]
    tokens: list[int]                  # generated (generate) or predicted per step (teacher-forced)
    text: str
    step_latency_ms: list[float]
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    #: per step, the logits after the step (kept only when asked: they are large)
    logits: list[np.ndarray] | None = field(default=None, repr=False)
    extra: dict = field(default_factory=dict)
    #: per step, the times the host waited for a device inside its llama_decode (the scheduler's count:
    #: a CPU split reading the device's result, a pool's own waits), pool or not
    step_host_waits: list[int] = field(default_factory=list)

    def tokens_per_s(self, first: int = 0, last: int | None = None) -> float:
        """Token-to-token rate over steps [first, last): the first steps of a run fill a cache (cold),
        the last ones show its steady state (warm)."""
        ms = sum(self.step_latency_ms[first:last])
        return _rate(len(self.step_latency_ms[first:last]), ms)

    def host_waits_per_token(self) -> float:
        return sum(self.step_host_waits) / len(self.step_host_waits) if self.step_host_waits else 0.0

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("logits")
        return data


def _rate(n: int, ms: float) -> float:
    return n / (ms / 1000.0) if ms > 0 else 0.0


def run_context(ctx: Context, prompt: Sequence[int], n_predict: int = 32, *,
                teacher_tokens: Sequence[int] | None = None, sampler: Sampler | None = None,
                keep_logits: bool = False, on_step=None) -> RunResult:
    """Prefill prompt, then decode n_predict steps (or one step per teacher token)."""
    if not prompt:
        raise PyllamapoolError("the prompt must hold at least one token")
    sampler = sampler or Sampler(greedy=True)
    ctx.perf_reset()
    t0 = time.perf_counter()
    ctx.decode(list(prompt))
    next_tok = sampler.sample(ctx)  # waits for the device's part of the prompt too
    prefill_ms = (time.perf_counter() - t0) * 1000.0
    logits_out: list[np.ndarray] = []
    if keep_logits:
        logits_out.append(ctx.logits())
    predicted: list[int] = []
    latency: list[float] = []
    waits: list[int] = []
    steps = list(teacher_tokens) if teacher_tokens is not None else None
    n_steps = len(steps) if steps is not None else n_predict
    for i in range(n_steps):
        predicted.append(next_tok)
        feed = steps[i] if steps is not None else next_tok
        t = time.perf_counter()
        ctx.decode([feed])
        waits.append(ctx.host_syncs())
        # token to token, as a user sees it: llama_decode only queues the step on a GPU, and the
        # sampler's read of the logits waits for it
        next_tok = sampler.sample(ctx)
        latency.append((time.perf_counter() - t) * 1000.0)
        if keep_logits:
            logits_out.append(ctx.logits())
        if on_step is not None:
            on_step(i)
    decode_ms = sum(latency)
    return RunResult(
        mode="teacher-forced" if steps is not None else "generate",
        prompt_tokens=list(prompt), tokens=predicted, text=ctx.model.detokenize(predicted),
        step_latency_ms=latency, prefill_tokens_per_s=_rate(len(prompt), prefill_ms),
        decode_tokens_per_s=_rate(len(latency), decode_ms),
        logits=logits_out if keep_logits else None, step_host_waits=waits)


def run(model: str | Path | Model, tokens: Sequence[int] | str, n_predict: int = 32, *,
        offload: Offload | None = None, sampler: Sampler | None = None,
        teacher_tokens: Sequence[int] | None = None, keep_logits: bool = False) -> RunResult:
    """Load (if a path), prefill `tokens` (ids, or text to tokenize), decode; return the result."""
    offload = offload or Offload(n_gpu_layers=0)
    owned = not isinstance(model, Model)
    mdl = offload.load(model) if owned else model
    try:
        prompt = mdl.tokenize(tokens) if isinstance(tokens, str) else list(tokens)
        with Context(mdl, n_ctx=offload.n_ctx, n_threads=offload.n_threads) as ctx:
            return run_context(ctx, prompt, n_predict, teacher_tokens=teacher_tokens, sampler=sampler,
                               keep_logits=keep_logits)
    finally:
        if owned:
            mdl.close()
