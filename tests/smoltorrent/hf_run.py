"""What the Trainer tests run in their own process: a tiny GPT-2 built from a config in
code (no download), random token data, a Trainer on the CPU, and what to compare."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)


def data(rows: int = 32, length: int = 16) -> list[dict]:
    ids = torch.randint(0, 64, (rows, length), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": r, "labels": r} for r in ids]


def trainer(
    output_dir: Path,
    callbacks=(),
    max_steps: int = 6,
    save_steps: int = 3,
    save_total_limit: int | None = None,
) -> Trainer:
    set_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    args = TrainingArguments(
        str(output_dir),
        max_steps=max_steps,
        save_steps=save_steps,
        save_total_limit=save_total_limit,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        seed=0,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    return Trainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=data(), callbacks=list(callbacks)
    )


class StopAfterSave(TrainerCallback):
    """Ends training right after the checkpoint of step `step` is saved (and stored): the
    run an interruption would have left."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class Pauses(TrainerCallback):
    """At the end of each step in `steps` (before that step's checkpoint is saved), writes
    DIRECTORY/at-N and waits for the test to write DIRECTORY/go-N: the test does what it
    must (kills Redis, the worker) at that point of the run, not at a time."""

    def __init__(self, directory: str | os.PathLike[str], steps: list[int]) -> None:
        self.directory, self.steps = Path(directory), set(steps)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps:
            (self.directory / f"at-{state.global_step}").touch()
            while not (self.directory / f"go-{state.global_step}").exists():
                time.sleep(0.05)


class Steps(TrainerCallback):
    """The steps this run trained (a resumed run's log history holds the earlier ones
    too, read back from trainer_state.json)."""

    def __init__(self) -> None:
        self.trained: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.trained.append(state.global_step)


def digests(root: str | os.PathLike[str]) -> dict[str, str]:
    root = Path(root)
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def losses(t: Trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}


def same_weights(a: Trainer, b: Trainer) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
