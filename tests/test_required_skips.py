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


def test_every_test_that_makes_namespaces_requires_them():
    """A test module that makes network namespaces (`ip netns`, coordinator.local.netns)
    skips through require_network_namespaces, never a skipif of its own: test_discovery's
    `skipif(geteuid() != 0)` skipped silently on CI where namespaces could not be made."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    making = [
        p
        for p in here.rglob("test_*.py")
        if p.name != Path(__file__).name
        and ('"netns"' in (text := p.read_text()) or "netns.Lan" in text or "Lan(" in text)
    ]
    assert any(p.name == "test_discovery.py" for p in making), making
    silent = [
        str(p.relative_to(here))
        for p in making
        if "require_network_namespaces()" not in p.read_text() or "geteuid" in p.read_text()
    ]
    assert silent == []
