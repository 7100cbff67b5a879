"""The base install is a storage node: the wheel installs with no index and nothing but the
standard library, `smoltorrent serve` runs from it, and coordinator commands say what to add."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from coordinator.dataplane.node_client import NodeAddress, NodeClient

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "README.md", "smoltorrent", "coordinator", "worker_server", "tasks"]
SOURCES += ["beat"]
STEP_TIMEOUT_S = 300.0  # seconds for one build or install step on a loaded box


def run(*argv: str | Path, **kwargs) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=STEP_TIMEOUT_S, **kwargs
    )
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stderr}"
    return result


def test_wheel_installs_a_node_with_the_standard_library_only(tmp_path: Path) -> None:
    # Build from a copy, so the checkout gets no build/ or egg-info from the test.
    source = tmp_path / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=ignore)
        else:
            shutil.copy(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", wheels, source)  # fmt: skip
    (wheel,) = wheels.glob("smoltorrent-*.whl")
    # The metadata's Lua scripts are files, not Python: the wheel must carry every one.
    scripts = {str(p.relative_to(REPO)) for p in (REPO / "coordinator").rglob("*.lua")}
    assert scripts and scripts <= set(zipfile.ZipFile(wheel).namelist())

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    # --no-index and an empty environment: a single dependency would fail this install.
    clean_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run(venv / "bin" / "pip", "install", "--no-index", "--isolated", "-q", wheel, env=clean_env)
    listed = run(venv / "bin" / "pip", "list", "--format=freeze", env=clean_env).stdout
    assert {line.split("==")[0] for line in listed.split()} <= {"pip", "setuptools", "smoltorrent"}

    data = tmp_path / "data"
    node = subprocess.Popen(
        [venv / "bin" / "smoltorrent", "serve", "--data-dir", data, "--port", "0"],
        cwd=tmp_path,  # not the checkout: only the installed package can be imported
        env=clean_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not (data / "port").exists():
            assert node.poll() is None, node.communicate()[1]
            assert time.monotonic() < deadline, "the node never wrote its port file"
            time.sleep(0.05)
        port = int((data / "port").read_text())
        assert NodeClient(NodeAddress("127.0.0.1", port)).ping()
    finally:
        node.terminate()
        node.wait(STEP_TIMEOUT_S)

    coordinator_command = subprocess.run(
        [venv / "bin" / "smoltorrent", "ls"],
        cwd=tmp_path,
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )
    assert coordinator_command.returncode == 1
    assert "pip install 'smoltorrent[coordinator]'" in coordinator_command.stderr
    assert "Traceback" not in coordinator_command.stderr
