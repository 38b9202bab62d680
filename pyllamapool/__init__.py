"""pyllamapool: a persistent device-side expert pool for llama.cpp MoE models, and its tooling."""
__version__ = "0.1.0"

from .native.manifest import warn_if_stale as _warn_if_stale

_warn_if_stale()

# The high-level API, imported on first use: the build driver imports this package inside pip's
# isolated build environment, where numpy and cffi are not installed.
_API = {"Offload": "run.offload", "PoolRun": "run.session", "PoolSession": "run.session",
        "PoolConfig": "binding.pool", "PoolCounters": "binding.pool", "PoolStatus": "binding.pool"}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        import importlib
        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(f"module 'pyllamapool' has no attribute {name!r}")
