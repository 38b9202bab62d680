"""Where a model's tensors go and how its contexts are made, as llama.cpp's flags say it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..binding.llama import Model


@dataclass(frozen=True)
class Offload:
    """-ngl, --rpc, --n-cpu-moe / --cpu-moe, mmap and repacking; context size, threads, KV types."""
    n_gpu_layers: int = 99
    rpc: tuple[str, ...] = ()
    n_cpu_moe: int = 0
    cpu_moe: bool = False
    use_mmap: bool = True
    repack: bool = True    # llama.cpp's default; the pool uploads repacked experts from the model file
    n_ctx: int = 1024
    n_threads: int | None = None
    type_k: str | None = None
    type_v: str | None = None
    flash_attn: bool | None = None

    def load(self, path: str | Path, *, no_alloc: bool = False) -> Model:
        return Model(path, n_gpu_layers=self.n_gpu_layers, rpc=self.rpc, n_cpu_moe=self.n_cpu_moe,
                     cpu_moe=self.cpu_moe, use_mmap=self.use_mmap, repack=self.repack, no_alloc=no_alloc)
