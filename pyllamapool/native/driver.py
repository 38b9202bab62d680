"""`python build.py ...` / `pyllamapool build ...`: prepare the tree, manage patches, build."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import buildsys, paths, vulkan_deps
from ..errors import PyllamapoolError
from .patches import check_patches, export_patches, prepare, write_patch_page
from .pin import Pin
from .runner import Runner

COMMANDS = ("build", "prepare", "export-patches", "check-patches")


def make_parser(prog: str = "build.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Fetch the pinned llama.cpp, apply patches/series, build a target.",
        epilog="commands: build (default), prepare, export-patches, check-patches")
    parser.add_argument("command", nargs="?", default="build", choices=COMMANDS,
                        help="what to do (default: build)")
    parser.add_argument("--target", default="cpu",
                        help="cpu, cuda, hip, vulkan, or gfx906 (= hip with GPU_TARGETS=gfx906)")
    parser.add_argument("--arch", help="GPU archs: CUDA like 86 or '86;90', HIP like gfx906;gfx1100")
    parser.add_argument("--jobs", "-j", type=int, help="parallel compile jobs")
    parser.add_argument("--build-dir", type=Path, help="CMake build folder (default build/<target>)")
    parser.add_argument("--source", type=Path,
                        help="use this local llama.cpp tree (e.g. a git checkout of the pinned commit) "
                             "instead of the verified sdist")
    parser.add_argument("--reset", action="store_true",
                        help="prepare: recreate vendor/llama.cpp from the pin and series")
    parser.add_argument("--prefix", type=Path,
                        help="install into PREFIX/pyllamapool/{lib,bin} instead of this checkout (a second "
                             "build beside the default one; point PYLLAMAPOOL_LIB_DIR at PREFIX/pyllamapool/lib)")
    parser.add_argument("--sanitize", nargs="?", const="address", choices=("address", "thread"),
                        help="a sanitized build: address (the default: AddressSanitizer + UndefinedBehaviorSanitizer, "
                             "folder build/<target>-sanitize) or thread (ThreadSanitizer, build/<target>-tsan); "
                             "install it with --prefix)")
    parser.add_argument("--only", choices=buildsys.ONLY, default="all",
                        help="all (the default): everything the package installs; tests: what the suite "
                             "loads from a second build beside the CPU one (libraries, llama-quantize, "
                             "ggml-rpc-server, the ctests), without llama-server, llama-cli, llama-bench and "
                             "mtmd, which are most of the compile")
    parser.add_argument("--define", "-D", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra CMake definition (repeatable), e.g. -D GGML_CUDA_FA=OFF to trim a build")
    parser.add_argument("--dry-run", action="store_true", help="print every command, change nothing")
    return parser


def main(argv: list[str] | None = None, prog: str = "build.py") -> int:
    args = make_parser(prog).parse_args(argv)
    runner = Runner(dry_run=args.dry_run)
    console = runner.console
    try:
        pin = Pin.load()
        if args.command == "prepare":
            prepare(pin, runner, source_path=args.source, reset=args.reset)
        elif args.command == "export-patches":
            changed = export_patches(paths.vendor_dir(), paths.patches_dir(), runner)
            console.print(f"patches/: {len(changed)} file(s) changed" +
                          (f": {', '.join(changed)}" if changed else " (up to date)"))
            # the page's footprints are counted from the series, so they follow every export
            page = paths.project_root() / "docs" / "patches.md"
            if page.exists() and write_patch_page(page, paths.vendor_dir(), runner):
                console.print("docs/patches.md: the stacks' footprints refreshed")
        elif args.command == "check-patches":
            footprints: list = []
            per_patch: list = []
            problems = check_patches(pin, runner, source_path=args.source, footprints=footprints,
                                     per_patch=per_patch)
            for patch in per_patch:
                console.print(patch.patch_line(), highlight=False, soft_wrap=True)
            for footprint in footprints:
                console.print(footprint.line())
                for path, lines in footprint.upstream:
                    console.print(f"  {path}: {lines} lines changed", highlight=False, soft_wrap=True)
                for path, lines in footprint.new:
                    longest = footprint.longest_in(path)
                    console.print(f"  {path}: new, {lines} lines" + (f"; longest function {longest}" if longest else ""),
                                  highlight=False, soft_wrap=True)
            if problems:
                console.print("[red]check-patches failed:[/red]\n  " + "\n  ".join(problems))
                return 1
            console.print("check-patches: the series applies to a pristine tree and patches/ is current")
        else:
            if args.target == "vulkan":
                # on Debian 12, fetch what the build and a lavapipe run need (and say so)
                deps = vulkan_deps.ensure(runner)
                if deps.include_dir:
                    os.environ["Vulkan_INCLUDE_DIR"] = str(deps.include_dir)
                for line in deps.done:
                    runner.note(f"vulkan: {line}")
            cfg = buildsys.configure_target(args.target, args.arch, args.build_dir, args.jobs, args.sanitize,
                                           args.only)
            for define in args.define:
                if "=" not in define or not define.split("=", 1)[0]:
                    raise PyllamapoolError(f"--define {define!r}: expected KEY=VALUE")
                cfg.cmake_flags.append(f"-D{define}")
            libdir = buildsys.build(
                cfg, runner, prefix=args.prefix.resolve() if args.prefix else None,
                prepare_tree=lambda: prepare(pin, runner, source_path=args.source, reset=args.reset))
            if not args.dry_run:
                console.print(f"built --target {cfg.target}"
                              f"{' --arch ' + cfg.arch if cfg.arch else ''}: libraries in {libdir}, "
                              f"tools in {libdir.parent / 'bin'}")
    except PyllamapoolError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
