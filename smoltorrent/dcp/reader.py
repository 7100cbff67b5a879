"""smoltorrent.dcp.Reader: DCP's StorageReader from the cluster.

    dcp.load(state, storage_reader=smoltorrent.dcp.Reader("run1/step_100"))

read_metadata() reads the Metadata from the manifest of the step's rank-0 part (JSON in
its header, no byte gathered), refusing a step not every rank finished. DCP's planner
then says which stored items (and which slices of them) this process needs, for
whatever world size, sharding or plain module it loads into; read_data() reads just
those tensors from each rank's part (ranged reads, each verified), narrows them and
copies them into place. A BYTE_IO item comes back byte for byte and goes to the
planner's load_bytes, which is DCP's torch.load (smoltorrent never unpickles it).
"""

from __future__ import annotations

import io
import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from smoltorrent.api import load
from smoltorrent.dcp import metadata_json
from smoltorrent.dcp.steps import DCP_METADATA_KEY, committed_metadata, split
from smoltorrent.errors import CheckpointFormatError, NotFoundError


class Reader(StorageReader):
    """Loads the DCP checkpoint `name` ("RUN/STEP", as saved by Writer). `version`: a
    version id prefix of its rank-0 part (`smoltorrent ls` shows it), checked if given."""

    def __init__(self, name: str | os.PathLike[str], version: str | None = None) -> None:
        super().__init__()
        split(name)
        self.name = os.fspath(name).strip("/")
        self.version = version
        self._parts: dict[int, tuple[str, str]] | None = None
        self._storage: dict[Any, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            split(checkpoint_id)
            self.name = os.fspath(checkpoint_id).strip("/")
        self._parts = None
        self._storage = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        header, parts = committed_metadata(self.name)
        if self.version is not None and not parts[0][1].startswith(self.version):
            raise NotFoundError(
                f"{self.name} is version {parts[0][1][:12]} (its rank-0 part), not "
                f"{self.version}: a DCP checkpoint is saved once, under one version"
            )
        self._parts = parts
        return metadata_json.loads(header[DCP_METADATA_KEY])

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._storage = metadata.storage_data or {}
        if self._parts is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        by_rank: dict[int, list[tuple[Any, str]]] = defaultdict(list)
        for item in plan.items:
            where = self._storage.get(item.storage_index)
            if where is None:
                raise CheckpointFormatError(
                    f"{self.name}: its metadata says nothing of where {item.storage_index} is"
                )
            by_rank[where["rank"]].append((item, where["key"]))
        for rank, items in sorted(by_rank.items()):
            part, version_id = self._parts[rank]
            loaded = load(part, version=version_id, tensors=sorted({k for _, k in items}))
            for item, key in items:
                stored = loaded[key]
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(stored.numpy().tobytes()))
                    continue
                tensor = _narrow(stored, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise CheckpointFormatError(
                        f"{self.name}: {key} of rank {rank}'s part is {tuple(tensor.size())} "
                        f"where the plan wants {tuple(target.size())}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(item, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            split(checkpoint_id)
        except Exception:
            return False
        return True


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The slice of a stored item a read item wants, dimension by dimension."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor
