"""The expert pool from Python: configuration, admission status, per-pool info and counters.

Everything here reads the C API in include/llama-moe-pool.h (added by the patch series); field names
follow the telemetry lines (`expert pool status=... requested_slots=... limited_by=...`).
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

from . import _ffi
from ..errors import PyllamapoolError

LIMITS = ("slots", "rail", "cap")
MAX_DEVICES = 16
log = logging.getLogger(__name__)


class PoolConfigError(PyllamapoolError):
    """A pool setting is out of range."""


#: the slot policies by their C API code (enum llama_moe_pool_policy_type); the pool's default first
POLICY_KINDS = {"adaptive": 2, "lru": 1}
DEFAULT_POLICY = "adaptive"
#: the admission gate by its C API code (enum llama_moe_pool_gate_type)
#: "auto": decode steps timed with and without the pool in turns, the faster side runs (`-mec auto`)
GATES = {"off": 1, "yield": 2, "auto": 3}
#: slots="auto" (`-mec auto`): as many slots as fit, and the pool stands down where decode is faster without it
AUTO = "auto"
#: how a missed expert is served, by its C API code (enum llama_moe_pool_mode)
MODES = {"copy": 1, "hybrid": 2}
#: how misses' bytes reach the slots, by C API code (enum llama_moe_pool_uploads): "stream" (an upload
#: queue of its own, by default where the device has events and pinned experts) or "inline" (the compute queue)
UPLOAD_PATHS = {"inline": 1, "stream": 2}
#: hybrid mode, where a step's misses are computed, by C API code (enum llama_moe_pool_placement_type):
#: "cost" (a share is uploaded for the device to compute in the step, by measured cost), "cpu" (the CPU
#: computes them all) or "device" (every miss a slot can take is uploaded in its step, as copy mode does)
PLACEMENTS = {"cost": 1, "cpu": 2, "device": 3}
#: hybrid mode, whether a layer's step uploads the next layer's predicted experts ahead of its step, by
#: C API code (enum llama_moe_pool_prefetch_type): "auto" (where uploads run beside compute, as many as
#: the link carries before that step), "off", or "on" (every predicted expert a slot can take)
PREFETCHES = {"auto": 1, "off": 2, "on": 3}
#: whether experts in pageable pages (the default, mmap'd load) are pinned in place for the device's
#: copies where its backend offers that (CUDA, HIP), by C API code (enum llama_moe_pool_pin_type)
PINS = {"on": 1, "off": 2}
#: where a decode step's pooled layers are served, by C API code (enum llama_moe_pool_serve_type): "auto"
#: (on the device where it can: it finds and fetches its misses in the graph, no host wait; elsewhere the
#: host; in hybrid mode the device's path and hybrid's take turns, timed, and the faster one serves),
#: "device" (the device wherever it can, untimed: a device that cannot says why) or "host"
SERVES = {"auto": 1, "device": 2, "host": 3}
#: whether a device's slots are one bank for its layers, by C API code (enum llama_moe_pool_bank_type):
#: "off" (the default: a pool per layer) or "on" (copy mode where the device serves every pooled layer:
#: its LRU runs over (layer, expert) and a slot belongs to no layer)
BANKS = {"off": 1, "on": 2}
#: where a device's misses are read from (PoolStatus.experts), fastest first
EXPERT_SOURCES = ("pinned", "registered", "mapped", "file")
#: the environment knobs (as llama.cpp's tools read them through common) for PoolConfig's fields
ENVIRONMENT = {"rail_mib": "LLAMA_MOE_POOL_RAIL_MIB", "cap_mib": "LLAMA_MOE_POOL_CAP_MIB",
               "device_mib": "LLAMA_MOE_POOL_DEVICE_MIB", "profile": "LLAMA_MOE_POOL_PROFILE",
               "policy": "LLAMA_MOE_POOL_POLICY", "gate": "LLAMA_MOE_POOL_GATE", "mode": "LLAMA_MOE_POOL_MODE",
               "upload_frac": "LLAMA_MOE_POOL_UPLOAD_FRAC", "max_batch": "LLAMA_MOE_POOL_MAX_BATCH",
               "uploads": "LLAMA_MOE_POOL_UPLOADS", "staging_mib": "LLAMA_MOE_POOL_STAGING_MIB",
               "placement": "LLAMA_MOE_POOL_PLACEMENT", "hotset": "LLAMA_MOE_POOL_HOTSET",
               "prefetch": "LLAMA_MOE_POOL_PREFETCH", "pin": "LLAMA_MOE_POOL_PIN",
               "gather_threads": "LLAMA_MOE_POOL_GATHER_THREADS", "serve": "LLAMA_MOE_POOL_SERVE",
               "bank": "LLAMA_MOE_POOL_BANK"}
#: any value asks for per-pool counters and hits by batch size in the shutdown report
STATS_ENV = "GGML_MOE_POOL_STATS"
#: micro-batch sizes the counters are split by (tokens; the last only where a pool holds every expert)
BATCH_CLASSES = ("1", "2-8", "9-32", "33+")


def parse_layer_profile(text: str) -> tuple[list[float], list[str]]:
    """A profile's `blk.<layer> <weight>` lines ('#' starts a comment) as a weight per layer, by layer
    index, 1 for the layers it does not list, and the problems found, each naming its line: a line
    that does not parse is ignored, a weight that is not a positive float counts as 1, a layer listed
    again takes the last weight. The same rules as common's reader (common_moe_pool_parse_profile):
    libllama takes the weights, not the file."""
    weights: list[float] = []
    listed: set[int] = set()
    problems: list[str] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        raw = raw.rstrip(" \t\r")
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        index = fields[0][4:] if fields[0].startswith("blk.") else ""
        layer = int(index) if index.isascii() and index.isdigit() else -1
        if not 0 <= layer < 1 << 16 or len(fields) != 2:
            problems.append(f"line {lineno}: expected `blk.<layer> <weight>`; line ignored ({raw!r})")
            continue
        try:
            weight = ctypes.c_float(float(fields[1])).value  # what libllama gets: a C float
        except ValueError:
            weight = math.nan
        if not 0 < weight < math.inf:
            problems.append(f"line {lineno}: the weight is not a positive number; weight 1 used ({raw!r})")
            weight = 1.0
        weights.extend([1.0] * (layer + 1 - len(weights)))
        if layer in listed:
            problems.append(f"line {lineno}: the layer is listed again; the last weight wins ({raw!r})")
        listed.add(layer)
        weights[layer] = weight
    return weights or [1.0], problems


def _code(what: str, value: str | int, codes: dict[str, int]) -> int:
    if isinstance(value, str) and value in codes:
        return codes[value]
    if isinstance(value, int) and not isinstance(value, bool) and value in codes.values():
        return value
    raise PoolConfigError(f"{what} {value!r} is unknown: expected one of {', '.join(codes)}")


def policy_kind(policy: str | int) -> int:
    """The C API code of a policy given by name or code."""
    return _code("policy", policy, POLICY_KINDS)


def gate_code(gate: str | int) -> int:
    """The C API code of an admission gate given by name or code."""
    return _code("gate", gate, GATES)


def mode_code(mode: str | int) -> int:
    """The C API code of a pool mode given by name or code."""
    return _code("mode", mode, MODES)


def uploads_code(uploads: str | int) -> int:
    """The C API code of an upload path given by name or code."""
    return _code("uploads", uploads, UPLOAD_PATHS)


def placement_code(placement: str | int) -> int:
    """The C API code of a hybrid placement rule given by name or code."""
    return _code("placement", placement, PLACEMENTS)


def prefetch_code(prefetch: str | int) -> int:
    """The C API code of a prefetch rule given by name or code."""
    return _code("prefetch", prefetch, PREFETCHES)


def pin_code(pin: str | int) -> int:
    """The C API code of a pinning rule given by name or code."""
    return _code("pin", pin, PINS)


def serve_code(serve: str | int) -> int:
    """The C API code of where pooled layers are served, given by name or code."""
    return _code("serve", serve, SERVES)


def bank_code(bank: str | int) -> int:
    """The C API code of whether a device's layers share one bank, given by name or code."""
    return _code("bank", bank, BANKS)


def _check_whole(name: str, value, minimum: int, expected: str) -> None:
    """None (take the default) or a whole number >= minimum; bools are not numbers here."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise PoolConfigError(f"{name}={value!r} is invalid: {expected}")


def _parse_env(name: str, text: str):
    """An environment value for PoolConfig's field `name` (ValueError for one that does not parse)."""
    if name == "device_mib":
        sizes = tuple(int(part) for part in text.split(","))
        return sizes[0] if len(sizes) == 1 else sizes
    if name in ("rail_mib", "cap_mib", "max_batch", "staging_mib", "gather_threads"):
        if not text.strip().isdigit():
            raise ValueError("expected a whole number")
        return int(text)
    if name == "upload_frac":
        return float(text)
    return text


@dataclass(frozen=True)
class PoolConfig:
    """What to ask of the pool. None = take the environment knob (LLAMA_MOE_POOL_*) or its default.

    slots: requested slots per offloaded expert tensor; an int for every device, or one per device;
        0 = off, -1 = as many as the ledger allows (up to every expert); "auto" = -1 with gate "auto",
        as `-mec auto` asks: decode steps are timed with the pool and on the stock path in turns, and
        the pool stands down while the stock path is not slower.
    device_mib: emulated device size(s) in MiB; an int for every device, or one per device.
    policy: which expert a miss evicts: "adaptive" (the default) or "lru".
    gate: "off" (the default), "yield": a layer whose full pool copies in more experts than it serves
        runs the stock path (CPU experts) for a cool-down; those steps are not device-computed; or
        "auto" (what slots="auto" sets): the whole pool stands down while timed decode steps show the
        stock path is not slower.
    mode: "hybrid" (the default: the device computes the experts it holds while the CPU computes
        the misses, which are uploaded after the CPU served them, when they pay back) or "copy" (a
        miss is copied to a slot before the layer's matmul).
    upload_frac: hybrid mode's upload budget, the share of a token's measured time uploads may take
        (default 0.25, LLAMA_MOE_POOL_UPLOAD_FRAC); a missed expert is uploaded only when its recent
        uses pay back the upload. 0 = neither: every miss is uploaded, as copy mode does.
    max_batch: micro-batches of up to this many tokens use the pool (default 32,
        LLAMA_MOE_POOL_MAX_BATCH): decode, several sequences, speculative verification. Bigger ones
        take the stock path and never evict. Copy mode also needs tokens x top-k to fit the slots.
    reserve_mib: device memory (MiB) to leave for buffers made after this context, e.g. a speculative
        draft model's weights (llama-server sets it from the draft's file).
    uploads: "stream" (misses copied on an upload queue of their own, from pinned staging where they
        are not pinned already, a slot read only after its copy ran; the default where the device has
        events and its experts sit in its pinned host memory, `use_mmap=False`) or "inline" (copies on
        the compute queue from wherever the bytes are; the default for mmap'd experts, which an H200 ran
        faster this way; LLAMA_MOE_POOL_UPLOADS).
    staging_mib: the stream path's pinned staging per device (default 64, LLAMA_MOE_POOL_STAGING_MIB).
    placement: hybrid mode, where a step's misses are computed: "cost" (the default: as many are
        uploaded for the device to compute in the step as make its side no longer than the CPU's, from
        the measured upload and CPU costs), "cpu" (the CPU computes every miss) or "device" (every miss a
        slot can take is uploaded in its step, as copy mode does; LLAMA_MOE_POOL_PLACEMENT).
    hotset: a hot set file (LLAMA_MOE_POOL_HOTSET): each layer's most used experts, one section per
        model and slot count. The context starts with its section's experts in the slots (a missing
        file or section: a cold start) and, once its pool served a step, merges this run's uses back
        into the file when it is freed.
    prefetch: hybrid mode, whether each layer's step uploads the experts the next layer's router picks
        from this layer's hidden state, before that layer's step: "auto" (the default: where uploads
        run beside compute, as many as the link carries in time, each into an empty slot or one whose
        expert was used no more often lately), "off", or "on" (every predicted expert a slot can take,
        on either upload path; LLAMA_MOE_POOL_PREFETCH).
    pin: "on" (the default: experts in pageable pages, as the default mmap'd load leaves them, are pinned
        in place when the pool is made where the device's backend offers that, CUDA and HIP, so that
        copies run at the link's speed; a refusal falls back with a warning) or "off" (LLAMA_MOE_POOL_PIN).
    gather_threads: stream uploads of experts in pageable pages: host threads that gather them into
        pinned staging (default: the fewest measured within 10% of the fastest, at most 8;
        LLAMA_MOE_POOL_GATHER_THREADS).
    serve: where a decode step's pooled layers are served: "auto" (the default: on the device where its
        backend runs the device's path, CUDA and HIP, and its experts are pinned or pinned in place: the
        device finds each step's misses and copies them from the host in the step's own graph, by LRU, so
        the step never waits for the host; elsewhere the host. In hybrid mode decode steps are timed on
        the device's path and on hybrid's, in turns as -mec auto times the pool, and the faster serves:
        on a slow link the CPU computing a share of the misses wins), "device" (the device's path
        wherever it can run, untimed, and a device that cannot says why) or "host" (the host reads each
        step's ids: copy or hybrid mode; LLAMA_MOE_POOL_SERVE).
    bank: "off" (the default: a pool per layer) or "on": in copy mode a device's slots are one bank
        over (layer, expert), so the memory goes to the layers whose routing is least local; the
        device's path runs its LRU over it, the host's path the pool's policy. In hybrid mode, with
        the yield gate, or for layers that differ in layout, a pool per layer, and the status says
        why (LLAMA_MOE_POOL_BANK).
    """
    slots: int | tuple[int, ...] | str = 0
    rail_mib: int | None = None
    cap_mib: int | None = None
    device_mib: int | tuple[int, ...] | None = None
    profile: str | Path | None = None
    policy: str | None = None
    gate: str | None = None
    mode: str | None = None
    upload_frac: float | None = None
    max_batch: int | None = None
    reserve_mib: int | None = None
    uploads: str | None = None
    staging_mib: int | None = None
    placement: str | None = None
    hotset: str | Path | None = None
    prefetch: str | None = None
    pin: str | None = None
    gather_threads: int | None = None
    serve: str | None = None
    bank: str | None = None

    @property
    def slot_list(self) -> tuple[int, ...]:
        if self.slots == AUTO:
            return (-1,)
        return (self.slots,) if isinstance(self.slots, int) else tuple(self.slots)

    @property
    def gate_asked(self) -> str | None:
        """The gate this config asks for: its own, else "auto" where slots="auto"."""
        return self.gate if self.gate is not None or self.slots != AUTO else AUTO

    @property
    def enabled(self) -> bool:
        return any(s != 0 for s in self.slot_list)

    def validate(self) -> None:
        if isinstance(self.slots, str) and self.slots != AUTO:
            raise PoolConfigError(f"slots {self.slots!r} is invalid: expected a whole number >= 0, -1 or "
                                  f"{AUTO!r}")
        slots = self.slot_list
        if not slots or len(slots) > MAX_DEVICES:
            raise PoolConfigError(f"slots needs 1 to {MAX_DEVICES} values, got {len(slots)}")
        bad = [s for s in slots if not isinstance(s, int) or s < -1]
        if bad:
            raise PoolConfigError(f"slots {bad[0]!r} is invalid: slots must be whole numbers >= 0, or -1 "
                                  "(as many as the ledger allows)")
        for name in ("rail_mib", "cap_mib", "device_mib"):
            value = getattr(self, name)
            values = value if isinstance(value, tuple) else (value,)
            if name == "device_mib" and isinstance(value, tuple) and not 1 <= len(value) <= MAX_DEVICES:
                raise PoolConfigError(f"device_mib needs 1 to {MAX_DEVICES} values, got {len(value)}")
            for v in values:
                _check_whole(name, v, 1, "it must be a whole number of MiB >= 1")
        if self.policy is not None:
            policy_kind(self.policy)
        if self.gate is not None:
            gate_code(self.gate)
        if self.mode is not None:
            mode_code(self.mode)
        if self.upload_frac is not None and not (isinstance(self.upload_frac, (int, float))
                                                 and 0 <= self.upload_frac <= 1):
            raise PoolConfigError(f"upload_frac={self.upload_frac!r} is invalid: expected 0 (no budget) to 1")
        _check_whole("max_batch", self.max_batch, 1, "expected a token count of at least 1")
        _check_whole("reserve_mib", self.reserve_mib, 0, "expected a whole number of MiB >= 0")
        if self.uploads is not None:
            uploads_code(self.uploads)
        if self.placement is not None:
            placement_code(self.placement)
        if self.prefetch is not None:
            prefetch_code(self.prefetch)
        _check_whole("staging_mib", self.staging_mib, 1, "it must be a whole number of MiB >= 1")
        if self.pin is not None:
            pin_code(self.pin)
        if self.serve is not None:
            serve_code(self.serve)
        if self.bank is not None:
            bank_code(self.bank)
        _check_whole("gather_threads", self.gather_threads, 1, "expected a thread count from 1 to 256")
        if self.gather_threads is not None and self.gather_threads > 256:
            raise PoolConfigError(f"gather_threads={self.gather_threads!r} is invalid: expected a thread count "
                                  "from 1 to 256")
        if self.profile is not None and not Path(self.profile).is_file():
            raise PoolConfigError(f"profile {str(self.profile)!r} does not exist")
        if self.hotset is not None:
            # a file that does not exist yet is this run's to write; its folder must be there
            where = Path(self.hotset)
            if str(self.hotset) == "" or where.is_dir() or not where.resolve().parent.is_dir():
                raise PoolConfigError(f"hotset {str(self.hotset)!r} is invalid: expected a file path in an "
                                      "existing folder")

    def with_environment(self, environ=None) -> "PoolConfig":
        """This config with the fields left at None taken from the environment (ENVIRONMENT), as
        llama.cpp's tools do; a value that is not valid raises PoolConfigError naming the variable."""
        environ = os.environ if environ is None else environ
        self.validate()  # a problem of the config's own is not the environment's
        updates = {}
        for name, var in ENVIRONMENT.items():
            text = environ.get(var)
            if text is None or getattr(self, name) is not None:
                continue
            try:
                value = _parse_env(name, text)
                replace(self, **{name: value}).validate()
            except (ValueError, PoolConfigError) as e:
                raise PoolConfigError(f"{var}={text} is invalid: {e}") from None
            updates[name] = value
        return replace(self, **updates)

    def to_c(self, ffi, keep: list, model_path: str | Path | None = None):
        """A `struct llama_moe_pool_params *` (objects it points to are appended to keep).

        model_path: the model's file, from which uploads read experts whose host copy the CPU
        repacked (without it such layers keep the stock path, reason=repacked)."""
        config = self.with_environment()
        config.validate()
        _, lib, _ = _ffi.load()
        params = ffi.new("struct llama_moe_pool_params *", lib.llama_moe_pool_default_params())
        slots = config.slot_list
        params.n_slots = len(slots)
        for i, s in enumerate(slots):
            params.slots[i] = s
        if config.rail_mib is not None:
            params.rail_mib = config.rail_mib
        if config.cap_mib is not None:
            params.cap_mib = config.cap_mib
        if config.device_mib is not None:
            sizes = config.device_mib if isinstance(config.device_mib, tuple) else (config.device_mib,)
            params.n_device_mib = len(sizes)
            for i, v in enumerate(sizes):
                params.device_mib[i] = v
        if config.profile is not None:
            weights, problems = parse_layer_profile(Path(config.profile).read_text(errors="replace"))
            for problem in problems:
                log.warning("expert pool: profile %s: %s", config.profile, problem)
            array = ffi.new("float[]", weights)
            keep.append(array)
            params.layer_weights, params.n_layer_weights = array, len(weights)
        for name, value in (("profile", config.profile), ("hotset", config.hotset), ("model_path", model_path)):
            if value is not None:
                text = ffi.new("char[]", str(value).encode())
                keep.append(text)
                setattr(params, name, text)
        if config.policy is not None:
            params.policy = policy_kind(config.policy)
        if config.gate_asked is not None:
            params.gate = gate_code(config.gate_asked)
        if config.mode is not None:
            params.mode = mode_code(config.mode)
        if config.upload_frac is not None:
            # the C API's 0 is the default, "no budget" is negative
            params.upload_frac = float(config.upload_frac) if config.upload_frac > 0 else -1.0
        if config.max_batch is not None:
            params.max_batch = config.max_batch
        if config.reserve_mib is not None:
            params.reserve_mib = config.reserve_mib
        if config.uploads is not None:
            params.uploads = uploads_code(config.uploads)
        if config.staging_mib is not None:
            params.staging_mib = config.staging_mib
        if config.placement is not None:
            params.placement = placement_code(config.placement)
        if config.prefetch is not None:
            params.prefetch = prefetch_code(config.prefetch)
        if config.pin is not None:
            params.pin = pin_code(config.pin)
        if config.gather_threads is not None:
            params.gather_threads = config.gather_threads
        if config.serve is not None:
            params.serve = serve_code(config.serve)
        if config.bank is not None:
            params.bank = bank_code(config.bank)
        params.detailed_stats = STATS_ENV in os.environ
        keep.append(params)
        return params


@dataclass(frozen=True)
class PoolStatus:
    """One `expert pool status=...` line, typed."""
    enabled: bool
    reason: str
    device: str
    requested_slots: int
    actual_slots: int
    pool_count: int
    bytes: int
    cap: int
    ceiling: int
    limited_by: str
    alloc: str
    profile: str
    slots_min: int
    slots_med: int
    slots_max: int
    total_slots: int
    policy: str = DEFAULT_POLICY
    gate: str = "off"
    mode: str = "hybrid"
    uploads: str = "inline"
    prefetch: str = "auto"
    #: where misses are read from (EXPERT_SOURCES), and why mapped pages were not pinned in place
    #: ("off", "no-hook": the device offers no way to, "refused"; "" where they were)
    experts: str = "mapped"
    experts_reason: str = ""
    #: stream uploads from pageable pages: host threads gathering them into staging (0: none gathered)
    gather_threads: int = 0
    #: where decode steps' pooled layers are served ("device", "host", "mixed", or "auto": timed turns of
    #: the device's path and hybrid's), and why not on the
    #: device where that was asked ("no-op", "not-pinned", "repacked", "tensors", "gate", "off")
    serve: str = "host"
    serve_reason: str = ""
    #: whether the device's slots are one bank for its layers ("on"; in hybrid mode, for the layers that
    #: run copy mode) or a pool per layer ("off"), and why not where a bank was asked for ("hybrid",
    #: "gate", "serve", "layout", "one-layer", "size")
    bank: str = "off"
    bank_reason: str = ""


@dataclass(frozen=True)
class PoolCounters:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    copy_bytes: int = 0
    steps: int = 0
    bypassed_steps: int = 0
    gated_steps: int = 0     # steps (per layer, as lookups) the closed gate sent to the stock path
    gate_closures: int = 0
    device_experts: int = 0  # expert computations on the device (copy mode: every lookup)
    cpu_experts: int = 0     # hybrid mode: expert computations on the CPU (the misses not placed)
    uploads: int = 0         # experts uploaded into slots (copy_bytes are their bytes)
    deferred: int = 0        # hybrid mode: admitted experts whose upload waited for the budget
    syncs: int = 0           # times the host waited for a device in the steps that used the pool
    tokens: int = 0          # tokens of those steps
    #: lookups and hits by micro-batch size, in the order of BATCH_CLASSES
    batch_lookups: tuple[int, ...] = (0, 0, 0, 0)
    batch_hits: tuple[int, ...] = (0, 0, 0, 0)
    #: offloaded stock-path batches (prefill): used experts' bytes copied from the slots / from the host
    prefill_device_bytes: int = 0
    prefill_host_bytes: int = 0
    #: host time (us) blocked inside the device API in the pool's ops, and hybrid stream uploads
    #: queued but not yet in the slot table (a level, not a count)
    block_us: int = 0
    uploads_in_flight: int = 0
    #: gate "auto": decode steps run on the stock path because they were not slower there, and times
    #: the pool was stood down after it had been the faster side (per context)
    stood_down_steps: int = 0
    stand_downs: int = 0
    #: hybrid mode: misses uploaded in their own step for the device to compute (placement "cost";
    #: counted in uploads and device_experts, not in cpu_experts)
    placed: int = 0
    #: hybrid mode, prefetch: distinct experts predicted for steps, how many of them those steps
    #: selected, and what those steps selected; experts uploaded ahead (counted in uploads), the ones
    #: their step computed on the device (counted in hits), and the bytes of those it did not select
    predicted: int = 0
    predicted_used: int = 0
    predicted_lookups: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0
    prefetch_wasted_bytes: int = 0
    #: hybrid mode: steps the pool served that carried a fill's uploads (a pool holding every expert
    #: taking the ones no step asked for, a warm start); -mec auto does not time them
    fill_steps: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def prefetch_precision(self) -> float:
        """Of the experts predicted for a step, the share it selected."""
        return self.predicted_used / self.predicted if self.predicted else 0.0

    @property
    def prefetch_recall(self) -> float:
        """Of the experts steps with a prediction selected, the share it named."""
        return self.predicted_used / self.predicted_lookups if self.predicted_lookups else 0.0

    @property
    def syncs_per_token(self) -> float:
        return self.syncs / self.tokens if self.tokens else 0.0

    @property
    def block_us_per_token(self) -> float:
        return self.block_us / self.tokens if self.tokens else 0.0

    def by_batch(self) -> dict[str, dict[str, float]]:
        """Lookups, hits, misses and hit rate per micro-batch size class (the classes that saw lookups)."""
        return {name: {"lookups": n, "hits": h, "misses": n - h, "hit_rate": h / n}
                for name, n, h in zip(BATCH_CLASSES, self.batch_lookups, self.batch_hits) if n}

    def to_json(self) -> dict:
        data = asdict(self)
        del data["batch_lookups"], data["batch_hits"]
        return {**data, "hit_rate": self.hit_rate, "syncs_per_token": self.syncs_per_token,
                "prefetch_precision": self.prefetch_precision, "prefetch_recall": self.prefetch_recall,
                "block_us_per_token": self.block_us_per_token,
                "by_batch": self.by_batch()}


@dataclass(frozen=True)
class PoolInfo:
    index: int
    layer: int
    device: int
    slots: int
    n_expert: int
    tensor: str
    slot_bytes: int
    slots_alloc: int   # slots allocated on the device: `slots` plus never-used padding
    from_file: bool    # the host copy is repacked for the CPU: misses are read from the model file
    mode: str = "copy"  # the mode this pool's layer runs: "copy" or "hybrid"
    reason: str = ""    # why it runs copy mode where hybrid was asked for ("weight-before-ffn", ...)


@dataclass(frozen=True)
class MemoryRow:
    buffer_type: str
    device: str
    model: int
    context: int
    compute: int
    pool: int


@dataclass
class PoolReport:
    """Everything the pool says about one context."""
    status: PoolStatus
    devices: list[PoolStatus] = field(default_factory=list)
    counters: PoolCounters = field(default_factory=PoolCounters)
    pools: list[PoolInfo] = field(default_factory=list)
    pool_counters: list[PoolCounters] = field(default_factory=list)


def _status_from_c(ffi, s) -> PoolStatus:
    return PoolStatus(
        enabled=bool(s.enabled), reason=ffi.string(s.reason).decode() if s.reason else "",
        device=ffi.string(s.device).decode() if s.device else "", requested_slots=s.requested_slots,
        actual_slots=s.actual_slots, pool_count=s.pool_count, bytes=s.bytes, cap=s.cap, ceiling=s.ceiling,
        limited_by=LIMITS[s.limited_by] if 0 <= s.limited_by < len(LIMITS) else str(s.limited_by),
        alloc="weighted" if s.weighted else "uniform",
        profile=ffi.string(s.profile).decode() if s.profile else "none", slots_min=s.slots_min,
        slots_med=s.slots_med, slots_max=s.slots_max, total_slots=s.total_slots,
        policy=ffi.string(s.policy).decode() if s.policy else DEFAULT_POLICY,
        gate=ffi.string(s.gate).decode() if s.gate else "off",
        mode=ffi.string(s.mode).decode() if s.mode else "hybrid",
        uploads=ffi.string(s.uploads).decode() if s.uploads else "inline",
        prefetch=ffi.string(s.prefetch).decode() if s.prefetch else "off",
        experts=ffi.string(s.experts).decode() if s.experts else "mapped",
        experts_reason=ffi.string(s.experts_reason).decode() if s.experts_reason else "",
        gather_threads=s.gather_threads,
        serve=ffi.string(s.serve).decode() if s.serve else "host",
        serve_reason=ffi.string(s.serve_reason).decode() if s.serve_reason else "",
        bank=ffi.string(s.bank).decode() if s.bank else "off",
        bank_reason=ffi.string(s.bank_reason).decode() if s.bank_reason else "")


def _counters_from_c(c) -> PoolCounters:
    return PoolCounters(c.lookups, c.hits, c.misses, c.evictions, c.copy_bytes, c.steps, c.bypassed_steps,
                        c.gated_steps, c.gate_closures, c.device_experts, c.cpu_experts, c.uploads, c.deferred,
                        c.syncs, c.tokens, tuple(c.batch_lookups), tuple(c.batch_hits), c.prefill_device_bytes,
                        c.prefill_host_bytes, c.block_us, c.uploads_in_flight, c.stood_down_steps,
                        c.stand_downs, c.placed, c.predicted, c.predicted_used, c.predicted_lookups,
                        c.prefetched, c.prefetch_hits, c.prefetch_wasted_bytes, c.fill_steps)


def status(ctx_handle, device: int = -1) -> PoolStatus:
    ffi, lib, _ = _ffi.load()
    out = ffi.new("struct llama_moe_pool_status *")
    if lib.llama_moe_pool_get_status(ctx_handle, device, out) != 0:
        raise PyllamapoolError(f"no pool status for device {device}")
    return _status_from_c(ffi, out)


def device_statuses(ctx_handle) -> list[PoolStatus]:
    _, lib, _ = _ffi.load()
    return [status(ctx_handle, i) for i in range(lib.llama_moe_pool_n_devices(ctx_handle))]


def counters(ctx_handle, pool: int = -1) -> PoolCounters:
    ffi, lib, _ = _ffi.load()
    out = ffi.new("struct llama_moe_pool_counters *")
    if lib.llama_moe_pool_get_counters(ctx_handle, pool, out) != 0:
        raise PyllamapoolError(f"no pool {pool}")
    return _counters_from_c(out)


def reset_counters(ctx_handle) -> None:
    _, lib, _ = _ffi.load()
    lib.llama_moe_pool_reset_counters(ctx_handle)


def pools(ctx_handle) -> list[PoolInfo]:
    ffi, lib, _ = _ffi.load()
    out = ffi.new("struct llama_moe_pool_info *")
    result = []
    for i in range(lib.llama_moe_pool_n_pools(ctx_handle)):
        lib.llama_moe_pool_get_info(ctx_handle, i, out)
        result.append(PoolInfo(i, out.layer, out.device, out.slots, out.n_expert,
                               ffi.string(out.tensor).decode(), out.slot_bytes, out.slots_alloc,
                               bool(out.from_file), ffi.string(out.mode).decode(),
                               ffi.string(out.reason).decode()))
    return result


def report(ctx_handle, per_pool: bool = False) -> PoolReport:
    infos = pools(ctx_handle) if per_pool else []
    return PoolReport(status(ctx_handle), device_statuses(ctx_handle), counters(ctx_handle), infos,
                      [counters(ctx_handle, p.index) for p in infos])


def memory(ctx_handle) -> list[MemoryRow]:
    ffi, lib, _ = _ffi.load()
    n = lib.llama_moe_pool_memory_breakdown(ctx_handle, ffi.NULL, 0)
    rows = ffi.new("struct llama_moe_pool_memory[]", max(n, 1))
    n = lib.llama_moe_pool_memory_breakdown(ctx_handle, rows, n)
    return [MemoryRow(ffi.string(r.buffer_type).decode(), ffi.string(r.device).decode(), r.model,
                      r.context, r.compute, r.pool) for r in rows[0:n]]


class Policy:
    """The product's slot policy on its own (the same C++ the pool runs), for trace replay."""

    def __init__(self, n_expert: int, n_slots: int, policy: str | int = DEFAULT_POLICY, gate: bool = False):
        ffi, lib = _ffi.replay()
        kind = policy_kind(policy)
        handle = lib.llama_moe_pool_policy_init(n_expert, n_slots, kind)
        if handle == ffi.NULL:
            raise PoolConfigError(f"invalid policy: {n_expert} experts, {n_slots} slots, policy {policy!r}")
        self.handle = ffi.gc(handle, lib.llama_moe_pool_policy_free)
        self.n_expert, self.n_slots, self.gated = n_expert, n_slots, gate
        if gate:
            lib.llama_moe_pool_policy_enable_gate(self.handle)

    def admits(self) -> bool:
        """Whether the admission gate lets the next step use the pool (always, without a gate)."""
        _, lib = _ffi.replay()
        return bool(lib.llama_moe_pool_policy_admits(self.handle))

    def skip(self) -> None:
        """The next step ran the stock path because the gate was closed."""
        _, lib = _ffi.replay()
        lib.llama_moe_pool_policy_skip(self.handle)

    def feed(self, ids: Sequence[int]) -> list[bool] | None:
        """One step as the pool runs it: through the gate (when enabled), then the policy. The miss
        mask, or None when the closed gate sent the step to the stock path."""
        if self.gated and not self.admits():
            self.skip()
            return None
        step = self.step(ids)
        if step is None:
            raise ValueError(f"a step of {len(set(ids))} distinct experts does not fit {self.n_slots} slots")
        return step[1]

    def step(self, ids: Sequence[int]) -> tuple[list[int], list[bool]] | None:
        """(slots, missed) for one step's ids, or None if they do not fit the slots."""
        ffi, lib = _ffi.replay()
        n = len(ids)
        c_ids = ffi.new("int32_t[]", list(ids))
        slots = ffi.new("int32_t[]", max(n, 1))
        miss = ffi.new("uint8_t[]", max(n, 1))
        if lib.llama_moe_pool_policy_step(self.handle, c_ids, n, slots, miss) < 0:
            return None
        return list(slots[0:n]), [bool(m) for m in miss[0:n]]

    def counters(self) -> PoolCounters:
        ffi, lib = _ffi.replay()
        out = ffi.new("struct llama_moe_pool_counters *")
        lib.llama_moe_pool_policy_counters(self.handle, out)
        return _counters_from_c(out)

    def freq_led_steps(self) -> int:
        """Steps whose victims were chosen by use count, not recency (adaptive only)."""
        _, lib = _ffi.replay()
        return lib.llama_moe_pool_policy_freq_led_steps(self.handle)
