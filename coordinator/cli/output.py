"""How the CLI shows things: rich tables for people, --json for scripts.

Sentences are never hard-wrapped or cut: they soft-wrap (the terminal folds
them, a pipe or a file gets one line each). A table keeps each row on one line
of the terminal, as `docker ps` and `kubectl get` do: its longest cells are
elided ("grpo/run1/chec…"), and on a narrow terminal the columns a table names
as optional are left out (said below it). A table written to a pipe or a file
is plain tab-separated rows, every cell whole; --json has every field.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from functools import cached_property

from smoltorrent import defaults


class _Console:
    """A rich Console made at its first use: a command that writes only JSON never imports
    rich, a tenth of a second of its start."""

    def __init__(self, **options) -> None:
        self._options = options

    @cached_property
    def rich(self):
        from rich.console import Console

        # No markup: names are the user's ("model[step=100].safetensors" would lose its
        # brackets, and "[/]" in one would fail the command). Styles go in style=.
        return Console(soft_wrap=True, markup=False, **self._options)

    def __getattr__(self, name: str):
        return getattr(self.rich, name)


console = _Console()
err_console = _Console(stderr=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def pieces(count: int, chunked: bool) -> str:
    """How many pieces a checkpoint is kept in, in the words of its format: "1 chunk",
    "12 shards" (a chunked version said "in 1 shards")."""
    word = "chunk" if chunked else "shard"
    return f"{count} {word}" + ("" if count == 1 else "s")


def numbers(values: Sequence[int]) -> str:
    """Indexes as runs, "0-5,9,11-12": a batch's chunks in a column that stays short."""
    runs: list[list[int]] = []
    for value in sorted(set(values)):
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def emit_json(data) -> None:
    # One write: json.dump writes every token on its own (700,000 writes, 1.5 s, for an
    # `ls --json` of 10,000 versions). Indented for a person at a terminal only: an indent
    # takes json's pure-Python encoder, 159 ms against 33 ms for those 10,000 rows.
    indent = 2 if sys.stdout.isatty() else None  # not console: rich stays unimported
    sys.stdout.write(json.dumps(data, indent=indent, sort_keys=True, default=str) + "\n")


def table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    optional: Sequence[str] = (),
) -> None:
    """Rows under `columns`. On a terminal each row keeps to one line: the widest cells
    are elided to fit, and where they would keep fewer than CLI_ELIDED_CELL_MIN_COLUMNS
    the `optional` columns are left out, in that order, and a line says which."""
    if not console.is_terminal:
        for row in [columns, *rows]:
            sys.stdout.write("\t".join(str(cell).replace("\t", " ") for cell in row) + "\n")
        return
    if len(rows) > defaults.CLI_DRAWN_TABLE_MAX_ROWS:
        _aligned(title, columns, rows)
        return
    from rich.cells import cell_len
    from rich.table import Table

    cells = [[" ".join(str(x).split()) for x in row] for row in rows]
    natural = {
        c: max([cell_len(c), *(cell_len(row[i]) for row in cells)]) for i, c in enumerate(columns)
    }
    shown = list(columns)
    left_out = []
    cap = _widest_cell(shown, natural)
    for name in optional:
        if cap >= min(defaults.CLI_ELIDED_CELL_MIN_COLUMNS, max(natural.values())):
            break
        shown.remove(name)
        left_out.append(name)
        cap = _widest_cell(shown, natural)
    t = Table(title=title, title_justify="left")
    for c in shown:
        width = max(1, min(natural[c], cap))
        t.add_column(c, no_wrap=True, overflow="ellipsis", min_width=width, max_width=width)
    at = [list(columns).index(c) for c in shown]
    for row in cells:
        t.add_row(*(row[i] for i in at))
    console.print(t, soft_wrap=False)
    if left_out:
        console.print(f"(left out at this width: {', '.join(left_out)}; see --json)")


def _widest_cell(shown: Sequence[str], natural: dict[str, int]) -> int:
    """The most terminal columns a cell may take for `shown` to fit the console on one line
    (a drawn table's borders and padding take 3 columns a column, and 1): the widest cells
    are cut first, short ones keep their width."""
    budget = console.width - (3 * len(shown) + 1)
    widths = sorted(natural[c] for c in shown)
    for i, w in enumerate(widths):
        rest = len(widths) - i  # columns this wide or wider
        if w * rest > budget:
            return max(0, budget // rest)
        budget -= w
    return widths[-1] if widths else 0


def _aligned(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A long table as plain columns, each as wide as its widest cell (the terminal folds
    a line too long for it): the same content as the drawn table, written at once."""
    from rich.cells import cell_len

    def width(cell: str) -> int:  # terminal columns: a CJK character takes two
        return len(cell) if cell.isascii() else cell_len(cell)

    lines = [[" ".join(str(cell).split()) for cell in row] for row in [columns, *rows]]
    widths = [max(width(line[i]) for line in lines) for i in range(len(columns))]
    text = [
        "  ".join(
            cell + " " * (w - width(cell)) for cell, w in zip(line, widths, strict=True)
        ).rstrip()
        for line in lines
    ]
    console.print(title, style="italic")
    console.print(text[0], style="bold")
    console.file.write("\n".join(text[1:]) + "\n")


def error(message: str, hint: str | None = None, *, as_json: bool = False) -> None:
    """An error for a person (stderr) or, under --json, for a script (stdout)."""
    if as_json:
        json.dump({"error": message, "hint": hint}, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
    else:
        _tagged("error: ", "bold red", message)


def warn(message: str) -> None:
    _tagged("warning: ", "yellow", message)


def _tagged(tag: str, style: str, message: str) -> None:
    if err_console.is_terminal:
        from rich.text import Text

        err_console.print(Text.assemble((tag, style), message))
    else:
        sys.stderr.write(f"{tag}{message}\n")
