"""smoltorrent.dcp.Writer: DCP's StorageWriter onto the cluster.

    dcp.save(state, storage_writer=smoltorrent.dcp.Writer("run1/step_100"))

Each rank resolves its own items (DCP's planner has already cut them: FSDP2 and TP
shards, deduplicated replicated tensors) and stores them as its part of the step
(smoltorrent/dcp/steps.py), straight to the cluster. Tensor items become tensors of a
.safetensors part, chunked and deduplicated like any other; a BYTE_IO item (what DCP
pickled: plain values of the state) becomes a uint8 tensor of its bytes exactly, never
unpickled here. Rank 0 (DCP's coordinator) stores its part last, in finish(), with the
Metadata as JSON (smoltorrent/dcp/metadata_json.py): that part commits the step.
"""

from __future__ import annotations

import io
import os
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from coordinator.state.steps import COMMITTED
from smoltorrent import defaults
from smoltorrent.dcp import metadata_json
from smoltorrent.dcp.steps import DCP_METADATA_KEY, DCP_NAME_KEY, begin, split, store_part
from smoltorrent.errors import ShardedCheckpointError


def item_key(index: MetadataIndex) -> str:
    """The tensor name an item is stored under in its rank's part: its key in the state,
    and for a tensor item the offsets of its chunk in the whole tensor."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(map(str, index.offset))}"


class Writer(StorageWriter):
    """Saves a DCP checkpoint as step STEP of RUN, named "RUN/STEP" (e.g. "run1/step_100",
    the last part ending in the step number). `replicas`: copies of each chunk."""

    def __init__(
        self, name: str | os.PathLike[str], *, replicas: int = defaults.DEFAULT_REPLICAS
    ) -> None:
        super().__init__()
        split(name)
        if replicas < 1:
            raise ShardedCheckpointError(f"replicas must be at least 1, not {replicas}")
        self.name = os.fspath(name).strip("/")
        self.replicas = replicas
        self.rank = 0
        self.world_size = 1
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex
        self._own: dict[str, torch.Tensor] | None = None  # rank 0's items, stored in finish

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            split(checkpoint_id)
            self.name = os.fspath(checkpoint_id).strip("/")
        self.save_id = uuid.uuid4().hex
        self._own = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        collective = kwargs.get("use_collectives", True) and dist.is_initialized()
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", dist.get_rank())) if collective else 0
        self.world_size = dist.get_world_size() if collective else 1
        if is_coordinator != (self.rank == 0):
            raise ShardedCheckpointError(
                "smoltorrent.dcp.Writer needs rank 0 as DCP's coordinator (it stores the "
                f"metadata with its part); this one is rank {self.rank}: leave "
                "coordinator_rank at its default"
            )
        begin(self.name, self.world_size)

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.name, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        tensors: dict[str, torch.Tensor] = {}
        results = []
        for item in plan.items:
            key = item_key(item.index)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                tensor = (
                    torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    if raw
                    else (torch.empty(0, dtype=torch.uint8))
                )
            else:
                tensor = data.detach().to("cpu").contiguous()
            tensors[key] = tensor
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=tensor.numel() * tensor.element_size(),
                    storage_data={"rank": self.rank, "key": key},
                )
            )
        if self.is_coordinator:
            self._own = tensors
        else:
            store_part(self.name, self.rank, self.world_size, tensors, {}, self.replicas)
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        header = {DCP_NAME_KEY: self.name, DCP_METADATA_KEY: metadata_json.dumps(metadata)}
        state = store_part(self.name, 0, self.world_size, self._own or {}, header, self.replicas)
        self._own = None
        if state != COMMITTED:
            raise ShardedCheckpointError(
                f"{self.name}: every rank reported its part stored, yet the step is {state}"
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            split(checkpoint_id)
        except ShardedCheckpointError:
            return False
        return True
