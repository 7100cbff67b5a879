"""The Hugging Face Trainer's checkpoints onto a smoltorrent cluster: a TrainerCallback.

    from transformers import Trainer
    from smoltorrent.integrations.transformers import Callback, restore

    restore("out", "run1")  # the newest checkpoint the cluster holds, on a fresh machine
    trainer = Trainer(..., args=TrainingArguments("out", ...), callbacks=[Callback("run1")])
    trainer.train(resume_from_checkpoint=True)

The Trainer writes each checkpoint itself, a directory `OUTPUT_DIR/checkpoint-N`, then
calls the callbacks' on_save. The callback stores that directory whole as the directory
checkpoint `NAME/checkpoint-N` (tasks/directory_requests.py, with all_files): its
.safetensors files (the weights) as chunks, deduplicated against the checkpoints before
it, and every other file (trainer_state.json, training_args.bin, optimizer.pt,
scheduler.pt, rng_state.pth, the config) byte for byte in its pack
(coordinator/plan/file_pack.py). Those are torch.save pickles the Trainer wrote and will
read back itself; smoltorrent never unpickles them.

on_save returns once the checkpoint is committed at its replicas, so the Trainer's
rotation (save_total_limit) never deletes a directory still being stored. A store that
fails (Redis or the worker away, no node to take it) never raises into the training
step, nor waits for a worker to come back: it is logged as a warning, with the command
that stores it by hand, and training goes on from the Trainer's own copy on disk
(invariant 12). It is tried again once a later checkpoint is stored (the cluster answers
again) and when training ends, if its directory is still there; one still not stored
then is named in a last warning.

Once a checkpoint is stored, those of the run past the `keep_last` newest (by default
the Trainer's save_total_limit: the cluster keeps what the output directory keeps) are
removed from the cluster whole, as `smoltorrent rm` removes a directory checkpoint; the
best one (load_best_model_at_end) stays, as the Trainer keeps it, and so does one with a
pinned version.

`restore(output_dir, name)` gathers the newest stored checkpoint (the highest N) into
OUTPUT_DIR/checkpoint-N, where `resume_from_checkpoint=True` looks for it.
"""

from __future__ import annotations

import logging
import os
import re
import time

from transformers import TrainerCallback

from smoltorrent import defaults
from smoltorrent.errors import SmoltorrentError

log = logging.getLogger("smoltorrent")
CHECKPOINT_PREFIX = "checkpoint-"  # the Trainer's name for its checkpoint directories
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def default_name(output_dir: str | os.PathLike[str]) -> str:
    """The name a run's checkpoints are stored under when none is given: the output
    directory's base name."""
    return os.path.basename(os.path.abspath(output_dir).rstrip(os.sep))


class Callback(TrainerCallback):
    """Store each checkpoint-N directory the Trainer writes as NAME/checkpoint-N.

    name: the run's name on the cluster (default: the output directory's base name; give
    one when several runs share a cluster). replicas: copies of each chunk. keep_last:
    how many of the run's checkpoints the cluster keeps (None: as many as the Trainer's
    save_total_limit keeps on disk, all when it has none).
    stored: the checkpoint names stored so far; failed: (name, error) of those not
    stored (yet: one is tried again while its directory is on disk)."""

    def __init__(
        self,
        name: str | None = None,
        *,
        replicas: int = defaults.DEFAULT_REPLICAS,
        keep_last: int | None = None,
    ):
        if name is not None and (not isinstance(name, str) or not name.strip("/")):
            raise SmoltorrentError(f"a run's name is a non-empty name, not {name!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise SmoltorrentError(f"keep_last keeps at least 1 checkpoint, not {keep_last!r}")
        self.name = None if name is None else name.strip("/")
        self.replicas = replicas
        self.keep_last = keep_last
        self.stored: list[str] = []
        self.failed: list[tuple[str, str]] = []
        self._paths: dict[str, str] = {}  # checkpoint name -> its directory, until stored

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:  # one rank stores; the others wrote the same
            return
        path = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}{state.global_step}")
        name = f"{self._run(args)}/{os.path.basename(path)}"
        if not self._store(path, name):
            return
        # The cluster answers again: the checkpoints it could not take before, oldest first.
        for earlier, earlier_path in list(self._paths.items()):
            if os.path.isdir(earlier_path):
                self._store(earlier_path, earlier)
        self._prune(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        for name, path in list(self._paths.items()):
            if os.path.isdir(path):
                self._store(path, name)
        for name, error in self.failed:
            path = self._paths[name]
            log.warning(
                "smoltorrent: training ended with %s not stored (%s)%s",
                name,
                error,
                f"; `smoltorrent store {path} --name {name} --all-files` stores it"
                if os.path.isdir(path)
                else f"; its directory {path} was deleted (save_total_limit)",
            )

    def _run(self, args) -> str:
        return self.name or default_name(args.output_dir)

    def _store(self, path: str, name: str) -> bool:
        """Store one checkpoint directory; whether it was. A failure is logged and kept in
        `failed`, never raised: the step goes on."""
        self.failed = [f for f in self.failed if f[0] != name]
        self._paths[name] = path
        started = time.monotonic()
        try:
            from tasks.directory_requests import store_directory

            # give_up_unserved: a worker gone meanwhile is not waited for (the store it
            # holds stays recorded and goes on when it is back; this one is tried again).
            store_directory(path, name, self.replicas, all_files=True, give_up_unserved=True)
        except Exception as exc:  # never into the training step: its copy is on disk
            self.failed.append((name, str(exc)))
            log.warning(
                "smoltorrent: %s was not stored (%s); it is still at %s, tried again once a"
                " later checkpoint is stored and when training ends (`smoltorrent store %s"
                " --name %s --all-files` stores it by hand)",
                name,
                exc,
                path,
                path,
                name,
            )
            return False
        del self._paths[name]
        self.stored.append(name)
        log.info("smoltorrent: stored %s in %.1f s", name, time.monotonic() - started)
        return True

    def _prune(self, args, state) -> None:
        """Remove the run's stored checkpoints past the newest `keep_last` (the Trainer's
        save_total_limit by default) by the Trainer's own rule (rotate_checkpoints): the
        newest and the best stay, the oldest others go; never raises into the step."""
        keep = self.keep_last or args.save_total_limit
        if not keep or keep < 1:
            return
        from tasks.directory_requests import remove_directory

        run = self._run(args)
        try:
            oldest_first = [name for _, name in reversed(checkpoints(run))]
            if not oldest_first:
                return
            protected = {oldest_first[-1]}
            if state.best_model_checkpoint:
                protected.add(f"{run}/{os.path.basename(state.best_model_checkpoint)}")
            remaining = len(oldest_first)
            for name in oldest_first:
                if remaining <= max(keep, len(protected)):
                    break
                if name in protected:
                    continue
                remaining -= 1
                if remove_directory(name):
                    log.info("smoltorrent: removed %s (the run keeps %d)", name, keep)
                else:
                    log.info("smoltorrent: %s has a pinned version; kept", name)
        except Exception as exc:  # retention is not worth a step: done after the next
            log.warning("smoltorrent: old checkpoints of %s not removed (%s)", run, exc)


def checkpoints(name: str) -> list[tuple[int, str]]:
    """(step, directory checkpoint name) of every checkpoint stored under `name`, newest
    first."""
    from coordinator.plan.directory import RECORD_FILE
    from coordinator.state.directories import Directories
    from tasks.requests import connected_metadata

    md = connected_metadata()
    found = []
    for member in md.versions.names():
        folder, _, file = member.rpartition("/")
        parent, _, base = folder.rpartition("/")
        match = _CHECKPOINT.match(base)
        if file == RECORD_FILE and parent == name and match:
            found.append((int(match.group(1)), folder))
    directories = Directories(md.r)
    return sorted((c for c in found if directories.is_directory(c[1])), reverse=True)


def restore(output_dir: str | os.PathLike[str], name: str | None = None) -> str | None:
    """Gather the newest checkpoint stored under `name` (default: the output directory's
    base name) into OUTPUT_DIR/checkpoint-N, so `trainer.train(resume_from_checkpoint=
    True)` resumes from it; its path, or None when the cluster holds none. A directory
    already there is left as it is (the Trainer wrote it, or an earlier restore did)."""
    from tasks.directory_requests import gather_directory

    name = (name or default_name(output_dir)).strip("/")
    found = checkpoints(name)
    if not found:
        return None
    step, newest = found[0]
    out = os.path.join(os.fspath(output_dir), f"{CHECKPOINT_PREFIX}{step}")  # as the Trainer's
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        log.info("smoltorrent: %s is there already; %s not gathered", out, newest)
        return out
    os.makedirs(os.fspath(output_dir), exist_ok=True)
    gather_directory(newest, os.path.abspath(out))
    return out
