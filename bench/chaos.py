"""Jepsen-style fault runs: a seeded schedule of faults (SIGKILLs and SIGSTOPs of the
nodes, the worker, beat and Redis; EIO on a node's fsync, write or rename; a full node
disk; a worker's or a node's clock off by minutes; a node cut from the coordinator, from
the other nodes, or its link flapping) under a workload of concurrent stores, gathers,
rollbacks and removes, every operation a real `smoltorrent` command; then the checker's
verdict. A seed replays the same schedule for the same --faults (by default every kind
whose tool is installed here).

    .venv/bin/python -m bench.chaos --minutes 30 --seed 1     # one long run
    .venv/bin/python -m bench.chaos --minutes 2 --seeds 1 2 3  # several short ones
    .venv/bin/python -m bench.chaos --seed 7 --minutes 1       # replay seed 7's schedule

Prints each seed's fault schedule before it runs (the same on every run of that seed),
then its operations, faults and violations; the whole history is kept in
<dir>/seed-N/history.json. Exits 1 if any seed broke a promise.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/chaos.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.local.chaos import FAULT_KINDS, ChaosRun, available_kinds  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=1.0, help="workload time per seed")
    p.add_argument("--seed", type=int, action="append", dest="seeds", help="a seed (repeatable)")
    p.add_argument("--seeds", type=int, nargs="+", dest="seed_list", help="several seeds")
    p.add_argument("--clients", type=int, default=3, help="concurrent CLI clients")
    p.add_argument(
        "--faults",
        nargs="+",
        choices=FAULT_KINDS,
        default=list(available_kinds()),
        help="fault kinds to draw from (default: every one whose tool is installed here)",
    )
    p.add_argument(
        "--overlap", action="store_true", help="hold faults at once, each on its own process"
    )
    p.add_argument("--dir", type=Path, help="where runs keep their files (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="one JSON line of figures per seed")
    args = p.parse_args(argv)
    # A SIGTERM (a timeout, a CI cancel) unwinds like Ctrl-C, so the run's finally stops its
    # processes and removes its namespaces and mounts; a SIGKILL leaves the namespaces to
    # the next run's netns.remove_stale.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seeds = (args.seeds or []) + (args.seed_list or []) or [1]
    root = args.dir or Path(tempfile.mkdtemp(prefix="smoltorrent-chaos-"))
    failed = 0
    for seed in seeds:
        run = ChaosRun(
            root / f"seed-{seed}",
            seed=seed,
            seconds=args.minutes * 60,
            clients=args.clients,
            kinds=tuple(args.faults),
            overlap=args.overlap,
            say=lambda line: print(line, file=sys.stderr, flush=True),
        )
        report = run.run()
        print(report.summary(), flush=True)
        for violation in report.violations:
            print(f"  VIOLATION: {violation}", flush=True)
        if args.json:
            print(json.dumps(report.figures()), flush=True)
        failed += bool(report.violations)
        print(f"  history: {root / f'seed-{seed}' / 'history.json'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
