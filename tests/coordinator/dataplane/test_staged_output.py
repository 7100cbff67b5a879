"""A gathered file appears whole or not at all, and the temp file of a gather that died
where nothing could remove it does not stay: real processes hold and drop the files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from coordinator.dataplane.staged_output import staged_output

HOLD = """
import sys, time
from coordinator.dataplane.staged_output import staged_output
with staged_output(sys.argv[1], 1 << 20, "a test checkpoint"):
    print("writing", flush=True)
    time.sleep(600)
"""


def _partials(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(".partial")}


def _writing(out: Path) -> tuple[subprocess.Popen, str]:
    """A process inside staged_output(out), its temp file reserved; and that file's name."""
    before = _partials(out.parent)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "writing\n"
    [name] = _partials(out.parent) - before
    return proc, name


def test_a_dead_gathers_temp_file_is_removed_and_a_live_ones_kept(tmp_path):
    """Two gathers into one destination: one SIGKILLed mid-write (no handler runs: its
    reserved temp file stayed for good), one still writing (as a second run of a request
    whose lease lapsed may be). The next gather there removes the dead one's file only,
    and its own output appears whole."""
    out = tmp_path / "out.safetensors"
    live, live_file = _writing(out)
    dead, dead_file = _writing(out)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        with staged_output(str(out), 3, "a test checkpoint") as fd:
            os.write(fd, b"abc")
        assert out.read_bytes() == b"abc"
        assert _partials(tmp_path) == {live_file} and dead_file != live_file
    finally:
        live.kill()
        live.wait()
