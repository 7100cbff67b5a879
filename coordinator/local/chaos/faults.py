"""The faults a run draws and its schedule: what each kind does, which tools it needs, and
the seeded draw (`draw_schedule`) that makes every run of a seed the same."""

from __future__ import annotations

import glob
import os
import random
import shutil
from dataclasses import dataclass

from coordinator.local import netns

PROCESS_KINDS = ("node", "worker", "beat", "redis")
ACTIONS = ("kill", "stop")  # SIGKILL then a restart, or SIGSTOP then SIGCONT
# eio-node: the node's every fsync fails with EIO (libfiu's fiu-run/fiu-ctrl in that node
# process), then works again; eiowrite-node and eiorename-node: its every pwrite (a blob's
# bytes) or rename (a blob or manifest published). full-node: the node's file system (a
# tmpfs of its own) is filled to the last byte, then emptied again. skew-worker and
# skew-node: the worker, or one node, restarted with its clock SKEW_S off (libfaketime),
# every other process on the real one, then restarted true. Links (each node in a network
# namespace of its own): cutcoord-node, the node and the coordinator's processes (CLI,
# worker, beat) cannot reach each other, the node and the other nodes still can;
# cutpeers-node, the reverse, so chains through it break; flap-node, the node's cable out
# and in every FLAP_HALF_PERIOD_S. Data on a node's disk: flip-node, one byte of one blob
# file flipped in place (it must never be served, and must be healed); wipe-node, the node
# killed, its blobs, manifests and temp files deleted (its id kept), and started again
# empty; lose-node, the node killed for good (repair must bring every blob back to R on the
# others while the faults go on; at most one a run). Appended, never inserted: a seed's
# schedule over the older kinds draws the same as before only if their order stays.
FAULT_KINDS = (
    *(f"{a}-{p}" for p in PROCESS_KINDS for a in ACTIONS),
    "eio-node",
    "full-node",
    "skew-worker",
    "eiowrite-node",
    "eiorename-node",
    "skew-node",
    "cutcoord-node",
    "cutpeers-node",
    "flap-node",
    "flip-node",
    "wipe-node",
    "lose-node",
)
# The kinds that destroy a copy. With R=2 two of them on two nodes before repair healed the
# first can destroy a blob's every copy, a loss the design does not promise to survive:
# so one of them starts at least DESTRUCTIVE_GAP_S after the last one began (the dead
# timeout, a repair sweep or two, and a scrub pass, at the run's fast intervals).
DESTRUCTIVE_KINDS = ("flip-node", "wipe-node", "lose-node")
DESTRUCTIVE_GAP_S = 30.0
# ...and, when its time comes, waits for the cluster back at R, for this long at most (and
# never past the next fault's time): still short, it is skipped (nemesis.py)
R_WAIT_S = 120.0
STATUS_TIMEOUT_S = 30.0  # seconds one `status --json` may take on a loaded machine
EIO_POINTS = {  # libfiu's failure point (fiu-utils' function_list) per disk-error kind
    "eio": "posix/io/sync/fsync",
    # pwrite, not write: the node writes its sockets with write(2) (and a blob's bytes with
    # pwrite), so this fails the disk alone, as a bad disk does.
    "eiowrite": "posix/io/rw/pwrite",
    "eiorename": "posix/io/dir/rename",
}
LINK_KINDS = ("cutcoord-node", "cutpeers-node", "flap-node")


def faketime_lib(lib_dir: str = "/usr/lib") -> str:
    """libfaketime's path here: Debian keeps it in the architecture's multiarch directory
    (x86_64-linux-gnu, aarch64-linux-gnu, ...); the first found, else the plain one."""
    found = sorted(glob.glob(os.path.join(lib_dir, "*", "faketime", "libfaketime.so.1")))
    return found[0] if found else os.path.join(lib_dir, "faketime", "libfaketime.so.1")


FAKETIME_LIB = faketime_lib()
SKEW_S = 300  # seconds the skewed worker's clock is off, either way: minutes, as without NTP
NODE_FS_BYTES = 256 * 1024 * 1024  # each node's tmpfs for full-node, at least: a short run uses MBs
# ...and more for a long run: every store's content is unique and every version is kept, so a
# node's disk only grows. Seed 38's 30-minute run (2026-12-06) filled 256 MiB per node in
# ~12 min (~21 MiB a minute each on 4 nodes, ~28 with one lost), then every store failed for
# space and repair had nowhere to go; 64 MiB a minute leaves twice that.
NODE_FS_BYTES_PER_MINUTE = 64 * 1024 * 1024
FLAP_HALF_PERIOD_S = 0.2  # a flapping link is out this long, then in as long: 2.5 flaps a second
# Namespaces of a run are named NETNS_TAG<pid>-...: the next run removes those of a run that
# was killed before it could (netns.remove_stale).
NETNS_TAG = "stc"
COORDINATOR_HOST = "co"  # the LAN host that is this namespace: Redis, worker, beat, CLI


def available_kinds() -> tuple[str, ...]:
    """FAULT_KINDS less those whose tool is not installed here (Debian: fiu-utils for the
    eio kinds, faketime for the skew kinds; root and iproute2 for the links)."""
    missing = set()
    if shutil.which("fiu-run") is None or shutil.which("fiu-ctrl") is None:
        missing.update(("eio-node", "eiowrite-node", "eiorename-node"))
    if not os.path.exists(FAKETIME_LIB):
        missing.update(("skew-worker", "skew-node"))
    if os.geteuid() != 0 or shutil.which("mount") is None:
        missing.add("full-node")  # mounting each node's tmpfs needs root
    if netns.unavailable() is not None:
        missing.update(LINK_KINDS)
    return tuple(k for k in FAULT_KINDS if k not in missing)


# Sweep intervals of a second or two, so a run of a minute heals within it; the dead
# timeout is longer than the longest hold, so a held node comes back before it is dead


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the workload starts
    kind: str  # one of FAULT_KINDS
    target: int  # node index (0 for the single worker, beat and Redis; skew-worker: seconds)
    hold_s: float  # seconds the process stays killed or stopped
    skew_s: int = 0  # skew-node: seconds its clock is off


@dataclass(frozen=True)
class Schedule:
    seed: int
    faults: tuple[Fault, ...]

    def describe(self) -> str:
        lines = [f"seed {self.seed}: {len(self.faults)} faults"]
        for f in self.faults:
            who = f"node{f.target}" if f.kind.endswith("node") else f.kind.split("-")[1]
            if f.kind == "skew-worker":
                who = f"worker {f.target:+d}s"
            elif f.kind == "skew-node":
                who = f"node{f.target} {f.skew_s:+d}s"
            lines.append(
                f"  t={f.at_s:6.2f}s {f.kind.split('-')[0]:9} {who:12} for {f.hold_s:.2f}s"
            )
        return "\n".join(lines)


def draw_schedule(
    seed: int,
    seconds: float,
    nodes: int,
    kinds: tuple[str, ...] = FAULT_KINDS,
    overlap: bool = False,
) -> Schedule:
    """Faults through `seconds`, drawn from the seed alone. By default one after another:
    a quiet gap, then one fault held a while, then healed. With `overlap` the next fault
    starts 0.3-2 s after the last one began, while it may still be held, on a process no
    held fault is on (a node killed and stopped at once has no order to undo in)."""
    rng = random.Random(f"nemesis:{seed}")
    faults: list[Fault] = []
    t = rng.uniform(1.0, 3.0)
    while t < seconds and kinds:
        kind = rng.choice(kinds)
        hold = rng.uniform(0.5, 4.0)
        target = rng.randrange(nodes) if kind.endswith("node") else 0
        skew = 0
        if kind == "skew-worker":  # long enough to work skewed after its ~2 s start
            hold, target = rng.uniform(6.0, 12.0), rng.choice((-SKEW_S, SKEW_S))
        elif kind == "skew-node":
            hold, skew = rng.uniform(6.0, 12.0), rng.choice((-SKEW_S, SKEW_S))
        fault = Fault(round(t, 2), kind, target, round(hold, 2), skew)
        held = [f for f in faults if f.at_s + f.hold_s > fault.at_s]
        lost = [f for f in faults if f.kind == "lose-node"]
        destroyed = [f for f in faults if f.kind in DESTRUCTIVE_KINDS]
        if (
            not any(_process(f) == _process(fault) for f in held)
            and not any(_process(f) == _process(fault) for f in lost)
            and not (kind == "lose-node" and lost)
            and not (
                kind in DESTRUCTIVE_KINDS
                and destroyed
                and fault.at_s - destroyed[-1].at_s < DESTRUCTIVE_GAP_S
            )
        ):
            faults.append(fault)
        t += rng.uniform(0.3, 2.0) if overlap else hold + rng.uniform(1.0, 4.0)
    return Schedule(seed, tuple(faults))


def _process(fault: Fault) -> str:
    """Which process a fault is on: node2, worker, beat, redis."""
    what = fault.kind.split("-")[1]
    return f"node{fault.target}" if what == "node" else what
