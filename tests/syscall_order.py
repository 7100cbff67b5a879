"""Whether a process makes its files durable before it says they are there, read from its
system calls with strace (only a power cut shows a missing fsync; the trace shows it
without one).

For every name the process makes (rename) or removes (unlink) among the paths a test
owns, the trace must show:
- the file's bytes fsynced after its last write and before the rename (nothing becomes
  visible before its bytes are on disk);
- its directory fsynced after the rename or unlink and before that thread next says so
  (a write to a socket, or to the process's stdout: nothing is acknowledged that a power
  cut could take back).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SYSCALLS = (
    "pwrite64,write,writev,fsync,fdatasync,rename,renameat,renameat2,unlink,unlinkat,"
    "sendto,sendmsg,sendfile"
)
STRACE = ("strace", "-f", "-yy", "-e", f"trace={SYSCALLS}")  # then -o FILE, and -p or argv
ATTACH_TIMEOUT_S = 30.0  # seconds for strace to attach to every thread of a process
# One line of `strace -f -yy`: the thread, the call, its arguments (an fd shown N<path>).
CALL = re.compile(r"^(\d+)\s+(\w+)\((.*)$")
FD = re.compile(r"^(\d+)<(.*?)>")
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
WRITES = ("pwrite64", "write", "writev")
SAYS = ("sendto", "sendmsg", "sendfile", "write", "writev")


def require_strace() -> None:
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (Debian: apt-get install strace)")


@contextmanager
def attached(pid: int, out: Path) -> Iterator[None]:
    """strace attached to every thread of a running process, detached at the end."""
    require_strace()
    errors = out.with_suffix(".err")
    threads = len(os.listdir(f"/proc/{pid}/task"))
    with open(errors, "wb") as stderr:
        strace = subprocess.Popen([*STRACE, "-o", str(out), "-p", str(pid)], stderr=stderr)
    try:
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        while errors.read_text().count(" attached") < threads:
            assert strace.poll() is None, errors.read_text()
            assert time.monotonic() < deadline, f"strace did not attach: {errors.read_text()}"
            time.sleep(0.05)
        yield
    finally:
        strace.send_signal(signal.SIGINT)  # detaches; the process goes on
        strace.wait(timeout=30)


def says_over_tcp(thread: str, fd: int, target: str) -> bool:
    """A node acknowledges with a reply on its connection."""
    return target.startswith("TCP")


def prints(trace: str) -> Callable[[str, int, str], bool]:
    """A command acknowledges with what its main thread prints (its result, its JSON, or a
    trainer's line once save() returned): the traced process's first thread, not a child
    it started (a save's writer process reports on its own stdout, to the trainer)."""
    main = trace.split(None, 1)[0]
    return lambda thread, fd, target: thread == main and fd == 1


@dataclass
class DurableOrder:
    """What one trace shows, call by call (see the module's docstring). `owned`: the paths
    whose names must be durable; `says`: whether a thread's write to (fd, its path)
    acknowledges them."""

    owned: Callable[[str], bool]
    says: Callable[[str, int, str], bool]
    dirty: dict[str, bool] = field(default_factory=dict)  # a file: written since its fsync
    unsynced: dict[str, list[str]] = field(default_factory=dict)  # a thread: dirs to fsync
    synced: dict[str, int] = field(default_factory=dict)  # a thread: names not yet said
    made: int = 0  # names made or removed
    acknowledged: int = 0  # of those, made durable and then said
    faults: list[str] = field(default_factory=list)

    def read(self, trace: str) -> DurableOrder:
        for line in trace.splitlines():
            call = CALL.match(line)
            if call is None or "resumed>" in line or ") = -1 " in line:
                continue  # an exit, a signal, a call that failed, or a call's end
            thread, name, args = call.groups()
            fd = FD.match(args)
            number, target = (int(fd[1]), fd[2]) if fd else (-1, "")
            if name in ("fsync", "fdatasync"):
                self.dirty[target] = False
                waiting = self.unsynced.get(thread, [])
                self.synced[thread] = self.synced.get(thread, 0) + waiting.count(target)
                self.unsynced[thread] = [d for d in waiting if d != target]
            elif name in ("rename", "renameat", "renameat2"):
                source, destination = QUOTED.findall(args)[:2]
                if self.owned(destination):
                    if self.dirty.get(source, True):
                        self.faults.append(f"renamed before its bytes were fsynced: {line}")
                    self._made(thread, destination)
            elif name in ("unlink", "unlinkat"):
                [removed] = QUOTED.findall(args)[:1]
                if self.owned(removed):
                    self._made(thread, removed)
            elif name in SAYS and self.says(thread, number, target):
                if self.unsynced.get(thread):
                    left = sorted(set(self.unsynced.pop(thread)))
                    self.faults.append(f"said before {left} was fsynced: {line}")
                self.acknowledged += self.synced.pop(thread, 0)
            elif name in WRITES and target:
                self.dirty[target] = True
        return self

    def _made(self, thread: str, path: str) -> None:
        self.made += 1
        self.unsynced.setdefault(thread, []).append(os.path.dirname(path))


def under(*directories: Path) -> Callable[[str], bool]:
    """Paths inside any of `directories`."""
    prefixes = tuple(f"{d}/" for d in directories)
    return lambda path: path.startswith(prefixes)
