"""`pyllamapool`: one entry point for building, inspecting, running and tracing."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .errors import PyllamapoolError
from .terminal import table_console, wide

console = table_console()
err_console = table_console(stderr=True)

LAUNCHERS = {"server": "llama-server", "cli": "llama-cli", "bench": "llama-bench",
             "rpc-server": "ggml-rpc-server", "quantize": "llama-quantize"}


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value:g} is outside 0 to 1")
    return value


def add_offload_args(p: argparse.ArgumentParser) -> None:
    """The llama.cpp offload flags, spelled as llama.cpp spells them."""
    p.add_argument("-ngl", "--n-gpu-layers", dest="n_gpu_layers", type=int, default=0,
                   help="layers to offload to the accelerator / RPC device (-1 or 99: all)")
    p.add_argument("--rpc", default="", help="comma-separated RPC servers HOST:PORT")
    p.add_argument("-ncmoe", "--n-cpu-moe", dest="n_cpu_moe", type=_non_negative, default=0,
                   help="keep the routed experts of the first N layers in host memory")
    p.add_argument("-cmoe", "--cpu-moe", dest="cpu_moe", action="store_true",
                   help="keep all routed experts in host memory")
    p.add_argument("-c", "--ctx-size", dest="n_ctx", type=_positive, default=1024)
    p.add_argument("-t", "--threads", dest="n_threads", type=_positive)


def _slots(text: str) -> tuple[int | str, ...]:
    """-mec N or N0,N1,...: slots per offloaded tensor (0 = off, -1 = as many as fit, auto = as many as
    fit and the pool stands down where decode is faster without it)."""
    from .binding.pool import AUTO
    parts = [v.strip() for v in text.split(",")]
    try:
        values = [v if v == AUTO else int(v) for v in parts]
    except ValueError:
        values = []
    if not values or any(v != AUTO and v < -1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: slots must be whole numbers >= 0 (0 = pool off), -1 "
                                         "(as many as the ledger allows) or auto")
    return tuple(values)


def _mib(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} MiB is invalid: it must be 1 or more")
    return value


def _mib_list(text: str) -> tuple[int, ...]:
    return tuple(_mib(v) for v in text.split(","))


def _choices(kind: str, allowed) -> "callable":
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(","))
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not a {kind}: expected {', '.join(allowed)}")
        return values
    return parse


def _existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return text


def add_pool_args(p: argparse.ArgumentParser, sweepable: bool = False) -> None:
    if sweepable:
        p.add_argument("--slots", "-mec", "--moe-expert-cache", dest="slots", type=_slots, default=(0, 8, 16),
                       help="slot counts to sweep, e.g. 0,8,16,auto (0 = pool off)")
        p.add_argument("--rail-mib", type=_mib_list, default=(None,), help="rails to sweep (MiB)")
        p.add_argument("--cap-mib", type=_mib_list, default=(None,), help="caps to sweep (MiB)")
        p.add_argument("--profile", type=_existing_file, action="append", default=None,
                       help="profile file(s) to sweep (blk.<layer> <weight> lines)")
    else:
        p.add_argument("-mec", "--moe-expert-cache", dest="slots", type=_slots, default=(0,),
                       help="expert pool slots per offloaded tensor (N or N0,N1,...; 0 = off, -1 = as many as fit; "
                            "auto = as many as fit, standing down where decode is faster without the pool)")
        p.add_argument("--rail-mib", type=_mib, help="VRAM held back from the pool (default 2879, floor 1024)")
        p.add_argument("--cap-mib", type=_mib, help="absolute cap on pool bytes (MiB)")
        p.add_argument("--profile", type=_existing_file, help="per-layer weights file (blk.<layer> <weight>)")
        p.add_argument("--hotset", metavar="FILE",
                       help="hot set file: start with the experts an earlier run used most, and write this "
                            "run's back at exit (LLAMA_MOE_POOL_HOTSET)")
        p.add_argument("--prefetch", choices=("auto", "off", "on"),
                       help="hybrid mode: upload the next layer's predicted experts ahead of its step: auto "
                            "(default: where uploads run beside compute, as many as the link carries in time), "
                            "off, or on (LLAMA_MOE_POOL_PREFETCH)")
    from .binding.pool import GATES, MODES, POLICY_KINDS
    several = " (comma-separated values are swept)" if sweepable else ""
    p.add_argument("--policy", type=_choices("policy", list(POLICY_KINDS)), default=(None,),
                   help=f"slot policy: adaptive (default) or lru{several}")
    p.add_argument("--gate", type=_choices("gate", list(GATES)), default=(None,),
                   help="admission gate: off (default); yield, where a layer whose pool copies more than it "
                        "serves runs the stock path for a while; or auto (what -mec auto sets), where timed "
                        f"decode steps decide whether the pool runs at all{several}")
    p.add_argument("--mode", "--moe-pool-mode", dest="mode", type=_choices("mode", list(MODES)), default=(None,),
                   help="hybrid (default: the device computes the experts it holds, the CPU the misses) or copy (a "
                        f"miss is copied to a slot before the matmul){several}")
    p.add_argument("--upload-frac", type=float,
                   help="hybrid mode's upload budget: share of a token's time (default 0.25); uploads only "
                        "experts that pay back. 0 = no budget, every miss uploaded")
    p.add_argument("--device-mib", type=_mib_list,
                   help="treat the device(s) as this big (MiB; N or N0,N1,...)")


def _device_mib(args):
    if args.device_mib is None:
        return None
    return args.device_mib[0] if len(args.device_mib) == 1 else args.device_mib


def _pool_config(args):
    from .binding.pool import PoolConfig
    slots = args.slots[0] if len(args.slots) == 1 else args.slots
    if len(args.policy) > 1 or len(args.gate) > 1 or len(args.mode) > 1:
        raise PyllamapoolError("--policy, --gate and --mode take one value here (lists are for `sweep`)")
    return PoolConfig(slots=slots, rail_mib=args.rail_mib, cap_mib=args.cap_mib, device_mib=_device_mib(args),
                      profile=args.profile, policy=args.policy[0], gate=args.gate[0], mode=args.mode[0],
                      upload_frac=args.upload_frac, hotset=getattr(args, "hotset", None),
                      prefetch=getattr(args, "prefetch", None))


def _offload(args, **over):
    from .run.offload import Offload
    rpc = tuple(e for e in args.rpc.split(",") if e)
    settings = dict(n_gpu_layers=args.n_gpu_layers, rpc=rpc, n_cpu_moe=args.n_cpu_moe, cpu_moe=args.cpu_moe,
                    n_ctx=args.n_ctx, n_threads=args.n_threads)
    return Offload(**{**settings, **over})


# ---------------------------------------------------------------------------------------------
# commands


def cmd_build(argv: list[str]) -> int:
    from .native.driver import main as driver_main
    return driver_main(argv, prog="pyllamapool build")


def cmd_info(args) -> int:
    from .binding import _ffi
    from .native.manifest import check_current, read_manifest

    try:
        where = _ffi.locate()
    except PyllamapoolError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return 2
    manifest = read_manifest(where.lib_dir) or {}
    if args.json:
        from .binding.llama import devices
        print(json.dumps({"lib_dir": str(where.lib_dir), "manifest": manifest,
                          "devices": [asdict(d) for d in devices()]}, indent=2))
        return 0
    table = Table(title="build manifest", show_header=False)
    table.add_row("libraries", str(where.lib_dir))
    for key, value in manifest.items():
        table.add_row(key, ", ".join(value) if isinstance(value, list) else
                      json.dumps(value) if isinstance(value, dict) else str(value))
    console.print(table)
    stale = check_current(manifest)
    if stale:
        console.print(f"[yellow]warning:[/yellow] {stale}")
    from .binding.llama import devices
    dev_table = Table(title="devices")
    for col in ("#", "name", "description", "type", "free MiB", "total MiB"):
        dev_table.add_column(col)
    for d in devices():
        dev_table.add_row(str(d.index), d.name, d.description, d.kind, f"{d.free_bytes >> 20}",
                          f"{d.total_bytes >> 20}")
    console.print(dev_table)
    return 0


def cmd_make_model(args) -> int:
    from .run.testmodel import ModelSpec, write_model
    spec = ModelSpec(arch=args.arch, n_layer=args.layers, n_embd=args.embd, n_head=args.heads,
                     n_head_kv=args.heads_kv, n_expert=args.experts, n_expert_used=args.top_k,
                     n_ff_exp=args.ff, n_vocab=args.vocab, expert_type=args.type.upper(),
                     n_topics=args.topics, zipf=args.zipf, seed=args.seed)
    path = write_model(spec, Path(args.output))
    console.print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): {spec.arch}, {spec.n_layer} "
                  f"layers, {spec.n_expert} experts top-{spec.n_expert_used}, {spec.expert_type} experts")
    return 0


def _prompt_tokens(args, model) -> list[int]:
    if args.tokens:
        return _int_list(args.tokens)
    if args.prompt is not None:
        return model.tokenize(args.prompt)
    return [1]


def cmd_run(args) -> int:
    from .binding.llama import Sampler
    from .run.session import PoolSession

    pool = _pool_config(args)
    with PoolSession(args.model, _offload(args)) as session:
        prompt = _prompt_tokens(args, session.model)
        teacher = _int_list(args.teacher) if args.teacher else None
        sampler = Sampler(greedy=args.temp <= 0, seed=args.seed, temperature=max(args.temp, 1e-6))
        pooled = session.run(prompt, args.n_predict, pool=pool, teacher_tokens=teacher, sampler=sampler)
    result = pooled.decode
    if args.json:
        print(json.dumps({**result.to_json(), "pool": pooled.to_json()}, indent=2))
        return 0
    for line in pooled.lines:
        console.print(line, soft_wrap=True)
    table = Table(title=f"{Path(args.model).name}: {result.mode}", show_header=False)
    table.add_row("prompt tokens", str(len(result.prompt_tokens)))
    table.add_row("tokens", " ".join(map(str, result.tokens[:64])) + (" ..." if len(result.tokens) > 64 else ""))
    table.add_row("text", result.text[:200])
    table.add_row("prefill t/s", f"{result.prefill_tokens_per_s:.1f}")
    table.add_row("decode t/s", f"{result.decode_tokens_per_s:.1f}")
    if pool.enabled:
        c = pooled.counters
        table.add_row("pool", f"{pooled.status.reason}, hits {c.hits}/{c.lookups} ({c.hit_rate:.1%}), "
                              f"copy_bytes {c.copy_bytes:,}")
    for row in pooled.memory:
        table.add_row(f"memory {row.buffer_type}", f"model {row.model / 2**20:.1f} MiB, context "
                      f"{row.context / 2**20:.1f} MiB (pool {row.pool / 2**20:.1f}), compute {row.compute / 2**20:.1f} MiB")
    console.print(table)
    return 0


def cmd_plan(args) -> int:
    from .lab.plan import plan

    offload = _offload(args, type_k=args.cache_type_k, type_v=args.cache_type_v,
                       flash_attn=True if args.flash_attn == "on" else False if args.flash_attn == "off" else None)
    result = plan(args.model, offload, _pool_config(args))
    if args.json:
        print(json.dumps(result.run.to_json(), indent=2))
        return 0
    for line in result.status_lines:
        console.print(line, soft_wrap=True)
    console.print(result.layer_table())
    for d in result.run.devices:
        why = {"slots": "the request fit", "rail": "device total - rail - memory in use",
               "cap": "--cap-mib / LLAMA_MOE_POOL_CAP_MIB"}[d.limited_by]
        state = f"limited_by={d.limited_by} ({why})" if d.enabled else f"off: reason={d.reason}"
        console.print(f"{d.device}: {d.actual_slots} slots per tensor, {d.bytes / 2**20:.1f} MiB of "
                      f"{d.cap / 2**20:.1f} MiB allowed; {state}")
    return 0


def cmd_sweep(args) -> int:
    from .run.sweep import SweepGrid, plot, run_sweep, sweep_table, write_json
    from .run.testmodel import StreamSpec, spec_of, token_stream

    grid = SweepGrid(slots=args.slots, rail_mib=args.rail_mib, cap_mib=args.cap_mib,
                     profile=tuple(args.profile) if args.profile else (None,), device_mib=_device_mib(args),
                     policy=args.policy, gate=args.gate, mode=args.mode, upload_frac=args.upload_frac)
    spec = spec_of(args.model)
    stream = token_stream(spec, StreamSpec(n_tokens=args.n_tokens + 8, seed=args.seed))
    offload = _offload(args, n_ctx=max(args.n_ctx, args.n_tokens + 16))
    result = run_sweep(args.model, offload, grid, stream[:8], stream[8:], repeats=args.repeats,
                       console=err_console, progress=not args.json)
    if args.predict:
        from .lab.predict import annotate_sweep, parse_profile
        annotate_sweep(result.rows, args.model, parse_profile(args.predict),
                       n_host_layers=None if offload.cpu_moe or not offload.n_cpu_moe else offload.n_cpu_moe)
    if args.json:
        print(write_json(result, None))
    else:
        console.print(sweep_table(result))
    if args.plot:
        err_console.print(f"plot written to {plot(result, Path(args.plot))}")
    return 0


def cmd_predict(args) -> int:
    from .lab import predict as P

    if args.list_profiles:
        if args.json:
            print(json.dumps([asdict(prof) for prof in P.PROFILES.values()], indent=2))
            return 0
        table = Table(title="hardware profiles (pyllamapool predict --profile NAME)")
        for col in ("name", "machine", "link GB/s pinned / pageable", "copy µs", "CPU expert GB/s",
                    "device GB/s", "sync µs"):
            table.add_column(col)
        for prof in P.PROFILES.values():
            table.add_row(prof.name, prof.description, f"{prof.pcie_gb_s:g} / {prof.pageable_gb_s:g}",
                          f"{prof.copy_latency_us:g}", f"{prof.host_expert_gb_s:g}", f"{prof.device_gb_s:g}",
                          f"{prof.sync_us:g}")
        console.print(table)
        return 0
    if args.validate:
        return _print_validation(P.validate(seed=args.seed), args.json)
    if not args.model:
        raise PyllamapoolError("pyllamapool predict needs a model (MODEL.gguf), or --validate / --list-profiles")
    profile = P.parse_profile(args.profile)
    geometry = P.geometry_from_gguf(args.model, profile, n_host_layers=args.host_layers,
                                    stock_tps=args.stock_tps, dense_ms=args.dense_ms)
    if args.trace:
        from .run.trace import Trace
        routing = P.Routing.from_trace(Trace.load(args.trace), f"trace {args.trace}")
        if (routing.n_expert, routing.top_k) != (geometry.n_expert, geometry.top_k):
            raise PyllamapoolError(f"--trace {args.trace}: {routing.n_expert} experts top-{routing.top_k}, the "
                                   f"model has {geometry.n_expert} top-{geometry.top_k}")
    else:
        routing = P.Routing.from_preset(args.preset, args.seed, n_expert=geometry.n_expert, top_k=geometry.top_k)
    rows = [r for slots in args.mec for r in P.predict(geometry, profile, routing, slots,
                                                       upload_frac=args.upload_frac, pinned=not args.pageable,
                                                       prefetch_overlap=args.prefetch_overlap)
            if r.mode != "stock" or slots == args.mec[0]]
    if args.json:
        print(json.dumps({"schema": "pyllamapool.predict/1", "profile": asdict(profile),
                          "geometry": asdict(geometry), "routing": routing.source,
                          "rows": P.as_json(rows)}, indent=2))
        return 0
    console.print(f"{geometry.name}: {geometry.n_host_layers} host-expert layers, {geometry.n_expert} experts "
                  f"top-{geometry.top_k}, {geometry.expert_bytes / 2**20:.2f} MiB per expert, device "
                  f"{geometry.dense_ms:.1f} ms/token; {profile.description}; routing: {routing.source}")
    stock = next(r for r in rows if r.mode == "stock")
    table = Table(title="predicted decode (batch 1), per token")
    for col in ("mode", "-mec", "hit rate", "t/s", "x stock", "ms", "device", "CPU experts", "uploads",
                "syncs", "CPU experts/token", "MiB up/token"):
        table.add_column(col, justify="right")
    for r in rows:
        parts = r.parts_ms
        cpu_ms = parts.get("cpu_experts", parts.get("experts_overlapped", 0.0))
        table.add_row(r.mode, str(r.slots) if r.mode != "stock" else "-", f"{r.hit_rate:.1%}",
                      f"{r.tokens_per_s:.2f}", f"{r.tokens_per_s / stock.tokens_per_s:.2f}", f"{r.ms_per_token:.1f}",
                      f"{parts['device'] + parts.get('device_experts', 0.0):.1f}", f"{cpu_ms:.1f}",
                      f"{parts.get('uploads', 0.0):.1f}", f"{parts['syncs']:.1f}", f"{r.cpu_experts:.0f}",
                      f"{r.upload_mib:.1f}")
    wide(console, 150).print(table)
    console.print("hybrid's CPU column is the slower side of each layer (hits on the device run at the same "
                  "time); its uploads are off the critical path, within --upload-frac of a token")
    for r in rows:
        if r.mode == "hybrid" and r.setting:
            source = "the trace's recorded predictions" if routing.predicted else "predictions drawn at that overlap"
            console.print(f"hybrid -mec {r.slots}: {r.setting}; {source}")
    return 0


def _print_validation(rows, as_json: bool) -> int:
    if as_json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    table = Table(title="pyllamapool predict --validate: published results vs the model")
    for col in ("anchor", "mode", "slots", "measured t/s", "predicted", "error", "hits (preset)",
                "hits needed", "hits published", "predicted at published hits", "error"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.anchor, r.mode, str(r.slots), f"{r.measured_tps:.2f}", f"{r.predicted_tps:.2f}",
                      f"{r.error:+.0%}", f"{r.hit_rate:.1%}",
                      "-" if r.hit_rate_needed is None else f"{r.hit_rate_needed:.1%}",
                      "-" if r.published_hit_rate is None else f"{r.published_hit_rate:.1%}",
                      "-" if r.predicted_tps_at_published_hits is None else f"{r.predicted_tps_at_published_hits:.2f}",
                      "-" if r.error_at_published_hits is None else f"{r.error_at_published_hits:+.0%}")
    wide(console, 170).print(table)
    misses: dict[str, list[str]] = {}
    notes = {r.anchor: r.note for r in rows}
    for r in rows:
        best = r.error if r.error_at_published_hits is None else r.error_at_published_hits
        if abs(best) > 0.20:
            misses.setdefault(r.anchor, []).append(f"{best:+.0%} at {r.slots} slots")
    for anchor, where in misses.items():
        console.print(f"[yellow]{anchor} misses by more than 20% ({', '.join(where)})[/yellow]: {notes[anchor]}")
    return 0


def cmd_measure_host(args) -> int:
    from .run.measure import measure_host

    m = measure_host(args.expert_type, args.n_embd, args.n_ff, threads=args.threads, seconds=args.seconds)
    if args.json:
        print(json.dumps(asdict(m), indent=2))
        return 0
    console.print(f"{m.expert_type} expert of {m.n_embd} x {m.n_ff} (x3: gate, up, down; "
                  f"{m.expert_bytes / 2**20:.2f} MiB) on {m.threads} threads: {m.ms_per_expert:.3f} ms per "
                  f"token, {m.gb_per_s:.1f} GB/s of expert bytes")
    console.print(f"use it as a profile's host_expert_gb_s: {m.gb_per_s:.1f}")
    return 0


def cmd_tune(args) -> int:
    from .lab.tune import tune, tune_table

    modes = args.mode if args.mode != (None,) else ("hybrid", "copy")
    result = tune(args.model, _offload(args), device_mib=_device_mib(args), modes=modes, n_tokens=args.n_tokens,
                  profile=args.profile, console=None if args.json else err_console)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    console.print(tune_table(result))
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(f"recommended: [bold]{result.best.label}[/bold] ({result.best.source}); run it with:")
    console.print(result.command_line, soft_wrap=True, markup=False)
    return 0


def cmd_demo(args) -> int:
    from .run.demo import run_demo
    # with --json the narrative and the tables go to stderr, the figures to stdout
    result = run_demo(err_console if args.json else console, out_dir=args.out, n_tokens=args.n_tokens,
                      repeats=args.repeats)
    if args.json:
        print(json.dumps({"parity": result.parity, "plot": str(result.plot_path),
                          "sweep": json.loads(result.json_path.read_text())}, indent=1))
    return 0 if result.parity else 1


def cmd_trace(args) -> int:
    from .binding.llama import Context, Model
    from .run.testmodel import StreamSpec, spec_of, token_stream
    from .run.trace import PoolTraceRecorder, expert_bytes_from_gguf, locality, record_trace

    offload = _offload(args)
    pool = _pool_config(args)
    model = Model(args.model, n_gpu_layers=offload.n_gpu_layers, rpc=offload.rpc, n_cpu_moe=offload.n_cpu_moe,
                  cpu_moe=offload.cpu_moe)
    if model.n_expert == 0:
        raise PyllamapoolError(f"{args.model} is not a Mixture-of-Experts model: nothing to trace")
    spec = spec_of(args.model)
    stream = token_stream(spec, StreamSpec(n_tokens=args.n_tokens + 1, seed=args.seed))
    n_ctx = max(args.n_ctx, args.n_tokens + 8)
    meta = {"stream_seed": args.seed}
    if pool.enabled:
        # the pool's view: the experts each pooled decode step looked up, and which ones missed
        ctx = Context(model, n_ctx=n_ctx, n_threads=args.n_threads, pool=pool)
        recorder = PoolTraceRecorder(ctx)
        ctx.decode(stream[:1])
        for tok in stream[1:]:
            ctx.decode([tok])
            recorder.end_step()
        recorder.detach()
        for line in ctx.pool_lines():
            console.print(line, soft_wrap=True)
        ctx.close()
        for line in ctx.close_log:
            if line.startswith("expert pool runtime"):
                console.print(line, soft_wrap=True)
        trace = recorder.trace(model.n_expert, model.n_expert_used, expert_bytes_from_gguf(args.model),
                               {"model": str(args.model), **meta})
    else:
        trace = record_trace(model, stream[:1], stream[1:], n_ctx=n_ctx, meta=meta)
    model.close()
    out = trace.save(args.output)
    loc = locality(trace)
    console.print(f"wrote {out}: {trace.n_tokens} tokens x {len(trace.layers)} MoE layers, top-{trace.top_k} "
                  f"of {trace.n_expert}" + (", with the pool's hit/miss per lookup" if trace.miss is not None else ""))
    console.print(f"top-25% experts carry {sum(loc.top_quarter_share) / len(loc.top_quarter_share):.0%} "
                  f"of selections; reuse from previous token {loc.reuse_prev:.0%}, within {loc.window} "
                  f"tokens {loc.reuse_window:.0%}")
    if trace.miss is not None:
        console.print(f"pool view: {1 - trace.miss.mean():.1%} of lookups hit")
    return 0


def launch(tool: str, argv: list[str]) -> int:
    """exec the patched binary with the user's arguments, unchanged."""
    from .native.tools import tool_path
    path = tool_path(tool)
    os.execv(path, [str(path), *argv])
    return 0  # not reached


# ---------------------------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyllamapool", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("build", help="build the patched llama.cpp (same as python build.py ...)",
                   add_help=False)
    p = sub.add_parser("info", help="the build manifest and the devices llama.cpp sees")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)

    from .run.testmodel import ARCHITECTURES, EXPERT_TYPES, ModelSpec
    d = ModelSpec()
    p = sub.add_parser("make-model", help="write a tiny deterministic MoE GGUF with routing locality")
    p.add_argument("output", help="path of the .gguf to write")
    p.add_argument("--arch", choices=ARCHITECTURES, default=d.arch)
    p.add_argument("--layers", type=_positive, default=d.n_layer)
    p.add_argument("--experts", type=_positive, default=d.n_expert)
    p.add_argument("--top-k", type=_positive, default=d.n_expert_used)
    p.add_argument("--embd", type=_positive, default=d.n_embd)
    p.add_argument("--heads", type=_positive, default=d.n_head)
    p.add_argument("--heads-kv", type=_positive, default=d.n_head_kv)
    p.add_argument("--ff", type=_positive, default=d.n_ff_exp, help="expert FFN width")
    p.add_argument("--vocab", type=_positive, default=d.n_vocab)
    p.add_argument("--type", default=d.expert_type, help=f"expert storage: {', '.join(EXPERT_TYPES)}")
    p.add_argument("--topics", type=_positive, default=d.n_topics, help="token topics (routing locality)")
    p.add_argument("--zipf", type=float, default=d.zipf, help="expert popularity skew")
    p.add_argument("--seed", type=int, default=d.seed)
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("run", help="scripted decode: free generation or teacher-forced replay")
    p.add_argument("model")
    p.add_argument("-p", "--prompt", help="prompt text")
    p.add_argument("--tokens", help="prompt as comma-separated token ids")
    p.add_argument("--teacher", help="teacher-forced stream: comma-separated token ids, one per step")
    p.add_argument("-n", "--n-predict", type=_non_negative, default=32)
    p.add_argument("--temp", type=float, default=0.0, help="0 = greedy; > 0 = seeded sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    add_offload_args(p)
    add_pool_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("plan", help="what-if admission for a card size, without the card")
    p.add_argument("model")
    add_offload_args(p)
    add_pool_args(p)
    p.add_argument("-ctk", "--cache-type-k", help="KV cache type for K (f16, q8_0, ...)")
    p.add_argument("-ctv", "--cache-type-v", help="KV cache type for V")
    p.add_argument("-fa", "--flash-attn", choices=("on", "off", "auto"), default="auto")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("sweep", help="run one workload over a grid of pool settings")
    p.add_argument("model")
    add_offload_args(p)
    add_pool_args(p, sweepable=True)
    p.add_argument("-n", "--n-tokens", type=_positive, default=128, help="teacher-forced decode tokens")
    p.add_argument("-r", "--repeats", type=_positive, default=3)
    p.add_argument("--seed", type=int, default=0, help="token stream seed")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--predict", metavar="PROFILE",
                   help="add the cost model's t/s at each row's measured hit rate (a built-in profile or a "
                        "GPU check report; the pool-off row calibrates the device's time)")
    p.add_argument("--json", action="store_true", help="print the sweep as JSON (schema pyllamapool.sweep/1)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("predict", help="predicted decode t/s per pool mode for a model on a card, from a cost model")
    p.add_argument("model", nargs="?", help="MODEL.gguf (its header gives experts, top-k and bytes)")
    p.add_argument("--profile", default="rtx3090-pcie4",
                   help="a built-in hardware profile (--list-profiles) or a GPU check report (gpu-check.json)")
    p.add_argument("-mec", "--moe-expert-cache", dest="mec", type=_int_list, default=[16, 32, 64],
                   help="slots per layer to predict (comma-separated)")
    p.add_argument("--host-layers", type=_non_negative, help="MoE layers with host experts (--n-cpu-moe; default all)")
    p.add_argument("--stock-tps", type=float, help="your measured stock --n-cpu-moe decode t/s (calibrates the "
                                                   "device's own time; otherwise estimated from the model's bytes)")
    p.add_argument("--dense-ms", type=float, help="the device's own time per token, if known")
    p.add_argument("--preset", default="qwen3-30b-a3b", help="routing preset (shaped to the model's experts)")
    p.add_argument("--trace", help="a recorded routing trace (pyllamapool trace) instead of a preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--upload-frac", type=float, default=0.25, help="hybrid's upload budget, share of a token")
    p.add_argument("--pageable", action="store_true",
                   help="the experts stay in pageable pages (LLAMA_MOE_POOL_PIN=off, or a device that refused or "
                        "cannot pin them: Vulkan, RPC); by default a mapped load is pinned in place, as -lm none "
                        "pins it, and uploads run at the pinned link's speed")
    p.add_argument("--prefetch-overlap", type=_fraction, default=0.61,
                   help="hybrid's prefetch: the share of a step's experts the previous layer's prediction names "
                        "(default 0.61, published for GLM-5.3-Flash; 0 = no prefetch; a --trace recorded with "
                        "prefetch brings its own predictions)")
    p.add_argument("--validate", action="store_true", help="compare the model with published results")
    p.add_argument("--list-profiles", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("measure-host", help="what one expert costs this CPU (ggml's MUL_MAT_ID, from RAM)")
    p.add_argument("--expert-type", default="Q4_K")
    p.add_argument("--n-embd", type=_positive, default=2048)
    p.add_argument("--n-ff", type=_positive, default=768, help="expert FFN width")
    p.add_argument("-t", "--threads", type=_positive)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_measure_host)

    p = sub.add_parser("tune", help="what to run on this machine: plan, measure, time or predict each mode, and "
                                    "the llama-server command line")
    p.add_argument("model", type=_existing_file)
    add_offload_args(p)
    p.add_argument("--mode", "--moe-pool-mode", dest="mode", type=_choices("mode", ["hybrid", "copy"]),
                   default=(None,), help="the pool modes to consider (default hybrid,copy)")
    p.add_argument("--device-mib", type=_mib_list, help="plan for a card of this size (MiB) instead of this device")
    p.add_argument("-n", "--n-tokens", type=_positive, default=64, help="teacher-forced decode tokens per timing")
    p.add_argument("--profile", default="rtx3090-pcie4",
                   help="the link and device to predict with where there is no device (a built-in profile or a "
                        "GPU check report)")
    p.add_argument("--json", action="store_true", help="the choices and the command as JSON (pyllamapool.tune/1)")
    p.set_defaults(func=cmd_tune, n_gpu_layers=99)  # tuning is for a model on the device, experts on the host

    p = sub.add_parser("demo", help="the pool end to end on this machine (GPU, or a loopback RPC device)")
    p.add_argument("--out", type=Path, help="where to write sweep.png and sweep.json")
    p.add_argument("-n", "--n-tokens", type=_positive, default=160)
    p.add_argument("-r", "--repeats", type=_positive, default=3)
    p.add_argument("--json", action="store_true", help="the parity verdict and the sweep as JSON on stdout")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("trace", help="record routing (per token, per MoE layer) to .npz")
    p.add_argument("model")
    p.add_argument("-o", "--output", default="trace.npz")
    p.add_argument("-n", "--n-tokens", type=_positive, default=256)
    p.add_argument("--seed", type=int, default=0, help="token stream seed")
    add_offload_args(p)
    add_pool_args(p)
    p.set_defaults(func=cmd_trace)

    for name, tool in LAUNCHERS.items():
        sub.add_parser(name, help=f"run the patched {tool} with your arguments", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # llama.cpp's own log goes to Python logging; on the command line show its errors only
    # (the pool's telemetry lines are printed by the commands themselves)
    verbose = "-v" in argv or "--verbose" in argv
    argv = [a for a in argv if a not in ("-v", "--verbose")] if argv[:1] not in (["server"], ["cli"], ["bench"],
                                                                                   ["rpc-server"], ["quantize"], ["build"]) else argv
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if not verbose:
        logging.getLogger("pyllamapool.llama").setLevel(logging.ERROR)
    try:
        if argv and argv[0] == "build":
            return cmd_build(argv[1:])
        if argv and argv[0] in LAUNCHERS:
            return launch(LAUNCHERS[argv[0]], argv[1:])
        parser = make_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        return int(args.func(args) or 0)
    except PyllamapoolError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
