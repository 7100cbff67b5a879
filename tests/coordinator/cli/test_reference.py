"""docs/cli.md names every flag of every command, and every flag explains itself in
--help: the page and the parser are checked against each other, not kept by memory."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from coordinator.cli.parser import build_parser

CLI_MD = Path(__file__).resolve().parents[3] / "docs" / "cli.md"
# Flags every listing takes, as the page says once at its top.
SAID_ONCE = {"--help", "--json"}


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, its parser) for every command and subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))
            return
    yield path, parser


def rows() -> list[str]:
    return [line for line in CLI_MD.read_text().splitlines() if line.startswith("| `")]


def row_of(path: tuple[str, ...]) -> str | None:
    command = " ".join(path)
    pattern = re.compile(rf"`{re.escape(command)}(?=[ `])")
    first_cells = [row for row in rows() if pattern.search(row.split(" | ")[0])]
    return first_cells[0] if first_cells else None


def test_every_command_has_a_row_that_names_each_of_its_flags():
    missing = []
    for path, parser in commands(build_parser()):
        row = row_of(path)
        if row is None:
            missing.append(f"{' '.join(path)}: no row")
            continue
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag not in SAID_ONCE and flag not in row:
                    missing.append(f"{' '.join(path)} {flag}")
    assert not missing, f"docs/cli.md does not name: {missing}"


def test_every_flag_has_help_text():
    silent = [
        f"{' '.join(path)} {action.option_strings[0]}"
        for path, parser in commands(build_parser())
        for action in parser._actions
        if action.option_strings and not action.help
    ]
    assert not silent, f"flags with no help text: {silent}"
