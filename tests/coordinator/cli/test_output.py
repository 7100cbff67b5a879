"""How the CLI writes to a terminal (a real rich Console forced into terminal mode, into
a buffer): names exactly as stored, and long tables fast as plain columns."""

from __future__ import annotations

import io
import os
import re
import sys
import time

import pytest
from rich.cells import cell_len

from coordinator.cli import output
from coordinator.local.synthetic import write_checkpoint
from smoltorrent import defaults
from tests.tasks.test_progress import run_on_a_terminal

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def terminal(monkeypatch):
    """The CLI's console as a 120-column terminal; what it showed, without colours."""
    buf = io.StringIO()
    monkeypatch.setattr(
        output, "console", output._Console(file=buf, force_terminal=True, width=120)
    )
    return lambda: ANSI.sub("", buf.getvalue())


NAMES = ["model[step=100].safetensors", "exp[/]/model.safetensors", "[bold]x[/bold]"]


def test_names_with_brackets_print_as_they_are(terminal):
    """rich reads "[...]" as markup: "model[step=100].safetensors" came out as
    "model.safetensors", and a name with "[/]" made `ls` fail with a MarkupError."""
    output.table("runs[/]", ["name", "version"], [(name, "abc") for name in NAMES])
    for name in NAMES:
        output.console.print(f"stored {name}")
    shown = terminal()
    assert "runs[/]" in shown
    for name in NAMES:
        assert name in shown
        assert f"stored {name}" in shown


def test_a_long_table_is_written_as_aligned_columns(terminal):
    count = defaults.CLI_DRAWN_TABLE_MAX_ROWS + 1
    rows = [(f"run{i}/model[1].safetensors", f"{i:012x}", "1.2 GB") for i in range(count)]
    rows[7] = ("実験/モデル.safetensors", rows[7][1], rows[7][2])  # two columns a character
    output.table("checkpoints", ["name", "version", "size"], rows)
    title, header, *lines = terminal().splitlines()
    assert title == "checkpoints" and header.split() == ["name", "version", "size"]
    assert len(lines) == count
    at = cell_len(header[: header.index("version")])
    for (name, version, size), line in zip(rows, lines, strict=True):
        assert line.startswith(name) and set_at(line, at).split("  ")[0] == version
        assert line.endswith(size)


def set_at(line: str, column: int) -> str:
    """What `line` shows from terminal column `column` on."""
    for i in range(len(line) + 1):
        if cell_len(line[:i]) >= column:
            return line[i:]
    return ""


def test_a_short_table_is_drawn(terminal):
    output.table("nodes", ["node", "state"], [("a", "up"), ("b", "down")])
    shown = terminal()
    assert "┃" in shown or "│" in shown  # rich's box, not plain columns


def test_a_bracketed_name_is_stored_listed_and_gathered_on_a_terminal(make_cluster, tmp_path):
    """The same through the real commands on a pseudo-terminal (bars, tables and summary
    lines all drawn by rich): each exits 0 and shows the name as it was given."""
    c = make_cluster(2)
    src = tmp_path / "m.safetensors"
    write_checkpoint(src, 2_000_000, hidden=64)
    os.utime(src, (time.time() - 60, time.time() - 60))
    name = "run[/]/model[step=100].safetensors"
    cli = [sys.executable, "-m", "coordinator.cli"]
    screen = run_on_a_terminal([*cli, "store", str(src), "--name", name], c.env())
    assert f"stored: {name} version" in screen
    assert name in run_on_a_terminal([*cli, "ls"], c.env())
    out = tmp_path / "out.safetensors"
    screen = run_on_a_terminal([*cli, "gather", name, "-o", str(out)], c.env())
    assert f"gathered {name} version" in screen
    assert out.read_bytes() == src.read_bytes()


def test_indexes_read_as_runs() -> None:
    assert output.numbers([5, 0, 1, 2, 9, 11, 12, 1]) == "0-2,5,9,11-12"
    assert output.numbers([7]) == "7"
    assert output.numbers([]) == ""


@pytest.fixture
def narrow(monkeypatch):
    """The CLI's console as an 80-column terminal (COLUMNS=80); what it showed."""
    buf = io.StringIO()
    monkeypatch.setattr(output, "console", output._Console(file=buf, force_terminal=True, width=80))
    return lambda: ANSI.sub("", buf.getvalue())


LS_COLUMNS = ["name", "version", "state", "tensors", "size", "chunks", "copies", "kept", "created"]


def test_a_table_at_80_columns_keeps_each_row_on_one_line(narrow):
    """Every cell folded at 80 columns ("versio|n", a name over 5 lines): now the longest
    cells are elided and short ones kept whole, and a column of less use is left out, said."""
    long = "grpo/run1/checkpoints/step_100000.safetensors"
    rows = [
        (long, "0123456789ab *", "committed", 291, "503.2 MB", 30, "2/2", "pinned,@best",
         "2026-12-05 23:12:01"),
        ("a.safetensors", "ba9876543210", "pending", 3, "1.2 kB", 1, "0/2", "",
         "2026-12-05 23:12:02"),
    ]  # fmt: skip
    output.table("checkpoints", LS_COLUMNS, rows, optional=["tensors", "chunks", "created", "kept"])
    lines = narrow().splitlines()
    assert all(cell_len(line) <= 80 for line in lines), lines
    (row,) = [line for line in lines if "grpo/" in line]
    assert "…" in row and long not in row  # elided, on its one line
    assert "0123456789ab *" in row and "committed" in row and "503.2 MB" in row
    assert "a.safetensors" in narrow() and "┃ version " in lines[2]  # not "versio|n"
    assert lines[-1].startswith("(left out at this width: tensors, chunks, created, kept;")
    assert sum("│" in line for line in lines) == 2  # a row is one line


def test_a_table_that_fits_is_drawn_whole(narrow):
    output.table("nodes", ["node", "state"], [("a", "up"), ("b", "down")], optional=["state"])
    shown = narrow()
    assert "…" not in shown and "left out" not in shown and "down" in shown
