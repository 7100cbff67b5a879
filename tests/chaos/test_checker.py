"""The chaos checker on made-up histories: each promise it checks is broken once, and it
says so; a history that keeps them all passes. No cluster: the checker is pure."""

from __future__ import annotations

import dataclasses
import json

from coordinator.local.chaos import FAULT_KINDS, SKEW_S, Final, Op, check, draw_schedule

A, B = "a" * 64, "b" * 64
NAME = "run/latest.safetensors"


def store(path: str, content: str, *, exit: int | None = 0, vkey: str = "va", t: float = 1) -> Op:
    out = json.dumps({"vkey": vkey}) if exit == 0 else ""
    return Op(0, "store", NAME, content, path, t, t + 1, exit, out, "")


def request(path: str, seq: int, vkey: str, state: str = "done") -> dict[str, str]:
    args = json.dumps({"path": path, "name": NAME})
    return {"kind": "store", "args": args, "seq": str(seq), "state": state, "vkey": vkey}


def final(**changes) -> Final:
    base = {
        "requests": {"r1": request("/a1", 1, "va"), "r2": request("/b1", 2, "vb")},
        "versions": [
            {"vkey": "va", "state": "committed", "name": NAME, "content": A},
            {"vkey": "vb", "state": "committed", "name": NAME, "content": B},
        ],
        "gathered": {"va": A, "vb": B},
        "current": {NAME: B},
        "open_requests": [],
        "unsettled": [],
        "under_replicated": [],
    }
    return Final(**(base | changes))


OPS = [store("/a1", A, vkey="va"), store("/b1", B, vkey="vb", t=2)]
NAMES = {NAME: {A, B}}


def test_a_history_that_keeps_every_promise_passes():
    assert check(OPS, final(), NAMES) == []


def test_an_acknowledged_store_that_does_not_gather_identical_is_a_violation():
    [v] = check(OPS, final(gathered={"va": B, "vb": B}), NAMES)
    assert "acknowledged" in v and "va" in v


def test_an_acknowledged_store_with_no_request_is_lost():
    ops = [*OPS, store("/a2", A, vkey="va", t=3)]
    [v] = check(ops, final(), NAMES)
    assert "no request" in v


def test_a_name_serving_an_older_request_is_a_violation():
    [v] = check(OPS, final(current={NAME: A}), NAMES)
    assert "latest accepted request (seq 2" in v


def test_a_failed_exit_for_a_store_that_committed_is_a_violation():
    ops = [OPS[0], store("/b1", B, exit=1, t=2)]
    [v] = check(ops, final(), NAMES)
    assert "exited 1 (failed)" in v
    # Under --json the CLI's error is on stdout: the violation quotes it (it read empty).
    said = dataclasses.replace(ops[1], output='{"error": "cannot reach Redis"}')
    [v] = check([OPS[0], said], final(), NAMES)
    assert "cannot reach Redis" in v
    # Exit 3 says the outcome is unknown (recorded, may complete), not failed.
    assert check([OPS[0], store("/b1", B, exit=3, t=2)], final(), NAMES) == []


def test_a_gather_of_bytes_never_stored_is_a_violation(tmp_path):
    gather = Op(1, "gather", NAME, "c" * 64, str(tmp_path / "out"), 3, 4, 0, "", "")
    [v] = check([*OPS, gather], final(), NAMES)
    assert "bytes no store" in v


def test_a_failed_gather_that_left_a_file_is_a_violation(tmp_path):
    out = tmp_path / "out"
    out.write_bytes(b"partial")
    gather = Op(1, "gather", NAME, None, str(out), 3, 4, 1, "", "error")
    [v] = check([*OPS, gather], final(), NAMES)
    assert "left a file" in v


def test_what_stays_open_or_under_r_after_healing_is_a_violation():
    got = check(
        OPS,
        final(open_requests=["r9"], unsettled=["vc"], under_replicated=[{"shard": 0}]),
        NAMES,
    )
    assert len(got) == 3


def test_a_seed_draws_the_same_schedule_every_time():
    first = draw_schedule(5, 60, 4)
    assert first == draw_schedule(5, 60, 4) and first != draw_schedule(6, 60, 4)
    assert {f.kind for f in first.faults} <= set(FAULT_KINDS)
    assert all(f.at_s < 60 for f in first.faults)
    assert "seed 5" in first.describe()


def test_an_overlapping_schedule_holds_faults_at_once_never_two_on_one_process():
    faults = draw_schedule(5, 60, 4, overlap=True).faults
    at_once = [(a, b) for a in faults for b in faults if a.at_s < b.at_s < a.at_s + a.hold_s]
    assert at_once, faults
    for a, b in at_once:
        assert a.target != b.target or a.kind.split("-")[1] != b.kind.split("-")[1], (a, b)


def test_a_node_clock_or_link_fault_names_its_node_and_replays():
    kinds = ("skew-node", "cutcoord-node", "cutpeers-node", "flap-node")
    schedule = draw_schedule(9, 120, 4, kinds)
    assert schedule == draw_schedule(9, 120, 4, kinds)
    assert {f.kind for f in schedule.faults} == set(kinds)
    for f in schedule.faults:
        assert 0 <= f.target < 4
        assert abs(f.skew_s) == (SKEW_S if f.kind == "skew-node" else 0)
    described = schedule.describe()
    assert "cutpeers  node" in described and "300s" in described


def test_a_latest_request_whose_content_nobody_knows_is_not_taken_as_served():
    """issue 38: _check_latest passed when both sides were None (the latest request's
    content unknown, and the name's current gather failed or was never read): a name that
    serves nothing must not pass as serving its latest store."""
    versions = [
        {"vkey": "va", "state": "committed", "name": NAME, "content": A},
        {"vkey": "vb", "state": "committed", "name": NAME, "content": None},
    ]
    [v] = check(OPS[:1], final(versions=versions, current={NAME: None}), NAMES)
    assert "latest accepted request (seq 2" in v and "unknown" in v
