"""The Python pool API, sweeps, the what-if plan, the demo and the `pyllamapool` command line."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from pyllamapool.binding import logs
from pyllamapool.errors import PyllamapoolError
from pyllamapool.lab.plan import plan
from pyllamapool.binding.pool import PoolConfig
from pyllamapool.run.offload import Offload
from pyllamapool.run.session import PoolSession
from pyllamapool.run.sweep import SWEEP_SCHEMA, SweepGrid, run_sweep, write_json
from pyllamapool.run.testmodel import write_dense_model

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllamapool", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


# --------------------------------------------------------------------------------------------
# API


def test_the_same_config_twice_gives_identical_tokens_and_counters(qwen3_model, rpc_server, stream):
    # copy mode: its counters follow from the routing alone. Hybrid's admission weighs measured upload
    # and CPU times, so which misses it uploads differs from run to run by design
    with PoolSession(qwen3_model, Offload(rpc=(rpc_server.endpoint,), cpu_moe=True)) as session:
        cfg = PoolConfig(slots=6, device_mib=65536, mode="copy")
        a = session.run(stream[:8], 0, pool=cfg, teacher_tokens=stream[8:])
        b = session.run(stream[:8], 0, pool=cfg, teacher_tokens=stream[8:])
        other = session.run(stream[:8], 0, pool=PoolConfig(slots=12, device_mib=65536, mode="copy"),
                            teacher_tokens=stream[8:])
    assert a.decode.tokens == b.decode.tokens == other.decode.tokens
    # nothing leaks between runs: fresh context, fresh pool (block_us is a time, the one counter that
    # is not a count of what the pool did)
    from dataclasses import replace
    assert replace(a.counters, block_us=0) == replace(b.counters, block_us=0)
    assert other.counters.misses < a.counters.misses


def test_counters_are_readable_mid_run_and_resettable(qwen3_model, rpc_server, stream):
    with PoolSession(qwen3_model, Offload(rpc=(rpc_server.endpoint,), cpu_moe=True)) as session:
        with session.context(PoolConfig(slots=8, device_mib=65536)) as ctx:
            ctx.decode(stream[:4])
            seen = []
            for tok in stream[4:20]:
                ctx.decode([tok])
                seen.append(ctx.pool_counters().lookups)
            assert seen == sorted(seen) and seen[-1] > seen[0]
            ctx.pool_reset()
            assert ctx.pool_counters().lookups == 0
            ctx.decode([stream[20]])
            assert ctx.pool_counters().lookups > 0


def test_run_result_carries_status_counters_and_memory(qwen3_model, rpc_server, stream):
    with PoolSession(qwen3_model, Offload(rpc=(rpc_server.endpoint,), cpu_moe=True)) as session:
        run = session.run(stream[:8], 0, pool=PoolConfig(slots=8, device_mib=65536), teacher_tokens=stream[8:40],
                          per_pool=True)
    data = run.to_json()
    assert data["status"]["limited_by"] == "slots" and data["status"]["pool_count"] == 12
    assert data["counters"]["hits"] + data["counters"]["misses"] == data["counters"]["lookups"]
    assert any(m["pool"] for m in data["memory"])
    assert len(run.pools) == 12 and len(run.pool_counters) == 12
    assert any(l.startswith("expert pool runtime") for l in run.lines)


def test_a_dense_model_is_refused_by_the_pool_session(tmp_path):
    path = write_dense_model(tmp_path / "dense.gguf")
    with pytest.raises(PyllamapoolError, match="not a Mixture-of-Experts"):
        PoolSession(path, Offload(n_gpu_layers=0))


# --------------------------------------------------------------------------------------------
# sweep, plan


def test_sweep_json_validates_against_its_schema(qwen3_model, rpc_server, stream, tmp_path):
    result = run_sweep(qwen3_model, Offload(rpc=(rpc_server.endpoint,), cpu_moe=True),
                       SweepGrid(slots=(0, 4, 16), device_mib=65536, mode=("copy",)), stream[:8], stream[8:40],
                       repeats=2, progress=False)
    data = json.loads(write_json(result, tmp_path / "s.json"))
    jsonschema.validate(data, SWEEP_SCHEMA)
    rows = {r["slots"]: r for r in data["rows"]}
    assert rows[0]["lookups"] == 0 and rows[4]["hits"] + rows[4]["misses"] == rows[4]["lookups"]
    assert rows[16]["copy_bytes"] < rows[4]["copy_bytes"]  # copy mode: every miss is copied
    assert all(r["tokens_match_first_row"] for r in data["rows"])
    # one-token decode steps; the 8-token prompt too, where a pool holds every expert
    assert set(rows[4]["by_batch"]) == {"1"} and rows[4]["by_batch"]["1"]["lookups"] == rows[4]["lookups"]
    assert set(rows[16]["by_batch"]) == {"1", "2-8"}
    assert sum(b["hits"] for b in rows[16]["by_batch"].values()) == rows[16]["hits"]
    broken = json.loads(json.dumps(data))
    del broken["rows"][0]["copy_bytes"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SWEEP_SCHEMA)


def test_plan_agrees_with_a_real_run_on_the_rpc_device(qwen3_model, rpc_server):
    offload = Offload(rpc=(rpc_server.endpoint,), cpu_moe=True, n_ctx=2048, type_k="q8_0", type_v="q8_0",
                      flash_attn=True)
    # learn what weights, KV cache and compute take on the device, then size a card that binds
    probe = plan(qwen3_model, offload, PoolConfig(slots=16, device_mib=65536, rail_mib=1024)).run.status
    in_use = probe.ceiling - probe.cap
    card_mib = 1024 + -(-(in_use + 3 * 2**20) // 2**20)  # room for ~8 of the 16 slots
    cfg = PoolConfig(slots=16, device_mib=card_mib, rail_mib=1024)
    planned = plan(qwen3_model, offload, cfg).run.status
    with PoolSession(qwen3_model, offload) as session:
        real = session.plan(cfg).status  # a real, allocating context
    assert planned.limited_by == "rail" and planned.enabled
    assert (planned.actual_slots, planned.bytes, planned.cap, planned.ceiling, planned.limited_by) == \
        (real.actual_slots, real.bytes, real.cap, real.ceiling, real.limited_by)


def test_a_pool_asked_for_and_not_made_warns_but_a_what_if_plan_of_it_does_not(qwen3_model, rpc_server):
    """Where -mec asks for a pool that does not fit, a real context says so at WARN, which llama.cpp's
    tools show by default; a what-if plan of the same (a no_alloc model, as memory fitting probes) runs
    nothing, and reports the same line at INFO."""
    offload = Offload(rpc=(rpc_server.endpoint,), cpu_moe=True, n_ctx=2048)
    cfg = PoolConfig(slots=16, device_mib=1024, rail_mib=1024)  # the rail leaves nothing

    def status_levels(run) -> list[tuple[int, str]]:
        with logs.capture() as got:
            run()
        return [(level, text) for level, text in got if text.startswith("expert pool status=")]

    planned = status_levels(lambda: plan(qwen3_model, offload, cfg))

    def real():
        with PoolSession(qwen3_model, offload) as session:
            assert not session.plan(cfg).status.enabled
    made = status_levels(real)
    assert [level for level, _ in planned] == [logging.INFO]
    assert [level for level, _ in made] == [logging.WARNING]
    assert "status=disabled reason=no-room requested_slots=16" in planned[0][1]
    assert planned[0][1].split(" cap=")[0] == made[0][1].split(" cap=")[0]


def test_plan_without_a_device_size_or_pool_is_a_clear_error(qwen3_model):
    with pytest.raises(PyllamapoolError, match="--device-mib"):
        plan(qwen3_model, Offload(cpu_moe=True), PoolConfig(slots=8))
    with pytest.raises(PyllamapoolError, match="-mec"):
        plan(qwen3_model, Offload(cpu_moe=True), PoolConfig(slots=0, device_mib=1024))


# --------------------------------------------------------------------------------------------
# command line

COMMANDS = ["build", "info", "make-model", "run", "plan", "sweep", "demo", "trace", "predict", "measure-host"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


@pytest.mark.parametrize("args,needle", [
    (["run", "{model}", "-mec", "-3"], "slots must be whole numbers >= 0"),
    (["run", "{model}", "-mec", "x"], "-1 (as many as the ledger allows) or auto"),
    (["run", "{model}", "-mec", "8", "--profile", "/no/such/profile"], "does not exist"),
    (["run", "{model}", "-mec", "8", "--hotset", "/no/such/folder/hot.txt"], "expected a file path in an existing folder"),
    (["run", "{model}", "--rpc", "127.0.0.1:1", "-ngl", "99"], "unreachable"),
    (["run", "/no/such/model.gguf"], "does not exist"),
    (["plan", "{model}", "-mec", "8", "--device-mib", "0"], "must be 1 or more"),
    (["plan", "{dense}", "-mec", "8", "--device-mib", "16384"], "not a Mixture-of-Experts"),
    (["make-model", "{tmp}/x.gguf", "--type", "Q4_1"], "unknown expert type"),
    (["run", "{model}", "-mec", "8", "--gate", "on"], "'on' is not a gate: expected off, yield"),
    (["sweep", "{model}", "--policy", "lru,mru"], "'mru' is not a policy: expected adaptive, lru"),
    (["run", "{model}", "-mec", "8", "--policy", "lru,adaptive"], "lists are for `sweep`"),
])
def test_bad_values_exit_non_zero_with_a_one_line_reason(args, needle, qwen3_model, tmp_path):
    dense = write_dense_model(tmp_path / "dense.gguf")
    argv = [a.format(model=qwen3_model, dense=dense, tmp=tmp_path) for a in args]
    result = cli(*argv)
    assert result.returncode != 0
    assert needle in result.stderr
    last = [l for l in result.stderr.strip().splitlines() if l.strip()]
    assert any(needle in l for l in last[-2:])


def test_run_prints_pool_lines_and_json(qwen3_model, rpc_server):
    result = cli("run", str(qwen3_model), "--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe", "-mec", "8",
                 "--device-mib", "65536", "--tokens", "1,2,3", "-n", "8", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert len(data["tokens"]) == 8
    assert data["pool"]["status"]["enabled"] and data["pool"]["counters"]["lookups"] > 0


def test_run_with_a_hot_set_writes_it_and_the_next_run_starts_from_it(qwen3_model, rpc_server, tmp_path):
    hot = tmp_path / "hot.txt"
    argv = ("run", str(qwen3_model), "--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe", "-mec", "8",
            "--device-mib", "65536", "--tokens", "1,2,3", "-n", "8", "--hotset", str(hot))
    first = cli(*argv)
    assert first.returncode == 0, first.stderr
    assert "expert pool hotset=cold reason=no-file" in first.stdout + first.stderr
    assert hot.read_text().count("[hotset model=") == 1
    second = cli(*argv)
    assert second.returncode == 0, second.stderr
    assert "expert pool hotset=loaded" in second.stdout + second.stderr


def test_plan_command_prints_the_status_line_and_a_layer_table(qwen3_model):
    result = cli("plan", str(qwen3_model), "--device-mib", "1034", "--rail-mib", "1024", "-c", "2048",
                 "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-ngl", "99", "--n-cpu-moe", "4", "-mec", "16")
    assert result.returncode == 0, result.stderr
    assert "expert pool status=enabled" in result.stdout and "limited_by=rail" in result.stdout
    assert "planned pools per layer" in result.stdout


def test_sweep_command_json(qwen3_model, rpc_server, tmp_path):
    png = tmp_path / "s.png"
    result = cli("sweep", str(qwen3_model), "--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe",
                 "--slots", "0,8", "--device-mib", "65536", "-n", "24", "-r", "1", "--json", "--plot", str(png))
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), SWEEP_SCHEMA)
    assert png.stat().st_size > 10_000


def test_sweep_prints_the_cost_models_speed_next_to_the_measured_one(qwen3_model, rpc_server):
    from pyllamapool.lab import predict as P

    args = ("sweep", str(qwen3_model), "--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe",
            "--slots", "0,4,16", "--device-mib", "65536", "-n", "24", "-r", "1", "--predict", "rtx3090-pcie4")
    table = cli(*args)
    assert table.returncode == 0, table.stderr
    assert "predicted t/s" in table.stdout
    data = json.loads(cli(*args, "--json").stdout)
    jsonschema.validate(data, SWEEP_SCHEMA)
    off, *pooled = data["rows"]
    # the pool-off row calibrates the device's time, so it predicts itself
    assert off["predicted_tps"] == pytest.approx(off["decode_tps"]["median"])
    profile = P.PROFILES["rtx3090-pcie4"]
    g = P.geometry_from_gguf(qwen3_model, profile, stock_tps=off["decode_tps"]["median"])
    for r in pooled:
        assert r["predicted_tps"] == pytest.approx(P._tps_at_hit_rate(g, profile, "copy", r["hit_rate"], True))
    assert pooled[1]["predicted_tps"] > pooled[0]["predicted_tps"]  # 16 slots hit more than 4


def test_sweep_crosses_policies_and_gates_but_runs_the_pool_off_once(qwen3_model, rpc_server):
    result = cli("sweep", str(qwen3_model), "--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe",
                 "--slots", "0,4", "--policy", "adaptive,lru", "--gate", "off,yield", "--device-mib", "65536",
                 "-n", "24", "-r", "1", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    jsonschema.validate(data, SWEEP_SCHEMA)
    on = [(r["policy"], r["gate"]) for r in data["rows"] if r["slots"] == 4]
    assert sorted(on) == [("adaptive", "off"), ("adaptive", "yield"), ("lru", "off"), ("lru", "yield")]
    assert [r["slots"] for r in data["rows"]].count(0) == 1


def test_sweep_crosses_rails_caps_and_profiles(qwen3_model, rpc_server, tmp_path):
    flat, steep = tmp_path / "flat.txt", tmp_path / "steep.txt"
    flat.write_text("".join(f"blk.{i} 1\n" for i in range(4)))
    steep.write_text("blk.0 0.25\nblk.1 1\nblk.2 2\nblk.3 4\n")
    # a 2056 MiB device: a 1024 MiB rail leaves ~1 GiB, a 2048 MiB one leaves less than the weights
    result = cli("sweep", str(qwen3_model), "--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe",
                 "--slots", "8", "--rail-mib", "1024,2048", "--cap-mib", "2,64", "--profile", str(flat),
                 "--profile", str(steep), "--device-mib", "2056", "-n", "16", "-r", "1", "--mode", "copy", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    jsonschema.validate(data, SWEEP_SCHEMA)
    rows = {(r["rail_mib"], r["cap_mib"], r["profile"]): r for r in data["rows"] if r["slots"] == 8}
    assert set(rows) == {(rail, cap, str(p)) for rail in (1024, 2048) for cap in (2, 64) for p in (flat, steep)}
    for (rail, cap, profile), r in rows.items():
        if rail == 2048:  # the rail binds unless the cap is tighter still
            assert r["status"] == "disabled" or r["limited_by"] == ("rail" if cap == 64 else "cap"), r
        else:
            assert r["status"] == "enabled" and r["limited_by"] == ("cap" if cap == 2 else "slots"), r
            assert r["bytes"] <= cap * 2**20
    # the same bytes, shared out by the profile: a steeper profile changes which steps miss
    assert rows[(1024, 64, str(flat))]["bytes"] == rows[(1024, 64, str(steep))]["bytes"]
    assert rows[(1024, 64, str(flat))]["misses"] != rows[(1024, 64, str(steep))]["misses"]


def test_demo_runs_on_the_cpu_build(tmp_path):
    result = cli("demo", "--out", str(tmp_path), "-n", "48", "-r", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "logits bit-identical" in result.stdout
    evictions = re.search(r"pool \(\d+ slots, (\d+) evictions\)", result.stdout)
    assert evictions and int(evictions.group(1)) > 0
    assert "expert pool status=enabled" in result.stdout
    assert (tmp_path / "sweep.png").exists()
    assert f"plot written to {tmp_path / 'sweep.png'}" in result.stdout.replace("\n", "")


def test_demo_json_puts_the_figures_on_stdout_and_the_narrative_on_stderr(tmp_path):
    result = cli("demo", "--json", "--out", str(tmp_path), "-n", "24", "-r", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["parity"] is True and report["sweep"]["schema"] == "pyllamapool.sweep/1"
    assert [r["slots"] for r in report["sweep"]["rows"]][0] == 0
    assert "logits bit-identical" in result.stderr


def piped(*args: str) -> subprocess.CompletedProcess:
    """The CLI as a log or `| less` sees it: stdout a pipe, no COLUMNS."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "pyllamapool", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)


def test_tables_printed_to_a_pipe_keep_every_column_and_word():
    from pyllamapool.lab import predict as P

    profiles = piped("predict", "--list-profiles")
    assert profiles.returncode == 0 and "…" not in profiles.stdout
    lines = profiles.stdout.splitlines()
    for prof in P.PROFILES.values():  # each row on one line, its description whole
        assert any(prof.name in line and prof.description in line for line in lines), prof.name
    validation = piped("predict", "--validate")
    assert validation.returncode == 0 and "…" not in validation.stdout
    header = next(line for line in validation.stdout.splitlines() if "anchor" in line)
    assert header.count("┃") == 12  # all eleven columns side by side
    for anchor in P.ANCHORS:
        assert any(line.count("│") == 12 and anchor.name in line for line in validation.stdout.splitlines())


def test_every_table_has_a_json_twin():
    assert json.loads(piped("predict", "--list-profiles", "--json").stdout)[0]["name"] == "mi50-pcie3"
    assert json.loads(piped("predict", "--validate", "--json").stdout)[0]["anchor"]


def test_launchers_pass_arguments_through_unchanged(tmp_path):
    result = cli("bench", "--help")
    assert "--moe-expert-cache" in result.stdout + result.stderr
    result = cli("quantize", "--help")
    assert "--tensor-type" in result.stdout + result.stderr
    result = cli("server", "-mec", "nope", "-m", str(tmp_path / "none.gguf"))
    assert result.returncode != 0 and "invalid slot count 'nope'" in result.stderr
    result = cli("cli", "--help")
    assert result.returncode == 0 and "--moe-expert-cache" in result.stdout + result.stderr


def test_the_rpc_server_launcher_serves_on_the_port_it_is_given():
    import socket
    import time

    from pyllamapool.run.rpc import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyllamapool", "rpc-server", "-H", "127.0.0.1", "-p", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail(f"no RPC server on {port}: {proc.stdout.read().decode(errors='replace')[-1500:]}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_info_reports_the_manifest_and_devices():
    result = cli("info", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["manifest"]["upstream_ref"] == "b11549"
    assert data["manifest"]["target"] == "cpu"
    assert any(d["kind"] == "cpu" for d in data["devices"])


def test_trace_command_records_the_pool_view(qwen3_model, rpc_server, tmp_path):
    from pyllamapool.run.trace import Trace
    out = tmp_path / "pool.npz"
    result = cli("trace", str(qwen3_model), "--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe", "-mec", "8",
                 "--device-mib", "65536", "-n", "40", "-o", str(out))
    assert result.returncode == 0, result.stderr
    trace = Trace.load(out)
    assert trace.miss is not None and trace.miss.shape == trace.ids.shape
    runtime = next(l for l in result.stdout.splitlines() if "expert pool runtime" in l)
    misses = int(runtime.split("misses=")[1].split()[0])
    assert misses == int(trace.miss.sum())  # each layer counted once, though gate, up and down are three pools


def test_tune_without_a_device_predicts_and_says_so(qwen3_model):
    result = cli("tune", str(qwen3_model), "--device-mib", "16384", "--profile", "rtx3090-pcie4", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    tuned = json.loads(result.stdout)
    assert tuned["link"] is None and tuned["host"]["gb_per_s"] > 0  # the CPU is measured even so
    assert {c["source"] for c in tuned["choices"]} == {"predicted"}
    assert any("predicted" in n and "rtx3090-pcie4" in n for n in tuned["notes"])
    assert tuned["command"][:2] == ["pyllamapool", "server"] and "-mec" in tuned["command"]


def test_tune_names_a_bad_mode_and_a_missing_model(qwen3_model, tmp_path):
    missing = cli("tune", str(tmp_path / "none.gguf"))
    assert missing.returncode != 0 and "none.gguf' does not exist" in missing.stderr
    bad = cli("tune", str(qwen3_model), "--mode", "turbo", "--device-mib", "16384")
    assert bad.returncode != 0 and "'turbo' is not a mode: expected hybrid, copy" in bad.stderr
