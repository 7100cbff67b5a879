"""Builders for small test checkpoints, real ones and deliberately broken ones.

Every file stays well under a few MB so a test that builds one stays fast.
torch, numpy and mlx are imported here because tests build real tensors;
the code under test never imports them.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

LLM_METADATA = {"format": "pt", "step": "100", "run": "grpo/run1"}


def llm_like_tensors(
    *, layers: int = 4, hidden: int = 64, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A decoder-shaped state dict mixing the dtypes training checkpoints hold."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    vocab = 4 * hidden
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(vocab, hidden)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        tensors |= {
            f"{prefix}.self_attn.q_proj.weight": randn(hidden, hidden),
            f"{prefix}.self_attn.k_proj.weight": randn(hidden, hidden, dtype=torch.float16),
            f"{prefix}.mlp.up_proj.weight": randn(2 * hidden, hidden),
            f"{prefix}.mlp.down_proj.weight_fp8": randn(hidden, 2 * hidden).to(torch.float8_e4m3fn),
            f"{prefix}.mlp.down_proj.grad_fp8": randn(hidden, 2 * hidden).to(torch.float8_e5m2),
            f"{prefix}.input_layernorm.weight": randn(hidden, dtype=torch.float32),
            f"{prefix}.attention_mask_cache": torch.rand(hidden, generator=generator) > 0.5,
            f"{prefix}.quant_scale": torch.tensor(0.5 + layer, dtype=torch.float32),
        }
    tensors |= {
        "model.norm.weight": randn(hidden, dtype=torch.float32),
        "lm_head.weight_int8": torch.randint(-128, 127, (vocab, hidden), generator=generator).to(
            torch.int8
        ),
        "optimizer.step": torch.tensor(100, dtype=torch.int64),
        "optimizer.empty_state": torch.zeros(0, hidden, dtype=torch.float32),
        "optimizer.empty_flags": torch.zeros(0, dtype=torch.bool),
    }
    return tensors


def write_llm_like(
    path: str | os.PathLike[str], *, layers: int = 4, hidden: int = 64, seed: int = 0
) -> dict[str, torch.Tensor]:
    """bf16/f16/f32/int8/int64/bool/fp8 tensors, scalars, zero-size tensors and metadata."""
    tensors = llm_like_tensors(layers=layers, hidden=hidden, seed=seed)
    save_file(tensors, os.fspath(path), metadata=LLM_METADATA)
    return tensors


def write_mlx(path: str | os.PathLike[str]) -> None:
    """A file written by MLX, which packs tensors with no alignment padding."""
    mx = pytest.importorskip("mlx.core")
    arrays = {
        "w_f32": mx.arange(7, dtype=mx.float32),
        "w_bf16": mx.ones((3, 5), dtype=mx.bfloat16),
        "w_u8": mx.arange(3, dtype=mx.uint8),
        "w_f16": mx.zeros((5,), dtype=mx.float16),
        "w_i64": mx.array([1, 2, 3], dtype=mx.int64),
        "flag": mx.array([True, False, True]),
        "scalar": mx.array(3.5),
    }
    mx.save_safetensors(os.fspath(path), arrays, metadata={"framework": "mlx"})


def write_one_giant(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """One tensor larger than all the others together, then a tail of small ones."""
    tensors = {"embed.weight": torch.ones(64, 1024, dtype=torch.float32)}
    tensors |= {f"small.{i}": torch.full((16, 16), float(i)) for i in range(12)}
    save_file(tensors, os.fspath(path))
    return tensors


def raw_file_bytes(header: dict | bytes, data: bytes = b"", *, pad_to: int = 1) -> bytes:
    """8-byte length + header JSON (a dict, or exact bytes to craft bad JSON) + data."""
    header_bytes = header if isinstance(header, bytes) else json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % pad_to)
    return struct.pack("<Q", len(header_bytes)) + header_bytes + data


def write_raw(
    path: str | os.PathLike[str], header: dict | bytes, data: bytes = b"", *, pad_to: int = 1
) -> None:
    """Write a safetensors-shaped file from parts, for crafting malformed ones."""
    with open(path, "wb") as file:
        file.write(raw_file_bytes(header, data, pad_to=pad_to))


def write_hf_dir(root: Path, parts: int = 3, seed: int = 0) -> dict[str, str]:
    """A model split over `parts` files the way transformers' save_pretrained does."""
    root.mkdir(parents=True, exist_ok=True)
    tensors = llm_like_tensors(layers=3, hidden=32, seed=seed)
    names = sorted(tensors)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[i::parts]}
        save_file(chunk, root / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(chunk, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (root / "config.json").write_text('{"model_type": "llama"}')
    past = time.time() - 60  # settled: the store does not wait for the files to settle
    for f in root.iterdir():
        os.utime(f, (past, past))
    return weight_map
