"""The CLI's process entry point: what a command imports, and what run() hands back."""

from __future__ import annotations

import subprocess
import sys


def test_a_cli_command_does_not_import_the_node_server() -> None:
    # Every command parses `serve`'s options; only `serve` needs the server itself (and
    # http.server for its metrics), which would add its import time to every store.
    code = (
        "import sys, coordinator.cli.main; from coordinator.cli.parser import build_parser;"
        " build_parser().parse_args(['ls', '--json']);"
        " print('worker_server.server' in sys.modules, 'worker_server.options' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "True"]


def test_the_entry_point_exits_with_mains_code_and_its_output_arrives_whole() -> None:
    # run() freezes the garbage collector before the exit; the output is still flushed.
    argv = [sys.executable, "-m", "coordinator.cli", "--version"]
    script = subprocess.run(argv, capture_output=True, text=True, check=True)
    assert script.stdout.strip() and script.stdout.endswith("\n")
    bad = subprocess.run([*argv[:3], "no-such-command"], capture_output=True, text=True)
    assert bad.returncode == 2


def test_every_command_dispatches_to_a_function_of_its_module() -> None:
    # A command added to the parser but not to COMMAND_MODULES would fail only when run.
    import importlib

    from coordinator.cli.main import COMMAND_MODULES
    from coordinator.cli.parser import build_parser

    choices = next(a.choices for a in build_parser()._actions if a.dest == "command")
    assert set(choices) - set(COMMAND_MODULES) == {"serve", "demo"}
    for command, module in COMMAND_MODULES.items():
        assert callable(
            getattr(importlib.import_module(f"coordinator.cli.{module}"), f"cmd_{command}")
        )
