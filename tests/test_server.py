"""The patched llama-server and llama-bench on the RPC testbed: pool lines, -np 2 parity, speculative
decoding with the pool, the slot count from flags, lists and the environment, the bench's mec column."""
from __future__ import annotations

import csv
import io
import json
import os
import re
import socket
import subprocess
import threading
import time
import urllib.request
from contextlib import contextmanager

import pytest

from pyllamapool.native.tools import tool_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv_without_port: list[str], attempts: int = 3):
    """(process, port, lines) for a llama-server on a free port. The port is picked before the server
    binds it, so another process can take it meanwhile: a bind failure is retried on a new port."""
    for _ in range(attempts):
        port = free_port()
        proc = subprocess.Popen([*argv_without_port, "--port", str(port)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                reader.join(timeout=5)
                if any("couldn't bind" in l for l in lines):
                    break  # the port was taken: try another
                raise AssertionError("llama-server exited:\n" + "".join(lines[-30:]))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return proc, port, lines, reader
            except OSError:
                time.sleep(0.2)
        else:
            _stop(proc, reader)
            raise AssertionError("llama-server did not become healthy:\n" + "".join(lines[-30:]))
    raise AssertionError(f"llama-server could not bind a free port in {attempts} attempts")


def _stop(proc, reader) -> None:
    proc.send_signal(2)  # SIGINT: a clean shutdown logs the pool's runtime line
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(timeout=5)


@contextmanager
def llama_server_argv(argv: list[str], verbosity: int | None = 4):
    """(port, log lines) of a server started from argv on a free loopback port, stopped afterwards.
    The pool's lines are libllama INFO lines, which llama.cpp's tools show from -lv 4 (a -v or -lv of
    the caller's stands)."""
    asked = {"-v", "--verbose", "-lv", "--verbosity", "--log-verbosity"} & set(argv)
    extra = ["-lv", str(verbosity)] if verbosity is not None and not asked else []
    proc, port, lines, reader = _start([*argv, "--host", "127.0.0.1", *extra])
    try:
        yield port, lines
    finally:
        _stop(proc, reader)


def llama_server(model, *args: str, verbosity: int | None = 4):
    return llama_server_argv([str(tool_path("llama-server")), "-m", str(model), "-c", "2048", "-t", "1",
                              "--no-warmup", *args], verbosity)


def report_lines(lines: list[str]) -> list[str]:
    """The pool's key=value report lines ("expert pool status=...") among a tool's log lines, not the
    tools' own diagnostics about it ("expert pool: ...")."""
    return [l for l in lines if "expert pool " in l]


def complete(port: int, prompt: str, n: int = 24) -> dict:
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "n_probs": 5, "cache_prompt": False,
                       "seed": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def together(port: int, prompts: list[str], n: int = 24) -> list[dict]:
    """One request with several prompts: the server starts their slots in the same iteration, so the
    sequences decode in shared batches with the same composition on every run (separate concurrent
    requests race, and batch composition changes the stock path's own numerics)."""
    body = json.dumps({"prompt": prompts, "n_predict": n, "temperature": 0, "n_probs": 5,
                       "cache_prompt": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        results = json.loads(r.read())
    assert isinstance(results, list) and len(results) == len(prompts)
    return results


PROMPTS = ["the quick brown fox jumps over", "a completely different request here"]


def logprobs(result: dict):
    return [[(p["id"], p["logprob"]) for p in step["top_logprobs"]] for step in result["completion_probabilities"]]


@pytest.mark.parametrize("mode", ["copy", "hybrid"])
def test_server_np2_decode_with_the_pool_is_bit_identical_per_sequence(qwen3_model, rpc_server, monkeypatch, mode):
    monkeypatch.setenv("LLAMA_MOE_POOL_DEVICE_MIB", "65536")
    with llama_server(qwen3_model, "--rpc", rpc_server.endpoint, "-ngl", "99", "-np", "2") as (port, _):
        reference = together(port, PROMPTS)
    with llama_server(qwen3_model, "--rpc", rpc_server.endpoint, "-ngl", "99", "-np", "2", "--cpu-moe",
                      "-mec", "8", "--moe-pool-mode", mode) as (port, lines):
        pooled = together(port, PROMPTS)
    text = "".join(lines)
    assert "expert pool status=enabled" in text and "limited_by=slots" in text and f"mode={mode}" in text
    assert "expert pool first-use=active" in text
    runtime = [l for l in lines if "expert pool runtime" in l]
    assert runtime and int(runtime[0].split("evictions=")[1].split()[0]) > 0
    for ref, got in zip(reference, pooled):
        assert ref["content"] == got["content"]
        assert len(logprobs(ref)) > 0
        assert logprobs(ref) == logprobs(got)  # exact: top-5 log-probabilities of every step


@pytest.mark.parametrize("arch, spec", [("qwen3moe", ("--spec-type", "ngram-simple")),
                                        ("qwen3moe", ("-md", "DRAFT", "--spec-draft-n-max", "6")),
                                        ("glm4moe", ("--spec-type", "draft-mtp"))],
                         ids=["ngram", "draft-model", "mtp"])
def test_speculative_decoding_keeps_the_target_pool_and_its_tokens(make_model, rpc_server, monkeypatch, arch, spec):
    """Speculative decoding verifies drafts in small batches: the target context keeps its pool and
    serves them (hybrid, the default: any batch up to 32 tokens); a draft model's context, or the MTP
    context on the target's own weights (glm4moe's next-token layer), gets none. The accepted tokens
    and their log-probabilities are those of the same run without the pool."""
    monkeypatch.setenv("LLAMA_MOE_POOL_DEVICE_MIB", "65536")
    monkeypatch.setenv("GGML_MOE_POOL_STATS", "1")
    model = make_model(arch=arch)
    spec = [make_model(arch="qwen3moe", seed=11) if a == "DRAFT" else a for a in spec]
    args = ["--rpc", rpc_server.endpoint, "-ngl", "99", "-ngld", "99", "--cpu-moe", *map(str, spec)]
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    with llama_server(model, *args) as (port, _):
        reference = complete(port, prompt, 32)
    with llama_server(model, *args, "-mec", "6") as (port, lines):
        pooled = complete(port, prompt, 32)
    text = "".join(lines)
    assert pooled["content"] == reference["content"] and logprobs(pooled) == logprobs(reference)
    status = [l for l in lines if "expert pool status=" in l]
    assert "status=enabled" in status[0] and "mode=hybrid" in status[0]
    if "-md" in spec or "draft-mtp" in spec:
        assert any("status=disabled reason=draft-context" in l for l in status[1:])
        # a draft context never gets a pool: that is no warning, so the default verbosity shows nothing
        with llama_server(model, *args, "-mec", "6", verbosity=None) as (port, quiet):
            assert complete(port, prompt, 4)["content"]
        assert not report_lines(quiet)
    assert "expert pool first-use=active" in text
    runtime = next(l for l in lines if "expert pool runtime" in l)
    assert int(runtime.split(" steps=")[1].split()[0]) > 0
    # verification batches (the sampled token and its draft) were served by the pool
    batches = dict(re.findall(r"(\w+)=(\d+)", next(l for l in lines if "expert pool batches" in l)))
    assert int(batches["hits_b2_8"]) + int(batches["misses_b2_8"]) > 0, batches


def test_a_draft_model_s_weights_are_left_free_on_the_device(qwen3_model, make_model, rpc_server, monkeypatch):
    """llama-server loads -md's draft after the target context sized its pool: the pool leaves the
    draft file's size free (its weights, offloaded with -ngld 99), which the status line's cap shows."""
    monkeypatch.setenv("LLAMA_MOE_POOL_DEVICE_MIB", "8192")
    draft = make_model(arch="qwen3moe", seed=11)
    args = ["--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe", "-mec", "6"]
    caps = {}
    for name, extra in (("alone", []), ("with-draft", ["-md", str(draft), "-ngld", "99"])):
        with llama_server(qwen3_model, *args, *extra) as (port, lines):
            assert complete(port, PROMPTS[0], 4)["content"]
        status = next(l for l in lines if "expert pool status=enabled" in l)
        caps[name] = int(re.search(r" cap=(\d+)", status).group(1))
        text = "".join(lines)
    draft_mib = -(-draft.stat().st_size // 2**20)
    assert f"expert pool: leaving {draft_mib} MiB for the draft model's weights" in text
    assert caps["alone"] - caps["with-draft"] >= draft_mib * 2**20


def test_at_the_default_verbosity_only_a_pool_asked_for_and_not_made_is_reported(qwen3_model, rpc_server, monkeypatch):
    """The pool reports through libllama's log as upstream's MoE cache does: what it does at INFO, which
    llama.cpp's tools show from -lv 4, and a warning, shown by default, where -mec asked for a pool
    that is not there (here every expert already sits on the device)."""
    monkeypatch.setenv("LLAMA_MOE_POOL_DEVICE_MIB", "65536")
    with llama_server(qwen3_model, "--rpc", rpc_server.endpoint, "-ngl", "99", "-mec", "8", verbosity=None) as (port, lines):
        assert complete(port, PROMPTS[0], 4)["content"]
    status = [l for l in lines if "expert pool status=" in l]
    assert len(status) == 1 and "status=disabled reason=no-offloaded-experts requested_slots=8" in status[0]
    args = ["--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe", "-mec", "8"]
    with llama_server(qwen3_model, *args, verbosity=None) as (port, lines):
        assert complete(port, PROMPTS[0], 4)["content"]
    assert not report_lines(lines)
    with llama_server(qwen3_model, *args) as (port, lines):
        assert complete(port, PROMPTS[0], 4)["content"]
    assert any("expert pool status=enabled" in l for l in lines) and any("expert pool runtime" in l for l in lines)


@pytest.mark.parametrize("flag", ["-mec", "--moe-expert-cache"])
def test_server_rejects_bad_slot_counts_naming_the_value(qwen3_model, flag):
    result = subprocess.run([str(tool_path("llama-server")), "-m", str(qwen3_model), flag, "4,x"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "invalid slot count 'x'" in result.stderr + result.stdout


def test_server_uploads_repacked_experts_from_the_model_file(make_model, rpc_server, monkeypatch):
    """The CPU repacks Q4_0 experts into a layout of its own; common hands libllama the model's path,
    so the pool uploads those experts from the file instead of leaving the layers on the CPU."""
    monkeypatch.setenv("LLAMA_MOE_POOL_DEVICE_MIB", "65536")
    model = make_model(expert_type="Q4_0")
    with llama_server(model, "--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe", "-mec", "4",
                      "--moe-pool-mode", "copy", "-v") as (port, lines):
        assert complete(port, PROMPTS[0], 8)["content"]
    text = "".join(lines)
    assert "CPU_REPACK model buffer size" in text, "nothing was repacked: the test would not test the file path"
    assert "expert pool status=enabled" in text and "reason=repacked" not in text
    runtime = [l for l in lines if "expert pool runtime" in l]
    assert runtime and int(runtime[0].split(" uploads=")[1].split()[0]) > 0


def test_server_takes_the_slot_count_from_the_environment_and_a_list_per_device(qwen3_model, rpc_servers,
                                                                                 monkeypatch):
    servers = rpc_servers(2)
    rpc = ",".join(s.endpoint for s in servers)
    monkeypatch.setenv("LLAMA_MOE_POOL_DEVICE_MIB", "65536,65536")
    monkeypatch.setenv("LLAMA_ARG_MOE_EXPERT_CACHE", "6")
    with llama_server(qwen3_model, "--rpc", rpc, "-ngl", "99", "--cpu-moe") as (port, lines):
        assert complete(port, PROMPTS[0], 4)["content"]
    status = [l for l in lines if "expert pool status=" in l]
    assert len(status) == 2 and all("status=enabled" in l and "requested_slots=6" in l for l in status)
    monkeypatch.delenv("LLAMA_ARG_MOE_EXPERT_CACHE")
    with llama_server(qwen3_model, "--rpc", rpc, "-ngl", "99", "--cpu-moe", "-mec", "4,8") as (port, lines):
        assert complete(port, PROMPTS[0], 4)["content"]
    status = [l for l in lines if "expert pool status=" in l]
    assert len(status) == 2 and all("status=enabled" in l and " device=" in l for l in status)
    assert ["requested_slots=4" in status[0], "requested_slots=8" in status[1]] == [True, True]
    # a device given no slots is no warning: the default verbosity shows nothing of a pool that runs
    with llama_server(qwen3_model, "--rpc", rpc, "-ngl", "99", "--cpu-moe", "-mec", "0,8", verbosity=None) as (port, lines):
        assert complete(port, PROMPTS[0], 4)["content"]
    assert not report_lines(lines)


def test_llama_bench_sweeps_the_slot_count_in_an_mec_column(qwen3_model, rpc_server):
    argv = [str(tool_path("llama-bench")), "-m", str(qwen3_model), "--rpc", rpc_server.endpoint, "-ngl", "99",
            "-ncmoe", "99", "-mec", "0,8", "-p", "0", "-n", "8", "-r", "1", "-t", "1", "-o", "md", "-v"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "LLAMA_MOE_POOL_DEVICE_MIB": "65536"})
    assert result.returncode == 0, result.stderr[-2000:]
    table = [l for l in result.stdout.splitlines() if l.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert "mec" in header
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in table[2:]]
    assert [r[header.index("mec")] for r in rows] == ["0", "8"]
    assert result.stderr.count("expert pool status=enabled") == 1  # -mec 0: no pool at all


def test_llama_bench_reads_the_profile_named_in_the_environment_once_and_refuses_one_it_cannot_read_up_front(
        qwen3_model, rpc_server, tmp_path):
    profile = tmp_path / "profile.txt"
    profile.write_text("blk.0 0.5\nblk.1 two\nblk.3 4\n")
    argv = [str(tool_path("llama-bench")), "-m", str(qwen3_model), "--rpc", rpc_server.endpoint, "-ngl", "99",
            "-ncmoe", "99", "-mec", "0,8,12", "-p", "0", "-n", "4", "-r", "1", "-t", "1", "-o", "csv", "-v"]
    env = {**os.environ, "LLAMA_MOE_POOL_DEVICE_MIB": "65536", "LLAMA_MOE_POOL_PROFILE": str(profile)}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count(f"expert pool: profile {profile}: line 2: the weight is not a positive number") == 1
    status = [l for l in result.stderr.splitlines() if "expert pool status=enabled" in l]
    assert len(status) == 2 and all("alloc=weighted" in l and f"profile={profile}" in l for l in status)
    # a profile that cannot be read stops the bench before its first test, -mec 0's included
    missing = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                             env={**env, "LLAMA_MOE_POOL_PROFILE": str(tmp_path / "none.txt")})
    assert missing.returncode != 0 and f"profile {tmp_path / 'none.txt'} cannot be read" in missing.stderr
    assert len(list(csv.DictReader(io.StringIO(missing.stdout)))) == 0, missing.stdout


def test_llama_bench_crosses_the_slot_count_with_micro_batch_sizes_and_prompt_plus_generation(qwen3_model,
                                                                                              rpc_server):
    """-mec with -ub sweeps and -pg (a prompt, then generation in the same test): the pool's effect on
    prompt batches and decode shows per row; the pool's batch telemetry comes out with the runs."""
    argv = [str(tool_path("llama-bench")), "-m", str(qwen3_model), "--rpc", rpc_server.endpoint, "-ngl", "99",
            "-ncmoe", "99", "-mec", "0,8", "-ub", "16,64", "-p", "0", "-n", "0", "-pg", "48,8", "-r", "1", "-t", "1",
            "-o", "csv", "-v"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "LLAMA_MOE_POOL_DEVICE_MIB": "65536", "GGML_MOE_POOL_STATS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    got = sorted((r["moe_expert_cache"], r["n_ubatch"], r["n_prompt"], r["n_gen"]) for r in rows)
    assert got == sorted((str(m), str(u), "48", "8") for m in (0, 8) for u in (16, 64)), got
    # -ub 16: the prompt's three 16-token micro-batches are pooled (hybrid); -ub 64: one 48-token
    # batch, above the pool's 32, takes the stock path
    batches = [dict(re.findall(r"(\w+)=(\d+)", l)) for l in result.stderr.splitlines() if "expert pool batches" in l]
    runtime = [dict(re.findall(r"(\w+)=(\d+)", l)) for l in result.stderr.splitlines() if "expert pool runtime" in l]
    assert len(batches) == len(runtime) == 2, result.stderr[-3000:]
    assert any(int(b["hits_b9_32"]) + int(b["misses_b9_32"]) > 0 for b in batches)
    assert any(int(r["bypassed_steps"]) > 0 for r in runtime)


def test_llama_bench_sweeps_the_pool_mode_in_a_mode_column_kept_last_in_csv(qwen3_model, rpc_server):
    argv = [str(tool_path("llama-bench")), "-m", str(qwen3_model), "--rpc", rpc_server.endpoint, "-ngl", "99",
            "-ncmoe", "99", "-mec", "8", "--moe-pool-mode", "copy,hybrid", "-p", "0", "-n", "8", "-r", "1", "-t", "1"]
    env = {**os.environ, "LLAMA_MOE_POOL_DEVICE_MIB": "65536"}
    result = subprocess.run([*argv, "-o", "md", "-v"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    table = [l for l in result.stdout.splitlines() if l.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in table[2:]]
    assert [r[header.index("mode")] for r in rows] == ["copy", "hybrid"]
    assert "mode=copy" in result.stderr and "mode=hybrid" in result.stderr
    # new columns go at the end of the CSV: existing readers keep their column positions
    csv = subprocess.run([*argv, "-o", "csv"], capture_output=True, text=True, timeout=300, env=env)
    assert csv.returncode == 0, csv.stderr[-2000:]
    lines = csv.stdout.strip().splitlines()
    header = lines[0].split(",")
    assert header[-2:] == ["moe_expert_cache", "moe_pool_mode"]
    # upstream's columns keep their order: the timings follow n_depth, as in stock llama-bench
    assert header[header.index("n_depth") + 1:header.index("n_depth") + 7] == \
        ["test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "moe_expert_cache"]
    assert [l.split(",")[-1].strip('"') for l in lines[1:]] == ["copy", "hybrid"]
    assert [l.split(",")[-2].strip('"') for l in lines[1:]] == ["8", "8"]
    bad = subprocess.run([*argv[:-2], "--moe-pool-mode", "turbo"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode != 0


def _run_as_printed(command_line: str, monkeypatch):
    """A tune command line as a user pastes it: VAR=value words set the environment, `pyllamapool` is
    this interpreter's module (the same entry point an installed package puts on PATH)."""
    import shlex
    import sys

    words = shlex.split(command_line)
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        monkeypatch.setenv(key, value)
    assert words[:2] == ["pyllamapool", "server"], words
    return [sys.executable, "-m", "pyllamapool", *words[1:]]


@pytest.mark.parametrize("modes", [None, "hybrid"], ids=["best-of-all", "hybrid-only"])
def test_tune_recommends_a_setting_whose_command_line_starts_the_server_with_it(qwen3_model, rpc_server,
                                                                               monkeypatch, modes):
    import sys

    argv = [sys.executable, "-m", "pyllamapool", "tune", str(qwen3_model), "--rpc", rpc_server.endpoint,
            "--device-mib", "16384", "-n", "24", "--json"] + (["--mode", modes] if modes else [])
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    tuned = json.loads(result.stdout)
    assert tuned["schema"] == "pyllamapool.tune/1" and tuned["host"]["ms_per_expert"] > 0 and tuned["link"]
    choices = tuned["choices"]
    assert choices[0]["mode"] == "stock" and all(c["source"] == "measured" for c in choices)
    assert {c["mode"] for c in choices[1:]} == ({"hybrid"} if modes else {"hybrid", "copy"})
    best = tuned["best"]
    stock = choices[0]["tokens_per_s"]
    # the pool is recommended only where it beat stock by more than the margin; else stock
    assert best["mode"] == "stock" or best["tokens_per_s"] >= 1.05 * stock
    if modes == "hybrid":
        best_hybrid = max(choices[1:], key=lambda c: c["tokens_per_s"])
        assert best == (best_hybrid if best_hybrid["tokens_per_s"] >= 1.05 * stock else choices[0])
    with llama_server_argv(_run_as_printed(tuned["command_line"], monkeypatch)) as (port, lines):
        assert complete(port, "the quick brown fox", n=4)["content"] is not None
    text = "".join(lines)
    if best["mode"] == "stock":
        assert "expert pool status=enabled" not in text
    else:
        status = next(l for l in lines if "expert pool status=" in l)
        assert "status=enabled" in status and f"mode={best['mode']}" in status
        assert f"actual_slots={best['slots']}" in status


def test_with_host_experts_and_no_mec_the_server_runs_mec_auto_and_mec_0_turns_it_off(qwen3_model, rpc_server,
                                                                                      monkeypatch):
    """Routed experts in host memory (--cpu-moe) on an accelerator and no -mec: the tools run -mec auto,
    which sizes the pool itself and times decode with and without it. The status line says the size is
    the default's, and the tokens are the stock run's. -mec 0 turns the pool off and says nothing; so
    does a run whose experts all sit on the device, where the default has nothing to pool."""
    monkeypatch.setenv("LLAMA_MOE_POOL_DEVICE_MIB", "65536")
    args = ["--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe"]
    with llama_server(qwen3_model, *args, "-mec", "0") as (port, lines):
        reference = complete(port, PROMPTS[0], 40)
    assert not any("expert pool" in l for l in lines)
    with llama_server(qwen3_model, *args) as (port, lines):
        default = complete(port, PROMPTS[0], 40)
    status = next(l for l in lines if "expert pool status=" in l)
    assert "status=enabled" in status and "gate=auto" in status and "requested_slots=-1 size=default" in status
    assert any(re.search(r"expert pool auto=(pool|stock) reason=", l) for l in lines)
    assert default["content"] == reference["content"] and logprobs(default) == logprobs(reference)
    with llama_server(qwen3_model, *args, "-mec", "auto") as (port, lines):
        assert complete(port, PROMPTS[0], 4)["content"]
    assert "requested_slots=-1 size=auto" in next(l for l in lines if "expert pool status=" in l)
    with llama_server(qwen3_model, "--rpc", rpc_server.endpoint, "-ngl", "99") as (port, lines):
        assert complete(port, PROMPTS[0], 4)["content"]
    assert not any("expert pool" in l for l in lines)


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            # the pool's counts are whole numbers, printed in full (not as 1.23457e+06)
            assert not name.startswith("llamacpp:moe_pool_") or name.endswith("seconds_total") or value.isdigit(), line
            values[name] = float(value)
    return values


def test_the_server_s_metrics_carry_the_pool_s_status_and_counters(qwen3_model, rpc_server, monkeypatch):
    """With --metrics, /metrics has the pool's status and counters beside the server's own, so a user
    sees what the cache does without -lv 4: they count the decode tokens of a request, hits and misses
    add up to the lookups, and an info series carries the status line's settings. Without a pool there
    are none."""
    monkeypatch.setenv("LLAMA_MOE_POOL_DEVICE_MIB", "65536")
    args = ["--rpc", rpc_server.endpoint, "-ngl", "99", "--cpu-moe", "--metrics"]
    with llama_server(qwen3_model, *args, "-mec", "6", "--moe-pool-mode", "copy") as (port, lines):
        before = _metrics(port)
        result = complete(port, PROMPTS[0], 16)
        after = _metrics(port)
    assert before["llamacpp:moe_pool_enabled"] == 1 and before["llamacpp:moe_pool_lookups_total"] == 0
    assert after["llamacpp:moe_pool_slots"] > 0 and after["llamacpp:moe_pool_bytes"] > 0
    lookups, hits, misses = (after[f"llamacpp:moe_pool_{k}_total"] for k in ("lookups", "hits", "misses"))
    assert lookups > 0 and hits + misses == lookups and misses > 0
    assert after["llamacpp:moe_pool_uploads_total"] == misses  # copy mode uploads every miss
    assert after["llamacpp:moe_pool_uploaded_bytes_total"] > 0
    # decode tokens after the first (which the prompt's batch computes) are the pool's steps
    assert after["llamacpp:moe_pool_tokens_total"] == result["tokens_predicted"] - 1
    assert after["llamacpp:moe_pool_stood_down_steps_total"] == 0
    info = [k for k in after if k.startswith("llamacpp:moe_pool_info{")]
    assert len(info) == 1 and 'mode="copy"' in info[0] and 'reason="admitted"' in info[0]
    with llama_server(qwen3_model, *args, "-mec", "0") as (port, lines):
        assert complete(port, PROMPTS[0], 4)["content"]
        assert not any("moe_pool" in k for k in _metrics(port))
