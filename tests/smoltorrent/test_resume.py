"""A training run resumed from smoltorrent.save / smoltorrent.load through a real cluster
trains on bit-identically with the run that never stopped."""

from __future__ import annotations

import pytest

from tests.smoltorrent.conftest import run_api

TRAIN = """
import json, random
import torch
import smoltorrent

OPTIMIZER = "__OPTIMIZER__"

def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    if OPTIMIZER == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    # Enabled on CPU (bf16 autocast); growth_interval=2 moves its scale while training.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return model, opt, sched, scaler

def train(model, opt, sched, scaler, steps):
    for _ in range(steps):
        x = torch.randn(16, 8)  # the data come from the RNG: its state must resume too
        noise = random.random()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (model(x).float() - noise).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()

def state_of(model, opt, sched, scaler, step):
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "step": step,
    }

random.seed(0)
run = build(0)
train(*run, 5)
smoltorrent.save(state_of(*run, 5), "resume/" + OPTIMIZER)
train(*run, 4)  # the uninterrupted run
random.seed(123)
fresh = build(1)  # other weights and RNG: only the load can make it match
state = smoltorrent.load("resume/" + OPTIMIZER)
model, opt, sched, scaler = fresh
model.load_state_dict(state["model"])
opt.load_state_dict(state["optim"])
sched.load_state_dict(state["sched"])
scaler.load_state_dict(state["scaler"])
torch.set_rng_state(state["rng"]["torch"])
random.setstate(state["rng"]["python"])
train(*fresh, 4)

def tensors(m, o):
    yield from m.state_dict().values()
    for per_param in o.state_dict()["state"].values():
        yield from per_param.values()

print(json.dumps({
    "step": state["step"],
    "same_weights_and_optimizer": all(
        torch.equal(a, b) for a, b in zip(tensors(run[0], run[1]), tensors(model, opt), strict=True)
    ),
    "optimizer_state_tensors": sum(1 for _ in tensors(model, opt)) - 4,
    "lr": [run[1].param_groups[0]["lr"], opt.param_groups[0]["lr"]],
    "scaler": [run[3].state_dict(), scaler.state_dict()],
}))
"""


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_resumed_run_trains_on_bit_identically(make_cluster, optimizer):
    c = make_cluster(2)
    out = run_api(c, TRAIN.replace("__OPTIMIZER__", optimizer))
    assert out["step"] == 5
    assert out["same_weights_and_optimizer"]
    assert out["optimizer_state_tensors"] > 0  # exp_avg, exp_avg_sq, step / momentum buffers
    assert out["lr"][0] == out["lr"][1] < 0.01  # StepLR decayed, and resumed where it was
    assert out["scaler"][0] == out["scaler"][1]
    assert out["scaler"][1]["scale"] != 2.0**10  # the scaler's state moved and came back


def test_partial_loads_pick_key_paths(make_cluster):
    c = make_cluster(2)
    out = run_api(
        c,
        """
        import json
        import torch
        import smoltorrent
        from smoltorrent.errors import NotFoundError

        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7,
                 "tied": [model.weight, model.weight]}
        smoltorrent.save(state, "partial/state")
        just_model = smoltorrent.load("partial/state", tensors=["model/*"])
        just_optim = smoltorrent.load("partial/state", tensors=["optim"])
        restored = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.5)
        restored.load_state_dict(just_optim["optim"])
        step_only = smoltorrent.load("partial/state", tensors=["step"])
        tied = smoltorrent.load("partial/state", tensors=["tied/1"])
        try:
            smoltorrent.load("partial/state", tensors=["model.*"])
            missing = None
        except NotFoundError as exc:
            missing = str(exc)
        print(json.dumps({
            "model": sorted(just_model) == ["model"]
            and sorted(just_model["model"]) == ["bias", "weight"]
            and torch.equal(just_model["model"]["weight"], model.weight.detach()),
            "optim": sorted(just_optim) == ["optim"] and restored.param_groups[0]["lr"] == 0.1,
            "step_only": step_only,
            "tied": torch.equal(tied["tied"][0], model.weight.detach()),
            "missing": missing,
        }))
        """,
    )
    assert out["model"] and out["optim"] and out["tied"]
    assert out["step_only"] == {"step": 7}
    assert "'model.*'" in out["missing"] and "model/weight" in out["missing"]
