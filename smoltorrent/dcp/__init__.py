"""PyTorch Distributed Checkpoint (DCP) onto a smoltorrent cluster: DCP's planner does
the sharding and resharding (FSDP2, DTensor, TP, N ranks to M, a plain module with no
process group), smoltorrent stores what each rank writes.

    import torch.distributed.checkpoint as dcp
    import smoltorrent.dcp

    dcp.save(state, storage_writer=smoltorrent.dcp.Writer("run1/step_100"))
    dcp.load(state, storage_reader=smoltorrent.dcp.Reader(smoltorrent.dcp.latest("run1")))

This package imports torch (it is the integration); nothing on the store or gather path
imports it.
"""

from smoltorrent.dcp.reader import Reader
from smoltorrent.dcp.steps import latest
from smoltorrent.dcp.writer import Writer

__all__ = ["Reader", "Writer", "latest"]
