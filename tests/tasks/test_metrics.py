"""Metrics against a real Prometheus: it scrapes 4 nodes and the worker, and after a
store and a gather every PromQL expression of the Grafana dashboard returns data."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from coordinator.dataplane.node_client import NodeAddress
from coordinator.local.prometheus import LocalPrometheus, dashboard_panels, prometheus_binary
from coordinator.local.synthetic import synthetic_manifest, write_checkpoint
from coordinator.plan.version_ids import storage_key
from coordinator.state.embedded_redis import start_redis, url_for
from coordinator.state.metadata import Metadata
from tests.nodeproc import start_node
from tests.tasks.conftest import wait_until


def dashboard_expressions() -> list[str]:
    return [t["expr"] for panel in dashboard_panels() for t in panel["targets"]]


def start_prometheus(root: Path, targets: dict[str, list[str]]) -> LocalPrometheus:
    if prometheus_binary() is None:
        pytest.skip(
            "Prometheus is not installed (Debian: apt-get install prometheus; .ci/run "
            "installs it where it can)"
        )
    return LocalPrometheus(root, targets)


def worker_metrics_port(cluster) -> int:
    def port():
        found = re.search(r"metrics on http://[\d.]+:(\d+)/metrics", cluster.worker_log())
        return int(found.group(1)) if found else None

    return wait_until(port, 60, what="the worker's metrics port")


def families(port) -> list:
    """Every metric family /metrics serves on this port of 127.0.0.1."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        return list(text_string_to_metric_families(answer.read().decode()))


def scrape(port) -> list:
    """Every sample /metrics serves on this port of 127.0.0.1."""
    return [s for f in families(port) for s in f.samples]


def undocumented(port) -> list[str]:
    """The smoltorrent metrics served on port that docs/operations.md does not name."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    return [
        f.name
        for f in families(port)
        if f.name.startswith("smoltorrent_") and not re.search(rf"`{f.name}(_total)?`", page)
    ]


@pytest.mark.timeout(300)
def test_prometheus_scrapes_nodes_and_worker_and_every_dashboard_query_has_data(
    make_cluster, tmp_path
):
    c = make_cluster(4, SMOLTORRENT_METRICS_PORT="0")
    node_targets = [
        f"127.0.0.1:{(n.data_dir / 'metrics_port').read_text().strip()}" for n in c.node_procs
    ]
    worker_target = f"127.0.0.1:{worker_metrics_port(c)}"
    # Issue 22: /metrics has no login, so it listens on loopback unless --metrics-host.
    assert "metrics on http://127.0.0.1:" in c.worker_log()
    prom = start_prometheus(
        tmp_path / "prometheus",
        {"smoltorrent-nodes": node_targets, "smoltorrent-worker": [worker_target]},
    )
    try:
        wait_until(prom.ready, 60, what="Prometheus to start")
        wait_until(lambda: len(prom.targets_up()) == 5, 60, what="all 5 targets up")
        src = tmp_path / "m.safetensors"
        write_checkpoint(src, 6_000_000, hidden=256)
        past = time.time() - 60
        os.utime(src, (past, past))
        c.cli("store", str(src))
        c.cli("gather", "m.safetensors", "-o", str(tmp_path / "back.safetensors"))

        # Stored bytes show up on both sides: every node received some, the worker sent them.
        def stored():
            sent = prom.query("sum(smoltorrent_transfer_bytes_total)")
            received = prom.query("smoltorrent_node_bytes_received_total > 0")
            return sent and float(sent[0]["value"][1]) > 0 and len(received) == 4

        wait_until(stored, 60, what="transfer bytes in Prometheus")
        for histogram in ("smoltorrent_store_seconds", "smoltorrent_gather_seconds"):
            wait_until(
                lambda h=histogram: prom.query(f"{h}_count == 1"), 60, what=f"one {histogram}"
            )
        up = prom.query("smoltorrent_nodes_up")
        assert float(up[0]["value"][1]) == 4
        # The self-healing gauges exist from the start, at zero on a healthy cluster.
        for healing in (
            "smoltorrent_nodes_dead",
            "smoltorrent_repairs_in_flight",
            "smoltorrent_repairs_waiting",
            "smoltorrent_unrepairable_blobs",
            "smoltorrent_bad_copies_held",
        ):
            found = wait_until(lambda h=healing: prom.query(h), 60, what=healing)
            assert float(found[0]["value"][1]) == 0
        expressions = dashboard_expressions()
        assert len(expressions) >= 20
        # Every self-healing series has a panel: scrub progress, bad copies, repairs.
        for series in (
            "smoltorrent_nodes_dead",
            "smoltorrent_repairs_in_flight",
            "smoltorrent_repairs_waiting",
            "smoltorrent_unrepairable_blobs",
            "smoltorrent_bad_copies_held",
            "smoltorrent_repairs_total",
            "smoltorrent_node_scrubbed_bytes_total",
            "smoltorrent_node_verify_failures_total",
        ):
            assert any(series in e for e in expressions), f"no dashboard panel shows {series}"
        for expr in expressions:
            wait_until(lambda e=expr: prom.query(e), 60, what=f"data for {expr}")
    finally:
        prom.stop()


def test_node_metrics_parse_as_prometheus_text(tmp_path):
    """The node's hand-written exposition reads back through prometheus-client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    from worker_server.metrics import NodeMetrics

    m = NodeMetrics("n1", lambda: {"blobs": 3, "used_bytes": 10, "free_bytes": 5})
    m.received(100)
    m.sent(7)
    m.verify_failed("at_rest", 2)
    m.observe_request("put", 0.003)
    m.observe_request("put", 4.0)
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert families["smoltorrent_node_bytes_received"].samples[0].value == 100
    assert families["smoltorrent_node_bytes_sent"].samples[0].value == 7
    failures = {
        s.labels["where"]: s.value for s in families["smoltorrent_node_verify_failures"].samples
    }
    assert failures == {"at_rest": 2, "put": 0}
    hist = {
        (s.name, s.labels.get("le")): s.value
        for s in families["smoltorrent_node_request_seconds"].samples
    }
    assert hist[("smoltorrent_node_request_seconds_bucket", "0.005")] == 1
    assert hist[("smoltorrent_node_request_seconds_bucket", "+Inf")] == 2
    assert hist[("smoltorrent_node_request_seconds_count", None)] == 2
    assert families["smoltorrent_node_blobs"].samples[0].value == 3


def test_cluster_gauges_come_from_the_listing_not_from_every_manifest(tmp_path, monkeypatch):
    """The worker's cluster gauges (read on every scrape) count under-replicated shards by
    live copies and pending versions right, without reading one manifest per version: with
    10,000 checkpoints a scrape must not parse 10,000 manifests."""
    import tasks.context
    from tasks.metrics import ClusterCollector

    monkeypatch.delenv("SMOLTORRENT_CLUSTER_KEY", raising=False)
    pid, port = start_redis(tmp_path / "redis")
    nodes = [start_node(tmp_path / f"node{i}") for i in range(2)]
    try:
        url = url_for(tmp_path / "redis", port)
        md = Metadata(url)
        a, b = (n.client().stat().node_id for n in nodes)
        down = "f" * 32  # registered, never answers: its copies are not live
        md.nodes.add_node(a, nodes[0].address)
        md.nodes.add_node(b, nodes[1].address)
        md.nodes.add_node(down, NodeAddress("127.0.0.1", 9))
        under = pending = 0
        for i in range(30):
            m = synthetic_manifest(f"run{i % 3}/m.safetensors", i, 2)
            vkey = storage_key(m.name, m.version_id)
            holders = [(a, b), (a, down) if i % 3 == 0 else (a, b)]
            md.versions.create_pending(m, vkey, {"path": "/x"}, holders)
            if i % 5 == 4:
                pending += 1
                continue
            for s, shard_nodes in enumerate(holders):
                for r, node_id in enumerate(shard_nodes):
                    md.transfers.settle(vkey, s, r, node_id, m.entries[s].blob_sha256)
            md.versions.commit(vkey, m.name)
            under += i % 3 == 0
        monkeypatch.setenv("SMOLTORRENT_REDIS_URL", url)
        tasks.context.metadata.cache_clear()  # the tasks' client, made for this Redis
        md.r.config_resetstat()
        gauges = {f.name: f.samples[0].value for f in ClusterCollector().collect() if f.samples}
        stats = md.r.info("commandstats")
        assert gauges["smoltorrent_nodes_up"] == 2
        assert gauges["smoltorrent_under_replicated_shards"] == under > 0
        assert gauges["smoltorrent_pending_versions"] == pending > 0
        # One GET is the listing's hint (LISTING_HINT), whatever the number of versions;
        # reading manifests would be one per version.
        assert stats.get("cmdstat_get", {}).get("calls", 0) <= 1, "a manifest was read"
    finally:
        tasks.context.metadata.cache_clear()
        for node in nodes:
            node.stop()
        os.kill(pid, signal.SIGTERM)


def test_node_series_carry_the_nodes_address_beside_its_id(make_cluster, tmp_path):
    """Metrics labelled nodes with a 32-hex id only: a person reading a dashboard could not
    tell which machine it was (issue 24). The worker's per-node series and each node's own
    carry `address` (host:port) beside `node`."""
    c = make_cluster(2, SMOLTORRENT_METRICS_PORT="0")
    src = tmp_path / "m.safetensors"
    write_checkpoint(src, 200_000, hidden=32)
    past = time.time() - 60
    os.utime(src, (past, past))
    c.cli("store", str(src), "--replicas", "2", "--shards", "1")
    addresses = {nid: str(rec.address) for nid, rec in c.md.nodes.nodes().items()}
    sent = [
        s for s in scrape(worker_metrics_port(c)) if s.name == "smoltorrent_transfer_bytes_total"
    ]
    assert {s.labels["node"] for s in sent} == set(addresses), sent
    assert all(s.labels.get("address") == addresses[s.labels["node"]] for s in sent), sent
    for node in c.node_procs:
        info = [
            s
            for s in scrape((node.data_dir / "metrics_port").read_text().strip())
            if s.name == "smoltorrent_node_info"
        ]
        assert info[0].labels.get("address") == str(node.address), info
        assert addresses[info[0].labels["node"]] == str(node.address)
    # Every metric either side serves is in docs/operations.md (issue 40 item 9: four
    # were not).
    node_port = (c.node_procs[0].data_dir / "metrics_port").read_text().strip()
    assert undocumented(worker_metrics_port(c)) == [] and undocumented(node_port) == []


def test_a_gather_run_in_the_cli_process_is_counted_by_the_hosts_worker(
    make_cluster, tmp_path, tmp_path_factory
):
    """A gather into a directory the worker does not write runs in the CLI's own process
    (as load()'s does); it never reached smoltorrent_gather_seconds (issue 40 item 9). The
    worker of the host serves it with its own gathers."""
    # The worker writes gathers under its cluster's root only (not the tests' whole /tmp).
    allowed = tmp_path / "allowed"
    c = make_cluster(2, SMOLTORRENT_METRICS_PORT="0", SMOLTORRENT_GATHER_DIRS=str(allowed))
    src = tmp_path / "m.safetensors"
    write_checkpoint(src, 200_000, hidden=32)
    past = time.time() - 60
    os.utime(src, (past, past))
    c.cli("store", str(src), "--replicas", "2")
    port = worker_metrics_port(c)
    out = tmp_path_factory.mktemp("reader") / "m.safetensors"
    c.cli("gather", "m.safetensors", "-o", str(out))
    assert out.read_bytes() == src.read_bytes()
    assert "Task smoltorrent.gather[" not in c.worker_log()  # run by the CLI, not the worker
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in scrape(port)}
    assert samples[("smoltorrent_gather_seconds_count", ())] == 1
    raw = samples[("smoltorrent_raw_bytes_total", (("direction", "gather"),))]
    assert raw == src.stat().st_size
