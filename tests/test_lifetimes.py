"""Native objects and callbacks outlive nothing they depend on: models, contexts, observers, logs."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

from pyllamapool.binding.llama import Context, ContextError, Model
from pyllamapool.binding.pool import PoolConfig
from pyllamapool.run.trace import PoolTraceRecorder


def test_closing_a_model_first_closes_its_open_contexts(qwen3_model, rpc_server, stream):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    ctx = Context(model, pool=PoolConfig(slots=8, device_mib=65536))
    ctx.decode(stream[:4])
    ctx.decode([stream[4]])
    model.close()
    assert ctx.handle is None and model.handle is None
    # the context was freed while its model still existed: its runtime line was written
    assert any(line.startswith("expert pool runtime") for line in ctx.close_log)
    ctx.close()  # closing again is harmless


def test_an_observer_that_raises_is_reported_by_decode_once(qwen3_model, rpc_server, stream):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    calls = []

    def broken(name, rows):
        calls.append(name)
        raise ValueError("observer bug")

    ctx = Context(model, observe=lambda name: name.startswith("ffn_moe_topk"), observer=broken)
    with pytest.raises(ContextError, match="observer bug"):
        ctx.decode(stream[:4])
    assert calls
    model.close()


def test_the_pool_observer_belongs_to_the_context(qwen3_model, rpc_server, stream):
    model = Model(qwen3_model, n_gpu_layers=99, rpc=[rpc_server.endpoint], n_cpu_moe=99)
    ctx = Context(model, pool=PoolConfig(slots=6, device_mib=65536))
    recorder = PoolTraceRecorder(ctx)
    del recorder                      # the context keeps the callback alive
    gc.collect()
    ctx.decode(stream[:2])
    for tok in stream[2:10]:
        ctx.decode([tok])             # would call a freed callback if the recorder owned it
    assert ctx._pool_observer is not None
    ctx.close()
    assert ctx._pool_observer is None
    model.close()


def test_objects_left_open_at_exit_are_freed_before_python_goes(qwen3_model, rpc_server):
    script = textwrap.dedent(f"""
        from pyllamapool.binding.llama import Context, Model
        from pyllamapool.binding.pool import PoolConfig
        from pyllamapool.run.trace import PoolTraceRecorder
        model = Model({str(qwen3_model)!r}, n_gpu_layers=99, rpc=[{rpc_server.endpoint!r}], n_cpu_moe=99)
        ctx = Context(model, pool=PoolConfig(slots=6, device_mib=65536))
        recorder = PoolTraceRecorder(ctx)
        ctx.decode([1, 2, 3])
        ctx.decode([4])
        print("decoded", flush=True)
        # no close(): the interpreter exits with the model, the context and the observer alive
    """)
    for _ in range(3):
        result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "decoded" in result.stdout
        assert "Fatal Python error" not in result.stderr and "Segmentation fault" not in result.stderr
