"""The API runs in a child process with the cluster's environment, as a training script
does: tasks.app reads SMOLTORRENT_REDIS_URL once, at import."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.tasks.conftest import make_cluster  # noqa: F401  (the fixture, shared)

ROOT = Path(__file__).resolve().parents[2]


def run_api(cluster, script: str, *, timeout: float = 240, check: bool = True):
    """Run `script` with the cluster's environment; its last stdout line, parsed as JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=cluster.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if not check:
        return proc
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


END = "\x00end "  # the line after each script's output: END, then whether it ran through
# The session's loop: each stdin line a script (JSON), run as `python -c` would run it, in
# a namespace of its own; then END and whether it raised (its traceback on stderr).
SESSION = f"""
import json, sys, traceback
END = {END!r}
for line in sys.stdin:
    try:
        exec(compile(json.loads(line), "<script>", "exec"), {{"__name__": "__main__"}})
        ok = True
    except BaseException:
        traceback.print_exc()
        ok = False
    sys.stderr.flush()
    print(END + json.dumps(ok), flush=True)
"""


class ApiSession:
    """One API process with the cluster's environment that runs scripts in turn, each as
    run_api runs one: torch and the API are imported once for all of them (a child's
    import of torch is ~2 s of CPU), as one training script saves and loads many times.
    Use it where a test's children would run one after the other with nothing between
    them that needs a new process."""

    def __init__(self, cluster, *, timeout: float = 240):
        self.timeout = timeout
        self.err_path = cluster.root / f"session-{uuid.uuid4().hex[:8]}.err"
        # A file, not a pipe: a pipe left unread would fill and block the session.
        self.err = self.err_path.open("w+")  # noqa: SIM115  (closed by close())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SESSION],
            env=cluster.env(),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def run(self, script: str, *, check: bool = True):
        """`script`'s last stdout line, parsed as JSON; with check=False, (ok, that line
        or None, the stderr it wrote) instead of failing when it raised."""
        assert self.proc.stdin is not None
        start = self.err.seek(0, 2)
        self.proc.stdin.write(json.dumps(textwrap.dedent(script)) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + self.timeout
        last = None
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the script ran past {self.timeout} s") from None
            if line is None:
                raise AssertionError(f"the session ended: exit {self.proc.wait()}\n{self._err(0)}")
            if line.startswith(END):
                ok = json.loads(line[len(END) :])
                break
            last = line
        if not check:
            return ok, last, self._err(start)
        assert ok, f"the script raised\n{self._err(start)}"
        assert last is not None, "the script printed nothing"
        return json.loads(last)

    def _err(self, start: int) -> str:
        self.err.flush()
        self.err.seek(start)
        return self.err.read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()

    def __enter__(self) -> ApiSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def api_session():
    """make(cluster): an ApiSession on the cluster, closed at the test's end (before the
    cluster stops, when asked for after make_cluster)."""
    sessions: list[ApiSession] = []

    def make(cluster, **kwargs) -> ApiSession:
        sessions.append(ApiSession(cluster, **kwargs))
        return sessions[-1]

    yield make
    for session in sessions:
        session.close()
