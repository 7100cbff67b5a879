"""smoltorrent.integrations.transformers: the Hugging Face Trainer's checkpoints on the
cluster, resumed from it, against a real cluster, in a process of their own (as a
training script runs)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.smoltorrent.conftest import ROOT, run_api
from tests.tasks.conftest import wait_until


def test_a_trainer_resumed_from_the_cluster_ends_as_an_uninterrupted_run(make_cluster, tmp_path):
    """A run stopped after its checkpoint-3 (stored by the callback), its output directory
    deleted, restore()d and resumed with resume_from_checkpoint=True ends bit for bit as a
    run never interrupted: every weight, global_step, every step's loss. Every file of
    checkpoint-3 (the pickles optimizer.pt, scheduler.pt, rng_state.pth,
    training_args.bin, and trainer_state.json) comes back byte for byte; then restore()
    picks the newest checkpoint, checkpoint-6."""
    c = make_cluster(2)
    got = run_api(
        c,
        f"""
        import json, os, shutil
        from tests.smoltorrent.hf_run import (
            Steps, StopAfterSave, digests, losses, same_weights, trainer)
        from smoltorrent.integrations.transformers import Callback, restore

        tmp = {str(tmp_path)!r}
        whole = trainer(f"{{tmp}}/whole")
        whole.train()

        out = f"{{tmp}}/out"
        first = Callback("run1")
        trainer(out, [first, StopAfterSave(3)]).train()
        files = digests(f"{{out}}/checkpoint-3")
        shutil.rmtree(out)
        restored = restore(out, "run1")
        resumed_files = digests(restored)
        second, steps = Callback("run1"), Steps()
        resumed = trainer(out, [second, steps])
        resumed.train(resume_from_checkpoint=True)
        shutil.rmtree(out)
        print(json.dumps({{
            "restored": os.path.relpath(restored, tmp),
            "files": sorted(files), "same_files": files == resumed_files,
            "same_weights": same_weights(whole, resumed),
            "steps": [whole.state.global_step, resumed.state.global_step],
            "losses": [losses(whole), losses(resumed)], "trained": steps.trained,
            "stored": first.stored + second.stored, "failed": first.failed + second.failed,
            "newest": os.path.relpath(restore(out, "run1"), tmp),
        }}))
        """,
    )
    assert got["restored"] == "out/checkpoint-3"
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= set(
        got["files"]
    ) and {"trainer_state.json", "training_args.bin"} <= set(got["files"])
    assert got["same_files"]
    assert got["stored"] == ["run1/checkpoint-3", "run1/checkpoint-6"] and got["failed"] == []
    assert got["same_weights"] and got["steps"] == [6, 6]
    assert got["trained"] == [4, 5, 6]  # steps 1-3 came from the cluster
    whole, resumed = got["losses"]  # the resumed run's history holds steps 1-3 too
    assert resumed == whole and sorted(whole) == ["1", "2", "3", "4", "5", "6"]
    assert got["newest"] == "out/checkpoint-6"


def test_the_transformers_page_example_stores_and_resumes(make_cluster, tmp_path):
    """docs/transformers.md's example, run as written but for max_steps: 10 steps
    (checkpoint-10 stored), then 20 steps on another machine's empty directory, resuming
    from the cluster's checkpoint-10."""
    page = (ROOT / "docs" / "transformers.md").read_text()
    example = page.split("```python\n", 1)[1].split("```", 1)[0]
    assert "max_steps=20" in example
    c = make_cluster(2)
    check = """
import json
[callback] = [c for c in trainer.callback_handler.callbacks if isinstance(c, Callback)]
print(json.dumps({"checkpoint": checkpoint, "step": trainer.state.global_step,
                  "stored": callback.stored}))
"""
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
    first = run_api(
        c,
        f"import os\nos.chdir({str(tmp_path / 'first')!r})\n"
        + example.replace("max_steps=20", "max_steps=10")
        + check,
    )
    assert (first["checkpoint"], first["step"]) == (None, 10)
    assert first["stored"] == ["tiny-run/checkpoint-10"]
    second = run_api(c, f"import os\nos.chdir({str(tmp_path / 'second')!r})\n" + example + check)
    assert second["checkpoint"] == "out/checkpoint-10" and second["step"] == 20
    assert second["stored"] == ["tiny-run/checkpoint-20"]  # steps 1-10 were not trained again


def start_run(cluster, script: str, tmp_path) -> subprocess.Popen:
    """A training script against the cluster, in a process of its own, started and not
    waited for (the test acts on the cluster while it runs); stdout and stderr in files."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=cluster.env(),
        cwd=ROOT,
        stdout=(tmp_path / "run.out").open("w"),
        stderr=(tmp_path / "run.err").open("w"),
        text=True,
    )


def test_a_store_that_fails_never_stops_training_and_is_stored_once_the_cluster_answers(
    make_cluster, tmp_path
):
    """9 steps, a checkpoint every 3. redis-server is SIGKILLed before checkpoint-3 is
    saved and started again after step 4; the host's worker is SIGKILLed before
    checkpoint-6 and started again after step 7. Training runs its 9 steps and ends well;
    each store that failed is a warning naming it; checkpoint-3 and checkpoint-6, still
    on disk, are stored after checkpoint-9 is: the cluster holds all three. The worker
    killed with checkpoint-6's store queued is not waited for: its alive key expires and
    the callback gives up on it (it waited for a worker to come back)."""
    c = make_cluster(2)
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    run = start_run(
        c,
        f"""
        import json
        from tests.smoltorrent.hf_run import Pauses, trainer
        from smoltorrent.integrations.transformers import Callback, checkpoints

        callback = Callback("run1")
        t = trainer({str(tmp_path / "out")!r}, [Pauses({str(pauses)!r}, [3, 4, 6, 7]),
                    callback], max_steps=9)
        t.train()
        print(json.dumps({{"step": t.state.global_step, "stored": callback.stored,
                          "failed": callback.failed, "cluster": checkpoints("run1")}}))
        """,
        tmp_path,
    )
    try:
        for step, act in [
            (3, c.kill_redis),
            (4, c.start_redis),
            (6, c.kill_worker),
            (7, c.start_worker),
        ]:
            wait_until(
                lambda s=step: (pauses / f"at-{s}").exists() or run.poll() is not None,
                timeout=120,
                what=f"the run to reach step {step}",
            )
            assert run.poll() is None, (tmp_path / "run.err").read_text()
            act()
            (pauses / f"go-{step}").touch()
        assert run.wait(timeout=240) == 0, (tmp_path / "run.err").read_text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    err = (tmp_path / "run.err").read_text()
    got = json.loads((tmp_path / "run.out").read_text().strip().splitlines()[-1])
    assert got["step"] == 9
    assert "run1/checkpoint-3 was not stored (cannot reach Redis" in err
    assert "run1/checkpoint-6 was not stored (no worker serves test0 any more" in err
    assert got["stored"] == ["run1/checkpoint-9", "run1/checkpoint-3", "run1/checkpoint-6"]
    assert got["failed"] == []
    assert got["cluster"] == [[9, "run1/checkpoint-9"], [6, "run1/checkpoint-6"],
                              [3, "run1/checkpoint-3"]]  # fmt: skip


def test_the_cluster_keeps_the_checkpoints_the_trainers_save_total_limit_keeps(
    make_cluster, tmp_path
):
    """save_total_limit=2: the Trainer deletes its checkpoint-3 once checkpoint-9 is
    written, and the callback removes run1/checkpoint-3 from the cluster once
    checkpoint-9 is stored; keep_last=1 keeps one whatever the Trainer keeps. What
    remains restores, and the removed directory's files are gone from `ls`."""
    c = make_cluster(2)
    got = run_api(
        c,
        f"""
        import json, os
        from tests.smoltorrent.hf_run import trainer
        from smoltorrent.integrations.transformers import Callback, checkpoints

        tmp = {str(tmp_path)!r}
        trainer(f"{{tmp}}/out", [Callback("run1")], max_steps=9, save_total_limit=2).train()
        trainer(f"{{tmp}}/two", [Callback("run2", keep_last=1)], max_steps=6).train()
        print(json.dumps({{"local": sorted(os.listdir(f"{{tmp}}/out")),
                          "run1": checkpoints("run1"), "run2": checkpoints("run2")}}))
        """,
    )
    assert got["local"] == ["checkpoint-6", "checkpoint-9"]
    assert got["run1"] == [[9, "run1/checkpoint-9"], [6, "run1/checkpoint-6"]]
    assert got["run2"] == [[6, "run2/checkpoint-6"]]
    wait_until(
        lambda: not any("checkpoint-3" in r["name"] for r in c.cli_json("ls")),
        what="checkpoint-3's files to be removed",
    )
    assert c.cli_json("dlq", "ls") == []
