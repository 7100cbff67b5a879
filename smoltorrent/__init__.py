"""smoltorrent: shared errors and defaults, and the Python API for training loops.

Storage nodes import this package with the standard library only, so the API
(Celery, Redis, safetensors, tensor libraries) is loaded on first use of one of
its names: `smoltorrent.save`, `smoltorrent.load`, ...
"""

import importlib

__version__ = "0.1.0"

_API = {
    "save": "smoltorrent.api",
    "load": "smoltorrent.api",
    "SaveHandle": "smoltorrent.api",
    "SavedVersion": "smoltorrent.api",
    "save_sharded": "smoltorrent.sharded",
    "load_sharded": "smoltorrent.sharded",
    "latest_step": "smoltorrent.sharded",
    "partition": "smoltorrent.sharded",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        # Imported by name on first use (PEP 562): a node never loads the API's dependencies.
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'smoltorrent' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
