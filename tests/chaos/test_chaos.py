"""Seeded fault runs in CI (coordinator/local/chaos/): SIGKILL and SIGSTOP of the nodes,
the worker, beat and Redis, disk errors and a full disk on a node, clocks off by minutes,
and links cut in network namespaces, under concurrent stores, gathers, rollbacks and
removes, each a real `smoltorrent` command; the checker's verdict must be empty. A failing
seed prints its schedule; `python -m bench.chaos --seed N` replays it."""

from __future__ import annotations

import os

import pytest

from coordinator.local.chaos import (
    EIO_POINTS,
    LINK_KINDS,
    ChaosRun,
    available_kinds,
    faketime_lib,
)
from tests.conftest import REQUIRE_FIU_ENV, REQUIRE_NETNS_ENV, REQUIRE_TMPFS_ENV

# Three seeds of 20 s of faults each: about 30 s a seed with start, healing and the final
# gathers. Chosen so that, with every kind available (CI), they draw between them every
# kind but stop-redis, kill-beat, eio-node (fsync), flip-node, wipe-node and skew-worker
# (tests/beat/test_health.py and test_reconcile_clock.py skew a worker's clock): 36
# eiowrite, cutcoord, cutpeers, kill-redis, lose-node; 27 skew-node, cutcoord, eiorename;
# 181 kill-worker, full-node, stop-worker, lose-node. Longer runs and the other kinds:
# bench/chaos.py.
SEEDS = (36, 27, 181)
SECONDS = 20.0
# Kinds a seed leaves out (none now). Seed 181 left out lose-node for a while: drawn 17.8 s
# into its 20 s, it once ended, in a loaded CI run, with a version still pending or
# removing after healing (a remove waited for a lost node for ever: tasks/remove.py no
# longer waits for a dead node). Seed 36's lose-node once left a shared blob at one copy
# (a trim in flight counted as a copy arriving: coordinator/state/repair_plan.py).
LEFT_OUT: dict[int, set[str]] = {}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_fault_schedule_breaks_no_promise(seed, tmp_path):
    kinds = tuple(k for k in available_kinds() if k not in LEFT_OUT.get(seed, ()))
    report = ChaosRun(tmp_path / "run", seed=seed, seconds=SECONDS, kinds=kinds).run()
    why = f"{report.summary()}\n{report.schedule.describe()}\n" + "\n".join(report.violations)
    assert report.violations == [], why
    # The run proves something only if faults landed and operations were acknowledged.
    assert len(report.effective_faults()) >= 3, why
    assert not [f for f in report.faults_applied if "apply_error" in f or "undo_error" in f], why
    acked = [op for op in report.ops if op.kind == "store" and op.exit == 0]
    gathered = [op for op in report.ops if op.kind == "gather" and op.exit == 0]
    assert len(acked) >= 5 and gathered, why


def test_a_machine_that_must_run_a_fault_kind_draws_it():
    """Where CI says a tool is there (the REQUIRE variables .ci/run sets), its fault kinds
    are drawn: a kind that silently dropped out would leave the seeds above proving less."""
    kinds = set(available_kinds())
    required = {
        REQUIRE_NETNS_ENV: set(LINK_KINDS),
        REQUIRE_FIU_ENV: {f"{action}-node" for action in EIO_POINTS},
        REQUIRE_TMPFS_ENV: {"full-node"},
    }
    for env, wanted in required.items():
        if os.environ.get(env) == "1":
            assert wanted <= kinds, (env, wanted - kinds)


@pytest.mark.parametrize("arch", ["x86_64-linux-gnu", "aarch64-linux-gnu"])
def test_libfaketime_is_found_in_any_architecture_s_directory(tmp_path, arch) -> None:
    """Debian puts libfaketime under the machine's multiarch directory: the clock-skew
    faults and tests looked in x86_64's only, and skipped on a Raspberry Pi or Graviton."""
    lib = tmp_path / arch / "faketime" / "libfaketime.so.1"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    assert faketime_lib(str(tmp_path)) == str(lib)
