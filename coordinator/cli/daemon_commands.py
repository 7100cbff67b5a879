"""The commands that run until stopped, beside `serve` (worker_server/options.py) and
`worker` and `beat` (services.py): `watch`, `up`, `flower`, and `demo`, a whole local
cluster for one run."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import threading

from coordinator.cli.cluster import metadata
from coordinator.cli.output import console, emit_json, table
from smoltorrent import defaults
from smoltorrent.errors import SmoltorrentError, UsageError

FLOWER_LOGINS = ("--basic-auth", "--auth")  # Flower's options that require a login
FLOWER_LOGIN_ENV = ("FLOWER_BASIC_AUTH", "FLOWER_AUTH")


def cmd_flower(args: argparse.Namespace) -> int:
    extra = args.flower_options[1:] if args.flower_options[:1] == ["--"] else args.flower_options
    login = any(o.split("=")[0] in FLOWER_LOGINS for o in extra) or any(
        os.environ.get(name) for name in FLOWER_LOGIN_ENV
    )
    address = _last_address(extra, args.address)  # Flower takes the last one it is given
    if not (login or args.insecure or _loopback(address)):
        raise UsageError(
            f"refusing to run Flower on {address} with no login: anyone who reaches it"
            " could see every task and revoke them. Give it one after `--`: `smoltorrent"
            f" flower --address {address} -- --basic-auth=USER:PASS` (or --auth=... for"
            " OAuth; or set FLOWER_BASIC_AUTH), or pass --insecure if a proxy in front already"
            " asks for one"
        )
    from tasks.app import REDIS_URL

    env = dict(os.environ, SMOLTORRENT_REDIS_URL=REDIS_URL)
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tasks.app",
        "flower",
        f"--port={args.port}",
        f"--address={args.address}",
        f"--tasks-columns={defaults.FLOWER_TASKS_COLUMNS}",
        *extra,  # after ours: Flower takes the last value given
    ]
    sys.stdout.flush()
    sys.stderr.flush()
    # Become Flower rather than wait on it: a SIGTERM or SIGKILL sent to this command
    # then reaches Flower itself, and nothing is left behind listening on the port.
    os.execve(sys.executable, command, env)


def _last_address(options: list[str], default: str) -> str:
    """The address Flower will listen on: the last `--address=X` or `--address X` among
    the options passed through to it, else ours."""
    address = default
    for i, option in enumerate(options):
        if option.startswith("--address="):
            address = option.split("=", 1)[1]
        elif option == "--address" and i + 1 < len(options):
            address = options[i + 1]
    return address


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def cmd_demo(args: argparse.Namespace, run_command) -> int:
    from coordinator.local.demo import run_demo

    report = run_demo(
        run_command,
        checkpoint=args.checkpoint,
        size_mb=args.size_mb,
        keep=args.keep,
        quiet=args.json,
        say=(lambda _: None) if args.json else console.print,
    )
    if args.json:
        emit_json(report)
    else:
        table(
            "demo report",
            ["step", "seconds"],
            [(k, f"{v:.2f}") for k, v in report["seconds"].items()],
        )
        console.print(
            f"store {report['store_mb_s']} MB/s, gather (one node dead) "
            f"{report['gather_mb_s']} MB/s"
        )
        if report["byte_identical"]:
            console.print(
                "SHA-256 identical: the gathered file is the stored checkpoint, byte for byte.",
                style="bold green",
            )
        else:
            console.print("SHA-256 differs!", style="bold red")
    return 0 if report["byte_identical"] else 1


def cmd_up(args: argparse.Namespace) -> int:
    from coordinator.local.stack import Stack, run_up

    if args.watch and not os.path.isdir(args.watch):
        raise UsageError(f"--watch {args.watch}: no such directory")
    stack = Stack(
        nodes=args.nodes,
        watch=os.path.abspath(args.watch) if args.watch else None,
        name_prefix=args.name_prefix,
        flower_port=args.flower_port if args.flower else None,
        metrics=args.metrics,
        metrics_host=args.metrics_host,
        say=lambda line: console.print(f"up: {line}", highlight=False),
    )
    return run_up(stack)


def _store_watched_directory(path: str, name: str, replicas: int) -> None:
    import logging

    from tasks.directory_requests import store_directory

    log = logging.getLogger("smoltorrent.watch")
    with _watched_directory_lock(name):  # one store of a directory at a time, in order
        try:
            stored = store_directory(path, name, replicas)
        except SmoltorrentError as exc:
            log.warning(
                "storing %s as %s failed: %s; it is tried again when it changes", path, name, exc
            )
            return
    log.info(
        "event=stored-directory name=%s version=%s new_files=%d",
        name,
        stored.version.version_id,
        len(stored.new_files),
    )


_watched_directory_locks: dict[str, threading.Lock] = {}


def _watched_directory_lock(name: str) -> threading.Lock:
    return _watched_directory_locks.setdefault(name, threading.Lock())


def cmd_watch(args: argparse.Namespace) -> int:
    import logging
    import signal

    import redis
    from kombu.exceptions import OperationalError

    from coordinator.watcher import Watcher, stored_identities_from
    from smoltorrent.errors import MetadataError
    from tasks.requests import submit_store

    if args.replicas < 1:
        raise SmoltorrentError("--replicas must be at least 1")
    # Refused at start: a mistyped directory would otherwise be waited for ("is gone"), and
    # a file would be watched as if it were one. A directory that goes away later is waited
    # for (a run's directory replaced, a disk remounted).
    where = os.path.abspath(args.directory)
    if os.path.isfile(where):
        raise SmoltorrentError(
            f"{where} is a file: watch the directory it is written in"
            f" (`smoltorrent watch {os.path.dirname(where)}`), or store it with"
            " `smoltorrent store`"
        )
    if not os.path.isdir(where):
        raise SmoltorrentError(f"watch {where}: no such directory; create it first")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    md = metadata()

    def submit(path: str, name: str) -> str:
        try:
            return submit_store(path, name, args.replicas).task_id
        except (redis.RedisError, OperationalError) as exc:
            raise MetadataError(
                f"Redis is not answering ({exc}); {name} stays pending and is tried again."
            ) from exc

    def identities(name: str):
        try:
            return stored_identities_from(md)(name)
        except redis.RedisError as exc:
            raise MetadataError(f"Redis is not answering ({exc})") from exc

    def submit_directory(path: str, name: str) -> None:
        # A directory version is recorded once every file is committed: wait for that on
        # a thread of its own so the watcher goes on looking at other files meanwhile.
        threading.Thread(
            target=_store_watched_directory, args=(path, name, args.replicas), daemon=True
        ).start()

    watcher = Watcher(
        args.directory,
        submit,
        name_prefix=args.name_prefix,
        stored_identities=identities,
        submit_directory=submit_directory,
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: watcher.stop())
    watcher.run()
    return 0
