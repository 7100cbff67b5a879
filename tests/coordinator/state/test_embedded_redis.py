"""With no SMOLTORRENT_REDIS_URL, smoltorrent runs one redis-server per home and reuses it."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest
import redis


def test_commands_share_one_embedded_redis_with_aof(tmp_path):
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLTORRENT_")}
    env["SMOLTORRENT_HOME"] = str(home)
    seen = []
    try:
        for _ in range(2):
            proc = subprocess.run(
                [sys.executable, "-m", "coordinator.cli", "ls", "--json"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.strip() == "[]"
            seen.append((home / "redis" / "port").read_text())
        assert seen[0] == seen[1]
        port = int(seen[0])
        # Another local user, without the password, gets nothing.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        password_file = home / "redis" / "password"
        assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
        assert stat.S_IMODE((home / "redis").stat().st_mode) == 0o700
        assert stat.S_IMODE((home / "redis" / "redis.conf").stat().st_mode) == 0o600
        client = redis.Redis(port=port, password=password_file.read_text())
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        # The password never shows on the server's command line, where `ps` would list it.
        pid = int((home / "redis" / "redis.pid").read_text())
        cmdline = (home / f"/proc/{pid}/cmdline").read_bytes()
        assert password_file.read_text().encode() not in cmdline
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert client.config_get("dir")["dir"] == str(home / "redis")
        # Both commands found the same server: one pid file, one live process.
        os.kill(pid, 0)
    finally:
        pidfile = home / "redis" / "redis.pid"
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
