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


OPS = [store("/a1", A, vkey="va"), store("/b1", B, vkey="vb", t=3)]


def test_a_history_that_keeps_every_promise_passes():
    assert check(OPS, final()) == []


def test_an_acknowledged_store_that_does_not_gather_identical_is_a_violation():
    [v] = check(OPS, final(gathered={"va": B, "vb": B}))
    assert "acknowledged" in v and "va" in v


def test_an_acknowledged_store_with_no_request_is_lost():
    ops = [*OPS, store("/a2", A, vkey="va", t=3)]
    [v] = check(ops, final())
    assert "no request" in v


def test_a_name_serving_an_older_request_is_a_violation():
    [v] = check(OPS, final(current={NAME: A}))
    assert "latest accepted request (seq 2" in v


def test_a_failed_exit_for_a_store_that_committed_is_a_violation():
    ops = [OPS[0], store("/b1", B, exit=1, t=2)]
    v, served = check(ops, final())
    assert "exited 1 (failed)" in v and "committed version vb" in v
    assert "at the end" in served and "exited 1 (failed)" in served  # and it is current
    # Under --json the CLI's error is on stdout: the violation quotes it (it read empty).
    said = dataclasses.replace(ops[1], output='{"error": "cannot reach Redis"}')
    v, _ = check([OPS[0], said], final())
    assert "cannot reach Redis" in v
    # Exit 3 says the outcome is unknown (recorded, may complete), not failed.
    assert check([OPS[0], store("/b1", B, exit=3, t=2)], final()) == []


def test_a_gather_of_bytes_never_stored_is_a_violation(tmp_path):
    gather = Op(1, "gather", NAME, "c" * 64, str(tmp_path / "out"), 3, 4, 0, "", "")
    [v] = check([*OPS, gather], final())
    assert "bytes no store" in v


def test_a_failed_gather_that_left_a_file_is_a_violation(tmp_path):
    out = tmp_path / "out"
    out.write_bytes(b"partial")
    gather = Op(1, "gather", NAME, None, str(out), 3, 4, 1, "", "error")
    [v] = check([*OPS, gather], final())
    assert "left a file" in v


def test_what_stays_open_or_under_r_after_healing_is_a_violation():
    got = check(
        OPS,
        final(open_requests=["r9"], unsettled=["vc"], under_replicated=[{"shard": 0}]),
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
    unknown, v = check(OPS[:1], final(versions=versions, current={NAME: None}))
    assert "no store of it is known" in unknown
    assert "latest accepted request (seq 2" in v and "unknown" in v


# --- issue 38 item 1: each name a linearizable register over unique contents -----------
C, D = "c" * 64, "d" * 64
OTHER = "run/best.safetensors"


def gather(content: str | None, t: float, *, name: str = NAME, took: float = 1, exit=0) -> Op:
    return Op(1, "gather", name, content, "/nowhere/out", t, t + took, exit, "", "")


def test_a_stale_read_is_a_violation():
    """B was acknowledged (and superseded A) before the gather began: A is stale."""
    [v] = check([*OPS, gather(A, 5)], final())
    assert "stale read" in v and "superseded by client 0 store" in v


def test_a_read_concurrent_with_a_store_may_return_either_content():
    """B's store runs 2-3 and the gather 2.5-3.5: A (not yet superseded when the gather
    began) and B (in flight) are both valid."""
    ops = [store("/a1", A, vkey="va"), store("/b1", B, vkey="vb", t=2)]
    ops[1].completed = 3
    assert check([*ops, gather(A, 2.5)], final()) == []
    assert check([*ops, gather(B, 2.5)], final()) == []


def test_a_read_of_a_store_that_began_after_the_gather_ended_is_a_violation():
    [v] = check([*OPS, gather(B, 0.1, took=0.5)], final())
    assert "future read" in v


def test_a_read_across_names_is_a_violation():
    """C was only ever stored under another name: a gather of NAME returning it read the
    wrong register."""
    other = Op(2, "store", OTHER, C, "/c1", 1, 2, 0, json.dumps({"vkey": "vc"}), "")
    requests = final().requests | {
        "r3": {**request("/c1", 3, "vc"), "args": json.dumps({"path": "/c1", "name": OTHER})}
    }
    versions = [
        *final().versions,
        {"vkey": "vc", "state": "committed", "name": OTHER, "content": C},
    ]
    f = final(requests=requests, versions=versions, gathered={"va": A, "vb": B, "vc": C})
    f.current[OTHER] = C
    [v] = check([*OPS, other, gather(C, 5)], f)
    assert "read across names" in v and OTHER in v


def test_a_read_of_a_failed_write_is_a_violation():
    """C's store exited 1: its content must never be served, even by a gather that ran
    while it did."""
    failed = Op(2, "store", NAME, C, "/c1", 3, 4, 1, "", "failed")
    [v] = check([*OPS, failed, gather(C, 3.5)], final())
    assert "exited 1 (failed)" in v


def test_a_rollback_is_a_write_of_the_content_it_rolls_back_to():
    """A, B, then a rollback to A (its own request, A's bytes): A is current and fresh."""
    rollback = Op(0, "rollback", NAME, A, "/a2", 4.5, 4.8, 0, json.dumps({"vkey": "va"}), "")
    requests = final().requests | {"r3": request("/a2", 3, "va")}
    f = final(requests=requests, current={NAME: A})
    assert check([*OPS, rollback, gather(A, 5)], f) == []
    # Without it, A gathered at 5 is stale, and A current at the end too.
    assert len(check([*OPS, gather(A, 5)], final(current={NAME: A}))) == 3


def test_a_failed_request_whose_version_committed_anyway_is_a_violation():
    """The store exited 1 and its request closed failed, yet its version committed."""
    ops = [OPS[0], store("/b1", B, exit=1, t=2)]
    requests = {"r1": request("/a1", 1, "va"), "r2": request("/b1", 2, "vb", state="failed")}
    got = check(ops, final(requests=requests, current={NAME: A}))
    assert any("closed failed" in v and "committed anyway" in v for v in got), got


def test_an_acknowledged_store_naming_another_version_is_a_violation():
    ops = [OPS[0], store("/b1", B, vkey="vx", t=2)]
    [v] = check(ops, final())
    assert "naming version vx" in v


def test_a_remove_that_exited_0_serves_nothing_stored_before_it():
    scratch = "scratch/0-1.safetensors"
    s = Op(0, "store", scratch, C, "/c1", 3, 4, 0, json.dumps({"vkey": "vc"}), "")
    rm = Op(0, "remove", scratch, None, "", 5, 6, 0, "[]", "")
    args = json.dumps({"path": "/c1", "name": scratch})
    requests = final().requests | {"r3": {**request("/c1", 3, "vc"), "args": args}}
    gone = {"vkey": "vc", "state": "removed", "name": scratch, "content": C}
    f = final(requests=requests, versions=[*final().versions, gone])
    assert check([*OPS, s, rm, gather(None, 7, name=scratch, exit=1)], f) == []
    [v] = check([*OPS, s, rm, gather(C, 7, name=scratch)], f)
    assert "stale read" in v and "remove" in v
    kept = [*final().versions, {**gone, "state": "committed"}]
    f = final(requests=requests, versions=kept, gathered={"va": A, "vb": B, "vc": C})
    [v] = check([*OPS, s, rm], f)
    assert "still committed" in v


def test_a_hang_is_a_violation_unless_a_fault_that_took_effect_was_held_meanwhile():
    hung = Op(1, "gather", NAME, None, "/nowhere/out", 5, 125, None, "", "")
    fault = {"kind": "stop-redis", "applied_at": 4.0, "healed_at": 6.0, "took_effect": True}
    [v] = check([*OPS, hung], final())
    assert "hung" in v
    assert check([*OPS, hung], final(), [fault]) == []
    [v] = check([*OPS, hung], final(), [{**fault, "took_effect": False}])
    assert "hung" in v


def test_a_version_of_an_unwaited_store_is_gathered_and_compared_at_the_end():
    """A --no-wait store (exit 0: recorded) whose version committed: its final gather
    must succeed, with its bytes."""
    nowait = dataclasses.replace(OPS[1], kind="store-no-wait")
    assert check([OPS[0], nowait], final()) == []
    [v] = check([OPS[0], nowait], final(gathered={"va": A, "vb": None}))
    assert "final gather" in v and "vb" in v and "failed" in v
    [v] = check([OPS[0], nowait], final(gathered={"va": A, "vb": A}))
    assert "vb" in v and "gathers aaaaaaaaaaaa" in v


def test_a_name_whose_current_was_not_read_is_not_judged_by_its_latest_request():
    """A scratch name whose rm failed (Redis was down) kept its version; its current was
    never gathered, which is not a name serving nothing (seed 36 once reported it so)."""
    assert check(OPS, final(current={})) == []
