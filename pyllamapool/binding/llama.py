"""Typed wrappers over the raw binding: devices, RPC servers, models, contexts, batches, samplers.

Objects own their native handles and free them on close() / garbage collection. Errors are
PyllamapoolError subclasses whose message includes what llama.cpp logged about the failure.
"""
from __future__ import annotations

import atexit
import logging
import re
import socket
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import _ffi, logs
from ..run import rpc as rpc_helper
from . import pool as pool_api
from ..errors import PyllamapoolError
from .pool import MemoryRow, PoolConfig, PoolCounters, PoolReport, PoolStatus
from .moecache import MoeCacheStats
from .moecache import parse_stats as parse_moe_cache_stats

#: the pattern llama.cpp's common/ uses for routed-expert tensors (--cpu-moe / --n-cpu-moe)
EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
GGUF_MAGIC = b"GGUF"


class ModelLoadError(PyllamapoolError):
    """The model file is missing, not a GGUF, truncated, or not loadable."""


class ContextError(PyllamapoolError):
    """A context could not be created, or decode failed."""


_init_lock = threading.Lock()
_initialized = False
_rpc_regs: dict[str, object] = {}
_live_models: "weakref.WeakSet[Model]" = weakref.WeakSet()


@atexit.register
def _close_everything() -> None:
    # Contexts and models still open at exit are freed now, while Python can still take the log
    # lines they write; freed later by the interpreter's teardown, llama.cpp would call back into a
    # half-finalized Python. Then llama.cpp's logging goes back to its own stderr logger.
    for model in list(_live_models):
        model.close()
    logs.uninstall()


def backend():
    """(ffi, lib) with the backend initialised and logs routed to Python, once per process."""
    global _initialized
    ffi, lib, _ = _ffi.load()
    with _init_lock:
        if not _initialized:
            logs.install()
            lib.llama_backend_init()
            _initialized = True
    return ffi, lib


# ---------------------------------------------------------------------------------------------
# devices


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    description: str
    kind: str           # "cpu", "gpu", "igpu", "accel"
    free_bytes: int
    total_bytes: int


_DEV_KIND = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


def _device_info(index: int, dev) -> Device:
    ffi, lib = backend()
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    lib.ggml_backend_dev_memory(dev, free, total)
    return Device(index, ffi.string(lib.ggml_backend_dev_name(dev)).decode(),
                  ffi.string(lib.ggml_backend_dev_description(dev)).decode(),
                  _DEV_KIND.get(int(lib.ggml_backend_dev_type(dev)), "other"), free[0], total[0])


def _connects(endpoint: str, timeout: float = 1.0) -> bool:
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            return not _connected_to_itself(sock)
    except (OSError, ValueError):
        return False


def _connected_to_itself(sock: socket.socket) -> bool:
    """A TCP connection to a local port nobody listens on can be given that same port as its own
    source port, and then connects to itself: nothing is there, and ggml-rpc, reading back what it
    sent, aborts the process."""
    return sock.getsockname() == sock.getpeername()


def _endpoint_alive(endpoint: str) -> bool:
    """Whether an RPC server is still there. Servers started by pyllamapool.run.rpc are checked by
    their process (and ones it stopped are dead); others are assumed alive: probing with a
    connection would queue behind the client the (single-client) server is serving and can fill
    its accept backlog."""
    if rpc_helper.stopped_here(endpoint):
        return False
    server = rpc_helper.server_for(endpoint)
    return server.running if server is not None else True


def devices() -> list[Device]:
    """Every device llama.cpp knows. RPC devices whose server has gone away are listed without
    being queried (ggml aborts the process on a dead RPC connection)."""
    ffi, lib = backend()
    addr = lambda p: int(ffi.cast("uintptr_t", p))  # noqa: E731
    dead = {addr(lib.ggml_backend_reg_dev_get(reg, j)) for ep, reg in _rpc_regs.items()
            if not _endpoint_alive(ep) for j in range(lib.ggml_backend_reg_dev_count(reg))}
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if addr(dev) in dead:
            out.append(Device(i, ffi.string(lib.ggml_backend_dev_name(dev)).decode(),
                              "(server unreachable)", "gpu", 0, 0))
        else:
            out.append(_device_info(i, dev))
    return out


def add_rpc_server(endpoint: str):
    """Register an RPC server (host:port) as a device; returns its ggml_backend_dev_t."""
    ffi, lib = backend()
    if not re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", endpoint):
        raise PyllamapoolError(f"RPC endpoint {endpoint!r} is not HOST:PORT")
    if endpoint not in _rpc_regs and not _connects(endpoint):
        raise PyllamapoolError(f"RPC server {endpoint} is unreachable (nothing accepts connections there)")
    if endpoint not in _rpc_regs:
        with logs.capture() as lines:
            reg = lib.ggml_backend_rpc_add_server(endpoint.encode())
        if reg == ffi.NULL or lib.ggml_backend_reg_dev_count(reg) == 0:
            raise PyllamapoolError(f"RPC server {endpoint} is unreachable: "
                                   + "; ".join(logs.errors_in(lines)[-3:]))
        lib.ggml_backend_register(reg)
        _rpc_regs[endpoint] = reg
    return lib.ggml_backend_reg_dev_get(_rpc_regs[endpoint], 0)


#: the lazy-copy test device's library (tests/ggml-lazy-copy.cpp of the patched tree) and its
#: backend's registered name
LAZY_COPY_LIBRARY = "libggml-lazy-copy.so"
LAZY_COPY_REG = "LAZY"
_lazy_reg: list = []


def lazy_copy_device():
    """The lazy-copy test device (loaded once per process): a GPU-like device whose copies and
    graphs run only when it is synchronized or an event is waited on, reading their sources then,
    as a DMA engine does. A host buffer reused, or a table published, before the device read it
    gives a wrong result on it, where the synchronous RPC device cannot tell."""
    ffi, lib = backend()
    if not _lazy_reg:
        path = _ffi.locate().lib_dir / LAZY_COPY_LIBRARY
        if not path.exists():
            raise PyllamapoolError(f"the lazy-copy test device {path} is not built "
                                   "(python build.py --target cpu builds it)")
        with logs.capture() as lines:
            reg = lib.ggml_backend_load(str(path).encode())
        if reg == ffi.NULL or lib.ggml_backend_reg_dev_count(reg) == 0:
            raise PyllamapoolError(f"could not load the lazy-copy test device {path}: "
                                   + ("; ".join(logs.errors_in(lines)[-3:]) or "no reason logged"))
        _lazy_reg.append(reg)
    return lib.ggml_backend_reg_dev_get(_lazy_reg[0], 0)


def lazy_copy_devices(n: int) -> list:
    """The first n lazy-copy test devices. The device reads how many it has (GGML_LAZY_COPY_DEVICES,
    default 1) once, when the process first loads it."""
    _, lib = backend()
    lazy_copy_device()
    have = int(lib.ggml_backend_reg_dev_count(_lazy_reg[0]))
    if not 1 <= n <= have:
        raise PyllamapoolError(f"{n} lazy-copy devices asked for, the device has {have} (set "
                               "GGML_LAZY_COPY_DEVICES before it is first loaded in this process)")
    return [lib.ggml_backend_reg_dev_get(_lazy_reg[0], i) for i in range(n)]


def lazy_copy_registered() -> tuple[int, int]:
    """Host ranges registered with the lazy-copy test device (as CUDA pins mapped pages), and how many
    of them are no longer mapped: a caller must unregister a range before its pages go."""
    ffi, lib = backend()
    lazy_copy_device()
    counts = []
    for name in (b"ggml_backend_lazy_copy_n_registered", b"ggml_backend_lazy_copy_n_registered_unmapped"):
        fn = lib.ggml_backend_reg_get_proc_address(_lazy_reg[0], name)
        if fn == ffi.NULL:
            raise PyllamapoolError(f"the lazy-copy test device has no {name.decode()}")
        counts.append(int(ffi.cast("size_t (*)(void)", fn)()))
    return counts[0], counts[1]


def local_gpus() -> list:
    """This build's own GPUs (CUDA, HIP, Vulkan; never RPC devices), as llama.cpp picks them when a
    model names no devices: the discrete ones, or the integrated ones when there is none."""
    ffi, lib = backend()
    gpus, igpus = [], []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = int(lib.ggml_backend_dev_type(dev))
        if ffi.string(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev))) in (
                b"RPC", LAZY_COPY_REG.encode()):
            continue  # test devices join a model only when it names them
        if kind == lib.GGML_BACKEND_DEVICE_TYPE_GPU:
            gpus.append(dev)
        elif kind == lib.GGML_BACKEND_DEVICE_TYPE_IGPU:
            igpus.append(dev)
    return gpus or igpus


def cpu_buffer_type():
    _, lib = backend()
    return lib.ggml_backend_dev_buffer_type(lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU))


def expert_override_patterns(n_cpu_moe: int = 0, cpu_moe: bool = False) -> list[str]:
    """The tensor patterns llama.cpp's --cpu-moe / --n-cpu-moe N send to host memory."""
    if n_cpu_moe < 0:
        raise PyllamapoolError(f"n_cpu_moe must be 0 or more, got {n_cpu_moe}")
    if cpu_moe:
        return [EXPS_REGEX]
    return [rf"blk\.{i}{EXPS_REGEX}" for i in range(n_cpu_moe)]


def _rpc_safe_free(free_fn, endpoints: Sequence[str]):
    """A destructor that frees a handle, unless one of its RPC servers has gone away: freeing
    buffers on a dead server blocks forever inside ggml, so the handle is leaked (and said so)."""
    def destroy(handle):
        dead = [ep for ep in endpoints if not _endpoint_alive(ep)]
        if dead:
            logging.getLogger("pyllamapool").warning(
                "not freeing a llama.cpp object: its RPC server(s) %s are gone "
                "(close models and contexts before stopping their servers)", ", ".join(dead))
            return
        free_fn(handle)
    return destroy


# ---------------------------------------------------------------------------------------------
# model


def check_gguf(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"model file {path} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"model path {path} is not a file")
    with path.open("rb") as fh:
        if fh.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic)")


class Model:
    """A loaded GGUF model. rpc: endpoints whose devices take the offloaded layers, in order;
    lazy_copy: the lazy-copy test device takes them (before any RPC device); a number: that many
    lazy-copy devices split them, as llama.cpp splits layers between GPUs."""

    def __init__(self, path: str | Path, *, n_gpu_layers: int = 0, rpc: Sequence[str] = (),
                 n_cpu_moe: int = 0, cpu_moe: bool = False,
                 cpu_overrides: Sequence[str] = (), use_mmap: bool = True, repack: bool = True,
                 no_alloc: bool = False, lazy_copy: bool | int = False):
        ffi, lib = backend()
        self.path = Path(path)
        check_gguf(self.path)
        self._keep: list = []
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        # a no-allocation load reads no tensor data (and llama.cpp refuses it on a mapping)
        params.load_mode = lib.LLAMA_LOAD_MODE_MMAP if use_mmap and not no_alloc else lib.LLAMA_LOAD_MODE_NONE
        # llama.cpp's default: the CPU repacks what it has faster kernels for (the expert pool then
        # uploads those experts from the model file)
        params.use_extra_bufts = repack
        # what-if: load metadata only and let llama.cpp estimate every allocation
        params.no_alloc = no_alloc
        # Always pass an explicit device list: RPC devices registered for an earlier model in this
        # process must not silently join this one. The build's own GPUs come after this model's RPC
        # devices, as in llama.cpp's default list.
        devs = lazy_copy_devices(int(lazy_copy)) if lazy_copy else []
        devs += [add_rpc_server(ep) for ep in rpc] + local_gpus()
        dev_array = ffi.new("ggml_backend_dev_t[]", [*devs, ffi.NULL])
        self._keep.append(dev_array)
        params.devices = dev_array
        self.cpu_patterns = [*expert_override_patterns(n_cpu_moe, cpu_moe), *cpu_overrides]
        if self.cpu_patterns:
            overrides = ffi.new("struct llama_model_tensor_buft_override[]", len(self.cpu_patterns) + 1)
            buft = cpu_buffer_type()
            for i, pattern in enumerate(self.cpu_patterns):
                text = ffi.new("char[]", pattern.encode())
                self._keep.append(text)
                overrides[i].pattern = text
                overrides[i].buft = buft
            overrides[len(self.cpu_patterns)].pattern = ffi.NULL
            self._keep.append(overrides)
            params.tensor_buft_overrides = overrides
        with logs.capture() as lines:
            handle = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if handle == ffi.NULL:
            raise ModelLoadError(f"llama.cpp could not load {self.path}: "
                                 + ("; ".join(logs.errors_in(lines)[-3:]) or "no reason logged"))
        self.handle = ffi.gc(handle, _rpc_safe_free(lib.llama_model_free, rpc))
        # contexts must be freed before their model (llama_free reads the model)
        self._contexts: "weakref.WeakSet[Context]" = weakref.WeakSet()
        _live_models.add(self)
        self.load_log = [text for _, text in lines]
        self.vocab = lib.llama_model_get_vocab(self.handle)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.n_layer = lib.llama_model_n_layer(self.handle)
        self.rpc = list(rpc)
        self.n_gpu_layers = n_gpu_layers

    def meta(self, key: str) -> str | None:
        ffi, lib = backend()
        buf = ffi.new("char[]", 4096)
        n = lib.llama_model_meta_val_str(self.handle, key.encode(), buf, 4096)
        return ffi.string(buf).decode() if n >= 0 else None

    @property
    def n_expert(self) -> int:
        value = self.meta(f"{self.meta('general.architecture')}.expert_count")
        return int(value) if value else 0

    @property
    def n_expert_used(self) -> int:
        value = self.meta(f"{self.meta('general.architecture')}.expert_used_count")
        return int(value) if value else 0

    @property
    def description(self) -> str:
        ffi, lib = backend()
        buf = ffi.new("char[]", 256)
        lib.llama_model_desc(self.handle, buf, 256)
        return ffi.string(buf).decode()

    def tokenize(self, text: str) -> list[int]:
        ffi, lib = backend()
        data = text.encode()
        cap = len(data) + 8
        out = ffi.new("llama_token[]", cap)
        n = lib.llama_tokenize(self.vocab, data, len(data), out, cap, False, False)
        if n < 0:
            cap = -n
            out = ffi.new("llama_token[]", cap)
            n = lib.llama_tokenize(self.vocab, data, len(data), out, cap, False, False)
        return list(out[0:n])

    def detokenize(self, tokens: Sequence[int]) -> str:
        ffi, lib = backend()
        buf = ffi.new("char[]", 64)
        pieces = []
        for tok in tokens:
            n = lib.llama_token_to_piece(self.vocab, tok, buf, 64, 0, False)
            pieces.append(ffi.buffer(buf, max(n, 0))[:].decode("utf-8", "replace"))
        return "".join(pieces)

    def close(self) -> None:
        """Free the model; contexts still open on it are closed first."""
        if getattr(self, "handle", None) is not None:
            for ctx in list(self._contexts):
                ctx.close()
            handle, self.handle = self.handle, None
            _ffi.load()[0].release(handle)


# ---------------------------------------------------------------------------------------------
# context

#: KV cache types llama.cpp accepts for -ctk / -ctv
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def ggml_type(name: str) -> int:
    _, lib = backend()
    if name.lower() not in CACHE_TYPES:
        raise PyllamapoolError(f"cache type {name!r} is not one of {', '.join(CACHE_TYPES)}")
    return getattr(lib, f"GGML_TYPE_{name.upper()}")



#: observer(tensor_name, array) is called for every tensor whose name the filter accepts
TensorObserver = Callable[[str, np.ndarray], None]


class Context:
    def __init__(self, model: Model, *, n_ctx: int = 512, n_batch: int = 512, n_ubatch: int = 512,
                 n_seq_max: int = 1, n_threads: int | None = None,
                 observe: Callable[[str], bool] | None = None, observer: TensorObserver | None = None,
                 flash_attn: bool | None = None, pool: "PoolConfig | None" = None,
                 type_k: str | None = None, type_v: str | None = None, draft_of: "Context | None" = None,
                 moe_cache_mib: int = 0):
        """draft_of: the target context this one drafts for (llama.cpp's ctx_other, as common's
        speculative decoding sets it); such a context never gets an expert pool.
        moe_cache_mib: llama.cpp's own expert cache (`--moe-cache-mib`), 0 = off; it and an
        expert pool are not used together (llama.cpp refuses the context)."""
        ffi, lib = backend()
        self.model = model
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_ubatch, n_batch)
        params.n_seq_max = n_seq_max
        if n_threads:
            params.n_threads = params.n_threads_batch = n_threads
        if flash_attn is not None:
            params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                      else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.no_perf = False
        for name, value in (("type_k", type_k), ("type_v", type_v)):
            if value is not None:
                setattr(params, name, ggml_type(value))
        self._keep: list = []
        self.callback_error: BaseException | None = None   # the first error an observer raised
        if draft_of is not None:
            params.ctx_other = draft_of.handle
            self._keep.append(draft_of)   # the target must outlive its draft
        if isinstance(moe_cache_mib, bool) or not isinstance(moe_cache_mib, int) or moe_cache_mib < 0:
            raise ValueError(f"moe_cache_mib={moe_cache_mib!r} is invalid: expected a whole number of MiB "
                             ">= 0 (0 = off)")
        params.moe_cache_size = moe_cache_mib * 1024 * 1024
        self.pool_config = pool
        if pool is not None and pool.enabled:
            params.moe_pool = pool.to_c(ffi, self._keep, model_path=model.path)
        self._callback = None
        if observer is not None:
            self._callback = self._make_eval_callback(observe or (lambda name: True), observer)
            params.cb_eval = self._callback
            params.cb_eval_user_data = ffi.NULL
        with logs.capture() as lines:
            handle = lib.llama_init_from_model(model.handle, params)
        if handle == ffi.NULL:
            raise ContextError("llama.cpp could not create a context: "
                               + ("; ".join(logs.errors_in(lines)[-3:]) or "no reason logged"))
        self.handle = ffi.gc(handle, _rpc_safe_free(lib.llama_free, model.rpc))
        model._contexts.add(self)
        self._pool_observer = None      # the C callback lives as long as the context may call it
        self.init_log = [text for _, text in lines]
        self._run_log: list[str] = []   # pool lines logged while decoding (first-use)
        self.close_log: list[str] = []
        self.n_vocab = model.n_vocab

    # -- expert pool -------------------------------------------------------------------------
    def set_pool_observer(self, callback) -> None:
        """Install (or, with None, remove) a cffi callback as the pool's routing observer. The
        context keeps it alive, and removes it before it is freed."""
        ffi, lib = backend()
        if self.handle is None:
            if callback is not None:
                raise ContextError("the context is closed")
            return
        lib.llama_moe_pool_set_observer(self.handle, callback if callback is not None else ffi.NULL, ffi.NULL)
        self._pool_observer = callback

    def pool_status(self, device: int = -1) -> "PoolStatus":
        return pool_api.status(self.handle, device)

    def pool_counters(self, pool: int = -1) -> "PoolCounters":
        return pool_api.counters(self.handle, pool)

    def pool_reset(self) -> None:
        pool_api.reset_counters(self.handle)

    def host_syncs(self) -> int:
        """Times the host waited for a device during the last decode, pool or not (compare a
        pooled run with stock --n-cpu-moe)."""
        _, lib = backend()
        return int(lib.llama_moe_pool_host_syncs(self.handle))

    def copy_callback_ms(self) -> float:
        """Host time in the scheduler's copy callback during the last decode: where llama.cpp's MoE
        cache reads the selected experts and uploads its misses (and offloaded batches copy experts)."""
        _, lib = backend()
        return int(lib.llama_moe_pool_copy_callback_us(self.handle)) / 1000.0

    def moe_cache_stats(self) -> "MoeCacheStats | None":
        """What llama.cpp's own MoE cache logged (its hits and misses once the context is closed);
        None without one."""
        return parse_moe_cache_stats([*self.init_log, *self.close_log])

    def pool_report(self, per_pool: bool = False) -> "PoolReport":
        return pool_api.report(self.handle, per_pool)

    def memory(self) -> list["MemoryRow"]:
        return pool_api.memory(self.handle)

    def pool_lines(self) -> list[str]:
        """The `expert pool ...` lines llama.cpp logged for this context so far (status, first-use,
        and after close() the runtime line)."""
        return [line for line in [*self.init_log, *self._run_log, *self.close_log]
                if line.startswith("expert pool")]

    def _make_eval_callback(self, observe: Callable[[str], bool], observer: TensorObserver):
        ffi, lib = backend()
        itemsize = {lib.GGML_TYPE_F32: ("float32", 4), lib.GGML_TYPE_I32: ("int32", 4)}

        @ffi.callback("bool(struct ggml_tensor *, bool, void *)")
        def on_tensor(t, ask, _user):
            try:
                name = ffi.string(t.name).decode()
                if ask:
                    return bool(observe(name)) and int(t.type) in itemsize
                dtype, size = itemsize[int(t.type)]
                ne0, ne1 = int(t.ne[0]), int(t.ne[1])
                rows = np.empty((ne1, ne0), dtype=dtype)
                buf = ffi.from_buffer(rows)
                row_bytes = ne0 * size
                # Views (like the router's top-k) are strided: read row by row.
                for r in range(ne1):
                    lib.ggml_backend_tensor_get(t, buf + r * row_bytes, r * int(t.nb[1]), row_bytes)
                observer(name, rows)
            except Exception as e:  # never unwind into C: decode() raises it once it returns
                if self.callback_error is None:
                    self.callback_error = e
                return True
            return True

        return on_tensor

    # -- decoding ---------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int]) -> None:
        """Append tokens to sequence 0 (positions continue from the memory); logits of the last."""
        ffi, lib = backend()
        if not tokens:
            raise ContextError("decode needs at least one token")
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise ContextError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.n_vocab})")
        arr = ffi.new("llama_token[]", list(tokens))
        batch = lib.llama_batch_get_one(arr, len(tokens))
        with logs.capture() as lines:
            rc = lib.llama_decode(self.handle, batch)
        self._run_log.extend(text for _, text in lines if text.startswith("expert pool"))
        self._raise_callback_error()
        if rc != 0:
            raise ContextError(f"llama_decode returned {rc}: "
                               + ("; ".join(logs.errors_in(lines)[-3:]) or "no reason logged"))

    def _raise_callback_error(self) -> None:
        """An observer that raised inside a C callback: report it here, once."""
        error, self.callback_error = self.callback_error, None
        if error is not None:
            raise ContextError(f"an observer raised during decode: {error!r}") from error

    def decode_batch(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
                     want_logits: Sequence[bool]) -> None:
        """One batch mixing sequences (as llama-server does with -np > 1)."""
        ffi, lib = backend()
        n = len(tokens)
        batch = lib.llama_batch_init(n, 0, 1)
        try:
            for i in range(n):
                batch.token[i] = tokens[i]
                batch.pos[i] = positions[i]
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_ids[i]
                batch.logits[i] = 1 if want_logits[i] else 0
            batch.n_tokens = n
            with logs.capture() as lines:
                rc = lib.llama_decode(self.handle, batch)
            self._run_log.extend(text for _, text in lines if text.startswith("expert pool"))
        finally:
            lib.llama_batch_free(batch)
        self._raise_callback_error()
        if rc != 0:
            raise ContextError(f"llama_decode returned {rc}")

    def logits(self, index: int = -1) -> np.ndarray:
        ffi, lib = backend()
        ptr = lib.llama_get_logits_ith(self.handle, index)
        if ptr == ffi.NULL:
            raise ContextError(f"no logits for output {index}")
        return np.frombuffer(ffi.buffer(ptr, 4 * self.n_vocab), dtype=np.float32).copy()

    def clear(self) -> None:
        _, lib = backend()
        lib.llama_memory_clear(lib.llama_get_memory(self.handle), True)

    def perf(self) -> dict[str, float]:
        _, lib = backend()
        data = lib.llama_perf_context(self.handle)
        return {"prefill_ms": data.t_p_eval_ms, "prefill_tokens": data.n_p_eval,
                "decode_ms": data.t_eval_ms, "decode_tokens": data.n_eval}

    def perf_reset(self) -> None:
        _, lib = backend()
        lib.llama_perf_context_reset(self.handle)

    def close(self) -> None:
        """Free the context; what llama.cpp logs meanwhile (the pool's runtime line) is kept."""
        if getattr(self, "handle", None) is not None:
            if self._pool_observer is not None:
                self.set_pool_observer(None)
            handle, self.handle = self.handle, None
            with logs.capture() as lines:
                _ffi.load()[0].release(handle)
            self.close_log = [text for _, text in lines]

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sampler:
    """llama.cpp's own sampler chain: greedy, or seeded (top-k, temperature, dist(seed))."""

    def __init__(self, *, greedy: bool = True, seed: int = 0, top_k: int = 40, temperature: float = 0.8):
        ffi, lib = backend()
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if greedy:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        else:
            if temperature <= 0:
                raise PyllamapoolError(f"temperature must be > 0 for seeded sampling, got {temperature}")
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(top_k))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(temperature))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        self.handle = ffi.gc(chain, lib.llama_sampler_free)

    def sample(self, ctx: Context, index: int = -1) -> int:
        _, lib = backend()
        return int(lib.llama_sampler_sample(self.handle, ctx.handle, index))
