"""The checker catches lies (issue 38): one short run of the real harness on a real
cluster, no faults, with a defect of each kind planted in the `smoltorrent` CLI by a
sitecustomize on the CLI's PYTHONPATH only (tests/chaos/planted/): a stale read, a read
across names, an acknowledgement with nothing stored, a failure reported for a store that
committed, a remove that removed nothing. Each must be reported."""

from __future__ import annotations

import os
from pathlib import Path

from coordinator.local.chaos import ChaosRun

PLANTED = Path(__file__).parent / "planted"
# Seed 22's clients store run/best.safetensors three times, eval/model.safetensors and
# run/latest.safetensors (client 2 first of all), and client 1 a scratch name it then
# removes and gathers, in their first five operations each (a Recorded run of
# tests/chaos/test_workload.py shows the stream), so 8 s hold every kind.
SEED = 22
SECONDS = 8.0


def test_the_checker_reports_every_planted_defect(tmp_path):
    path = os.pathsep.join(filter(None, [str(PLANTED), os.environ.get("PYTHONPATH")]))
    run = ChaosRun(
        tmp_path / "run",
        seed=SEED,
        seconds=SECONDS,
        kinds=(),
        content_bytes=100_000,
        cli_env={"PYTHONPATH": path},
    )
    report = run.run()
    said = "\n".join(report.violations)
    why = f"{report.summary()}\n{said}"
    assert report.faults_applied == [], why
    stale = [v for v in report.violations if "run/best" in v and "stale read" in v]
    across = [v for v in report.violations if "eval/model" in v and "read across names" in v]
    lost = [v for v in report.violations if "client 2 store run/latest" in v and "(lost)" in v]
    kept = [v for v in report.violations if "remove scratch/" in v and "still committed" in v]
    served = [v for v in report.violations if "superseded by client" in v and " remove " in v]
    failed = [
        v
        for v in report.violations
        if "eval/model" in v and "exited 1 (failed)" in v and "committed" in v
    ]
    assert stale and across and lost and failed and kept and served, why
