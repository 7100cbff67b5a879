"""State dicts written and read back through smoltorrent.tensors (real files, each
framework's own safetensors writer): every name comes back with its exact values, whatever
the memory layout it was handed in."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from smoltorrent.tensors import read_file, write_file


def round_trip(state_dict, framework, tmp_path):
    path = str(tmp_path / f"{framework}.safetensors")
    write_file(state_dict, path, framework, None)
    return read_file(path, framework)


def test_numpy_arrays_in_any_layout_keep_their_values(tmp_path):
    """safetensors 0.8's numpy writer stores a non-C-contiguous array's memory as if it
    were in C order (safetensors issue 825): a transposed, Fortran-ordered or strided
    array came back silently reordered."""
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    sd = {
        "transposed": a.T,
        "fortran": np.asfortranarray(a),
        "strided": a[:, ::2],
        "column": a[:, 1],
        "offset": a[1:],
        "bf16": np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4).T,
    }
    back = round_trip(sd, "numpy", tmp_path)
    for name, array in sd.items():
        assert back[name].dtype == array.dtype, name
        assert np.array_equal(back[name], array), name


def test_torch_tied_weights_and_views_keep_their_values(tmp_path):
    embed, w = torch.randn(16, 4), torch.randn(3, 5)
    sd = {
        "embed": embed,
        "lm_head": embed,  # tied: one tensor under two names
        "transposed": w.t(),
        "rows": embed[:2],
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    }
    back = round_trip(sd, "torch", tmp_path)
    assert sorted(back) == sorted(sd)
    for name, tensor in sd.items():
        assert torch.equal(back[name], tensor), name


def test_mlx_views_keep_their_values(tmp_path):
    import mlx.core as mx

    m = mx.arange(12).reshape(3, 4).astype(mx.float32)
    sd = {"m": m, "transposed": m.T, "column": m[:, 1], "broadcast": mx.broadcast_to(m[0], (2, 4))}
    back = round_trip(sd, "mlx", tmp_path)
    for name, array in sd.items():
        assert mx.array_equal(back[name], array).item(), name
