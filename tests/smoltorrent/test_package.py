"""`import smoltorrent` stays light: a storage node imports it with the standard library
only, and the API's dependencies load on first use of one of its names."""

from __future__ import annotations

import subprocess
import sys

from tests.smoltorrent.conftest import ROOT


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return proc.stdout.strip()


def test_importing_the_package_loads_no_api_dependency() -> None:
    heavy = ("smoltorrent.api", "celery", "redis", "safetensors", "torch", "numpy", "mlx")
    loaded = _run(
        "import sys, smoltorrent, smoltorrent.errors, smoltorrent.defaults; "
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    assert loaded == ""


def test_api_names_resolve_on_first_use() -> None:
    out = _run(
        "import smoltorrent; from smoltorrent import load; "
        "print(smoltorrent.save.__module__, load.__module__, 'save' in dir(smoltorrent))"
    )
    assert out == "smoltorrent.api smoltorrent.api True"
    sharded = _run(
        "import smoltorrent; print(smoltorrent.save_sharded.__module__, "
        "smoltorrent.latest_step.__module__, 'load_sharded' in dir(smoltorrent))"
    )
    assert sharded == "smoltorrent.sharded smoltorrent.sharded True"
    proc = subprocess.run(
        [sys.executable, "-c", "import smoltorrent; smoltorrent.nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "has no attribute 'nope'" in proc.stderr
