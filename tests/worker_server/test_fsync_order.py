"""Where a node's fsyncs are (invariant 3), read from the system calls it makes.

Only a power cut shows a missing fsync; the node's system calls show it without one. strace
is attached to real nodes while they take blobs (a put, a chain of two, a replication),
manifests (whole and in parts) and deletes, and the trace must show, for every name made
or removed in the node's blob and manifest directories:
- the file's bytes fsynced after its last write and before it is renamed into place (no
  blob or manifest is visible before its bytes are on disk);
- its directory fsynced after the rename or unlink and before that thread next writes to a
  socket (nothing is acknowledged that a power cut could take back).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from coordinator.local.cluster import NodeProcess

SYSCALLS = (
    "pwrite64,write,fsync,fdatasync,rename,renameat,renameat2,unlink,unlinkat,"
    "sendto,sendmsg,sendfile"
)
ATTACH_TIMEOUT_S = 30.0  # seconds for strace to attach to every thread of a node
# One line of `strace -f -yy`: the thread, the call, its arguments (fds shown <path>).
CALL = re.compile(r"^(\d+)\s+(\w+)\((.*)$")
FD_PATH = re.compile(r"^\d+<(.*?)>")
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


@contextmanager
def traced(node: NodeProcess, out: Path) -> Iterator[None]:
    """strace attached to every thread of a running node, detached at the end."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (Debian: apt-get install strace)")
    errors = out.with_suffix(".err")
    threads = len(os.listdir(f"/proc/{node.pid}/task"))
    with open(errors, "wb") as stderr:
        strace = subprocess.Popen(
            ["strace", "-f", "-yy", "-e", f"trace={SYSCALLS}", "-o", str(out)]
            + ["-p", str(node.pid)],
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        while errors.read_text().count(" attached") < threads:
            assert strace.poll() is None, errors.read_text()
            assert time.monotonic() < deadline, f"strace did not attach: {errors.read_text()}"
            time.sleep(0.05)
        yield
    finally:
        strace.send_signal(signal.SIGINT)  # detaches; the node serves on
        strace.wait(timeout=30)


@dataclass
class Order:
    """What the trace of one node shows, call by call (see the module's docstring)."""

    data_dir: Path
    dirty: dict[str, bool] = field(default_factory=dict)  # a file: written since its fsync
    unsynced: dict[str, list[str]] = field(default_factory=dict)  # a thread: dirs to fsync
    synced: dict[str, int] = field(default_factory=dict)  # a thread: names not yet replied to
    published: int = 0
    acknowledged: int = 0
    faults: list[str] = field(default_factory=list)

    def owned(self, path: str) -> bool:
        """A name the invariant covers: a blob, a manifest, a quarantined copy."""
        if not path.startswith(f"{self.data_dir}/"):
            return False
        return Path(path).relative_to(self.data_dir).parts[0] in ("blobs", "manifests")

    def read(self, trace: str) -> Order:
        for line in trace.splitlines():
            call = CALL.match(line)
            if call is None or "resumed>" in line or ") = -1 " in line:
                continue  # an exit, a signal, a call that failed, or a call's end
            thread, name, args = call.groups()
            fd = FD_PATH.match(args)
            target = fd[1] if fd else ""
            if name in ("pwrite64", "write") and target.startswith(f"{self.data_dir}/"):
                self.dirty[target] = True
            elif name in ("fsync", "fdatasync"):
                self.dirty[target] = False
                waiting = self.unsynced.get(thread, [])
                self.synced[thread] = self.synced.get(thread, 0) + waiting.count(target)
                self.unsynced[thread] = [d for d in waiting if d != target]
            elif name in ("rename", "renameat", "renameat2"):
                source, destination = QUOTED.findall(args)[:2]
                if self.owned(destination):
                    self.published += 1
                    if self.dirty.get(source, True):
                        self.faults.append(f"renamed before its bytes were fsynced: {line}")
                    self.unsynced.setdefault(thread, []).append(str(Path(destination).parent))
            elif name in ("unlink", "unlinkat"):
                [removed] = QUOTED.findall(args)[:1]
                if self.owned(removed):
                    self.published += 1
                    self.unsynced.setdefault(thread, []).append(str(Path(removed).parent))
            elif name in ("sendto", "sendmsg", "write", "sendfile") and "TCP" in target:
                if self.unsynced.get(thread):
                    left = sorted(set(self.unsynced.pop(thread)))
                    self.faults.append(f"a reply before {left} was fsynced: {line}")
                self.acknowledged += self.synced.pop(thread, 0)
        return self


def test_every_name_a_node_makes_or_removes_is_durable_before_it_is_acknowledged(
    node_factory, make_blob, tmp_path: Path
) -> None:
    nodes = [node_factory("a"), node_factory("b")]
    traces = [tmp_path / "a.trace", tmp_path / "b.trace"]
    big = make_blob(3 * 1024 * 1024 + 17)  # arrives in many reads, written as it comes
    chained = make_blob(2 * 1024 * 1024)
    copied = make_blob(64 * 1024)
    with traced(nodes[0], traces[0]), traced(nodes[1], traces[1]):
        a = nodes[0].client()
        assert make_blob(1000).put(a)
        assert big.put(a)
        a.chain_put(
            chained.digest, chained.prefix, chained.fd, chained.offset, chained.length,
            [nodes[1].address],
        )  # fmt: skip
        assert copied.put(a) and a.replicate(copied.digest, nodes[1].address)
        a.put_manifest("v1", b'{"name": "run/v1"}')
        a.put_manifest("v2", b"x" * (17 * 1024 * 1024))  # over one body: in parts
        assert a.delete(big.digest) and a.delete_manifest("v1")
    orders = [Order(n.data_dir).read(t.read_text()) for n, t in zip(nodes, traces, strict=True)]
    assert [o.faults for o in orders] == [[], []]
    # Everything above was seen, and acknowledged: the checks were not vacuous. Node a
    # made 4 blobs and 2 manifests and removed 2; node b took the chain's and the copy's.
    assert [o.published for o in orders] == [8, 2]
    assert [o.acknowledged for o in orders] == [8, 2]
