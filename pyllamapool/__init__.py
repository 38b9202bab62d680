"""pyllamapool: a persistent device-side expert pool for llama.cpp MoE models, and its tooling."""
__version__ = "0.1.0"

from .manifest import warn_if_stale as _warn_if_stale

_warn_if_stale()
