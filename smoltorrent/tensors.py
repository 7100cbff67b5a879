"""State dicts of torch, numpy and MLX to and from .safetensors files, bit for bit.

Writing goes through each framework's own safetensors writer, so bf16 and the fp8
types keep their exact bits and nothing is pickled. Reading goes through the
framework's safetensors reader too, except numpy: safetensors' numpy reader knows
neither bf16 nor fp8, so those come back as ml_dtypes arrays read at the offsets
the header names. MLX has no fp8 type; its own reader returns fp8 tensors as
uint8 arrays of the same bits (`mx.from_fp8` converts them).

The framework libraries are imported only here and only when used: the
store/gather path never sees a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.plan.safetensors_header import read_header
from smoltorrent.errors import StateDictError

FRAMEWORKS = ("torch", "numpy", "mlx")

# safetensors dtype -> (module, attribute) of the numpy dtype that holds it exactly.
_NUMPY_DTYPES = {
    "BOOL": ("numpy", "bool_"),
    "U8": ("numpy", "uint8"),
    "I8": ("numpy", "int8"),
    "I16": ("numpy", "int16"),
    "U16": ("numpy", "uint16"),
    "F16": ("numpy", "float16"),
    "I32": ("numpy", "int32"),
    "U32": ("numpy", "uint32"),
    "F32": ("numpy", "float32"),
    "I64": ("numpy", "int64"),
    "U64": ("numpy", "uint64"),
    "F64": ("numpy", "float64"),
    "C64": ("numpy", "complex64"),
    "BF16": ("ml_dtypes", "bfloat16"),
    "F8_E4M3": ("ml_dtypes", "float8_e4m3fn"),
    "F8_E5M2": ("ml_dtypes", "float8_e5m2"),
    "F8_E8M0": ("ml_dtypes", "float8_e8m0fnu"),
    "F8_E4M3FNUZ": ("ml_dtypes", "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": ("ml_dtypes", "float8_e5m2fnuz"),
}


def check_framework(framework: str) -> None:
    if framework not in FRAMEWORKS:
        raise StateDictError(
            f"framework={framework!r} is not one smoltorrent loads into; use one of "
            + ", ".join(repr(f) for f in FRAMEWORKS)
        )


def kind_of(value: Any) -> str | None:
    """ "torch", "numpy" or "mlx" for a tensor of that framework, None for anything else."""
    module = type(value).__module__.split(".")[0]
    if module == "torch" and type(value).__name__ in ("Tensor", "Parameter"):
        return "torch"
    if module == "numpy" and type(value).__name__ == "ndarray":
        return "numpy"
    if module == "mlx" and type(value).__name__ == "array":
        return "mlx"
    return None


def check_metadata(
    metadata: Mapping[str, str] | None, reserved: str | None = None
) -> dict[str, str] | None:
    if metadata is None:
        return None
    bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise StateDictError(
            f"metadata must map strings to strings; {bad[0]!r} does not (json.dumps the value)"
        )
    if reserved is not None and reserved in metadata:
        raise StateDictError(
            f"the metadata key {reserved!r} is smoltorrent's own (it holds the saved state's "
            "structure); name yours otherwise"
        )
    return dict(metadata)


def write_file(
    state_dict: Mapping[str, Any], path: str, framework: str, metadata: dict[str, str] | None
) -> None:
    """Write with the framework's own safetensors writer. `path` must end in .safetensors
    (MLX appends the suffix otherwise)."""
    try:
        if framework == "torch":
            from safetensors.torch import save_file

            save_file(_own_memory_each(state_dict), path, metadata=metadata)
        elif framework == "numpy":
            import numpy as np
            from safetensors.numpy import save_file

            # safetensors 0.8 writes any array's memory as if it were in C order (its
            # issue 825): a transposed or strided one would come back silently reordered.
            arrays = {
                k: v
                if not isinstance(v, np.ndarray) or v.flags.c_contiguous
                else np.ascontiguousarray(v)
                for k, v in state_dict.items()
            }
            save_file(arrays, path, metadata=metadata)
        else:
            import mlx.core as mx

            mx.save_safetensors(path, dict(state_dict), metadata=metadata)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise StateDictError(f"cannot write the state dict as safetensors: {exc}") from exc


def _own_memory_each(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The torch tensors as safetensors can write them: each contiguous, none sharing memory
    with another. Many LLMs tie weights (lm_head.weight is embed_tokens.weight) and some
    hold transposed views; safetensors refuses both. Every name keeps its exact values: a
    tied tensor is written once per name, a view as a contiguous copy."""
    import torch

    out: dict[str, Any] = {}
    seen: set[tuple] = set()
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr(), storage.nbytes())
            if key in seen:
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            elif not tensor.is_contiguous():
                tensor = tensor.contiguous()
            if storage.data_ptr() and storage.nbytes():  # what safetensors counts as shared
                seen.add(key)
        out[name] = tensor
    return out


def read_file(path: str, framework: str, device: str | None = None) -> dict[str, Any]:
    """Every tensor of the file at `path`, as the framework's tensors (on `device` for torch)."""
    if framework == "torch":
        from safetensors.torch import load_file

        return load_file(path, device=device or "cpu")
    if device is not None:
        raise StateDictError(f"device= applies to torch only, not to {framework}")
    if framework == "numpy":
        return _read_numpy(path)
    import mlx.core as mx

    arrays = mx.load(path)
    mx.eval(*arrays.values())  # MLX loads lazily; read the bytes while the file is there
    return arrays


def _read_numpy(path: str) -> dict[str, Any]:
    import importlib

    import numpy as np

    header = read_header(path)
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        for tensor in header.tensors:
            where = _NUMPY_DTYPES.get(tensor.dtype)
            if where is None:
                raise StateDictError(
                    f"tensor {tensor.name!r} has dtype {tensor.dtype}, which numpy cannot hold "
                    "bit for bit; load it with framework='torch'"
                )
            try:
                dtype = np.dtype(getattr(importlib.import_module(where[0]), where[1]))
            except ImportError:
                raise StateDictError(
                    f"tensor {tensor.name!r} is {tensor.dtype}: install ml_dtypes "
                    "(pip install ml_dtypes) to load it into numpy"
                ) from None
            f.seek(header.data_start + tensor.start)
            count = tensor.size // dtype.itemsize if dtype.itemsize else 0
            array = np.fromfile(f, dtype=dtype, count=count) if count else np.empty(0, dtype)
            out[tensor.name] = array.reshape(tensor.shape)
    return out
