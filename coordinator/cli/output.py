"""How the CLI shows things: rich tables for people, --json for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def emit_json(data) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    for row in rows:
        t.add_row(*(str(x) for x in row))
    console.print(t)


def error(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)


def warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {message}", highlight=False)
