"""bench/dashboard.py draws the Grafana dashboard's own panels from a real Prometheus: the
panels it names exist, and a short run gives every one of them data, the node it kills
shows as dead and every shard ends back at two copies."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import dashboard
from coordinator.local.prometheus import dashboard_panels, prometheus_binary


def test_every_panel_drawn_is_one_of_the_dashboards() -> None:
    titles = {p["title"] for p in dashboard_panels()}
    assert set(dashboard.PANELS) <= titles, set(dashboard.PANELS) - titles


def test_legends_read_as_grafana_writes_them() -> None:
    assert dashboard.legend("p95 {{node}}", {"node": "node2"}) == "p95 node2"
    assert dashboard.legend("{{node}} {{where}}", {"node": "n"}) == "n "


@pytest.mark.timeout(600)
def test_a_short_run_gives_every_panel_data(tmp_path: Path) -> None:
    if prometheus_binary() is None:
        pytest.skip("Prometheus is not installed (Debian: apt-get install prometheus)")
    args = argparse.Namespace(
        size_mb=4.0, rounds=2, pause=0.0, tail=1.0, window="5s", scrub_rate_mbps=20.0
    )
    report = dashboard.run(args, tmp_path)
    assert [p["title"] for p in report["panels"]] == dashboard.PANELS
    for panel in report["panels"]:
        assert any(s["points"] for s in panel["series"]), panel["title"]
    (killed,) = report["events"]
    assert killed[1].endswith("killed")

    def last(title: str) -> float:
        (panel,) = [p for p in report["panels"] if p["title"] == title]
        return panel["series"][0]["points"][-1][1]

    assert last("Dead nodes") == 1
    assert last("Under-replicated shards") == 0
