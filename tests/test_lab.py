"""The policy lab: synthetic traces, reference policies, Belady's optimum, the benchmark's rows."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyllamapool.errors import PyllamapoolError
from pyllamapool.lab import bench, synth
from pyllamapool.lab.policies import (POLICIES, PolicyStep, adaptive, belady, brute_force_min_misses, layer_steps,
                                      recency)
from pyllamapool.binding.pool import Policy
from pyllamapool.lab.replay import replay_product
from pyllamapool.lab.synth import PRESETS, generate
from pyllamapool.run.trace import Trace, locality

ROOT = Path(__file__).resolve().parent.parent


def random_steps(rng, n_expert, top_k, n_steps):
    return [rng.choice(n_expert, size=top_k, replace=False).tolist() for _ in range(n_steps)]


def test_opt_equals_the_brute_force_optimum_on_tiny_traces():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n_expert = int(rng.integers(3, 7))
        top_k = int(rng.integers(1, 3))
        n_slots = int(rng.integers(top_k, n_expert + 1))
        steps = random_steps(rng, n_expert, top_k, int(rng.integers(3, 10)))
        assert belady(steps, n_slots).misses == brute_force_min_misses(steps, n_slots)


def trace_of(steps, n_expert, top_k) -> Trace:
    return Trace(np.asarray(steps, dtype=np.int32)[:, None, :], [0], n_expert, top_k)


def test_opt_never_misses_more_than_any_policy():
    rng = np.random.default_rng(1)
    for _ in range(40):
        n_expert = int(rng.integers(4, 24))
        top_k = int(rng.integers(1, 4))
        n_slots = int(rng.integers(top_k, n_expert + 1))
        steps = random_steps(rng, n_expert, top_k, 120)
        opt = belady(steps, n_slots).misses
        # OPT is the bound for policies that must admit every miss (as the pool does today); a
        # gated policy that runs misses on the CPU instead is outside that model
        for name in ("lru", "adaptive", "lfu", "decayed"):
            assert opt <= POLICIES[name](steps, n_slots).misses, name
        for policy in ("adaptive", "lru"):
            assert opt <= replay_product(trace_of(steps, n_expert, top_k), n_slots, policy).counters.misses


@pytest.mark.parametrize("slots", [8, 16, 32])
def test_on_uniform_routing_every_online_policy_hits_slots_over_experts(slots):
    trace = generate("uniform", seed=2, n_tokens=3000, n_layer=1)
    expected = slots / trace.n_expert
    steps = layer_steps(trace.ids, 0)
    for name in ("lru", "lfu", "decayed"):
        assert abs(POLICIES[name](steps, slots).hit_rate - expected) < 0.03, name
    for policy in ("adaptive", "lru"):
        product = replay_product(trace, slots, policy).counters
        assert abs(product.hit_rate - expected) < 0.03, policy
    assert belady(steps, slots).hit_rate > expected + 0.1  # knowing the future helps


@pytest.mark.parametrize("policy, rederived", [("adaptive", adaptive), ("lru", recency)])
def test_each_product_policy_is_exactly_its_python_re_derivation(policy, rederived):
    """Step for step: the same slot for every id, the same misses, the same rule leading, on random
    traces mixing a hot set with scans (several-token steps with repeats), where each rule leads."""
    rng = np.random.default_rng(5)
    led = [0, 0]
    evictions = 0
    for _ in range(40):
        n_expert = int(rng.choice([4, 8, 16, 64]))
        top_k = int(rng.integers(1, min(4, n_expert) + 1))
        n_slots = int(rng.integers(min(2 * top_k, n_expert), n_expert + 3))  # two rows always fit
        hot = max(top_k, n_expert // 4)
        steps = []
        for _ in range(250):
            rows = int(rng.integers(1, 3))
            ids = []
            for _ in range(rows):
                span = hot if rng.random() < 0.6 else n_expert
                ids += rng.choice(span, size=top_k, replace=False).tolist()
            steps.append(ids)
        product = Policy(n_expert, n_slots, policy)
        record: list[PolicyStep] = []
        ref = rederived(steps, n_slots, n_expert, record=record)
        assert len(record) == len(steps)
        for t, (step, want) in enumerate(zip(steps, record)):
            got = product.step(step)
            assert got is not None
            assert got == (want.slots, want.miss), f"step {t} of {steps[max(0, t - 3):t + 1]}"
        c = product.counters()
        assert (c.lookups, c.hits, c.misses, c.evictions) == (ref.lookups, ref.hits, ref.misses, ref.evictions)
        by_rule = [sum(r.rule == k for r in record) for k in (0, 1)]
        assert product.freq_led_steps() == by_rule[1]
        led = [a + b for a, b in zip(led, by_rule)]
        evictions += c.evictions
    assert evictions > 1000
    if policy == "adaptive":
        # both rules chose victims somewhere, or the comparison proved nothing about one of them
        assert led[0] > 1000 and led[1] > 1000, led


def test_adaptive_beats_lru_where_popularity_leads_and_ties_on_uniform_routing():
    def copied(trace, slots, policy):
        return replay_product(trace, slots, policy).counters.copy_bytes

    for preset in ("qwen3.8-flash-next", "glm-chat-shift"):
        trace = generate(preset, seed=4, n_tokens=600, n_layer=2)
        slots = PRESETS[preset].n_expert // 4
        assert copied(trace, slots, "adaptive") < 0.99 * copied(trace, slots, "lru"), preset
    uniform = generate("uniform", seed=4, n_tokens=2000, n_layer=2)
    for slots in (8, 32):
        assert copied(uniform, slots, "adaptive") == pytest.approx(copied(uniform, slots, "lru"), rel=0.02)


def test_the_gate_cuts_churn_bytes_with_bounded_excess_and_leaves_a_paying_pool_alone():
    def replay(trace, slots, gate):
        return replay_product(trace, slots, gate=gate)

    churn = generate("long-form-hard", seed=1, n_tokens=1500, n_layer=2)
    for slots in (32, 64):
        open_, gated = replay(churn, slots, False), replay(churn, slots, True)
        assert open_.counters.misses > open_.counters.hits  # the pool does not pay here
        assert gated.counters.copy_bytes < 0.3 * open_.counters.copy_bytes
        for c in gated.per_layer.values():
            bound = slots + 4 * slots * (c.gate_closures + 1)
            assert c.misses - c.hits <= bound, (slots, c)
    paying = generate("qwen3-30b-a3b", seed=1, n_tokens=800, n_layer=2)
    open_, gated = replay(paying, 64, False), replay(paying, 64, True)
    assert gated.counters.gate_closures == 0 and gated.counters == open_.counters


def test_generator_is_deterministic_by_seed():
    a = generate("qwen3-30b-a3b", seed=5, n_tokens=200)
    b = generate("qwen3-30b-a3b", seed=5, n_tokens=200)
    c = generate("qwen3-30b-a3b", seed=6, n_tokens=200)
    assert np.array_equal(a.ids, b.ids) and not np.array_equal(a.ids, c.ids)
    for t in range(a.n_tokens):
        for li in range(len(a.layers)):
            assert len(set(a.ids[t, li].tolist())) == a.top_k  # no duplicates within a token


def test_calibrated_preset_has_published_like_locality():
    trace = generate("qwen3-30b-a3b", seed=0)
    loc = locality(trace)
    assert 0.35 < loc.reuse_prev < 0.55     # published: ~45% of experts reused from the previous token
    assert 0.7 < loc.reuse_window < 0.95    # published: ~80% within 8 tokens
    for name, slots, published, synthetic in bench.lru_calibration(["qwen3-30b-a3b"]):
        assert abs(published - synthetic) < 0.08, (slots, published, synthetic)


def test_topic_shift_dips_then_recovers():
    trace = generate("glm-chat-shift", seed=0, n_layer=2)
    steps = layer_steps(trace.ids, 1)
    from collections import OrderedDict
    cache, hits = OrderedDict(), []
    for step in steps:  # per-token LRU hit rate with 100 slots
        h = sum(1 for e in step if e in cache)
        hits.append(h / len(step))
        for e in step:
            cache.pop(e, None)
            cache[e] = None
        while len(cache) > 100:
            cache.popitem(last=False)
    hits = np.array(hits)
    boundary = PRESETS["glm-chat-shift"].request_length
    before = hits[boundary - 60:boundary].mean()
    right_after = hits[boundary:boundary + 20].mean()
    later = hits[boundary + 100:boundary + 160].mean()
    assert right_after < before - 0.05 and later > right_after + 0.05


def test_trace_round_trips_through_npz(tmp_path):
    trace = generate("long-form-hard", seed=3, n_tokens=50)
    back = Trace.load(trace.save(tmp_path / "t.npz"))
    assert np.array_equal(back.ids, trace.ids)
    assert back.meta["preset"] == "long-form-hard" and back.meta["seed"] == 3
    assert back.bytes_per_expert == trace.bytes_per_expert


def test_benchmark_json_rows_have_the_documented_keys_and_meanings():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "policy.py"), "--json", "--preset", "uniform",
                             "--preset", "qwen3-30b-a3b", "--tokens", "150", "--layers", "1", "--plot", ""],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    for key in ("preset", "slots", "policy", "hit_rate", "copy_bytes_per_token", "vs_opt", "vs_lru", "yield"):
        assert all(key in r for r in rows)
    policies = {r["policy"] for r in rows}
    assert {"product-adaptive", "product-lru", "product-gated", "opt"} <= policies
    # the ratio columns are each row's bytes over OPT's and over the product LRU's for the same
    # preset and slot count; OPT (checked against a brute-force optimum above) copies least of the
    # policies that admit every miss (gated ones may copy less: their refusals run on the CPU)
    for r in rows:
        same = {o["policy"]: o for o in rows if (o["preset"], o["slots"]) == (r["preset"], r["slots"])}
        assert r["vs_opt"] == pytest.approx(r["copy_bytes_per_token"] / same["opt"]["copy_bytes_per_token"])
        assert r["vs_lru"] == pytest.approx(r["copy_bytes_per_token"] / same["product-lru"]["copy_bytes_per_token"])
        if r["policy"] not in ("product-gated", "second-touch"):
            assert r["copy_bytes_per_token"] >= same["opt"]["copy_bytes_per_token"]
    assert "copies" in result.stderr and "OPT" in result.stderr


def test_the_policy_lab_page_shows_what_the_benchmark_computes():
    """Every preset, the published seeds: regenerated here and compared with docs/policy-lab.md as written."""
    readme = (ROOT / "docs" / "policy-lab.md").read_text()
    policy, gate = bench.readme_tables()
    assert policy in readme
    assert gate in readme


def _gpu_check(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *argv],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


def test_the_gpu_check_runs_every_step_on_the_testbed(tmp_path):
    """benchmarks/gpu_check.py in its CPU mode: the same steps a CUDA or ROCm machine runs."""
    out = tmp_path / "gpu-check.json"
    result = _gpu_check("run", "--testbed", "--geometry", "tiny", "--tokens", "24", "--card-mib", "1030,65536",
                        "--upload-mib", "8", "--parity-types", "F16,Q4_K", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["schema"] == "pyllamapool.gpu-check/3" and report["device"]["name"].startswith("RPC")
    assert [s["step"] for s in report["steps"]] == ["upload", "first-card", "upstream-first", "loads-first",
                                                     "requests-first", "auto-first", "other-cards", "hybrid-rules",
                                                     "resident", "parity", "parity-types", "cxx-runtime"]
    assert all(s["status"] == "done" and s["wall_s"] >= 0 and s["est_s"] > 0 for s in report["steps"])
    assert report["upload"]["pageable_gb_s"] > 0 and report["upload"]["copy_latency_us_64k"] > 0
    rows = report["rows"]
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    designs = lambda step: sorted((r["design"], r["load"], r["stream"], r["mec"]) for r in by_step[step])
    # stock first; -mec 4 and 8 (top-k, half; a quarter is top-k here): the device's path and the host's
    assert rows[0]["mode"] == "stock" and rows[0]["design"] == "stock"
    assert designs("first-card")[:-1] == sorted((d, "default", "topics", m) for d in ("device", "copy", "hybrid", "bank")
                                                for m in (4, 8))
    # the bank is asked for on the first card (too small here for any pool); RPC has no device path, so
    # where a bank fits the host's policy serves it
    assert all(r["bank"] in ("on", "-") for r in by_step["first-card"] if r["design"] == "bank")
    # the other loads: pageable pages (the host's designs), pinned memory (every design); short requests
    assert designs("loads-first") == sorted([(d, "mapped", "topics", m) for d in ("copy", "hybrid") for m in (4, 8)]
                                            + [(d, "pinned", "topics", m) for d in ("device", "copy", "hybrid")
                                               for m in (4, 8)])
    assert designs("requests-first") == sorted((d, "default", "requests", m) for d in ("device", "copy", "hybrid")
                                               for m in (4, 8))
    # every row, every design: the whole run's rate, the cold and the warm one, and the host's waits
    measured = [r for r in rows if "decode_tps" in r]
    assert all(r["cold_tps"] > 0 and r["warm_tps"] > 0 and r["host_waits_per_token"] > 0 for r in measured)
    # hybrid's earlier rules beside the default on the first card: without prefetch, every miss on the CPU
    assert sorted((r["mode"], r["mec"]) for r in by_step["hybrid-rules"]) == [("hybrid-cpu", 8), ("hybrid-no-prefetch", 8)]
    # the small card admits no pool (or only one the rail limits); the big one admits every -mec
    assert all(r["status"] == "disabled" or r["limited_by"] == "rail" for r in by_step["first-card"][1:])
    big = [r for r in by_step["other-cards"] if r["mode"] in ("device", "copy", "hybrid")]
    assert len(big) == 6 and all(r["status"] == "enabled" for r in big)
    # RPC cannot read host memory in place, and the CPU repacks Q4_K: the host serves, and says why
    assert all(r["serve"] == "host" and r["serve_reason"] == ("repacked" if r["mode"] == "device" else "off")
               for r in big)
    assert any(r["cpu_experts"] > 0 for r in big if r["mode"] == "hybrid")
    copied = [r["copy_bytes_per_token"] for r in sorted((r for r in big if r["mode"] == "copy"), key=lambda r: r["mec"])]
    assert copied[0] > copied[-1]
    assert all(r["block_ms_per_token"] >= 0 for r in big)
    # llama.cpp's own cache beside every admitted copy pool, at its bytes
    upstream = [r for r in rows if r["mode"] == "upstream"]
    assert {(r["card_mib"], r["mec"]) for r in upstream} == {
        (r["card_mib"], r["mec"]) for r in rows if r["mode"] == "copy" and r["status"] == "enabled"
        and r["load"] == "default" and r["stream"] == "topics"}
    assert upstream and all(r["status"] == "enabled" and r["hit_rate"] > 0 for r in upstream)
    # -mec auto on every card: sized by itself; on the big card it ran some steps on each side (stock
    # first, then the pool's probe: 24 decode steps hold both)
    auto = [r for r in rows if r["mode"] == "auto"]
    assert [(r["step"], r["card_mib"]) for r in auto] == [("auto-first", 1030), ("other-cards", 65536)]
    assert auto[1]["status"] == "enabled" and auto[1]["actual_slots"] > max(r["mec"] for r in big)
    assert 0 < auto[1]["stock_share"] < 1
    # every design with every expert on the device: its fixed cost, and the host's cost per CPU expert
    assert [r["mode"] for r in by_step["resident"]] == ["device-resident", "hybrid-resident", "copy-resident",
                                                        "resident"]
    assert all(r["status"] == "enabled" for r in by_step["resident"][:3]) and report["host_expert_ms"] > 0
    # parity: copy bit for bit against all-resident with evictions; hybrid within its stated bound; the
    # device's path cannot run on RPC, and the report says so
    parity = report["parity"]
    assert parity["bit_identical"] and parity["evictions"] > 0
    assert parity["device_serve"]["serve"] == "host" and parity["device_serve"]["reason"]
    assert parity["hybrid"]["within_bound"] and parity["hybrid"]["cpu_experts"] > 0
    assert [(r["expert_type"], r["bit_identical"]) for r in report["parity_by_type"]] == [("F16", True), ("Q4_K", True)]
    # the prediction beside each measured row, from the profile this run measured
    predicted = [r for r in rows if "predicted_tps" in r]
    assert {r["mode"] for r in predicted} >= {"stock", "device", "copy", "hybrid", "upstream", "auto"}
    assert all(r["predicted_tps"] > 0 and r["prediction_error"] is not None for r in predicted)
    assert report["predict_profile"]["pcie_gb_s"] == report["upload"]["pageable_gb_s"]  # RPC: no pinned memory
    assert report["cxx_runtime"]["this_process"]["preloaded"] == "libstdc++.so.6"
    assert report["cxx_runtime"]["without_rule"]["loaded"]
    markdown = (tmp_path / "gpu-check.md").read_text()
    assert markdown in result.stdout and "| other-cards | copy | default | topics | host (off) | file | 65536 | 8 |" in markdown
    # `predict` puts a finished report's predictions back, as the run made them
    made = {i: r["predicted_tps"] for i, r in enumerate(rows) if "predicted_tps" in r}
    for r in rows:
        r.pop("predicted_tps", None)
    out.write_text(json.dumps(report))
    again = _gpu_check("predict", str(out), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {i: r["predicted_tps"] for i, r in enumerate(rows) if "predicted_tps" in r} == pytest.approx(made)
    assert (tmp_path / "gpu-check.md").read_text() == markdown


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_type_that_differs_only_where_cuda_fuses_passes_when_it_equals_the_all_resident_run():
    verdict = _gpu_check_module().type_parity
    assert verdict({"bit_identical": True}) == "="
    fused_only = {"bit_identical": False, "max_abs_diff": 0.59, "fusion_off": {"bit_identical": True}}
    # the H200's first run had no all-resident comparison: a difference, with what fusion off showed
    assert verdict(fused_only) == "differs (0.59; fusion off: =)"
    assert verdict({**fused_only, "bit_identical_to_resident": True}).startswith("= resident")
    assert verdict({**fused_only, "bit_identical_to_resident": False}) == \
        "differs (0.59; fusion off: =; vs all-resident: differs)"
    # differing with fusion off too is a difference, whatever the resident run says
    assert verdict({"bit_identical": False, "max_abs_diff": 0.1, "fusion_off": {"bit_identical": False},
                    "bit_identical_to_resident": True}).startswith("differs")
    assert verdict({"error": "rc 1"}) == "ERROR" and verdict({"skipped": "deadline"}) == "skipped"


def test_the_gpu_check_stops_at_its_deadline_and_keeps_what_it_measured(tmp_path):
    out = tmp_path / "gpu-check.json"
    result = _gpu_check("run", "--testbed", "--geometry", "tiny", "--tokens", "8", "--card-mib", "65536",
                        "--upload-mib", "8", "--parity-types", "", "--deadline-s", "6", "--out", str(out), cwd=tmp_path)
    report = json.loads(out.read_text())
    status = {s["step"]: s.get("status") for s in report["steps"]}
    assert result.returncode == 0, result.stderr[-2000:]
    # the bandwidth always runs; parity's two children are estimated past 6 s on their own
    assert status["upload"] == "done" and status["parity"] == "skipped: deadline", status
    assert "parity" not in report and "skipped, " in result.stderr
    markdown = (tmp_path / "gpu-check.md").read_text()
    assert "| parity | skipped: deadline |" in markdown


def test_the_plan_for_an_h200_fits_the_lease_with_the_build():
    result = _gpu_check("plan", "--json", cwd=ROOT)
    plan = json.loads(result.stdout)
    assert result.returncode == 0 and plan["fits_lease"] and plan["fits_deadline"]
    assert plan["geometry"] == "qwen3-30b-a3b" and plan["build_s"] > 0
    assert plan["total_s"] <= 14 * 60
    assert [s["step"] for s in plan["steps"]][:4] == ["build", "generate", "upload", "first-card"]


def test_the_policy_lab_page_shows_hybrid_admission_against_copy_on_miss_as_computed():
    readme = (ROOT / "docs" / "policy-lab.md").read_text()
    table = bench.hybrid_table()
    assert table in readme
    # hybrid never uploads more than copy-on-miss, and serves misses on the CPU instead
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        copy_mib, hybrid_mib, cpu = float(cells[2]), float(cells[3]), float(cells[4])
        assert hybrid_mib <= copy_mib and cpu > 0


def test_a_bank_over_one_layer_is_that_layers_pool_and_a_bank_for_every_expert_only_misses_cold():
    """policies.bank runs the product's policy over (layer, expert): with one layer it is that layer's
    pool, step for step; with a slot for every entry of every layer only first uses miss; it never
    evicts an entry the current step of its layer reads, so a step of top-k always fits top-k slots."""
    from pyllamapool.lab.policies import adaptive, bank, recency

    trace = generate("glm-chat-shift", seed=1, n_tokens=300)
    layers = [layer_steps(trace.ids, i) for i in range(trace.ids.shape[1])]
    n_expert = PRESETS["glm-chat-shift"].n_expert
    assert bank(layers[:1], 24) == adaptive(layers[0], 24, n_expert)
    assert bank(layers[:1], 24, "lru") == recency(layers[0], 24, n_expert)
    full = bank(layers, len(layers) * n_expert)
    distinct = sum(len({e for step in steps for e in step}) for steps in layers)
    assert full.misses == full.uploads == distinct and full.evictions == 0
    top_k = PRESETS["glm-chat-shift"].top_k
    tight = bank(layers, top_k)  # one layer's step at a time must fit: it evicts the others' entries
    assert tight.lookups == sum(len(set(step)) for steps in layers for step in steps) and tight.evictions > 0
    with pytest.raises(ValueError, match="accepted are 'adaptive' and 'lru'"):
        bank(layers, 64, "lfu")


def test_the_policy_lab_page_shows_the_bank_beside_per_layer_pools_and_both_upstream_banks_as_computed():
    """The bank table is the lab's replay as written; on every preset the bank moves no more than
    llama.cpp's LRFU bank, and on the layered one it moves at least 10% less than per-layer pools."""
    table = bench.bank_table()
    assert table in (ROOT / "docs" / "policy-lab.md").read_text()
    rows = [[c.strip() for c in row.strip("|").split("|")] for row in table.splitlines()[2:]]
    assert {r[0] for r in rows} == {*synth.PRESETS, *synth.LAYERED_PRESETS}
    for cells in rows:
        assert all(float(c) > 0 for c in cells[2:6])
        assert float(cells[8]) <= 1.0, cells  # bank / LRFU
    layered = [r for r in rows if r[0] in synth.LAYERED_PRESETS]
    assert min(float(r[6]) for r in layered) <= 0.9  # bank / per-layer


def test_the_layered_preset_matches_the_h200_where_its_page_says_and_misses_where_it_says():
    """At 64 slots a layer the layered preset's per-layer and bank hit rates are within half a point of
    the H200's and the bank saves what it saved there; at 32 the lab's bank saves where the H200's
    tied, as docs/policy-lab.md says (its calibration table is this computation)."""
    assert bench.bank_calibration_table() in (ROOT / "docs" / "policy-lab.md").read_text()
    by_slots = {c.slots: c for c in bench.bank_calibration()}
    at64, at32 = by_slots[64], by_slots[32]
    assert abs(at64.synthetic_per_layer - at64.measured_per_layer) < 0.005
    assert abs(at64.synthetic_bank - at64.measured_bank) < 0.005
    assert abs(at64.miss_ratio(False) - at64.miss_ratio(True)) < 0.05
    assert at32.miss_ratio(True) > 1.0 > at32.miss_ratio(False)


def test_a_locality_ramp_flattens_the_early_layers_and_leaves_the_last_as_given():
    """locality_ramp scales each layer's Zipf exponent from 1 - ramp (the first) to 1 (the last): the
    first layer touches more distinct experts than the last and than the same layer without a ramp;
    an unknown preset's error names the layered ones too."""
    flat = generate("qwen3-30b-a3b", seed=3, n_layer=3, n_tokens=120, early_flat=0)
    ramp = generate("qwen3-30b-a3b", seed=3, n_layer=3, n_tokens=120, early_flat=0, locality_ramp=0.9)
    distinct = [len(set(ramp.ids[:, li, :].ravel().tolist())) for li in range(3)]
    assert distinct[0] > distinct[2]
    assert len(set(flat.ids[:, 0, :].ravel().tolist())) < distinct[0]
    with pytest.raises(PyllamapoolError, match="unknown preset 'nope'; presets: .*qwen3-30b-a3b-layered"):
        generate("nope")


def test_the_policy_lab_page_sets_every_mode_side_by_side_as_the_benchmark_computed():
    """docs/policy-lab.md's side-by-side table is the committed benchmark JSON's, that JSON is what the
    lab computes (one preset and slot count recomputed here; the whole run takes a minute), and what
    the page says of it holds in every row."""
    import json

    from pyllamapool.lab import bench

    data = json.loads((ROOT / "benchmarks" / "results" / "modes-rtx3090.json").read_text())
    rows = [bench.ModesRow(**r) for r in data["rows"]]
    assert bench.modes_markdown(rows) in (ROOT / "docs" / "policy-lab.md").read_text()
    again = bench.modes_rows(["qwen3-30b-a3b"], (0.25,), seed=data["seed"])
    assert [r.__dict__ for r in again] == [r.__dict__ for r in rows if r.preset == "qwen3-30b-a3b" and r.slots == 32]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r.preset, r.slots), {})[r.mode] = r
    assert {m for c in cells.values() for m in c} == set(bench.MODES_COLUMNS)
    for key, c in cells.items():
        hyb, no_prefetch = c["hybrid"], c["hybrid-no-prefetch"]
        shares = [c[f"cpu-share {f:g}"] for f in (0.25, 0.5, 0.75)]
        best_share = max(shares, key=lambda r: r.tokens_per_s)
        # prefetch: more bytes, fewer CPU experts, faster; and ahead of upstream's best share
        assert hyb.upload_mib_per_token > no_prefetch.upload_mib_per_token, key
        assert hyb.cpu_experts_per_token <= no_prefetch.cpu_experts_per_token, key
        assert hyb.tokens_per_s > no_prefetch.tokens_per_s and hyb.tokens_per_s > best_share.tokens_per_s, key
        assert hyb.upload_mib_per_token > best_share.upload_mib_per_token, key
        assert hyb.cpu_experts_per_token < best_share.cpu_experts_per_token, key
        # OPT bounds copy-on-miss with the same slots per layer
        assert c["opt"].upload_mib_per_token <= c["copy"].upload_mib_per_token, key
    lrfu_more = [key for key, c in cells.items() if c["lrfu"].upload_mib_per_token > c["copy"].upload_mib_per_token]
    assert len(lrfu_more) == len(cells) - 1


@pytest.mark.parametrize("policy", ["adaptive", "lru"])
def test_the_products_policy_runs_a_bank_as_the_lab_rederives_it(policy):
    """replay_bank steps the pool's own C++ policy over (layer, expert) entries, each layer in turn
    within a token: its counters are the lab's bank's, miss for miss, and each layer's share adds up."""
    from pyllamapool.lab.policies import bank
    from pyllamapool.lab.replay import replay_bank

    trace = generate("glm-chat-shift", seed=1, n_layer=3, n_tokens=320)
    layers = [layer_steps(trace.ids, i) for i in range(3)]
    total = 3 * 36
    product = replay_bank(trace, total, policy)
    lab = bank(layers, total, policy)
    c = product.counters
    assert (c.lookups, c.hits, c.misses, c.evictions) == (lab.lookups, lab.hits, lab.misses, lab.evictions)
    assert sum(p.misses for p in product.per_layer.values()) == c.misses
    assert sum(p.lookups for p in product.per_layer.values()) == c.lookups
    assert c.evictions > 0


def test_the_policy_benchmark_replays_a_recorded_trace_through_every_bank(tmp_path):
    """`benchmarks/policy.py --bank TRACE.npz` prints the bank table's rows for routing from a file."""
    trace = generate("qwen3-30b-a3b", seed=2, n_layer=3, n_tokens=200)
    path = trace.save(tmp_path / "routing.npz")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "policy.py"), "--bank", str(path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    loaded = Trace.load(path)
    expected = bench.bank_rows(path.name, loaded, [16, 32, 64])
    assert [line for line in result.stdout.splitlines() if line.startswith(f"| {path.name} |")] == expected
