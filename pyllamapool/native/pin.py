"""The pin: which upstream llama.cpp tree the patch series applies to, and how to get it."""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import paths
from ..errors import SourceError

_HOTFIX_ACTIONS = ("revert", "keep")


@dataclass(frozen=True)
class Hotfix:
    """A change the sdist's packager made to the upstream tree, and what the driver does about it."""
    path: str
    action: str
    why: str
    sdist_blob: str
    drop_lines: tuple[tuple[int, int], ...] = ()
    pristine_blob: str = ""


@dataclass(frozen=True)
class Pin:
    upstream: str
    ref: str
    sdist_package: str
    sdist_version: str
    sdist_sha256: str
    sdist_subdir: str
    hotfixes: tuple[Hotfix, ...] = ()

    @property
    def short_ref(self) -> str:
        # a release tag stays whole; a commit hash is shortened as git does
        return self.ref[:9] if re.fullmatch(r"[0-9a-f]{40}", self.ref) else self.ref

    @property
    def build_number(self) -> int | None:
        """The upstream build number of a release tag (b11549 -> 11549), None for a commit."""
        match = re.fullmatch(r"b(\d+)", self.ref)
        return int(match.group(1)) if match else None

    @property
    def sdist_requirement(self) -> str:
        return f"{self.sdist_package}=={self.sdist_version}"

    @classmethod
    def load(cls, path: Path | None = None) -> "Pin":
        path = path or paths.pin_file()
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise SourceError(f"pin file {path} is missing") from None
        except tomllib.TOMLDecodeError as exc:
            raise SourceError(f"pin file {path} is not valid TOML: {exc}") from None
        fields = [name for name in cls.__dataclass_fields__ if name != "hotfixes"]
        missing = [name for name in fields if name not in data]
        if missing:
            raise SourceError(f"pin file {path} lacks {', '.join(missing)}")
        hotfixes = tuple(_hotfix(path, index, entry)
                         for index, entry in enumerate(data.get("hotfix", []), 1))
        return cls(**{name: str(data[name]) for name in fields}, hotfixes=hotfixes)


def _hotfix(path: Path, index: int, entry: dict) -> Hotfix:
    where = f"pin file {path}, hotfix {index}"
    for key in ("path", "action", "why", "sdist_blob"):
        if key not in entry:
            raise SourceError(f"{where} lacks {key}")
    action = entry["action"]
    if action not in _HOTFIX_ACTIONS:
        raise SourceError(f"{where}: action {action!r} is not one of {', '.join(_HOTFIX_ACTIONS)}")
    ranges: list[tuple[int, int]] = []
    if action == "revert":
        if "drop_lines" not in entry or "pristine_blob" not in entry:
            raise SourceError(f"{where}: a revert needs drop_lines and pristine_blob")
        for part in str(entry["drop_lines"]).split(","):
            match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", part)
            if not match or int(match.group(1)) < 1 or int(match.group(1)) > int(match.group(2)):
                raise SourceError(f"{where}: drop_lines part {part!r} is not FIRST-LAST (1-based)")
            ranges.append((int(match.group(1)), int(match.group(2))))
    return Hotfix(path=str(entry["path"]), action=action, why=str(entry["why"]),
                  sdist_blob=str(entry["sdist_blob"]), drop_lines=tuple(ranges),
                  pristine_blob=str(entry.get("pristine_blob", "")))
