"""coordinator/config.py: the home directory, read from the environment at each call;
the writer's nice value."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from coordinator import config
from smoltorrent import defaults
from smoltorrent.errors import ConfigError


def test_home_follows_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SMOLTORRENT_HOME", str(tmp_path / "a"))
    assert config.home() == tmp_path / "a"
    monkeypatch.setenv("SMOLTORRENT_HOME", str(tmp_path / "b"))
    assert config.home() == tmp_path / "b"
    assert config.spool_root() == tmp_path / "b" / "spool"
    monkeypatch.setenv("SMOLTORRENT_HOME", "~/elsewhere")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert config.home() == tmp_path / "user" / "elsewhere"
    monkeypatch.delenv("SMOLTORRENT_HOME")
    assert config.home() == tmp_path / "user" / ".smoltorrent"


def test_home_interns_no_new_strings_per_call(monkeypatch, tmp_path) -> None:
    """pathlib interns every part of a path it parses: a part nothing else keeps leaves
    the interned table when the path dies, and comes back at the next parse. A Celery
    pool child calls home() several times per chunk, so 16 GB's chain tasks churned ~400
    interned strings each through the table inherited from the worker, until it doubled
    (1.9 MB private in each child) (bench/RESULTS.md, 2026-11-29 chainmem)."""
    monkeypatch.setenv("SMOLTORRENT_HOME", str(tmp_path / "churn-home"))
    config.home()
    interned: list[str] = []
    real = sys.intern

    def counting(text: str) -> str:
        interned.append(text)
        return real(text)

    monkeypatch.setattr(sys, "intern", counting)
    for _ in range(3):
        config.home()
        config.spool_root()
        config.cluster_key_file()
    assert not [p for p in interned if p == "churn-home"]
    assert config.home() == Path(tmp_path / "churn-home")


def test_writer_nice_is_ten_unless_set_and_refuses_what_is_no_nice_value(monkeypatch) -> None:
    monkeypatch.delenv("SMOLTORRENT_WRITER_NICE", raising=False)
    assert config.writer_nice() == defaults.WRITER_NICE
    monkeypatch.setenv("SMOLTORRENT_WRITER_NICE", "0")
    assert config.writer_nice() == 0
    monkeypatch.setenv("SMOLTORRENT_WRITER_NICE", "19")
    assert config.writer_nice() == 19
    for bad in ("-5", "20", "low"):
        monkeypatch.setenv("SMOLTORRENT_WRITER_NICE", bad)
        with pytest.raises(ConfigError, match="SMOLTORRENT_WRITER_NICE=.* a nice value from 0"):
            config.writer_nice()
