"""Every MoE architecture llama.cpp's test-llama-archs makes, pooled on the loopback RPC device and on
the lazy-copy test device (whose copies read their sources only when its queue runs: an ordering bug
that the RPC device's synchronous copies hide is a wrong logit there), there both with the device
serving each step itself (the device-side path, its default) and with the host serving it.

The list comes from what the tool writes (its `-moe` models), so an architecture added upstream
joins the sweep by itself. Each model with fewer than eight experts (most have two) is widened to eight
(top-k stays as made) and
runs with default flags (the pool on, --cpu-moe) in both pool modes, and on the lazy device's two paths
in copy mode over a bank of slots the layers share (LLAMA_MOE_POOL_BANK=on), at top-k slots and a few more,
against the all-resident run on the same device: the logits must be the same bits, a pool that is
admitted must hit and miss, and each pool says which mode it runs. Models that carry optional
per-expert scales run once as made and once without them; gpt-oss also runs with only its expert
weights on the host (its expert biases left on the device).

Each architecture runs in a worker process (archs_worker.py): an abort fails that architecture's
cases, with the worker's stderr, and the worker starts again with the cases after the one it was in.

    python -m pytest -q tests/test_archs.py      # the tests
    python tests/test_archs.py [ARCH_REGEX]      # the same sweep as a table (arch x variant x device x mode)
"""
from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# run as a script: archmodels beside this file, pyllamapool from the checkout
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import archmodels  # noqa: E402

WORKER = Path(__file__).resolve().parent / "archs_worker.py"
ROOT = Path(__file__).resolve().parent.parent
N_EXPERT = 8
#: the pool's modes, and the sweep's: copy mode again with a bank of slots shared by the layers
#: (LLAMA_MOE_POOL_BANK=on), on the lazy device's two paths (the RPC device's is the host's path)
MODES = ("copy", "hybrid")
SWEEP_MODES = MODES + ("bank",)
BANK_DEVICES = ("lazy", "lazy-host")
#: why a bank may be off on a test model: every layer's layout differs, or one layer is pooled
BANK_REFUSALS = ("layout", "one-layer")
#: hybrid mode on those devices asks for a bank too: the layers planning finds it cannot run (their
#: pooled experts carry biases or scales) run copy mode and share one; those it runs keep their
#: tables, so "hybrid" is a refusal only where fewer than two layers run copy mode for those reasons.
#: Where the biases stay on the device (weights-on-host) the graph gives the same reasons later, after
#: the bank is laid out
HYBRID_COPY_REASONS = ("expert-biases", "expert-scales", "cpu-layout")
#: the loopback RPC device (synchronous copies) and the lazy-copy test device (copies that read their
#: sources when its queue runs: an upload or a table published too early is a wrong logit there), where
#: by default the device serves each step itself (GGML_OP_MOE_FETCH), and again with the host serving
DEVICES = ("rpc", "lazy", "lazy-host")
#: the optional per-expert scales test-llama-archs gives some architectures
EXPERT_SCALES = r"_(ch)?exps\.(scale|input_scale)$"
#: only the expert weights on the host: biases (and scales) stay on the device with the layer
WEIGHTS_ONLY = r"_(ch)?exps\.weight$"
#: architectures the sweep must contain: if one of them is missing, the list is not what it claims
MUST_CONTAIN = ("qwen3moe", "deepseek2", "llama4", "gpt-oss", "mistral4")
#: one worker's limit: a hang fails the case it was in, the rest still run
WORKER_TIMEOUT_S = 300


@dataclass(frozen=True)
class SweepCase:
    arch: str
    variant: str      # "as-made", "no-scales" or "weights-on-host"
    mode: str
    device: str = "rpc"

    @property
    def id(self) -> str:
        return f"{self.arch}/{self.variant}/{self.mode}/{self.device}"

    @property
    def hybrid_bank(self) -> bool:
        """Hybrid mode asks for a bank where the sweep runs banks: its copy layers share one."""
        return self.mode == "hybrid" and self.device in BANK_DEVICES


@dataclass
class CaseResult:
    case: SweepCase
    runs: list[dict] = field(default_factory=list)
    error: str = ""          # a Python exception in the worker (a load that failed, say)
    abort: str = ""          # how the worker died in this case, and its last words
    stderr_tail: str = ""

    def problems(self) -> list[str]:
        """What is wrong with this case; empty when it passed."""
        if self.abort:
            return [f"abort: {self.abort}"]
        if self.error:
            return [f"error: {self.error}"]
        out = []
        for run in self.runs:
            s = run["slots"]
            if not run["identical"]:
                out.append(f"slots={s}: logits differ from the all-resident run (max |diff| {run['max_abs_diff']:.3g} "
                           f"over {run['n_logits']} outputs)")
            if not run["enabled"] and run["reason"] != "experts-not-routed":
                # every pool here has room; the one reason to stand down is a graph that never
                # routes through its experts (refact loads expert tensors it does not use)
                out.append(f"slots={s}: not admitted ({run['reason']})")
            if run["enabled"]:
                if run["lookups"] == 0:
                    out.append(f"slots={s}: admitted but zero lookups ({run['steps']} steps, "
                               f"{run['bypassed_steps']} bypassed)")
                elif run["hits"] == 0 or run["misses"] == 0:
                    out.append(f"slots={s}: hits={run['hits']} misses={run['misses']}")
                out += [f"slots={s}: {p}" for p in mode_problems(self.case.mode, run)]
                if self.case.hybrid_bank and self.case.variant != "weights-on-host":
                    out += [f"slots={s}: {p}" for p in hybrid_bank_problems(run)]
        return out

    def summary(self) -> str:
        """One table cell."""
        if self.abort:
            return f"ABORT {self.abort}"
        if self.error:
            return f"ERROR {self.error[:120]}"
        problems = self.problems()
        if problems:
            kinds = sorted({("mismatch" if "logits differ" in p else "zero lookups" if "zero lookups" in p
                             else p.split(": ", 1)[1][:60]) for p in problems})
            return "FAIL " + "; ".join(kinds)
        enabled = [r for r in self.runs if r["enabled"]]
        if not enabled:
            return f"ok (pool not admitted: {self.runs[0]['reason']})"
        if self.case.mode == "copy":
            return "ok"
        if self.case.mode == "bank":
            off = sorted({r["bank_reason"] for r in enabled if r["bank"] != "on"})
            return "ok" + (f" (bank off: {', '.join(off)})" if off else "")
        # hybrid asked: which layers fell back to copy, and why; whether they shared a bank
        fallback = sorted({reason for r in enabled for reason in copy_reasons(r)})
        banked = any(r["bank"] == "on" for r in enabled)
        return "ok" + (f" (copy: {', '.join(fallback)}{'; bank' if banked else ''})" if fallback else "")


def layer_modes(run: dict) -> list[dict[str, str]]:
    """The `expert pool layers mode=M reason=R count=N layers=...` lines as dicts."""
    return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in run["layer_lines"]]


def copy_reasons(run: dict) -> set[str]:
    """Why layers run copy: the per-pool reasons where PoolInfo has them, and the layers lines."""
    reasons = {p["reason"] for p in run["pools"] if p["mode"] == "copy" and p["reason"]}
    return reasons | ({m.get("reason", "") for m in layer_modes(run) if m.get("mode") == "copy"} - {""})


def mode_problems(mode: str, run: dict) -> list[str]:
    """An admitted pool says which mode it runs: copy mode runs copy; hybrid runs hybrid, or copy
    in layers it says why for (weight-before-ffn, clamped-swiglu, ...)."""
    out = []
    if mode == "bank":
        if run["bank"] != "on" and run["bank_reason"] not in BANK_REFUSALS:
            out.append(f"no bank ({run['bank_reason'] or 'no reason'})")
        mode = "copy"  # a bank is copy mode's slots
    if mode == "copy" and run["status_mode"] != "copy":
        out.append(f"status mode {run['status_mode']} in copy mode")
    elif run["status_mode"] not in MODES:
        out.append(f"unknown status mode {run['status_mode']!r}")
    elif mode == "hybrid" and run["status_mode"] == "copy" and not copy_reasons(run):
        out.append("runs copy in hybrid mode and says no reason")
    return out + pool_mode_problems(mode, run["pools"])


def hybrid_bank_problems(run: dict) -> list[str]:
    """Hybrid mode with a bank asked for: the layers it cannot run share one, unless fewer than two
    of them do (or they share no layout), and the layers it runs keep pools of their own."""
    planned_copy = sum(int(m.get("count", "0")) for m in layer_modes(run)
                       if m.get("mode") == "copy" and m.get("reason") in HYBRID_COPY_REASONS)
    if run["bank"] == "on":
        return [] if planned_copy >= 2 else [f"a bank in hybrid mode with {planned_copy} layer(s) that run copy mode"]
    if run["bank_reason"] in BANK_REFUSALS or (run["bank_reason"] == "hybrid" and planned_copy < 2):
        return []
    return [f"no bank for {planned_copy} layers that run copy mode ({run['bank_reason'] or 'no reason'})"]


def pool_mode_problems(mode: str, pools: list[dict]) -> list[str]:
    """Per-pool mode and reason, where the binding reports them (PoolInfo.mode / .reason): copy mode
    runs every pool in copy; hybrid may run a layer in copy, and then says why."""
    if not pools or pools[0]["mode"] is None:
        return []   # PoolInfo has no mode yet: nothing to check
    out = []
    for p in pools:
        if p["mode"] == "none" and p["reason"] == "experts-not-routed":
            continue  # a layer the graph never routes through: it runs no mode, and says so
        if p["mode"] not in MODES:
            out.append(f"{p['tensor']}: unknown pool mode {p['mode']!r}")
        elif mode == "copy" and p["mode"] != "copy":
            out.append(f"{p['tensor']}: runs {p['mode']} in copy mode")
        elif mode == "hybrid" and p["mode"] == "copy" and not p["reason"]:
            out.append(f"{p['tensor']}: runs copy in hybrid mode and gives no reason")
    return out


# --------------------------------------------------------------------------------------------
# the models


@functools.cache
def models_dir() -> Path:
    """test-llama-archs' models in the cache, written once per build of the tool."""
    from pyllamapool.native.paths import cache_dir

    out = cache_dir() / "test-llama-archs" / archmodels.tool_stamp()
    if not (out / ".complete").exists():
        archmodels.generate(out)
        (out / ".complete").touch()
    return out


def has_expert_scales(path: Path) -> bool:
    import gguf

    return any(re.search(EXPERT_SCALES, t.name) for t in gguf.GGUFReader(str(path)).tensors)


def has_routed_experts(path: Path) -> bool:
    import gguf

    return any(re.search(r"_(ch)?exps\.weight$", t.name) for t in gguf.GGUFReader(str(path)).tensors)


@functools.cache
def without_experts() -> tuple[str, ...]:
    """MoE models of the tool that have no expert tensors (their architecture builds a dense FFN
    whatever the expert count): there is nothing to pool, so they are not swept."""
    return tuple(arch for arch, path in moe_models().items() if not has_routed_experts(path))


def sweep_cases(arch_filter: str = "") -> list[SweepCase]:
    cases = []
    for arch, path in moe_models().items():
        if arch_filter and not re.search(arch_filter, arch) or arch in without_experts():
            continue
        variants = ["as-made"] + (["no-scales"] if has_expert_scales(path) else [])
        if arch == "gpt-oss":
            variants.append("weights-on-host")
        cases += [SweepCase(arch, v, m, d) for v in variants for d in DEVICES for m in SWEEP_MODES
                  if m != "bank" or d in BANK_DEVICES]
    return cases


@functools.cache
def moe_models() -> dict[str, Path]:
    return archmodels.moe_models(models_dir())


def variant_model(arch: str, variant: str) -> Path:
    """The widened model a variant runs (made on first use)."""
    from pyllamapool.run.testmodel import widen_experts, without_tensors

    src = moe_models()[arch]
    # beside the tool's models, not among them: a widened model is not another architecture
    out = models_dir() / "widened"
    out.mkdir(exist_ok=True)
    wide = out / f"{arch}-moe-{N_EXPERT}.gguf"
    if archmodels.expert_count(src) >= N_EXPERT:
        wide = src  # the tool made enough experts already (deepseek2: 64)
    elif not wide.exists():
        widen_experts(src, wide.with_suffix(".tmp"), N_EXPERT).replace(wide)
    if variant != "no-scales":
        return wide
    plain = out / f"{arch}-moe-{N_EXPERT}-no-scales.gguf"
    if not plain.exists():
        without_tensors(wide, plain.with_suffix(".tmp"), EXPERT_SCALES).replace(plain)
    return plain


def worker_case(case: SweepCase, top_k: int) -> dict:
    weights_only = case.variant == "weights-on-host"
    return {"id": case.id, "model": str(variant_model(case.arch, case.variant)), "mode": case.mode,
            "device": case.device, "bank": case.hybrid_bank,
            # top-k slots (every step evicts) and a few more
            "slots": [top_k, top_k + 3], "cpu_moe": not weights_only,
            "cpu_overrides": [WEIGHTS_ONLY] if weights_only else []}


# --------------------------------------------------------------------------------------------
# running the workers


def abort_message(returncode: int, stderr: str) -> str:
    """How a worker died: the signal, the assertion or error llama.cpp printed last, and where
    Python was (faulthandler's innermost frames)."""
    how = (f"signal {signal.Signals(-returncode).name}" if returncode < 0 and -returncode in signal.Signals._value2member_map_
           else f"exit {returncode}")
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    said = [l for l in lines if re.search(r"GGML_ASSERT|GGML_ABORT|fatal error|error:|terminate called|what\(\)", l)
            and not l.startswith("Fatal Python error")]   # faulthandler's own line: the signal says it
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\w+)', stderr.split("most recent call first", 1)[-1])
    where = " <- ".join(f"{Path(f).name}:{n} {fn}" for f, n, fn in frames[:3])
    text = said[-1][:300] if said else ""
    return ", ".join(part for part in (how, text, f"in {where}" if where else "") if part)


def run_worker(cases: list[dict], timeout_s: float = WORKER_TIMEOUT_S) -> tuple[dict[str, dict], str | None, str, str]:
    """Run the worker over cases: (results by id, the id it was in when it died or None, how it died,
    its stderr tail)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(cases, fh)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(WORKER.parent)]))
    try:
        proc = subprocess.run([sys.executable, str(WORKER), fh.name], capture_output=True, text=True, env=env,
                              timeout=timeout_s, cwd=ROOT)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        rc = None
    finally:
        os.unlink(fh.name)
    results, current = {}, None
    for line in stdout.splitlines():
        if line.startswith("@@begin "):
            current = line[len("@@begin "):]
        elif line.startswith("@@result "):
            result = json.loads(line[len("@@result "):])
            results[result["id"]] = result
            current = None
    tail = stderr[-3000:]
    if rc == 0:
        return results, None, "", tail
    how = f"timeout after {timeout_s:.0f} s" if rc is None else abort_message(rc, stderr)
    return results, current, how, tail


def sweep_arch(cases: list[SweepCase]) -> dict[SweepCase, CaseResult]:
    """Run one architecture's cases in workers; after an abort, the next worker starts with the
    cases after the one that aborted."""
    import gguf

    arch = cases[0].arch
    reader = gguf.GGUFReader(str(moe_models()[arch]))
    top_k = int(reader.fields[f"{reader.fields['general.architecture'].contents()}.expert_used_count"].contents())
    by_id = {c.id: c for c in cases}
    out: dict[SweepCase, CaseResult] = {}
    remaining = [worker_case(c, top_k) for c in cases]
    made = {Path(c["model"]) for c in remaining}
    try:
        _run_cases(remaining, by_id, out)
    finally:
        # widened models are 4x the tool's: one architecture's at a time on disk, not all 55
        for path in made:
            path.unlink(missing_ok=True)
    return out


def _run_cases(remaining: list[dict], by_id: dict[str, SweepCase], out: dict[SweepCase, CaseResult]) -> None:
    while remaining:
        results, died_in, how, tail = run_worker(remaining)
        for rid, result in results.items():
            out[by_id[rid]] = CaseResult(by_id[rid], runs=result.get("runs", []), error=result.get("error", ""))
        if died_in is None and not how:
            break
        ids = [c["id"] for c in remaining]
        if died_in is None:   # it died outside any case (starting, or stopping its server)
            for rid in ids:
                if by_id[rid] not in out:
                    out[by_id[rid]] = CaseResult(by_id[rid], abort=f"worker died outside a case: {how}", stderr_tail=tail)
            break
        out[by_id[died_in]] = CaseResult(by_id[died_in], abort=how, stderr_tail=tail)
        remaining = remaining[ids.index(died_in) + 1:]


_results: dict[str, dict[SweepCase, CaseResult]] = {}


def result_of(case: SweepCase, all_cases: list[SweepCase]) -> CaseResult:
    """This case's result; the first case of an architecture runs all of its cases."""
    if case.arch not in _results:
        _results[case.arch] = sweep_arch([c for c in all_cases if c.arch == case.arch])
    return _results[case.arch][case]


# --------------------------------------------------------------------------------------------
# the tests


_cases: list[SweepCase] | None = None
_collect_error: str = ""


def collected_cases() -> list[SweepCase]:
    global _cases, _collect_error
    if _cases is None:
        try:
            _cases = sweep_cases()
        except FileNotFoundError as exc:  # the tool is not built: the tests fail saying so
            _cases, _collect_error = [], str(exc)
    return _cases


def pytest_generate_tests(metafunc):
    if "sweep_case" in metafunc.fixturenames:
        cases = collected_cases()
        metafunc.parametrize("sweep_case", cases or [None], ids=[c.id for c in cases] or ["no-models"])


def test_the_sweep_covers_the_moe_architectures_llama_cpp_tests():
    cases = collected_cases()
    assert not _collect_error, _collect_error
    archs = {c.arch for c in cases}
    assert len(archs) >= 20, sorted(archs)
    assert set(MUST_CONTAIN) <= archs, sorted(set(MUST_CONTAIN) - archs)
    for arch, path in moe_models().items():
        assert archmodels.expert_count(path) > 1, f"{arch}: {path.name} has one expert or none"
    # the few without expert tensors stay few: a regression that drops experts would show here
    assert len(without_experts()) <= 3, without_experts()
    assert {c.variant for c in cases if c.arch == "gpt-oss"} == {"as-made", "no-scales", "weights-on-host"}


def test_pooled_decode_matches_the_all_resident_run(sweep_case):
    assert sweep_case is not None, _collect_error
    result = result_of(sweep_case, collected_cases())
    problems = result.problems()
    if problems:
        detail = "\n".join(problems)
        if result.stderr_tail:
            detail += "\n--- worker stderr (tail) ---\n" + result.stderr_tail[-2000:]
        pytest.fail(f"{sweep_case.id}:\n{detail}", pytrace=False)


# --------------------------------------------------------------------------------------------
# the sweep as a table


def main(argv: list[str]) -> int:
    import time

    arch_filter = argv[0] if argv else ""
    cases = sweep_cases(arch_filter)
    archs = sorted({c.arch for c in cases})
    rows = []
    start = time.monotonic()
    for arch in archs:
        t0 = time.monotonic()
        results = sweep_arch([c for c in cases if c.arch == arch])
        for variant in dict.fromkeys(c.variant for c in cases if c.arch == arch):
            for device in DEVICES:
                cells = [results[SweepCase(arch, variant, m, device)].summary()
                         if SweepCase(arch, variant, m, device) in results else "-" for m in SWEEP_MODES]
                rows.append((arch, variant, device, *cells))
                print(f"| {arch} | {variant} | {device} | {' | '.join(cells)} |", flush=True)
        print(f"<!-- {arch}: {time.monotonic() - t0:.1f} s -->", flush=True)
        for r in results.values():
            if r.abort or r.problems():
                print(f"<!-- {r.case.id}: {'; '.join(r.problems())[:500]} -->", flush=True)
    print(f"\n{len(archs)} architectures, {len(cases)} cases, {time.monotonic() - start:.0f} s; not swept "
          f"(no expert tensors): {', '.join(without_experts()) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
