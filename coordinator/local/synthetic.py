"""Synthetic LLM-shaped checkpoints, written without any tensor library.

Valid .safetensors files (any bytes are valid BF16/F32 values), for the
demo and the benchmarks; written in fixed chunks so memory stays flat.
"""

from __future__ import annotations

import json
import os
import struct

from smoltorrent import defaults

_ITEM = {"BF16": 2, "F32": 4}


def llm_layout(target_bytes: int, hidden: int = 1024) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of a decoder stack sized to about target_bytes."""
    vocab = 8 * hidden
    tensors = [("model.embed_tokens.weight", "BF16", [vocab, hidden])]
    per_layer = [
        ("self_attn.q_proj.weight", [hidden, hidden]),
        ("self_attn.k_proj.weight", [hidden // 4, hidden]),
        ("self_attn.v_proj.weight", [hidden // 4, hidden]),
        ("self_attn.o_proj.weight", [hidden, hidden]),
        ("mlp.gate_proj.weight", [3 * hidden, hidden]),
        ("mlp.up_proj.weight", [3 * hidden, hidden]),
        ("mlp.down_proj.weight", [hidden, 3 * hidden]),
    ]
    layer_bytes = sum(a * b for _, (a, b) in per_layer) * 2 + 2 * hidden * 4
    fixed = 2 * vocab * hidden * 2 + hidden * 4
    layers = max(1, (target_bytes - fixed) // layer_bytes)
    for i in range(layers):
        for name, shape in per_layer:
            tensors.append((f"model.layers.{i}.{name}", "BF16", shape))
        tensors.append((f"model.layers.{i}.input_layernorm.weight", "F32", [hidden]))
        tensors.append((f"model.layers.{i}.post_attention_layernorm.weight", "F32", [hidden]))
    tensors.append(("model.norm.weight", "F32", [hidden]))
    tensors.append(("lm_head.weight", "BF16", [vocab, hidden]))
    return tensors


def write_checkpoint(path: str | os.PathLike, target_bytes: int, hidden: int = 1024) -> int:
    """Write an LLM-like checkpoint of about target_bytes; returns its size."""
    header: dict = {"__metadata__": {"format": "pt", "source": "smoltorrent synthetic"}}
    offset = 0
    layout = llm_layout(target_bytes, hidden)
    for name, dtype, shape in layout:
        size = _ITEM[dtype] * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        remaining = offset
        while remaining:
            n = min(remaining, defaults.IO_CHUNK_BYTES)
            f.write(os.urandom(n))
            remaining -= n
    return 8 + len(raw) + offset
