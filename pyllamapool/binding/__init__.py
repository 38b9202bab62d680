"""The binding: cffi over libllama and the expert pool's C API (`include/llama-moe-pool.h`), models and
contexts, the pool's settings and reports, llama.cpp's log routed into Python's."""
