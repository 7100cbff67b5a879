"""smoltorrent.dcp on a real cluster: DCP's save and load, unchanged, through Writer and
Reader, each tensor equal to what DCP's own FileSystemWriter and FileSystemReader give
for the same state, and nothing pickled in what smoltorrent stores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.smoltorrent.conftest import ROOT, run_api

# One process, no process group: a model and AdamW after a step, with plain values
# (DCP's BYTE_IO items), saved through Writer and FileSystemWriter, loaded back into a
# fresh model and optimizer through each reader.
ROUND_TRIP = """
import json, tempfile
import torch
import torch.distributed.checkpoint as dcp
import smoltorrent.dcp
from coordinator.state.steps import Steps
from smoltorrent.dcp import metadata_json
from smoltorrent.api import manifest_metadata
from smoltorrent.dcp.steps import DCP_METADATA_KEY, begin, store_part
from smoltorrent.errors import PartialStepError
from tasks.requests import connected_metadata
from tests.smoltorrent.dcp_run import bits, load_plain, model, state, trained

net = model(0)
saved = state(net, trained(net, 0))
directory = tempfile.mkdtemp()
dcp.save(saved, storage_writer=smoltorrent.dcp.Writer("run/step_7"))
dcp.save(saved, storage_writer=dcp.FileSystemWriter(directory))
ours = bits(load_plain(smoltorrent.dcp.Reader("run/step_7")))
theirs = bits(load_plain(dcp.FileSystemReader(directory)))
own = dcp.FileSystemReader(directory).read_metadata()
own.storage_data = None  # FileSystemWriter's own (a dataclass it pickles), not ours
back = metadata_json.loads(metadata_json.dumps(own))

# Step 8 of 2 ranks: rank 1 stored its part, rank 0 never did (died before finish()).
begin("run/step_8", 2)
store_part("run/step_8", 1, 2, {"w": torch.ones(2)}, {}, 1)
try:
    smoltorrent.dcp.Reader("run/step_8").read_metadata()
    partial = None
except PartialStepError as exc:
    partial = str(exc)
latest_after_partial = smoltorrent.dcp.latest("run")

# async_save in a thread: the same state, the same chunks.
dcp.async_save(saved, storage_writer=smoltorrent.dcp.Writer("run/step_9")).result()
steps = Steps(connected_metadata().r)
chunks = {
    n: sorted(
        e.raw_sha256 for p in steps.get("run", n).parts.values()
        for e in connected_metadata().versions.manifest(p.vkey).entries
    )
    for n in (7, 9)
}
print(json.dumps({
    "differ": sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)),
    "tensors": sum(1 for v in ours.values() if isinstance(v, list)),
    "extra": [ours["extra/step/"], ours["extra/name/"]],
    "partial": partial,
    "latest_after_partial": latest_after_partial,
    "async": [bits(load_plain(smoltorrent.dcp.Reader(f"run/step_{n}"))) == theirs for n in (9,)],
    "same_chunks": chunks[7] == chunks[9] and len(chunks[7]) > 0,
    "metadata": (back.state_dict_metadata, back.planner_data, back.version)
    == (own.state_dict_metadata, own.planner_data, own.version),
    "latest": smoltorrent.dcp.latest("run"),
    "kept_as_json": isinstance(json.loads(manifest_metadata(
        connected_metadata().versions.manifest(steps.get("run", 7).parts[0].vkey)
    )[DCP_METADATA_KEY]), dict),
}))
"""


def test_a_state_saved_through_writer_loads_through_reader_as_dcps_own_files_do(make_cluster):
    """Also: a partial step is never the newest; async_save in both modes."""
    c = make_cluster(2)
    out = run_api(c, ROUND_TRIP)
    assert out["differ"] == [], out
    assert out["tensors"] == 16  # 4 parameters, and exp_avg, exp_avg_sq and step of each
    assert out["extra"] == ["7", "'run'"]
    assert out["metadata"] is True
    assert out["kept_as_json"] is True  # in rank 0's part's header, read from its manifest
    # A step some rank never finished is never the newest, and reading it says why.
    assert out["latest_after_partial"] == "run/step_7"
    assert "of its 2 ranks, [0] never finished" in out["partial"], out["partial"]
    # async_save (thread mode; process mode needs a process group: the FSDP2 test): committed,
    # newest, equal, and deduplicated (the same chunks: nothing of them was sent again).
    assert out["async"] == [True]
    assert out["same_chunks"] is True
    assert out["latest"] == "run/step_9"


def torchrun(cluster, ranks: int, *args: str, timeout: float = 120) -> None:
    """`ranks` processes of tests/smoltorrent/dcp_run.py under torchrun, gloo on CPU."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            "-m",
            "tests.smoltorrent.dcp_run",
            *args,
        ],
        env={**cluster.env(), "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def load_plain(names: tuple[str, ...], directory: Path) -> str:
    """A script loading each of `names` through Reader and `directory` through
    FileSystemReader into a plain model and AdamW, in one process with no process group;
    for each name, what differs from DCP's own files and how many tensors it holds."""
    return f"NAMES, DIRECTORY = {names!r}, {str(directory)!r}\n" + LOAD_PLAIN


LOAD_PLAIN = """
import json
import torch.distributed.checkpoint as dcp
import smoltorrent.dcp
from tests.smoltorrent.dcp_run import bits, load_plain

out = {}
for name in NAMES:
    # Each name loaded into a fresh model and optimizer (load_plain makes them).
    ours = bits(load_plain(smoltorrent.dcp.Reader(name)))
    theirs = bits(load_plain(dcp.FileSystemReader(DIRECTORY)))
    out[name] = {
        "differ": sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)),
        "tensors": sum(1 for v in ours.values() if isinstance(v, list)),
    }
print(json.dumps(out))
"""


def test_fsdp2_on_two_ranks_saves_through_writer_and_loads_into_a_plain_model(
    make_cluster, tmp_path
):
    c = make_cluster(2)
    torchrun(c, 2, "fsdp/step_1", str(tmp_path / "fs"))
    # step_1 by dcp.save, step_2 by dcp.async_save in process mode, the same state: both
    # loaded in one process (one import of torch, ~3 s of a loaded CI box's CPU, not two).
    names = ("fsdp/step_1", "fsdp/step_2")
    out = run_api(c, load_plain(names, tmp_path / "fs"))
    assert list(out) == list(names), out
    for name in names:
        assert out[name]["differ"] == [], (name, out)
        assert out[name]["tensors"] == 16


def test_the_dcp_page_example_saves_and_resumes(make_cluster):
    page = (ROOT / "docs" / "dcp.md").read_text()
    example = page.split("```python\n", 1)[1].split("```", 1)[0]
    c = make_cluster(2)
    check = """
import json
weight = model.weight.tolist()
# Step 200 loaded again (into the model: a state dict's tensors are its parameters).
again = state(0)
dcp.load(again, storage_reader=smoltorrent.dcp.Reader("run1/step_200"))
print(json.dumps({"start": start, "latest": smoltorrent.dcp.latest("run1"), "weight": weight,
                  "step_200": again["model"]["weight"].tolist(), "step": again["step"]}))
"""
    first = run_api(c, example + check)
    assert (first["start"], first["latest"]) == (0, "run1/step_200")
    # Step 200 holds the weights the first run ended with, and the second run resumes
    # from it.
    assert (first["step_200"], first["step"]) == (first["weight"], 200)
    second = run_api(c, example + check)
    assert (second["start"], second["latest"]) == (200, "run1/step_400")
    assert (second["step_200"], second["step"]) == (first["weight"], 200)
