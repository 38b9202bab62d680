/* The C API that pyllamapool's cffi binding uses. At build time this file is run through the C
 * preprocessor against the built tree's own headers (see CMakeLists.txt); the binding's cdef is
 * that output, so no declaration is ever copied by hand. */
#include "llama.h"
#include "ggml-backend.h"
#include "ggml-rpc.h"
#if __has_include("llama-moe-pool.h")
#include "llama-moe-pool.h"
#endif
#if __has_include("llama-moe-pool-replay.h")
#include "llama-moe-pool-replay.h"
#endif
