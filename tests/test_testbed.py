"""The CPU testbed: generated MoE models, the loopback RPC device, the binding, scripted decode, traces."""
from __future__ import annotations

import hashlib
import logging
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from pyllamapool.run.decode import run, run_context
from pyllamapool.run.offload import Offload
from pyllamapool.errors import PyllamapoolError
from pyllamapool.binding import logs
from pyllamapool.binding.llama import Context, Model, ModelLoadError, Sampler
from pyllamapool.run.rpc import RpcServer, RpcServerError, start_rpc_server
from pyllamapool.run.testmodel import ModelSpec, StreamSpec, token_stream, write_model
from pyllamapool.run.trace import Trace, expert_bytes_from_gguf, locality, record_trace


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------
# generator


def test_same_seed_gives_byte_identical_files(tmp_path):
    a = write_model(ModelSpec(seed=5), tmp_path / "a.gguf")
    b = write_model(ModelSpec(seed=5), tmp_path / "b.gguf")
    c = write_model(ModelSpec(seed=6), tmp_path / "c.gguf")
    assert sha(a) == sha(b)
    assert sha(a) != sha(c)


def test_default_model_is_a_few_megabytes(qwen3_model):
    assert 1e6 < qwen3_model.stat().st_size < 12e6


@pytest.mark.parametrize("changes,needle", [
    ({"arch": "llama"}, "unknown arch"), ({"expert_type": "Q4_1"}, "unknown expert type"),
    ({"n_expert_used": 20}, "exceeds"), ({"expert_type": "Q4_K"}, "multiple of 256"),
    ({"n_layer": 0}, "n_layer"),
])
def test_bad_specs_are_rejected_clearly(tmp_path, changes, needle):
    with pytest.raises(PyllamapoolError, match=needle):
        write_model(ModelSpec(**changes), tmp_path / "x.gguf")


def test_widening_keeps_every_expert_and_tensor_and_adds_new_experts(tmp_path):
    import gguf

    from pyllamapool.run.testmodel import widen_experts

    f32 = write_model(ModelSpec(expert_type="F32"), tmp_path / "f32.gguf")
    wide = widen_experts(f32, tmp_path / "wide.gguf", 24, seed=3)
    before = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(f32)).tensors}
    reader = gguf.GGUFReader(str(wide))
    after = {t.name: np.array(t.data) for t in reader.tensors}
    assert reader.fields["qwen3moe.expert_count"].contents() == 24
    assert set(after) == set(before)
    for name, old in before.items():
        if "_exps." in name or "ffn_gate_inp." in name:
            assert after[name].shape == (24,) + old.shape[1:]
            assert np.array_equal(after[name][: old.shape[0]], old)
            assert not np.array_equal(after[name][old.shape[0]:], np.resize(old, after[name][old.shape[0]:].shape))
        else:
            assert np.array_equal(after[name], old)
    with pytest.raises(PyllamapoolError, match="has 16 experts; asked for 8"):
        widen_experts(f32, tmp_path / "narrow.gguf", 8)


def per_expert_tensors(path) -> dict[str, tuple[int, ...]]:
    """Tensors with one entry per routed expert (outermost axis), by name: the experts' weights,
    biases and scales, the router's rows and bias, the selection bias added before top-k."""
    import re

    import gguf

    pattern = re.compile(r"\.(ffn_(gate|up|down|gate_up)_exps\.\w+|ffn_gate_inp\.(weight|bias)|exp_probs_b(_vl)?(\.bias)?)$")
    return {t.name: tuple(np.array(t.data).shape) for t in gguf.GGUFReader(str(path)).tensors
            if pattern.search(t.name)}


def test_widening_a_model_with_a_selection_bias_widens_it_and_zeros_stay_zeros(tmp_path):
    """glm4moe routes by sigmoid scores plus a per-expert selection bias (exp_probs_b, zeros here):
    llama.cpp checks its width against expert_count like the experts'."""
    import gguf

    from pyllamapool.run.testmodel import widen_experts

    src = write_model(ModelSpec(arch="glm4moe", expert_type="F32"), tmp_path / "glm.gguf")
    wide = widen_experts(src, tmp_path / "wide.gguf", 24, seed=3)
    shapes = per_expert_tensors(wide)
    assert any(".exp_probs_b" in n for n in shapes)
    assert all(shape[0] == 24 for shape in shapes.values()), shapes
    biases = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(wide)).tensors if "exp_probs_b" in t.name}
    assert biases and all(not b.any() for b in biases.values())
    model = Model(wide)
    assert model.n_expert == 24
    model.close()


@pytest.mark.parametrize("arch", ["deepseek2", "dots1", "ernie4_5-moe", "mistral4",
                                  "hy_v3",        # exp_probs_b without `.bias`
                                  "deepseek4"])   # and exp_probs_b_vl
def test_a_widened_test_llama_archs_model_has_every_per_expert_tensor_at_the_new_width(archs_source, tmp_path,
                                                                                     arch):
    """These architectures carry a random selection bias besides the router: every per-expert
    tensor grows to the new width, the old experts' entries are kept, and llama.cpp (which refuses
    a tensor of the wrong shape) loads the result with the new expert count."""
    import gguf

    from pyllamapool.run.testmodel import widen_experts

    from archmodels import expert_count

    src = archs_source(arch)
    n_old = expert_count(src)       # two for most architectures; deepseek2 is made with 64
    width = n_old + 6
    wide = widen_experts(src, tmp_path / f"{arch}-{width}.gguf", width, seed=1)
    before, after = per_expert_tensors(src), per_expert_tensors(wide)
    assert set(before) == set(after) and any(".exp_probs_b" in n for n in after), sorted(after)
    assert all(shape[0] == n_old for shape in before.values()), before
    assert all(after[n] == (width,) + before[n][1:] for n in before), after
    old = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(src)).tensors if t.name in before}
    new = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(wide)).tensors if t.name in before}
    for name, data in old.items():
        assert np.array_equal(new[name][:n_old], data), name
        if data.std() > 0:  # drawn with the old entries' spread: not a copy of them
            assert not np.array_equal(new[name][n_old:n_old + 2], data[:2]), name
    model = Model(wide)   # on the CPU: the shapes are what is tested here
    assert model.n_expert == width
    model.close()


def test_the_suite_runs_with_its_own_cache_and_no_user_overrides():
    import os
    from pathlib import Path

    from pyllamapool.native.paths import cache_dir

    assert not [k for k in os.environ if k.startswith("PYLLAMAPOOL_")]
    assert Path.home() / ".cache" not in cache_dir().parents


def test_cached_models_are_keyed_by_the_generator_source_too(tmp_path, monkeypatch):
    from pyllamapool.run import testmodel

    spec = ModelSpec(n_layer=1)
    first = testmodel.cached_model(spec, tmp_path)
    assert testmodel.cached_model(spec, tmp_path) == first
    monkeypatch.setattr(testmodel, "generator_digest", lambda: "another generator")
    second = testmodel.cached_model(spec, tmp_path)
    assert second != first and second.exists()


def test_token_streams_are_deterministic_and_stay_on_topic():
    spec = ModelSpec()
    s1 = token_stream(spec, StreamSpec(n_tokens=400, seed=1))
    assert s1 == token_stream(spec, StreamSpec(n_tokens=400, seed=1))
    assert s1 != token_stream(spec, StreamSpec(n_tokens=400, seed=2))
    same_topic = sum(spec.topic_of(a) == spec.topic_of(b) for a, b in zip(s1, s1[1:])) / (len(s1) - 1)
    assert same_topic > 0.8  # p_stay = 0.95; a uniform stream would give 1/8


LOADABLE = [("qwen3moe", t) for t in ("F32", "F16", "Q8_0", "Q4_0", "Q4_K")] + [("qwen2moe", "F16"), ("qwen2moe", "Q8_0")]


@pytest.mark.parametrize("arch,expert_type", LOADABLE)
def test_llama_cpp_loads_and_decodes_every_architecture_and_storage_type(make_model, arch, expert_type):
    wide = {"n_embd": 256, "n_ff_exp": 256} if expert_type == "Q4_K" else {}
    path = make_model(arch=arch, expert_type=expert_type, **wide)
    if expert_type == "Q4_K":
        import gguf
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
        assert types["blk.0.ffn_up_exps.weight"] == "Q4_K"
    result = run(path, [1, 2, 3], 4)
    assert len(result.tokens) == 4
    assert all(0 <= t < 512 for t in result.tokens)


_AMX_PROMPT = """
import json, sys
from pyllamapool.binding import logs
from pyllamapool.run.decode import run
from pyllamapool.run.offload import Offload
with logs.capture() as lines:
    result = run(sys.argv[1], list(range(1, 17)), 2, offload=Offload(n_gpu_layers=0, n_threads=int(sys.argv[2])))
print(json.dumps({"amx": any("AMX model buffer" in text for _, text in lines), "tokens": list(result.tokens)}))
"""


def _cpu_has_amx_int8() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "amx_int8" in cpuinfo.read_text()


@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_prompt_decodes_through_q8_0_matrices_on_the_cpu_with_upstreams_amx_default(make_model, n_threads):
    """Patch 0004: on an AMX-INT8 CPU the Q8_0 matrices go to upstream's AMX buffer type, and a
    prompt-sized batch runs its tile matmul. Built with GCC 12, that matmul loaded a tile
    configuration the compiler had half dropped and died on the first prompt (SIGSEGV, SIGILL with
    one thread; llama.cpp #20824), so it runs in a process of its own: a regression fails here
    instead of taking the suite down."""
    import json
    import subprocess

    path = make_model(expert_type="Q4_K", n_embd=256, n_ff_exp=256)  # llama-quantize: Q8_0 projections
    result = subprocess.run([sys.executable, "-c", _AMX_PROMPT, str(path), str(n_threads)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["tokens"]) == 2 and all(0 <= t < 512 for t in out["tokens"])
    assert out["amx"] == _cpu_has_amx_int8()  # the AMX buffer type where the CPU has AMX-INT8, as upstream


# --------------------------------------------------------------------------------------------
# the RPC device


def test_rpc_server_starts_on_loopback_and_stops_by_pid():
    server = start_rpc_server()
    try:
        assert server.endpoint.startswith("127.0.0.1:")
        assert server.running and server.pid
        with socket.create_connection(("127.0.0.1", server.port), timeout=2):
            pass
        assert "Starting RPC server" in server.log_text()
    finally:
        server.stop()
    assert not server.running
    server.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_an_rpc_server_dies_with_a_parent_that_aborts():
    """A parent that aborts (a ggml assertion, say) runs no cleanup: the server goes anyway, by the
    parent-death signal, instead of holding its port and memory."""
    from procs import kill_if_alive, run_aborting_parent, wait_gone

    pids = run_aborting_parent(
        "import os\n"
        "from pyllamapool.run.rpc import start_rpc_server\n"
        "server = start_rpc_server()\n"
        "print(server.pid, flush=True)\n"
        "os.abort()\n")
    try:
        assert wait_gone(pids[0], timeout_s=5), f"ggml-rpc-server {pids[0]} outlived its aborted parent"
    finally:
        kill_if_alive(pids)


def test_rpc_devices_are_never_taken_for_the_builds_own_gpus(qwen3_model, rpc_server):
    from pyllamapool.binding.llama import devices, local_gpus

    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint])
    try:
        assert any(d.name.startswith("RPC") for d in devices())
        assert local_gpus() == []  # the CPU build has no GPU of its own; test_vulkan.py covers one that has
    finally:
        model.close()


def test_stopped_servers_are_forgotten_but_known_dead():
    from pyllamapool.run.rpc import server_for, stopped_here

    first = start_rpc_server()
    endpoint = first.endpoint
    assert server_for(endpoint) is first and not stopped_here(endpoint)
    first.close()
    assert server_for(endpoint) is None and stopped_here(endpoint)
    # a new server on the same port is alive again
    second = start_rpc_server(port=first.port)
    try:
        assert server_for(endpoint) is second and not stopped_here(endpoint)
    finally:
        second.close()


def test_several_rpc_servers_at_once(rpc_servers):
    servers = rpc_servers(2)
    assert len({s.port for s in servers}) == 2
    assert all(s.running for s in servers)


def test_busy_port_is_a_clear_error(rpc_server):
    with pytest.raises(RpcServerError, match=f"port {rpc_server.port} .* already in use"):
        RpcServer(rpc_server.port).start()


def test_missing_server_binary_is_a_clear_error(tmp_path):
    with pytest.raises(RpcServerError, match="does not exist"):
        start_rpc_server(binary=tmp_path / "ggml-rpc-server")


def test_unreachable_rpc_endpoint_is_a_clear_error(qwen3_model):
    # the port stays bound, and not listening, while the client connects: a freed port is one the
    # kernel may pick as the client's own source port, and a socket connected to itself reads back
    # what it sent, which ggml-rpc aborts on (seen once in a full run)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(PyllamapoolError, match="unreachable"):
            Model(qwen3_model, n_gpu_layers=99, rpc=[f"127.0.0.1:{port}"])


def test_a_connection_to_itself_is_no_rpc_server():
    from pyllamapool.binding.llama import _connected_to_itself

    # a socket bound to the port it connects to, with no listener there, connects to itself
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.connect(s.getsockname())
        assert _connected_to_itself(s)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()) as client:
            assert not _connected_to_itself(client)


# --------------------------------------------------------------------------------------------
# the binding: errors, logs, placement, parity


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Model(tmp_path / "nope.gguf")


def test_non_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Model(bad)


def test_truncated_gguf_is_a_clear_error_not_a_crash(qwen3_model, tmp_path, caplog):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(qwen3_model.read_bytes()[: qwen3_model.stat().st_size // 2])
    with caplog.at_level(logging.DEBUG, logger="pyllamapool.llama"):
        with pytest.raises(ModelLoadError, match="could not load"):
            Model(cut)
    # llama.cpp's own errors arrive in Python logging as ERROR, not DEBUG
    assert any(r.levelno == logging.ERROR for r in caplog.records)


def test_llama_cpp_info_logs_arrive_as_info(qwen3_model, caplog):
    with caplog.at_level(logging.DEBUG, logger="pyllamapool.llama"):
        Model(qwen3_model).close()
    levels = {r.levelno for r in caplog.records if "load_tensors" in r.getMessage()}
    assert logging.INFO in levels


def test_a_capture_ended_inside_another_leaves_the_outer_one_capturing(qwen3_model):
    with logs.capture() as outer:
        with logs.capture() as inner:
            pass  # both empty, so equal: the inner one ends, not the outer one
        Model(qwen3_model).close()
    assert not inner and any("load_tensors" in text for _, text in outer)


def expert_bytes(path) -> int:
    return sum(sum(per.values()) * 16 for per in expert_bytes_from_gguf(path).values())


def test_experts_on_host_and_everything_else_on_the_rpc_device(qwen3_model, rpc_server):
    # without mmap the host buffer holds exactly the overridden tensors (a mapping spans a file range)
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99, use_mmap=False)
    with Context(model) as ctx:
        rows = {r.buffer_type: r for r in ctx.memory()}
        host = [r for r in rows.values() if r.device == ""]
        device = [r for r in rows.values() if r.device.startswith("RPC")]
        assert device and host
        import gguf
        tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(qwen3_model)).tensors}
        experts = sum(v for k, v in tensors.items() if "_exps." in k)
        on_host = sum(r.model for r in host)
        # host memory holds the routed experts and the input embeddings, nothing else
        assert experts <= on_host <= experts + tensors["token_embd.weight"] + 64 * 1024
        # attention, router and output weights are on the RPC device
        non_expert = sum(v for k, v in tensors.items() if "_exps." not in k and k != "token_embd.weight")
        assert sum(r.model for r in device) >= non_expert
    model.close()


def test_greedy_decode_cpu_and_rpc_give_identical_tokens_and_logits(qwen3_model, rpc_server, stream):
    """Recorded finding: the RPC server runs the same CPU kernels, so logits are bit-identical."""
    cpu = run(qwen3_model, stream[:4], 24, keep_logits=True)
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    rpc = run(model, stream[:4], 24, offload=Offload(n_gpu_layers=99), keep_logits=True)
    model.close()
    assert cpu.tokens == rpc.tokens
    assert len(cpu.logits) == len(rpc.logits) >= 24
    assert all(np.array_equal(a, b) for a, b in zip(cpu.logits, rpc.logits))


def test_teacher_forced_replay_feeds_the_stream_and_reports_rates(qwen3_model, stream):
    result = run(qwen3_model, stream[:4], 0, teacher_tokens=stream[4:20])
    assert result.mode == "teacher-forced"
    assert len(result.tokens) == 16 and len(result.step_latency_ms) == 16
    assert result.decode_tokens_per_s > 0 and result.prefill_tokens_per_s > 0


def test_seeded_sampling_is_reproducible_and_differs_by_seed(qwen3_model):
    model = Model(qwen3_model)
    runs = []
    for seed in (1, 1, 2):
        with Context(model) as ctx:
            runs.append(run_context(ctx, [5, 6], 24, sampler=Sampler(greedy=False, seed=seed, temperature=1.5)).tokens)
    model.close()
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_text_prompts_are_tokenized_by_the_test_vocab(qwen3_model):
    result = run(qwen3_model, "hello world", 3)
    assert len(result.prompt_tokens) == 3  # the test vocab cuts text into 5-byte chunks
    assert result.text


# --------------------------------------------------------------------------------------------
# routing traces and locality


def test_trace_on_rpc_device_shows_locality(qwen3_model, rpc_server, tmp_path):
    spec = ModelSpec()
    stream = token_stream(spec, StreamSpec(n_tokens=257, seed=0))
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    trace = record_trace(model, stream[:1], stream[1:])
    model.close()
    assert trace.ids.shape == (256, spec.n_layer, spec.n_expert_used)
    assert trace.ids.min() >= 0 and trace.ids.max() < spec.n_expert
    loc = locality(trace)
    # skew: the most-used quarter of experts carries clearly more than a quarter of the selections
    assert np.mean(loc.top_quarter_share) > 0.4
    # reuse: most of a token's experts were used within the previous 8 tokens
    assert loc.reuse_window > 0.7
    assert loc.reuse_prev > 0.3
    saved = Trace.load(trace.save(tmp_path / "t.npz"))
    assert np.array_equal(saved.ids, trace.ids)
    assert saved.bytes_per_expert[0]["ffn_up_exps"] == 128 * 128 * 2
    assert saved.meta["source"] == "recorded"


def test_uniform_random_router_has_no_locality(make_model):
    """The control: with topic strength 0 and no popularity skew, routing is near uniform."""
    path = make_model(topic_strength=0.0, zipf=0.0, seed=9)
    spec = ModelSpec(topic_strength=0.0, zipf=0.0, seed=9)
    stream = token_stream(spec, StreamSpec(n_tokens=129, seed=4, p_stay=0.0))
    model = Model(path)
    loc = locality(record_trace(model, stream[:1], stream[1:]))
    model.close()
    assert loc.reuse_prev < 0.45
