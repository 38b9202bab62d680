#!/usr/bin/env python3
"""The GPU check: the device-side path, hybrid, copy, stock --n-cpu-moe and llama.cpp's own expert
cache, timed side by side in one process on a real card at a real model's shape, within one GPU lease.

    python benchmarks/gpu_check.py plan                                # the dry run: steps and seconds
    python benchmarks/gpu_check.py build --target cuda --arch 90       # ~230-270 s on 16 cores (FA off)
    python benchmarks/gpu_check.py run --out gpu-check.json            # stops at --deadline-s
    python benchmarks/gpu_check.py predict gpu-check.json              # predictions beside a finished run's rows

`run` writes a Qwen3-30B-A3B-shaped model (48 MoE layers x 128 experts, top-8, 2048 x 768, 16 GB of
Q4_K experts, written as random valid blocks at disk speed; `--geometry` also takes the small shapes),
then runs its steps in order of importance, each only if it fits before the deadline (a step of
several runs starts when its first fits, and stops at the deadline), and a step that fails is recorded
and the next one runs. Every row is one fresh context decoding `--tokens` teacher-forced tokens, timed
token to token (the logits read included): its rate over the whole run, the cold rate over the first
quarter and the warm rate over the last half (a cache fills in the first tokens, so the warm rate is
its steady state), host waits per token (the scheduler's count, for every design), and where a pool's
misses were read from (experts=) and who served its steps (serve=).

 1. upload         host -> device: pageable, pinned, and pageable pages pinned in place; one small copy
 2. first-card     stock, then the device's path, copy and hybrid (the host serving) at each -mec on an
                   emulated 16 GB card, on the default load (mapped experts, pinned in place where the
                   device offers that); then the device's path over one bank for the layers
                   (LLAMA_MOE_POOL_BANK=on) at the same -mec
 3. upstream-first llama.cpp's --moe-cache-mib at each copy pool's device bytes (equal memory)
 4. loads-first    the same designs on the other loads: mapped pages left pageable (pin off), and
                   pinned host memory (-lm none, llama.cpp's cache too)
 5. requests-first the default load's designs on a stream of short requests with topic switches
 6. auto-first     -mec auto on the first card (sized by itself, standing down where stock is faster)
 7. other-cards    the device's path, hybrid, copy, upstream's cache and -mec auto on the other cards
 8. hybrid-rules   hybrid without prefetch, and with the CPU computing every miss (the largest -mec)
 9. resident       every expert on the device: stock, copy and hybrid at full residency (fixed costs)
10. parity         copy and the device's path vs the stock host-copy path / the all-resident run, bit
                   for bit; hybrid vs stock within the bound
11. parity-types   every expert type on the tiny shape, again with CUDA fusion off where one differs
12. cxx-runtime    a child that loads a model without the binding's system-libstdc++-first rule

then `pyllamapool predict` with the profile this run measured beside every measured row. It writes the
JSON (schema pyllamapool.gpu-check/3) after every step, so a run cut short keeps what it measured, and
a Markdown table beside it.

    python benchmarks/gpu_check.py run --testbed --geometry tiny       # CPU only: the loopback RPC device

The testbed mode runs the same steps on the RPC device (CI runs it); its timings are loopback copies on
shared cores, not a GPU, and RPC cannot read host memory in place (the host serves every step there).
Emulated cards are LLAMA_MOE_POOL_DEVICE_MIB.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PREFIX = ROOT / "build" / "gpu-check"
SCHEMA = "pyllamapool.gpu-check/3"
from pyllamapool.terminal import table_console  # noqa: E402

PLAN_PROFILE = ROOT / "benchmarks" / "results" / "gpu-check-h200-small.json"
#: measured on the H200 lease of 2026-11: `gpu_check.py build --target cuda --arch 90`, 16 cores
CUDA_BUILD_S = 266.0
#: a lease's device time, and what one command may take
LEASE_S, COMMAND_S = 15 * 60, 10 * 60
PROMPT = 8
ROUTING_PRESET = "qwen3-30b-a3b"


# --------------------------------------------------------------------------------------------
# what one decode run costs: the dry run's estimates, and the deadline's


@dataclass
class Estimator:
    """Seconds per step from `pyllamapool predict`'s cost model and a profile, plus fixed costs per
    context and per model load. On a GPU these are guesses until a run has measured them; each step's
    measured seconds sit beside its estimate in the report."""
    spec: object
    profile: object
    tokens: int
    testbed: bool
    generate_s_per_gb: float = 1.0
    _ms: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from pyllamapool.lab import predict as P

        s = self.spec
        self.expert_bytes = P._expert_bytes_of_spec(s.__dict__)
        attn = s.n_layer * (2 * s.n_embd * s.n_embd + 2 * s.n_embd * (s.n_embd // s.n_head * s.n_head_kv)) * 2
        self.dense_bytes = attn + 2 * s.n_vocab * s.n_embd * 2 + s.n_layer * s.n_expert * s.n_embd * 4
        self.expert_total = self.expert_bytes * s.n_expert * s.n_layer
        self.geometry = P.Geometry("plan", n_host_layers=s.n_layer, n_expert=s.n_expert, top_k=s.n_expert_used,
                                   expert_bytes=self.expert_bytes,
                                   dense_ms=self.dense_bytes / self.profile.device_gb_s * 1e-6
                                   + s.n_layer * P.BLOCK_OVERHEAD_MS)
        self.routing = P.Routing.from_preset(ROUTING_PRESET, 0, n_expert=s.n_expert, top_k=s.n_expert_used,
                                             n_tokens=300)
        self.context_s = 0.3 if self.testbed else 1.0   # context, KV cache and pool allocation, warm-up

    def ms_per_token(self, mode: str, mec: int = 0) -> float:
        from pyllamapool.lab import predict as P

        if mode == "auto":  # the faster of stock and the pool, plus probing: at most about stock's time
            return 1.1 * self.ms_per_token("stock")
        if mode.endswith("-resident"):  # a pool holding every expert: nothing misses after warm-up
            mode, mec = mode.removesuffix("-resident"), self.spec.n_expert
        key = (mode, mec)
        if key not in self._ms:
            # the bank's bytes are the lab's to say (policy-lab.md); it is timed as the device's path
            modes = {"upstream": "merged-lru", "resident": "stock", "bank": "device"}.get(mode, mode)
            g = self.geometry
            if mode == "resident":  # every expert on the device: no host layers
                g = P.Geometry("plan", 0, g.n_expert, g.top_k, g.expert_bytes,
                               g.dense_ms + g.n_host_layers * g.top_k * self.expert_bytes / self.profile.device_gb_s * 1e-6)
            self._ms[key] = P.predict(g, self.profile, self.routing, mec if mode != "resident" else 0,
                                      modes=(modes,))[0].ms_per_token
        return self._ms[key]

    def run_s(self, mode: str, mec: int = 0) -> float:
        ms = self.ms_per_token(mode, mec)
        prefill = 4 * self.ms_per_token("stock")  # an 8-token prompt on the stock path
        return self.context_s + (self.tokens * ms + prefill) / 1000.0

    def load_s(self, resident: bool = False) -> float:
        on_device = self.dense_bytes + (self.expert_total if resident else 0)
        # the host side reads (and, for repacked types, rewrites) the experts: page cache speed
        on_host = 0 if resident else self.expert_total / 4e9
        return 1.0 + on_device / (self.profile.pageable_gb_s * 1e9) + on_host

    def generate_s(self) -> float:
        return (self.expert_total + self.dense_bytes) / 1e9 * self.generate_s_per_gb

    def child_s(self, runs: int) -> float:
        """A child process (parity): start, backend init, a small model's load and its runs."""
        return (3.0 if not self.testbed else 1.5) + runs * 1.5


# --------------------------------------------------------------------------------------------
# the steps


@dataclass
class Step:
    name: str
    title: str
    estimate: Callable[["Check"], float]
    run: Callable[["Check"], None]
    #: the step checks the deadline before each of its runs, so it starts whenever its first fits
    per_run: bool = True


class DeadlineReached(Exception):
    pass


#: the designs a row can be: the stock path, the pool served by the device (its own path) or by the
#: host (copy, hybrid), llama.cpp's cache, and -mec auto
DESIGNS = ("stock", "device", "copy", "hybrid", "upstream", "auto", "bank")
#: where the experts are: mapped from the file and pinned in place where the device offers that (the
#: default load), mapped and left pageable (pin off), or in pinned host memory (-lm none)
LOADS = ("default", "mapped", "pinned")
#: the token streams: one continuous topic stream, and short requests with a topic switch each
STREAMS = ("topics", "requests")
REQUEST_TOKENS = 64   # a request: a prompt of PROMPT tokens, then this many teacher-forced tokens


class Check:
    """One run of the check: the model, the sessions, the report, the clock."""

    def __init__(self, args, console) -> None:
        from pyllamapool.run.fullsize import shape

        self.args, self.console = args, console
        self.t0 = time.perf_counter()
        self.spec = shape(args.geometry)
        self.rows: list[dict] = []
        self.report: dict = {"schema": SCHEMA, "geometry": args.geometry, "spec": self.spec.__dict__,
                             "tokens": args.tokens, "testbed": args.testbed, "deadline_s": args.deadline_s,
                             "rows": self.rows, "steps": []}
        self.est: Estimator | None = None
        self.stack = ExitStack()
        self.rpc: tuple[str, ...] = ()
        self._sessions: dict[str, object] = {}
        self.pool_bytes: dict[tuple[int, int], int] = {}
        self.streams: dict[str, list[tuple[list[int], list[int]]]] = {}

    # the clock
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fits(self, seconds: float) -> bool:
        return self.elapsed() + seconds <= self.args.deadline_s

    # sessions, loaded on first use and kept for the run
    def session(self, kind: str):
        from pyllamapool.run.offload import Offload
        from pyllamapool.run.session import PoolSession

        if kind not in self._sessions:
            offload = {"offloaded": Offload(rpc=self.rpc, cpu_moe=True, n_ctx=2048),
                       # -lm none: the experts in the device's pinned host memory (llama.cpp's --no-mmap)
                       "pinned": Offload(rpc=self.rpc, cpu_moe=True, n_ctx=2048, use_mmap=False),
                       # upstream's cache caches only experts in plain host buffers: where the CPU
                       # repacks the type it runs on a --no-repack load, as its users must
                       "unrepacked": Offload(rpc=self.rpc, cpu_moe=True, n_ctx=2048, repack=False),
                       "resident": Offload(rpc=self.rpc, n_ctx=2048)}[kind]
            # never two copies of the experts on the device, nor two in host memory beside the mapping
            for other in [k for k in self._sessions if k != kind and (k in ("resident", "pinned") or
                                                                      kind in ("resident", "pinned"))]:
                self._sessions.pop(other).close()
            self._sessions[kind] = PoolSession(self.model_path, offload)
        return self._sessions[kind]

    def close(self) -> None:
        for s in self._sessions.values():
            s.close()
        self._sessions.clear()
        self.stack.close()

    # one decode run -> one row
    def decode(self, step: str, design: str, kind: str = "offloaded", mec: int = 0, card: int | None = None,
               pool=None, moe_cache_mib: int = 0, load: str = "default", stream: str = "topics",
               label: str | None = None) -> dict | None:
        from pyllamapool.binding import logs

        label = label or design
        est = self.est.run_s(design if design != "upstream" else "upstream", mec) + \
            (self.est.load_s(kind == "resident") if kind not in self._sessions else 0)
        if not self.fits(est):
            self.rows.append({"step": step, "mode": label, "design": design, "load": load, "stream": stream,
                              "card_mib": card, "slots": mec, "mec": mec, "skipped": "deadline", "est_s": round(est, 1)})
            raise DeadlineReached
        t = time.perf_counter()
        session = self.session(kind)
        with logs.capture() as lines:
            if stream == "requests":
                run = session.run_requests(self.streams["requests"], pool=pool, moe_cache_mib=moe_cache_mib)
            else:
                (prompt, teacher), = self.streams["topics"]
                run = session.run(prompt, 0, pool=pool, teacher_tokens=teacher, moe_cache_mib=moe_cache_mib)
        n = len(run.decode.step_latency_ms)
        row = (upstream_row(run, n, card, moe_cache_mib, mec) if moe_cache_mib
               else decode_row(label, run, n, card))
        if moe_cache_mib and run.moe_cache is None and kind == "offloaded":
            return None  # upstream's cache refused the repacked experts: the caller retries unrepacked
        # CUDA graphs: ggml-cuda says at debug level when it captures one and each time it reuses it
        graph_lines = [text for _, text in lines if "CUDA Graph" in text or "CUDA graph" in text]
        row.update(step=step, design=design, load=load, stream=stream, est_s=round(est, 1),
                   wall_s=round(time.perf_counter() - t, 1), mec=mec,
                   cold_tps=run.decode.tokens_per_s(0, max(1, n // 4)), warm_tps=run.decode.tokens_per_s(n // 2),
                   host_waits_per_token=run.decode.host_waits_per_token(),
                   cuda_graphs_reused=sum("reused" in text for text in graph_lines))
        self.rows.append(row)
        self.console.print(f"  {step}: {label}{'' if not mec else f' -mec {mec}'}{'' if not card else f' card {card} MiB'}"
                           f" [{load}, {stream}]: {row['decode_tps']:.1f} t/s (cold {row['cold_tps']:.1f}, warm "
                           f"{row['warm_tps']:.1f}), hit rate {row['hit_rate']:.1%}, {row['host_waits_per_token']:.1f} "
                           f"host waits/token, {row.get('status', '')} ({row.get('limited_by', '')})")
        if design == "copy" and card and load == "default" and stream == "topics":
            self.pool_bytes[(card, mec)] = sum(m.pool for m in run.memory)
        return row

    def write(self) -> None:
        out = Path(self.args.out)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        tmp.replace(out)


def upstream_row(run, n_tokens: int, card_mib: int | None, cache_mib: int, slots: int) -> dict:
    """llama.cpp's own cache: its figures come from its log (hits, misses, MiB uploaded)."""
    st = run.moe_cache
    return {"mode": "upstream", "card_mib": card_mib, "slots": slots, "cache_mib": cache_mib,
            "status": "enabled" if st else "disabled", "reason": "" if st else "no cache in the log",
            "actual_slots": st.slots if st else 0, "limited_by": f"{cache_mib} MiB",
            "decode_tps": run.decode.decode_tokens_per_s, "hit_rate": st.hit_rate if st else 0.0,
            "copy_bytes_per_token": (st.uploaded_mib * 2**20 / max(1, n_tokens)) if st else 0.0,
            "evictions": 0, "cpu_experts": 0, "deferred": 0}


def decode_row(label: str, run, n_tokens: int, card_mib: int | None) -> dict:
    c, s = run.counters, run.status
    return {"mode": label, "card_mib": card_mib, "slots": run.config.slot_list[0] if run.config.slots else 0,
            "status": "enabled" if s.enabled else "disabled", "reason": s.reason, "actual_slots": s.actual_slots,
            "limited_by": s.limited_by, "decode_tps": run.decode.decode_tokens_per_s, "hit_rate": c.hit_rate,
            "copy_bytes_per_token": c.copy_bytes / max(1, n_tokens), "evictions": c.evictions,
            "cpu_experts": c.cpu_experts, "cpu_experts_per_token": c.cpu_experts / max(1, n_tokens),
            "deferred": c.deferred, "pool_syncs_per_token": c.syncs_per_token,
            "uploads": s.uploads if s.enabled else "-", "block_ms_per_token": c.block_us_per_token / 1000.0,
            "experts": s.experts if s.enabled else "-", "serve": s.serve if s.enabled else "-",
            "serve_reason": s.serve_reason if s.enabled else "",
            "bank": s.bank if s.enabled else "-", "bank_reason": s.bank_reason if s.enabled else "",
            # hybrid: misses placed on the device in their step, and prefetch (per token, and its precision)
            "placed_per_token": c.placed / max(1, n_tokens), "prefetched_per_token": c.prefetched / max(1, n_tokens),
            "prefetch_hits_per_token": c.prefetch_hits / max(1, n_tokens),
            "prefetch_precision": c.prefetch_precision, "prefetch_recall": c.prefetch_recall,
            # -mec auto: the share of the pool's steps it ran on the stock path
            "stock_share": c.stood_down_steps / max(1, c.steps + c.stood_down_steps)}


def step_upload(c: Check) -> None:
    from pyllamapool.run.measure import measure_link

    c.report["upload"] = measure_link(c.device.name, mib=c.args.upload_mib)
    c.console.print(f"  upload: {c.report['upload']}")


#: the pool's designs, as PoolConfig settings: the device serving each step, or the host
POOL_DESIGNS = {"device": {"mode": "copy", "serve": "device"}, "copy": {"mode": "copy", "serve": "host"},
                "hybrid": {"mode": "hybrid", "serve": "host"},
                "bank": {"mode": "copy", "serve": "device", "bank": "on"}}
#: the session each load is on, and the pool setting it asks for
LOAD_SESSIONS = {"default": ("offloaded", {}), "mapped": ("offloaded", {"pin": "off"}), "pinned": ("pinned", {})}


def _designs(c: Check, step: str, card: int, designs: tuple[str, ...], load: str = "default",
             stream: str = "topics") -> None:
    from pyllamapool.binding.pool import PoolConfig

    kind, extra = LOAD_SESSIONS[load]
    for mec in c.args.mec:
        for design in designs:
            if design == "upstream":
                _upstream_at(c, step, card, mec, load, stream)
                continue
            c.decode(step, design, kind, mec, card, load=load, stream=stream,
                     pool=PoolConfig(slots=mec, device_mib=card, **POOL_DESIGNS[design], **extra))


def step_card_first(c: Check) -> None:
    c.decode("first-card", "stock", "offloaded")
    _designs(c, "first-card", c.args.card_mib[0], ("device", "copy", "hybrid", "bank"))


def _upstream_at(c: Check, step: str, card: int, mec: int, load: str = "default", stream: str = "topics") -> None:
    """llama.cpp's cache in the device bytes the copy pool took at this -mec on this card. It pins
    nothing it maps, so its default load is the mapped pages."""
    from pyllamapool.binding.moecache import equal_memory_mib

    cache_mib = equal_memory_mib(c.pool_bytes.get((card, mec), 0))
    if cache_mib <= 0:
        return  # the copy pool was not admitted on this card: nothing to match
    kind = "pinned" if load == "pinned" else "offloaded"
    row = c.decode(step, "upstream", kind, mec, card, moe_cache_mib=cache_mib, load=load, stream=stream)
    if row is None:
        row = c.decode(step, "upstream", "unrepacked", mec, card, moe_cache_mib=cache_mib, load=load, stream=stream)
        row["no_repack"] = True


def step_upstream_first(c: Check) -> None:
    for mec in c.args.mec:
        _upstream_at(c, "upstream-first", c.args.card_mib[0], mec)


def step_loads_first(c: Check) -> None:
    """The designs on the loads the default is not: pageable pages (copy and hybrid: the device's path
    needs pinned experts), and pinned host memory (every design, llama.cpp's cache too)."""
    card = c.args.card_mib[0]
    _designs(c, "loads-first", card, ("copy", "hybrid"), load="mapped")
    _designs(c, "loads-first", card, ("device", "copy", "hybrid", "upstream"), load="pinned")


def step_requests_first(c: Check) -> None:
    _designs(c, "requests-first", c.args.card_mib[0], ("device", "copy", "hybrid", "upstream"), stream="requests")


#: hybrid's rules before the default's: (label, placement, prefetch); the label is predict's mode
HYBRID_RULES = (("hybrid-no-prefetch", None, "off"), ("hybrid-cpu", "cpu", "off"))


def step_hybrid_rules(c: Check) -> None:
    """What placement by cost and prefetch each add on this card: the default's first-card runs beside
    hybrid without prefetch and hybrid with the CPU computing every miss."""
    from pyllamapool.binding.pool import PoolConfig

    card = c.args.card_mib[0]
    for mec in c.args.mec[-1:]:  # the largest: where the H200 found prefetch and placement cost the most
        for label, placement, prefetch in HYBRID_RULES:
            c.decode("hybrid-rules", "hybrid", "offloaded", mec, card, label=label,
                     pool=PoolConfig(slots=mec, device_mib=card, mode="hybrid", serve="host", placement=placement,
                                     prefetch=prefetch))


def _auto(c: Check, step: str, card: int) -> None:
    from pyllamapool.binding.pool import PoolConfig

    c.decode(step, "auto", "offloaded", -1, card, pool=PoolConfig(slots="auto", device_mib=card))


def step_auto_first(c: Check) -> None:
    _auto(c, "auto-first", c.args.card_mib[0])


def _resident_fits(c: Check) -> bool:
    return c.args.testbed or c.device.total_bytes > 1.25 * c.model_path.stat().st_size


def step_resident(c: Check) -> None:
    """Each design with every expert on the device: what it costs per layer when nothing misses."""
    from pyllamapool.binding.pool import PoolConfig

    if not _resident_fits(c):
        c.report["resident_skipped"] = "the device does not hold every expert"
        return
    full = c.spec.n_expert
    for design in ("device", "hybrid", "copy"):
        c.decode("resident", design, "offloaded", full, None, label=f"{design}-resident",
                 pool=PoolConfig(slots=full, **POOL_DESIGNS[design]))
    c.decode("resident", "resident", "resident")


def step_card_second(c: Check) -> None:
    for card in c.args.card_mib[1:]:
        _designs(c, "other-cards", card, ("device", "hybrid", "copy", "upstream"))
        _auto(c, "other-cards", card)


def _child(c: Check, *argv: str, **env: str) -> dict:
    """A child's JSON verdict; a child that fails, hangs past the deadline or prints no verdict is a
    failed comparison (never a pass), with what it printed."""
    cmd = [sys.executable, __file__, "child", *argv] + (["--testbed"] if c.args.testbed else [])
    failed = {"bit_identical": False, "within_bound": False}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env},
                           timeout=max(30.0, c.args.deadline_s - c.elapsed()))
    except subprocess.TimeoutExpired as e:
        return {**failed, "error": f"timed out after {e.timeout:.0f} s"}
    if r.returncode != 0:
        return {**failed, "error": (r.stdout + r.stderr)[-2000:], "rc": r.returncode}
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {**failed, "error": "no verdict in the child's output: " + (r.stdout + r.stderr)[-2000:]}


def step_parity(c: Check) -> None:
    """Copy mode against the stock host-copy path (the scheduler copies each expert tensor to the
    device and computes there, even for one token: GGML_OP_OFFLOAD_MIN_BATCH=1, which a backend reads
    when it initialises, hence a child); on the testbed against the all-resident run. Hybrid against
    stock (experts on the CPU), bounded by how far the device's own path is from stock."""
    geometry = c.args.parity_geometry
    logits = Path(c.args.out).with_suffix(".device-logits.npy")
    logits.unlink(missing_ok=True)  # an earlier run's file must never bound this one
    device_side = _child(c, "parity", "--geometry", geometry, "--tokens", str(c.args.tokens),
                         "--side", "device", "--logits", str(logits), GGML_OP_OFFLOAD_MIN_BATCH="1")
    if "error" in device_side:
        host_side = {"within_bound": False, "error": "no device-side logits to bound hybrid with"}
    else:
        host_side = _child(c, "parity", "--geometry", geometry, "--tokens", str(c.args.tokens), "--side", "host",
                           "--logits", str(logits))
    c.report["parity"] = {**device_side, "hybrid": host_side, "geometry": geometry}
    ok = device_side.get("bit_identical")
    served = device_side.get("device_serve", {})
    c.console.print(f"  parity: copy vs {device_side.get('against')}: {'bit-identical' if ok else 'DIFFERS'}; the device's "
                    f"path vs all-resident: {served.get('bit_identical_to_resident', served.get('reason'))}; hybrid "
                    f"vs stock max |dlogit| {host_side.get('hybrid_max_abs_diff')}, bound {host_side.get('bound')}")


def step_parity_types(c: Check) -> None:
    """Every expert type on the tiny shape. A type that differs is run again with the CUDA backend's op
    fusion off. On the H200, F16/F32 experts differed, and were bit-identical with fusion off: the
    scheduler gives every weight it copies a split of its own (so that the copy's memory can be reused),
    so the stock host-copy path can never fuse gate/up MUL_MAT_ID + GLU, while the pool's slots are
    device weights in one split, as every expert is in the all-resident run, and fuse. Where a type
    differs, the child also compares against that all-resident run: the graph the pool's is shaped like."""
    rows = c.report.setdefault("parity_by_type", [])
    for expert_type in c.args.parity_types:
        if not c.fits(c.est.child_s(2)):
            rows.append({"expert_type": expert_type, "skipped": "deadline"})
            raise DeadlineReached
        argv = ("parity", "--geometry", "tiny", "--tokens", str(c.args.tokens), "--side", "device",
                "--expert-type", expert_type)
        row = _child(c, *argv, GGML_OP_OFFLOAD_MIN_BATCH="1")
        row.setdefault("expert_type", expert_type)
        if not row.get("bit_identical") and not c.args.testbed and "error" not in row and c.fits(c.est.child_s(2)):
            row["fusion_off"] = _child(c, *argv, GGML_OP_OFFLOAD_MIN_BATCH="1", GGML_CUDA_DISABLE_FUSION="1")
        rows.append(row)


def step_cxx_runtime(c: Check) -> None:
    """The binding puts the system libstdc++ in the global scope before libllama (a CUDA 13 ggml-cuda
    exported its own copy, and model loading crashed in print_info). This run went through that rule;
    a child without it says whether this machine still needs it."""
    c.report["cxx_runtime"] = {"this_process": cxx_runtime_in_process(),
                               "without_rule": _child(c, "load", PYLLAMAPOOL_CXX_RUNTIME_FIRST="0")}


def cxx_runtime_in_process() -> dict:
    from pyllamapool.binding import _ffi

    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    libs = sorted({line.split()[-1] for line in maps.splitlines() if "libstdc++" in line})
    return {"preloaded": _ffi.CXX_RUNTIME, "mapped": libs}


def step_predict(c: Check) -> None:
    """`pyllamapool predict` with the profile this run measured, beside every measured row."""
    from pyllamapool.lab import predict as P

    if "upload" not in c.report or not any(r["mode"] == "stock" and "decode_tps" in r for r in c.rows):
        return
    stock = next(r for r in c.rows if r["mode"] == "stock" and "decode_tps" in r)
    resident = next((r for r in c.rows if r["mode"] == "resident" and "decode_tps" in r), None)
    if resident:
        # stock's token = the device's own time (the resident run's) + the host experts + one round trip
        # per host layer: the model the prediction calibrates with, so the round trips come out of the gap
        gap_ms = (1000.0 / stock["decode_tps"] - 1000.0 / resident["decode_tps"]
                  - c.spec.n_layer * P.GPU_CHECK_SYNC_US / 1000.0)
        c.report["host_expert_ms"] = max(1e-6, gap_ms) / (c.spec.n_layer * c.spec.n_expert_used)
    try:
        profile = P.HardwareProfile.from_gpu_check_report(c.report, "this run")
    except Exception as e:  # no host cost measured (the resident run did not fit): the plan's profile
        c.report["predict_profile_note"] = str(e)
        profile = c.est.profile
    try:
        g = P.geometry_from_gguf(c.model_path, profile, stock_tps=stock["decode_tps"])
    except P.PyllamapoolError as e:  # the measured figures contradict each other: say so, predict nothing
        c.report["predict_error"] = str(e)
        return
    routing = c.est.routing
    for r in c.rows:
        if "decode_tps" not in r or r["mode"] not in ("stock", "device", "copy", "hybrid", "upstream", "auto",
                                                      *(label for label, _, _ in HYBRID_RULES)) or \
                (r["mode"] != "stock" and r.get("status") == "disabled"):
            continue
        # the link the row's misses crossed: pinned memory, or pages pinned in place (experts=registered;
        # llama.cpp's cache pins what it maps only with -lm none); else pageable pages
        pinned = r.get("experts") in ("pinned", "registered") or (r["mode"] == "upstream" and r.get("load") == "pinned")
        mode = {"upstream": "merged-lru"}.get(r["mode"], r["mode"])
        slots = r["actual_slots"] if mode != "merged-lru" else r["slots"]
        pred = P.predict(g, profile, routing, slots, modes=(mode,), pinned=pinned)[0] if mode != "stock" else None
        r["predicted_tps"] = pred.tokens_per_s if pred else P._tps_at_hit_rate(g, profile, "stock", 0.0, pinned)
        r["predicted_hit_rate"] = pred.hit_rate if pred else 0.0
        if mode in ("copy", "hybrid", "device"):
            r["predicted_tps_at_measured_hits"] = P._tps_at_hit_rate(g, profile, mode, r["hit_rate"], pinned)
        r["prediction_error"] = r["predicted_tps"] / r["decode_tps"] - 1 if r["decode_tps"] else None
    c.report["predict_profile"] = profile.__dict__


def _runs_s(c: Check, designs: tuple[str, ...], cards: int = 1) -> float:
    return sum(c.est.run_s(d, mec) for mec in c.args.mec for d in designs) * cards


STEPS = (
    Step("upload", "host -> device: pageable, pinned, pinned in place; copy latency", lambda c: 3.0, step_upload),
    Step("first-card", "stock, the device's path, copy and hybrid on the first card", lambda c: c.est.run_s("stock")
         + _runs_s(c, ("device", "copy", "hybrid")) + c.est.load_s(), step_card_first),
    Step("upstream-first", "llama.cpp's --moe-cache-mib at equal memory", lambda c: _runs_s(c, ("upstream",)),
         step_upstream_first),
    Step("loads-first", "the designs on pageable pages and on pinned memory (-lm none)", lambda c: _runs_s(
        c, ("copy", "hybrid")) + _runs_s(c, ("device", "copy", "hybrid", "upstream")) + c.est.load_s(), step_loads_first),
    Step("requests-first", "the designs on short requests with topic switches", lambda c: _runs_s(
        c, ("device", "copy", "hybrid", "upstream")) + c.est.load_s(), step_requests_first),
    Step("auto-first", "-mec auto on the first card", lambda c: c.est.run_s("auto"), step_auto_first),
    Step("other-cards", "the other cards", lambda c: (_runs_s(c, ("device", "hybrid", "copy", "upstream"))
         + c.est.run_s("auto")) * (len(c.args.card_mib) - 1), step_card_second),
    Step("hybrid-rules", "hybrid without prefetch, and with every miss on the CPU", lambda c: sum(
        c.est.run_s(label, mec) for mec in c.args.mec[-1:] for label, _, _ in HYBRID_RULES), step_hybrid_rules),
    Step("resident", "every expert on the device, per design", lambda c: 3 * c.est.run_s("copy", c.spec.n_expert)
         + c.est.run_s("resident") + c.est.load_s(True), step_resident),
    Step("parity", "copy and the device's path bit for bit, hybrid within the bound", lambda c: 2 * c.est.child_s(4),
         step_parity, per_run=False),
    Step("parity-types", "every expert type", lambda c: len(c.args.parity_types) * c.est.child_s(2),
         step_parity_types),
    Step("cxx-runtime", "the libstdc++ rule", lambda c: c.est.child_s(1), step_cxx_runtime, per_run=False),
)


# --------------------------------------------------------------------------------------------
# children: parity sides and a bare load, each in a process of its own


def child(args) -> int:
    if not args.testbed and (PREFIX / "pyllamapool" / "lib" / "libllama.so").exists():
        os.environ.setdefault("PYLLAMAPOOL_LIB_DIR", str(PREFIX / "pyllamapool" / "lib"))
    if args.what == "load":
        from pyllamapool.binding.llama import Model
        from pyllamapool.run.testmodel import ModelSpec, cached_model
        m = Model(cached_model(ModelSpec()))
        print(json.dumps({"loaded": True, "n_expert": m.n_expert}))
        m.close()
        return 0
    print(json.dumps(parity(args)))
    return 0


def _parity_model(args):
    from pyllamapool.run.fullsize import cached_fullsize, shape
    from pyllamapool.run.testmodel import ModelSpec, cached_model

    if args.expert_type:  # the tiny shape through llama-quantize: every type, from float weights
        spec = ModelSpec(**{**shape(args.geometry).__dict__, "expert_type": args.expert_type})
        return spec, cached_model(spec)
    spec = shape(args.geometry)
    return spec, cached_fullsize(spec)[0]


def parity(args) -> dict:
    """One side of the parity step. device: copy mode (every slot evicting) against the device's own
    stock path (host-copy offload on a GPU, the all-resident run on the testbed), bit for bit.
    host: hybrid and stock with experts on the CPU; the bound is the device side's distance from stock."""
    import numpy as np

    from pyllamapool.binding.llama import add_rpc_server
    from pyllamapool.run.offload import Offload
    from pyllamapool.binding.pool import PoolConfig
    from pyllamapool.run.rpc import start_rpc_server
    from pyllamapool.run.session import PoolSession
    from pyllamapool.run.testmodel import StreamSpec, token_stream

    spec, model_path = _parity_model(args)
    stream = token_stream(spec, StreamSpec(n_tokens=args.tokens + PROMPT, seed=11))

    def run(session, pool=None):
        return session.run(stream[:PROMPT], 0, pool=pool, teacher_tokens=stream[PROMPT:], keep_logits=True)

    def max_diff(a, b) -> float:
        if len(a) != len(b) or any(np.shape(x) != np.shape(y) for x, y in zip(a, b)):
            raise SystemExit(f"logits of {len(a)} and {len(b)} steps (or of other widths) cannot be compared")
        return float(max(np.max(np.abs(x - y)) for x, y in zip(a, b)))

    heavy = PoolConfig(slots=spec.n_expert_used, mode="copy", device_mib=65536, serve="host")
    # the device's own path at the same slots: the device fetches every miss, every step evicts
    heavy_device = PoolConfig(slots=spec.n_expert_used, mode="copy", device_mib=65536, serve="device")
    with ExitStack() as stack:
        rpc: tuple[str, ...] = ()
        if args.testbed:
            server = stack.enter_context(start_rpc_server())
            rpc = (server.endpoint,)
            add_rpc_server(server.endpoint)
        # the testbed's bit-identity holds with the CPU's plain kernels: a repacked CPU computes the
        # prompt (the stock path's) as stock rounds, which the all-resident run does not; on random
        # Q4_K blocks the two differ where llama-quantize's blocks did not
        repack = not (args.testbed and args.side == "device")
        offloaded = stack.enter_context(PoolSession(model_path, Offload(rpc=rpc, cpu_moe=True, n_ctx=1024,
                                                                        repack=repack)))
        if args.side == "device":
            pooled = run(offloaded, heavy)
            def same(a, b) -> bool:
                return len(a) == len(b) > 0 and all(np.array_equal(x, y) for x, y in zip(a, b))

            def resident():
                return run(stack.enter_context(PoolSession(model_path, Offload(rpc=rpc, n_ctx=1024))))

            reference = resident() if args.testbed else run(offloaded)
            a, b = pooled.decode.logits, reference.decode.logits
            if args.logits:
                np.save(args.logits, np.array(b))
            verdict = {"against": "all-resident (testbed)" if args.testbed else "stock host-copy path on the device",
                       "bit_identical": same(a, b), "max_abs_diff": max_diff(a, b) if len(a) == len(b) else None,
                       "evictions": pooled.counters.evictions, "steps": len(a), "expert_type": spec.expert_type}
            resident_logits = None
            if not args.testbed and not verdict["bit_identical"]:
                # every expert on the device: one split, the fusions the pool's graph gets
                resident_logits = resident().decode.logits
                verdict["bit_identical_to_resident"] = same(a, resident_logits)
            # the device's path reads its slots as copy mode's graph does: bit for bit the all-resident run
            served = run(offloaded, heavy_device)
            if served.status.serve == "device":
                if resident_logits is None:
                    resident_logits = reference.decode.logits if args.testbed else resident().decode.logits
                verdict["device_serve"] = {"bit_identical_to_resident": same(served.decode.logits, resident_logits),
                                           "evictions": served.counters.evictions,
                                           "host_waits_per_token": served.decode.host_waits_per_token()}
            else:
                verdict["device_serve"] = {"serve": served.status.serve, "reason": served.status.serve_reason}
            return verdict
        stock = run(offloaded)
        hybrid = run(offloaded, PoolConfig(slots=max(spec.n_expert_used, spec.n_expert // 4), mode="hybrid",
                                           device_mib=65536))
        device = [x for x in np.load(args.logits)] if args.logits and Path(args.logits).exists() else None
        bound = 2 * max_diff(device, stock.decode.logits) if device is not None else None
        diff = max_diff(hybrid.decode.logits, stock.decode.logits)
        return {"hybrid_max_abs_diff": diff, "device_vs_stock": None if bound is None else bound / 2,
                "bound": bound, "within_bound": bound is not None and diff <= bound,
                "cpu_experts": hybrid.counters.cpu_experts, "device_experts": hybrid.counters.device_experts,
                "rule": "hybrid mixes the CPU's and the device's expert results, so it is at most twice as far "
                        "from stock as the device's own path is (and equal to stock where that is)"}


# --------------------------------------------------------------------------------------------
# plan, run, tables


def plan_profile(args):
    from pyllamapool.lab import predict as P

    if args.testbed:
        return TESTBED_PROFILE()
    return P.parse_profile(args.profile) if args.profile else P.HardwareProfile.from_gpu_check(PLAN_PROFILE)


def TESTBED_PROFILE():
    from pyllamapool.lab.predict import HardwareProfile
    return HardwareProfile("testbed", "loopback RPC on shared cores (an estimate for the deadline only)",
                           pcie_gb_s=1.5, pageable_gb_s=1.5, copy_latency_us=60.0, host_expert_gb_s=4.0,
                           device_gb_s=4.0, sync_us=80.0)


def plan(args, console=None, est: "Estimator | None" = None) -> dict:
    """The dry run's steps and seconds; `est`, a run's own estimator, so its routing is replayed once."""
    from rich.table import Table

    from pyllamapool.run.fullsize import shape

    est = est or Estimator(shape(args.geometry), plan_profile(args), args.tokens, args.testbed)
    fake = Check.__new__(Check)  # only what the estimates read
    fake.args, fake.est, fake.spec = args, est, est.spec
    rows = [("build", "CUDA build (a command of its own)", 0.0 if args.testbed else CUDA_BUILD_S),
            ("generate", f"write the {args.geometry} model ({(est.expert_total + est.dense_bytes) / 1e9:.1f} GB)",
             est.generate_s())]
    for s in STEPS:
        rows.append((s.name, s.title, s.estimate(fake)))
    run_s = sum(r[2] for r in rows[1:])
    steps = [{"step": name, "title": title, "est_s": round(sec, 1)} for name, title, sec in rows]
    out = {"profile": est.profile.name, "geometry": args.geometry, "steps": steps, "run_s": round(run_s, 1),
           "build_s": rows[0][2], "total_s": round(run_s + rows[0][2], 1), "deadline_s": args.deadline_s,
           "fits_deadline": run_s <= args.deadline_s, "lease_s": LEASE_S,
           "fits_lease": run_s + rows[0][2] <= LEASE_S - 60}
    if console is not None:
        table = Table(title=f"GPU check plan: {args.geometry} on {est.profile.description}")
        for col in ("step", "what", "est. s", "cumulative s"):
            table.add_column(col, justify="right" if col.endswith("s") else "left")
        acc = 0.0
        for name, title, sec in rows:
            acc += sec
            table.add_row(name, title, f"{sec:.0f}", f"{acc:.0f}")
        console.print(table)
        console.print(f"run command: {run_s:.0f} s of a {args.deadline_s:.0f} s deadline; with the build "
                      f"{out['total_s']:.0f} s of the lease's {LEASE_S} s (a minute kept for the machine's start "
                      f"and the copies back)" + ("" if out["fits_lease"] else ": [red]does not fit[/red]"))
    return out


def run(args) -> int:
    if not args.testbed and (PREFIX / "pyllamapool" / "lib" / "libllama.so").exists():
        os.environ.setdefault("PYLLAMAPOOL_LIB_DIR", str(PREFIX / "pyllamapool" / "lib"))
    from pyllamapool.run.fullsize import cached_fullsize
    from pyllamapool.binding.llama import add_rpc_server, devices
    from pyllamapool.run.rpc import start_rpc_server
    from pyllamapool.run.session import has_accelerator
    from pyllamapool.run.testmodel import StreamSpec, token_stream

    console = table_console(stderr=True)
    c = Check(args, console)
    c.est = Estimator(c.spec, plan_profile(args), args.tokens, args.testbed)
    c.report["plan"] = plan(args, est=c.est)
    try:
        t = time.perf_counter()
        c.model_path, stats = cached_fullsize(c.spec)
        c.report["generate"] = {"path": str(c.model_path), "bytes": c.model_path.stat().st_size,
                                "seconds": round(time.perf_counter() - t, 2), "cached": stats is None,
                                "s_per_gb": None if stats is None else round(stats.seconds_per_gb, 3)}
        console.print(f"model {c.model_path.name}: {c.model_path.stat().st_size / 1e9:.2f} GB"
                      + ("" if stats is None else f", written in {stats.seconds:.0f} s ({stats.seconds_per_gb:.2f} s/GB)"))
        # the topic stream is another seed than parity's; the requests are as many tokens in all
        topics = token_stream(c.spec, StreamSpec(n_tokens=args.tokens + PROMPT, seed=23))
        c.streams["topics"] = [(topics[:PROMPT], topics[PROMPT:])]
        per = PROMPT + min(REQUEST_TOKENS, args.tokens)
        n_req = max(2, args.tokens // min(REQUEST_TOKENS, args.tokens))
        requests = token_stream(c.spec, StreamSpec(n_tokens=n_req * per, request_length=per, seed=29))
        c.streams["requests"] = [(requests[i:i + PROMPT], requests[i + PROMPT:i + per]) for i in range(0, n_req * per, per)]
        if args.testbed:
            server = c.stack.enter_context(start_rpc_server())
            c.rpc = (server.endpoint,)
            add_rpc_server(server.endpoint)
        elif not has_accelerator():
            console.print("[red]no GPU visible to this build[/red]: build one with `gpu_check.py build`, or use --testbed")
            return 2
        c.device = next(d for d in devices() if d.kind in ("gpu", "igpu")
                        and (args.testbed or not d.name.startswith("RPC")))
        c.report["device"] = {"name": c.device.name, "description": c.device.description,
                              "total_bytes": c.device.total_bytes}
        c.report["cxx_runtime"] = {"this_process": cxx_runtime_in_process()}
        console.print(f"device {c.device.name}: {c.device.description}")
        for s in STEPS:
            est = s.estimate(c)
            entry = {"step": s.name, "est_s": round(est, 1)}
            c.report["steps"].append(entry)
            if not c.fits(est if not s.per_run else min(est, c.est.run_s("stock"))) and s.name != "upload":
                entry["status"] = "skipped: deadline"
                console.print(f"[yellow]{s.name}: skipped, {est:.0f} s would pass the deadline[/yellow]")
                continue
            console.print(f"[bold]{s.name}[/bold]: {s.title} (est. {est:.0f} s)")
            t = time.perf_counter()
            try:
                s.run(c)
                entry["status"] = "done"
            except DeadlineReached:
                entry["status"] = "partial: deadline"
            except Exception as e:  # one step's failure must not cost the lease the steps after it
                entry["status"] = f"error: {type(e).__name__}: {e}"[:500]
                console.print(f"[red]{s.name}: {entry['status']}[/red]")
            entry["wall_s"] = round(time.perf_counter() - t, 1)
            c.write()
        step_predict(c)
    finally:
        c.close()
        c.report["elapsed_s"] = round(c.elapsed(), 1)
        if hasattr(c, "device"):
            c.write()
    markdown = report_markdown(c.report)
    Path(args.out).with_suffix(".md").write_text(markdown)
    print(markdown)
    parity_ok = c.report.get("parity", {}).get("bit_identical", True) and all(
        type_parity(r) in ("=", "skipped", RESIDENT_PARITY) for r in c.report.get("parity_by_type", []))
    hybrid_ok = c.report.get("parity", {}).get("hybrid", {}).get("within_bound", True)
    print(f"written to {args.out} and {Path(args.out).with_suffix('.md')}"
          + (" (testbed: loopback copies on shared cores, not a GPU)" if args.testbed else ""))
    return 0 if parity_ok and hybrid_ok else 1


def repredict(args) -> int:
    """`pyllamapool predict` beside the rows of a finished report, written back into it and its
    Markdown: for a run whose prediction failed, or after the cost model changed. The report's model
    is written here first if it is not cached (its geometry's header is what the prediction reads)."""
    from pyllamapool.run.fullsize import cached_fullsize

    path = Path(args.report)
    report = json.loads(path.read_text())
    if report.get("schema") not in (SCHEMA, "pyllamapool.gpu-check/2"):
        raise SystemExit(f"{path}: not a {SCHEMA} report (schema {report.get('schema')!r})")
    ns = argparse.Namespace(geometry=report["geometry"], tokens=report["tokens"], testbed=report["testbed"],
                            deadline_s=report["deadline_s"], profile=None, out=str(path))
    c = Check(ns, table_console(stderr=True))
    c.report, c.rows = report, report["rows"]
    c.est = Estimator(c.spec, plan_profile(ns), ns.tokens, ns.testbed)
    c.model_path, _ = cached_fullsize(c.spec)
    report.pop("predict_error", None)
    step_predict(c)
    c.write()
    path.with_suffix(".md").write_text(report_markdown(report))
    if "predict_error" in report:
        print(f"no prediction: {report['predict_error']}", file=sys.stderr)
        return 1
    print(f"predictions written to {path} and {path.with_suffix('.md')}")
    return 0


RESIDENT_PARITY = "= resident (host-copy path unfused)"


def type_parity(r: dict) -> str:
    """One expert type's verdict. "=": copy mode is bit-identical to the stock host-copy path.
    "= resident": it differs only where CUDA fuses, is bit-identical with fusion off, and equals the
    all-resident device run with fusion on: the pool computes as the device does with its own experts,
    which the host-copy path, a split per copied weight, cannot fuse."""
    if r.get("skipped"):
        return "skipped"
    if r.get("error"):
        return "ERROR"
    if r.get("bit_identical"):
        return "="
    off = r.get("fusion_off")
    off_verdict = None if not off else "ERROR" if off.get("error") else \
        "=" if off.get("bit_identical") else "still differs"
    if off_verdict == "=" and r.get("bit_identical_to_resident"):
        return RESIDENT_PARITY
    resident = r.get("bit_identical_to_resident")
    return (f"differs ({_f(r.get('max_abs_diff'), '.3g')}" + (f"; fusion off: {off_verdict}" if off else "")
            + ("" if resident is None else f"; vs all-resident: {'=' if resident else 'differs'}") + ")")


def _f(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def report_markdown(report: dict) -> str:
    """The measured rows with the prediction beside each, the steps, parity: Markdown for the README."""
    dev = report.get("device", {})
    rows = [r for r in report["rows"] if "decode_tps" in r]
    stock = next((r["decode_tps"] for r in rows if r["mode"] == "stock"), None)
    lines = [f"GPU check on {dev.get('description', '?')} ({dev.get('name', '?')}), {report['geometry']} shape, "
             f"{report['tokens']} decode tokens per row, timed token to token; cold: the first quarter, warm: the "
             "last half" + (" (testbed: loopback RPC)" if report["testbed"] else ""), "",
             "| step | design | load | stream | served | experts | card MiB | -mec | slots | t/s | cold | warm | "
             "warm x stock | hit rate | CPU experts/token | MiB up/token | host waits/token | CUDA graphs | "
             "predicted t/s | error |",
             "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: | ---: | ---: |"]
    for r in rows:
        why = "" if r.get("status") != "disabled" else f" ({r.get('reason')})"
        served = r.get("serve", "-") + (f" ({r['serve_reason']})" if r.get("serve_reason") else "")
        warm = r.get("warm_tps", r["decode_tps"])
        lines.append(
            f"| {r['step']} | {r['mode']}{why} | {r.get('load', '-')} | {r.get('stream', '-')} | {served} | "
            f"{r.get('experts', '-')} | {r.get('card_mib') or '-'} | {r.get('mec') or '-'} | {r.get('actual_slots', 0)} | "
            f"{r['decode_tps']:.1f} | {_f(r.get('cold_tps'))} | {_f(r.get('warm_tps'))} | "
            f"{_f(warm / stock if stock else None, '.2f')} | {r['hit_rate']:.1%} | "
            f"{_f(r.get('cpu_experts_per_token'))} | {r['copy_bytes_per_token'] / 2**20:.2f} | "
            f"{_f(r.get('host_waits_per_token', r.get('syncs_per_token')))} | {_f(r.get('cuda_graphs_reused'), 'd')} | "
            f"{_f(r.get('predicted_tps'))} | {_f(r.get('prediction_error'), '+.0%')} |")
    skipped = [f"{r['step']} {r['mode']} -mec {r.get('slots')}" for r in report["rows"] if r.get("skipped")]
    lines += ["", "| step | status | est. s | measured s |", "| --- | --- | ---: | ---: |"]
    for s in report["steps"]:
        lines.append(f"| {s['step']} | {s.get('status', '-')} | {s['est_s']:.0f} | {_f(s.get('wall_s'), '.0f')} |")
    up = report.get("upload")
    if up:
        lines += ["", f"upload: {_f(up.get('pageable_gb_s'))} GB/s pageable, {_f(up.get('pinned_gb_s'))} GB/s pinned, "
                      f"{_f(up.get('registered_gb_s'))} GB/s pinned in place (registered at "
                      f"{_f(up.get('register_gb_s'))} GB/s), {up['copy_latency_us_64k']:.0f} us per 64 KiB copy; "
                      f"host cost per CPU expert {_f(report.get('host_expert_ms'), '.3f')} ms"]
    gen = report.get("generate")
    if gen:
        lines.append(f"model: {gen['bytes'] / 1e9:.1f} GB" + (" (cached)" if gen["cached"] else
                                                              f", written at {gen['s_per_gb']:.2f} s/GB"))
    p = report.get("parity")
    if p:
        h = p.get("hybrid", {})
        served = p.get("device_serve", {})
        served_text = ("bit-identical" if served.get("bit_identical_to_resident") else "DIFFERS") \
            if "bit_identical_to_resident" in served else f"not run ({served.get('serve', '?')}: {served.get('reason', '')})"
        lines.append(f"parity ({p.get('geometry')} shape): copy vs {p.get('against')}: "
                     f"{'bit-identical' if p.get('bit_identical') else 'DIFFERS ' + str(p.get('max_abs_diff'))}; "
                     f"the device's path vs all-resident: {served_text}; "
                     f"hybrid vs stock max |dlogit| {_f(h.get('hybrid_max_abs_diff'), '.3g')} (bound "
                     f"{_f(h.get('bound'), '.3g')}: twice the device path's distance from stock)")
    by_type = report.get("parity_by_type")
    if by_type:
        lines.append("parity by expert type (tiny shape): " + ", ".join(f"{r['expert_type']} {type_parity(r)}"
                                                                      for r in by_type))
    cxx = report.get("cxx_runtime", {})
    if cxx.get("this_process"):
        w = cxx.get("without_rule")
        lines.append(f"C++ runtime: {', '.join(cxx['this_process']['mapped']) or 'none mapped'}"
                     + ("" if w is None else f"; a child without the rule: {'loads' if w.get('loaded') else 'FAILS (rc ' + str(w.get('rc')) + ')'}"))
    if skipped:
        lines.append(f"not run (deadline): {', '.join(skipped)}")
    return "\n".join(lines) + "\n"


def build(args) -> int:
    argv = [sys.executable, str(ROOT / "build.py"), "--target", args.target, "--prefix", str(PREFIX),
            "--build-dir", str(ROOT / "build" / f"gpu-check-{args.target}")]
    if args.arch:
        argv += ["--arch", args.arch]
    if args.jobs:
        argv += ["--jobs", str(args.jobs)]
    if args.source:
        argv += ["--source", args.source]
    if args.target == "cuda":
        argv += ["-D", "GGML_CUDA_FA=OFF"]  # the check needs no FlashAttention kernels: half the build
    print("$", " ".join(argv), flush=True)
    return subprocess.call(argv)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers separated by commas") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive whole numbers")
    return values


def main() -> int:
    from pyllamapool.run.fullsize import SHAPES
    from pyllamapool.run.testmodel import EXPERT_TYPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="a trimmed build for this GPU into build/gpu-check")
    b.add_argument("--target", choices=("cuda", "hip", "vulkan"), required=True)
    b.add_argument("--arch")
    b.add_argument("--jobs", type=int)
    b.add_argument("--source", help="a local pristine llama.cpp tree at the pin (machines without network)")
    for name, helptext in (("run", "measure and write the report"), ("plan", "the dry run: steps and their seconds")):
        r = sub.add_parser(name, help=helptext)
        r.add_argument("--testbed", action="store_true", help="the loopback RPC device instead of a GPU (CPU-only CI)")
        r.add_argument("--geometry", choices=list(SHAPES), default=None,
                       help="the model's shape (default qwen3-30b-a3b; tiny with --testbed)")
        r.add_argument("--mec", type=_ints, default=None,
                       help="slots per layer (default: top-k, 1/4 and 1/2 of the experts; all of them is the resident step)")
        r.add_argument("--card-mib", type=_ints, default=[16384, 24576],
                       help="emulated card sizes (LLAMA_MOE_POOL_DEVICE_MIB), the most important first")
        r.add_argument("--tokens", type=int, default=256, help="teacher-forced decode tokens per run (warm: the last half)")
        r.add_argument("--deadline-s", type=float, default=COMMAND_S - 60,
                       help="steps that would end after this many seconds are skipped (default 540)")
        r.add_argument("--profile", help="the hardware profile the plan estimates with (default: the H200's "
                                         "earlier check; a built-in name or a gpu-check JSON)")
        r.add_argument("--upload-mib", type=int, default=256)
        r.add_argument("--out", default="gpu-check.json")
        r.add_argument("--parity-geometry", choices=list(SHAPES), default=None,
                       help="the shape parity runs at (default small; tiny with --testbed)")
        r.add_argument("--parity-types", type=lambda s: [t for t in s.split(",") if t], default=None,
                       help="expert types compared bit for bit on the tiny shape (default: every type the test "
                            "models come in; '' for none)")
        r.add_argument("--json", action="store_true", help=argparse.SUPPRESS if name == "run" else "the plan as JSON")
    pr = sub.add_parser("predict", help="fill in the predictions of a finished report")
    pr.add_argument("report", help="a gpu-check JSON; it and its Markdown are rewritten")
    ch = sub.add_parser("child", help=argparse.SUPPRESS)
    ch.add_argument("what", choices=("parity", "load"))
    ch.add_argument("--testbed", action="store_true")
    ch.add_argument("--geometry", default="tiny")
    ch.add_argument("--tokens", type=int, default=24)
    ch.add_argument("--side", choices=("device", "host"), default="device")
    ch.add_argument("--expert-type")
    ch.add_argument("--logits")
    args = parser.parse_args()
    if args.command == "build":
        return build(args)
    if args.command == "child":
        return child(args)
    if args.command == "predict":
        return repredict(args)
    args.geometry = args.geometry or ("tiny" if args.testbed else "qwen3-30b-a3b")
    args.parity_geometry = args.parity_geometry or ("tiny" if args.testbed else "small")
    if args.parity_types is None:
        args.parity_types = list(EXPERT_TYPES)
    bad = [t for t in args.parity_types if t not in EXPERT_TYPES]
    if bad:
        parser.error(f"--parity-types: unknown {', '.join(bad)}; accepted: {', '.join(EXPERT_TYPES)}")
    if args.tokens < 1:
        parser.error(f"--tokens {args.tokens}: expected at least 1")
    if args.mec is None:
        g = SHAPES[args.geometry]
        args.mec = sorted({g.n_expert_used, g.n_expert // 4, g.n_expert // 2})
    if args.command == "plan":
        result = plan(args, None if args.json else table_console())
        if args.json:
            print(json.dumps(result, indent=1))
        return 0 if result["fits_lease"] else 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
