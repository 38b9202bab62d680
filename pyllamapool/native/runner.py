"""Runs (or, in a dry run, only prints) the external commands the driver issues."""
from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from rich.console import Console


@dataclass
class Runner:
    dry_run: bool = False
    console: Console = field(default_factory=lambda: Console(stderr=True, highlight=False))

    def show(self, argv: Sequence[str | os.PathLike], cwd: Path | None = None,
             env: Mapping[str, str] | None = None) -> None:
        prefix = f"(cd {shlex.quote(str(cwd))} && " if cwd else ""
        env_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        cmd = " ".join(shlex.quote(str(a)) for a in argv)
        line = f"{prefix}{env_text + ' ' if env_text else ''}{cmd}{')' if cwd else ''}"
        self.console.print(f"[dim]$[/dim] {line}", markup=True, soft_wrap=True)

    def note(self, text: str) -> None:
        self.console.print(f"[dim]#[/dim] {text}", soft_wrap=True)

    def run(self, argv: Sequence[str | os.PathLike], *, cwd: Path | None = None,
            env: Mapping[str, str] | None = None, capture: bool = False,
            check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess[str]:
        """Run argv; `env` holds only the variables added to the current environment."""
        if not quiet or self.dry_run:
            self.show(argv, cwd, env)
        if self.dry_run:
            return subprocess.CompletedProcess(list(map(str, argv)), 0, "", "")
        full_env = {**os.environ, **(env or {})}
        return subprocess.run([str(a) for a in argv], cwd=cwd, env=full_env, text=True,
                              capture_output=capture, check=check)
