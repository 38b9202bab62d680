"""Full-size models: a released MoE's shape written as random, valid quant blocks at disk speed."""
from __future__ import annotations

import numpy as np
import pytest

from pyllamapool.run import fullsize as F
from pyllamapool.errors import PyllamapoolError
from pyllamapool.run.testmodel import ModelSpec, StreamSpec, spec_of, token_stream


def _tensors(path):
    import gguf
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("expert_type", list(F.FORMATS))
def test_every_format_writes_blocks_gguf_decodes_with_the_spread_asked_for(tmp_path, expert_type):
    from gguf import quants

    spec = F.shape("tiny", expert_type=expert_type)
    stats = F.write_fullsize_model(spec, tmp_path / "m.gguf")
    tensors = _tensors(stats.path)
    gate, down = tensors["blk.2.ffn_gate_exps.weight"], tensors["blk.2.ffn_down_exps.weight"]
    assert gate.tensor_type.name == expert_type and tuple(gate.shape) == (spec.n_embd, spec.n_ff_exp, spec.n_expert)
    for t, fan_in in ((gate, spec.n_embd), (down, spec.n_ff_exp)):
        w = quants.dequantize(np.array(t.data), t.tensor_type)
        assert np.isfinite(w).all()
        assert w.std() == pytest.approx(0.9 / fan_in ** 0.5, rel=0.1)
        assert abs(w.mean()) < 0.15 * w.std()
    # the router and norms stay F32, the projections are F16
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "F16"
    assert stats.bytes == stats.path.stat().st_size and stats.seconds_per_gb > 0


def test_the_bytes_depend_on_the_spec_and_seed_not_on_the_thread_count(tmp_path):
    spec = F.shape("tiny")
    one = F.write_fullsize_model(spec, tmp_path / "a.gguf", threads=1).path.read_bytes()
    many = F.write_fullsize_model(spec, tmp_path / "b.gguf", threads=4).path.read_bytes()
    other = F.write_fullsize_model(F.shape("tiny", seed=1), tmp_path / "c.gguf").path.read_bytes()
    assert one == many
    assert len(other) == len(one) and other != one
    # different experts, not one block repeated
    t = _tensors(tmp_path / "a.gguf")["blk.0.ffn_up_exps.weight"]
    data = np.array(t.data).reshape(spec.n_expert, -1)
    assert len({row.tobytes() for row in data}) == spec.n_expert


def test_llama_cpp_loads_and_decodes_it_and_routing_follows_the_topic(tmp_path):
    from pyllamapool.run.offload import Offload
    from pyllamapool.run.session import PoolSession
    from pyllamapool.run.trace import locality, record_trace

    path = F.write_fullsize_model(F.shape("tiny"), tmp_path / "m.gguf").path
    spec = spec_of(path)
    assert spec == F.shape("tiny")  # the provenance key: token streams match the model's topics
    staying = token_stream(spec, StreamSpec(n_tokens=72, seed=3))
    jumping = token_stream(spec, StreamSpec(n_tokens=72, seed=3, p_stay=0.0))
    with PoolSession(path, Offload(n_ctx=256)) as session:
        run = session.run(staying[:8], 0, teacher_tokens=staying[8:], keep_logits=True)
        assert np.isfinite(np.array(run.decode.logits)).all()
        reuse = [locality(record_trace(session.model, s[:8], s[8:], n_ctx=256)).reuse_prev for s in (staying, jumping)]
    # random experts do not wash out the topic the router reads: a stream that stays on its topic
    # reuses more of the previous token's experts than one that changes topic at every token
    assert reuse[0] > reuse[1] + 0.1, reuse


def test_bad_specs_name_the_value_and_what_is_accepted(tmp_path):
    with pytest.raises(PyllamapoolError, match=r"expert type 'F16' is not one: accepted are Q4_0, Q8_0"):
        F.write_fullsize_model(F.shape("tiny", expert_type="F16"), tmp_path / "m.gguf")
    with pytest.raises(PyllamapoolError, match=r"unknown shape 'qwen9'; shapes: qwen3-30b-a3b, medium"):
        F.shape("qwen9")
    with pytest.raises(PyllamapoolError, match="qwen3moe"):
        F.write_fullsize_model(ModelSpec(arch="qwen2moe", n_embd=256, n_ff_exp=256, expert_type="Q4_K"),
                               tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_the_qwen3_30b_shape_is_the_released_models():
    s = F.SHAPES["qwen3-30b-a3b"]
    assert (s.n_layer, s.n_expert, s.n_expert_used, s.n_embd, s.n_ff_exp, s.expert_type) == (48, 128, 8, 2048, 768, "Q4_K")
    # 3 matrices of 2048 x 768 at 144 bytes per 256 weights, for every expert of every layer: ~16.3 GB
    assert 48 * 128 * 3 * 2048 * 768 // 256 * 144 == pytest.approx(16.3e9, rel=0.01)
