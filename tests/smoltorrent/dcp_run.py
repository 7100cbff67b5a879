"""What the DCP tests run in their own processes (one, or ranks under torchrun): a model
and AdamW after one step, its DCP state, and a state as comparable bits."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def model(seed: int, width: int = 16, depth: int = 0) -> torch.nn.Module:
    """8 inputs, 4 outputs, `depth` hidden width x width layers between (the tests: none;
    bench/dcp_side_by_side.py: a state of ~1 GB)."""
    torch.manual_seed(seed)
    hidden = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), *hidden, torch.nn.Linear(width, 4)
    )


def trained(net: torch.nn.Module, seed: int) -> torch.optim.Optimizer:
    """One AdamW step on `net` (fully_shard'ed or not), from inputs of `seed`."""
    optim = torch.optim.AdamW(net.parameters(), lr=1e-3)
    torch.manual_seed(seed)
    net(torch.randn(3, 8)).sum().backward()
    optim.step()
    return optim


def state(net: torch.nn.Module, optim: torch.optim.Optimizer, step: int = 7) -> dict[str, Any]:
    msd, osd = get_state_dict(net, optim)
    return {"model": msd, "optim": osd, "extra": {"step": step, "name": "run"}}


def load_plain(reader: Any) -> dict[str, Any]:
    """A fresh plain model and AdamW (no process group), loaded through `reader`."""
    import torch.distributed.checkpoint as dcp

    net = model(1)  # other weights, so a load that did nothing shows
    optim = trained(net, 1)
    into = state(net, optim, step=0)
    dcp.load(into, storage_reader=reader)
    set_state_dict(net, optim, model_state_dict=into["model"], optim_state_dict=into["optim"])
    out = state(net, optim)
    out["extra"] = into["extra"]
    return out


def bits(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{key path: (dtype, shape, bytes)} for each tensor, repr() for anything else."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in bits(sub, f"{prefix}{key}/").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in bits(sub, f"{prefix}{i}/").items()}
    if isinstance(tree, torch.Tensor):
        raw = tree.detach().contiguous().view(-1).view(torch.uint8).tolist()
        return {prefix: [str(tree.dtype), list(tree.shape), raw]}
    return {prefix: repr(tree)}


def sharded_model(seed: int, width: int = 16, depth: int = 0) -> torch.nn.Module:
    """model(seed, width, depth) fully_shard'ed (FSDP2) over every rank of the process
    group, layer by layer, then whole."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = model(seed, width, depth)
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def fsdp_save(name: str, directory: str, seed: int = 0) -> None:
    """A rank under torchrun (gloo, CPU): the model fully_shard'ed over every rank, one
    AdamW step, its state saved through smoltorrent's Writer as `name` and through
    FileSystemWriter into `directory`, and by async_save in process mode as the next step."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import smoltorrent.dcp

    dist.init_process_group("gloo")
    try:
        net = sharded_model(seed)
        saved = state(net, trained(net, seed))
        dcp.save(saved, storage_writer=smoltorrent.dcp.Writer(name))
        dcp.save(saved, storage_writer=dcp.FileSystemWriter(directory))
        step, number = name.rsplit("_", 1)
        dcp.async_save(
            saved,
            storage_writer=smoltorrent.dcp.Writer(f"{step}_{int(number) + 1}"),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        ).result()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    fsdp_save(*sys.argv[1:3])
