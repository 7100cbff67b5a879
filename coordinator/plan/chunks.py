"""Cut a checkpoint's data section into chunks that survive the next version.

A chunk is a byte range of the data section, addressed by the SHA-256 of its raw bytes.
Its boundaries follow tensors and depend on nothing but the header, never on the bytes:

- a tensor of CHUNK_SOLO_BYTES or more is a chunk of its own, or, past
  CHUNK_TARGET_BYTES, several, cut at fixed multiples of that from its first byte;
- the smaller tensors between two such (norms, biases, scalars) are packed in data
  order into runs of at most CHUNK_TARGET_BYTES.

So a tensor that did not change between two versions of a fine-tune maps to the same
bytes, hence the same chunk, and never moves again; a changed weight matrix moves itself
and nothing else. Even a tensor that grew or a new tensor before it only disturbs the run
of small tensors it sits in: a big tensor's chunks are its own bytes wherever they lie.

Each chunk also says how its bytes are laid out for the codec: runs of one grouping
width, each tensor's bytes grouped by its element size (coordinator/dataplane/codec.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from coordinator.plan.safetensors_header import DTYPE_BITS, CheckpointHeader, TensorInfo
from smoltorrent import defaults

# Bytes per element the codec groups a dtype by. Complex numbers are pairs of floats, so
# their planes are those of the float; 8-bit and sub-byte types are not grouped.
_COMPLEX_WIDTH = {"C64": 4}


def grouping_width(dtype: str) -> int:
    """How many bytes make one element of `dtype` for byte grouping: 1, 2, 4 or 8."""
    if dtype in _COMPLEX_WIDTH:
        return _COMPLEX_WIDTH[dtype]
    bits = DTYPE_BITS[dtype]
    return bits // 8 if bits in (16, 32, 64) else 1


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    index: int
    data_start: int  # relative to the source's data section
    data_end: int
    layout: tuple[tuple[int, int], ...]  # (raw bytes, grouping width) runs, in order

    @property
    def size(self) -> int:
        return self.data_end - self.data_start


def plan_chunks(
    header: CheckpointHeader,
    target: int = defaults.CHUNK_TARGET_BYTES,
    solo: int = defaults.CHUNK_SOLO_BYTES,
) -> list[ChunkPlan]:
    """The chunks of the data section, in order; they tile it exactly (none if it is empty)."""
    if not 0 < solo <= target or target % 8:
        # A multiple of 8: a big tensor's pieces then start on an element boundary.
        raise ValueError(f"chunk target {target} and solo size {solo} do not fit together")
    plans: list[ChunkPlan] = []
    # Chunks of one layout share its tuple: thousands of chunks, a few dozen layouts.
    layouts: dict[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] = {}
    for group in _groups(header.tensors, target, solo):
        start = group[0].start
        while start < group[-1].end:
            # Only a lone big tensor runs past the target; it is cut at fixed offsets.
            end = min(group[-1].end, start + target)
            layout = _layout(group, start, end)
            plans.append(ChunkPlan(len(plans), start, end, layouts.setdefault(layout, layout)))
            start = end
    return plans


def _groups(tensors: tuple[TensorInfo, ...], target: int, solo: int) -> Iterator[list[TensorInfo]]:
    """Tensors with bytes, in data order: each big one alone, small ones in runs <= target."""
    run: list[TensorInfo] = []
    for tensor in tensors:
        if not tensor.size:
            continue  # no bytes, so in no chunk
        if tensor.size >= solo:
            if run:
                yield run
            run = []
            yield [tensor]
        elif run and tensor.end - run[0].start > target:
            yield run
            run = [tensor]
        else:
            run.append(tensor)
    if run:
        yield run


def _layout(group: list[TensorInfo], start: int, end: int) -> tuple[tuple[int, int], ...]:
    """The (raw bytes, width) runs of [start, end), neighbours of one width merged."""
    runs: list[tuple[int, int]] = []
    for tensor in group:
        length = min(tensor.end, end) - max(tensor.start, start)
        if length <= 0:
            continue
        width = grouping_width(tensor.dtype)
        if runs and runs[-1][1] == width:
            runs[-1] = (runs[-1][0] + length, width)
        else:
            runs.append((length, width))
    return tuple(runs)
