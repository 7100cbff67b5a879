"""Hints that sent a cluster user the wrong way (issue 40 item 5), each through the real
CLI or API: a shared Redis down, a node that never answers, a request id unknown."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import smoltorrent
from coordinator.local.cluster import LocalCluster
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.embedded_redis import free_port
from smoltorrent import defaults
from smoltorrent.errors import MetadataError
from tests.coordinator.cli.test_papercuts import clean_env, empty_cluster, run  # noqa: F401


def test_a_shared_redis_down_is_not_fixed_by_unsetting_its_url(tmp_path: Path) -> None:
    """ "unset SMOLTORRENT_REDIS_URL to let smoltorrent run its own" gave a reader an empty
    private Redis: the shared one is to be brought back or reached."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = run("ls", env=clean_env(tmp_path, SMOLTORRENT_REDIS_URL=url))
    assert result.returncode == 1
    assert "unset" not in result.stderr and "cluster's Redis" in result.stderr, result.stderr
    assert not (tmp_path / "home" / "redis").exists()


def test_load_names_the_shared_redis_not_the_embedded_ones_status(tmp_path, monkeypatch):
    monkeypatch.setenv("SMOLTORRENT_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    monkeypatch.setenv("SMOLTORRENT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(defaults, "CLIENT_OUTAGE_S", 0.5)
    with pytest.raises(MetadataError) as caught:
        smoltorrent.load("run/latest.safetensors", staging_dir=tmp_path / "staging")
    assert "redis status" not in str(caught.value), caught.value
    assert "SMOLTORRENT_REDIS_URL" in str(caught.value), caught.value


def test_nodes_add_of_a_host_that_never_answers_names_the_timeout(
    empty_cluster: LocalCluster,  # noqa: F811
) -> None:
    with socket.socket() as silent:  # accepts (the kernel does), never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        result = run("nodes", "add", address, "--timeout", "0.5", env=empty_cluster.env())
    assert result.returncode == 1, result.stderr
    assert "within 0.5 s" in result.stderr and "--timeout" in result.stderr, result.stderr


def test_wait_for_an_unknown_request_says_what_to_do(empty_cluster: LocalCluster) -> None:  # noqa: F811
    result = run("wait", "deadbeef", env=empty_cluster.env())
    assert result.returncode == 1
    assert "smoltorrent ls" in result.stderr and "whole ID" in result.stderr, result.stderr


def test_a_missing_file_and_an_empty_directory_exit_alike(
    tmp_path: Path,
    empty_cluster: LocalCluster,  # noqa: F811
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = run("store", str(tmp_path / "nope.safetensors"), env=empty_cluster.env())
    nothing = run("store", str(empty), env=empty_cluster.env())
    assert missing.returncode == nothing.returncode == 2, (missing.stderr, nothing.stderr)


def test_ls_of_a_directory_checkpoint_lists_its_files(make_cluster, tmp_path: Path) -> None:
    """`store DIR/` then `ls DIR` said "no checkpoint named DIR": a directory is listed by
    its name as by its prefix."""
    c = make_cluster(2)
    run1 = tmp_path / "run1"
    run1.mkdir()
    write_checkpoint(run1 / "model-00001-of-00002.safetensors", 200_000)
    write_checkpoint(run1 / "model-00002-of-00002.safetensors", 300_000)
    c.cli("store", f"{run1}/")
    by_name, by_prefix = c.cli_json("ls", "run1"), c.cli_json("ls", "run1/")
    assert (
        [r["name"] for r in by_name]
        == [r["name"] for r in by_prefix]
        == [
            "run1/model-00001-of-00002.safetensors",
            "run1/model-00002-of-00002.safetensors",
        ]
    )


def test_a_file_of_another_folder_under_the_same_default_name_is_warned(
    make_cluster, tmp_path: Path
) -> None:
    """Two runs' checkpoints/step_100.safetensors became versions of one name without a
    word, so keep-last retention pruned one run for the other: the second store says
    whence the name's versions came and how to keep the runs apart."""
    c = make_cluster(2)
    a, b = tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints"
    for folder, size in ((a, 200_000), (b, 300_000)):
        folder.mkdir(parents=True)
        write_checkpoint(folder / "step_100.safetensors", size)
    first = c.cli("store", str(a / "step_100.safetensors"))
    assert "warning" not in first.stderr
    again = c.cli("store", str(a / "step_100.safetensors"))  # the same file again: no word
    assert "warning" not in again.stderr
    other = c.cli("store", str(b / "step_100.safetensors"))
    said = " ".join(other.stderr.split())
    assert str(a / "step_100.safetensors") in said and "--name" in said, other.stderr
    named = c.cli("store", str(b / "step_100.safetensors"), "--name", "step_100.safetensors")
    assert "warning" not in named.stderr  # named on purpose: no word
