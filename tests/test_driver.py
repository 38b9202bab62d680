"""The build driver: pin verification, targets and flags, the patch-series workflow."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyllamapool.native import buildsys, paths, source
from pyllamapool.errors import PatchError, PyllamapoolError, SourceError, ToolchainError
from pyllamapool.native.patches import Series, check_patches, export_patches, prepare, render_series
from pyllamapool.native.pin import Pin
from pyllamapool.native.runner import Runner

ROOT = Path(__file__).resolve().parent.parent
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@localhost", "GIT_AUTHOR_DATE": "2020-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2020-01-01T00:00:00Z"}


def driver(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=600)


# --------------------------------------------------------------------------------------------
# the pin


def test_pin_names_the_upstream_release_and_sdist():
    pin = Pin.load()
    assert pin.ref == "b11549" and pin.build_number == 11549
    assert pin.sdist_requirement == "xllamacpp==2026.10.11549"
    assert pin.sdist_subdir == "thirdparty/llama.cpp"
    assert len(pin.sdist_sha256) == 64
    # every packager hotfix is either reverted (and checked by its pristine blob) or kept with a why
    assert {fix.action for fix in pin.hotfixes} == {"revert", "keep"}
    assert all(fix.why and len(fix.sdist_blob) == 40 for fix in pin.hotfixes)


def _pin_with(tmp_path: Path, hotfix: str) -> Path:
    text = paths.pin_file().read_text().split("[[hotfix]]")[0]
    path = tmp_path / "llama.cpp.pin"
    path.write_text(text + hotfix)
    return path


def test_a_hotfix_entry_with_a_bad_action_or_line_range_is_refused_by_name(tmp_path):
    bad_action = _pin_with(tmp_path, '[[hotfix]]\npath = "a"\naction = "patch"\nwhy = "w"\nsdist_blob = "x"\n')
    with pytest.raises(SourceError, match=r"action 'patch' is not one of revert, keep"):
        Pin.load(bad_action)
    bad_range = _pin_with(tmp_path, '[[hotfix]]\npath = "a"\naction = "revert"\nwhy = "w"\nsdist_blob = "x"\n'
                                    'drop_lines = "9-3"\npristine_blob = "y"\n')
    with pytest.raises(SourceError, match=r"drop_lines part '9-3' is not FIRST-LAST"):
        Pin.load(bad_range)


def test_a_reverted_hotfix_gives_the_pristine_file_or_the_tree_is_refused(tmp_path):
    from pyllamapool.native.pin import Hotfix
    pristine = b"one\ntwo\nthree\n"
    shipped = b"one\n#if PACKAGER\ntwo\n#endif\nthree\n"
    (tmp_path / "f.h").write_bytes(shipped)
    fix = Hotfix("f.h", "revert", "a packager's guard", source.git_blob_id(shipped), ((2, 2), (4, 4)),
                 source.git_blob_id(pristine))
    source.undo_hotfix(tmp_path, fix, Runner())
    assert (tmp_path / "f.h").read_bytes() == pristine
    # the same entry against a file that is not what the sdist shipped: refused, naming both blobs
    with pytest.raises(SourceError, match="the pin's hotfix entry does not describe this sdist"):
        source.undo_hotfix(tmp_path, fix, Runner())
    # dropping the wrong lines does not give the pristine blob: refused
    (tmp_path / "f.h").write_bytes(shipped)
    wrong = Hotfix("f.h", "revert", "w", fix.sdist_blob, ((1, 1),), fix.pristine_blob)
    with pytest.raises(SourceError, match="not the pristine"):
        source.undo_hotfix(tmp_path, wrong, Runner())
    assert source.git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # git's empty blob


def test_sdist_with_wrong_sha256_is_refused_with_both_hashes(tmp_path, monkeypatch):
    monkeypatch.setenv("PYLLAMAPOOL_CACHE", str(tmp_path))
    pin = Pin.load()
    cached = source.cached_sdist(pin)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not the sdist")
    with pytest.raises(SourceError) as err:
        source.fetch_sdist(pin, Runner())
    text = str(err.value)
    assert pin.sdist_sha256 in text
    assert source.sha256_of(cached) in text
    assert "refusing" in text


# --------------------------------------------------------------------------------------------
# targets and flags


def test_unknown_target_is_rejected_with_the_valid_ones():
    result = driver("--target", "metal", "--dry-run")
    assert result.returncode == 2
    for name in ("cpu", "cuda", "hip", "vulkan", "gfx906"):
        assert name in result.stderr
    assert "'metal'" in result.stderr


def test_dry_run_gfx906_shows_hip_flags_and_changes_nothing(tmp_path):
    build_dir = tmp_path / "never-created"
    stamp_before = paths.stamp_file().read_bytes() if paths.stamp_file().exists() else None
    result = driver("--target", "gfx906", "--dry-run", "--build-dir", str(build_dir))
    assert result.returncode == 0, result.stderr
    assert "-DGGML_HIP=ON" in result.stderr
    assert "-DGPU_TARGETS=gfx906" in result.stderr
    assert "HIPCXX=" in result.stderr
    assert not build_dir.exists()
    assert (paths.stamp_file().read_bytes() if paths.stamp_file().exists() else None) == stamp_before


def test_dry_run_cuda_arch_86_shows_cuda_flags():
    result = driver("--target", "cuda", "--arch", "86", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "-DGGML_CUDA=ON" in result.stderr
    assert "-DCMAKE_CUDA_ARCHITECTURES=86" in result.stderr


def test_cpu_target_always_has_the_rpc_backend():
    cfg = buildsys.configure_target("cpu")
    assert "-DGGML_RPC=ON" in cfg.cmake_flags


def test_a_second_build_can_hold_only_what_the_suite_loads_from_it():
    assert "-DPYLLAMAPOOL_ONLY=all" in buildsys.configure_target("cpu").cmake_flags
    result = driver("--sanitize", "thread", "--only", "tests", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "-DPYLLAMAPOOL_ONLY=tests" in result.stderr and "-DLLAMA_SANITIZE_THREAD=ON" in result.stderr
    result = driver("--only", "server", "--dry-run")
    assert result.returncode == 2 and "--only: invalid choice: 'server'" in result.stderr
    with pytest.raises(PyllamapoolError, match="--only server: expected one of all, tests"):
        buildsys.configure_target("cpu", only="server")


def test_sanitized_builds_optimize_less_and_plain_builds_keep_release_flags():
    for kind in buildsys.SANITIZERS:
        flags = buildsys.configure_target("cpu", sanitize=kind).cmake_flags
        assert "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" in flags and "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG" in flags
    assert not any("FLAGS_RELEASE" in f for f in buildsys.configure_target("cpu").cmake_flags)


@pytest.mark.parametrize("target,arch,expected", [
    ("cuda", "86;90", "86;90"), ("cuda", "86,90", "86;90"), ("hip", "gfx906;gfx1100", "gfx906;gfx1100"),
    ("gfx906", None, "gfx906"),
])
def test_arch_lists_are_normalised(target, arch, expected):
    assert buildsys.configure_target(target, arch).arch == expected


@pytest.mark.parametrize("target,arch,needle", [
    ("cuda", "sm86", "sm86"), ("hip", "906", "906"), ("cpu", "86", "only to --target cuda or hip"),
    ("gfx906", "gfx1100", "implies --arch gfx906"),
])
def test_bad_arch_is_rejected_naming_the_value(target, arch, needle):
    with pytest.raises(PyllamapoolError, match=needle):
        buildsys.configure_target(target, arch)


def test_real_build_with_a_missing_toolchain_fails_fast_with_what_to_install():
    if buildsys._which("hipconfig"):
        pytest.fail("this machine has ROCm: pick another missing toolchain for this test")
    result = driver("--target", "hip")
    assert result.returncode == 2
    assert "ROCm" in result.stderr and "hipconfig not found" in result.stderr


# --------------------------------------------------------------------------------------------
# the patch workflow, on a small stand-in tree


@pytest.fixture
def fake_project(tmp_path):
    """A project root with a tiny 'llama.cpp' source tree and an empty series."""
    src = tmp_path / "upstream"
    (src / "include").mkdir(parents=True)
    (src / "include" / "llama.h").write_text("int llama(void);\n")
    (src / "src").mkdir()
    (src / "src" / "llama.cpp").write_text("int llama(void) { return 1; }\n")
    root = tmp_path / "project"
    (root / "patches").mkdir(parents=True)
    (root / "vendor").mkdir()
    pin = Pin("ggml-org/llama.cpp", "0" * 40, "llama-cpp-python", "0.0.0", "f" * 64, "vendor/llama.cpp")
    return root, src, pin


def commit_in(tree: Path, rel: str, text: str, message: str) -> None:
    (tree / rel).write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=tree, check=True, env={**os.environ, **GIT_ENV})
    subprocess.run(["git", "commit", "-q", "-m", message], cwd=tree, check=True, env={**os.environ, **GIT_ENV})


def test_apply_export_round_trip_is_byte_identical(fake_project, tmp_path):
    root, src, pin = fake_project
    runner = Runner()
    tree = prepare(pin, runner, source_path=src, root=root)
    commit_in(tree, "src/llama.cpp", "int llama(void) { return 2; }\n", "llama : return two\n\nBecause two.")
    commit_in(tree, "include/llama.h", "int llama(void);\nint pool(void);\n", "llama : declare pool\n\nWhy: tests.")
    export_patches(tree, root / "patches", runner)
    first = {p.name: p.read_bytes() for p in (root / "patches").iterdir()}
    assert Series.load(root / "patches").names == tuple(sorted(n for n in first if n != "series"))

    # a fresh pristine copy with the exported series, exported again: nothing changes
    root2 = tmp_path / "project2"
    (root2 / "vendor").mkdir(parents=True)
    import shutil
    shutil.copytree(root / "patches", root2 / "patches")
    tree2 = prepare(pin, runner, source_path=src, root=root2)
    assert export_patches(tree2, root2 / "patches", runner) == []
    assert {p.name: p.read_bytes() for p in (root2 / "patches").iterdir()} == first
    # and exporting the original again is no churn either
    assert export_patches(tree, root / "patches", runner) == []


def test_the_series_is_two_stacks_ggml_first_and_check_patches_reports_each_footprint(fake_project):
    """ggml's changes come first, each reviewable upstream on its own, then llama's; check-patches says
    which upstream files each stack touches and how many lines it changes in them."""
    root, src, pin = fake_project
    runner = Runner()
    tree = prepare(pin, runner, source_path=src, root=root)
    (tree / "ggml").mkdir()
    commit_in(tree, "ggml/new.c", "int g(void) {\n    return 1;\n}\n", "ggml : a new file\n\nWhy: tests.")
    commit_in(tree, "include/llama.h", "int llama(void);\nint pool(void);\n", "llama : declare pool\n\nWhy: tests.")
    commit_in(tree, "src/llama.cpp", "int llama(void) { return 2; }\nint pool(void) { return 0; }\n",
              "llama : define pool\n\nWhy: tests.")
    export_patches(tree, root / "patches", runner)
    text = (root / "patches" / "series").read_text()
    assert text.index("# ggml:") < text.index("0001-ggml-a-new-file.patch") < text.index("# llama:") \
        < text.index("0002-llama-declare-pool.patch")
    footprints: list = []
    assert check_patches(pin, runner, source_path=src, root=root, footprints=footprints) == []
    ggml, llama = footprints
    assert (ggml.stack, ggml.patches, ggml.upstream_files, ggml.new_files) == ("ggml", 1, (), 1)
    assert ggml.longest == (("ggml/new.c", "g", 3),) and "| `ggml/new.c` | new | 3 | g (3) |" in ggml.markdown()
    assert (llama.stack, llama.patches, llama.upstream_files) == ("llama", 2, ("include/llama.h", "src/llama.cpp"))
    # lines added plus removed: one added to the header; in the source one removed, two added
    assert llama.upstream_lines == 1 + 3
    assert "2 upstream files, 4 lines changed" in llama.line()
    per_patch: list = []
    assert check_patches(pin, runner, source_path=src, root=root, per_patch=per_patch) == []
    assert [(p.stack, p.upstream, p.ours, p.new) for p in per_patch] == [
        ("0001-ggml-a-new-file.patch", (), (), (("ggml/new.c", 3),)),
        ("0002-llama-declare-pool.patch", (("include/llama.h", 1),), (), ()),
        ("0003-llama-define-pool.patch", (("src/llama.cpp", 3),), (), ()),
    ]

    # a ggml commit after a llama one is refused, naming both, and nothing is written
    commit_in(tree, "ggml/new.c", "int g2;\n", "ggml : later\n\nWhy: tests.")
    with pytest.raises(PatchError, match="0004-ggml-later.patch changes ggml but follows the llama stack "
                                         r"\(0003-llama-define-pool.patch\)"):
        export_patches(tree, root / "patches", runner)
    assert not (root / "patches" / "0004-ggml-later.patch").exists()


def test_the_patch_page_lists_every_patch_and_what_each_stack_changes_as_check_patches_counts_it():
    from pyllamapool.native.patches import stack_footprints

    series = Series.load()
    page = (ROOT / "docs" / "patches.md").read_text()
    for name in series.names:
        assert re.search(rf"^\| (ggml|llama) \| {name[:4]} \| ", page, re.M), name
    if not (paths.vendor_dir() / ".git").exists():
        pytest.skip("no vendor tree: python build.py prepare")
    for footprint in stack_footprints(paths.vendor_dir(), series, Runner()):
        assert footprint.markdown() in page, footprint.line()


def test_check_patches_counts_each_patch_apart_from_upstreams_files_the_series_own(fake_project):
    """Per patch, a reviewer sees what it changes upstream, apart from the lines it changes in files an
    earlier patch of the series added."""
    root, src, pin = fake_project
    runner = Runner()
    tree = prepare(pin, runner, source_path=src, root=root)
    commit_in(tree, "src/llama-pool.cpp", "int pool(void) {\n    return 0;\n}\n", "llama : a pool\n\nWhy: tests.")
    commit_in(tree, "src/llama-pool.cpp", "int pool(void) {\n    return 1;\n}\n", "llama : a pool of one\n\nWhy: tests.")
    commit_in(tree, "include/llama.h", "int llama(void);\nint pool(void);\n", "llama : declare pool\n\nWhy: tests.")
    export_patches(tree, root / "patches", runner)
    per_patch: list = []
    footprints: list = []
    assert check_patches(pin, runner, source_path=src, root=root, footprints=footprints, per_patch=per_patch) == []
    assert [(p.upstream, p.ours, p.new) for p in per_patch] == [
        ((), (), (("src/llama-pool.cpp", 3),)),
        ((), (("src/llama-pool.cpp", 2),), ()),  # one line removed, one added, in the series' own file
        ((("include/llama.h", 1),), (), ()),
    ]
    assert per_patch[1].patch_line().endswith(": 0 upstream files, 0 lines changed in them; "
                                              "1 of the series' files, 2 lines changed; 0 new files, 0 lines")
    # the stack as a whole: the file is new, and upstream's header is the one upstream file
    (llama,) = footprints
    assert (llama.upstream, llama.ours, llama.new) == ((("include/llama.h", 1),), (), (("src/llama-pool.cpp", 3),))


def test_export_refreshes_the_patch_pages_footprints_and_keeps_its_prose():
    from pyllamapool.native.patches import StackFootprint, refresh_patch_page

    ggml = StackFootprint("ggml", 2, (("ggml/src/ggml.c", 12),), (("tests/test-x.cpp", 40),))
    llama = StackFootprint("llama", 1, (("src/llama.cpp", 3),), ())
    stale = ("# Patches\n\nprose before\n\n"
             "ggml stack: 1 patches; old counts\n\n| file | | lines | |\n| --- | --- | ---: | --- |\n"
             "| `ggml/src/gone.c` | upstream | 9 changed | |\n\nprose between\n\n"
             "llama stack: 9 patches; old counts\n\n| file | | lines | |\n| --- | --- | ---: | --- |\n"
             "\nprose after\n")
    page = refresh_patch_page(stale, [ggml, llama])
    assert page.startswith("# Patches\n\nprose before\n\n" + ggml.markdown())
    assert "gone.c" not in page and "old counts" not in page
    assert "\nprose between\n\n" + llama.markdown() + "\nprose after\n" in page
    assert page.count("ggml stack: ") == page.count("llama stack: ") == 1
    assert refresh_patch_page(page, [ggml, llama]) == page  # a current page stays as it is
    with pytest.raises(PatchError, match="no 'llama stack: ' section"):
        refresh_patch_page("ggml stack: x\n\n", [ggml, llama])


def test_applying_twice_is_a_no_op(fake_project):
    root, src, pin = fake_project
    runner = Runner()
    tree = prepare(pin, runner, source_path=src, root=root)
    commit_in(tree, "src/llama.cpp", "int llama(void) { return 3; }\n", "llama : three")
    export_patches(tree, root / "patches", runner)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout
    prepare(pin, runner, source_path=src, root=root)  # series changed: vendor already matches it
    prepare(pin, runner, source_path=src, root=root)  # stamp matches: nothing at all
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout == head
    assert len(render_series(tree, runner)) == 1


def test_a_changed_series_is_reapplied_when_vendor_has_no_work_of_its_own(fake_project, tmp_path):
    root, src, pin = fake_project
    runner = Runner()
    tree = prepare(pin, runner, source_path=src, root=root)
    commit_in(tree, "src/llama.cpp", "int llama(void) { return 5; }\n", "llama : five")
    export_patches(tree, root / "patches", runner)
    prepare(pin, runner, source_path=src, root=root)
    # patches/ moves on elsewhere (another checkout exported a different version of the patch)
    other = tmp_path / "other"
    (other / "vendor").mkdir(parents=True)
    (other / "patches").mkdir()
    tree2 = prepare(pin, runner, source_path=src, root=other)
    commit_in(tree2, "src/llama.cpp", "int llama(void) { return 6; }\n", "llama : six")
    export_patches(tree2, other / "patches", runner)
    for f in (root / "patches").iterdir():
        f.unlink()
    for f in (other / "patches").iterdir():
        (root / "patches" / f.name).write_bytes(f.read_bytes())
    prepare(pin, runner, source_path=src, root=root)  # no own commits in vendor/: re-applied
    assert (tree / "src" / "llama.cpp").read_text() == "int llama(void) { return 6; }\n"
    # but commits of one's own in vendor/ are never thrown away
    commit_in(tree, "include/llama.h", "int llama(void);\nint mine(void);\n", "llama : my work")
    (root / "patches" / "series").write_text("")
    with pytest.raises(PatchError, match="export-patches"):
        prepare(pin, runner, source_path=src, root=root)


def test_a_broken_patch_names_itself_and_its_file(fake_project):
    root, src, pin = fake_project
    patch = root / "patches" / "0001-broken.patch"
    patch.write_text(
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: t <t@localhost>\nDate: Wed, 1 Jan 2020 00:00:00 +0000\nSubject: [PATCH] broken\n\n---\n"
        "diff --git a/src/llama.cpp b/src/llama.cpp\n--- a/src/llama.cpp\n+++ b/src/llama.cpp\n"
        "@@ -1 +1 @@\n-int something_else(void) { return 9; }\n+int llama(void) { return 4; }\n-- \n2.0\n\n")
    (root / "patches" / "series").write_text("0001-broken.patch\n")
    with pytest.raises(PatchError) as err:
        prepare(pin, Runner(), source_path=src, root=root)
    text = str(err.value)
    assert "0001-broken.patch" in text
    assert "src/llama.cpp" in text
    assert "git am --abort" in text and "export-patches" in text


def test_series_naming_a_missing_patch_is_an_error(fake_project):
    root, _, _ = fake_project
    (root / "patches" / "series").write_text("0001-nothere.patch\n")
    with pytest.raises(PatchError, match="0001-nothere.patch"):
        Series.load(root / "patches")


def test_uncommitted_vendor_edits_block_export(fake_project):
    root, src, pin = fake_project
    tree = prepare(pin, Runner(), source_path=src, root=root)
    (tree / "src" / "llama.cpp").write_text("dirty\n")
    with pytest.raises(PatchError, match="uncommitted"):
        export_patches(tree, root / "patches", Runner())


# --------------------------------------------------------------------------------------------
# the real series and the real build


def test_the_real_series_applies_to_a_pristine_tree_and_is_current():
    assert check_patches(Pin.load(), Runner()) == []


def test_vendor_tree_is_ignored_and_no_upstream_source_is_tracked():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert not [f for f in tracked if f.startswith("vendor/llama.cpp/")]
    ignored = subprocess.run(["git", "check-ignore", "-q", "vendor/llama.cpp/include/llama.h"], cwd=ROOT)
    assert ignored.returncode == 0


def test_built_binaries_are_the_patched_runnable_ones(rpc_server):
    from pyllamapool.native.manifest import current_series_digest, read_manifest
    from pyllamapool.native.tools import tool_path

    cli_help = subprocess.run([str(tool_path("llama-cli")), "--help"], capture_output=True, text=True, timeout=60)
    assert "--moe-expert-cache" in cli_help.stdout + cli_help.stderr
    bench_help = subprocess.run([str(tool_path("llama-bench")), "--help"], capture_output=True, text=True, timeout=60)
    assert "--moe-expert-cache" in bench_help.stdout + bench_help.stderr
    assert rpc_server.running and "Starting RPC server" in rpc_server.log_text()
    manifest = read_manifest()
    assert manifest["upstream_ref"] == Pin.load().ref
    assert manifest["series_digest"] == current_series_digest()


def _fake_toolkit(root: Path, with_cublas: bool) -> Path:
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    if with_cublas:
        (root / "lib64").mkdir()
        (root / "lib64" / "libcublas.so.12").write_bytes(b"")
    return nvcc


def test_cuda_without_cublas_is_reported_before_the_build_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDACXX", str(_fake_toolkit(tmp_path / "cuda", with_cublas=False)))
    monkeypatch.delenv("CUDAToolkit_ROOT", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(buildsys, "_cublas_wheel", lambda: None)
    cfg = buildsys.configure_target("cuda", "86")
    problem = next(p for p in cfg.problems if "cuBLAS" in p)
    assert "pip install nvidia-cublas" in problem and "CUDA_cublas_LIBRARY" in problem
    # and the driver stops on it before configuring anything
    with pytest.raises(ToolchainError, match="cuBLAS not found"):
        buildsys.build(cfg, Runner(dry_run=False), prepare_tree=lambda: pytest.fail("prepared anyway"))


def test_cuda_with_the_toolkits_cublas_needs_nothing_more(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDACXX", str(_fake_toolkit(tmp_path / "cuda", with_cublas=True)))
    cfg = buildsys.configure_target("cuda", "86")
    assert not any("cuBLAS" in p for p in cfg.problems)
    assert not any("cublas" in f for f in cfg.cmake_flags)


@pytest.mark.parametrize("layout", ["cublas", "cu13"])  # nvidia-cublas-cu12, and CUDA 13's nvidia-cublas
def test_cuda_with_the_nvidia_cublas_wheel_points_cmake_at_it(tmp_path, monkeypatch, layout):
    monkeypatch.setenv("CUDACXX", str(_fake_toolkit(tmp_path / "cuda", with_cublas=False)))
    monkeypatch.delenv("CUDAToolkit_ROOT", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    wheel = tmp_path / "site" / "nvidia" / layout
    (wheel / "lib").mkdir(parents=True)
    (wheel / "include").mkdir()
    (wheel / "lib" / "libcublas.so.13").write_bytes(b"")
    (wheel / "lib" / "libcublasLt.so.13").write_bytes(b"")
    (wheel / "include" / "cublas_v2.h").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    cfg = buildsys.configure_target("cuda", "86")
    assert not any("cuBLAS" in p for p in cfg.problems)
    assert f"-DCUDA_cublas_LIBRARY={wheel / 'lib' / 'libcublas.so.13'}" in cfg.cmake_flags
    assert f"-DCUDA_cublasLt_LIBRARY={wheel / 'lib' / 'libcublasLt.so.13'}" in cfg.cmake_flags
    assert f"-DCMAKE_CUDA_FLAGS=-I{wheel / 'include'}" in cfg.cmake_flags


def test_prepare_reset_recreates_vendor_from_the_pin_and_the_series(fake_project):
    root, src, pin = fake_project
    runner = Runner()
    tree = prepare(pin, runner, source_path=src, root=root)
    commit_in(tree, "src/llama.cpp", "int llama(void) { return 4; }\n", "llama : four")
    export_patches(tree, root / "patches", runner)
    # work that never became a patch: an extra commit and a stray file
    commit_in(tree, "src/llama.cpp", "int llama(void) { return 5; }\n", "llama : five, not exported")
    (tree / "stray.txt").write_text("scratch\n")
    prepare(pin, runner, source_path=src, root=root, reset=True)
    assert not (tree / "stray.txt").exists()
    assert (tree / "src" / "llama.cpp").read_text() == "int llama(void) { return 4; }\n"
    log = subprocess.run(["git", "log", "--format=%s"], cwd=tree, capture_output=True, text=True).stdout.split("\n")
    assert log[0] == "llama : four" and "llama : five, not exported" not in log


def test_a_missing_or_old_vulkan_toolchain_is_reported_with_what_to_install(monkeypatch):
    monkeypatch.setattr(buildsys, "_which", lambda name: None if name == "glslc" else f"/usr/bin/{name}")
    monkeypatch.setattr(buildsys, "_vulkan_header_version", lambda: None)
    problems = " | ".join(buildsys.configure_target("vulkan", None).problems)
    assert "glslc not found (apt-get install glslc)" in problems
    assert "Vulkan headers not found (apt-get install libvulkan-dev" in problems
    monkeypatch.setattr(buildsys, "_which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(buildsys, "_vulkan_header_version", lambda: (1, 3, 239))
    problems = " | ".join(buildsys.configure_target("vulkan", None).problems)
    assert "Vulkan headers 1.3.239 are too old" in problems and "Vulkan_INCLUDE_DIR" in problems
    monkeypatch.setattr(buildsys, "_vulkan_header_version", lambda: (1, 4, 309))
    assert buildsys.configure_target("vulkan", None).problems == []


def test_a_missing_nvcc_is_reported_with_what_to_install(monkeypatch):
    monkeypatch.setattr(buildsys, "_find_nvcc", lambda: None)
    problems = buildsys.configure_target("cuda", "86").problems
    assert any("nvcc not found: install the CUDA toolkit" in p and "CUDACXX" in p for p in problems)


def _runpath(binary: Path) -> str:
    out = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True, check=True).stdout
    return " ".join(line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "RUNPATH" in line or "RPATH" in line)


def test_installed_libraries_and_tools_find_each_other_through_origin_rpaths():
    lib, bin_ = paths.installed_lib_dir(), paths.installed_bin_dir()
    libs = sorted(p for p in lib.glob("lib*.so*") if not p.is_symlink())
    tools = [bin_ / name for name in ("llama-server", "llama-cli", "llama-bench", "ggml-rpc-server")]
    assert libs and all(t.exists() for t in tools)
    for so in libs:
        assert "$ORIGIN" in _runpath(so), so
    for tool in tools:
        assert "$ORIGIN/../lib" in _runpath(tool), tool
        # resolved with no library path from the environment: every pyllamapool library comes from lib/
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        ldd = subprocess.run(["ldd", str(tool)], capture_output=True, text=True, env=env, check=True).stdout
        assert "not found" not in ldd
        for line in ldd.splitlines():
            if "libllama" in line or "libggml" in line:
                resolved = Path(line.split("=>")[1].split("(")[0].strip()).resolve()
                assert resolved.parent == lib.resolve(), line


def test_importing_the_package_warns_when_the_build_is_from_another_series(tmp_path):
    import shutil

    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "patches", checkout / "patches")
    (checkout / "vendor").mkdir()
    shutil.copy(paths.pin_file(ROOT), paths.pin_file(checkout))

    def import_warnings(root: Path, **env: str) -> str:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("PYLLAMAPOOL_")}
        result = subprocess.run([sys.executable, "-W", "always", "-c", "import pyllamapool"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=120,
                                env={**clean, "PYTHONPATH": str(ROOT), "PYLLAMAPOOL_ROOT": str(root), **env})
        assert result.returncode == 0, result.stderr
        return result.stderr

    assert "StaleBuildWarning" not in import_warnings(checkout)  # same series as the build
    first = sorted((checkout / "patches").glob("0*.patch"))[0]
    first.write_bytes(first.read_bytes() + b"\n")
    text = import_warnings(checkout)
    assert "StaleBuildWarning" in text and "do not match patches/series" in text and "python build.py" in text
    assert "StaleBuildWarning" not in import_warnings(checkout, PYLLAMAPOOL_NO_STALE_WARNING="1")


def test_on_debian_12_the_vulkan_build_fetches_what_it_needs_and_says_so(tmp_path, monkeypatch):
    """As root with nothing installed: glslc and the loader's dev files from bookworm, lavapipe from
    bookworm-backports through a list of its own, newer headers through a private apt configuration.
    A dry run prints all of it and writes nothing."""
    import io

    from rich.console import Console

    from pyllamapool.native import vulkan_deps

    monkeypatch.setenv("PYLLAMAPOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("Vulkan_INCLUDE_DIR", raising=False)
    monkeypatch.setattr(vulkan_deps, "debian_codename", lambda: "bookworm")
    monkeypatch.setattr(vulkan_deps.os, "geteuid", lambda: 0)
    monkeypatch.setattr(vulkan_deps.shutil, "which", lambda name: None if name == "glslc" else f"/usr/bin/{name}")
    monkeypatch.setattr(vulkan_deps, "package_version",
                        lambda name: "22.3.6-1+deb12u2" if name == "mesa-vulkan-drivers" else None)
    monkeypatch.setattr(vulkan_deps, "_has_loader_link", lambda: False)
    monkeypatch.setattr(vulkan_deps, "header_version", lambda include: (1, 3, 239))
    out = io.StringIO()
    runner = Runner(dry_run=True, console=Console(file=out, width=400, highlight=False))
    deps = vulkan_deps.ensure(runner)
    text = out.getvalue()
    assert "apt-get -q -y install --no-install-recommends glslc libvulkan-dev" in text
    assert "-t bookworm-backports install --no-install-recommends mesa-vulkan-drivers" in text
    assert "the system's apt sources are unchanged" in text
    assert "Dir::State::status=/dev/null" in text and "download libvulkan-dev spirv-headers" in text
    assert deps.include_dir == tmp_path / "cache" / "vulkan" / "headers-trixie" / "usr" / "include"
    assert all(line.startswith("(a real run)") for line in deps.done) and len(deps.done) == 3
    assert "over 22.3.6" in deps.done[1]
    assert not (tmp_path / "cache").exists()


def test_elsewhere_the_vulkan_build_changes_nothing(monkeypatch):
    from pyllamapool.native import vulkan_deps

    monkeypatch.setattr(vulkan_deps, "debian_codename", lambda: "noble")
    runner = Runner(dry_run=True)
    deps = vulkan_deps.ensure(runner)
    assert deps.include_dir is None and deps.done == []


def test_vulkan_header_versions_are_read_from_vulkan_core_h(tmp_path):
    from pyllamapool.native import vulkan_deps

    (tmp_path / "vulkan").mkdir()
    (tmp_path / "vulkan" / "vulkan_core.h").write_text(
        "#define VK_HEADER_VERSION 309\n"
        "#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 4, VK_HEADER_VERSION)\n")
    assert vulkan_deps.header_version(tmp_path) == (1, 4, 309)
    assert vulkan_deps.header_version(tmp_path / "none") is None


_FAKE_NINJA = ("import time\n"
               "for i in range(1, 4):\n"
               "    print(f'[{i}/3] Building CXX object src/CMakeFiles/llama.dir/llama-file-{i}.cpp.o', flush=True)\n"
               "    time.sleep(0.3)\n")
_COMPILE = ("import sys\n"
            "from pyllamapool.native.buildsys import _compile\n"
            "from pyllamapool.native.runner import Runner\n"
            "_compile([sys.executable, '-c', sys.argv[1]], Runner(), {})\n")


def test_the_build_shows_files_compiled_of_total_in_a_terminal_and_is_quiet_in_a_pipe():
    import pty
    import select

    argv = [sys.executable, "-c", _COMPILE, _FAKE_NINJA]
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, close_fds=True)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 30)
        if not ready:
            break
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    proc.wait(timeout=30)
    os.close(master)
    text = seen.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "compile" in text and "3/3" in text and "llama-file-" in text  # the step, files of total, the file
    piped = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert piped.returncode == 0 and "3/3" not in piped.stdout + piped.stderr


def test_check_patches_measures_each_function_a_new_source_file_defines():
    """The longest function of a new file is what a reviewer must read in one go: namespaces, macros,
    comments and strings holding braces, initializers and member functions are told apart."""
    from pyllamapool.native.sourcesize import functions, longest_function

    text = (
        '#define CHECK(c) do { if (!(c)) { \\\n'
        '    abort(); } } while (0)\n'
        'namespace {\n'
        'static const int table[] = { 1, 2, 3 };\n'
        'struct pool {\n'
        '    int size() const { return n; }\n'
        '    int n = 0;\n'
        '};\n'
        '}\n'
        'static int\n'
        'count(const char * s, int limit = 3) {\n'
        '    // a comment with a brace {\n'
        '    const char * brace = "}";\n'
        '    auto f = [&](int x) { return x + limit; };\n'
        '    if (s) {\n'
        '        return f(1);\n'
        '    }\n'
        '    return 0;\n'
        '}\n'
        'pool::pool(int n) : n(n) {\n'
        '}\n'
        'pool & pool::operator=(const pool & o) {\n'
        '    return *this;\n'
        '}\n')
    found = functions(text)
    assert [(f.name, f.first_line, f.lines) for f in found] == [
        ("size", 6, 1), ("count", 10, 10), ("pool::pool", 20, 2), ("pool::operator=", 22, 3)]
    assert longest_function(text).name == "count"
    assert longest_function("int x;\n") is None


def test_the_readme_stays_short_and_its_table_links_every_docs_page():
    """The README is the front page (under 150 lines); the rest lives in docs/, every page of which
    its documentation table links."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    table = readme[readme.index("## Documentation"):]
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in table, page.name
