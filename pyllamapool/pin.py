"""The pin: which upstream llama.cpp tree the patch series applies to, and how to get it."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import paths
from .errors import SourceError


@dataclass(frozen=True)
class Pin:
    upstream: str
    commit: str
    sdist_package: str
    sdist_version: str
    sdist_sha256: str
    sdist_subdir: str

    @property
    def short_commit(self) -> str:
        return self.commit[:9]

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
        fields = cls.__dataclass_fields__
        missing = [name for name in fields if name not in data]
        if missing:
            raise SourceError(f"pin file {path} lacks {', '.join(missing)}")
        return cls(**{name: str(data[name]) for name in fields})
