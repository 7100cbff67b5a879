"""smoltorrent.dcp on a real cluster: DCP's save and load, unchanged, through Writer and
Reader, each tensor equal to what DCP's own FileSystemWriter and FileSystemReader give
for the same state, and nothing pickled in what smoltorrent stores."""

from __future__ import annotations

from tests.smoltorrent.conftest import run_api

# One process, no process group: a model and AdamW after a step, with plain values
# (DCP's BYTE_IO items), saved through Writer and FileSystemWriter, loaded back into a
# fresh model and optimizer through each reader.
ROUND_TRIP = """
import json, tempfile
import torch.distributed.checkpoint as dcp
import smoltorrent.dcp
from smoltorrent.dcp import metadata_json
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
print(json.dumps({
    "differ": sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)),
    "tensors": sum(1 for v in ours.values() if isinstance(v, list)),
    "extra": [ours["extra/step/"], ours["extra/name/"]],
    "metadata": (back.state_dict_metadata, back.planner_data, back.version)
    == (own.state_dict_metadata, own.planner_data, own.version),
    "latest": smoltorrent.dcp.latest("run"),
}))
"""


def test_a_state_saved_through_writer_loads_through_reader_as_dcps_own_files_do(make_cluster):
    c = make_cluster(2)
    out = run_api(c, ROUND_TRIP)
    assert out["differ"] == [], out
    assert out["tensors"] == 16  # 4 parameters, and exp_avg, exp_avg_sq and step of each
    assert out["extra"] == ["7", "'run'"]
    assert out["metadata"] is True
    assert out["latest"] == "run/step_7"
