"""`smoltorrent init` and the cluster key file (issue 24, a cluster across machines):
the key made once as a file, read by `serve --key-file`, SMOLTORRENT_CLUSTER_KEY_FILE
and the coordinator side, through real CLI and node processes."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

from coordinator.dataplane.node_client import NodeAddress, NodeClient
from smoltorrent.errors import SmoltorrentError

TIMEOUT_S = 60.0  # seconds for one CLI run on a loaded box


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLTORRENT_")}
    env["SMOLTORRENT_HOME"] = str(home)
    env.update(extra)
    return env


def run(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )


def test_init_makes_a_private_key_file_once_and_says_what_to_run_where(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = clean_env(home)
    first = run("init", env=env)
    assert first.returncode == 0, first.stderr
    key_file = home / "cluster.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    out = first.stdout
    # What to run on a node, and on every other training or reading machine.
    assert f"< {key_file}" in out  # the copy to each machine, from this file
    assert "smoltorrent serve --key-file ~/.smoltorrent/cluster.key" in out
    assert "--data-dir" in out
    assert "smoltorrent nodes add" in out and "smoltorrent worker" in out
    assert "smoltorrent gather" in out and "SMOLTORRENT_REDIS_URL" in out
    assert key not in out  # the secret itself is never printed (terminal scrollback, logs)

    again = run("init", env=env)
    assert again.returncode == 2
    assert "--force" in again.stderr and "Traceback" not in again.stderr
    assert key_file.read_text().strip() == key  # untouched

    forced = run("init", "--force", env=env)
    assert forced.returncode == 0, forced.stderr
    assert key_file.read_text().strip() != key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_a_node_and_the_cli_share_the_key_through_files(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert run("init", env=clean_env(home)).returncode == 0
    key_file = home / "cluster.key"
    key = key_file.read_text().strip().encode()

    # A node reads the key from --key-file (beyond loopback: it has a key now).
    data = tmp_path / "node"
    node = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "serve", "--data-dir", str(data)]
        + ["--key-file", str(key_file), "--host", "0.0.0.0", "--port", "0", "--no-mdns"],
        env=clean_env(tmp_path / "nodehome"),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert node.stderr is not None
        for line in node.stderr:
            assert "error" not in line.lower(), line
            if "listening on" in line:
                assert "listening on 0.0.0.0:" in line
                break
        port = int((data / "port").read_text())
        address = NodeAddress("127.0.0.1", port)
        assert NodeClient(address, cluster_key=key).ping()
        try:
            NodeClient(address, cluster_key=b"not the key").ping()
            raise AssertionError("the node accepted a wrong key")
        except SmoltorrentError as exc:
            assert "key" in str(exc)

        # The coordinator side finds the key in its home without being told.
        redis_env = clean_env(home)
        added = run("nodes", "add", f"127.0.0.1:{port}", "--json", env=redis_env)
        assert added.returncode == 0, added.stdout + added.stderr
        # The key file elsewhere, named by SMOLTORRENT_CLUSTER_KEY_FILE.
        moved = tmp_path / "elsewhere.key"
        key_file.rename(moved)
        named = clean_env(home, SMOLTORRENT_CLUSTER_KEY_FILE=str(moved))
        listed = run("nodes", "ls", "--json", env=named)
        assert listed.returncode == 0 and '"up": true' in listed.stdout, listed.stdout
        # With no key at all, the same node refuses the CLI, which says how to set the key.
        refused = run("nodes", "add", f"127.0.0.1:{port}", env=redis_env)
        assert refused.returncode != 0
        assert "SMOLTORRENT_CLUSTER_KEY_FILE" in refused.stderr, refused.stderr
    finally:
        node.terminate()
        node.wait(TIMEOUT_S)
        run("redis", "stop", env=clean_env(home))


def test_a_node_reads_the_key_file_named_in_its_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "cluster.key"
    key_file.write_text("a-key-from-a-file\n")
    key_file.chmod(0o600)
    data = tmp_path / "node"
    env = clean_env(tmp_path / "home", SMOLTORRENT_CLUSTER_KEY_FILE=str(key_file))
    node = subprocess.Popen(
        [sys.executable, "-m", "worker_server", "--data-dir", str(data)]
        + ["--host", "0.0.0.0", "--port", "0", "--no-mdns"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert node.stderr is not None
        for line in node.stderr:
            if "listening on" in line:
                break
        port = int((data / "port").read_text())
        assert NodeClient(NodeAddress("127.0.0.1", port), cluster_key=b"a-key-from-a-file").ping()
    finally:
        node.terminate()
        node.wait(TIMEOUT_S)

    missing = clean_env(tmp_path / "home", SMOLTORRENT_CLUSTER_KEY_FILE=str(tmp_path / "nope"))
    result = subprocess.run(
        [sys.executable, "-m", "worker_server", "--data-dir", str(data), "--port", "0"],
        env=missing,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 2
    assert str(tmp_path / "nope") in result.stderr and "Traceback" not in result.stderr


def test_a_keyless_node_refused_beyond_loopback_says_how_to_set_the_key(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "serve", "--data-dir", str(tmp_path / "d")]
        + ["--host", "0.0.0.0"],
        env=clean_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 2
    assert "smoltorrent init" in result.stderr and "--key-file" in result.stderr

    helped = run("--help", env=clean_env(tmp_path / "home"))
    recipe = helped.stdout[helped.stdout.index("across machines") :]
    assert "smoltorrent init" in recipe
    assert "smoltorrent serve --key-file" in recipe
