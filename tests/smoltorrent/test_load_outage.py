"""A Redis restart (SIGKILL, back from its AOF OUTAGE_S later) at a read `smoltorrent.load`
makes before its gather: of a checkpoint file's load and of a directory checkpoint's. The
load rides it out and returns the state, as the CLI's gather does
(tests/tasks/test_outage_at_every_phase.py).

Every read of what to load goes through one path, api._read (ride_out, recorded=False, a
plain read on the one metadata client): a `NAME@LABEL` (_at), whether the name is a
directory checkpoint, a partial load's selection, the local tier's check, a directory's
files' record and their manifests differ only in which call is first after the restart.
A restart costs OUTAGE_S, so it lands at two of them: the first read of a file's load
(_at) and of a directory's (Directories.get), each a different failure on the code before
77d63e9 (MetadataError from a ping; a bare redis ConnectionError).

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
    "coordinator.state.directories:Directories.get",
)


def test_a_redis_restart_in_the_reads_before_a_loads_gather_is_ridden_out(make_cluster, tmp_path):
    c = make_cluster(3)
    src = make_ckpt(tmp_path / "o.safetensors", size=500_000)
    c.cli("store", str(src))
    [version] = c.cli_json("ls")
    c.cli("tag", "o.safetensors", version["version_id"][:12], "best")
    hf = tmp_path / "hf"
    write_hf_dir(hf)
    c.cli("store", str(hf), "--name", "hf")
    files = sorted(str(p) for p in hf.glob("*.safetensors"))
    script = f"""
        import json
        import safetensors.torch
        import smoltorrent

        want = safetensors.torch.save(safetensors.torch.load_file({str(src)!r}))
        # A labelled, partial load (held at _at), then a whole one that looks at the local
        # tier first; then a directory's partial load (held at Directories.get).
        part = smoltorrent.load("o.safetensors@best", tensors=["*"])
        whole = smoltorrent.load("o.safetensors")
        want_hf = {{}}
        for f in {files!r}:
            want_hf.update(safetensors.torch.load_file(f))
        got_hf = smoltorrent.load("hf", tensors=["*"])
        print(json.dumps([safetensors.torch.save(s) == want for s in (part, whole)]
                         + [safetensors.torch.save(got_hf) == safetensors.torch.save(want_hf)]))
        """
    assert held_load(c, PHASES, script) == [True, True, True]


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
