"""A Redis restart (SIGKILL, back from its AOF OUTAGE_S later) at each read `smoltorrent.load`
makes before its gather: a `NAME@LABEL`, whether the name is a directory checkpoint, a
partial load's selection, the local tier's check. The load rides it out and returns the
state, as the CLI's gather does (tests/tasks/test_outage_at_every_phase.py).

Each phase is held, not timed: the script stops itself (SIGSTOP) as it enters the function
named (tests/held_cli.py), Redis is killed, and it goes on (SIGCONT) into the outage."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests import held_cli
from tests.checkpoints import write_hf_dir
from tests.smoltorrent.conftest import ROOT
from tests.tasks.test_control_plane import make_ckpt
from tests.tasks.test_outage_at_every_phase import restart_redis_around

# In the order one run of the script below enters them.
PHASES = (
    "smoltorrent.api:_at",
    "coordinator.state.directories:Directories.is_directory",
    "smoltorrent.api:_select",
    "smoltorrent.api:_local_copy",
)


def test_a_redis_restart_at_each_read_before_a_loads_gather_is_ridden_out(make_cluster, tmp_path):
    c = make_cluster(4)
    src = make_ckpt(tmp_path / "o.safetensors")
    c.cli("store", str(src))
    [version] = c.cli_json("ls")
    c.cli("tag", "o.safetensors", version["version_id"][:12], "best")
    script = f"""
        import json
        import safetensors.torch
        import smoltorrent

        want = safetensors.torch.save(safetensors.torch.load_file({str(src)!r}))
        # A labelled, partial load (_at, is_directory, _select), then a whole one that
        # looks at the local tier first (_local_copy).
        part = smoltorrent.load("o.safetensors@best", tensors=["*"])
        whole = smoltorrent.load("o.safetensors")
        print(json.dumps([safetensors.torch.save(s) == want for s in (part, whole)]))
        """
    assert held_load(c, PHASES, script) == [True, True]


def test_a_redis_restart_at_each_read_of_a_directory_load_is_ridden_out(make_cluster, tmp_path):
    c = make_cluster(3)
    src = tmp_path / "hf"
    write_hf_dir(src)
    c.cli("store", str(src), "--name", "hf")
    files = sorted(str(p) for p in src.glob("*.safetensors"))
    script = f"""
        import json
        import safetensors.torch
        import smoltorrent

        want = {{}}
        for f in {files!r}:
            want.update(safetensors.torch.load_file(f))
        got = smoltorrent.load("hf", tensors=["*"])
        print(json.dumps(safetensors.torch.save(got) == safetensors.torch.save(want)))
        """
    # Its files' record, then their manifests (what a partial load picks from).
    phases = (
        "coordinator.state.directories:Directories.get",
        "coordinator.state.versions:Versions.manifest",
    )
    assert held_load(c, phases, script) is True


def held_load(c, phases: tuple[str, ...], script: str):
    """`script` run with the cluster's environment, held as it enters each of `phases` in
    turn while Redis restarts; its last stdout line, parsed as JSON."""
    holds = "".join(f"held_cli.hold_at({p!r})\n" for p in phases)
    load = subprocess.Popen(
        [sys.executable, "-c", "from tests import held_cli\n" + holds + textwrap.dedent(script)],
        env=c.env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in phases:
            # It ended with "cannot reach Redis" (MetadataError) or a redis traceback.
            held_cli.wait_stopped(load)
            restart_redis_around(c, load)
        out, err = load.communicate(timeout=240)
    finally:
        load.kill()
    assert load.returncode == 0, out + err
    return json.loads(out.strip().splitlines()[-1])
