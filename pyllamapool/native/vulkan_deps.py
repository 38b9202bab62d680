"""What `--target vulkan` needs on Debian 12, from Debian's own packages, without breaking the system.

* `glslc` and the Vulkan loader's development files (`libvulkan-dev`) come from bookworm itself.
* Debian 12's Vulkan headers (1.3.239) are too old for this llama.cpp. Debian 13's `libvulkan-dev` and
  `spirv-headers` are downloaded with a private apt configuration (nothing in /etc/apt or the system's
  package state changes) and unpacked into the user cache; the build is pointed at them.
* Running on a CPU-only machine needs lavapipe, Mesa's CPU Vulkan device. Debian 12's Mesa 22.3 crashes
  in its own worker thread on llama.cpp's graphs; Mesa 25 from bookworm-backports (built for Debian 12)
  runs them. It is installed for this one command from a backports list kept in the user cache, so the
  system's apt sources stay as they were.

Installing system packages needs root; without it the build's toolchain check names what to install.
Each action is announced before it runs.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import paths
from .runner import Runner

#: oldest Vulkan headers this llama.cpp compiles with (vk::LayerSettingEXT)
MIN_HEADERS = (1, 3, 275)
#: oldest Mesa whose lavapipe runs llama.cpp's graphs (22.3 crashes in its worker thread)
MIN_MESA = (25, 0)
MIRROR = "http://deb.debian.org/debian"
HEADER_PACKAGES = ("libvulkan-dev", "spirv-headers")


@dataclass
class VulkanDeps:
    """What ensure() did for a Vulkan build on this machine."""
    include_dir: Path | None = None        # headers new enough, when not the system's own
    done: list[str] = field(default_factory=list)


def debian_codename() -> str | None:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return None
    m = re.search(r"^VERSION_CODENAME=(\w+)", text, re.M)
    return m.group(1) if m else None


def header_version(include_dir: Path) -> tuple[int, int, int] | None:
    header = include_dir / "vulkan" / "vulkan_core.h"
    try:
        text = header.read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"VK_HEADER_VERSION_COMPLETE\s+VK_MAKE_API_VERSION\(\s*\d+\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*"
                  r"VK_HEADER_VERSION\s*\)", text)
    patch = re.search(r"#define\s+VK_HEADER_VERSION\s+(\d+)", text)
    if not (m and patch):
        return None
    return int(m.group(1)), int(m.group(2)), int(patch.group(1))


def package_version(name: str) -> str | None:
    """The installed Debian version of a package, or None."""
    if not shutil.which("dpkg-query"):
        return None
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status} ${Version}", name], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.startswith("install ok installed"):
        return None
    return out.stdout.split()[-1]


def _major_minor(version: str) -> tuple[int, int]:
    m = re.match(r"(?:\d+:)?(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def cache_root() -> Path:
    return paths.cache_dir() / "vulkan"


def _write_sources(runner: Runner, path: Path, suite: str) -> Path:
    if not runner.dry_run:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"deb {MIRROR} {suite} main\n")
    return path


def _private_apt(runner: Runner, root: Path, suite: str) -> list[str]:
    """apt options that read one suite's lists into root and touch nothing of the system's."""
    if not runner.dry_run:
        (root / "lists" / "partial").mkdir(parents=True, exist_ok=True)
        (root / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    sources = _write_sources(runner, root / "sources.list", suite)
    opts = [f"Dir::Etc::SourceList={sources}", "Dir::Etc::SourceParts=/nonexistent",
            f"Dir::State::Lists={root / 'lists'}", f"Dir::Cache={root}", f"Dir::Cache::Archives={root / 'archives'}",
            "Dir::State::status=/dev/null", "Debug::NoLocking=1"]
    if os.geteuid() == 0:
        opts.append("APT::Sandbox::User=root")  # downloads go to the user cache, which _apt cannot write
    return [x for o in opts for x in ("-o", o)]


def fetch_headers(runner: Runner, suite: str = "trixie") -> Path:
    """Debian `suite`'s Vulkan and SPIR-V headers unpacked into the user cache; the include folder."""
    prefix = cache_root() / f"headers-{suite}"
    include = prefix / "usr" / "include"
    if (header_version(include) or (0, 0, 0)) >= MIN_HEADERS:
        return include
    work = cache_root() / f"apt-{suite}"
    apt = _private_apt(runner, work, suite)
    runner.note(f"Vulkan headers: downloading Debian {suite}'s {' and '.join(HEADER_PACKAGES)} into {prefix} "
                "(a private apt configuration: the system's sources and packages are untouched)")
    runner.run(["apt-get", "-q", *apt, "update"], capture=True)
    runner.run(["apt-get", "-q", *apt, "download", *HEADER_PACKAGES], cwd=work, capture=True)
    if runner.dry_run:
        return include
    for deb in sorted(work.glob("*.deb")):
        runner.run(["dpkg-deb", "-x", str(deb), str(prefix)], capture=True)
    return include


def install_system_packages(runner: Runner, packages: list[str], backports: bool) -> None:
    """apt-get install as root; with backports, from a bookworm-backports list kept in the user cache
    for this one command (the system's sources are not changed)."""
    apt: list[str] = []
    if backports:
        sources = _write_sources(runner, cache_root() / "bookworm-backports.list", "bookworm-backports")
        apt = ["-o", f"Dir::Etc::SourceList={sources}"]
        runner.note(f"installing {' '.join(packages)} from bookworm-backports (Debian's own builds for Debian 12; "
                    f"the list lives in {sources}, the system's apt sources are unchanged)")
    else:
        runner.note(f"installing {' '.join(packages)} from Debian")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    runner.run(["apt-get", "-q", *apt, "update"], env=env, capture=True)
    target = ["-t", "bookworm-backports"] if backports else []
    runner.run(["apt-get", "-q", "-y", *apt, *target, "install", "--no-install-recommends", *packages],
               env=env, capture=True)


def ensure(runner: Runner) -> VulkanDeps:
    """On Debian 12, make what a Vulkan build and a lavapipe run need available (packages as root,
    newer headers into the user cache). Elsewhere nothing is done: the build's toolchain check says
    what is missing. An explicit Vulkan_INCLUDE_DIR is used as it is."""
    deps = VulkanDeps()
    if debian_codename() != "bookworm" or not shutil.which("apt-get"):
        return deps
    root = os.geteuid() == 0
    missing = [pkg for pkg, ok in (("glslc", shutil.which("glslc")),
                                   ("libvulkan-dev", package_version("libvulkan-dev") or _has_loader_link()))
               if not ok]
    mesa = package_version("mesa-vulkan-drivers")
    old_mesa = mesa is None or _major_minor(mesa) < MIN_MESA
    if root:
        if missing:
            install_system_packages(runner, missing, backports=False)
            deps.done.append(f"installed {' '.join(missing)}")
        if old_mesa:
            install_system_packages(runner, ["mesa-vulkan-drivers"], backports=True)
            deps.done.append(f"installed lavapipe (mesa-vulkan-drivers) from bookworm-backports over {mesa or 'none'}")
    elif old_mesa:
        # not a build problem: the build goes on, and says how to get a device to run on
        runner.note("no lavapipe from Mesa 25 here (Debian 12's Mesa 22.3 crashes on llama.cpp's graphs): to run "
                    "on the CPU, as root add bookworm-backports and `apt-get install -t bookworm-backports "
                    "mesa-vulkan-drivers`")
    if not os.environ.get("Vulkan_INCLUDE_DIR"):
        version = header_version(Path("/usr/include"))
        if version is None or version < MIN_HEADERS:
            deps.include_dir = fetch_headers(runner)
            deps.done.append(f"Vulkan headers from Debian trixie in {deps.include_dir}")
    if runner.dry_run:
        deps.done = [f"(a real run) {line}" for line in deps.done]
    return deps


def _has_loader_link() -> bool:
    return any(Path(d, "libvulkan.so").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib",
                                                          "/usr/lib/aarch64-linux-gnu"))
