"""The cffi binding cannot drift from the library: its cdef is the build's preprocessed headers, and
here the C compiler checks that cdef against the real headers (API mode: struct layouts, enum
values and function signatures) and the dynamic linker checks every bound function exists."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import cffi
import pytest

from pyllamapool.binding import _ffi
from pyllamapool.native.paths import project_root

VENDOR = project_root() / "vendor" / "llama.cpp"
WRAPPER = project_root() / "pyllamapool" / "binding" / "cdef.h"


def unexported_functions(cdef_text: str) -> list[str]:
    """Functions the headers declare but no built library exports (upstream has a few): libllama
    (with the libraries it loads) and the pool's replay library are looked in."""
    ffi, lib, _ = _ffi.load()
    _, replay = _ffi.replay()
    declared = [key.split(" ", 1)[1] for key in ffi._parser._declarations if key.startswith("function ")]
    missing = []
    for name in sorted(declared):
        found = False
        for library in (lib, replay):
            try:
                getattr(library, name)
                found = True
                break
            except AttributeError:
                pass
        if not found:
            missing.append(name)
    return missing


def without_declarations(cdef_text: str, names: list[str]) -> str:
    for name in names:
        cdef_text = re.sub(r"[^;{}]*\b" + name + r"\s*\([^;{}]*\)\s*;", "", cdef_text)
    return cdef_text


def compile_checker(tmp_path, cdef_text: str, name: str):
    """Build an API-mode module from cdef_text against the real headers; import it."""
    _, _, where = _ffi.load()
    # declared-but-unimplemented functions would make the module unloadable; they are unusable
    # through the binding anyway (ABI mode resolves a symbol only when it is called)
    cdef_text = without_declarations(cdef_text, unexported_functions(cdef_text))
    ffi = cffi.FFI()
    ffi.cdef(cdef_text)
    ffi.set_source(name, f'#include "{WRAPPER}"',
                   include_dirs=[str(VENDOR / "include"), str(VENDOR / "ggml" / "include")],
                   library_dirs=[str(where.lib_dir)],
                   libraries=["llama", "llama-moe-pool-replay", "ggml", "ggml-base", "ggml-rpc"],
                   extra_link_args=[f"-Wl,-rpath,{where.lib_dir}"],
                   extra_compile_args=["-Wno-deprecated-declarations", "-Werror=incompatible-pointer-types",
                                       "-Werror=int-conversion"])
    lib_path = ffi.compile(tmpdir=str(tmp_path), verbose=False)
    spec = importlib.util.spec_from_file_location(name, lib_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # cffi compares each struct's cdef layout with the compiler's when the type is first used:
    # use them all (field sizes and offsets), so a drifted struct raises here
    parsed = cffi.FFI()
    parsed.cdef(cdef_text)
    for key, (tp, _) in parsed._parser._declarations.items():
        if key.startswith("struct ") and getattr(tp, "fldnames", None):
            module.ffi.sizeof(key)
    return module


def enum_mismatches(module, cdef_text: str) -> list[str]:
    """Enum constants whose value in the cdef differs from the compiler's (the C truth)."""
    parsed = cffi.FFI()
    parsed.cdef(cdef_text)
    out = []
    for key, (tp, _) in parsed._parser._declarations.items():
        if key.startswith(("enum ", "anonenum ")) and getattr(tp, "enumerators", None):
            for name, value in zip(tp.enumerators, tp.enumvalues):
                real = getattr(module.lib, name)
                if real != value:
                    out.append(f"{name}: cdef {value}, C {real}")
    return out


def test_the_binding_cdef_matches_the_real_headers(tmp_path):
    _, _, where = _ffi.load()
    text = _ffi.clean_cdef(where.cdef_file.read_text())
    module = compile_checker(tmp_path, text, "_pyllamapool_drift_ok")  # struct layouts checked on import
    assert enum_mismatches(module, text) == []
    ffi, lib, _ = _ffi.load()
    for name in ("GGML_LOG_LEVEL_ERROR", "GGML_LOG_LEVEL_CONT", "GGML_TYPE_I32", "LLAMA_MOE_POOL_LIMIT_CAP"):
        assert getattr(module.lib, name) == getattr(lib, name), name
    assert module.ffi.sizeof("struct llama_context_params") == ffi.sizeof("struct llama_context_params")
    assert module.ffi.offsetof("struct llama_context_params", "moe_pool") == \
        ffi.offsetof("struct llama_context_params", "moe_pool")


def test_a_drifted_declaration_is_caught(tmp_path):
    """The check can fail: an enum value copied wrong is refused, as a hand copy would drift."""
    _, _, where = _ffi.load()
    text = _ffi.clean_cdef(where.cdef_file.read_text())
    drifted, n = re.subn(r"LLAMA_MOE_POOL_LIMIT_CAP\s*=\s*2", "LLAMA_MOE_POOL_LIMIT_CAP = 3", text)
    assert n == 1
    module = compile_checker(tmp_path, drifted, "_pyllamapool_drift_bad")
    assert enum_mismatches(module, drifted) == ["LLAMA_MOE_POOL_LIMIT_CAP: cdef 3, C 2"]


def test_a_drifted_struct_layout_is_caught(tmp_path):
    """A struct field copied with the wrong type is refused when the checker module loads."""
    _, _, where = _ffi.load()
    text = _ffi.clean_cdef(where.cdef_file.read_text())
    drifted, n = re.subn(r"(struct llama_moe_pool_counters \{\s*)uint64_t lookups;", r"\1uint32_t lookups;", text)
    assert n == 1
    with pytest.raises(Exception, match="llama_moe_pool_counters"):
        compile_checker(tmp_path, drifted, "_pyllamapool_drift_struct")


def test_every_bound_llama_and_pool_function_exists_in_the_library():
    _, _, where = _ffi.load()
    missing = unexported_functions(_ffi.clean_cdef(where.cdef_file.read_text()))
    # everything of llama.h, the pool API and the RPC backend the binding uses is there;
    # only ggml-cpu.h declares one function upstream never implemented
    assert [m for m in missing if m.startswith(("llama_", "ggml_backend_"))] == []
    assert set(missing) <= {"ggml_threadpool_get_n_threads"}, missing


def test_the_pool_adds_twelve_functions_to_libllama_and_keeps_the_policy_replay_apart():
    """llama.h's surface grows by what a server, a bench and this binding need of the pool; the
    policy replay (research tooling) is a library of its own with a header of its own."""
    def functions(header: str) -> list[str]:
        text = (VENDOR / "include" / header).read_text()
        return re.findall(r"^LLAMA(?:_MOE_REPLAY)?_API\b[^(]*?\b(llama_\w+)\s*\(", text, re.M)
    pool = functions("llama-moe-pool.h")
    replay = functions("llama-moe-pool-replay.h")
    assert len(pool) == 12, pool
    assert not any(name.startswith("llama_moe_pool_policy_") for name in pool)
    assert replay and all(name.startswith("llama_moe_pool_policy_") for name in replay)
    _, lib, _ = _ffi.load()
    with pytest.raises(AttributeError):
        getattr(lib, "llama_moe_pool_policy_init")  # not libllama's


def test_cdef_is_generated_from_our_wrapper_header():
    _, _, where = _ffi.load()
    text = where.cdef_file.read_text()
    assert "struct llama_moe_pool_params" in text
    assert "#include" not in text  # preprocessed


def test_missing_library_error_lists_the_paths_tried(monkeypatch, tmp_path):
    monkeypatch.setenv("PYLLAMAPOOL_LIB_DIR", str(tmp_path))
    with pytest.raises(_ffi.LibraryNotFound) as err:
        _ffi.locate()
    assert str(tmp_path) in str(err.value)
    assert "PYLLAMAPOOL_LIB_DIR" in str(err.value)


def test_the_system_cxx_runtime_serves_libllama_before_any_backend_copy():
    """A backend library that exports its own copy of the C++ runtime (nvcc-linked CUDA 13 builds do)
    must not serve libllama's std:: calls: the binding puts the system runtime in the global scope
    first. dlsym(RTLD_DEFAULT) searches only that scope."""
    code = ("import ctypes, sys\n"
            "from pyllamapool.binding import _ffi\n"
            "_ffi.load()\n"
            "ctypes.CDLL(None)._ZNSo9_M_insertIlEERSoT_\n"  # std::ostream::_M_insert<long>
            "print('global')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "global" in result.stdout, result.stderr[-2000:]


def test_the_pool_params_hold_one_value_per_device_llama_cpp_supports():
    """The pool's per-device lists (slots, device sizes) are fixed arrays so that the params struct
    is self-contained when common and Python copy it; their length is llama.cpp's device limit."""
    ffi, lib, _ = _ffi.load()
    from pyllamapool.binding.pool import MAX_DEVICES
    params = ffi.new("struct llama_moe_pool_params *")
    assert len(params.slots) == len(params.device_mib) == MAX_DEVICES == lib.llama_max_devices()
