"""A training run's nested state through smoltorrent.keypaths and real safetensors files:
every key, container type and plain value comes back as it was, tensors bit for bit,
tied tensors stored once and shared again; a flat state dict is written as it always was."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import safetensors.torch
import torch

from coordinator.plan.safetensors_header import read_header
from smoltorrent.errors import StateDictError
from smoltorrent.keypaths import STATE_KEY, decode, encode, flatten, parse_structure, unflatten
from smoltorrent.tensors import read_file, write_file


def round_trip(state, framework, tmp_path):
    flat = flatten(state)
    path = str(tmp_path / f"{framework}.safetensors")
    write_file(
        flat.tensors,
        path,
        flat.framework,
        None if flat.structure is None else {STATE_KEY: flat.structure},
    )
    tree = parse_structure(read_header(path).metadata)
    tensors = read_file(path, framework)
    return path, (tensors if tree is None else unflatten(tree, tensors))


@pytest.mark.parametrize(
    "path",
    [
        ("model", "layers.0.weight"),
        ("optim", "state", 0, "exp_avg"),
        ("0", 0, "-1", -1, "007"),
        ("a/b", "%2F", "%", "50%/x"),
        ("", "", "ü/\n"),
    ],
)
def test_a_key_path_decodes_to_the_keys_it_was_made_of(path):
    assert decode(encode(path)) == path


def test_int_and_str_keys_stay_apart_and_dotted_names_read_as_they_are():
    assert encode(("optim", "state", 0, "exp_avg")) == "optim/state/0/exp_avg"
    assert encode(("x", "0")) != encode(("x", 0))
    assert encode(("model", "layers.0.weight")) == "model/layers.0.weight"


def test_a_flat_state_dict_writes_the_file_it_always_wrote(tmp_path):
    sd = OrderedDict(
        [("layers.0.weight", torch.randn(3, 4)), ("a/b", torch.arange(5)), ("0", torch.ones(1))]
    )
    path, back = round_trip(sd, "torch", tmp_path)
    assert Path(path).read_bytes() == safetensors.torch.save(dict(sd))
    assert read_header(path).metadata is None
    assert type(back) is dict and sorted(back) == sorted(sd)


def test_a_training_state_comes_back_with_its_structure_and_exact_values(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "step": 3,
        "values": [True, None, 2.5, -0.0, math.inf, 10**30, "x", (1, [2, {}])],
        "keys": {0: torch.zeros(2), "0": torch.ones(2), "a/b": 1, "%": 2, "": 3},
    }
    _, back = round_trip(state, "torch", tmp_path)
    assert type(back["model"]) is OrderedDict and list(back["model"]) == list(state["model"])
    for name, tensor in state["model"].items():
        assert torch.equal(back["model"][name], tensor)
    assert back["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)  # a tuple again
    assert sorted(back["optim"]["state"]) == [0, 1, 2, 3]
    for i, per_param in state["optim"]["state"].items():
        for key, tensor in per_param.items():
            assert torch.equal(back["optim"]["state"][i][key], tensor)
    assert back["sched"] == state["sched"]
    assert back["rng"]["python"] == state["rng"]["python"]
    random.setstate(back["rng"]["python"])  # takes it as it comes back (tuples)
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert back["values"] == state["values"] and back["step"] == 3
    assert math.copysign(1, back["values"][3]) == -1.0
    assert list(back["keys"]) == [0, "0", "a/b", "%", ""]
    assert torch.equal(back["keys"][0], torch.zeros(2)) and torch.equal(
        back["keys"]["0"], torch.ones(2)
    )


def test_tied_tensors_are_stored_once_and_come_back_shared(tmp_path):
    embed = torch.randn(64, 16)
    state = {"model": {"embed.weight": embed, "lm_head.weight": embed, "rows": embed[:2]}}
    flat = flatten(state)
    assert sorted(flat.tensors) == ["model/embed.weight", "model/rows"]
    _, back = round_trip(state, "torch", tmp_path)
    assert back["model"]["lm_head.weight"] is back["model"]["embed.weight"]
    assert torch.equal(back["model"]["rows"], embed[:2])
    # A flat state dict with tied tensors is stored the same way.
    flat_tied = flatten({"embed": embed, "head": embed})
    assert list(flat_tied.tensors) == ["embed"] and flat_tied.structure is not None


def test_numpy_and_mlx_states(tmp_path):
    import mlx.core as mx

    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    _, back = round_trip({"w": [arr, arr.T], "n": 1}, "numpy", tmp_path)
    assert np.array_equal(back["w"][0], arr) and np.array_equal(back["w"][1], arr.T)
    assert back["w"][0] is not back["w"][1] and back["n"] == 1
    m = mx.arange(4)
    _, back = round_trip({"w": (m, m), "s": "x"}, "mlx", tmp_path)
    assert mx.array_equal(back["w"][0], m).item() and back["w"][0] is back["w"][1]


@pytest.mark.parametrize(
    "state, where",
    [
        ({"a": {"b": {1, 2}}}, "'a/b'"),
        ({"a": {(1, 2): 3}}, "(1, 2)"),
        ({"a": torch.ones(1), "b": mx.ones(1)}, "mixes mlx and torch"),
        ([torch.ones(1)], "mapping"),
    ],
)
def test_what_a_state_cannot_hold_is_refused_with_where_it_is(state, where):
    with pytest.raises(StateDictError, match=None) as info:
        flatten(state)
    assert where in str(info.value)
