"""Shared fixtures: generated tiny MoE models, loopback RPC devices, the native build."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pyllamapool.run.testmodel import ModelSpec, StreamSpec, token_stream, write_model

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    # the suite tests this checkout with its own caches, whatever the developer's shell points at:
    # no PYLLAMAPOOL_* override (library folder, root, cache, target, warnings) and a cache folder
    # of its own (generated models, the demo's output), removed at the end
    import shutil
    import tempfile

    # a sanitized build under test (tests/test_sanitizers.py runs the suite's decode tests against one)
    # names its libraries in a variable of its own, which survives the clean-up
    sanitized = os.environ.get("PYLLAMAPOOL_TESTS_LIB_DIR")
    for name in list(os.environ):
        if name.startswith("PYLLAMAPOOL_"):
            del os.environ[name]
    if sanitized:
        os.environ["PYLLAMAPOOL_LIB_DIR"] = sanitized
        from pyllamapool.binding import _ffi
        # test_sanitizers.py checks this line: the run really is on the sanitized libraries
        print(f"pyllamapool tests: libraries from {_ffi.locate().lib_dir}", file=sys.__stderr__, flush=True)
    # two lazy-copy devices, for the tests that split a model between devices (the others take the
    # first); the device reads this once, when it is first loaded
    os.environ["GGML_LAZY_COPY_DEVICES"] = "2"
    cache = tempfile.mkdtemp(prefix="pyllamapool-tests-cache-")
    os.environ["XDG_CACHE_HOME"] = cache
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def make_model(models_dir):
    """make_model(**spec_changes) -> path of a generated model (cached for the session)."""
    made: dict[ModelSpec, Path] = {}

    def _make(**changes) -> Path:
        spec = ModelSpec(**changes)
        if spec not in made:
            made[spec] = write_model(spec, models_dir / f"{spec.file_stem}.gguf")
        return made[spec]

    return _make


@pytest.fixture(scope="session")
def qwen3_model(make_model) -> Path:
    return make_model()


@pytest.fixture(scope="session")
def qwen2_model(make_model) -> Path:
    return make_model(arch="qwen2moe")


@pytest.fixture(scope="session")
def stream() -> list[int]:
    return token_stream(ModelSpec(), StreamSpec(n_tokens=72, seed=3))


@pytest.fixture
def rpc_server():
    """One ggml-rpc-server on a free 127.0.0.1 port, stopped by its pid afterwards."""
    from pyllamapool.run.rpc import start_rpc_server
    with start_rpc_server() as server:
        yield server


@pytest.fixture
def rpc_servers():
    """rpc_servers(n) -> n running servers (several devices at once)."""
    from pyllamapool.run.rpc import start_rpc_server
    started = []

    def _start(n: int):
        for _ in range(n):
            started.append(start_rpc_server())
        return started[-n:]

    yield _start
    for server in started:
        server.close()


@pytest.fixture(scope="session")
def archs_source(tmp_path_factory):
    """archs_source(arch) -> the MoE model test-llama-archs writes for arch (two experts, top-2)."""
    from archmodels import MOE_SUFFIX, generate

    out = tmp_path_factory.mktemp("archs")
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            made[arch] = generate(out, arch) / f"{arch}{MOE_SUFFIX}"
            assert made[arch].exists(), f"test-llama-archs wrote no MoE model for {arch}"
        return made[arch]
    return make


@pytest.fixture(scope="session")
def archs_model(archs_source):
    """archs_model(arch) -> a random model of that arch from test-llama-archs, widened to 8 experts."""
    from archmodels import expert_count
    from pyllamapool.run.testmodel import widen_experts

    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            src = archs_source(arch)
            # the tool makes two experts for most architectures, more for a few (deepseek2: 64)
            made[arch] = src if expert_count(src) >= 8 else widen_experts(src, src.with_name(f"{arch}-moe-8.gguf"), 8)
        return made[arch]
    return make


@pytest.fixture(autouse=True)
def _clean_pool_env(monkeypatch):
    # the pool's environment knobs must not leak from the developer's shell into tests
    for name in list(os.environ):
        if name.startswith(("LLAMA_MOE_POOL_", "GGML_MOE_POOL_")) or name == "LLAMA_ARG_MOE_EXPERT_CACHE":
            monkeypatch.delenv(name)
