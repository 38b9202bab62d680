"""Measure this machine's side of the cost model: what one expert costs when the CPU computes it,
and what the link to a device moves.

`pyllamapool measure-host` times ggml's CPU MUL_MAT_ID on one expert tensor of the given shape and
type, the way a decode step runs it (one token, top-k ids), cycling through enough experts that the
weights come from RAM rather than cache. One expert is gate + up + down: three such matrices.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from ..errors import PyllamapoolError


@dataclass
class HostMeasurement:
    expert_type: str
    n_embd: int
    n_ff: int
    threads: int
    expert_bytes: int        # gate + up + down
    ms_per_expert: float     # one expert (three matrices) for one token
    gb_per_s: float          # expert bytes streamed per second: the profile's host_expert_gb_s


def measure_host(expert_type: str = "Q4_K", n_embd: int = 2048, n_ff: int = 768, threads: int | None = None,
                 top_k: int = 8, working_set_mib: int = 512, seconds: float = 2.0) -> HostMeasurement:
    from ..binding.llama import backend

    ffi, lib = backend()
    type_id = getattr(lib, f"GGML_TYPE_{expert_type}", None)
    if type_id is None:
        raise PyllamapoolError(f"unknown expert type {expert_type!r} (a ggml type name, e.g. Q4_K, IQ4_XS, F16)")
    if lib.ggml_quantize_requires_imatrix(type_id):
        raise PyllamapoolError(f"{expert_type} needs an importance matrix to quantize; measure a type that "
                               "does not (the cost per byte is close among types of one family)")
    matrix_bytes = lib.ggml_row_size(type_id, n_embd) * n_ff
    if n_embd % 256 and expert_type not in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        raise PyllamapoolError(f"n_embd {n_embd}: {expert_type} needs a multiple of 256")
    # enough experts that a pass over them leaves the caches: the weights stream from RAM
    n_expert = max(2 * top_k, (working_set_mib << 20) // matrix_bytes)
    threads = threads or os.cpu_count() or 1

    ctx = lib.ggml_init({"mem_size": 8 * lib.ggml_tensor_overhead() + lib.ggml_graph_overhead(),
                         "mem_buffer": ffi.NULL, "no_alloc": True})
    cpu = lib.ggml_backend_cpu_init()
    buf = ffi.NULL
    try:
        lib.ggml_backend_cpu_set_n_threads(cpu, threads)
        weights = lib.ggml_new_tensor_3d(ctx, type_id, n_embd, n_ff, n_expert)
        x = lib.ggml_new_tensor_3d(ctx, lib.GGML_TYPE_F32, n_embd, 1, 1)
        ids = lib.ggml_new_tensor_2d(ctx, lib.GGML_TYPE_I32, top_k, 1)
        out = lib.ggml_mul_mat_id(ctx, weights, x, ids)
        graph = lib.ggml_new_graph(ctx)
        lib.ggml_build_forward_expand(graph, out)
        buf = lib.ggml_backend_alloc_ctx_tensors(ctx, cpu)
        if buf == ffi.NULL:
            raise PyllamapoolError(f"could not allocate {n_expert} x {matrix_bytes / 2**20:.1f} MiB for the measurement")
        rng = np.random.default_rng(0)
        rows = rng.standard_normal((n_ff, n_embd), dtype=np.float32) * 0.05
        one = bytearray(matrix_bytes)
        lib.ggml_quantize_chunk(type_id, ffi.from_buffer("float[]", rows), ffi.from_buffer(one), 0, n_ff, n_embd,
                                ffi.NULL)
        for e in range(n_expert):  # the same values in every expert; the bytes still come from RAM
            lib.ggml_backend_tensor_set(weights, ffi.from_buffer(one), e * matrix_bytes, matrix_bytes)
        xs = rng.standard_normal(n_embd, dtype=np.float32)
        lib.ggml_backend_tensor_set(x, ffi.from_buffer(xs), 0, xs.nbytes)

        order = rng.permutation(n_expert).astype(np.int32)
        calls, start, pos = 0, None, 0
        while True:
            chosen = np.take(order, range(pos, pos + top_k), mode="wrap").astype(np.int32)
            pos = (pos + top_k) % n_expert
            lib.ggml_backend_tensor_set(ids, ffi.from_buffer(chosen), 0, chosen.nbytes)
            lib.ggml_backend_graph_compute(cpu, graph)
            if start is None:  # the first call warms the thread pool
                start = time.perf_counter()
                continue
            calls += 1
            if time.perf_counter() - start >= seconds and calls >= 3:
                break
        elapsed = time.perf_counter() - start
    finally:
        if buf != ffi.NULL:
            lib.ggml_backend_buffer_free(buf)
        lib.ggml_backend_free(cpu)
        lib.ggml_free(ctx)
    ms_per_matrix = elapsed * 1e3 / (calls * top_k)
    expert_bytes = 3 * matrix_bytes
    ms = 3 * ms_per_matrix
    return HostMeasurement(expert_type, n_embd, n_ff, threads, expert_bytes, ms, expert_bytes / (ms * 1e-3) / 1e9)


def measure_link(device_name: str, mib: int = 256, repeats: int = 5) -> dict:
    """Host -> device copies through the backend API: big copies from pageable and from pinned host
    memory (GB/s), and the latency of one small copy."""
    from ..binding.llama import backend

    ffi, lib = backend()
    dev = lib.ggml_backend_dev_by_name(device_name.encode())
    if dev == ffi.NULL:
        raise PyllamapoolError(f"no device named {device_name!r}")
    size = mib << 20
    buf = lib.ggml_backend_buft_alloc_buffer(lib.ggml_backend_dev_buffer_type(dev), size)
    ctx = lib.ggml_init({"mem_size": 4 * lib.ggml_tensor_overhead(), "mem_buffer": ffi.NULL, "no_alloc": True})
    tensor = lib.ggml_new_tensor_1d(ctx, lib.GGML_TYPE_I8, size)
    lib.ggml_backend_tensor_alloc(buf, tensor, lib.ggml_backend_buffer_get_base(buf))
    pageable = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    sources = {"pageable": ffi.cast("void *", pageable.ctypes.data)}
    host_buft = lib.ggml_backend_dev_host_buffer_type(dev)
    pinned_buf = lib.ggml_backend_buft_alloc_buffer(host_buft, size) if host_buft != ffi.NULL else ffi.NULL
    if pinned_buf != ffi.NULL:
        base = lib.ggml_backend_buffer_get_base(pinned_buf)
        ffi.memmove(base, ffi.from_buffer(pageable), size)
        sources["pinned"] = base
    out: dict = {"mib": mib}
    for name, src in sources.items():
        lib.ggml_backend_tensor_set(tensor, src, 0, size)  # first touch
        t = time.perf_counter()
        for _ in range(repeats):
            lib.ggml_backend_tensor_set(tensor, src, 0, size)
        out[f"{name}_gb_s"] = repeats * size / (time.perf_counter() - t) / 1e9
    # the pageable buffer pinned in place, as the pool pins mapped experts (CUDA, HIP): how long that
    # takes, and how fast copies from it then run
    reg = lib.ggml_backend_dev_backend_reg(dev)
    register = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_register_host_buffer")
    unregister = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_unregister_host_buffer")
    if register != ffi.NULL and unregister != ffi.NULL:
        register = ffi.cast("bool (*)(void *, size_t)", register)
        unregister = ffi.cast("void (*)(void *)", unregister)
        t = time.perf_counter()
        if register(sources["pageable"], size):
            out["register_gb_s"] = size / (time.perf_counter() - t) / 1e9
            t = time.perf_counter()
            for _ in range(repeats):
                lib.ggml_backend_tensor_set(tensor, sources["pageable"], 0, size)
            out["registered_gb_s"] = repeats * size / (time.perf_counter() - t) / 1e9
            unregister(sources["pageable"])
    small, n = 64 << 10, 200
    t = time.perf_counter()
    for i in range(n):
        lib.ggml_backend_tensor_set(tensor, sources["pageable"], (i * small) % (size - small), small)
    out["copy_latency_us_64k"] = (time.perf_counter() - t) / n * 1e6
    if pinned_buf != ffi.NULL:
        lib.ggml_backend_buffer_free(pinned_buf)
    lib.ggml_free(ctx)
    lib.ggml_backend_buffer_free(buf)
    return out
