"""What must run on CI does not skip there: with its SMOLTORRENT_REQUIRE_* set (.ci/run),
a test that cannot make its tmpfs or its network namespaces fails instead."""

from __future__ import annotations

import pytest

from coordinator.local import netns
from tests.conftest import REQUIRE_FIU_ENV, REQUIRE_NETNS_ENV, require_network_namespaces


def test_link_cut_tests_fail_where_namespaces_are_required_and_cannot_be_made(monkeypatch):
    monkeypatch.setattr(netns, "unavailable", lambda: "ip netns add: Operation not permitted")
    monkeypatch.setenv(REQUIRE_NETNS_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="must run it"):
        require_network_namespaces()
    monkeypatch.delenv(REQUIRE_NETNS_ENV)
    with pytest.raises(pytest.skip.Exception, match="Operation not permitted"):
        require_network_namespaces()


def test_ci_requires_the_tmpfs_the_namespaces_and_libfiu():
    from pathlib import Path

    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert "SMOLTORRENT_REQUIRE_TMPFS=1" in ci and f"{REQUIRE_NETNS_ENV}=1" in ci
    assert f"{REQUIRE_FIU_ENV}=1" in ci and "fiu-utils" in ci
