"""The high-level pool API: load a model with offload settings, run scripted decodes with a pool
configuration, and get tokens, timings, memory, the admission status and the counters back.

    from pyllamapool import Offload, PoolConfig, PoolSession
    with PoolSession("model.gguf", Offload(n_gpu_layers=99, n_cpu_moe=48)) as session:
        result = session.run(prompt, n_predict=64, pool=PoolConfig(slots=66))
        print(result.status.limited_by, result.counters.hit_rate, result.counters.copy_bytes)

Each run uses a fresh context, so nothing (slots, counters, KV cache) leaks between configurations.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from .decode import RunResult, run_context
from ..errors import PyllamapoolError
from ..binding.llama import Context, Sampler, local_gpus
from ..binding.moecache import MoeCacheStats
from .offload import Offload
from ..binding.pool import MemoryRow, PoolConfig, PoolCounters, PoolInfo, PoolStatus


@dataclass
class PoolRun:
    """One scripted decode with one pool configuration."""
    config: PoolConfig
    decode: RunResult
    status: PoolStatus
    devices: list[PoolStatus]
    counters: PoolCounters
    memory: list[MemoryRow]
    lines: list[str]                      # the `expert pool ...` lines of this context
    pools: list[PoolInfo] = field(default_factory=list)
    pool_counters: list[PoolCounters] = field(default_factory=list)
    moe_cache: MoeCacheStats | None = None  # llama.cpp's own cache, when the run used it

    def to_json(self) -> dict:
        return {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.config).items()},
            "tokens": self.decode.tokens,
            "decode_tokens_per_s": self.decode.decode_tokens_per_s,
            "prefill_tokens_per_s": self.decode.prefill_tokens_per_s,
            "status": asdict(self.status), "devices": [asdict(d) for d in self.devices],
            "counters": self.counters.to_json(),
            "memory": [asdict(m) for m in self.memory],
            "lines": self.lines,
            "moe_cache": asdict(self.moe_cache) if self.moe_cache else None,
        }


class PoolSession:
    """A model loaded once; every run() makes its own context with its own pool."""

    def __init__(self, model: str | Path, offload: Offload = Offload(), *, no_alloc: bool = False):
        self.offload = offload
        self.model = offload.load(model, no_alloc=no_alloc)
        if self.model.n_expert == 0:
            self.model.close()
            raise PyllamapoolError(f"{model} is not a Mixture-of-Experts model (no expert_count): "
                                   "the expert pool has nothing to cache")

    @contextmanager
    def context(self, pool: PoolConfig | None = None, **kwargs) -> Iterator[Context]:
        o = self.offload
        ctx = Context(self.model, n_ctx=o.n_ctx, n_threads=o.n_threads, pool=pool, type_k=o.type_k,
                      type_v=o.type_v, flash_attn=o.flash_attn, **kwargs)
        try:
            yield ctx
        finally:
            ctx.close()

    def run(self, prompt: Sequence[int], n_predict: int = 32, *, pool: PoolConfig | None = None,
            teacher_tokens: Sequence[int] | None = None, per_pool: bool = False,
            keep_logits: bool = False, sampler: Sampler | None = None, moe_cache_mib: int = 0) -> PoolRun:
        """moe_cache_mib: llama.cpp's own expert cache instead of a pool (the two are exclusive)."""
        pool = pool or PoolConfig()
        with self.context(pool, moe_cache_mib=moe_cache_mib) as ctx:
            decoded = run_context(ctx, prompt, n_predict, teacher_tokens=teacher_tokens, sampler=sampler,
                                  keep_logits=keep_logits)
            report = ctx.pool_report(per_pool=per_pool)
            memory = ctx.memory()
        return PoolRun(pool, decoded, report.status, report.devices, report.counters, memory,
                       ctx.pool_lines(), report.pools, report.pool_counters, ctx.moe_cache_stats())

    def run_requests(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                     pool: PoolConfig | None = None, moe_cache_mib: int = 0) -> PoolRun:
        """Several requests in one context, as a server serves one user's turns: for each (prompt,
        teacher tokens), the KV cache is cleared and the prompt prefilled, then one step per teacher
        token. The pool (or llama.cpp's cache) keeps what it holds from one request to the next. The
        result's steps are every request's, in order."""
        if not requests:
            raise PyllamapoolError("run_requests needs at least one request")
        pool = pool or PoolConfig()
        with self.context(pool, moe_cache_mib=moe_cache_mib) as ctx:
            parts = []
            for prompt, teacher in requests:
                ctx.clear()
                parts.append(run_context(ctx, prompt, 0, teacher_tokens=teacher))
            report = ctx.pool_report()
            memory = ctx.memory()
        decoded = RunResult("teacher-forced", [t for p in parts for t in p.prompt_tokens],
                            [t for p in parts for t in p.tokens], "", [x for p in parts for x in p.step_latency_ms],
                            sum(p.prefill_tokens_per_s for p in parts) / len(parts), 0.0,
                            step_host_waits=[w for p in parts for w in p.step_host_waits])
        decoded.decode_tokens_per_s = decoded.tokens_per_s()
        return PoolRun(pool, decoded, report.status, report.devices, report.counters, memory,
                       ctx.pool_lines(), moe_cache=ctx.moe_cache_stats())

    def plan(self, pool: PoolConfig) -> PoolRun:
        """Admission only: a context is made (in a no-allocation session, nothing is allocated)."""
        with self.context(pool) as ctx:
            report = ctx.pool_report(per_pool=True)
            memory = ctx.memory()
            lines = ctx.pool_lines()
        empty = RunResult("plan", [], [], "", [], 0.0, 0.0)
        return PoolRun(pool, empty, report.status, report.devices, report.counters, memory, lines,
                       report.pools, report.pool_counters)

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> "PoolSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def has_accelerator() -> bool:
    """A GPU of this build's own (CUDA, HIP or Vulkan sees a card): test devices (RPC, the lazy-copy
    device, once a test has loaded it) do not count."""
    return bool(local_gpus())
