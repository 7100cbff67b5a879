"""`worker` and `beat` run without the CLI's rendering: every prefork pool child starts as
a copy of the worker, so whatever the worker imports, each child carries too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from coordinator.local.synthetic import write_checkpoint
from tests.tasks.conftest import wait_until

RENDERING = (
    "rich",
    "coordinator.cli.transfer_commands",
    "coordinator.cli.listing_commands",
    "coordinator.cli.node_commands",
    "coordinator.cli.operation_commands",
    "coordinator.cli.daemon_commands",
    "coordinator.cli.output",
    "coordinator.cli.reports",
)

# What `smoltorrent worker` imports before Celery takes over: the entry point, the command
# and the app (the tasks and everything they use).
PROBE = """
import sys
from coordinator.cli import main, services
import tasks.app
print(sorted(m for m in sys.modules if m.split(".")[0] == "rich" or m in {rendering!r}))
"""


def test_the_worker_and_beat_commands_import_none_of_the_cli_rendering():
    code = PROBE.format(rendering=set(RENDERING[1:]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# What a command under --json goes through: its imports, the no-bar and the JSON writers.
JSON_PROBE = """
import sys
from coordinator.cli import main, transfer_commands
from coordinator.cli.output import emit_json, error
with transfer_commands._progress(as_json=True) as bar:
    bar.update(bar.add_task("gathering", total=1), completed=1)
emit_json({"ok": True})
error("a failure", "a hint", as_json=True)
print(sorted(m for m in sys.modules if m.split(".")[0] == "rich"))
"""


def test_a_command_under_json_never_imports_rich():
    """rich's imports are a tenth of a second of every command's start; a script reading
    --json sees none of what it draws."""
    out = subprocess.run(
        [sys.executable, "-c", JSON_PROBE], capture_output=True, text=True, check=True
    )
    assert out.stdout.splitlines()[-1] == "[]"


# `smoltorrent worker` as on a Mac: the worker command sees sys.platform "darwin" until the
# process has been started again with the Objective-C fork check off; Celery sees Linux.
AS_ON_A_MAC = """
import os, runpy, sys, types
from coordinator.cli import services
if os.environ.get("OBJC_DISABLE_INITIALIZE_FORK_SAFETY") != "YES":
    services.sys = types.SimpleNamespace(**{**vars(sys), "platform": "darwin"})
sys.argv = ["smoltorrent", *sys.argv[1:]]
runpy.run_module("coordinator.cli", run_name="__main__")
"""


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state_and_parent = stat.read_text().rsplit(") ", 1)[1].split()[:2]
        except OSError:
            continue  # gone meanwhile
        if state_and_parent[1] == str(pid):
            found.append(int(stat.parent.name))
    return found


def test_the_worker_on_macos_runs_its_prefork_pool_with_the_objc_fork_check_off(
    make_cluster, tmp_path: Path
) -> None:
    cluster = make_cluster(worker=False)
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115  (closed below)
    worker = subprocess.Popen(
        [sys.executable, "-c", AS_ON_A_MAC, "worker", "--concurrency", "2"],
        env=cluster.env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(
            lambda: worker.poll() is not None or cluster.worker_answers(),
            timeout=180,
            what="the worker",
        )
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
        # The same process (exec keeps the pid) and every pool child carry the setting.
        pool = _children(worker.pid)
        assert len(pool) >= 2
        for pid in [worker.pid, *pool]:
            assert _environ(pid).get("OBJC_DISABLE_INITIALIZE_FORK_SAFETY") == "YES", pid
        assert "(prefork)" in (tmp_path / "worker.log").read_text()
        src = tmp_path / "m.safetensors"
        write_checkpoint(src, 1024 * 1024, hidden=64)
        cluster.cli("store", str(src))
        out = tmp_path / "out.safetensors"
        cluster.cli("gather", "m.safetensors", "-o", str(out))
        assert out.read_bytes() == src.read_bytes()
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        log.close()
