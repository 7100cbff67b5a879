"""A tiny LightningModule for tests/smoltorrent/test_lightning.py: a linear layer, AdamW and a
StepLR on 12 fixed samples in batches of 4 (3 steps an epoch), on CPU, quiet."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import torch

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, _):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]

    def train_dataloader(self):
        x = torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def trainer(epochs: int, **kwargs) -> pl.Trainer:
    # Epochs, not max_steps: a run Lightning stops by max_steps right at an epoch's end
    # resumes from its last.ckpt one batch off (with Lightning's own files too), while one
    # stopped by max_epochs resumes exactly.
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def state_bits(model: Tiny, run: pl.Trainer) -> dict:
    """What must be equal after a resume: weights, the optimizer's state, the step."""
    optim = run.optimizers[0].state_dict()
    return {
        "weights": {k: v.tolist() for k, v in model.state_dict().items()},
        "optim": {str(p): {k: v.tolist() for k, v in s.items()} for p, s in optim["state"].items()},
        "lr": [g["lr"] for g in optim["param_groups"]],
        "global_step": run.global_step,
    }
