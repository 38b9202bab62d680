"""The cost model (`pyllamapool predict`): its laws, its reference policies, its inputs, its checks
against published results, and its command line."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pyllamapool.lab import predict as P
from pyllamapool.errors import PyllamapoolError
from pyllamapool.lab import bench, policies, synth
from pyllamapool.run.trace import expert_bytes_from_gguf

ROOT = Path(__file__).resolve().parent.parent
GEOMETRY = P.Geometry("test", n_host_layers=48, n_expert=128, top_k=8, expert_bytes=2 << 20, dense_ms=20.0)


@pytest.fixture(scope="module")
def routing() -> P.Routing:
    return P.Routing.from_preset("qwen3-30b-a3b", 0, n_tokens=400)


def by_mode(rows: list[P.ModePrediction]) -> dict[str, P.ModePrediction]:
    return {r.mode: r for r in rows}


def test_without_slots_every_mode_is_the_stock_path(routing):
    rows = by_mode(P.predict(GEOMETRY, P.PROFILES["rtx3090-pcie4"], routing, 0))
    assert {r.ms_per_token for r in rows.values()} == {rows["stock"].ms_per_token}
    assert all(r.upload_mib == 0 for r in rows.values())


def test_stock_computes_every_routed_expert_of_a_host_layer_on_the_cpu(routing):
    stock = by_mode(P.predict(GEOMETRY, P.PROFILES["rtx3090-pcie4"], routing, 32))["stock"]
    assert stock.cpu_experts == pytest.approx(48 * 8)
    cpu = 48 * 8 * (2 << 20) / 44.0 * 1e-6
    assert stock.parts_ms["cpu_experts"] == pytest.approx(cpu, abs=1e-3)
    assert stock.ms_per_token == pytest.approx(20.0 + cpu + 48 * 0.020, abs=1e-2)


def test_more_slots_copy_fewer_bytes_and_decode_faster(routing):
    prof = P.PROFILES["rtx3090-pcie4"]
    copy = [by_mode(P.predict(GEOMETRY, prof, routing, s, modes=("copy",)))["copy"] for s in (8, 16, 32, 64, 128)]
    assert [c.upload_mib for c in copy] == sorted((c.upload_mib for c in copy), reverse=True)
    assert [c.tokens_per_s for c in copy] == sorted(c.tokens_per_s for c in copy)
    # room for every expert: only first uses miss
    cold = sum(len({e for step in steps for e in step}) for steps in routing.layers)
    lookups = sum(len(set(step)) for steps in routing.layers for step in steps)
    assert copy[-1].hit_rate == pytest.approx(1 - cold / lookups)


def test_copy_on_miss_breaks_even_where_an_upload_costs_what_its_misses_save():
    """routing-locality.md: copy-on-miss pays only above h* ~ 1 - (CPU time per expert / upload time
    per expert); over PCIe 3.0 with an 8-channel DDR4 host that is ~90%."""
    prof = P.PROFILES["pcie3-ddr4-8ch"]
    g = GEOMETRY
    stock_tps = 1000.0 / (g.dense_ms + g.n_host_layers * g.top_k * g.expert_bytes / prof.host_expert_gb_s * 1e-6
                          + g.n_host_layers * prof.sync_us / 1000)
    h = P._hit_rate_needed(g, prof, "copy", stock_tps, pinned=True)
    cpu_e = g.expert_bytes / prof.host_expert_gb_s
    up_e = g.expert_bytes / prof.pcie_gb_s + 3 * prof.copy_latency_us * 1e3
    dev_e = g.expert_bytes / prof.device_gb_s
    assert h == pytest.approx(1 - (cpu_e - dev_e) / up_e, abs=1e-6)
    assert 0.85 < h < 0.95


@pytest.mark.parametrize("profile", sorted(P.PROFILES))
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "glm-chat-shift", "uniform"])
def test_hybrid_is_never_slower_than_stock_and_never_waits_for_an_upload(profile, preset):
    routing = P.Routing.from_preset(preset, 1, n_tokens=300, n_expert=128, top_k=8)
    for slots in (8, 32, 96):
        rows = by_mode(P.predict(GEOMETRY, P.PROFILES[profile], routing, slots, modes=("stock", "hybrid")))
        assert rows["hybrid"].ms_per_token <= rows["stock"].ms_per_token + 1e-9
        assert "uploads" not in rows["hybrid"].parts_ms
        assert rows["hybrid"].cpu_experts <= rows["stock"].cpu_experts


def test_hybrid_admission_keeps_to_its_upload_budget_and_only_evicts_for_a_payback():
    steps = policies.layer_steps(synth.generate("glm-chat-shift", 0, n_tokens=600).ids, 0)
    for per_step in (0.1, 0.5, 2.0):
        s = policies.hybrid_admission(steps, 32, per_step, payback_uses=2)
        assert s.uploads <= per_step * len(steps) + 1
        assert s.hits + s.misses == s.lookups and s.evictions <= s.uploads
    # an upload that never pays back fills the empty slots and then never evicts
    s = policies.hybrid_admission(steps, 32, 10.0, payback_uses=10**6)
    assert s.uploads == 32 and s.evictions == 0
    # a tighter budget defers admissions that would pay
    assert policies.hybrid_admission(steps, 32, 0.05, payback_uses=1).deferred > 0


def test_the_merged_caches_global_lru_shares_its_slots_between_layers():
    trace = synth.generate("qwen3-30b-a3b", 0, n_tokens=300)
    layers = [policies.layer_steps(trace.ids, i) for i in range(trace.ids.shape[1])]
    # one layer: the same as a per-layer LRU
    assert policies.global_lru(layers[:1], 24).misses == policies.lru(layers[0], 24).misses
    # room for everything: only first uses miss
    everything = policies.global_lru(layers, len(layers) * trace.n_expert)
    assert everything.misses == sum(len({e for step in steps for e in step}) for steps in layers)
    assert everything.evictions == 0
    # a shared budget lets a busy layer take slots from a quiet one
    shared = policies.global_lru(layers, 24 * len(layers))
    assert shared.lookups == sum(policies.lru(steps, 24).lookups for steps in layers)


def test_upstreams_lrfu_keeps_a_frequently_used_expert_through_a_scan_that_lru_lets_evict_it():
    """Two entries, expert 0 every third token and a new expert on the others: LRU evicts 0 each time
    two new experts come in; LRFU's frequency class keeps it once its score reaches 2 (class 1): after
    its third use, as each use's 1 has decayed a little by the next."""
    steps = [[0] if t % 3 == 0 else [100 + t] for t in range(300)]
    lru, lrfu = policies.global_lru([steps], 2), policies.lrfu([steps], 2)
    assert lru.hits == 0
    assert lrfu.hits == 100 - 3
    assert lrfu.hits + lrfu.misses == lrfu.lookups and lrfu.uploads == lrfu.misses and lrfu.cpu == 0


def test_upstreams_cpu_share_sends_that_share_of_the_misses_to_the_cpu_once_the_cache_is_full():
    trace = synth.generate("glm-chat-shift", 0, n_tokens=300)
    layers = [policies.layer_steps(trace.ids, i) for i in range(trace.ids.shape[1])]
    plain = policies.lrfu(layers, 32 * len(layers))
    assert plain == policies.lrfu(layers, 32 * len(layers), cpu_share=0.0)
    for share in (0.25, 0.5, 1.0):
        s = policies.lrfu(layers, 32 * len(layers), cpu_share=share)
        assert s.uploads + s.cpu == s.misses and s.hits + s.misses == s.lookups
        after_full = s.misses - 32 * len(layers)  # the first misses fill the empty slots
        assert s.cpu == pytest.approx(share * after_full, abs=1.0)
    assert policies.lrfu(layers, 32 * len(layers), cpu_share=1.0).uploads == 32 * len(layers)
    # room for everything: only first uses miss, nothing is evicted
    everything = policies.lrfu(layers, len(layers) * trace.n_expert)
    assert everything.misses == sum(len({e for step in steps for e in step}) for steps in layers)
    assert everything.evictions == 0
    with pytest.raises(ValueError, match="0 <= F <= 1"):
        policies.lrfu(layers, 32, cpu_share=1.5)


def test_per_miss_placement_uploads_misses_while_the_device_side_is_the_shorter_one():
    from pyllamapool.lab.placement import cost_placement, uploads_now

    assert uploads_now(0, 8, cpu_ms=1.0, dev_ms=0.1, up_ms=100.0) == 0   # a slow link: today's hybrid
    assert uploads_now(0, 8, cpu_ms=1.0, dev_ms=0.01, up_ms=0.09) == 8   # a slow host: copy mode
    # in between it evens the sides out: 2 hits + u uploads at 0.5 ms against (8 - u) misses at 1 ms
    assert uploads_now(2, 8, cpu_ms=1.0, dev_ms=0.1, up_ms=0.4) == 5
    steps = policies.layer_steps(synth.generate("glm-chat-shift", 0, n_tokens=300).ids, 0)
    today = policies.hybrid_admission(steps, 32, 0.5, 2.0)
    slow_link = cost_placement(steps, 32, 1.0, 0.1, 100.0, 0.5, 2.0)
    assert slow_link == today and today.uploaded_now == 0 and today.cpu == today.misses
    fast_link = cost_placement(steps, 32, 1.0, 0.01, 0.09, 0.5, 2.0)
    assert fast_link.uploaded_now == fast_link.misses and fast_link.cpu == 0
    assert fast_link.hit_rate > today.hit_rate


def test_prefetch_pays_where_the_link_has_room_and_costs_little_when_the_prediction_is_useless():
    """The lab's prefetch rule over every anchor's machine and a few presets: a prediction that names
    61% of a step's experts (the published figure) never loses and gains where the link idles during
    the device's own work; one that names nothing costs at most 1% (its guesses evict only experts
    nobody used more lately); behind an x4 eGPU link there is no room, and it does nothing."""
    gains: dict[tuple, float] = {}
    for name, prof, g, slots, routing, preset in P.auto_cases():
        if preset not in ("qwen3.8-flash-next", "glm-chat-shift"):
            continue
        for overlap in (0.01, 0.61):
            m = {r.mode: r for r in P.predict(g, P.PROFILES[prof], routing, slots, prefetch_overlap=overlap,
                                              modes=("hybrid", P.HYBRID_NO_PREFETCH))}
            gains[(name, preset, overlap)] = m["hybrid"].tokens_per_s / m[P.HYBRID_NO_PREFETCH].tokens_per_s
            if overlap == 0.61:
                assert "prefetch" in m["hybrid"].setting and "precision" in m["hybrid"].setting
    assert all(gain >= 0.99 for (_, _, overlap), gain in gains.items() if overlap == 0.01), gains
    assert all(gain >= 1.0 for (_, _, overlap), gain in gains.items() if overlap == 0.61), gains
    assert max(gains.values()) > 1.05
    assert all(gain == pytest.approx(1.0, abs=1e-9) for (name, _, _), gain in gains.items() if "eGPU" in name)
    with pytest.raises(PyllamapoolError, match="prefetch overlap 1.5"):
        P.predict(GEOMETRY, P.PROFILES["rtx3090-pcie4"], P.Routing.from_preset("uniform", 0, n_tokens=20), 8,
                  prefetch_overlap=1.5)


def test_a_prefetch_takes_the_links_room_and_only_slots_used_no_more_lately():
    """lab.prefetch's rule on a hand-made layer: a predicted miss goes up only while the link has room,
    into an empty slot or the slot of a resident used no more often lately than the candidate."""
    from pyllamapool.lab.policies import HybridStats
    from pyllamapool.lab.prefetch import Prefetch, synthetic

    s = HybridStats()
    resident = {1, 2, 3}
    uses, last = {1: 3, 2: 0, 3: 1, 7: 1}, {1: 5, 2: 1, 3: 4, 7: 2}
    ahead = Prefetch([[7, 8, 9]], window_uploads=3.0).run(0, [7, 8], resident, uses, last, 4, 1, s)
    # room for two (3 less the 1 the link carried): 7 (used lately) takes the empty slot, 8 evicts 2 (no use)
    assert ahead == {7, 8} and resident == {1, 3, 7, 8}
    assert (s.predicted, s.predicted_used, s.prefetched, s.uploads, s.evictions) == (3, 2, 2, 2, 1)
    # a full pool whose residents were all used more lately than a newcomer takes none
    busy = {1, 3}
    assert Prefetch([[9]]).run(0, [9], busy, {1: 2, 3: 2}, {}, 2, 0, HybridStats()) == set() and busy == {1, 3}
    named = synthetic([[0, 1, 2, 3]] * 200, 0.5, 64, seed=1)
    right = sum(len(set(p) & {0, 1, 2, 3}) for p in named) / (4 * len(named))
    assert all(len(p) == 4 for p in named) and 0.4 < right < 0.6
    with pytest.raises(ValueError, match="overlap 2"):
        synthetic([[0]], 2, 8)


def test_the_side_by_side_table_sets_every_mode_beside_upstreams_cache():
    """Ours against llama.cpp's cache as merged and as it stands (LRFU, the CPU share at its best),
    on every anchor's machine and preset: the default mode (hybrid, misses placed by cost), and hybrid
    with the CPU computing every miss, each against the fastest of stock, copy and upstream's modes."""
    rows = P.peers_rows()
    assert len(rows) == (len(P.ANCHORS) + 1) * len(synth.PRESETS)
    for r in rows:
        others = [r[m] for m in ("stock", "copy", *P.UPSTREAM_MODES)]
        assert r[r["best_other"]] == max(others) and r["default"] == "hybrid"
        # the CPU share is the best of the shares the tuner tries, and names the one it picked
        assert r["cpu_share_setting"] in {f"cpu-share {f:g}" for f in P.UPSTREAM_CPU_SHARES}
        # placement by cost contains the CPU rule (no upload pays): it is never far below it. It can be
        # a little below: a placed miss takes the slot of a resident that would have paid back later
        assert r["hybrid"] >= 0.96 * r[P.HYBRID_CPU], r
    # where the host is slow and the link fast, the CPU rule falls behind; placement closes most of the
    # gap and prefetch the rest
    slow_host = [r for r in rows if r["machine"] == "4090-qwen38-curve"]
    assert min(r[P.HYBRID_CPU] / r[r["best_other"]] for r in slow_host) < 0.7
    assert min(r[P.HYBRID_NO_PREFETCH] / r[r["best_other"]] for r in slow_host) > 0.93
    # the default is at least the best of stock, copy and upstream's modes everywhere, within 2%
    assert all(r["hybrid"] >= 0.98 * r[r["best_other"]] for r in rows)
    assert all(r["hybrid"] >= 0.99 * r[P.HYBRID_NO_PREFETCH] for r in rows)
    # where the link is slow nothing is placed: the two rules are the same
    slow_link = [r for r in rows if r["machine"] == "2x3090-glm53 on an x4 eGPU"]
    assert all(r["hybrid"] == pytest.approx(r[P.HYBRID_CPU], rel=1e-12) for r in slow_link)
    assert P.peers_markdown() in (ROOT / "docs" / "predict.md").read_text()


def test_geometry_from_a_gguf_header(qwen3_model):
    prof = P.PROFILES["rtx3090-pcie4"]
    g = P.geometry_from_gguf(qwen3_model, prof)
    per_layer = expert_bytes_from_gguf(qwen3_model)
    assert g.n_host_layers == len(per_layer) and (g.n_expert, g.top_k) == (16, 4)
    assert g.expert_bytes == max(sum(p.values()) for p in per_layer.values()) and g.n_expert_tensors == 3
    assert g.dense_ms > 0
    with pytest.raises(PyllamapoolError, match=f"the model has {len(per_layer)} MoE layers"):
        P.geometry_from_gguf(qwen3_model, prof, n_host_layers=len(per_layer) + 1)


def test_a_measured_stock_speed_calibrates_the_device_time(qwen3_model, routing):
    prof = P.PROFILES["rtx3090-pcie4"]
    g = P.geometry_from_gguf(qwen3_model, prof, stock_tps=250.0)
    r = P.Routing.from_preset("qwen3-30b-a3b", 0, n_tokens=100, n_expert=g.n_expert, top_k=g.top_k)
    assert by_mode(P.predict(g, prof, r, 4))["stock"].tokens_per_s == pytest.approx(250.0)
    with pytest.raises(PyllamapoolError, match="exceeds that token time"):
        P.geometry_from_gguf(qwen3_model, replace(prof, host_expert_gb_s=1e-6), stock_tps=250.0)


def test_bad_inputs_name_the_value_and_what_is_accepted(routing):
    prof = P.PROFILES["rtx3090-pcie4"]
    with pytest.raises(PyllamapoolError, match="unknown mode turbo; modes: stock, copy"):
        P.predict(GEOMETRY, prof, routing, 8, modes=("turbo",))
    with pytest.raises(PyllamapoolError, match="upload fraction 0: accepted is 0 < f <= 1"):
        P.predict(GEOMETRY, prof, routing, 8, upload_frac=0)
    with pytest.raises(PyllamapoolError, match="pcie_gb_s must be > 0"):
        replace(prof, pcie_gb_s=0)
    with pytest.raises(PyllamapoolError, match="built-in are mi50-pcie3"):
        P.parse_profile("gtx480")


def test_a_gpu_check_report_is_a_profile():
    prof = P.HardwareProfile.from_gpu_check(ROOT / "benchmarks" / "results" / "gpu-check-h200-small.json")
    report = json.loads((ROOT / "benchmarks" / "results" / "gpu-check-h200-small.json").read_text())
    assert prof.pcie_gb_s == report["upload"]["pinned_gb_s"]
    assert prof.pageable_gb_s == report["upload"]["pageable_gb_s"]
    assert prof.copy_latency_us == report["upload"]["copy_latency_us_64k"]
    # the host's cost per expert of the check's model, as a throughput
    expert_bytes = 3 * (1024 * 256 // 256 * 144)  # Q4_K: 144 bytes per 256 weights
    assert prof.host_expert_gb_s == pytest.approx(expert_bytes / (report["host_expert_ms"] * 1e-3) / 1e9)


def test_a_gpu_check_profile_gives_stock_the_resident_runs_device_time():
    """The host's cost per expert is what the stock run spends beyond the all-resident one, less a
    round trip per host layer: calibrated back on the stock run, the device's own time is the
    resident run's (at Qwen3-30B-A3B's shape the whole gap had been given to the experts, which
    left the device no time at all and the check no prediction)."""
    path = ROOT / "benchmarks" / "results" / "gpu-check-h200-qwen3-30b-a3b.json"
    report = json.loads(path.read_text())
    prof = P.HardwareProfile.from_gpu_check(path)
    spec = report["spec"]
    rows = {r["mode"]: r for r in report["rows"] if r["step"] in ("first-card", "resident")}
    g = P.Geometry("check", spec["n_layer"], spec["n_expert"], spec["n_expert_used"],
                   P._expert_bytes_of_spec(spec), dense_ms=1.0)
    dense = P.dense_ms_from_stock(rows["stock"]["decode_tps"], g.n_host_layers, g.top_k, P.expert_costs(g, prof))
    assert dense == pytest.approx(1000.0 / rows["resident"]["decode_tps"], rel=1e-9)


def test_the_single_workload_qwen_preset_matches_its_published_hit_rates():
    for _, slots, published, synthetic in bench.lru_calibration(["qwen3.8-flash-next-hot"]):
        assert abs(published - synthetic) < 0.05, (slots, published, synthetic)


def test_validation_states_every_anchors_error_and_explains_each_miss_beyond_20_percent():
    rows = P.validate()
    assert {r.anchor for r in rows} == {a.name for a in P.ANCHORS}
    for r in rows:
        assert math.isfinite(r.error) and r.predicted_tps > 0
        best = r.error if r.error_at_published_hits is None else r.error_at_published_hits
        if abs(best) > 0.20:
            assert len(r.note) > 40, r
    # the measured figure lies within the model's reach at some hit rate, except where the note says not
    for r in rows:
        assert r.hit_rate_needed is not None or "out of the model's reach" in r.note, r


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllamapool", "predict", *args], capture_output=True,
                          text=True, timeout=300)


def test_the_command_prints_every_mode_per_slot_count(qwen3_model):
    result = run_cli(str(qwen3_model), "--profile", "rtx3090-pcie4", "-mec", "4,8")
    assert result.returncode == 0, result.stderr
    for mode in ("stock", "copy", "hybrid", "device", "bank", "merged-lru", "lrfu", "cpu-share", "auto"):
        assert mode in result.stdout
    out = json.loads(run_cli(str(qwen3_model), "-mec", "4,8", "--json").stdout)
    assert out["schema"] == "pyllamapool.predict/1"
    assert [(r["mode"], r["slots"]) for r in out["rows"]][:6] == [("stock", 4), ("copy", 4), ("hybrid", 4),
                                                                 ("device", 4), ("bank", 4), ("merged-lru", 4)]
    # stock once, then copy, hybrid, the device's path, the bank, merged-lru, lrfu, cpu-share and auto at each
    assert len(out["rows"]) == 17


def test_the_command_validates_and_refuses_what_it_cannot_use(qwen3_model):
    result = run_cli("--validate")
    assert result.returncode == 0 and all(a.name in result.stdout for a in P.ANCHORS)
    bad = run_cli(str(qwen3_model), "--profile", "gtx480")
    assert bad.returncode != 0 and "built-in are" in bad.stderr
    assert "needs a model" in run_cli().stderr


def test_measure_host_times_the_cpus_expert_matmul():
    from pyllamapool.run.measure import measure_host

    small = measure_host("Q4_K", 256, 256, threads=1, working_set_mib=16, seconds=0.2)
    assert small.expert_bytes == 3 * (256 * 256 // 256 * 144)
    assert small.ms_per_expert > 0 and small.gb_per_s == pytest.approx(
        small.expert_bytes / (small.ms_per_expert * 1e-3) / 1e9)
    with pytest.raises(PyllamapoolError, match="unknown expert type 'Q9_K'"):
        measure_host("Q9_K")
    with pytest.raises(PyllamapoolError, match="needs a multiple of 256"):
        measure_host("Q4_K", 200, 256)


def test_the_predict_page_shows_the_validation_and_the_predicted_modes_as_computed():
    readme = (ROOT / "docs" / "predict.md").read_text()
    assert P.validation_markdown() in readme
    assert P.readme_table() in readme


def test_the_readmes_which_mode_table_quotes_the_predicted_modes():
    """The README's short card table carries the ratios docs/predict.md computes for each anchor:
    hybrid with pinned experts, hybrid from mmap'd pages, and copy."""
    readme = (ROOT / "README.md").read_text()
    rows: dict[str, list[tuple[float, float, float]]] = {}
    for line in P.readme_table().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        ratio = lambda cell: float(cell.split("(")[1].rstrip("x)"))  # noqa: E731
        rows.setdefault(cells[0], []).append((ratio(cells[3]), ratio(cells[4]), ratio(cells[5])))

    def span(values: list[float]) -> str:
        lo, hi = min(values), max(values)
        return f"{lo:.2f}x" if lo == hi else f"{lo:.2f}-{hi:.2f}x"

    quoted = {"mi50-qwen38": "MI50", "2x3090-glm53": "2x RTX 3090", "pcie3-ddr4-regression": "8-channel DDR4",
              "4090-qwen38-curve": "RTX 4090"}
    for anchor, machine in quoted.items():
        line = next(l for l in readme.splitlines() if l.startswith("|") and machine in l)
        copy, mapped, pinned = ([r[i] for r in rows[anchor]] for i in range(3))
        assert f"hybrid {span(pinned)} pinned, {span(mapped)} mmap'd; copy {span(copy)}" in line, (anchor, line)
        # the choice the table names wins at every slot count of that machine
        assert all(p >= max(c, m) for c, m, p in rows[anchor]) and "| hybrid, experts pinned |" in line, (anchor, line)


def test_auto_plays_the_arbiters_rules_faster_side_first_probes_cheap():
    """lab.arbiter plays -mec auto's rules with fixed step times: the faster side runs nearly every
    step of a reply, and the slower side's probes cost a few percent (stock's first sample is free)."""
    from pyllamapool.lab.arbiter import GENERATION, play

    for ratio in (0.4, 0.7, 1.5, 2.5):
        run = play(10.0 * ratio, 10.0)
        best, worst = min(10.0, 10.0 * ratio), max(10.0, 10.0 * ratio)
        assert run.holder == ("pool" if ratio < 1 else "stock")
        assert best <= run.ms_per_token <= best + 0.07 * (worst - best) + 0.06 * best, ratio
    tie = play(10.0, 10.0)
    assert tie.holder == "stock" and tie.ms_per_token == pytest.approx(10.0)  # a tie keeps the stock path
    assert play(5.0, 10.0, 16).stock_share == 10 / 16  # stock's warm-up and sample come first
    with pytest.raises(ValueError, match="must be > 0"):
        play(0.0, 10.0, GENERATION)


def test_predicted_auto_is_never_below_stock_and_close_to_the_faster_side_everywhere():
    """On every anchor's machine (and the 2x3090 behind an eGPU) under every routing preset."""
    rows = P.auto_rows()
    assert len(rows) == (len(P.ANCHORS) + 1) * len(synth.PRESETS)  # every machine, every preset
    for r in rows:
        assert r["auto"] >= 0.98 * r["stock"], r
        assert r["auto"] >= 0.9 * max(r["stock"], r["hybrid"]), r


def test_the_auto_page_shows_the_predicted_table_as_computed():
    assert P.auto_markdown() in (ROOT / "docs" / "auto.md").read_text()


def test_the_devices_path_waits_once_a_token_and_needs_pinned_experts():
    """The device-side path: LRU on the device, the misses read over the pinned link by a kernel, no
    round trip per layer (one a token), two kernel launches a layer. At the same hit rate it beats copy
    mode by copy's round trips and copy latencies; where the experts stay pageable the device cannot
    read them in place and the host serves: copy mode's row."""
    routing = P.Routing.from_preset("qwen3-30b-a3b", 0, n_tokens=200)
    for name, prof in P.PROFILES.items():
        for slots in (16, 64):
            rows = by_mode(P.predict(GEOMETRY, prof, routing, slots, modes=("copy", "device")))
            device, copy = rows["device"], rows["copy"]
            assert device.parts_ms["syncs"] == pytest.approx(prof.sync_us / 1000, abs=1e-3)  # parts are rounded
            assert device.parts_ms["launches"] == pytest.approx(GEOMETRY.n_host_layers * P.FETCH_LAUNCH_US / 1000, abs=1e-3)
            same_hits = P._tps_at_hit_rate(GEOMETRY, prof, "device", copy.hit_rate, True)
            assert same_hits > P._tps_at_hit_rate(GEOMETRY, prof, "copy", copy.hit_rate, True), name
            host = by_mode(P.predict(GEOMETRY, prof, routing, slots, modes=("copy", "device"), pinned=False))
            assert host["device"].ms_per_token == host["copy"].ms_per_token and host["device"].setting


def test_a_file_whose_layers_mix_types_is_priced_as_a_bank_per_layout(make_model):
    """A file whose ffn_down_exps mixes types (as Q4_K_M does): its geometry knows each layer's layout,
    and the bank mode replays a bank per layout, a layer alone in its layout keeping its own pool, as
    the product makes them; on either path."""
    from pyllamapool.lab import policies

    from pyllamapool.run.testmodel import ModelSpec, spec_of

    path = make_model(n_layer=5, down_types=("F16", "Q8_0", "Q8_0", "F16", "F32"))
    assert spec_of(path) == ModelSpec(n_layer=5, down_types=("F16", "Q8_0", "Q8_0", "F16", "F32"))
    prof = P.PROFILES["h200-pcie5"]
    g = P.geometry_from_gguf(path, prof)
    assert g.layouts == (0, 1, 1, 0, 2)
    routing = P.Routing.from_preset("qwen3-30b-a3b", 0, n_tokens=200, n_expert=16, top_k=4, n_layer=5)
    L = routing.layers
    for slots in (4, 8):
        pinned = by_mode(P.predict(g, prof, routing, slots, modes=("bank",)))["bank"]
        stats = [policies.global_lru([L[0], L[3]], 2 * slots), policies.global_lru([L[1], L[2]], 2 * slots),
                 policies.lru(L[4], slots)]
        assert pinned.hit_rate == sum(s.hits for s in stats) / sum(s.lookups for s in stats)
        assert pinned.setting == "device (an LRU bank, 3 layouts)"
        host = by_mode(P.predict(g, prof, routing, slots, modes=("bank",), pinned=False))["bank"]
        stats = [policies.bank([L[0], L[3]], 2 * slots), policies.bank([L[1], L[2]], 2 * slots),
                 policies.adaptive(L[4], slots, 16)]
        assert host.hit_rate == sum(s.hits for s in stats) / sum(s.lookups for s in stats)
    # a routing of another depth than the file's host layers is one bank, as before
    other = P.Routing.from_preset("qwen3-30b-a3b", 0, n_tokens=50, n_expert=16, top_k=4, n_layer=4)
    assert P.bank_groups(g, len(other.layers)) == ((0, 1, 2, 3),)


def test_a_bank_is_priced_on_the_banks_own_replay_on_either_path():
    """The bank mode prices copy mode's slots as one bank over (layer, expert): with pinned experts the
    device's path over an LRU bank (llama.cpp's cache's hit rate at the pin, the device's costs), with
    pageable ones the host's copy mode over the product's adaptive bank. Each is the per-layer row's
    cost at the bank's own hit rate, and the bytes follow that hit rate."""
    from pyllamapool.lab import policies

    routing = P.Routing.from_preset("qwen3-30b-a3b", 0, n_tokens=200)
    prof = P.PROFILES["h200-pcie5"]
    for slots in (16, 64):
        total = slots * len(routing.layers)
        pinned = by_mode(P.predict(GEOMETRY, prof, routing, slots, modes=("device", "bank", "merged-lru")))
        assert pinned["bank"].hit_rate == pinned["merged-lru"].hit_rate == \
            policies.global_lru(routing.layers, total).hit_rate
        assert pinned["bank"].tokens_per_s == pytest.approx(
            P._tps_at_hit_rate(GEOMETRY, prof, "device", pinned["bank"].hit_rate, True))
        assert pinned["bank"].setting.startswith("device")
        host = by_mode(P.predict(GEOMETRY, prof, routing, slots, modes=("copy", "bank"), pinned=False))
        assert host["bank"].hit_rate == policies.bank(routing.layers, total).hit_rate
        assert host["bank"].tokens_per_s == pytest.approx(
            P._tps_at_hit_rate(GEOMETRY, prof, "copy", host["bank"].hit_rate, False))
        # fewer hits, more bytes: the bytes are the hit rate's
        for rows in (pinned, host):
            other = rows.get("device", rows.get("copy"))
            assert (rows["bank"].hit_rate > other.hit_rate) == (rows["bank"].upload_mib < other.upload_mib)
