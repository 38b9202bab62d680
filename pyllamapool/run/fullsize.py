"""Models at a released MoE's full size, written at disk speed.

The GPU check times the pool at a real model's shape: Qwen3-30B-A3B has 48 MoE layers of 128
experts (top-8, 2048 x 768), 16 GB of Q4_K experts. Quantizing 16 GB of float weights through
llama-quantize takes longer than a GPU lease, and a decode's cost depends on the experts' bytes and
shapes, not on what their weights learned. So the routed experts are written as random, valid
quant blocks straight from numpy: uniform quants and packed sub-block scales, and fp16 block scales
bounded and set so that a weight has a chosen spread (0.9 / sqrt(fan-in), which is testmodel's 0.08
at its default width), centred where the format has a min. They are generated chunk by chunk on
every core while the previous tensor is written, so memory stays at two tensors.

Everything else (embeddings, attention, norms and the router) is testmodel's, so routing keeps the
topic locality those models are built for, and `token_stream()` drives these models as it does the
small ones. Attention and embedding matrices are stored as F16, the router in F32.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import PyllamapoolError
from .testmodel import ModelSpec, default_model_dir, generator_digest, new_writer, _weights


@dataclass(frozen=True)
class BlockFormat:
    """Where a quant block keeps its fp16 scales; every other byte may hold any value."""
    nbytes: int
    weights: int
    scale_at: int               # byte offset of the block's fp16 scale d
    min_at: int | None = None   # byte offset of the fp16 min scale dmin (K-quants with mins)


#: block layouts as ggml-common.h defines them
FORMATS = {
    "Q4_0": BlockFormat(18, 32, 0), "Q8_0": BlockFormat(34, 32, 0), "IQ4_NL": BlockFormat(18, 32, 0),
    "Q2_K": BlockFormat(84, 256, 80, 82), "Q3_K": BlockFormat(110, 256, 108),
    "Q4_K": BlockFormat(144, 256, 0, 2), "Q5_K": BlockFormat(176, 256, 0, 2),
    "Q6_K": BlockFormat(210, 256, 208), "IQ4_XS": BlockFormat(136, 256, 0),
}

#: released models' shapes. Attention keeps n_embd / n_head wide heads (Qwen3-30B-A3B's 32 query heads
#: of 128 make a 4096-wide q; 16 of 128 here), and the vocabulary is small: the device's share of a
#: token is a little lighter than the real model's, the experts' is the real one.
SHAPES: dict[str, ModelSpec] = {
    "qwen3-30b-a3b": ModelSpec(n_layer=48, n_embd=2048, n_head=16, n_head_kv=4, n_expert=128, n_expert_used=8,
                               n_ff_exp=768, n_vocab=4096, expert_type="Q4_K"),
    # ~2 GB of Q4_K experts of a 30B-A3B expert's size (2.6 MB each)
    "medium": ModelSpec(n_layer=12, n_embd=2048, n_head=16, n_head_kv=4, n_expert=64, n_expert_used=8,
                        n_ff_exp=768, n_vocab=4096, expert_type="Q4_K"),
    "small": ModelSpec(n_layer=8, n_embd=1024, n_head=8, n_head_kv=2, n_expert=64, n_expert_used=8,
                       n_ff_exp=256, n_vocab=2048, expert_type="Q4_K"),
    "tiny": ModelSpec(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_expert=16, n_expert_used=4,
                      n_ff_exp=256, n_vocab=512, expert_type="Q4_K"),
}

#: bytes of random data one task generates: small enough to spread a tensor over every core
_CHUNK = 8 << 20
#: the spread of the block scales around their mean, so blocks differ as trained ones do
_JITTER = 0.25


def _qtype(expert_type: str):
    import gguf
    return getattr(gguf.GGMLQuantizationType, expert_type)


@lru_cache(maxsize=None)
def _scale_tables(expert_type: str, std: float) -> tuple[np.ndarray, np.ndarray | None]:
    """fp16 bit patterns for d (and dmin) indexed by the random 16 bits a block's d held: d varies by
    +-_JITTER around the value that gives weights a standard deviation of `std`, and dmin is d times
    the ratio that centres them. Both are measured by dequantizing random blocks with gguf's own
    reference code, so no format's arithmetic is restated here."""
    from gguf import quants

    fmt = FORMATS[expert_type]
    rng = np.random.default_rng(1234)
    blocks = rng.integers(0, 256, (4096, fmt.nbytes), dtype=np.uint8)
    halves = blocks.view(np.uint16)

    def weights(d: float, dmin: float) -> np.ndarray:
        halves[:, fmt.scale_at // 2] = np.float16(d).view(np.uint16)
        if fmt.min_at is not None:
            halves[:, fmt.min_at // 2] = np.float16(dmin).view(np.uint16)
        return quants.dequantize(blocks, _qtype(expert_type)).astype(np.float64)

    ratio = 0.0
    if fmt.min_at is not None:
        ratio = weights(1.0, 0.0).mean() / -weights(0.0, 1.0).mean()
    d = std / weights(1.0, ratio).std()
    factor = 1.0 + _JITTER * (np.arange(1 << 16, dtype=np.float64) / (1 << 15) - 1.0)
    table_d = (d * factor).astype(np.float16).view(np.uint16)
    table_min = (d * ratio * factor).astype(np.float16).view(np.uint16) if fmt.min_at is not None else None
    if not (np.isfinite(table_d.view(np.float16)).all() and table_d.view(np.float16).min() > 0):
        raise PyllamapoolError(f"{expert_type}: a weight spread of {std:g} needs block scales out of fp16's range")
    return table_d, table_min


def _random_bytes(n: int, seed: tuple[int, ...]) -> np.ndarray:
    """n bytes from a generator keyed by seed, so a chunk's bytes do not depend on the thread count.
    Generator.integers releases the GIL (a bit generator's random_raw does not)."""
    rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed)))
    words = rng.integers(0, np.iinfo(np.uint64).max, (n + 7) // 8, dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:n]


@lru_cache(maxsize=None)
def _normal_f16(std: float) -> np.ndarray:
    """fp16 values at the 65536 quantiles of a normal of spread std: 16 random bits -> one draw."""
    from statistics import NormalDist

    q = (np.arange(1 << 16) + 0.5) / (1 << 16)
    return np.vectorize(NormalDist(0.0, std).inv_cdf)(q).astype(np.float16)


def _projection(spec: ModelSpec, pool: ThreadPoolExecutor) -> Callable[[tuple[int, int]], np.ndarray]:
    """Attention projections as F16 normal draws of testmodel's spread (0.02), 16 random bits through a
    quantile table, row blocks on every core. (Their shape matters to routing: weights drawn with
    the same spread but none near zero mix more through attention, and cut the shape's LRU hit rate
    at 8 slots from 36% to 27%.)"""
    table = _normal_f16(0.02)
    counter = iter(range(1 << 30))

    def draw(shape: tuple[int, int]) -> np.ndarray:
        key = next(counter)
        out = np.empty(shape, np.float16)
        step = max(1, (1 << 18) // shape[1])  # a shape's blocks, whatever the thread count

        def fill(r: int) -> None:
            rows = out[r:r + step]
            bits = _random_bytes(2 * rows.size, (spec.seed, 1 << 20, key, r)).view(np.uint16)
            np.take(table, bits, out=rows.reshape(-1))

        list(pool.map(fill, range(0, shape[0], step)))
        return out
    return draw


def _expert_tensor(pool: ThreadPoolExecutor, spec: ModelSpec, shape: tuple[int, int, int], std: float,
                   seed: tuple[int, ...]) -> np.ndarray:
    """One routed-expert tensor (n_expert, rows, cols) as quant blocks: raw bytes (n_expert, rows, bytes)."""
    fmt = FORMATS[spec.expert_type]
    n_expert, rows, cols = shape
    out = np.empty((n_expert, rows, cols // fmt.weights * fmt.nbytes), np.uint8)
    flat = out.reshape(-1)
    table_d, table_min = _scale_tables(spec.expert_type, std)
    chunk = _CHUNK // fmt.nbytes * fmt.nbytes  # whole blocks, so each task patches its own scales

    def fill(i: int) -> None:
        part = flat[i * chunk:(i + 1) * chunk]
        part[:] = _random_bytes(part.size, seed + (i,))
        halves = part.view(np.uint16).reshape(-1, fmt.nbytes // 2)
        bits = halves[:, fmt.scale_at // 2].copy()
        halves[:, fmt.scale_at // 2] = table_d[bits]
        if table_min is not None:
            halves[:, fmt.min_at // 2] = table_min[bits]

    list(pool.map(fill, range((flat.size + chunk - 1) // chunk)))
    return out


def _expert_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, int, int], float]]:
    """(name, numpy shape, weight spread) of every routed-expert tensor, layer by layer."""
    e, d, f = spec.n_expert, spec.n_embd, spec.n_ff_exp
    out = []
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        out += [(p + "ffn_gate_exps.weight", (e, f, d), 0.9 / d ** 0.5),
                (p + "ffn_up_exps.weight", (e, f, d), 0.9 / d ** 0.5),
                (p + "ffn_down_exps.weight", (e, d, f), 0.9 / f ** 0.5)]
    return out


def validate(spec: ModelSpec) -> None:
    spec.validate()
    if spec.expert_type not in FORMATS:
        raise PyllamapoolError(f"full-size models write their experts as quant blocks; expert type "
                               f"{spec.expert_type!r} is not one: accepted are {', '.join(FORMATS)}")
    if spec.arch != "qwen3moe":
        raise PyllamapoolError(f"full-size models are qwen3moe (the arch of the shapes they copy); got {spec.arch!r}")


class _Buffered:
    """An array as gguf's write_tensor_data takes it, written with one buffered write: the writer calls
    ndarray.tofile(), which numpy implements at a fraction of the page cache's speed (0.4 GB/s against
    3 GB/s here), the difference between minutes and seconds for 16 GB."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = np.ascontiguousarray(array)
        self.nbytes = self.array.nbytes

    def tofile(self, f) -> None:
        f.write(memoryview(self.array.reshape(-1).view(np.uint8)))


@dataclass(frozen=True)
class WriteStats:
    path: Path
    bytes: int
    seconds: float

    @property
    def seconds_per_gb(self) -> float:
        return self.seconds / (self.bytes / 1e9)


def write_fullsize_model(spec: ModelSpec, path: str | Path, *, threads: int | None = None,
                         progress: Callable[[int, int], None] | None = None) -> WriteStats:
    """Write spec's model to path; progress(bytes_written, bytes_total) after each tensor."""
    import gguf

    validate(spec)
    t0 = time.perf_counter()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two writers of one cached model never share a file
    # the K-quant file types are named by their mixes (Q4_K_M); an exact name where there is one
    file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{spec.expert_type}", None) or \
        getattr(gguf.LlamaFileType, f"MOSTLY_{spec.expert_type}_M", gguf.LlamaFileType.MOSTLY_Q8_0)
    try:
        return _write(spec, path, tmp, file_type, threads, progress, t0)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave gigabytes of a half-written model behind
        raise


def _write(spec: ModelSpec, path: Path, tmp: Path, file_type, threads: int | None,
           progress: Callable[[int, int], None] | None, t0: float) -> WriteStats:
    writer = new_writer(spec, tmp, file_type)
    dense = {}
    with ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool:
        weights = _weights(spec, experts=False, projection=_projection(spec, pool))
    for name, data in weights.items():
        # the router stays F32, as converters leave it; norms are vectors, which ggml keeps F32
        dense[name] = data if data.ndim == 1 or "ffn_gate_inp" in name else data.astype(np.float16, copy=False)
        writer.add_tensor_info(name, dense[name].shape, dense[name].dtype, dense[name].nbytes)
    experts = _expert_shapes(spec)
    fmt = FORMATS[spec.expert_type]
    for name, shape, _ in experts:
        byte_shape = shape[:-1] + (shape[-1] // fmt.weights * fmt.nbytes,)
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                               raw_dtype=_qtype(spec.expert_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = sum(a.nbytes for a in dense.values()) + sum(
        int(np.prod(s[:-1])) * (s[-1] // fmt.weights * fmt.nbytes) for _, s, _ in experts)
    done = 0
    for data in dense.values():
        writer.write_tensor_data(_Buffered(data))
        done += data.nbytes
    dense.clear()
    # the next tensor is generated on the pool while this one is written
    with ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool, \
            ThreadPoolExecutor(max_workers=1) as ahead:
        def make(i: int):
            _, shape, std = experts[i]
            return ahead.submit(_expert_tensor, pool, spec, shape, std, (spec.seed, i))
        pending = make(0) if experts else None
        for i in range(len(experts)):
            data = pending.result()
            pending = make(i + 1) if i + 1 < len(experts) else None
            writer.write_tensor_data(_Buffered(data))
            done += data.nbytes
            del data
            if progress:
                progress(done, total)
    writer.close()
    tmp.replace(path)
    return WriteStats(path, path.stat().st_size, time.perf_counter() - t0)


def file_stem(spec: ModelSpec) -> str:
    # this module's source and testmodel's (which writes the dense part) both shape the bytes
    own = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    key = json.dumps(asdict(spec), sort_keys=True) + generator_digest() + own
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"full-{spec.arch}-L{spec.n_layer}-E{spec.n_expert}k{spec.n_expert_used}-{spec.n_embd}x" \
           f"{spec.n_ff_exp}-{spec.expert_type.lower()}-s{spec.seed}-{digest}"


def cached_fullsize(spec: ModelSpec, directory: Path | None = None, **kwargs) -> tuple[Path, WriteStats | None]:
    """The model for spec in the cache (None for stats when it was there already)."""
    path = (directory or default_model_dir()) / f"{file_stem(spec)}.gguf"
    if path.exists():
        return path, None
    return path, write_fullsize_model(spec, path, **kwargs)


def shape(name: str, **changes) -> ModelSpec:
    if name not in SHAPES:
        raise PyllamapoolError(f"unknown shape {name!r}; shapes: {', '.join(SHAPES)}")
    return replace(SHAPES[name], **changes) if changes else SHAPES[name]


__all__ = ["FORMATS", "SHAPES", "WriteStats", "write_fullsize_model", "cached_fullsize", "shape", "file_stem"]
