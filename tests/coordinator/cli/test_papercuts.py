"""The first-hour papercuts of issue 11, each run through the real CLI as a subprocess.

Output goes to pipes here, as in a script: no terminal, so no wrapping and no tables
drawn with box characters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.local.cluster import LocalCluster
from coordinator.local.synthetic import write_checkpoint
from smoltorrent import __version__

TIMEOUT_S = 120.0  # seconds for one CLI run on a loaded box


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *argv],
        stdin=subprocess.DEVNULL,  # as in a script, even when the tests run on a terminal
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLTORRENT_")}
    env["SMOLTORRENT_HOME"] = str(tmp_path / "home")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def empty_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A Redis with no nodes and no worker."""
    cluster = LocalCluster(tmp_path_factory.mktemp("empty"), nodes=0)
    cluster.start(worker=False)
    yield cluster
    cluster.stop()


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"smoltorrent {__version__}"


def test_redis_url_without_scheme_is_one_line_exit_2_never_wrapped(tmp_path: Path) -> None:
    url = "127.0.0.1:6379" + "/0" * 40  # long, so a hard wrap at 80 columns would show
    result = run("ls", env=clean_env(tmp_path, SMOLTORRENT_REDIS_URL=url))
    assert result.returncode == 2
    line = one_line_error(result)
    assert len(line) > 120 and "redis://" in line and url in line


def test_transfer_retries_not_a_number_is_one_line_exit_2(tmp_path: Path) -> None:
    result = run("worker", env=clean_env(tmp_path, SMOLTORRENT_TRANSFER_RETRIES="six"))
    assert result.returncode == 2
    assert "SMOLTORRENT_TRANSFER_RETRIES='six'" in one_line_error(result)


def test_serve_port_out_of_range_is_exit_2(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "node_id").write_text("0" * 32)
    result = run("serve", "--data-dir", str(data), "--port", "99999")
    assert result.returncode == 2
    assert "'99999' is not a TCP port" in result.stderr
    assert "Traceback" not in result.stderr


def test_usage_errors_exit_2(tmp_path: Path, empty_cluster: LocalCluster) -> None:
    replicas = run("store", str(tmp_path / "x.safetensors"), "--replicas", "0")
    assert replicas.returncode == 2 and "'0' is not a whole number >= 1" in replicas.stderr
    replay = run("dlq", "replay", env=empty_cluster.env())
    assert replay.returncode == 2
    assert "task id or --all" in one_line_error(replay)


def test_errors_under_json_are_json(tmp_path: Path, empty_cluster: LocalCluster) -> None:
    bad_url = run("ls", "--json", env=clean_env(tmp_path, SMOLTORRENT_REDIS_URL="nope"))
    assert bad_url.returncode == 2
    answer = json.loads(bad_url.stdout)
    assert "redis://" in answer["error"] and answer["hint"]
    usage = run("store", "x", "--replicas", "0", "--json")
    assert usage.returncode == 2 and "whole number" in json.loads(usage.stdout)["error"]
    missing = run("nodes", "rm", "nosuchnode", "--json", env=empty_cluster.env())
    assert missing.returncode == 1 and "nodes ls" in json.loads(missing.stdout)["error"]
    replay = run("dlq", "replay", "--json", env=empty_cluster.env())
    assert replay.returncode == 2 and "--all" in json.loads(replay.stdout)["error"]
    replayed = run("dlq", "replay", "--all", "--json", env=empty_cluster.env())
    assert replayed.returncode == 0 and json.loads(replayed.stdout) == {"replayed": []}


def test_nodes_add_takes_the_default_port(empty_cluster: LocalCluster) -> None:
    result = run("nodes", "add", "127.0.0.1", env=empty_cluster.env())
    # Nothing listens on 7411 here: the error names the address with the default port,
    # which shows the bare host was accepted rather than refused as malformed.
    assert "127.0.0.1:7411" in result.stderr + result.stdout
    assert "is not a node address" not in result.stderr


def test_store_of_a_directory_says_so(tmp_path: Path, empty_cluster: LocalCluster) -> None:
    result = run("store", str(tmp_path), env=empty_cluster.env())
    assert result.returncode == 2
    assert "is a directory" in one_line_error(result)


def test_status_on_an_empty_cluster_says_what_to_do_first(empty_cluster: LocalCluster) -> None:
    result = run("status", env=empty_cluster.env())
    assert result.returncode == 0
    assert "no storage nodes registered yet" in result.stdout
    assert "smoltorrent nodes add" in result.stdout
    assert "healthy" not in result.stdout and "all its live copies" not in result.stdout


def test_ls_in_a_pipe_is_tab_separated_and_cuts_nothing(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", nodes=2)
    try:
        cluster.start()
        run("nodes", "add", *(str(n.address) for n in cluster.node_procs), env=cluster.env())
        src = tmp_path / "src.safetensors"
        write_checkpoint(src, 300_000, hidden=32)
        past = time.time() - 60  # settled: the store does not wait for the file to settle
        os.utime(src, (past, past))
        name = "grpo/a-rather-long-run-name-that-would-not-fit/step_000100.safetensors"
        stored = run("store", str(src), "--name", name, "--replicas", "1", env=cluster.env())
        assert stored.returncode == 0, stored.stderr
        listing = run("ls", env=cluster.env())
        assert listing.returncode == 0, listing.stderr
        header, row = listing.stdout.splitlines()[:2]
        assert header.split("\t")[:2] == ["name", "version"]
        cells = row.split("\t")
        assert cells[0] == name and header.split("\t")[2] == "current" and cells[2] == "*"
        version = json.loads(run("ls", "--json", env=cluster.env()).stdout)[0]["version_id"]
        assert version.startswith(cells[1]) and len(cells[1]) >= 12
        assert "…" not in listing.stdout and "\n " not in listing.stdout
        created = cells[-1]
        assert len(created.split()) == 2  # date and time on one line
    finally:
        cluster.stop()


def test_a_name_with_control_characters_is_refused(tmp_path: Path, empty_cluster: LocalCluster):
    """A newline or a tab in a name would split or shift its row in `ls` (a pipe gets one
    line per version, cells split by tabs) and in every log line naming it."""
    src = tmp_path / "m.safetensors"
    write_checkpoint(src, 100_000, hidden=16)
    for name in ("a\nb.safetensors", "tab\there.safetensors", "bell\x07.safetensors"):
        result = run("store", str(src), "--name", name, env=empty_cluster.env())
        assert result.returncode == 2, result.stderr
        assert f"{name!r} holds a control character" in one_line_error(result)


def test_a_rebuild_that_reads_no_node_fails(empty_cluster: LocalCluster):
    """After losing Redis, a rebuild given only wrong addresses rebuilt nothing and exited 0:
    a script would go on as if the metadata were back."""
    result = run("rebuild", "127.0.0.1:1", env=empty_cluster.env())
    assert result.returncode == 1
    assert "not read: 127.0.0.1:1" in result.stderr and "nothing was rebuilt" in result.stderr
    answer = run("rebuild", "127.0.0.1:1", "--json", env=empty_cluster.env())
    assert answer.returncode == 1 and json.loads(answer.stdout)["nodes_read"] == 0


def test_dlq_ls_in_a_pipe_shows_each_error_whole(empty_cluster: LocalCluster):
    from coordinator.state.metadata import Metadata

    error = "NodeUnavailableError: cannot reach node 10.0.0.7:7411 (timed out): " + "x" * 150
    md = Metadata(empty_cluster.redis_url)
    md.dead_letters.add_dead_letter(
        "transfer-long-0-1", {"task": "smoltorrent.transfer", "error": error}
    )
    try:
        result = run("dlq", "ls", env=empty_cluster.env())
        assert result.returncode == 0 and error in result.stdout
    finally:
        md.dead_letters.remove_dead_letter("transfer-long-0-1")


def test_commands_that_only_read_redis_never_import_celery(empty_cluster: LocalCluster):
    """Celery's imports are a tenth of a second of a command's start: ls, status, nodes ls
    and dlq ls read Redis (and probe nodes), and send no task."""
    for argv in (["ls"], ["status"], ["nodes", "ls"], ["dlq", "ls"]):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "coordinator.cli", *argv, "--json"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=empty_cluster.env(),
        )
        assert result.returncode == 0, result.stderr[-2000:]
        imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()}
        assert "celery" not in imported, argv


def test_a_store_of_a_missing_file_starts_nothing(tmp_path: Path):
    """A typo in the path is said at once; it used to start the embedded Redis first."""
    env = clean_env(tmp_path)
    result = run("store", str(tmp_path / "nope.safetensors"), env=env)
    assert result.returncode == 2  # as an empty directory's (it was 1, that one's 2)
    assert "nope.safetensors: no such file" in one_line_error(result)
    assert not (tmp_path / "home" / "redis").exists()


def test_a_malformed_node_address_is_a_usage_error_before_any_node_is_added(
    empty_cluster: LocalCluster,
):
    result = run("nodes", "add", "127.0.0.1:1", "notaport:xyz", env=empty_cluster.env())
    assert result.returncode == 2
    error = one_line_error(result)
    assert "'notaport:xyz' is not a node address" in error and "127.0.0.1:1" not in error
    assert run("rebuild", "host:99999", env=empty_cluster.env()).returncode == 2


def test_the_help_recipe_sets_the_key_a_node_needs_beyond_loopback(tmp_path: Path) -> None:
    """`--help`'s cross-machine recipe ran `serve` with no key, so the node listened on
    loopback only and `nodes add pi1:7411` was refused; the recipe now sets the key first,
    and a node refusing a non-loopback bind says how to make and set one."""
    recipe = run("--help").stdout.split("A real cluster")[1].split("Environment:")[0]
    lines = recipe.splitlines()
    key_line = next(i for i, line in enumerate(lines) if "smoltorrent init" in line)
    serve_line = next(i for i, line in enumerate(lines) if "smoltorrent serve --key-file" in line)
    assert key_line < serve_line, recipe
    refused = run(
        "serve",
        "--data-dir",
        str(tmp_path / "n"),
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        env=clean_env(tmp_path),
    )
    assert refused.returncode == 2
    assert "smoltorrent init" in refused.stderr
    assert "--key-file" in refused.stderr
