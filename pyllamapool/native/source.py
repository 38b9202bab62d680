"""Obtain the pinned llama.cpp tree: from the verified sdist (cached per user) or a local path."""
from __future__ import annotations

import hashlib
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from . import paths
from ..errors import SourceError
from .pin import Hotfix, Pin
from .runner import Runner


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sdist(path: Path, pin: Pin) -> None:
    actual = sha256_of(path)
    if actual != pin.sdist_sha256:
        raise SourceError(
            f"refusing {path}: sha256 mismatch\n  expected {pin.sdist_sha256} (from the pin)\n"
            f"  actual   {actual}\nDelete the file to download it again, or fix the pin.")


def cached_sdist(pin: Pin) -> Path:
    name = f"{pin.sdist_package.replace('-', '_')}-{pin.sdist_version}.tar.gz"
    return paths.cache_dir() / "sdist" / name


def fetch_sdist(pin: Pin, runner: Runner) -> Path:
    """Return the verified sdist, downloading it into the user cache only when it is not there."""
    target = cached_sdist(pin)
    if target.exists():
        runner.note(f"using cached {target}")
        if not runner.dry_run:
            verify_sdist(target, pin)
        return target
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", pin.sdist_package,
            pin.sdist_requirement, "-d"]
    if runner.dry_run:
        runner.show([*argv, str(target.parent)])
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        runner.note(f"downloading {pin.sdist_requirement} (sdist, tens of MB)")
        result = runner.run([*argv, tmp], capture=True, check=False)
        if result.returncode != 0:
            raise SourceError(f"pip download of {pin.sdist_requirement} failed:\n"
                              f"{(result.stderr or result.stdout).strip()[-2000:]}")
        found = list(Path(tmp).glob("*.tar.gz"))
        if len(found) != 1:
            raise SourceError(f"pip download left {len(found)} sdists in {tmp}, expected one")
        verify_sdist(found[0], pin)
        found[0].replace(target)
    return target


def extract_sdist(sdist: Path, pin: Pin, dest: Path, runner: Runner) -> None:
    """Extract the sdist's vendored llama.cpp into dest (which must not exist)."""
    runner.note(f"extract {pin.sdist_subdir}/ of {sdist.name} into {dest}")
    if runner.dry_run:
        return
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        top = members[0].name.split("/", 1)[0]
        prefix = f"{top}/{pin.sdist_subdir}/"
        wanted = [m for m in members if m.name.startswith(prefix)]
        if not wanted:
            raise SourceError(f"{sdist} has no {pin.sdist_subdir}/ folder")
        staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".extract-"))
        try:
            with Progress(TextColumn("extract"), BarColumn(), MofNCompleteColumn(),
                          console=runner.console, transient=True) as progress:
                task = progress.add_task("extract", total=len(wanted))
                for member in wanted:
                    member.name = member.name[len(prefix):]
                    if member.name:
                        tar.extract(member, staging, filter="data")
                    progress.advance(task)
            _drop_dangling_git_pointer(staging)
            for fix in pin.hotfixes:
                undo_hotfix(staging, fix, runner)
            staging.rename(dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's content (`git hash-object`), without needing git."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def undo_hotfix(tree: Path, fix: Hotfix, runner: Runner) -> None:
    """Check one packager hotfix in the extracted tree and revert it where the pin says so."""
    path = tree / fix.path
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SourceError(f"the pin names a hotfix in {fix.path}, which the sdist does not have") from None
    if git_blob_id(data) != fix.sdist_blob:
        raise SourceError(f"{fix.path} in the sdist is blob {git_blob_id(data)}, the pin expects "
                          f"{fix.sdist_blob}: the pin's hotfix entry does not describe this sdist")
    if fix.action == "keep":
        runner.note(f"keep the packager's hotfix in {fix.path}: {fix.why}")
        return
    lines = data.split(b"\n")
    drop = {n for first, last in fix.drop_lines for n in range(first, last + 1)}
    if max(drop) > len(lines):
        raise SourceError(f"{fix.path} has {len(lines)} lines; the pin drops up to line {max(drop)}")
    pristine = b"\n".join(line for n, line in enumerate(lines, 1) if n not in drop)
    if git_blob_id(pristine) != fix.pristine_blob:
        raise SourceError(f"reverting the hotfix in {fix.path} gave blob {git_blob_id(pristine)}, "
                          f"not the pristine {fix.pristine_blob} the pin names")
    path.write_bytes(pristine)
    runner.note(f"revert the packager's hotfix in {fix.path}: {fix.why}")


def copy_source(source: Path, dest: Path, runner: Runner) -> None:
    """Use a local llama.cpp tree (e.g. a git checkout of the pinned commit) instead of the sdist."""
    if not (source / "include" / "llama.h").exists():
        raise SourceError(f"--source {source} does not look like a llama.cpp tree (no include/llama.h)")
    runner.note(f"copy {source} into {dest} (without .git)")
    if runner.dry_run:
        return
    shutil.copytree(source, dest, symlinks=True, ignore=shutil.ignore_patterns(".git"))


def _drop_dangling_git_pointer(tree: Path) -> None:
    # In the sdist, vendor/llama.cpp/.git is a file pointing into the sdist's own .git/modules;
    # extracted on its own that pointer dangles and would confuse `git init`.
    pointer = tree / ".git"
    if pointer.is_file():
        pointer.unlink()


def materialize(pin: Pin, dest: Path, runner: Runner, source: Path | None = None) -> None:
    """Create dest holding the pristine pinned tree."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source is not None:
        copy_source(source, dest, runner)
    else:
        extract_sdist(fetch_sdist(pin, runner), pin, dest, runner)
