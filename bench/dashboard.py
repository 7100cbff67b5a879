"""The Grafana dashboard's panels, drawn from real Prometheus data after a demo run.

    .venv/bin/python -m bench.dashboard [--size-mb 64] [--rounds 12] [--pause 4]
                                        [--out docs/images/dashboard.png] [--json PATH]

Needs Debian's `prometheus` and matplotlib (`pip install '.[bench]'`); no Grafana.

A LocalCluster (Redis, 4 nodes, a Celery worker, all on loopback, metrics on) with a real
`smoltorrent beat` (sweeps every second, a node dead after 5 s) and a real Prometheus
scraping the nodes and the worker every second. The run: a training-like loop that
writes a new checkpoint (random bytes) under one name every round, stores it through the
CLI and gathers it back; halfway, the node holding the most blobs is SIGKILLed for good,
and the loop goes on while the sweeps bring every shard back to two copies on the
survivors. Then every panel below is asked of Prometheus over the run (query_range, 1 s
steps) with the dashboard's own PromQL, its rate windows shortened to --window for a run
of minutes, and drawn with matplotlib as the dashboard lays it out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.self_heal import cli, wait  # noqa: E402
from coordinator.local.cluster import LocalCluster  # noqa: E402
from coordinator.local.prometheus import LocalPrometheus, dashboard_panels  # noqa: E402
from coordinator.local.synthetic import write_checkpoint  # noqa: E402
from coordinator.state.metadata import Metadata  # noqa: E402
from smoltorrent.errors import SmoltorrentError  # noqa: E402

# The panels drawn, by their title in deploy/grafana/smoltorrent.json, in reading order.
PANELS = [
    "Nodes up",
    "Dead nodes",
    "Under-replicated shards",
    "Store wall time",
    "Gather wall time",
    "Aggregate throughput",
    "Per-node bandwidth in",
    "Per-node bandwidth out",
    "Transfer latency by node",
    "Blobs per node",
    "Scrub progress by node",
    "Repairs and trims (1 h)",
]
SCALE = {"Bps": (1e6, "MB/s"), "bytes": (1e6, "MB"), "s": (1.0, "s")}


def log(msg: str) -> None:
    print(f"[dashboard] {msg}", file=sys.stderr, flush=True)


def metrics_targets(cluster: LocalCluster) -> dict[str, list[str]]:
    nodes = [
        f"127.0.0.1:{(n.data_dir / 'metrics_port').read_text().strip()}" for n in cluster.node_procs
    ]

    def worker_port() -> str | None:
        text = (cluster.root / "worker.log").read_text(errors="replace")
        found = re.search(r"metrics on http://[\d.]+:(\d+)/metrics", text)
        return found.group(1) if found else None

    wait(worker_port, 60, "the worker's metrics port")
    return {"smoltorrent-nodes": nodes, "smoltorrent-worker": [f"127.0.0.1:{worker_port()}"]}


def scalar(prom: LocalPrometheus, expr: str) -> float | None:
    found = prom.query(expr)
    return float(found[0]["value"][1]) if found else None


def run(args: argparse.Namespace, root: Path) -> dict:
    interval = "1"
    cluster = LocalCluster(
        root / "cluster",
        nodes=4,
        extra_env={
            "SMOLTORRENT_METRICS_PORT": "0",
            "SMOLTORRENT_HEALTH_INTERVAL_S": interval,
            "SMOLTORRENT_REPAIR_INTERVAL_S": interval,
            "SMOLTORRENT_SCRUB_INTERVAL_S": interval,
            "SMOLTORRENT_DEAD_AFTER_S": "5",
            "SMOLTORRENT_SCRUB_RATE_BPS": str(int(args.scrub_rate_mbps * 1e6)),
        },
    )
    prom = None
    try:
        cluster.start()
        cli(cluster, "nodes", "add", *(str(n.address) for n in cluster.node_procs))
        cluster.start_beat()
        prom = LocalPrometheus(root / "prometheus", metrics_targets(cluster))
        prom.wait_ready()
        wait(lambda: len(prom.targets_up()) == 5, 60, "Prometheus scraping 4 nodes and the worker")
        names = {n.address: f"node{i}" for i, n in enumerate(cluster.node_procs)}
        md = Metadata(cluster.redis_url)
        node_names = {node_id: names[rec.address] for node_id, rec in md.nodes.nodes().items()}
        start = time.time()
        events = []
        src, back = root / "model.safetensors", cluster.root / "back.safetensors"
        for i in range(args.rounds):
            if i == args.rounds // 2:
                held = Counter(n for nodes in md.blobs.placements().values() for n in nodes)
                victim_id = held.most_common(1)[0][0]
                victim_name = node_names[victim_id]
                victim = next(n for n in cluster.node_procs if names[n.address] == victim_name)
                victim.kill()
                events.append((time.time() - start, f"{victim_name} killed"))
                log(f"killed {victim_name}")
            write_checkpoint(src, int(args.size_mb * 1e6), hidden=512)
            past = time.time() - 60  # written whole: no settle wait
            os.utime(src, (past, past))
            cli(cluster, "store", str(src), "--name", "run1/model.safetensors")
            cli(cluster, "gather", "run1/model.safetensors", "-o", str(back))
            log(f"round {i + 1}/{args.rounds}: stored and gathered {args.size_mb} MB")
            time.sleep(args.pause)
        healed = wait(
            lambda: (
                scalar(prom, "smoltorrent_under_replicated_shards") == 0
                and scalar(prom, "smoltorrent_nodes_dead") == 1
            ),
            180,
            "every shard back at two copies",
        )
        log(f"healed ({healed:.1f} s after the last round)")
        time.sleep(args.tail)  # the rates fall back to zero on the picture
        end = time.time()
        panels = query_panels(prom, start, end, args.window, node_names)
        return {
            "size_mb": args.size_mb,
            "rounds": args.rounds,
            "window": args.window,
            "seconds": end - start,
            "events": events,
            "panels": panels,
        }
    finally:
        if prom is not None:
            prom.stop()
        cluster.stop()


def query_panels(
    prom: LocalPrometheus, start: float, end: float, window: str, node_names: dict[str, str]
) -> list[dict]:
    """Each panel of PANELS as {"title", "unit", "series": [{"label", "points"}]}."""
    by_title = {p["title"]: p for p in dashboard_panels()}
    run_s = f"{int(end - start) + 1}s"
    out = []
    for title in PANELS:
        panel = by_title[title]
        series = []
        for target in panel["targets"]:
            # Rate windows made for hours of data, shortened for a run of minutes; a
            # "last hour" increase becomes one over the whole run.
            expr = re.sub(r"\[(1m|5m)\]", f"[{window}]", target["expr"]).replace(
                "[1h]", f"[{run_s}]"
            )
            for result in prom.query_range(expr, start, end, 1):
                labels = {
                    k: node_names.get(v, v) if k == "node" else v
                    for k, v in result["metric"].items()
                }
                label = legend(target.get("legendFormat", ""), labels)
                points = [(t - start, float(v)) for t, v in result["values"] if v != "NaN"]
                series.append({"label": label.strip() or expr, "expr": expr, "points": points})
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "none")
        out.append({"title": title, "unit": unit, "series": series})
    return out


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: {{name}} replaced by that label's value."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: labels.get(m.group(1), ""), template)


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = report["panels"]
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(15, 3.1 * rows), sharex=True)
    for ax, panel in zip(axes.flat, panels, strict=False):
        divisor, unit = SCALE.get(panel["unit"], (1.0, ""))
        for s in sorted(panel["series"], key=lambda s: s["label"]):
            if s["points"]:
                xs, ys = zip(*s["points"], strict=True)
                ax.plot(xs, [y / divisor for y in ys], label=s["label"], linewidth=1.2)
        for at, _ in report["events"]:
            ax.axvline(at, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(panel["title"] + (f" ({unit})" if unit else ""), fontsize=10)
        ax.grid(alpha=0.3)
        if any(s["points"] for s in panel["series"]):
            ax.legend(fontsize=7, loc="upper left")
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds")
    what = ", ".join(f"{w} at {at:.0f} s (dashed)" for at, w in report["events"])
    fig.suptitle(
        f"smoltorrent dashboard panels from Prometheus: {report['rounds']} rounds of store +"
        f" gather of {report['size_mb']:g} MB on 4 local nodes, R=2; {what};"
        f" rate windows {report['window']}",
        fontsize=11,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mb", type=float, default=64.0, help="checkpoint size per round")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--pause", type=float, default=4.0, help="seconds between rounds")
    p.add_argument("--tail", type=float, default=15.0, help="seconds recorded after healing")
    p.add_argument("--window", default="5s", help="rate window in place of 1m and 5m")
    p.add_argument("--scrub-rate-mbps", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=Path("docs/images/dashboard.png"))
    p.add_argument("--json", type=Path, help="also write the queried series here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="smoltorrent-dashboard-") as tmp:
        try:
            report = run(args, Path(tmp))
        except SmoltorrentError as exc:
            sys.exit(f"error: {exc}")
    if args.json:
        args.json.write_text(json.dumps(report))
    plot(report, args.out)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
