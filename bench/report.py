"""Turn bench measurements into the JSON summary and the text table, targets included."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from importlib.metadata import version
from pathlib import Path

# The targets the figures are judged against (see bench/RESULTS.md).
MAX_RATIO_TO_RAW = 1.5  # store/gather wall time over the raw sendfile reference
MAX_PEAK_RSS_MB = 150  # coordinator peak RSS during one store or gather
RSS_FLAT_WITHIN = 0.10  # peak RSS spread between the smallest and the largest size
MAX_CONTROL_PLANE = 0.10  # share of the Celery wall time not spent in the direct engine


def _ram_gb() -> float:
    with open("/proc/meminfo") as f:
        kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return round(kib / 1024**2, 1)


def _op(runs: list[dict], size: int) -> dict:
    """Median time over the runs (robust to one disturbed run), worst peak RSS."""
    seconds = statistics.median(m["seconds"] for m in runs)
    return {
        "seconds": round(seconds, 3),
        "mb_s": round(size / 1e6 / seconds, 1),
        "process_wall_s": round(statistics.median(m["process_wall_s"] for m in runs), 3),
        "peak_rss_mb": round(max(m["peak_rss_mb"] for m in runs), 1),
        "rss_before_mb": round(max(m["rss_before_mb"] for m in runs), 1),
        "runs_s": [round(m["seconds"], 3) for m in runs],
    }


def _celery(runs: list[dict], direct: dict, size: int) -> dict:
    out = {}
    for op in ("store", "gather"):
        seconds = statistics.median(r[op]["seconds"] for r in runs)
        # Both walls include one interpreter start: the CLI's and the direct child's.
        engine = direct[op]["process_wall_s"]
        out[op] = {
            "seconds": round(seconds, 3),
            "mb_s": round(size / 1e6 / seconds, 1),
            "vs_direct": round(seconds / engine, 2),
            "control_plane_share": round((seconds - engine) / seconds, 3),
            "runs_s": [round(r[op]["seconds"], 3) for r in runs],
        }
    out["gather"]["task_seconds"] = round(
        statistics.median(r["gather"]["task_seconds"] for r in runs), 3
    )
    if "reader_gather" in runs[0]:  # the CLI gathering in its own process (no worker hop)
        seconds = statistics.median(r["reader_gather"]["seconds"] for r in runs)
        out["reader_gather"] = {
            "seconds": round(seconds, 3),
            "mb_s": round(size / 1e6 / seconds, 1),
            "vs_raw": round(seconds / direct["raw_gather"]["seconds"], 2),
            "gather_seconds": round(
                statistics.median(r["reader_gather"]["task_seconds"] for r in runs), 3
            ),
            "runs_s": [round(r["reader_gather"]["seconds"], 3) for r in runs],
        }
    for op in ("store", "gather"):
        out[op]["vs_raw"] = round(out[op]["seconds"] / direct[f"raw_{op}"]["seconds"], 2)
    for op, raw in (("store", "store"), ("gather", "gather"), ("reader_gather", "gather")):
        if op in out and f"raw_hashed_{raw}" in direct:
            hashed = direct[f"raw_hashed_{raw}"]["seconds"]
            out[op]["vs_raw_hashed"] = round(out[op]["seconds"] / hashed, 2)
    return out


def summarize(rows: list[dict], args, command: str) -> dict:
    sizes = []
    for r in rows:
        size, runs = r["size_bytes"], r["runs"]
        entry = {"size_gb": r["size_gb"], "size_bytes": size, "shards": runs[0]["shards"]}
        entry["runs"] = len(runs)
        entry["plan"] = _op([run["plan"] for run in runs], size)
        for op in ("store", "gather"):
            entry[op] = _op([run[op] for run in runs], size)
            entry[f"raw_{op}"] = _op([run[f"raw_{op}"] for run in runs], size)
            # Engine and raw run back to back in each run: the ratio within a run is
            # robust to load that comes and goes between runs; report its median.
            ratios = [run[op]["seconds"] / run[f"raw_{op}"]["seconds"] for run in runs]
            entry[f"{op}_vs_raw"] = round(statistics.median(ratios), 2)
            entry[f"{op}_vs_raw_runs"] = [round(x, 2) for x in ratios]
            if f"raw_hashed_{op}" in runs[0]:
                entry[f"raw_hashed_{op}"] = _op([run[f"raw_hashed_{op}"] for run in runs], size)
                hashed = [run[op]["seconds"] / run[f"raw_hashed_{op}"]["seconds"] for run in runs]
                entry[f"{op}_vs_raw_hashed"] = round(statistics.median(hashed), 2)
                floor = [
                    run[f"raw_hashed_{op}"]["seconds"] / run[f"raw_{op}"]["seconds"] for run in runs
                ]
                entry[f"raw_hashed_{op}_vs_raw"] = round(statistics.median(floor), 2)
        for op in ("gather", "raw_gather"):
            entry[f"{op}_cold"] = _op([run[f"{op}_cold"] for run in runs], size)
        entry["raw_gather_cold"]["steps_s"] = {
            step: round(
                statistics.median(run["raw_gather_cold"]["result"][step] for run in runs), 3
            )
            for step in ("preallocate_s", "transfer_s", "fsync_s")
        }
        entry["raw_gather"]["steps_s"] = {
            step: round(statistics.median(run["raw_gather"]["result"][step] for run in runs), 3)
            for step in ("preallocate_s", "transfer_s", "fsync_s")
        }
        if "celery" in runs[0]:
            entry["celery"] = _celery([run["celery"] for run in runs], entry, size)
        sizes.append(entry)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {
            "cores": os.cpu_count(),
            "ram_gb": _ram_gb(),
            "network": "loopback",
            # Other work on the 2 cores (a test run) slows every figure: note the load.
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "page_cache": "warm: the source was just written and caches were not "
            "dropped; node and output files are fsynced",
        },
        "command": command,
        "code": _code_version(),
        "nodes": args.nodes,
        "replicas": args.replicas,
        "sizes": sizes,
        "targets": {
            "ratio_to_raw_max": MAX_RATIO_TO_RAW,
            "peak_rss_mb_max": MAX_PEAK_RSS_MB,
            "rss_flat_within": RSS_FLAT_WITHIN,
            "control_plane_share_max": MAX_CONTROL_PLANE,
        },
        "checks": _checks(sizes),
    }


def machine(scratch: str | os.PathLike) -> dict:
    """What a torch bench's record says of the machine: cores, platform, the file system its
    scratch directory is on (its figures depend on it), torch's version."""
    df = subprocess.run(["df", "--output=fstype", scratch], capture_output=True, text=True)
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "filesystem": df.stdout.split()[-1],
        "torch": version("torch"),
    }


def write_json(path: str | os.PathLike, record: dict) -> None:
    """A bench's record as the results under bench/results/ are kept: sorted, indented."""
    Path(path).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def head_commit() -> str:
    """The short commit measured."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = ["git", "-C", root, "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True).stdout.strip()


def _code_version() -> str:
    """The commit measured, and whether engine code had uncommitted edits at the time."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = ["git", "-C", root]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "coordinator", "worker_server", "smoltorrent"],
        capture_output=True,
        text=True,
    )
    changed = len(dirty.stdout.splitlines())
    return head.stdout.strip() + (f" + {changed} uncommitted engine file(s)" if changed else "")


def _checks(sizes: list[dict]) -> dict:
    checks: dict = {}
    for op in ("store", "gather"):
        checks[f"{op}_ratio_to_raw"] = all(s[f"{op}_vs_raw"] <= MAX_RATIO_TO_RAW for s in sizes)
        peaks = [s[op]["peak_rss_mb"] for s in sizes]
        checks[f"{op}_peak_rss"] = max(peaks) < MAX_PEAK_RSS_MB
        if len(peaks) > 1:
            checks[f"{op}_rss_flat"] = (max(peaks) - min(peaks)) / min(peaks) <= RSS_FLAT_WITHIN
    celery = [s["celery"] for s in sizes if "celery" in s]
    if celery:
        checks["celery_control_plane"] = all(
            c[op]["control_plane_share"] < MAX_CONTROL_PLANE
            for c in celery
            for op in ("store", "gather")
        )
    return checks


def table(summary: dict) -> str:
    head = ("size", "operation", "seconds", "min-max s", "MB/s", "x raw", "peak RSS MB")
    lines = []

    def line(size: str, label: str, m: dict, ratio: str, rss: bool = True) -> None:
        peak = f"{m['peak_rss_mb']:.0f}" if rss else "-"
        spread = f"{min(m['runs_s']):.2f}-{max(m['runs_s']):.2f}"
        seconds, rate = f"{m['seconds']:.2f}", f"{m['mb_s']:.0f}"
        lines.append((size, label, seconds, spread, rate, ratio, peak))

    for s in summary["sizes"]:
        size = f"{s['size_gb']:g} GB"
        for op in ("store", "gather"):
            line(size, f"{op} (engine)", s[op], f"{s[f'{op}_vs_raw']:.2f}")
            if op == "store":
                line(size, "  of which plan + hash", s["plan"], "")
            line(size, f"{op} (raw sendfile)", s[f"raw_{op}"], "1.00")
            if f"raw_hashed_{op}" in s:
                hashed = s[f"raw_hashed_{op}_vs_raw"]
                line(size, f"{op} (raw + SHA-256)", s[f"raw_hashed_{op}"], f"{hashed:.2f}")
            if op == "gather":
                line(size, "  gather (engine), cold", s["gather_cold"], "")
                line(size, "  gather (raw), cold", s["raw_gather_cold"], "")
            if "celery" in s:
                c = s["celery"][op]
                ratio = f"{c['vs_raw']:.2f} ({c['vs_direct']:.2f} x engine)"
                if "vs_raw_hashed" in c:
                    ratio += f", {c['vs_raw_hashed']:.2f} x hashed"
                line(size, f"{op} (Celery + CLI)", c, ratio, False)
                if op == "gather" and "reader_gather" in s["celery"]:
                    c = s["celery"]["reader_gather"]
                    ratio = f"{c['vs_raw']:.2f}"
                    if "vs_raw_hashed" in c:
                        ratio += f" ({c['vs_raw_hashed']:.2f} x hashed)"
                    line(size, "gather (CLI, own process)", c, ratio, False)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = " | ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
    out += [fmt.format(*row) for row in lines]
    checks = ", ".join(f"{k}={'ok' if v else 'MISS'}" for k, v in summary["checks"].items())
    runs = summary["sizes"][0]["runs"]
    out.append(f"seconds and MB/s: medians of {runs} run(s); x raw: median of per-run ratios")
    out.append("gathers run twice back to back: the warm (second) run is the headline")
    out.append(f"targets: {checks}")
    return "\n".join(out)
