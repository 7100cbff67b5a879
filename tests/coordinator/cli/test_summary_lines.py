"""store and gather off a terminal: one line each, with the size, the time and the rate,
for a file and for a Hugging Face directory alike (what a log or a CI job keeps)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from coordinator.local.synthetic import write_checkpoint
from tests.checkpoints import write_hf_dir

# a size, then the seconds it took and the rate: "1.2 MB ... 0.31 s ... 3.9 MB/s"
TIME_AND_RATE = r"\d[\d.]* [kKMG]?B\b.* \d[\d.]* s\b.* \(?\d[\d.]* [kKMG]?B/s\)*$"


def one_line(proc) -> str:
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "\r" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return lines[0]


def test_store_and_gather_summaries_in_a_pipe(make_cluster, tmp_path: Path) -> None:
    c = make_cluster(3)
    src = tmp_path / "m.safetensors"
    write_checkpoint(src, 2_000_000, hidden=64)
    os.utime(src, (time.time() - 60, time.time() - 60))
    line = one_line(c.cli("store", str(src)))
    assert re.search(TIME_AND_RATE, line), line
    # In the words of its format, counted right: a small checkpoint is one chunk.
    assert " in 1 chunk x 2 replicas, " in line, line
    shards = one_line(c.cli("store", str(src), "--name", "whole", "--shards", "2"))
    assert " in 2 shards x 2 replicas, " in shards, shards
    shown = c.cli("show", "m.safetensors").stdout
    assert " in 1 chunk (header " in shown, shown
    line = one_line(c.cli("gather", "m.safetensors", "-o", str(tmp_path / "back.safetensors")))
    assert line.startswith("gathered m.safetensors") and re.search(TIME_AND_RATE, line), line

    write_hf_dir(tmp_path / "hf")
    stored = c.cli("store", str(tmp_path / "hf"), "--name", "hf/tiny")
    line = stored.stdout.strip().splitlines()[0]  # then a warning that config.json is left out
    assert line.startswith("stored directory hf/tiny") and re.search(TIME_AND_RATE, line), line
    line = one_line(c.cli("gather", "hf/tiny", "-o", str(tmp_path / "hf-back")))
    assert line.startswith("gathered directory hf/tiny") and re.search(TIME_AND_RATE, line), line
