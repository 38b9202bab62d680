"""Tiny, deterministic MoE GGUF models whose routing has locality, and token streams to drive them.

Random weights make a router pick experts almost uniformly, which makes every expert cache look
useless. These models are built so routing behaves like a real MoE's:

* every token belongs to a *topic*; its embedding is the topic's centroid plus a little noise;
* in each layer every expert has a *home topic* and a *popularity*; its router row points at its
  home topic's centroid, plus a shared direction scaled by its popularity (Zipf over a per-layer
  permutation, flatter in early layers), so the same few experts win while a stream stays on a topic;
* attention and expert outputs are small, so the residual stream keeps its topic through the layers.

`token_stream()` writes topic-Markov, Zipfian token sequences: a stream that stays on a topic reuses
experts from token to token, and a topic switch makes the working set move, as a new request does.
"""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import PyllamapoolError

#: qwen3moe; qwen2moe (a gated shared expert); glm4moe (sigmoid routing with a bias, one shared expert, and
#: one MTP layer after the trunk, for llama-server --spec-type draft-mtp)
ARCHITECTURES = ("qwen3moe", "qwen2moe", "glm4moe")
#: expert storage types written by the gguf package itself
NATIVE_TYPES = ("F32", "F16", "Q8_0", "Q4_0")
#: types that go through the pinned tree's llama-quantize (the gguf package cannot write them)
QUANTIZE_TYPES = {"Q2_K": "q2_K", "Q3_K": "q3_K", "Q4_K": "q4_K", "Q5_K": "q5_K", "Q6_K": "q6_K",
                  "IQ4_XS": "iq4_xs", "IQ4_NL": "iq4_nl"}
EXPERT_TYPES = NATIVE_TYPES + tuple(QUANTIZE_TYPES)
_BLOCK = {"F32": 1, "F16": 1, "Q8_0": 32, "Q4_0": 32, "Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256,
          "Q6_K": 256, "IQ4_XS": 256, "IQ4_NL": 32}


def block_size(expert_type: str) -> int:
    """Weights per quantization block of an expert type: n_embd and n_ff_exp must be multiples of it."""
    return _BLOCK[expert_type]


@dataclass(frozen=True)
class ModelSpec:
    """Knobs of a generated model. Defaults: ~2 MB, decodes at hundreds of tokens/s on 2 cores."""
    arch: str = "qwen3moe"
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    n_expert: int = 16
    n_expert_used: int = 4
    n_ff_exp: int = 128
    n_ff_shexp: int = 128         # qwen2moe only
    n_vocab: int = 512
    n_ctx_train: int = 4096
    expert_type: str = "F16"
    #: ffn_down_exps's type layer by layer, in turn (layer i takes down_types[i % len]): the mix a
    #: Q4_K_M file has, where some layers' ffn_down gets more bits. Empty: expert_type. Types the
    #: gguf package writes only
    down_types: tuple[str, ...] = ()
    #: number of token topics; routing reuse comes from streams that stay on one topic
    n_topics: int = 8
    #: Zipf exponent of per-layer expert popularity (last layer); early layers are flatter
    zipf: float = 0.8
    #: how strongly a token's topic drives the router, vs per-token noise
    topic_strength: float = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        # a spec read back from a model's metadata (JSON) has a list here: the same spec, hashable
        object.__setattr__(self, "down_types", tuple(self.down_types))

    def validate(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise PyllamapoolError(f"unknown arch {self.arch!r}; supported: {', '.join(ARCHITECTURES)}")
        if self.expert_type not in EXPERT_TYPES:
            raise PyllamapoolError(f"unknown expert type {self.expert_type!r}; supported: "
                                   f"{', '.join(EXPERT_TYPES)}")
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_expert", "n_expert_used",
                     "n_ff_exp", "n_vocab", "n_topics"):
            if getattr(self, name) < 1:
                raise PyllamapoolError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_expert_used > self.n_expert:
            raise PyllamapoolError(f"top-k {self.n_expert_used} exceeds the {self.n_expert} experts")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise PyllamapoolError(f"n_embd {self.n_embd} must divide by n_head {self.n_head}, and "
                                   f"n_head by n_head_kv {self.n_head_kv}")
        if self.down_types and not (self.expert_type in NATIVE_TYPES and set(self.down_types) <= set(NATIVE_TYPES)):
            raise PyllamapoolError(f"down_types {self.down_types!r} with {self.expert_type} experts: a mixed "
                                   f"layout takes types the gguf package writes: {', '.join(NATIVE_TYPES)}")
        block = max(block_size(t) for t in (self.expert_type, *self.down_types))
        for name in ("n_embd", "n_ff_exp"):
            if getattr(self, name) % block:
                raise PyllamapoolError(f"{'/'.join((self.expert_type, *self.down_types))} experts need {name} to be a multiple of "
                                       f"{block}, got {getattr(self, name)}")
        if self.n_vocab < self.n_topics:
            raise PyllamapoolError(f"n_vocab {self.n_vocab} must be at least n_topics {self.n_topics}")

    @property
    def file_stem(self) -> str:
        # the generator's own source is part of the name: a cached model written by an older
        # generator is never mistaken for this one's
        key = json.dumps(asdict(self), sort_keys=True) + generator_digest()
        digest = hashlib.sha256(key.encode()).hexdigest()[:10]
        return f"tiny-{self.arch}-L{self.n_layer}-E{self.n_expert}k{self.n_expert_used}-" \
               f"{self.expert_type.lower()}-s{self.seed}-{digest}"

    def topic_of(self, token: int) -> int:
        return token % self.n_topics


def generator_digest() -> str:
    """A digest of this module's source: what a cached model's bytes depend on besides its spec."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def _topics_per_token(spec: ModelSpec) -> np.ndarray:
    return np.arange(spec.n_vocab) % spec.n_topics


def _weights(spec: ModelSpec, experts: bool = True,
             projection: Callable[[tuple[int, int]], np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """All tensors as float32 arrays in numpy (row-major, gguf) order: shape = reversed ggml ne.
    Without `experts`, the routed experts' weights are left out (a caller writes its own);
    `projection(shape)` draws the attention projections instead of this generator (a full-size
    model's 500M of them take seconds here)."""
    rng = np.random.default_rng(spec.seed)
    small = 0.02
    if projection is None:
        def projection(shape: tuple[int, int]) -> np.ndarray:
            return (rng.standard_normal(shape) * small).astype(np.float32)
    d, v = spec.n_embd, spec.n_vocab
    head_dim = d // spec.n_head
    kv = head_dim * spec.n_head_kv
    # Topic centroids are orthonormal-ish; one extra shared direction carries expert popularity.
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0].T.astype(np.float32)
    centroids = basis[: spec.n_topics]
    shared = basis[spec.n_topics % d]
    topics = _topics_per_token(spec)
    emb = centroids[topics] * spec.topic_strength + shared * 1.0 \
        + rng.standard_normal((v, d)).astype(np.float32) * 0.35
    t: dict[str, np.ndarray] = {
        "token_embd.weight": emb.astype(np.float32),
        "output_norm.weight": np.ones(d, np.float32),
        "output.weight": (rng.standard_normal((v, d)) * 0.5).astype(np.float32),
    }
    n_mtp = 1 if spec.arch == "glm4moe" else 0
    for il in range(spec.n_layer + n_mtp):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = np.ones(d, np.float32)
        t[p + "attn_q.weight"] = projection((d, d))
        t[p + "attn_k.weight"] = projection((kv, d))
        t[p + "attn_v.weight"] = projection((kv, d))
        t[p + "attn_output.weight"] = projection((d, d))
        if spec.arch == "qwen3moe":
            t[p + "attn_q_norm.weight"] = np.ones(head_dim, np.float32)
            t[p + "attn_k_norm.weight"] = np.ones(head_dim, np.float32)
        t[p + ("post_attention_norm.weight" if spec.arch == "glm4moe" else "ffn_norm.weight")] = np.ones(d, np.float32)
        # Router: home topic + popularity (Zipf over a per-layer permutation; flatter early on).
        depth = (il + 1) / spec.n_layer
        exponent = spec.zipf * (0.35 + 0.65 * depth)
        ranks = rng.permutation(spec.n_expert) + 1
        popularity = ranks.astype(np.float32) ** -exponent
        popularity = np.log(popularity / popularity.mean()) * 1.5
        homes = rng.permutation(np.arange(spec.n_expert) % spec.n_topics)
        router = centroids[homes] * 2.0 + np.outer(popularity, shared) \
            + rng.standard_normal((spec.n_expert, d)).astype(np.float32) * 0.6
        t[p + "ffn_gate_inp.weight"] = router.astype(np.float32)
        f = spec.n_ff_exp
        if experts:
            t[p + "ffn_gate_exps.weight"] = (rng.standard_normal((spec.n_expert, f, d)) * 0.08).astype(np.float32)
            t[p + "ffn_up_exps.weight"] = (rng.standard_normal((spec.n_expert, f, d)) * 0.08).astype(np.float32)
            t[p + "ffn_down_exps.weight"] = (rng.standard_normal((spec.n_expert, d, f)) * 0.08).astype(np.float32)
        if spec.arch in ("qwen2moe", "glm4moe"):
            s = spec.n_ff_shexp if spec.arch == "qwen2moe" else f  # glm4moe: one shared expert
            if spec.arch == "qwen2moe":
                t[p + "ffn_gate_inp_shexp.weight"] = (rng.standard_normal(d) * 0.1).astype(np.float32)
            t[p + "ffn_gate_shexp.weight"] = (rng.standard_normal((s, d)) * 0.05).astype(np.float32)
            t[p + "ffn_up_shexp.weight"] = (rng.standard_normal((s, d)) * 0.05).astype(np.float32)
            t[p + "ffn_down_shexp.weight"] = (rng.standard_normal((d, s)) * 0.05).astype(np.float32)
        if spec.arch == "glm4moe":
            t[p + "exp_probs_b.bias"] = np.zeros(spec.n_expert, np.float32)
        if il >= spec.n_layer:
            # the MTP layer: the next token's embedding and this one's hidden state, projected together
            t[p + "nextn.eh_proj.weight"] = (rng.standard_normal((d, 2 * d)) * 0.05).astype(np.float32)
            t[p + "nextn.enorm.weight"] = np.ones(d, np.float32)
            t[p + "nextn.hnorm.weight"] = np.ones(d, np.float32)
            t[p + "nextn.shared_head_norm.weight"] = np.ones(d, np.float32)
    return t


def _is_expert(name: str) -> bool:
    return "_exps." in name


def new_writer(spec: ModelSpec, path: Path, file_type) -> "gguf.GGUFWriter":
    """A GGUF writer with every key of spec's model written (tensors still to add)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), spec.arch)
    writer.add_name(f"pyllamapool tiny {spec.arch}")
    writer.add_context_length(spec.n_ctx_train)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer + (1 if spec.arch == "glm4moe" else 0))
    writer.add_feed_forward_length(spec.n_ff_exp * spec.n_expert_used)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_expert_count(spec.n_expert)
    writer.add_expert_used_count(spec.n_expert_used)
    writer.add_expert_feed_forward_length(spec.n_ff_exp)
    if spec.arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
    if spec.arch == "glm4moe":
        writer.add_uint32(f"{spec.arch}.expert_shared_count", 1)
        writer.add_uint32(f"{spec.arch}.leading_dense_block_count", 0)
        writer.add_bool(f"{spec.arch}.expert_weights_norm", True)
        writer.add_float32(f"{spec.arch}.expert_weights_scale", 1.0)
        writer.add_uint32(f"{spec.arch}.nextn_predict_layers", 1)
    writer.add_file_type(file_type)
    writer.add_tokenizer_model("test")
    writer.add_token_list([f"tok_{i}" for i in range(spec.n_vocab)])
    writer.add_token_scores([0.0] * spec.n_vocab)
    # Provenance: the spec, so a file can be tied back to the knobs that made it.
    writer.add_string("pyllamapool.model_spec", json.dumps(asdict(spec), sort_keys=True))
    return writer


def _expert_type_of(spec: ModelSpec, name: str, expert_type: str) -> str:
    """The storage type of expert tensor `name`: down_types's turn for ffn_down_exps (validate lets
    down_types only where the gguf package writes the whole file)."""
    m = re.match(r"^blk\.(\d+)\.ffn_down_exps\.", name)
    if m and spec.down_types:
        return spec.down_types[int(m.group(1)) % len(spec.down_types)]
    return expert_type


def _write_gguf(spec: ModelSpec, path: Path, expert_type: str) -> None:
    import gguf

    writer = new_writer(spec, path, gguf.LlamaFileType.MOSTLY_F16 if expert_type == "F16"
                        else gguf.LlamaFileType.ALL_F32)
    for name, data in _weights(spec).items():
        qtype = getattr(gguf.GGMLQuantizationType, _expert_type_of(spec, name, expert_type))
        if _is_expert(name) and qtype != gguf.GGMLQuantizationType.F32:
            if qtype == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(name, data.astype(np.float16))
            else:
                writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_model(spec: ModelSpec, path: Path, quantize_bin: Path | None = None) -> Path:
    """Write the model described by spec to path (deterministic: same spec -> same bytes)."""
    spec.validate()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if spec.expert_type in NATIVE_TYPES:
        tmp = path.with_suffix(".tmp")
        _write_gguf(spec, tmp, spec.expert_type)
        tmp.replace(path)
        return path
    # K-quants and IQ types: the pinned tree's llama-quantize converts the experts; the override
    # only applies with a quantized base type, so the other matrices become Q8_0
    if quantize_bin is None:
        from ..native.tools import tool_path
        quantize_bin = tool_path("llama-quantize")
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32.gguf"
        _write_gguf(spec, f32, "F32")
        argv = [str(quantize_bin), "--tensor-type",
                f"ffn_(gate|up|down)_exps={QUANTIZE_TYPES[spec.expert_type]}", str(f32),
                str(path.with_suffix(".tmp")), "Q8_0", "1"]
        result = subprocess.run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            raise PyllamapoolError(f"llama-quantize failed for {spec.expert_type}:\n{result.stderr[-1500:]}")
        path.with_suffix(".tmp").replace(path)
    return path


def write_dense_model(path: Path, seed: int = 0, n_layer: int = 2, n_embd: int = 64, n_vocab: int = 256) -> Path:
    """A tiny dense (non-MoE) llama model: the control case for "this model has no experts"."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(1024)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(2 * n_embd)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_rope_dimension_count(n_embd // 4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("test")
    writer.add_token_list([f"tok_{i}" for i in range(n_vocab)])
    writer.add_token_scores([0.0] * n_vocab)
    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)
    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    writer.add_tensor("output.weight", w(n_vocab, n_embd))
    for il in range(n_layer):
        p = f"blk.{il}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(n_embd, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(p + name + ".weight", w(n_embd, n_embd))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, np.float32))
        writer.add_tensor(p + "ffn_gate.weight", w(2 * n_embd, n_embd))
        writer.add_tensor(p + "ffn_up.weight", w(2 * n_embd, n_embd))
        writer.add_tensor(p + "ffn_down.weight", w(n_embd, 2 * n_embd))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


#: tensors with one entry per routed expert along their outermost axis: the experts' own weights,
#: biases and scales (ffn_{gate,up,down,gate_up}_exps), the router's rows and bias (ffn_gate_inp), and
#: the selection bias added to the router's scores before top-k (exp_probs_b; hy_v3 names it without
#: `.bias`, deepseek4 has a second one, exp_probs_b_vl, for image input). llama.cpp checks every one of
#: them against expert_count, so a widened model must widen them all. (arctic's ffn_norm_exps is one
#: norm for the expert path, not per expert.)
_EXPERT_AXIS_TENSOR = re.compile(
    r"^blk\.\d+\.(ffn_(gate|up|down|gate_up)_exps\.\w+|ffn_gate_inp\.(weight|bias)|exp_probs_b(_vl)?(\.bias)?)$")
#: grovemoe's chunk experts (ffn_*_chexps): one per group of experts_per_group routed experts
_CHUNK_EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)_chexps\.\w+$")


def _copy_fields(reader, writer, arch: str, override: dict | None = None) -> None:
    """Every key of `reader` into `writer` (the architecture is the writer's own), some overridden."""
    import gguf

    override = override or {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        is_array = field.types[0] == gguf.GGUFValueType.ARRAY
        if is_array and len(field.types) == 1:
            continue  # an empty array has no element type and cannot be written; absent reads the same
        value = override[name] if name in override else field.contents()
        sub_type = field.types[-1] if is_array else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)


def without_tensors(src: str | Path, dst: str | Path, pattern: str) -> Path:
    """Copy a GGUF without the tensors whose names match `pattern` (e.g. the optional per-expert
    scales of a test-llama-archs model, to get the plain-weights variant of that architecture)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    _copy_fields(reader, writer, arch)
    for tensor in reader.tensors:
        if not re.search(pattern, tensor.name):
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def _widened(data: np.ndarray, width: int, rng: np.random.Generator, is_scale: bool) -> np.ndarray:
    """data (outermost axis: one entry per expert) with entries appended up to `width`."""
    extra = width - data.shape[0]
    if is_scale:  # scales multiply outputs: keep their magnitude and sign
        new = data[rng.integers(data.shape[0], size=extra)] * (1.0 + 0.1 * rng.standard_normal((extra,) + data.shape[1:]))
    elif float(data.std()) == 0.0:
        # a constant tensor (a selection bias of zeros, say) has no spread to draw from: the new
        # experts get the same constant, so they route as the old ones do
        new = np.full((extra,) + data.shape[1:], float(data.flat[0]) if data.size else 0.0)
    else:
        new = rng.standard_normal((extra,) + data.shape[1:]) * float(data.std()) + float(data.mean())
    return np.concatenate([data, new.astype(np.float32)])


def widen_experts(src: str | Path, dst: str | Path, n_expert: int, seed: int = 0) -> Path:
    """Copy an F32 MoE GGUF (e.g. one of llama.cpp's test-llama-archs models, which have two experts)
    with n_expert experts: the existing experts are kept, the new ones are drawn with the spread of the
    old ones (router rows and biases, selection biases, weights, biases; per-expert scales are the old
    ones, jittered), so a pool smaller than the layer has something to evict. Chunk experts (grovemoe:
    one per experts_per_group experts) grow in proportion. Every other tensor and key is copied
    unchanged."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    old = int(reader.fields[f"{arch}.expert_count"].contents())
    if n_expert <= old:
        raise PyllamapoolError(f"widen_experts: {src} has {old} experts; asked for {n_expert}, which is not more")
    group_field = reader.fields.get(f"{arch}.experts_per_group")
    group = int(group_field.contents()) if group_field is not None else 1
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(dst), arch)
    _copy_fields(reader, writer, arch, {f"{arch}.expert_count": n_expert})
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if _EXPERT_AXIS_TENSOR.match(tensor.name):
            width_old, width_new = old, n_expert
        elif _CHUNK_EXPERT_TENSOR.match(tensor.name):
            if group < 1 or n_expert % group:
                raise PyllamapoolError(f"widen_experts: {tensor.name} holds one expert per {group} experts; "
                                       f"{n_expert} experts do not divide into groups of {group}")
            width_old, width_new = old // group, n_expert // group
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
            continue
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32 or data.shape[0] != width_old:
            raise PyllamapoolError(f"widen_experts: {tensor.name} is not an F32 array of {width_old} experts "
                                   f"(type {tensor.tensor_type.name}, shape {tuple(data.shape)})")
        data = _widened(data, width_new, rng, tensor.name.endswith("scale"))
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def default_model_dir() -> Path:
    from ..native.paths import cache_dir
    return cache_dir() / "models"


def cached_model(spec: ModelSpec | None = None, directory: Path | None = None) -> Path:
    """The generated model for spec in the cache, generated on first use."""
    spec = spec or ModelSpec()
    path = (directory or default_model_dir()) / f"{spec.file_stem}.gguf"
    if not path.exists():
        write_model(spec, path)
    return path


# ---------------------------------------------------------------------------------------------
# token streams


@dataclass(frozen=True)
class StreamSpec:
    """A topic-Markov stream: stay on a topic with p_stay, pick tokens Zipf-distributed within it."""
    n_tokens: int = 256
    p_stay: float = 0.95
    zipf: float = 1.1
    #: force a topic switch every this many tokens (request boundaries); 0 = never
    request_length: int = 0
    seed: int = 0


def token_stream(model: ModelSpec, stream: StreamSpec = StreamSpec()) -> list[int]:
    if not 0.0 <= stream.p_stay <= 1.0:
        raise PyllamapoolError(f"p_stay must be within [0, 1], got {stream.p_stay}")
    rng = np.random.default_rng(stream.seed + 7919 * model.seed)
    by_topic = [np.flatnonzero(_topics_per_token(model) == k) for k in range(model.n_topics)]
    weights = []
    for members in by_topic:
        w = (np.arange(len(members)) + 1.0) ** -stream.zipf
        weights.append(w / w.sum())
    order = [rng.permutation(len(m)) for m in by_topic]
    topic = int(rng.integers(model.n_topics))
    out = []
    for i in range(stream.n_tokens):
        boundary = stream.request_length and i and i % stream.request_length == 0
        if boundary or rng.random() > stream.p_stay:
            topic = int(rng.integers(model.n_topics))
        j = rng.choice(len(by_topic[topic]), p=weights[topic])
        out.append(int(by_topic[topic][order[topic][j]]))
    return out


def spec_of(path: str | Path) -> ModelSpec:
    """The spec a generated model was written from (kept in its metadata), so token streams match
    its topics; for any other GGUF, a default spec over its vocabulary."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("pyllamapool.model_spec")
    if field is not None:
        return ModelSpec(**json.loads(bytes(field.parts[field.data[0]]).decode()))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else ModelSpec().n_vocab
    return ModelSpec(n_vocab=n_vocab, n_topics=min(ModelSpec().n_topics, n_vocab))


__all__ = ["ModelSpec", "StreamSpec", "write_model", "cached_model", "token_stream", "ARCHITECTURES",
           "EXPERT_TYPES", "spec_of", "widen_experts", "block_size"]
