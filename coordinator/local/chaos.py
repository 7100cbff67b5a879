"""Jepsen-style fault runs on a LocalCluster: a seeded nemesis, a workload of CLI
commands recorded as a history, and a checker that reads the history afterwards.

    run = ChaosRun(root, seed=7, seconds=30)
    report = run.run()          # starts the cluster, runs, heals, settles, checks, stops
    report.violations           # [] when every promise held

Everything random is drawn from `random.Random` streams named after the seed: the fault
schedule (printed by `Schedule.describe`) and each client's sequence of operations are
the same on every run of a seed; only the processes' own timing differs. The parts are
the ones a user runs (redis-server, `python -m worker_server`, `smoltorrent worker`,
`smoltorrent beat`, the `smoltorrent` CLI), each a real process; faults are real
signals, system calls failed with libfiu, clocks set off with libfaketime, and links cut
in network namespaces (coordinator/local/netns.py: each node in a namespace of its own on
one switch, the coordinator's processes here in the machine's own). Nothing here imports
Celery: the history is what the CLI printed and exited with, and the final state is what
Redis and `smoltorrent ls/status` say.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

from coordinator.local import netns
from coordinator.local.cluster import LocalCluster, _alive
from coordinator.local.synthetic import write_checkpoint
from coordinator.state import redis_keys as K
from coordinator.state.leaks import find_leaks
from coordinator.state.metadata import Metadata
from smoltorrent.errors import SmoltorrentError

# The faults the nemesis draws from: (what it does, which process kind).
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
# and in every FLAP_HALF_PERIOD_S. Appended, never inserted: a seed's schedule over the
# older kinds draws the same as before only if their order stays.
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
)
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
NODE_FS_BYTES = 256 * 1024 * 1024  # each node's tmpfs for full-node: a run stores some MB
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
# (the health sweep and repair still run for the killed ones that stay down longer).
FAST_ENV = {
    "SMOLTORRENT_HEALTH_INTERVAL_S": "1",
    "SMOLTORRENT_DEAD_AFTER_S": "8",
    "SMOLTORRENT_REPAIR_INTERVAL_S": "1",
    "SMOLTORRENT_REPAIR_BACKOFF_S": "1",
    "SMOLTORRENT_CROSSCHECK_INTERVAL_S": "2",
    # Scrub passes run under the faults too: a node's one wall-clock reading is when its
    # last pass finished (reported in status, compared with nothing), so skew-node shows
    # whether a clock off by minutes changes what the sweep does.
    "SMOLTORRENT_SCRUB_INTERVAL_S": "3",
    "SMOLTORRENT_RECONCILE_INTERVAL_S": "2",
    "SMOLTORRENT_RECONCILE_GRACE_S": "10",
    # Every acknowledged version must stay gatherable to the end of the run.
    "SMOLTORRENT_KEEP_LAST": "1000",
    "SMOLTORRENT_TRANSFER_RETRIES": "6",
}
GATHER_DIRS_ENV = "SMOLTORRENT_GATHER_DIRS"
CLI_TIMEOUT_S = 120.0  # an operation still running after this is recorded as timed out
SETTLE_TIMEOUT_S = 90.0  # after healing: requests closed, nothing pending, R restored
# Leaks found once settled are looked for again after this many crosscheck periods: a blob
# that stopped being used as the run settled is noted by then (only a run that found one
# waits)
LEAK_RECHECK_PERIODS = 2
NAMES = ("run/latest.safetensors", "run/best.safetensors", "eval/model.safetensors")
GATHER_AT_LEAST_EVERY = 3  # a client's operations between gathers at most, once it stored


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
    while t < seconds:
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
        if not any(_process(f) == _process(fault) for f in held):
            faults.append(fault)
        t += rng.uniform(0.3, 2.0) if overlap else hold + rng.uniform(1.0, 4.0)
    return Schedule(seed, tuple(faults))


def _process(fault: Fault) -> str:
    """Which process a fault is on: node2, worker, beat, redis."""
    what = fault.kind.split("-")[1]
    return f"node{fault.target}" if what == "node" else what


@dataclass
class Op:
    """One operation as a client saw it: what it asked, when, and what it was told."""

    client: int
    kind: str  # store | store-no-wait | gather | remove
    name: str
    content: str | None  # the content's SHA-256 (stores), or what a gather returned
    path: str  # the file stored (unique per store), or the gather's output
    invoked: float  # wall-clock seconds
    completed: float | None = None
    exit: int | None = None  # None: killed at CLI_TIMEOUT_S, outcome unknown
    output: str = ""  # its stdout
    error: str = ""  # its stderr


@dataclass
class Final:
    """The cluster after healing, as the checker needs it."""

    requests: dict[str, dict[str, str]]  # request id -> record (args decoded)
    versions: list[dict]  # `smoltorrent ls --json`
    gathered: dict[str, str | None]  # vkey -> SHA-256 gathered (None: the gather failed)
    current: dict[str, str | None]  # name -> SHA-256 gathered of its current version
    open_requests: list[str]
    unsettled: list[str]  # vkeys still pending or removing
    under_replicated: list[dict]


@dataclass
class Report:
    seed: int
    schedule: Schedule
    ops: list[Op]
    faults_applied: list[dict]
    violations: list[str]
    seconds: float

    def figures(self) -> dict:
        """Operations by kind and outcome, faults by kind, violations: plain data."""
        ops: dict[str, dict[str, int]] = {}
        for op in self.ops:
            outcome = "ok" if op.exit == 0 else "failed" if op.exit is not None else "timed out"
            counts = ops.setdefault(op.kind, {})
            counts[outcome] = counts.get(outcome, 0) + 1
        faults: dict[str, int] = {}
        for f in self.faults_applied:
            faults[f["kind"]] = faults.get(f["kind"], 0) + 1
        return {
            "seed": self.seed,
            "seconds": round(self.seconds, 1),
            "operations": ops,
            "faults": faults,
            "violations": self.violations,
        }

    def summary(self) -> str:
        f = self.figures()
        ops = "; ".join(
            f"{kind} " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
            for kind, counts in f["operations"].items()
        )
        faults = ", ".join(f"{n} {kind}" for kind, n in f["faults"].items())
        return (
            f"seed {self.seed}: {len(self.ops)} operations ({ops}); "
            f"{len(self.faults_applied)} faults ({faults}); "
            f"{len(self.violations)} violations; {self.seconds:.0f} s"
        )


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_contents(directory: Path, count: int, size: int) -> list[Path]:
    """`count` checkpoints of about `size` bytes; each after the first is the first with
    one tensor's bytes changed, so versions share blobs (what reference counting guards)."""
    directory.mkdir(parents=True, exist_ok=True)
    base = directory / "content0.safetensors"
    write_checkpoint(base, size, hidden=64)
    header_len = int.from_bytes(base.read_bytes()[:8], "little")
    total = base.stat().st_size
    out = [base]
    for i in range(1, count):
        path = directory / f"content{i}.safetensors"
        data = bytearray(base.read_bytes())
        # A slice of the data section near the end (the lm_head tensor): one shard differs.
        start = max(8 + header_len, total - total // 8)
        data[start : start + 64] = os.urandom(64)
        path.write_bytes(bytes(data))
        out.append(path)
    past = time.time() - 120  # settled: no store waits for the file to stop changing
    for path in out:
        os.utime(path, (past, past))
    return out


def check(ops: list[Op], final: Final, content_names: dict[str, set[str]]) -> list[str]:
    """Every promise the history and the final state must keep; one sentence per breach.

    content_names: for each name, the SHA-256 of every content any store of it sent."""
    bad: list[str] = []
    by_path = {
        json.loads(r["args"]).get("path"): (rid, r)
        for rid, r in final.requests.items()
        if r.get("kind") == "store"
    }
    states = {v["vkey"]: v["state"] for v in final.versions}
    removed_names = {op.name for op in ops if op.kind == "remove"}
    for op in ops:
        if op.kind in ("store", "store-no-wait"):
            rid, req = by_path.get(op.path, (None, None))
            if op.exit == 0 and req is None:
                bad.append(f"{_op(op)} exited 0 but no request of it is recorded (lost)")
            if op.kind == "store" and op.exit == 0 and op.name not in removed_names:
                vkey = _vkey_from(op.output)
                got = final.gathered.get(vkey) if vkey else None
                if got != op.content:
                    bad.append(
                        f"{_op(op)} was acknowledged (version {vkey}) but gathers "
                        f"{got or 'nothing'}, not {op.content[:12]}"
                    )
            done = req is not None and req.get("state") == "done"
            # Exit 3: recorded, outcome unknown (not a failure). Under --json the error
            # is on stdout, so it is quoted from there when stderr has none.
            failed = op.exit not in (0, 3, None)
            if failed and done and states.get(req.get("vkey")) == "committed":
                said = (op.error.strip() or op.output.strip())[-300:]
                bad.append(
                    f"{_op(op)} exited {op.exit} (failed) but its request {rid} "
                    f"committed version {req['vkey']}: {said}"
                )
        elif op.kind == "gather":
            if op.exit == 0 and op.content not in content_names.get(op.name, set()):
                bad.append(f"{_op(op)} exited 0 with bytes no store of {op.name} sent")
            if op.exit not in (0, None) and os.path.exists(op.path):
                bad.append(f"{_op(op)} exited {op.exit} but left a file at {op.path}")
    bad += _check_latest(final, removed_names)
    if final.open_requests:
        bad.append(f"requests still open after healing: {sorted(final.open_requests)}")
    if final.unsettled:
        bad.append(f"versions still pending or removing after healing: {final.unsettled}")
    if final.under_replicated:
        bad.append(f"under-replicated after healing: {final.under_replicated}")
    return bad


def _check_latest(final: Final, removed_names: set[str]) -> list[str]:
    """Each name serves the content of its latest accepted store request (order: the
    requests' sequence numbers) among those that committed."""
    states = {v["vkey"]: v["state"] for v in final.versions}
    content_of = {v["vkey"]: v.get("content") for v in final.versions}
    latest: dict[str, tuple[int, dict]] = {}
    for rec in final.requests.values():
        if rec.get("kind") != "store" or rec.get("state") != "done":
            continue
        name = json.loads(rec["args"])["name"]
        if name in removed_names or states.get(rec.get("vkey", "")) != "committed":
            continue
        seq = int(rec["seq"])
        if name not in latest or seq > latest[name][0]:
            latest[name] = (seq, rec)
    bad = []
    for name, (seq, rec) in sorted(latest.items()):
        want = rec.get("content") or content_of.get(rec["vkey"])
        got = final.current.get(name)
        if want is None:  # nothing to compare with: never a pass, whatever is served
            bad.append(
                f"{name}: the content its latest accepted request (seq {seq}, version"
                f" {rec['vkey'][:12]}) stored is unknown, so what it serves cannot be judged"
            )
        elif got != want:
            bad.append(
                f"{name} serves {str(got)[:12]}, but its latest accepted request (seq {seq},"
                f" version {rec['vkey'][:12]}) stored {str(want)[:12]}"
            )
    return bad


def _op(op: Op) -> str:
    return f"client {op.client} {op.kind} {op.name} @{op.invoked:.2f}"


def _vkey_from(output: str) -> str | None:
    with contextlib.suppress(ValueError, AttributeError):
        return json.loads(output).get("vkey")
    return None


@dataclass
class ChaosRun:
    """One seeded run: cluster up, workload + nemesis for `seconds`, heal, settle, check."""

    root: Path
    seed: int
    seconds: float = 30.0
    nodes: int = 4
    clients: int = 3
    kinds: tuple[str, ...] = field(default_factory=available_kinds)
    overlap: bool = False  # faults held at once (draw_schedule)
    content_bytes: int = 400_000
    say: Callable[[str], None] = print
    cluster: LocalCluster | None = None
    ops: list[Op] = field(default_factory=list)
    faults_applied: list[dict] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _skewed: bool = False  # the worker runs with a skewed clock
    lan: netns.Lan | None = None  # the nodes' namespaces, when a link kind is drawn
    _severed: dict[frozenset[str], int] = field(default_factory=dict)  # pair -> faults on it
    _node_launch: dict[int, tuple[tuple[str, ...], dict[str, str]]] = field(default_factory=dict)

    def run(self) -> Report:
        started = time.monotonic()
        schedule = draw_schedule(self.seed, self.seconds, self.nodes, self.kinds, self.overlap)
        self.say(schedule.describe())
        self.root.mkdir(parents=True, exist_ok=True)
        contents = write_contents(self.root / "contents", 4, self.content_bytes)
        self.digests = {str(p): sha256_file(p) for p in contents}
        self.contents = contents
        self.by_inode = {p.stat().st_ino: self.digests[str(p)] for p in contents}
        fiu = any(k.split("-")[0] in EIO_POINTS for k in self.kinds)
        places, key = self._open_lan() if set(LINK_KINDS) & set(self.kinds) else ((), None)
        self.cluster = LocalCluster(
            self.root / "cluster",
            nodes=self.nodes,
            host_id=f"chaos{self.seed}",
            # Nodes beyond loopback (their own namespaces) serve only with a cluster key.
            cluster_key=key,
            worker_concurrency=4,
            # Gathers write under the run's directory (the worker's list and the CLI's).
            extra_env={**FAST_ENV, GATHER_DIRS_ENV: str(self.root)},
            node_launcher=("fiu-run", "-x") if fiu else (),
            node_places=places,
        )
        mounts = []
        try:
            if "full-node" in self.kinds:
                mounts = self._mount_node_disks()
            self.cluster.start()
            self._cli("nodes", "add", *(str(n.address) for n in self.cluster.node_procs))
            self.cluster.start_beat()
            stop = threading.Event()
            workers = [
                threading.Thread(target=self._client, args=(i, stop), daemon=True)
                for i in range(self.clients)
            ]
            for w in workers:
                w.start()
            self._nemesis(schedule)
            stop.set()
            for w in workers:
                w.join(CLI_TIMEOUT_S + 10)
            self.heal()
            final = self.settle()
            content_names: dict[str, set[str]] = {}
            for op in self.ops:
                if op.kind.startswith("store") and op.content:
                    content_names.setdefault(op.name, set()).add(op.content)
            violations = check(self.ops, final, content_names) + self.leaks()
        finally:
            with contextlib.suppress(Exception):
                self.heal()
            self.cluster.stop()
            for mount in mounts:
                subprocess.run(["umount", "-l", str(mount)], check=False)
            if self.lan is not None:
                self.lan.close()
        report = Report(
            self.seed,
            schedule,
            self.ops,
            self.faults_applied,
            violations,
            time.monotonic() - started,
        )
        (self.root / "history.json").write_text(
            json.dumps(
                {
                    "seed": self.seed,
                    "schedule": [asdict(f) for f in schedule.faults],
                    "faults": self.faults_applied,
                    "ops": [asdict(o) for o in self.ops],
                    "violations": violations,
                },
                indent=1,
            )
        )
        return report

    # --- the workload -----------------------------------------------------------

    def _cli(self, *argv: str, timeout: float = CLI_TIMEOUT_S) -> tuple[int | None, str, str]:
        """Run `smoltorrent ARGV` in a session of its own; (exit status or None if it was
        killed at `timeout`, stdout, stderr)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", *argv],
            env=self.cluster.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return None, out, err
        return proc.returncode, out, err

    def _client(self, index: int, stop: threading.Event) -> None:
        rng = random.Random(f"client:{self.seed}:{index}")
        n = 0
        since_gather = 0
        stored: dict[str, list[Path]] = {}
        while not stop.is_set():
            n += 1
            since_gather += 1
            roll = rng.random()
            name = rng.choice(NAMES)
            if since_gather > GATHER_AT_LEAST_EVERY and stored:
                # A loaded machine runs few operations in the window (11 in 20 s once, none
                # of them drawn a gather): a client still reads back, so a run proves
                # something about gathers under the faults however slow the machine is.
                since_gather = 0
                self._gather(index, n, name if stored.get(name) else min(stored))
            elif roll < 0.45 or not stored.get(name):
                content = rng.choice(self.contents)
                kind = "store-no-wait" if rng.random() < 0.2 else "store"
                stored.setdefault(name, []).append(content)
                self._store(index, n, name, content, kind)
            elif roll < 0.6:
                # A rollback: the name's earlier content again (A, B, A).
                history = stored[name]
                content = history[-2] if len(history) >= 2 else history[-1]
                stored[name].append(content)
                self._store(index, n, name, content, "store")
            elif roll < 0.85:
                since_gather = 0
                self._gather(index, n, name)
            else:
                # A throwaway name stored then removed: its blobs are shared with the
                # others' versions, so a remove that deletes too much shows up there.
                scratch = f"scratch/{index}-{n}.safetensors"
                self._store(index, n, scratch, rng.choice(self.contents), "store")
                self._record(index, "remove", scratch, None, "", ("rm", scratch, "--yes", "--json"))

    def _store(self, client: int, n: int, name: str, content: Path, kind: str) -> None:
        # A path of its own (a hard link: same bytes, same file), so the request it made is
        # found by its path.
        path = self.root / "sources" / f"c{client}-{n}-{len(self.ops)}.safetensors"
        path.parent.mkdir(exist_ok=True)
        os.link(content, path)
        argv = ("store", str(path), "--name", name, "--json")
        if kind == "store-no-wait":
            argv += ("--no-wait",)
        self._record(client, kind, name, self.digests[str(content)], str(path), argv)

    def _gather(self, client: int, n: int, name: str) -> None:
        out = self.root / "gathered" / f"c{client}-{n}.safetensors"
        out.parent.mkdir(exist_ok=True)
        op = self._record(client, "gather", name, None, str(out), ("gather", name, "-o", str(out)))
        if op.exit == 0 and out.exists():
            op.content = sha256_file(out)
            out.unlink()

    def _record(
        self, client: int, kind: str, name: str, content: str | None, path: str, argv
    ) -> Op:
        op = Op(client, kind, name, content, path, time.time())
        with self._lock:
            self.ops.append(op)
        op.exit, op.output, op.error = self._cli(*argv)
        op.completed = time.time()
        return op

    # --- the nemesis --------------------------------------------------------------

    def _nemesis(self, schedule: Schedule) -> None:
        """Each fault in a thread of its own, applied at its time and undone after its
        hold: one after another, or several held at once (an overlapping schedule)."""
        began = time.monotonic()

        def run(fault: Fault) -> None:
            delay = fault.at_s - (time.monotonic() - began)
            if delay > 0:
                time.sleep(delay)
            record = {**asdict(fault), "applied_at": time.time()}
            # A fault that could not be applied or undone whole (a worker restarted while
            # another fault holds Redis down, say) is recorded so; heal() sets it right.
            try:
                self._apply(fault)
                self._hold(fault)
            except Exception as exc:
                record["apply_error"] = repr(exc)
            try:
                self._undo(fault)
            except Exception as exc:
                record["undo_error"] = repr(exc)
            record["healed_at"] = time.time()
            with self._lock:
                self.faults_applied.append(record)

        threads = [threading.Thread(target=run, args=(f,), daemon=True) for f in schedule.faults]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rest = self.seconds - (time.monotonic() - began)
        if rest > 0:
            time.sleep(rest)

    def _pid(self, fault: Fault) -> int | None:
        c = self.cluster
        what = fault.kind.split("-")[1]
        if what == "node":
            node = c.node_procs[fault.target]
            return node.pid if node.is_running() else None
        if what == "redis":
            return c.redis_pid
        proc = c.worker if what == "worker" else c.beat
        return proc.pid if proc is not None and proc.poll() is None else None

    def _apply(self, fault: Fault) -> None:
        action, what = fault.kind.split("-")
        if action in ("cutcoord", "cutpeers"):
            for pair in self._pairs(fault):
                self._sever(*pair)
            return
        pid = self._pid(fault)
        if pid is None or action == "flap":
            return
        c = self.cluster
        if action in EIO_POINTS:
            _fiu_ctrl(pid, f"enable name={EIO_POINTS[action]},failinfo={errno.EIO}")
        elif action == "skew" and what == "node":
            self._restart_node_skewed(fault.target, fault.skew_s)
        elif action == "full":
            _fill(c.node_procs[fault.target].data_dir / FILLER)
        elif action == "skew":
            c.kill_worker()
            self._skewed = True
            c.start_worker(env=_skewed(fault.target))
        elif action == "stop":
            # A whole group for the worker and beat (a worker's pool children too).
            if what in ("worker", "beat"):
                os.killpg(pid, signal.SIGSTOP)
            else:
                os.kill(pid, signal.SIGSTOP)
        elif what == "node":
            c.node_procs[fault.target].kill()
        elif what == "redis":
            c.kill_redis()
        elif what == "worker":
            c.kill_worker()
        else:
            os.killpg(pid, signal.SIGKILL)
            c.beat.wait()

    def _hold(self, fault: Fault) -> None:
        """Wait out the fault's hold; a flapping link goes out and in meanwhile."""
        if fault.kind != "flap-node":
            time.sleep(fault.hold_s)
            return
        assert self.lan is not None
        host = _node_host(fault.target)
        end = time.monotonic() + fault.hold_s
        while time.monotonic() < end:
            self.lan.cut(host)
            time.sleep(FLAP_HALF_PERIOD_S)
            self.lan.reconnect(host)
            time.sleep(min(FLAP_HALF_PERIOD_S, max(end - time.monotonic(), 0)))

    def _undo(self, fault: Fault) -> None:
        action, what = fault.kind.split("-")
        if action in ("cutcoord", "cutpeers"):
            for pair in self._pairs(fault):
                self._mend(*pair)
            return
        if action == "flap":
            assert self.lan is not None
            self.lan.reconnect(_node_host(fault.target))
            return
        if action in EIO_POINTS:
            if (pid := self._pid(fault)) is not None:
                _fiu_ctrl(pid, f"disable name={EIO_POINTS[action]}")
            return
        if action == "skew" and what == "node":
            self._restart_node_skewed(fault.target, 0)
            return
        if action == "full":
            (self.cluster.node_procs[fault.target].data_dir / FILLER).unlink(missing_ok=True)
            return
        if action == "skew":
            self.cluster.kill_worker()
            self._skewed = False
            self.cluster.start_worker()
            return
        if action == "stop":
            pid = self._pid(fault)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    if what in ("worker", "beat"):
                        os.killpg(pid, signal.SIGCONT)
                    else:
                        os.kill(pid, signal.SIGCONT)
            return
        self._restart(what, fault.target)

    def _restart(self, what: str, target: int = 0) -> None:
        c = self.cluster
        if what == "node" and not c.node_procs[target].is_running():
            c.node_procs[target].start()
        elif what == "redis" and not (c.redis_pid and _alive(c.redis_pid)):
            c.start_redis()
        elif what == "worker" and (c.worker is None or c.worker.poll() is not None):
            c.start_worker()
        elif what == "beat" and (c.beat is None or c.beat.poll() is not None):
            c.start_beat()

    # --- links and clocks of the nodes ---------------------------------------------

    def _open_lan(self) -> tuple[tuple[tuple[str, tuple[str, ...]], ...], str]:
        """Each node in a namespace of its own on one switch, this namespace (Redis, the
        worker, beat, the CLI) on a port of it too; where each node runs, and the cluster
        key nodes beyond loopback need."""
        netns.remove_stale(NETNS_TAG)
        hosts = [COORDINATOR_HOST, *(_node_host(i) for i in range(self.nodes))]
        with netns.subnet_lock():
            self.lan = netns.Lan(
                hosts,
                prefix=f"{NETNS_TAG}{os.getpid()}",
                subnet=netns.free_subnet(),
                local_host=COORDINATOR_HOST,
            ).open()
        places = tuple(
            (self.lan.address(_node_host(i)), tuple(self.lan.exec_prefix(_node_host(i))))
            for i in range(self.nodes)
        )
        return places, secrets.token_hex(32)

    def _pairs(self, fault: Fault) -> list[tuple[str, str]]:
        """The host pairs a cut fault severs: the node and the coordinator, or the node and
        each other node."""
        node = _node_host(fault.target)
        if fault.kind == "cutcoord-node":
            return [(node, COORDINATOR_HOST)]
        return [(node, _node_host(i)) for i in range(self.nodes) if i != fault.target]

    def _sever(self, a: str, b: str) -> None:
        # Counted: two held faults may cut one pair (node1's and node2's peers), and the
        # first to heal must not mend it under the other.
        assert self.lan is not None
        pair = frozenset((a, b))
        with self._lock:
            self._severed[pair] = self._severed.get(pair, 0) + 1
            if self._severed[pair] == 1:
                self.lan.sever(a, b)

    def _mend(self, a: str, b: str) -> None:
        assert self.lan is not None
        pair = frozenset((a, b))
        with self._lock:
            self._severed[pair] = max(self._severed.get(pair, 0) - 1, 0)
            if self._severed[pair] == 0:
                self.lan.mend(a, b)

    def _restart_node_skewed(self, index: int, seconds: int) -> None:
        """Stop node `index` and start it again with its clock `seconds` off (0: true).
        libfaketime is added to the LD_PRELOAD the launcher set (fiu-run sets its own), by
        a shell that then execs the node: the pid stays the node's."""
        node = self.cluster.node_procs[index]
        base_launcher, base_env = self._node_launch.setdefault(
            index, (node.launcher, dict(node.env))
        )
        node.stop()
        node.launcher, node.env = base_launcher, dict(base_env)
        if seconds:
            preload = f'export LD_PRELOAD="${{LD_PRELOAD:+$LD_PRELOAD }}{FAKETIME_LIB}"; exec "$@"'
            node.launcher = (*base_launcher, "sh", "-c", preload, "sh")
            node.env.update({k: v for k, v in _skewed(seconds).items() if k != "LD_PRELOAD"})
        node.start()

    def _mount_node_disks(self) -> list[Path]:
        """A tmpfs of NODE_FS_BYTES for each node's data directory, so full-node fills a
        disk of the node's own and nothing else."""
        mounts = []
        for i in range(self.nodes):
            data = self.root / "cluster" / f"node{i}"  # LocalCluster's layout
            data.mkdir(parents=True, exist_ok=True)
            size = f"size={NODE_FS_BYTES}"
            subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(data)], check=True)
            mounts.append(data)
        return mounts

    def heal(self) -> None:
        """Every process running and none stopped."""
        c = self.cluster
        for pid in [c.redis_pid, *(n.pid for n in c.node_procs if n.is_running())]:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(pid, signal.SIGCONT)
        for proc in (c.worker, c.beat):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
        self._restart("redis")
        if self.lan is not None:
            for pair in [p for p, n in self._severed.items() if n]:
                self._severed[pair] = 0
                self.lan.mend(*pair)
            for i in range(self.nodes):
                self.lan.reconnect(_node_host(i))
        for i, node in enumerate(c.node_procs):
            if i in self._node_launch and node.launcher != self._node_launch[i][0]:
                self._restart_node_skewed(i, 0)
            self._restart("node", i)
            (node.data_dir / FILLER).unlink(missing_ok=True)
            for kind, point in EIO_POINTS.items():
                if f"{kind}-node" in self.kinds:
                    _fiu_ctrl(node.pid, f"disable name={point}")
        if self._skewed:
            c.kill_worker()
        self._restart("worker")
        self._restart("beat")

    # --- after the faults -----------------------------------------------------------

    def settle(self) -> Final:
        """Wait (bounded) until requests are closed, nothing is pending and every shard is
        at R; then read what the checker needs."""
        r = redis.Redis.from_url(self.cluster.redis_url, decode_responses=True)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            open_rids = r.zrange(K.REQUESTS_OPEN, 0, -1)
            _, status, _ = self._cli("status", "--json")
            versions = json.loads(self._cli("ls", "--json")[1] or "[]")
            unsettled = [v["vkey"] for v in versions if v["state"] in ("pending", "removing")]
            under = _json_or(status, {}).get("under_replicated", ["status failed"])
            if (not open_rids and not unsettled and not under) or time.monotonic() > deadline:
                break
            time.sleep(1)
        requests = {}
        for key in r.scan_iter(K.REQUEST.format(rid="*"), count=1000):
            requests[key.rsplit(":", 1)[1]] = r.hgetall(key)
        r.close()
        content_of = {}
        for rec in requests.values():
            if rec.get("kind") == "store" and rec.get("vkey"):
                path = json.loads(rec["args"])["path"]
                content_of[rec["vkey"]] = self._content_of_source(path)
        for v in versions:
            v["content"] = content_of.get(v["vkey"])
        # Four gathers at a time (the worker's concurrency): each is a CLI process, most of
        # its time spent starting, and one after another they took most of a short run.
        committed = [v for v in versions if v["state"] == "committed"]
        with ThreadPoolExecutor(max_workers=4) as pool:
            gathered = dict(
                zip(
                    (v["vkey"] for v in committed),
                    pool.map(lambda v: self._final_gather(v["name"], v["version_id"]), committed),
                    strict=True,
                )
            )
            current = dict(zip(NAMES, pool.map(self._final_gather, NAMES), strict=True))
        return Final(requests, versions, gathered, current, open_rids, unsettled, under)

    def leaks(self) -> list[str]:
        """Invariant 14 once the sweeps have run (coordinator/state/leaks.py): references
        in Redis against the manifests, and every blob on a node used by a version or
        noted by the crosscheck for collection. A node that does not answer is said."""
        md = Metadata(self.cluster.redis_url)
        try:
            for attempt in range(2):
                inventories, unread = {}, []
                for node in self.cluster.node_procs:
                    try:
                        client = node.client()
                        inventories[client.ping()] = set(client.list_blobs())
                    except SmoltorrentError as exc:
                        unread.append(f"leak check: node {node.address} not read: {exc}")
                found = find_leaks(md, inventories) + unread
                if not found or attempt:
                    return [f"leak: {x}" for x in found]
                period = float(FAST_ENV["SMOLTORRENT_CROSSCHECK_INTERVAL_S"])
                time.sleep(LEAK_RECHECK_PERIODS * period)
        finally:
            md.close()
        return []

    def _content_of_source(self, path: str) -> str | None:
        """The content a store's source holds: each is a hard link to one of them."""
        with contextlib.suppress(OSError):
            return self.by_inode.get(os.stat(path).st_ino)
        return None

    def _final_gather(self, name: str, version_id: str | None = None) -> str | None:
        out = self.root / "final" / hashlib.sha256(f"{name}{version_id}".encode()).hexdigest()
        out.parent.mkdir(exist_ok=True)
        argv = ["gather", name, "-o", str(out)] + (["--version", version_id] if version_id else [])
        code, _, _ = self._cli(*argv)
        if code != 0 or not out.exists():
            return None
        digest = sha256_file(out)
        out.unlink()
        return digest


FILLER = "chaos-filler"  # the file full-node grows in a node's data directory


def _node_host(index: int) -> str:
    """Node `index`'s host name on the LAN (its namespace's suffix)."""
    return f"n{index}"


def _fill(path: Path) -> None:
    """Write zeros to `path` until its file system has no byte left."""
    with contextlib.suppress(OSError), open(path, "ab", buffering=0) as filler:
        while True:
            filler.write(bytes(1 << 20))
    with contextlib.suppress(OSError), open(path, "ab", buffering=0) as filler:
        while True:
            filler.write(bytes(4096))  # the last partial megabyte


def _fiu_ctrl(pid: int, command: str) -> None:
    """Send libfiu's control command to a node run under fiu-run; a node that died
    meanwhile (another fault, or none) has no control pipe left, which is fine."""
    subprocess.run(["fiu-ctrl", "-c", command, str(pid)], capture_output=True, timeout=10)


def _skewed(seconds: int) -> dict[str, str]:
    """The environment that sets a process's wall clock `seconds` off (libfaketime);
    its monotonic clock stays true, as NTP slewing would leave it."""
    return {
        "LD_PRELOAD": FAKETIME_LIB,
        "FAKETIME": f"{seconds:+d}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
    }


def _json_or(text: str, default):
    try:
        return json.loads(text)
    except ValueError:
        return default
