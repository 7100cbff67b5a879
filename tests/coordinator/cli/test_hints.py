"""Hints that sent a cluster user the wrong way (issue 40 item 5), each through the real
CLI or API: a shared Redis down, a node that never answers, a request id unknown."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import smoltorrent
from coordinator.local.cluster import LocalCluster
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
