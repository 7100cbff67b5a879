"""A gathered file or directory appears whole or not at all, and the temp file or
directory of a gather that died where nothing could remove it does not stay: real
processes hold and drop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from coordinator.dataplane.staged_output import staged_directory, staged_output

HOLD = """
import sys, time
from coordinator.dataplane.staged_output import staged_output
with staged_output(sys.argv[1], 1 << 20, "a test checkpoint"):
    print("writing", flush=True)
    time.sleep(600)
"""
HOLD_DIRECTORY = """
import os, sys, time
from coordinator.dataplane.staged_output import staged_directory
with staged_directory(sys.argv[1]) as tmp:
    with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
        f.write(bytes(1 << 20))
    print("writing", flush=True)
    time.sleep(600)
"""


def _partials(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(".partial")}


def _writing(out: Path, script: str = HOLD) -> tuple[subprocess.Popen, str]:
    """A process inside staged_output(out), its temp file reserved (with HOLD_DIRECTORY,
    inside staged_directory(out), a file in its temp directory); and that temp's name."""
    before = _partials(out.parent)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE, text=True
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


def test_a_dead_gathers_temp_directory_is_removed_and_a_live_ones_kept(tmp_path):
    """The same for a directory checkpoint's gather: one SIGKILLed with a file in its temp
    directory, one still gathering. The next directory gather there removes the dead one's
    directory with what is in it, never the live one's, and its own appears whole."""
    out = tmp_path / "model"
    live, live_dir = _writing(out, HOLD_DIRECTORY)
    dead, dead_dir = _writing(out, HOLD_DIRECTORY)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        with staged_directory(str(out)) as tmp:
            Path(tmp, "a.safetensors").write_bytes(b"abc")
        assert [p.name for p in out.iterdir()] == ["a.safetensors"]
        assert (out / "a.safetensors").read_bytes() == b"abc"
        assert _partials(tmp_path) == {live_dir} and dead_dir != live_dir
        assert [p.name for p in (tmp_path / live_dir).iterdir()] == ["model.safetensors"]
    finally:
        live.kill()
        live.wait()
