"""Fixtures shared by every test package."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SMALL_FS_BYTES = 4 * 1024 * 1024  # small enough to fill in a blink
# Set by .ci/run: on CI a disk-full test that cannot mount its tmpfs, a link-cut test
# that cannot make network namespaces, or a disk-error test without libfiu fails instead
# of skipping, so the suite never goes green without having filled a real disk, unplugged
# a real link or failed a real system call.
REQUIRE_TMPFS_ENV = "SMOLTORRENT_REQUIRE_TMPFS"
REQUIRE_NETNS_ENV = "SMOLTORRENT_REQUIRE_NETNS"
REQUIRE_FIU_ENV = "SMOLTORRENT_REQUIRE_FIU"


def skip_unless_required(reason: str, env: str) -> None:
    """Skip the test for `reason`, or fail it where `env`=1 says this machine must run it."""
    if os.environ.get(env) == "1":
        pytest.fail(f"{reason}; {env}=1 says this machine must run it")
    pytest.skip(reason)


def require_network_namespaces() -> None:
    """Skip (fail on CI) a test that needs network namespaces where none can be made."""
    from coordinator.local.netns import unavailable

    why = unavailable()
    if why is not None:
        skip_unless_required(f"network namespaces: {why}", REQUIRE_NETNS_ENV)


def require_libfiu() -> None:
    """Skip (fail on CI) a test that fails a node's system calls with libfiu's fiu-run
    where it is not installed (Debian's fiu-utils)."""
    if shutil.which("fiu-run") is None or shutil.which("fiu-ctrl") is None:
        reason = "libfiu's fiu-run is not installed (Debian: fiu-utils)"
        skip_unless_required(reason, REQUIRE_FIU_ENV)


# Workers the tests start skip Celery's mingle, a 1 s wait for other workers' answers at
# every start (hundreds of starts a run); smoltorrent uses nothing it exchanges.
os.environ.setdefault("SMOLTORRENT_WORKER_MINGLE", "0")
# Tests gather into their temp directories; workers and CLIs they start inherit this.
os.environ.setdefault("SMOLTORRENT_GATHER_DIRS", tempfile.gettempdir())
# Importing the task modules in a test process starts the embedded Redis when no URL is
# set: in a home of the run's own (xdist workers inherit it), not the user's
# ~/.smoltorrent, and stopped when the run ends.
if "SMOLTORRENT_HOME" not in os.environ:
    os.environ["SMOLTORRENT_HOME"] = tempfile.mkdtemp(prefix="smoltorrent-tests-home-")
    _OWN_HOME = True
else:
    _OWN_HOME = False  # inherited: an xdist worker's, or the caller's own choice


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Under xdist, the slowest tests first, spread over the workers (tests/slow_first.py).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        from tests.slow_first import slow_first, slow_seconds

        items[:] = slow_first(items, workers, slow_seconds())


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _OWN_HOME or os.environ.get("SMOLTORRENT_REDIS_URL"):
        return
    from coordinator.state.embedded_redis import stop_redis

    stop_redis()
    shutil.rmtree(os.environ["SMOLTORRENT_HOME"], ignore_errors=True)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real size-limited file system (tmpfs), mounted for one test."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS_BYTES}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        reason = f"cannot mount a small tmpfs (needs root): {mounted.stderr.strip()}"
        skip_unless_required(reason, REQUIRE_TMPFS_ENV)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)
