"""Consoles whose tables survive a pipe."""
from __future__ import annotations

import sys

from rich.console import Console

#: columns a table may take when the output is not a terminal (no table here comes close)
PIPE_WIDTH = 400


def table_console(stderr: bool = False) -> Console:
    """A console for tables: a terminal's own width; elsewhere (a pipe, a log, CI) wide enough that
    no table is cut, where rich would wrap and truncate every table at 80 columns (or at a COLUMNS
    inherited from the shell that started the pipeline)."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, highlight=False, width=None if stream.isatty() else PIPE_WIDTH)


def wide(console: Console, columns: int) -> Console:
    """`console`, or one at least `columns` wide where a terminal is narrower than a table that must
    keep every cell (the terminal wraps its lines; nothing is cut)."""
    if console.width >= columns:
        return console
    return Console(file=console.file, highlight=False, width=columns)
