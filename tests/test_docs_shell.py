"""Every shell block of the README and of docs/ runs as written, so a how-to cannot rot.

A ```bash, ```sh or ```console block (in a console block, the lines after `$ `) runs in
bash with `set -euo pipefail`, as `smoltorrent` on PATH would for a user, in a fresh work
directory holding what the docs name (`checkpoints/step_100.safetensors`, a Hugging Face
directory `llama-8b/`), with HOME a temporary directory. It must exit 0, and a command it
started in the background (`smoltorrent worker &`) must still run, or have exited 0, a
second after its end; then everything it started is stopped. An HTML comment on the line
before the block changes how it runs:

- no comment: against one local cluster that the blocks share (Redis, 2 nodes, a worker);
- `<!-- shell-test: alone -->`: in a home of its own and a network namespace of its own,
  for a block that starts its own cluster on fixed ports;
- `<!-- shell-test: alone, until "TEXT" -->`: the same, for a command that runs until
  Ctrl-C: once it has printed TEXT it gets SIGINT, as from a terminal, and must exit 0;
- `<!-- shell-test: skip REASON -->`: not run here, saying why (at most MAX_SKIPS of them);
- `<!-- shell-test: cluster MACHINE... -->`: a step of the README's cluster across machines,
  run on each MACHINE by tests/test_cross_machine.py, in order with the other steps.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.local.cluster import LocalCluster
from coordinator.local.synthetic import write_checkpoint
from tests.checkpoints import write_hf_dir
from tests.conftest import require_network_namespaces

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages whose shell blocks are not how-tos, with the reason they are not run.
NOT_HOW_TO = {
    "docs/benchmarks.md": "benchmark commands run for minutes and report figures, not a pass",
}
MAX_SKIPS = 4  # blocks that cannot run here (several machines, an install): few, each says why
BLOCK_TIMEOUT_S = 120.0  # seconds for one block on a loaded 2-core box
UNTIL_TIMEOUT_S = 90.0  # seconds for a run-until-Ctrl-C command to print what it promises
STOP_GRACE_S = 20.0  # seconds for a block's processes to stop on SIGTERM before SIGKILL
CHECKPOINT_BYTES = 2 * 1024 * 1024  # the docs' checkpoints/step_100.safetensors: small
SETTLED_AGO_S = 60  # its mtime in the past: a store does not wait for it to settle

FENCE = re.compile(r"^(\s*)```(bash|sh|console)\s*$")
MARKER = re.compile(r"^\s*<!--\s*shell-test:\s*(.*?)\s*-->\s*$")
UNTIL = re.compile(r'^alone,\s*until\s+"([^"]+)"$')
# Around every block: the pid of each command it sends to the background (`$!`, read
# before each next command) is kept, so one that died failing fails the block.
BACKGROUND_WATCH = """set -euo pipefail
background=()
trap '[[ -n "${!-}" && " ${background[*]-} " != *" ${!} "* ]] && background+=("$!") || true' DEBUG
"""
BACKGROUND_CHECK = """
sleep 1
trap - DEBUG
for job in "${background[@]}"; do
    if ! kill -0 "$job" 2>/dev/null; then
        wait "$job" || { echo "a background command exited $?" >&2; exit 1; }
    fi
done
"""


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    marker: str  # the comment's text, "" without one

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        return self.marker[len("skip") :].strip() if self.marker.startswith("skip") else None

    @property
    def cluster(self) -> list[str]:
        """The machines a cluster step runs on (tests/test_cross_machine.py), else []."""
        return self.marker.split()[1:] if self.marker.startswith("cluster ") else []

    @property
    def alone(self) -> bool:
        return self.marker.startswith("alone")

    @property
    def until(self) -> str | None:
        match = UNTIL.match(self.marker)
        return match.group(1) if match else None


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang, start = fence.group(1), fence.group(2), i
        body = []
        i += 1
        while not lines[i].strip().startswith("```"):
            body.append(lines[i][len(indent) :])
            i += 1
        if lang == "console":
            body = [line[2:] for line in body if line.startswith("$ ")]
        previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(previous)
        found.append(
            Block(
                page.relative_to(ROOT).as_posix(),
                start + 1,
                "\n".join(body),
                marker.group(1) if marker else "",
            )
        )
        i += 1
    return found


BLOCKS = [b for page in PAGES for b in blocks_of(page) if b.page not in NOT_HOW_TO]
RUN = [b for b in BLOCKS if b.skip_reason is None and not b.cluster]


def test_every_marker_is_known_and_skips_are_few_and_say_why() -> None:
    assert RUN, "no shell block found to run"
    known = [
        b for b in BLOCKS if b.marker in ("", "alone") or b.until or b.skip_reason or b.cluster
    ]
    unknown = [b.id for b in BLOCKS if b not in known]
    assert unknown == [], f"shell-test markers this test does not know: {unknown}"
    skips = [b for b in BLOCKS if b.skip_reason is not None]
    assert all(len(b.skip_reason.split()) >= 4 for b in skips), "a skip must say why"
    assert len(skips) <= MAX_SKIPS, f"{len(skips)} blocks skipped: {[b.id for b in skips]}"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One cluster for every block without a marker: Redis, 2 nodes, a worker."""
    cluster = LocalCluster(tmp_path_factory.mktemp("docs-cluster"), nodes=2, host_id="docs")
    cluster.start()
    try:
        addresses = [str(n.address) for n in cluster.node_procs]
        subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "nodes", "add", *addresses],
            env=cluster.env(),
            check=True,
            capture_output=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        yield cluster
    finally:
        cluster.stop()


def workdir(path: Path) -> Path:
    """What the docs' blocks name, in the directory they run in."""
    (path / "checkpoints").mkdir(parents=True)
    write_checkpoint(path / "checkpoints" / "step_100.safetensors", CHECKPOINT_BYTES)
    write_hf_dir(path / "llama-8b")
    past = time.time() - SETTLED_AGO_S
    os.utime(path / "checkpoints" / "step_100.safetensors", (past, past))
    return path


def processes_with(token: str, under: Path) -> list[int]:
    """Every process still running whose environment carries this block's token, or whose
    working directory is in `under`: a daemonized redis-server writes its process title
    over its environment (so the token is gone) and works in its --dir, inside the block's
    home."""
    needle = f"SMOLTORRENT_DOCS_BLOCK={token}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (proc / "environ").read_bytes().split(b"\0") or (
                    Path(os.readlink(proc / "cwd")).is_relative_to(under)
                ):
                    pids.append(int(proc.name))
    return pids


def stop_everything(token: str, under: Path) -> None:
    """SIGTERM what the block left (nodes, a worker, its own Redis), SIGKILL past a grace."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        for pid in processes_with(token, under):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while processes_with(token, under) and time.monotonic() < deadline:
            time.sleep(0.1)


def run_block(block: Block, env: dict[str, str], cwd: Path) -> tuple[int, str]:
    script = BACKGROUND_WATCH + block.code + "\n" + BACKGROUND_CHECK
    argv = ["bash", "-c", script]
    if block.alone:
        argv = ["unshare", "--net", "--", "bash", "-c", "ip link set lo up && " + script]
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    output = b""
    # Read until bash exits, not until end of file: what it left in the background holds
    # the pipe open until stop_everything.
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        interrupt_by = time.monotonic() + UNTIL_TIMEOUT_S if block.until else None
        drain_until = None
        while drain_until is None or time.monotonic() < drain_until:
            if drain_until is None and proc.poll() is not None:
                drain_until = time.monotonic() + 0.2  # what bash printed last
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                output += f"\n(killed after {BLOCK_TIMEOUT_S:.0f} s)".encode()
                break
            if sel.select(timeout=0.2):
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                output += chunk
            if interrupt_by is not None and (
                block.until.encode() in output or time.monotonic() > interrupt_by
            ):
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, to the foreground group
                interrupt_by = None
    code = proc.wait()
    return code, output.decode(errors="replace")


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_shell_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    home = tmp_path / "home"
    home.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SMOLTORRENT_")}
    if block.alone:
        require_network_namespaces()
        env = base
    else:
        env = request.getfixturevalue("shared").env()
    env |= {
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "SMOLTORRENT_DOCS_BLOCK": token,
    }
    try:
        code, output = run_block(block, env, workdir(tmp_path / "work"))
    finally:
        stop_everything(token, tmp_path)
    assert code == 0, f"{block.id} exited {code}:\n{block.code}\n--- output ---\n{output}"
    if block.until:
        assert block.until in output, output


@pytest.mark.parametrize(
    "code", ["false\necho unreachable", "sh -c 'sleep 0.2; exit 3' &\necho started"]
)
def test_a_block_that_fails_fails(code: str, tmp_path: Path) -> None:
    """A failing command, or a background one that died failing, is the block failing."""
    block = Block("README.md", 1, code, "")
    exit_code, output = run_block(block, dict(os.environ), tmp_path)
    assert exit_code != 0, output
    assert "unreachable" not in output


def test_what_a_block_started_is_stopped_even_a_daemonized_redis(tmp_path: Path) -> None:
    """A block that starts an embedded Redis leaves no redis-server behind: the daemon
    writes its title over the environment that carried the block's token (three were left
    after every CI run), so it is also found by its working directory in the block's home."""
    token = uuid.uuid4().hex
    start = "import sys, pathlib; from coordinator.state.embedded_redis import start_redis; "
    start += "print(start_redis(pathlib.Path(sys.argv[1]))[0])"
    env = {**os.environ, "SMOLTORRENT_DOCS_BLOCK": token}
    argv = [sys.executable, "-c", start, str(tmp_path / "home" / "redis")]
    pid = int(subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout)
    assert pid in processes_with(token, tmp_path)
    stop_everything(token, tmp_path)
    with contextlib.suppress(FileNotFoundError):  # gone, or dead and not yet reaped by init
        assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
