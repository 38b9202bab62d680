"""The policy benchmark: bytes moved by each policy on each preset, against Belady's optimum."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..binding.pool import DEFAULT_POLICY, Policy
from ..run.trace import Trace
from .policies import POLICIES, PolicyStats, layer_steps
from .synth import LAYERED_PRESETS, PRESETS, Preset, generate

#: the product's slot policies (the C++ in the patch series): (policy, admission gate)
PRODUCT_POLICIES = {"product-adaptive": ("adaptive", False), "product-lru": ("lru", False),
                    "product-gated": ("adaptive", True)}
#: what the pool runs unless told otherwise
DEFAULT = f"product-{DEFAULT_POLICY}"


@dataclass
class Row:
    preset: str
    slots: int
    slot_fraction: float
    policy: str
    hit_rate: float
    copy_bytes_per_token: float
    uploads: int
    evictions: int
    yield_: float          # bytes served from the pool per byte uploaded
    vs_opt: float = 0.0    # this policy's copied bytes / OPT's
    vs_lru: float = 0.0    # this policy's copied bytes / LRU's
    served_bytes_per_token: float = 0.0  # bytes of experts found in the pool

    @property
    def excess_bytes_per_token(self) -> float:
        """Bytes moved beyond the bytes the pool served: what a pool that does not pay costs."""
        return max(0.0, self.copy_bytes_per_token - self.served_bytes_per_token)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["yield"] = d.pop("yield_")
        return d


def product_stats(steps, n_expert: int, n_slots: int, policy_name: str, gate: bool = False
                  ) -> tuple[PolicyStats, float]:
    """Replay one layer through the product's C++ policy; also the seconds spent in it. With the
    gate, steps it sends to the stock path are skipped: no lookup, no copy."""
    policy = Policy(n_expert, n_slots, policy_name, gate=gate)
    t0 = time.perf_counter()
    for step in steps:
        policy.feed(step)
    elapsed = time.perf_counter() - t0
    c = policy.counters()
    return PolicyStats(c.lookups, c.hits, c.misses, c.misses, c.evictions), elapsed


def evaluate(trace: Trace, slots: int, policies: list[str]) -> tuple[dict[str, PolicyStats], float]:
    totals = {name: PolicyStats() for name in policies}
    product_seconds = 0.0
    for li in range(len(trace.layers)):
        steps = layer_steps(trace.ids, li)
        for name in policies:
            if name in PRODUCT_POLICIES:
                st, secs = product_stats(steps, trace.n_expert, slots, *PRODUCT_POLICIES[name])
                if name == DEFAULT:
                    product_seconds += secs
            else:
                st = POLICIES[name](steps, slots)
            t = totals[name]
            t.lookups += st.lookups
            t.hits += st.hits
            t.misses += st.misses
            t.uploads += st.uploads
            t.evictions += st.evictions
    return totals, product_seconds


def slot_counts(preset: Preset, fractions: tuple[float, ...]) -> list[int]:
    return sorted({max(preset.top_k, int(round(f * preset.n_expert))) for f in fractions})


def run(presets: list[str], fractions: tuple[float, ...] = (0.125, 0.25, 0.5), seed: int = 0,
        policies: list[str] | None = None, n_tokens: int | None = None,
        n_layer: int | None = None) -> tuple[list[Row], dict]:
    policies = policies or [DEFAULT, "product-lru", "product-gated", "lfu", "decayed", "second-touch", "opt"]
    rows: list[Row] = []
    timing = {"product_seconds": 0.0, "product_lookups": 0}
    for name in presets:
        changes = {k: v for k, v in (("n_tokens", n_tokens), ("n_layer", n_layer)) if v}
        trace = generate(name, seed=seed, **changes)
        preset = PRESETS[name]
        for slots in slot_counts(preset, fractions):
            stats, secs = evaluate(trace, slots, policies)
            if DEFAULT in stats:
                timing["product_seconds"] += secs
                timing["product_lookups"] += stats[DEFAULT].lookups
            per_token = trace.n_tokens
            opt_bytes = stats["opt"].uploads * preset.bytes_per_slot if "opt" in stats else None
            lru = "product-lru" if "product-lru" in stats else "lru"
            lru_bytes = stats[lru].uploads * preset.bytes_per_slot if lru in stats else None
            for pol, st in stats.items():
                copied = st.uploads * preset.bytes_per_slot
                rows.append(Row(
                    preset=name, slots=slots, slot_fraction=slots / preset.n_expert, policy=pol,
                    hit_rate=st.hit_rate, copy_bytes_per_token=copied / per_token, uploads=st.uploads,
                    evictions=st.evictions, yield_=(st.hits / st.uploads) if st.uploads else float("inf"),
                    vs_opt=copied / opt_bytes if opt_bytes else float("nan"),
                    vs_lru=copied / lru_bytes if lru_bytes else float("nan"),
                    served_bytes_per_token=st.hits * preset.bytes_per_slot / per_token))
    return rows, timing


def lru_calibration(presets: list[str], seed: int = 0) -> list[tuple[str, int, float, float]]:
    """(preset, slots, published hit rate, synthetic LRU hit rate) for each published point."""
    out = []
    for name in presets:
        preset = PRESETS[name]
        if not preset.published:
            continue
        trace = generate(name, seed=seed)
        for slots, published in preset.published:
            stats, _ = evaluate(trace, slots, ["lru"])
            out.append((name, slots, published, stats["lru"].hit_rate))
    return out


def plot(rows: list[Row], path, default: str = DEFAULT) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({r.preset for r in rows}, key=list(PRESETS).index)
    fig, axes = plt.subplots(1, len(presets), figsize=(4 * len(presets), 3.6), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        for pol in sorted({r.policy for r in rows}):
            pts = sorted((r.slots, r.copy_bytes_per_token / 2**20) for r in rows if r.preset == preset and r.policy == pol)
            style = "-o" if pol in (default, "opt", "product-lru") else "--."
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=pol, markersize=4)
        ax.set_title(preset, fontsize=9)
        ax.set_xlabel("slots per layer")
        ax.set_ylabel("MiB copied per token")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("bytes moved per token by slot policy (lower is better; opt = Belady's bound for policies that admit "
                 "every miss; gated ones run refused misses on the CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(rows: list[Row], default: str = DEFAULT) -> dict[str, dict[str, float]]:
    """Per preset: the default policy's copied bytes as a multiple of OPT and of LRU (geometric mean)."""
    out = {}
    for preset in sorted({r.preset for r in rows}, key=list(PRESETS).index):
        mine = [r for r in rows if r.preset == preset and r.policy == default]
        out[preset] = {"vs_opt": float(np.exp(np.mean([np.log(r.vs_opt) for r in mine]))),
                       "vs_lru": float(np.exp(np.mean([np.log(r.vs_lru) for r in mine])))}
    return out


def gate_summary(rows: list[Row], default: str = DEFAULT, gated: str = "product-gated") -> dict[str, dict]:
    """Per preset: the admission gate against the default policy alone, over the slot counts: copied
    bytes (gated / default, min and max) and the worst excess (moved beyond served) per token."""
    out = {}
    for preset in sorted({r.preset for r in rows}, key=list(PRESETS).index):
        pairs = [(a, b) for a in rows for b in rows if a.preset == b.preset == preset and a.slots == b.slots
                 and a.policy == default and b.policy == gated]
        if not pairs:
            continue
        ratios = [b.copy_bytes_per_token / a.copy_bytes_per_token for a, b in pairs if a.copy_bytes_per_token]
        out[preset] = {
            "bytes_min": min(ratios, default=1.0), "bytes_max": max(ratios, default=1.0),
            "excess_default": max(a.excess_bytes_per_token for a, _ in pairs),
            "excess_gated": max(b.excess_bytes_per_token for _, b in pairs),
        }
    return out


#: the seeds docs/policy-lab.md's tables are computed over
README_SEEDS = (0, 1, 2)


def _span(values: list[float], digits: int, always_two: bool = False) -> str:
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{lo}-{hi}" if always_two or lo != hi else lo


def readme_tables(seeds: tuple[int, ...] = README_SEEDS) -> tuple[str, str]:
    """docs/policy-lab.md's two tables (Markdown): the default policy's copied bytes against LRU and
    OPT, and the admission gate against the default, on every preset at its default size, over seeds."""
    summaries, gates = [], []
    for seed in seeds:
        rows, _ = run(list(PRESETS), seed=seed, policies=[DEFAULT, "product-lru", "opt", "product-gated"])
        summaries.append(summary(rows))
        gates.append(gate_summary(rows))
    policy = ["| preset | adaptive / LRU | adaptive / OPT |", "| --- | --- | --- |"]
    gate = ["| preset | gated / default bytes | worst excess, MiB/token: default -> gated |", "| --- | --- | --- |"]
    for preset in PRESETS:
        label = f"{preset} (sanity)" if preset == "uniform" else preset
        policy.append(f"| {label} | {_span([s[preset]['vs_lru'] for s in summaries], 3)} | "
                      f"{_span([s[preset]['vs_opt'] for s in summaries], 2)} |")
        g = [x[preset] for x in gates]
        gate.append(f"| {preset} | {_span([x['bytes_min'] for x in g] + [x['bytes_max'] for x in g], 2, True)} | "
                    f"{max(x['excess_default'] for x in g) / 2**20:.1f} -> "
                    f"{max(x['excess_gated'] for x in g) / 2**20:.1f} |")
    return "\n".join(policy) + "\n", "\n".join(gate) + "\n"


def hybrid_table(seed: int = 0, fraction: float = 0.25, upload_per_step: float = 1.0,
                 payback_uses: float = 2.0) -> str:
    """Hybrid admission against copy-on-miss (the product's default policy) on every preset at a
    quarter of the experts as slots (Markdown): MiB uploaded and expert computations on the CPU per
    token, over the preset's layers. Copy mode uploads every miss and computes nothing on the CPU;
    hybrid serves misses on the CPU and uploads at most `upload_per_step` per layer and step, an
    eviction only when the candidate's recent uses beat the victim's by `payback_uses`."""
    from .policies import adaptive, hybrid_admission, layer_steps

    lines = ["| preset | slots | copy: MiB up / token | hybrid: MiB up / token | hybrid: CPU experts / token | "
             "hybrid: device hit rate |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, preset in PRESETS.items():
        trace = generate(name, seed=seed)
        slots = max(preset.top_k, int(round(fraction * preset.n_expert)))
        layers = [layer_steps(trace.ids, i) for i in range(trace.ids.shape[1])]
        copy = [adaptive(steps, slots, preset.n_expert) for steps in layers]
        hyb = [hybrid_admission(steps, slots, upload_per_step, payback_uses) for steps in layers]
        t = trace.n_tokens
        mib = preset.bytes_per_slot / 2**20
        lookups = sum(s.lookups for s in hyb)
        lines.append(f"| {name} | {slots} | {sum(s.uploads for s in copy) * mib / t:.1f} | "
                     f"{sum(s.uploads for s in hyb) * mib / t:.1f} | {sum(s.misses for s in hyb) / t:.1f} | "
                     f"{sum(s.hits for s in hyb) / lookups:.1%} |")
    return "\n".join(lines) + "\n"


BANK_HEADER = ("| {what} | slots per layer | per-layer pools: MiB up / token | bank: MiB up / token | "
               "LRU bank (the pin): MiB up / token | LRFU bank (later): MiB up / token | bank / per-layer | "
               "bank / LRU bank | bank / LRFU bank |\n"
               "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def bank_rows(name: str, trace, slot_counts_: list[int]) -> list[str]:
    """A trace's rows of the bank table (Markdown), one per slot count: copy-on-miss at equal memory
    in a pool per layer (the product's adaptive policy), one bank shared by the layers (the same
    policy over (layer, expert)), llama.cpp's cache at the pin (one LRU bank, what the GPU check
    measures) and after it (an LRFU bank). An upload is the mean of the layers' expert bytes."""
    from .policies import adaptive, bank, global_lru, layer_steps, lrfu
    from .replay import layer_slot_bytes

    layers = [layer_steps(trace.ids, i) for i in range(trace.ids.shape[1])]
    slot_bytes = sum(layer_slot_bytes(trace, layer)[1] for layer in trace.layers) / len(trace.layers)
    mib = slot_bytes / 2**20 / trace.n_tokens
    rows = []
    for slots in slot_counts_:
        total = slots * len(layers)
        per_layer = sum(adaptive(steps, slots, trace.n_expert).uploads for steps in layers)
        shared = bank(layers, total).uploads
        at_pin = global_lru(layers, total).uploads
        later = lrfu(layers, total).uploads
        ratios = " | ".join(f"{shared / other if other else 1.0:.2f}" for other in (per_layer, at_pin, later))
        rows.append(f"| {name} | {slots} | {per_layer * mib:.1f} | {shared * mib:.1f} | {at_pin * mib:.1f} | "
                    f"{later * mib:.1f} | {ratios} |")
    return rows


def bank_table(seed: int = 0, fractions: tuple[float, ...] = (0.125, 0.25, 0.5)) -> str:
    """bank_rows() for every preset, the layered ones included, at each fraction of its experts."""
    lines = [BANK_HEADER.format(what="preset")]
    for name, preset in {**PRESETS, **LAYERED_PRESETS}.items():
        lines += bank_rows(name, generate(name, seed=seed), slot_counts(preset, fractions))
    return "\n".join(lines) + "\n"


def bank_trace_table(traces: dict[str, "object"], fractions: tuple[float, ...] = (0.125, 0.25, 0.5)) -> str:
    """bank_rows() for recorded traces (name -> Trace), at each fraction of their experts that holds a
    step's top-k."""
    lines = [BANK_HEADER.format(what="trace")]
    for name, trace in traces.items():
        counts = sorted({max(trace.top_k, int(round(f * trace.n_expert))) for f in fractions})
        lines += bank_rows(name, trace, counts)
    return "\n".join(lines) + "\n"


@dataclass
class BankCalibration:
    """One measured point of a layered preset beside the lab's replay of its synthetic routing."""
    preset: str
    slots: int
    measured_per_layer: float   # hit rate of the pool's per-layer pools on the GPU
    synthetic_per_layer: float  # ... of the product's policy per layer on the preset
    measured_bank: float        # hit rate of llama.cpp's LRU bank on the GPU
    synthetic_bank: float       # ... of an LRU bank (llama.cpp's at the pin) on the preset

    def miss_ratio(self, measured: bool) -> float:
        """The bank's misses as a share of the per-layer pools'."""
        bank, per_layer = ((self.measured_bank, self.measured_per_layer) if measured
                           else (self.synthetic_bank, self.synthetic_per_layer))
        return (1.0 - bank) / (1.0 - per_layer)


def bank_calibration(seed: int = 0) -> list[BankCalibration]:
    """Each layered preset's measured points against what the lab replays on its routing."""
    from .policies import adaptive, global_lru, layer_steps

    out = []
    for name, preset in LAYERED_PRESETS.items():
        trace = generate(name, seed=seed)
        layers = [layer_steps(trace.ids, i) for i in range(trace.ids.shape[1])]
        for slots, per_layer, shared in preset.measured:
            pools = [adaptive(steps, slots, preset.n_expert) for steps in layers]
            lru_bank = global_lru(layers, slots * len(layers))
            out.append(BankCalibration(name, slots, per_layer, sum(p.hits for p in pools) / sum(p.lookups for p in pools),
                                       shared, lru_bank.hits / lru_bank.lookups))
    return out


def bank_calibration_table(seed: int = 0) -> str:
    """bank_calibration() as docs/policy-lab.md shows it (Markdown)."""
    lines = ["| slots per layer | per-layer pools: H200 / lab | LRU bank: H200 / lab | "
             "bank's misses / per-layer's: H200 / lab |",
             "| ---: | ---: | ---: | ---: |"]
    for c in bank_calibration(seed):
        lines.append(f"| {c.slots} | {c.measured_per_layer:.1%} / {c.synthetic_per_layer:.1%} | "
                     f"{c.measured_bank:.1%} / {c.synthetic_bank:.1%} | "
                     f"{c.miss_ratio(True):.2f} / {c.miss_ratio(False):.2f} |")
    return "\n".join(lines) + "\n"


#: the machine the modes table prices placement and prefetch on: an RTX 3090 on PCIe 4.0 running a
#: model with the anchors' shape (48 host-expert layers, ~20 ms of the device's own work per token, as
#: the multi-GPU fork reports); routing, experts, top-k and expert bytes are the preset's
MODES_PROFILE = "rtx3090-pcie4"
MODES_HOST_LAYERS = 48
MODES_DENSE_MS = 20.0
#: the columns: ours (copy-on-miss, hybrid before placement, placement without and with prefetch),
#: llama.cpp's cache as it stands (LRFU; a CPU share of the misses at three shares), and the offline
#: optimum for a copy-on-miss cache
MODES_COLUMNS = ("copy", "hybrid-cpu", "hybrid-no-prefetch", "hybrid", "lrfu", "cpu-share 0.25", "cpu-share 0.5",
                 "cpu-share 0.75", "opt")


@dataclass
class ModesRow:
    preset: str
    slots: int
    slot_fraction: float
    mode: str
    upload_mib_per_token: float
    cpu_experts_per_token: float
    tokens_per_s: float | None   # predicted on MODES_PROFILE; None for OPT (a bound on bytes, not a mode)


def modes_rows(presets: list[str] | None = None, fractions: tuple[float, ...] = (0.125, 0.25, 0.5), seed: int = 0,
               overlap: float | None = None) -> list[ModesRow]:
    """Every mode side by side on every preset and slot fraction: MiB uploaded and expert computations
    on the CPU per token of a 48-layer model, replayed on the preset's routing; placement, prefetch
    and the upload budget priced on MODES_PROFILE. Prefetch draws its predictions at `overlap` (the
    published 0.61 by default): the presets route each layer on its own, so there is nothing to
    predict from in them."""
    from . import predict as P
    from .policies import belady, layer_steps
    from .prefetch import PUBLISHED_OVERLAP

    overlap = PUBLISHED_OVERLAP if overlap is None else overlap
    profile = P.PROFILES[MODES_PROFILE]
    rows: list[ModesRow] = []
    for name in presets or list(PRESETS):
        preset = PRESETS[name]
        routing = P.Routing.from_preset(name, seed)
        g = P.Geometry(name, MODES_HOST_LAYERS, preset.n_expert, preset.top_k, preset.bytes_per_slot, MODES_DENSE_MS)
        for slots in slot_counts(preset, fractions):
            ours = P.predict(g, profile, routing, slots, prefetch_overlap=overlap,
                             modes=("copy", P.HYBRID_CPU, P.HYBRID_NO_PREFETCH, "hybrid", "lrfu"))
            shares = [replace_mode(r, f"cpu-share {f:g}") for f in P.UPSTREAM_CPU_SHARES
                      for r in P.predict(g, profile, routing, slots, modes=("cpu-share",), cpu_shares=(f,))]
            for r in ours + shares:
                rows.append(ModesRow(name, slots, slots / preset.n_expert, r.mode, r.upload_mib, r.cpu_experts,
                                     r.tokens_per_s))
            opt = [belady(layer_steps(routing_trace_ids(routing), li), slots) for li in range(len(routing.layers))]
            lookups = sum(s.lookups for s in opt)
            per_lookup = sum(s.uploads for s in opt) / lookups if lookups else 0.0
            k = routing.lookups_per_layer_step()
            rows.append(ModesRow(name, slots, slots / preset.n_expert, "opt",
                                 MODES_HOST_LAYERS * k * per_lookup * preset.bytes_per_slot / 2**20, 0.0, None))
    return rows


def replace_mode(row, mode: str):
    """A prediction row under another mode name (one cpu-share setting among several)."""
    from dataclasses import replace
    return replace(row, mode=mode)


def routing_trace_ids(routing) -> np.ndarray:
    """A Routing's steps back as trace ids [tokens, layers, top_k] (its layers have equal lengths)."""
    return np.array([[routing.layers[li][t] for li in range(len(routing.layers))]
                     for t in range(len(routing.layers[0]))])


def modes_markdown(rows: list[ModesRow]) -> str:
    """`modes_rows` as docs/policy-lab.md's table: per preset and slot count, MiB uploaded / CPU experts
    per token for each column, and predicted t/s on MODES_PROFILE."""
    lines = ["| preset | slots | " + " | ".join(MODES_COLUMNS) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in MODES_COLUMNS) + " |"]
    cells: dict[tuple[str, int], dict[str, ModesRow]] = {}
    for r in rows:
        cells.setdefault((r.preset, r.slots), {})[r.mode] = r
    for (preset, slots), by_mode in cells.items():
        out = []
        for mode in MODES_COLUMNS:
            r = by_mode[mode]
            tps = "" if r.tokens_per_s is None else f", {r.tokens_per_s:.1f} t/s"
            out.append(f"{r.upload_mib_per_token:.0f} / {r.cpu_experts_per_token:.0f}{tps}")
        lines.append(f"| {preset} | {slots} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"
