"""One architecture's sweep cases, run in a process of their own (test_archs.py starts it), so that
an abort inside llama.cpp ends this process and not pytest: `python tests/archs_worker.py CASES.json`.

Each case names its device: the loopback RPC device (a server the worker starts, which dies with
it, abort or not; its copies are synchronous) or the lazy-copy test device (its copies read their
sources only when its queue runs, so an ordering bug is a wrong logit there). Then for
each case prints `@@begin ID` before it starts and `@@result JSON` when it is done: whoever reads the
output knows which case an abort interrupted, and starts the worker again with the cases after it.

Every case compares pooled decode (experts on the host, layers on the device, the pool on) with
the all-resident run on the same device, logit for logit, over one scenario: prompts of 1, 5 and 32
tokens decoded in one batch, each followed by single-token steps, then two sequences in one batch
(llama-server -np 2).
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from pyllamapool.binding.llama import Context, Model
from pyllamapool.binding.pool import PoolConfig
from pyllamapool.run.rpc import start_rpc_server

#: test-llama-archs models have 128 tokens
TOKENS = [(7 * i) % 97 + 3 for i in range(64)]
PROMPT_LENGTHS = (1, 5, 32)
STEPS_AFTER_PROMPT = 3
#: the two-sequence part: each sequence's prompt in one batch, then this many steps of one token each
TWO_SEQ_PROMPT, TWO_SEQ_STEPS = 4, 4
MARK = "@@"


@dataclass(frozen=True)
class Case:
    id: str
    model: str
    mode: str
    slots: tuple[int, ...]
    device: str = "rpc"   # or "lazy" (the device serves the steps where it can), or "lazy-host"
    cpu_moe: bool = True
    cpu_overrides: tuple[str, ...] = ()
    bank: bool = False    # ask for a bank in a mode other than "bank" (hybrid: its copy layers share one)


@dataclass
class Run:
    """One slot count of a case."""
    slots: int
    identical: bool
    n_logits: int
    max_abs_diff: float
    enabled: bool
    reason: str
    status_mode: str
    actual_slots: int
    lookups: int
    hits: int
    misses: int
    steps: int
    bypassed_steps: int
    device_experts: int
    cpu_experts: int
    #: per pool: tensor, and the mode / reason llama_moe_pool_info reports (None where the binding
    #: does not have them yet)
    pools: list[dict] = field(default_factory=list)
    #: the `expert pool layers mode=... reason=...` lines: which layers run which mode, and why
    layer_lines: list[str] = field(default_factory=list)
    #: hybrid mode's prefetch: experts predicted for steps, and uploaded ahead of them
    predicted: int = 0
    prefetched: int = 0
    #: whether the layers shared a bank of slots, and why not where they did not
    bank: str = "off"
    bank_reason: str = ""


def scenario(model: Model, pool: PoolConfig | None) -> tuple[list[np.ndarray], Context]:
    """The logits of every output of the scenario, and the (open) context that made them."""
    ctx = Context(model, n_ctx=512, n_seq_max=2, pool=pool)
    out: list[np.ndarray] = []
    for n in PROMPT_LENGTHS:
        ctx.clear()
        prompt = TOKENS[:n]
        ctx.decode_batch(prompt, list(range(n)), [0] * n, [False] * (n - 1) + [True])
        out.append(ctx.logits(n - 1))
        for i in range(STEPS_AFTER_PROMPT):
            ctx.decode_batch([TOKENS[n + i]], [n + i], [0], [True])
            out.append(ctx.logits(0))
    ctx.clear()
    seqs = [TOKENS[:TWO_SEQ_PROMPT + TWO_SEQ_STEPS], TOKENS[16:16 + TWO_SEQ_PROMPT + TWO_SEQ_STEPS]]
    p = TWO_SEQ_PROMPT
    ctx.decode_batch([t for s in seqs for t in s[:p]], list(range(p)) * 2, [0] * p + [1] * p,
                     ([False] * (p - 1) + [True]) * 2)
    out += [ctx.logits(p - 1), ctx.logits(2 * p - 1)]
    for i in range(p, p + TWO_SEQ_STEPS):
        ctx.decode_batch([seqs[0][i], seqs[1][i]], [i, i], [0, 1], [True, True])
        out += [ctx.logits(0), ctx.logits(1)]
    return out, ctx


def pooled_run(model: Model, reference: list[np.ndarray], mode: str, slots: int, serve: str | None = None,
               bank: bool = False) -> Run:
    # hybrid with prefetch on: the default (auto) prefetches only on the stream path, where the link
    # has room, which the RPC device's inline path is not, and each architecture's router must predict
    # bank: copy mode's slots as one bank per layout for the layers a device holds (asked for in
    # hybrid mode too, `bank`: the layers that run copy mode there share one)
    pool = PoolConfig(slots=slots, device_mib=65536, mode="copy" if mode == "bank" else mode,
                      prefetch="on" if mode == "hybrid" else None, serve=serve,
                      bank="on" if mode == "bank" or bank else None)
    logits, ctx = scenario(model, pool)
    report = ctx.pool_report(per_pool=True)
    status = report.status
    ctx.close()
    layer_lines = [line for line in ctx.pool_lines() if line.startswith("expert pool layers")]
    same = len(logits) == len(reference) and all(np.array_equal(a, b) for a, b in zip(logits, reference))
    diff = max((float(np.max(np.abs(a - b))) for a, b in zip(logits, reference)), default=float("nan"))
    c = report.counters
    pools = [{"tensor": i.tensor, "layer": i.layer, "mode": getattr(i, "mode", None),
              "reason": getattr(i, "reason", None)} for i in report.pools]
    return Run(slots, same, len(logits), diff, status.enabled, status.reason, status.mode, status.actual_slots,
               c.lookups, c.hits, c.misses, c.steps, c.bypassed_steps, c.device_experts, c.cpu_experts, pools,
               layer_lines, c.predicted, c.prefetched, status.bank, status.bank_reason)


def main(cases_file: str) -> None:
    cases = [Case(**{**c, "slots": tuple(c["slots"]), "cpu_overrides": tuple(c["cpu_overrides"])})
             for c in json.load(open(cases_file))]
    references: dict[tuple, list[np.ndarray]] = {}
    models: dict[tuple, Model] = {}
    rpc_needed = any(c.device == "rpc" for c in cases)
    with start_rpc_server() if rpc_needed else contextlib.nullcontext() as server:
        on = {"rpc": {"rpc": [server.endpoint]} if server else {}, "lazy": {"lazy_copy": True}}
        try:
            for case in cases:
                print(f"{MARK}begin {case.id}", flush=True)
                try:
                    # "lazy-host": the lazy device, with the host serving each step (not the device's path)
                    device, _, serve = case.device.partition("-")
                    if (case.model, device) not in references:
                        resident = Model(case.model, n_gpu_layers=99, **on[device])
                        references[case.model, device] = scenario(resident, None)[0]
                        resident.close()
                    key = (case.model, device, case.cpu_moe, case.cpu_overrides)
                    if key not in models:
                        models[key] = Model(case.model, n_gpu_layers=99, **on[device], cpu_moe=case.cpu_moe,
                                            cpu_overrides=case.cpu_overrides)
                    runs = [asdict(pooled_run(models[key], references[case.model, device], case.mode, s, serve or None,
                                              bank=case.bank)) for s in case.slots]
                    result = {"id": case.id, "runs": runs}
                except Exception as exc:  # a Python-side failure is this case's, not the worker's
                    result = {"id": case.id, "error": f"{type(exc).__name__}: {exc}"}
                print(f"{MARK}result {json.dumps(result)}", flush=True)
        finally:
            for model in models.values():   # before the server stops: freeing needs it
                model.close()


if __name__ == "__main__":
    # a crash in C prints where Python was (the case, the call) before the process dies
    faulthandler.enable()
    main(sys.argv[1])
