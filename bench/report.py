"""Turn bench measurements into the JSON summary and the text table, targets included."""

from __future__ import annotations

import os
import time

# The targets the figures are judged against (see bench/RESULTS.md).
MAX_RATIO_TO_RAW = 1.5  # store/gather wall time over the raw sendfile reference
MAX_PEAK_RSS_MB = 150  # coordinator peak RSS during one store or gather
RSS_FLAT_WITHIN = 0.10  # peak RSS spread between the smallest and the largest size
MAX_CONTROL_PLANE = 0.10  # share of the Celery wall time not spent in the direct engine


def _ram_gb() -> float:
    with open("/proc/meminfo") as f:
        kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return round(kib / 1024**2, 1)


def _op(m: dict, size: int) -> dict:
    return {
        "seconds": round(m["seconds"], 3),
        "mb_s": round(size / 1e6 / m["seconds"], 1),
        "process_wall_s": round(m["process_wall_s"], 3),
        "peak_rss_mb": round(m["peak_rss_mb"], 1),
        "rss_before_mb": round(m["rss_before_mb"], 1),
    }


def _celery(c: dict, direct: dict, size: int, op: str) -> dict:
    seconds = c[op]["seconds"]
    # Both walls include an interpreter start: the CLI's, and the direct child's.
    overhead = (seconds - direct[op]["process_wall_s"]) / seconds
    return {
        "seconds": round(seconds, 3),
        "mb_s": round(size / 1e6 / seconds, 1),
        "vs_direct": round(seconds / direct[op]["process_wall_s"], 2),
        "control_plane_share": round(overhead, 3),
    }


def summarize(rows: list[dict], args, command: str) -> dict:
    sizes = []
    for r in rows:
        size = r["size_bytes"]
        entry = {"size_gb": r["size_gb"], "size_bytes": size, "shards": r["shards"]}
        for op in ("store", "gather"):
            entry[op] = _op(r[op], size)
            entry[f"raw_{op}"] = _op(r[f"raw_{op}"], size)
            entry[f"{op}_vs_raw"] = round(r[op]["seconds"] / r[f"raw_{op}"]["seconds"], 2)
        if "celery" in r:
            entry["celery"] = {op: _celery(r["celery"], r, size, op) for op in ("store", "gather")}
        sizes.append(entry)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {
            "cores": os.cpu_count(),
            "ram_gb": _ram_gb(),
            "network": "loopback",
            "page_cache": "warm: the source was just written and caches were not "
            "dropped; node and output files are fsynced",
        },
        "command": command,
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
    head = ("size", "operation", "seconds", "MB/s", "x raw", "peak RSS MB")
    lines = []
    for s in summary["sizes"]:
        size = f"{s['size_gb']:g} GB"
        for op in ("store", "gather"):
            d, r = s[op], s[f"raw_{op}"]
            lines.append(
                (
                    size,
                    f"{op} (engine)",
                    f"{d['seconds']:.2f}",
                    f"{d['mb_s']:.0f}",
                    f"{s[f'{op}_vs_raw']:.2f}",
                    f"{d['peak_rss_mb']:.0f}",
                )
            )
            lines.append(
                (
                    size,
                    f"{op} (raw sendfile)",
                    f"{r['seconds']:.2f}",
                    f"{r['mb_s']:.0f}",
                    "1.00",
                    f"{r['peak_rss_mb']:.0f}",
                )
            )
            if "celery" in s:
                c = s["celery"][op]
                lines.append(
                    (
                        size,
                        f"{op} (Celery + CLI)",
                        f"{c['seconds']:.2f}",
                        f"{c['mb_s']:.0f}",
                        f"{c['vs_direct']:.2f} x engine",
                        "-",
                    )
                )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = " | ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
    out += [fmt.format(*line) for line in lines]
    checks = ", ".join(f"{k}={'ok' if v else 'MISS'}" for k, v in summary["checks"].items())
    out.append(f"targets: {checks}")
    return "\n".join(out)
