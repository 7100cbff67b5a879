"""One rank of tests/smoltorrent/test_two_hosts.py, on its own host (network namespace):

    python -m tests.smoltorrent.two_hosts_run RANK MASTER_ADDR MASTER_PORT OUT_DIR

Joins a process group of 2 ranks (gloo, TCP rendezvous on rank 0's host), trains the
FSDP2 test model one AdamW step (tests/smoltorrent/dcp_run.py), and saves that step once
through each way in: DCP with smoltorrent.dcp.Writer (and with FileSystemWriter into
OUT_DIR/fs, the reference), and save_sharded of this rank's local shards. Then, the group
gone, it loads its own part back from the cluster with load_sharded and, on rank 0, the
DCP step into a plain model (no group); its last stdout line says what matched, as JSON.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import smoltorrent
import smoltorrent.dcp
from tests.smoltorrent.dcp_run import bits, load_plain, sharded_model, state, trained

DCP_NAME = "twohosts/step_1"
SHARDED_NAME = "twohosts-sharded"
STEP = 1
WORLD = 2
GROUP_TIMEOUT_S = 120  # the other host's rank starts beside a loaded CI run


def main(rank: int, master: str, port: int, out: str) -> dict:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    try:
        net = sharded_model(0)
        saved = state(net, trained(net, 0))
        dcp.save(saved, storage_writer=smoltorrent.dcp.Writer(DCP_NAME))
        dcp.save(saved, storage_writer=dcp.FileSystemWriter(f"{out}/fs"))
        # This rank's shards of the model, as plain tensors: its part of the step.
        local = {k: v.to_local().detach().clone() for k, v in net.state_dict().items()}
        smoltorrent.save_sharded(local, SHARDED_NAME, STEP, rank, WORLD, wait=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    back = smoltorrent.load_sharded(SHARDED_NAME, STEP, rank, WORLD, source="cluster")
    report = {"rank": rank, "sharded_same": bits(back) == bits(local)}
    if rank == 0:
        ours = bits(load_plain(smoltorrent.dcp.Reader(DCP_NAME)))
        theirs = bits(load_plain(dcp.FileSystemReader(f"{out}/fs")))
        keys = ours.keys() | theirs.keys()
        report["dcp_differ"] = sorted(k for k in keys if ours.get(k) != theirs.get(k))
        report["dcp_tensors"] = sum(1 for v in ours.values() if isinstance(v, list))
    return report


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])))
