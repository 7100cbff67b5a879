"""smoltorrent.integrations.lightning on a real cluster: a Lightning Trainer with the
CheckpointIO plugin saves to the cluster, resumes with ckpt_path="last" exactly where an
uninterrupted run is, and writes no pickle anywhere (a tiny model on CPU, 2 epochs of 3 steps)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

from tests.smoltorrent.conftest import ROOT, run_api
from tests.tasks.conftest import wait_until

# In WORKDIR: a run of 2 epochs (6 steps) with no checkpoint at all, then a run of 1 epoch
# with the plugin and one that resumes it with ckpt_path="last" up to the end of epoch 2.
RESUME = """
import json, os
from lightning.pytorch.callbacks import ModelCheckpoint
from smoltorrent.integrations.lightning import CheckpointIO
from tests.smoltorrent.lightning_run import Tiny, state_bits, trainer

os.chdir(WORKDIR)
model = Tiny()
straight = trainer(2, enable_checkpointing=False)
straight.fit(model)
expected = state_bits(model, straight)

def run(epochs, ckpt_path=None):
    model = Tiny()
    checkpoints = ModelCheckpoint(dirpath="ck", save_last=True)
    run = trainer(epochs, plugins=[CheckpointIO("lt")], callbacks=[checkpoints])
    run.fit(model, ckpt_path=ckpt_path)
    return state_bits(model, run), run

first, _ = run(1)
resumed, second = run(2, ckpt_path="last")
# A link as save_last="link" makes it: removing it removes the link alone.
os.symlink("epoch=1-step=6.ckpt", "ck/link.ckpt")
CheckpointIO("lt").remove_checkpoint("ck/link.ckpt")
print(json.dumps({
    "first_step": first["global_step"],
    "resumed": resumed == expected,
    "expected": expected,
    "got": resumed,
    "last": second.checkpoint_callback.last_model_path,
    # A path with no file (another machine): the current version of its name.
    "elsewhere": CheckpointIO("lt", root="/nowhere").load_checkpoint("/nowhere/ck/last.ckpt")[
        "global_step"
    ],
}))
"""


def test_a_trainer_resumes_from_the_cluster_with_ckpt_path_last_exactly(make_cluster, tmp_path):
    """Also: nothing written is a pickle; a checkpoint ModelCheckpoint replaced is removed
    from the cluster."""
    c = make_cluster(2)
    work = tmp_path / "work"
    work.mkdir()
    out = run_api(c, f"WORKDIR = {str(work)!r}\n" + RESUME)
    assert out["first_step"] == 3
    # Weights, AdamW's moments and step, the scheduler's lr and the global step: all equal
    # to the run that never stopped, bit for bit.
    assert out["resumed"] is True, (out["expected"], out["got"])
    assert out["last"] == str(work / "ck" / "last.ckpt")
    assert out["elsewhere"] == 6

    # What Lightning sees in its checkpoint directory are pointers, JSON naming a version.
    files = sorted(p.name for p in (work / "ck").iterdir())
    assert files == ["epoch=1-step=6.ckpt", "last.ckpt"], files
    for name in files:
        assert (work / "ck" / name).read_bytes().startswith(b"{"), name
    # On the cluster: one name per path, each version a .safetensors file whose state is
    # JSON in its header (the store refuses anything else: a pickle, torch.save's zip).
    rows = [v for v in c.cli_json("ls") if v["name"] == "lt/ck/last.ckpt"]
    assert [v["state"] for v in rows] == ["committed"] * 2  # steps 3 and 6
    show = c.cli_json("show", "lt/ck/last.ckpt", "--tensors")
    tensors = [t["name"] for t in show["tensors"]]
    assert "smoltorrent.state" in show["metadata"]
    assert "state_dict/net.weight" in tensors
    assert "optimizer_states/0/state/0/exp_avg" in tensors
    # The step and the loops' progress are JSON, not tensors: nothing else is stored.
    assert all(t.startswith(("state_dict/", "optimizer_states/", "callbacks/")) for t in tensors)
    # Every file smoltorrent kept on this machine (its local tier) is .safetensors.
    kept = [p for p in (c.root / "staging").rglob("*") if p.is_file()]
    assert all(p.suffix == ".safetensors" for p in kept if "journal" not in p.parts), kept
    # epoch=0-step=3.ckpt, replaced by epoch=1-step=6.ckpt, is removed from the cluster too;
    # what the removed link pointed to stays.
    wait_until(
        lambda: "lt/ck/epoch=0-step=3.ckpt" not in {v["name"] for v in c.cli_json("ls")},
        timeout=30,
        what="the replaced checkpoint's removal",
    )
    assert "lt/ck/epoch=1-step=6.ckpt" in {v["name"] for v in c.cli_json("ls")}


def test_the_lightning_page_example_resumes_from_the_cluster_on_a_fresh_machine(
    make_cluster, tmp_path
):
    page = (ROOT / "docs" / "lightning.md").read_text()
    example = page.split("```python\n", 1)[1].split("```", 1)[0]
    c = make_cluster(2)
    assert "max_epochs=2," in example
    check = """
import json
print(json.dumps({"step": trainer.global_step, "from": trainer.ckpt_path}))
"""
    runs = []
    # The first run is cut short after epoch 1 (step 3); the second starts in an empty directory.
    for machine, script in (
        ("first", example.replace("max_epochs=2,", "max_epochs=1,")),
        ("second", example),
    ):
        (tmp_path / machine).mkdir()
        chdir = f"import os\nos.chdir({str(tmp_path / machine)!r})\n"
        runs.append(run_api(c, chdir + script + check))
    assert runs[0] == {"step": 3, "from": None}  # no last.ckpt yet: from scratch
    # The second machine had no file: restore() wrote the pointers from the cluster, and
    # ckpt_path="last" resumed from step 3 and trained epoch 2.
    assert runs[1] == {"step": 6, "from": str(tmp_path / "second" / "checkpoints" / "last.ckpt")}


def test_a_save_returns_before_its_commit_and_its_pointer_follows_the_commit(
    make_cluster, tmp_path
):
    """The plugin saves in the background, as save(wait=False) does. The worker is
    SIGSTOPped before the run, so no save can commit: the run still starts epoch 2 (epoch
    1's save returned, journalled), with no pointer at ck/last.ckpt yet. SIGCONT: fit ends
    once every pointer is written (teardown waits for them), and they name what was
    saved: last.ckpt loads back step 6."""
    c = make_cluster(2)
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "epoch-2"
    script = f"""
        import json, os
        from lightning.pytorch.callbacks import Callback, ModelCheckpoint
        from smoltorrent.integrations.lightning import CheckpointIO
        from tests.smoltorrent.lightning_run import Tiny, trainer

        class Mark(Callback):
            def on_train_epoch_start(self, trainer, module):
                if trainer.current_epoch == 1:
                    with open({str(marker)!r}, "w") as f:
                        json.dump(os.path.lexists("ck/last.ckpt"), f)

        os.chdir({str(work)!r})
        every = ModelCheckpoint(dirpath="ck", save_last=True)
        trainer(2, plugins=[CheckpointIO("bg")], callbacks=[every, Mark()]).fit(Tiny())
        last = CheckpointIO("bg").load_checkpoint("ck/last.ckpt")
        print(json.dumps({{"files": sorted(os.listdir("ck")), "step": last["global_step"]}}))
        """
    os.killpg(c.worker.pid, signal.SIGSTOP)
    run = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=c.env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "run.err").open("w"),
        text=True,
    )
    try:
        wait_until(
            lambda: marker.exists() or run.poll() is not None,
            timeout=120,
            what="the run's second epoch",
        )
    finally:
        os.killpg(c.worker.pid, signal.SIGCONT)
        if not marker.exists():
            run.kill()
    out, _ = run.communicate(timeout=240)
    assert run.returncode == 0, (tmp_path / "run.err").read_text()
    assert json.loads(marker.read_text()) is False  # epoch 1's save not committed yet
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"files": ["epoch=1-step=6.ckpt", "last.ckpt"], "step": 6}
