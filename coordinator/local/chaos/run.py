"""One seeded run (`ChaosRun`): the cluster up, clients and nemesis for its seconds, heal,
settle, check, stop."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
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

from coordinator.local.chaos.checker import check
from coordinator.local.chaos.faults import EIO_POINTS, LINK_KINDS, available_kinds, draw_schedule
from coordinator.local.chaos.history import Final, Op, Report
from coordinator.local.chaos.nemesis import Nemesis
from coordinator.local.chaos.workload import (
    GATHER_AT_LEAST_EVERY,
    NAMES,
    Contents,
    sha256_file,
)
from coordinator.local.cluster import LocalCluster
from coordinator.state import redis_keys as K
from coordinator.state.leaks import find_leaks
from coordinator.state.metadata import Metadata
from coordinator.state.sweeps import Sweeps
from smoltorrent.errors import SmoltorrentError

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
DIAGNOSIS_LOG_LINES = 30  # the worker's last warnings a run that did not settle reports
# The beat sweeps whose runs it reports (beat/: each module's @sweep name)
SWEEP_NAMES = ("health", "repair", "reconcile", "crosscheck", "scrub", "retention")


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
    nemesis: Nemesis | None = None
    contents: Contents | None = None
    digest_of: dict[str, str] = field(default_factory=dict)  # source path -> its SHA-256
    cli_env: dict[str, str] = field(default_factory=dict)  # over the CLI commands' environment
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> Report:
        started = time.monotonic()
        schedule = draw_schedule(self.seed, self.seconds, self.nodes, self.kinds, self.overlap)
        self.say(schedule.describe())
        self.nemesis = Nemesis(self.root, self.nodes, self.kinds, self.seconds)
        self.root.mkdir(parents=True, exist_ok=True)
        self.contents = Contents(self.root / "contents", self.content_bytes)
        fiu = any(k.split("-")[0] in EIO_POINTS for k in self.kinds)
        places, key = self.nemesis.open_lan() if set(LINK_KINDS) & set(self.kinds) else ((), None)
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
                mounts = self.nemesis.mount_node_disks()
            self.cluster.start()
            self.nemesis.cluster = self.cluster
            self._cli("nodes", "add", *(str(n.address) for n in self.cluster.node_procs))
            self.cluster.start_beat()
            stop = threading.Event()
            workers = [
                threading.Thread(target=self._client, args=(i, stop), daemon=True)
                for i in range(self.clients)
            ]
            for w in workers:
                w.start()
            self.nemesis.run(schedule)
            stop.set()
            for w in workers:
                w.join(CLI_TIMEOUT_S + 10)
            self.nemesis.heal()
            final = self.settle()
            violations = check(self.ops, final, self.nemesis.faults_applied)
            violations += self.nemesis.unhealed() + self.leaks()
        finally:
            with contextlib.suppress(Exception):
                self.nemesis.heal()
            self.cluster.stop()
            for mount in mounts:
                subprocess.run(["umount", "-l", str(mount)], check=False)
            if self.nemesis.lan is not None:
                self.nemesis.lan.close()
        report = Report(
            self.seed,
            schedule,
            self.ops,
            self.nemesis.faults_applied,
            violations,
            time.monotonic() - started,
        )
        (self.root / "history.json").write_text(
            json.dumps(
                {
                    "seed": self.seed,
                    "schedule": [asdict(f) for f in schedule.faults],
                    "faults": self.nemesis.faults_applied,
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
            env={**self.cluster.env(), **self.cli_env},
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
        stored: dict[str, list[Path]] = {}  # name -> the sources this client stored under it
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
                kind = "store-no-wait" if rng.random() < 0.2 else "store"
                stored.setdefault(name, []).append(self._store(index, n, name, kind))
            elif roll < 0.6:
                # A rollback: the name's earlier content again (A, B, A), a request of its
                # own that writes the bytes of the store it rolls back to.
                history = stored[name]
                earlier = history[-2] if len(history) >= 2 else history[-1]
                history.append(self._store(index, n, name, "rollback", earlier))
            elif roll < 0.85:
                since_gather = 0
                self._gather(index, n, name)
            else:
                # A throwaway name stored then removed: its blobs are shared with the
                # others' versions, so a remove that deletes too much shows up there.
                # Then it is gathered: once `rm` exited 0 nothing may be served under it.
                scratch = f"scratch/{index}-{n}.safetensors"
                self._store(index, n, scratch, "store")
                self._record(index, "remove", scratch, None, "", ("rm", scratch, "--yes", "--json"))
                self._gather(index, n, scratch)

    def _store(
        self, client: int, n: int, name: str, kind: str, rollback_to: Path | None = None
    ) -> Path:
        """Store (or roll back to) content of its own at a path of its own, so the request
        it made is found by its path; a rollback's source is a hard link to the earlier
        store's (same bytes). The source's path."""
        path = self.root / "sources" / f"c{client}-{n}-{len(self.ops)}.safetensors"
        path.parent.mkdir(exist_ok=True)
        if rollback_to is None:
            digest = self.contents.write(path, f"{self.seed}:{client}:{n}:{name}")
        else:
            os.link(rollback_to, path)
            digest = self.digest_of[str(rollback_to)]
        self.digest_of[str(path)] = digest
        argv = ("store", str(path), "--name", name, "--json")
        if kind == "store-no-wait":
            argv += ("--no-wait",)
        self._record(client, kind, name, digest, str(path), argv)
        return path

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

    # --- after the faults -----------------------------------------------------------

    def settle(self) -> Final:
        """Wait (bounded) until requests are closed, nothing is pending and every shard is
        at R; then read what the checker needs."""
        r = redis.Redis.from_url(self.cluster.redis_url, decode_responses=True)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        diagnosis = ""
        while True:
            open_rids = r.zrange(K.REQUESTS_OPEN, 0, -1)
            _, status, _ = self._cli("status", "--json")
            versions = json.loads(self._cli("ls", "--json")[1] or "[]")
            unsettled = [v["vkey"] for v in versions if v["state"] in ("pending", "removing")]
            under = _json_or(status, {}).get("under_replicated", ["status failed"])
            if not open_rids and not unsettled and not under:
                break
            if time.monotonic() > deadline:
                # Not settled: what the sweeps were doing goes into the verdict, so a
                # failure seen once (a loaded CI run) says why without a replay.
                diagnosis = self._diagnosis(r, _json_or(status, {}))
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
            # A scratch name whose rm did not exit 0 may keep a version: its current too.
            kept = {op.name for op in self.ops if op.kind == "remove" and op.exit != 0}
            names = [*NAMES, *sorted(kept)]
            current = dict(zip(names, pool.map(self._final_gather, names), strict=True))
        return Final(requests, versions, gathered, current, open_rids, unsettled, under, diagnosis)

    def _diagnosis(self, r: redis.Redis, status: dict) -> str:
        """What a run that did not settle leaves to read: the nodes' health, the repairs
        in flight, backing off or impossible, each sweep's last run, stand-downs and lock,
        and the worker's last warnings."""
        record = Sweeps(r)
        now = record.redis_time()
        sweeps = {}
        for name in SWEEP_NAMES:
            runs = record.sweep_runs(name)
            sweeps[name] = {
                "last_finished_s_ago": round(now - runs[-1]["finished"], 1) if runs else None,
                "last_outcome": runs[-1]["outcome"] if runs else None,
                "skipped": record.sweep_skips(name),
                "lock": r.get(K.SWEEP_LOCK.format(name=name)),
                "lock_ttl_s": r.ttl(K.SWEEP_LOCK.format(name=name)),
            }
        log = self.cluster.root / "worker.log"
        warnings = [
            line[:300]
            for line in (log.read_text(errors="replace").splitlines() if log.exists() else [])
            if "WARNING" in line or "ERROR" in line
        ][-DIAGNOSIS_LOG_LINES:]
        found = {
            "nodes": [
                {k: n.get(k) for k in ("node_id", "up", "state")} for n in status.get("nodes", [])
            ],
            "unrepairable": status.get("unrepairable"),
            "repairs_in_flight": status.get("repairs_in_flight"),
            "repairs_waiting": status.get("repairs_waiting"),
            "sweeps": sweeps,
            "worker_warnings": warnings,
        }
        return json.dumps(found, indent=1, default=str)

    def leaks(self) -> list[str]:
        """Invariant 14 once the sweeps have run (coordinator/state/leaks.py): references
        in Redis against the manifests, and every blob on a node used by a version or
        noted by the crosscheck for collection. A node that does not answer is said."""
        md = Metadata(self.cluster.redis_url)
        try:
            for attempt in range(2):
                inventories, unread = {}, []
                for i, node in enumerate(self.cluster.node_procs):
                    if i in self.nemesis.lost:
                        continue
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
        """The content a store's source holds (each written by _store, so known)."""
        return self.digest_of.get(path)

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


def _json_or(text: str, default):
    try:
        return json.loads(text)
    except ValueError:
        return default
