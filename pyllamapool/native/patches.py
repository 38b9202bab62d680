"""The patch series: apply patches/series onto the pinned tree as commits, export them back, check.

vendor/llama.cpp is a git repository whose root commit is the pristine pinned tree; each patch in
patches/series is one commit above it (`git am -3`). Developers edit there, commit, and run
`export-patches`, which regenerates patches/ from those commits with stable output.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import paths, source, sourcesize
from ..errors import PatchError
from .pin import Pin
from .runner import Runner

# Fixed identity and dates so the baseline commit is the same on every machine.
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "pyllamapool", "GIT_AUTHOR_EMAIL": "pyllamapool@localhost",
    "GIT_COMMITTER_NAME": "pyllamapool", "GIT_COMMITTER_EMAIL": "pyllamapool@localhost",
}
_BASELINE_DATE = "2000-01-01T00:00:00Z"
# Options that make format-patch output independent of the user's git configuration.
_STABLE_GIT = ["-c", "core.abbrev=12", "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
               "-c", "diff.relative=false", "-c", "format.numbered=false", "-c", "core.autocrlf=false"]
FORMAT_PATCH_ARGS = ["format-patch", "-q", "--zero-commit", "--no-numbered", "--no-signature",
                     "--no-thread", "--stat=80"]


@dataclass(frozen=True)
class Series:
    """patches/series and the patch files it names, in order."""
    directory: Path
    names: tuple[str, ...]

    @classmethod
    def load(cls, directory: Path | None = None) -> "Series":
        directory = directory or paths.patches_dir()
        series_file = directory / "series"
        if not series_file.exists():
            return cls(directory, ())
        names = []
        for lineno, raw in enumerate(series_file.read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if not (directory / line).is_file():
                raise PatchError(f"{series_file}:{lineno}: patch {line!r} does not exist")
            names.append(line)
        return cls(directory, tuple(names))

    def files(self) -> list[Path]:
        return [self.directory / name for name in self.names]

    def digest(self, pin: Pin) -> str:
        h = hashlib.sha256(f"{pin.ref}\n{pin.sdist_sha256}\n".encode())
        for path in self.files():
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return h.hexdigest()


def git(tree: Path, *args: str, runner: Runner, capture: bool = True, check: bool = True,
        quiet: bool = True):
    return runner.run(["git", *_STABLE_GIT, *args], cwd=tree, env=_GIT_ENV, capture=capture,
                      check=check, quiet=quiet)


def baseline_commit(tree: Path, runner: Runner) -> str:
    out = git(tree, "rev-list", "--max-parents=0", "HEAD", runner=runner).stdout.split()
    if not out:
        raise PatchError(f"{tree} has no baseline commit")
    return out[-1]


def init_baseline(tree: Path, pin: Pin, runner: Runner) -> None:
    runner.note(f"make {tree} a git repository; first commit = pristine {pin.upstream}@{pin.short_ref}")
    env = {"GIT_AUTHOR_DATE": _BASELINE_DATE, "GIT_COMMITTER_DATE": _BASELINE_DATE}
    message = (f"llama.cpp {pin.ref}\n\nPristine {pin.upstream}@{pin.ref}, as vendored by the "
               f"{pin.sdist_requirement} sdist\n(sha256 {pin.sdist_sha256}).\n")
    hotfixes = [f"- {fix.path}: {fix.why} ({'reverted' if fix.action == 'revert' else 'kept'})"
                for fix in pin.hotfixes]
    if hotfixes:
        message += "\nThe sdist packager's hotfixes:\n" + "\n".join(hotfixes) + "\n"
    for argv in (["init", "-q", "-b", "main"], ["add", "-A", "-f"],
                 ["commit", "-q", "--no-verify", "-m", message]):
        runner.run(["git", *_STABLE_GIT, *argv], cwd=tree, env={**_GIT_ENV, **env}, capture=True,
                   quiet=True)


def _patch_files_touched(patch: Path) -> list[str]:
    return sorted(set(re.findall(r"^diff --git a/(\S+) b/", patch.read_text(errors="replace"), re.M)))


def apply_series(tree: Path, series: Series, runner: Runner, start: int = 0) -> None:
    """git am -3 each patch of the series from index `start`; stop on the first that fails."""
    names = series.names[start:]
    if not names:
        return
    for index, patch in enumerate(series.files()[start:], start + 1):
        argv = ["git", "am", "-3", "-q", "--committer-date-is-author-date", str(patch)]
        if runner.dry_run:
            runner.show(argv, cwd=tree)
            continue
        result = git(tree, "am", "-3", "-q", "--committer-date-is-author-date", str(patch),
                     runner=runner, check=False)
        if result.returncode != 0:
            conflicts = git(tree, "diff", "--name-only", "--diff-filter=U", runner=runner,
                            check=False).stdout.split()
            touched = conflicts or _patch_files_touched(patch)
            detail = (result.stderr or result.stdout).strip().splitlines()[-6:]
            raise PatchError(
                f"patch {index}/{len(series.names)} {patch.name} does not apply\n"
                f"  files: {', '.join(touched) or '(none found)'}\n"
                + "".join(f"  | {line}\n" for line in detail)
                + f"To recover:\n  cd {tree}\n"
                f"  # resolve the conflicts, `git add` the files, then\n  git am --continue\n"
                f"  # ...or give up on this patch with\n  git am --abort\n"
                f"  # then save the result into patches/ with\n  python build.py export-patches")
        runner.note(f"applied {patch.name}")


def render_series(tree: Path, runner: Runner) -> dict[str, bytes]:
    """The commits above the baseline, as format-patch files (name -> bytes), in order."""
    base = baseline_commit(tree, runner)
    with tempfile.TemporaryDirectory() as tmp:
        git(tree, *FORMAT_PATCH_ARGS, "-o", tmp, f"{base}..HEAD", runner=runner)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).glob("*.patch"))}


def current_patches(series: Series) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in series.files()}


def describe_difference(expected: dict[str, bytes], actual: dict[str, bytes]) -> list[str]:
    lines = []
    for name in expected.keys() | actual.keys():
        if name not in actual:
            lines.append(f"only in patches/: {name}")
        elif name not in expected:
            lines.append(f"not in patches/: {name}")
        elif expected[name] != actual[name]:
            lines.append(f"differs: {name}")
    return sorted(lines)


#: the two stacks of the series, in order: ggml's changes (each with its own test, small enough to send
#: upstream alone), then llama's (the expert pool). A patch's stack is the component its subject names.
STACKS = ("ggml", "llama")
STACK_TITLES = {"ggml": "ggml: backend changes, each with its own test, each reviewable upstream on its own",
                "llama": "llama: the expert pool (libllama, common, tools)"}


def stack_of(name: str) -> str:
    """"0003-ggml-backend-sched-...patch" -> "ggml"; every other patch belongs to the llama stack."""
    subject = name.split("-", 1)[1] if "-" in name else name
    return "ggml" if subject.startswith("ggml") else "llama"


def stacks(names: Sequence[str]) -> dict[str, list[str]]:
    """The series split into its stacks; the ggml stack must come first (it never depends on llama's)."""
    out: dict[str, list[str]] = {s: [] for s in STACKS}
    for name in names:
        stack = stack_of(name)
        if stack == "ggml" and out["llama"]:
            raise PatchError(f"{name} changes ggml but follows the llama stack ({out['llama'][-1]}): move the "
                             "ggml commits before the first llama one (git rebase -i) and export again")
        out[stack].append(name)
    return out


def series_text(names: Sequence[str]) -> str:
    text = ("# Applied in order with `git am -3` onto the pinned tree (vendor/llama.cpp.pin).\n"
            "# Regenerate with `python build.py export-patches`; never edit patches by hand.\n")
    for stack, members in stacks(names).items():
        if members:
            text += f"\n# {STACK_TITLES[stack]}\n" + "".join(f"{name}\n" for name in members)
    return text


def export_patches(tree: Path, patches_dir: Path, runner: Runner) -> list[str]:
    """Write the commits above the baseline to patches/ and update series; returns changed names."""
    ensure_clean(tree, runner)
    rendered = render_series(tree, runner)
    text = series_text(list(rendered))  # refuses a ggml commit after a llama one, before writing anything
    old = Series.load(patches_dir)
    changed = [name for name, data in rendered.items()
               if not (patches_dir / name).exists() or (patches_dir / name).read_bytes() != data]
    removed = [name for name in old.names if name not in rendered]
    if runner.dry_run:
        runner.note(f"would write {len(changed)} and remove {len(removed)} patch files")
        return changed + removed
    patches_dir.mkdir(parents=True, exist_ok=True)
    for name in changed:
        (patches_dir / name).write_bytes(rendered[name])
    for name in removed:
        (patches_dir / name).unlink(missing_ok=True)
    series_file = patches_dir / "series"
    if not series_file.exists() or series_file.read_text() != text:
        series_file.write_text(text)
        changed.append("series")
    return changed + removed


def ensure_clean(tree: Path, runner: Runner) -> None:
    if (tree / ".git" / "rebase-apply").exists():
        raise PatchError(f"a `git am` is in progress in {tree}: finish it with `git am --continue` "
                         f"or drop it with `git am --abort` first")
    dirty = git(tree, "status", "--porcelain", runner=runner).stdout.strip()
    if dirty:
        raise PatchError(f"{tree} has uncommitted changes; commit them (one commit per patch) "
                         f"first:\n{dirty[:1500]}")


# ---------------------------------------------------------------------------------------------
# stamp: lets `prepare` be a no-op when the tree already holds this pin + series


def read_stamp(root: Path | None = None) -> dict:
    try:
        return json.loads(paths.stamp_file(root).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_stamp(tree: Path, pin: Pin, series: Series, runner: Runner, root: Path | None = None) -> None:
    if runner.dry_run:
        return
    head = git(tree, "rev-parse", "HEAD", runner=runner).stdout.strip()
    paths.stamp_file(root).write_text(json.dumps(
        {"ref": pin.ref, "sdist_sha256": pin.sdist_sha256, "series_digest": series.digest(pin),
         "head": head}, indent=2) + "\n")


def prepare(pin: Pin, runner: Runner, *, source_path: Path | None = None, reset: bool = False,
            root: Path | None = None) -> Path:
    """Make vendor/llama.cpp hold the pinned tree with the series applied. Idempotent."""
    tree = paths.vendor_dir(root)
    series = Series.load(paths.patches_dir(root))
    digest = series.digest(pin)
    if reset and tree.exists():
        runner.note(f"--reset: removing {tree}")
        if not runner.dry_run:
            shutil.rmtree(tree)
            paths.stamp_file(root).unlink(missing_ok=True)
    if not tree.exists() or runner.dry_run and reset:
        source.materialize(pin, tree, runner, source_path)
        init_baseline(tree, pin, runner)
        apply_series(tree, series, runner)
        write_stamp(tree, pin, series, runner, root)
        return tree
    stamp = read_stamp(root)
    # stamps written before the pin named a release tag call it "commit"
    held = stamp.get("ref", stamp.get("commit"))
    if held not in (None, pin.ref):
        raise PatchError(f"{tree} holds upstream {held[:9]}, the pin says {pin.short_ref}; "
                         f"run `python build.py prepare --reset` to recreate it")
    if stamp.get("series_digest") == digest:
        runner.note(f"{tree} already holds the pinned tree + {len(series.names)} patches")
        return tree
    if runner.dry_run:
        # telling how vendor/ relates to the new series takes git commands that a dry run only prints
        runner.note(f"patches/ changed since {tree} was prepared: a real run applies the new patches, or "
                    "re-applies the series, or says why it cannot")
        return tree
    # The series changed since the tree was prepared: find out how vendor/ relates to it.
    ensure_clean(tree, runner)
    rendered = list(render_series(tree, runner).items())
    wanted = list(current_patches(series).items())
    head = git(tree, "rev-parse", "HEAD", runner=runner).stdout.strip()
    if rendered == wanted:
        runner.note("vendor/ commits already match patches/; updating the stamp")
    elif rendered == wanted[:len(rendered)]:
        runner.note(f"applying {len(wanted) - len(rendered)} new patches")
        apply_series(tree, series, runner, start=len(rendered))
    elif stamp.get("head") == head:
        # vendor/ holds exactly what the driver applied last time (no commits of anyone's own),
        # and patches/ has moved on (e.g. git pull): re-apply the series onto the baseline
        runner.note("patches/ changed since vendor/ was prepared; re-applying the series")
        git(tree, "reset", "-q", "--hard", baseline_commit(tree, runner), runner=runner)
        apply_series(tree, series, runner)
    else:
        diff = describe_difference(dict(wanted), dict(rendered))
        raise PatchError(
            "vendor/llama.cpp commits and patches/series disagree:\n  " + "\n  ".join(diff) +
            "\nIf your vendor/ commits are the newer work: python build.py export-patches\n"
            "If patches/ is newer (e.g. after git pull): python build.py prepare --reset")
    write_stamp(tree, pin, series, runner, root)
    return tree


@dataclass(frozen=True)
class StackFootprint:
    """What one stack changes in upstream llama.cpp: files that exist in the pinned tree, with the lines
    added plus removed in each, and the new files of our own with their lines."""
    stack: str
    patches: int
    upstream: tuple[tuple[str, int], ...]   # (path, lines added + removed)
    new: tuple[tuple[str, int], ...]        # (path, lines)
    longest: tuple[tuple[str, str, int], ...] = ()  # new C/C++ files: (path, longest function, its lines)
    ours: tuple[tuple[str, int], ...] = ()  # files an earlier patch or stack added: (path, lines changed)

    @property
    def upstream_files(self) -> tuple[str, ...]:
        return tuple(path for path, _ in self.upstream)

    @property
    def upstream_lines(self) -> int:
        return sum(lines for _, lines in self.upstream)

    @property
    def new_files(self) -> int:
        return len(self.new)

    @property
    def new_lines(self) -> int:
        return sum(lines for _, lines in self.new)

    @property
    def ours_lines(self) -> int:
        return sum(lines for _, lines in self.ours)

    def longest_in(self, path: str) -> str:
        """`name (N lines)` for a new source file's longest function, else empty."""
        return next((f"{name} ({lines})" for p, name, lines in self.longest if p == path), "")

    def line(self) -> str:
        return (f"{self.stack} stack: {self.patches} patches; {len(self.upstream)} upstream files, "
                f"{self.upstream_lines} lines changed in them; {self.new_files} new files, {self.new_lines} lines")

    def patch_line(self) -> str:
        """One patch's footprint (labelled by its file name), the lines in the series' own files apart."""
        return (f"{self.stack}: {len(self.upstream)} upstream files, {self.upstream_lines} lines changed in them; "
                f"{len(self.ours)} of the series' files, {self.ours_lines} lines changed; "
                f"{self.new_files} new files, {self.new_lines} lines")

    def markdown(self) -> str:
        """The stack's files as docs/patches.md's table: upstream files first, then the series' own files an
        earlier stack added, then new ones."""
        def row(*cells: str) -> str:
            return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"
        rows = [row(f"`{path}`", "upstream", f"{lines} changed", "") for path, lines in self.upstream]
        rows += [row(f"`{path}`", "series", f"{lines} changed", "") for path, lines in self.ours]
        rows += [row(f"`{path}`", "new", str(lines), self.longest_in(path)) for path, lines in self.new]
        return "\n".join([self.line(), "", row("file", "", "lines", "longest function (lines)"),
                          "| --- | --- | ---: | --- |", *rows, ""])


def _footprint(tree: Path, label: str, n_patches: int, start: str, end: str, upstream: set[str],
               runner: Runner) -> StackFootprint:
    """What the commits start..end change: the files they modify, upstream's (in `upstream`) apart from
    those the series added before `start`, and the new files with their longest functions."""
    def numstat(kind: str) -> tuple[tuple[str, int], ...]:
        rows = git(tree, "diff", "--numstat", f"--diff-filter={kind}", start, end, runner=runner).stdout
        return tuple((path, int(added) + int(removed))
                     for added, removed, path in (row.split("\t", 2) for row in rows.splitlines()))
    new = numstat("A")
    longest = []
    for path, _ in new:
        if sourcesize.is_source(path):
            found = sourcesize.longest_function(git(tree, "show", f"{end}:{path}", runner=runner).stdout)
            if found:
                longest.append((path, found.name, found.lines))
    modified = numstat("M")
    return StackFootprint(label, n_patches, tuple(row for row in modified if row[0] in upstream), new,
                          tuple(longest), tuple(row for row in modified if row[0] not in upstream))


def _series_commits(tree: Path, runner: Runner) -> tuple[str, list[str], set[str]]:
    """The baseline, the series' commits in order, and the baseline's files (upstream's)."""
    base = baseline_commit(tree, runner)
    commits = git(tree, "rev-list", "--reverse", f"{base}..HEAD", runner=runner).stdout.split()
    return base, commits, set(git(tree, "ls-tree", "-r", "--name-only", base, runner=runner).stdout.splitlines())


def stack_footprints(tree: Path, series: Series, runner: Runner) -> list[StackFootprint]:
    """Per stack, from a tree holding the baseline and the series as commits."""
    start, commits, upstream = _series_commits(tree, runner)
    out = []
    for stack, members in stacks(series.names).items():
        if not members:
            continue
        end = commits[series.names.index(members[-1])]
        out.append(_footprint(tree, stack, len(members), start, end, upstream, runner))
        start = end
    return out


def patch_footprints(tree: Path, series: Series, runner: Runner) -> list[StackFootprint]:
    """Per patch (labelled by its file name), what it alone changes: a reviewer takes them one by one."""
    start, commits, upstream = _series_commits(tree, runner)
    out = []
    for name, end in zip(series.names, commits):
        out.append(_footprint(tree, name, 1, start, end, upstream, runner))
        start = end
    return out


def refresh_patch_page(text: str, footprints: Sequence[StackFootprint]) -> str:
    """docs/patches.md with each stack's footprint (its summary line and its table) as `footprints`
    count it; the prose around them is kept. A page without a stack's section is refused: where the
    table goes is the page's choice, not ours."""
    for footprint in footprints:
        found = re.search(rf"^{re.escape(footprint.stack)} stack: .*\n\n(\|.*\n)*", text, re.M)
        if found is None:
            raise PatchError(f"docs/patches.md has no '{footprint.stack} stack: ' section to refresh; "
                             f"add the line where its table belongs")
        text = text[:found.start()] + footprint.markdown() + text[found.end():]
    return text


def write_patch_page(page: Path, tree: Path, runner: Runner) -> bool:
    """Refresh the footprints in `page` from the series committed in `tree`; whether it changed."""
    old = page.read_text()
    new = refresh_patch_page(old, stack_footprints(tree, Series.load(), runner))
    if new != old and not runner.dry_run:
        page.write_text(new)
    return new != old


def check_patches(pin: Pin, runner: Runner, *, source_path: Path | None = None,
                  root: Path | None = None, footprints: list[StackFootprint] | None = None,
                  per_patch: list[StackFootprint] | None = None) -> list[str]:
    """Apply the series to a fresh pristine copy, patch by patch, each onto its predecessors; return
    problems (empty = good). `footprints`, when given, receives what each stack changes upstream;
    `per_patch` what each patch does."""
    series = Series.load(paths.patches_dir(root))
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pyllamapool-check-") as tmp:
        fresh = Path(tmp) / "llama.cpp"
        source.materialize(pin, fresh, runner, source_path)
        init_baseline(fresh, pin, runner)
        stacks(series.names)  # the ggml stack first
        apply_series(fresh, series, runner)  # raises PatchError naming the patch
        if runner.dry_run:
            return problems
        if footprints is not None:
            footprints.extend(stack_footprints(fresh, series, runner))
        if per_patch is not None:
            per_patch.extend(patch_footprints(fresh, series, runner))
        roundtrip = render_series(fresh, runner)
        problems += [f"round trip: {line}" for line in
                     describe_difference(current_patches(series), roundtrip)]
    tree = paths.vendor_dir(root)
    if tree.exists():
        status = git(tree, "status", "--porcelain", runner=runner).stdout.strip()
        if status:
            problems.append("vendor/llama.cpp has uncommitted changes (commit and export them)")
        problems += [f"stale: {line}" for line in
                     describe_difference(current_patches(series), render_series(tree, runner))]
    return problems
