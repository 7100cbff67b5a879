"""With no SMOLTORRENT_REDIS_URL, smoltorrent runs one redis-server per home and reuses it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import redis

from coordinator.state.embedded_redis import password


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


def _env(home) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLTORRENT_")}
    env["SMOLTORRENT_HOME"] = str(home)
    return env


def _redis_servers_in(directory) -> list[int]:
    """PIDs of redis-server processes working in `directory` (a daemonized one chdirs there)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            exe = os.path.basename(os.readlink(f"/proc/{entry}/exe"))
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if exe.startswith("redis-server") and cwd == str(directory):
            pids.append(int(entry))
    return pids


def _stop_all(directory) -> None:
    for pid in _redis_servers_in(directory):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


START_AT_SLACK_S = 2.0  # seconds until both processes call at once: covers interpreter start


def test_two_processes_starting_at_once_start_one_server(tmp_path):
    home = tmp_path / "home"
    start_at = time.time() + START_AT_SLACK_S
    code = (
        "import time, sys\n"
        "from coordinator.state.embedded_redis import ensure_redis_url\n"
        f"time.sleep(max(0, {start_at} - time.time()))\n"
        "print(ensure_redis_url())\n"
    )
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=_env(home),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        urls = {out.strip() for out, _ in outs}
        assert len(urls) == 1, outs
        assert len(_redis_servers_in(home / "redis")) == 1
        # Exactly one of them started it, and said so on stderr.
        assert sum("started its own redis-server" in err for _, err in outs) == 1, outs
    finally:
        _stop_all(home / "redis")


def _cli(home, *argv):
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *argv],
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_redis_status_stop_and_restart_on_the_same_port(tmp_path):
    home = tmp_path / "home"
    try:
        status = _cli(home, "redis", "status", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["running"] is False
        first = _cli(home, "ls", "--json")
        assert first.returncode == 0 and "started its own redis-server" in first.stderr
        port = (home / "redis" / "port").read_text()
        client = redis.Redis(port=int(port), password=password(home / "redis"))
        client.set("kept", "yes")
        status = json.loads(_cli(home, "redis", "status", "--json").stdout)
        assert status["running"] is True and status["port"] == int(port)
        assert status["pid"] in _redis_servers_in(home / "redis")
        stopped = _cli(home, "redis", "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert _redis_servers_in(home / "redis") == []
        again = _cli(home, "ls", "--json")
        assert again.returncode == 0 and "started its own redis-server" in again.stderr
        assert (home / "redis" / "port").read_text() == port  # workers find it where it was
        assert client.get("kept") == b"yes"  # the AOF kept the data
        quiet = _cli(home, "ls", "--json")
        assert "started" not in quiet.stderr  # a running server is reused silently
    finally:
        _stop_all(home / "redis")


def test_redis_stop_refuses_a_redis_it_did_not_start(tmp_path):
    env = {**_env(tmp_path / "home"), "SMOLTORRENT_REDIS_URL": "redis://127.0.0.1:1/0"}
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "redis", "stop"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "did not start" in proc.stderr


def test_a_redis_password_never_shows_in_what_a_command_prints(tmp_path):
    """Errors and status lines get pasted into bug reports and land in logs: a Redis URL's
    password is shown masked, as Celery's banner shows it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLTORRENT_")}
    env["SMOLTORRENT_HOME"] = str(tmp_path / "home")
    closed = 1  # nothing listens on port 1
    runs = {
        "unreachable": (f"redis://:s3cret@127.0.0.1:{closed}/0", ["ls"]),
        "status": (f"redis://user:s3cret@127.0.0.1:{closed}/0", ["redis", "status"]),
        "status json": (f"redis://:s3cret@127.0.0.1:{closed}/0", ["redis", "status", "--json"]),
        "not redis": ("http://user:s3cret@127.0.0.1:6379/0", ["ls"]),
    }
    for what, (url, argv) in runs.items():
        proc = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", *argv],
            env={**env, "SMOLTORRENT_REDIS_URL": url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        shown = proc.stdout + proc.stderr
        assert "s3cret" not in shown, (what, shown)
        assert f"127.0.0.1:{closed}" in shown or "6379" in shown, (what, shown)
