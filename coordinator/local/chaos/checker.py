"""The checker: the promises a run's history and its final state must keep, one sentence
per breach. Pure: it reads what the run recorded and touches nothing but the gathered
files' paths.

Every store writes content of its own (workload.Contents), so a gather's digest names the
writes it can have come from: the store that sent those bytes and the rollbacks to it.
Each name is a linearizable register (as in Jepsen's Knossos): a gather G returning
content C is valid iff some write S of C to that name was invoked before G completed, did
not fail, and was not superseded before G began, by an acknowledged write of other content
(a waited store or rollback that exited 0, or an `rm` that exited 0) invoked after S
completed and completed before G was invoked. A write that never completed (killed at
the harness's timeout) is concurrent with everything after it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable

from coordinator.local.chaos.history import Final, Op

WRITES = ("store", "store-no-wait", "rollback")  # the kinds that write a content
WAITED = ("store", "rollback")  # exit 0 means committed (--no-wait: only recorded)
UNKNOWN_EXITS = (3, None)  # 3: recorded, outcome unknown; None: killed at the timeout


def check(ops: list[Op], final: Final, faults: Iterable[dict] = ()) -> list[str]:
    """Every promise the history and the final state must keep; one sentence per breach.

    faults: the nemesis's records (applied_at, healed_at, took_effect); only one that
    took effect and was held while an operation ran explains its hang."""
    counted = [f for f in faults if f.get("took_effect")]
    bad: list[str] = []
    bad += _check_writes(ops, final)
    bad += _check_versions(ops, final)
    bad += _check_reads(ops, final)
    bad += _check_removes(ops, final)
    bad += _check_hangs(ops, counted)
    removed_names = {op.name for op in ops if op.kind == "remove" and op.exit == 0}
    bad += _check_latest(final, removed_names)
    if final.open_requests:
        bad.append(f"requests still open after healing: {sorted(final.open_requests)}")
    if final.unsettled:
        bad.append(f"versions still pending or removing after healing: {final.unsettled}")
    if final.under_replicated:
        bad.append(f"under-replicated after healing: {final.under_replicated}")
    if final.diagnosis:
        bad[-1] += f"\nthe cluster when the settling ran out: {final.diagnosis}"
    return bad


def failed(op: Op) -> bool:
    """The command said the request failed: nothing of it may ever become current."""
    return op.exit not in (0, *UNKNOWN_EXITS)


def _requests_by_path(final: Final) -> dict[str, tuple[str, dict[str, str]]]:
    return {
        json.loads(r["args"]).get("path"): (rid, r)
        for rid, r in final.requests.items()
        if r.get("kind") == "store"
    }


def _check_writes(ops: list[Op], final: Final) -> list[str]:
    """Each store's and rollback's exit status against its request and version."""
    bad: list[str] = []
    by_path = _requests_by_path(final)
    states = {v["vkey"]: v["state"] for v in final.versions}
    removed = _removed_after(ops)
    # The contents a write that did not fail sent: a failed rollback's version may be
    # committed by the store it rolled back to, which is no breach.
    sent_ok = {(op.name, op.content) for op in ops if op.kind in WRITES and not failed(op)}
    for op in ops:
        if op.kind not in WRITES:
            continue
        rid, req = by_path.get(op.path, (None, None))
        vkey = req.get("vkey") if req else None
        if op.exit == 0 and req is None:
            bad.append(f"{_op(op)} exited 0 but no request of it is recorded (lost)")
        if op.kind in WAITED and op.exit == 0 and req is not None:
            said = _vkey_from(op.output)
            if said != vkey:
                bad.append(f"{_op(op)} exited 0 naming version {said}, but its request has {vkey}")
            if states.get(vkey) != "committed" and not removed(op):
                bad.append(
                    f"{_op(op)} exited 0 (committed) but its version {vkey} is"
                    f" {states.get(vkey, 'not listed')}"
                )
            if req.get("state") != "done":
                bad.append(f"{_op(op)} exited 0 but its request {rid} is {req.get('state')}")
        if failed(op) and req is not None and states.get(vkey) == "committed":
            said = (op.error.strip() or op.output.strip())[-300:]
            if req.get("state") == "done":
                bad.append(
                    f"{_op(op)} exited {op.exit} (failed) but its request {rid} "
                    f"committed version {vkey}: {said}"
                )
            elif (op.name, op.content) not in sent_ok:
                bad.append(
                    f"{_op(op)} exited {op.exit} (failed), its request {rid} closed"
                    f" {req.get('state')}, but its version {vkey} committed anyway: {said}"
                )
    return bad


def _check_versions(ops: list[Op], final: Final) -> list[str]:
    """Every committed version gathers at the end, byte for byte what its store sent: the
    acknowledged ones, and those of --no-wait, exit-3 and timed-out stores alike."""
    bad: list[str] = []
    by_vkey: dict[str, list[Op]] = {}
    by_path = _requests_by_path(final)
    for op in ops:
        if op.kind in WRITES and op.path in by_path:
            by_vkey.setdefault(by_path[op.path][1].get("vkey", ""), []).append(op)
    for v in final.versions:
        if v["state"] != "committed":
            continue
        vkey = v["vkey"]
        got = final.gathered.get(vkey)
        want = v.get("content")
        who = _who(by_vkey.get(vkey, []))
        if got is None:
            bad.append(f"the final gather of {v['name']} version {vkey} ({who}) failed")
        elif want is None:
            bad.append(f"{v['name']} version {vkey}: no store of it is known ({who})")
        elif got != want:
            bad.append(
                f"{v['name']} version {vkey} ({who}) gathers {got[:12]}, but its store sent"
                f" {want[:12]}"
            )
    return bad


def _who(ops: list[Op]) -> str:
    acked = [op for op in ops if op.kind in WAITED and op.exit == 0]
    if acked:
        return f"acknowledged by {_op(acked[0])}"
    if ops:
        return f"{_op(ops[0])}, exit {ops[0].exit}"
    return "no store of this run"


def _check_reads(ops: list[Op], final: Final) -> list[str]:
    """Each gather's exit and bytes, and the final current of each name, against the
    register model."""
    bad: list[str] = []
    writes: dict[str, list[Op]] = {}
    for op in ops:
        if op.kind in WRITES and op.content:
            writes.setdefault(op.name, []).append(op)
    acked = _acknowledged(ops)
    for op in ops:
        if op.kind != "gather":
            continue
        if op.exit not in (0, None) and os.path.exists(op.path):
            bad.append(f"{_op(op)} exited {op.exit} but left a file at {op.path}")
        if op.exit != 0:
            continue
        if op.content is None:
            bad.append(f"{_op(op)} exited 0 but wrote no file")
            continue
        bad += _judge_read(op, writes, acked)
    end = max((_end(op) for op in ops if op.completed is not None), default=0.0)
    for name, content in sorted(final.current.items()):
        if content is not None:
            read = Op(-1, "gather", name, content, "", end, end, 0)
            bad += _judge_read(read, writes, acked, what=f"at the end {name}")
    return bad


def _judge_read(
    read: Op, writes: dict[str, list[Op]], acked: dict[str, list[Op]], what: str = ""
) -> list[str]:
    what = what or _op(read)
    mine = [s for s in writes.get(read.name, []) if s.content == read.content]
    if not mine:
        elsewhere = sorted({n for n, ws in writes.items() for s in ws if s.content == read.content})
        if elsewhere:
            return [
                f"{what} served {read.content[:12]}, a content of {elsewhere} (read across names)"
            ]
        return [f"{what} served {read.content[:12]}: bytes no store of {read.name} sent"]
    reasons = []
    for s in mine:
        if failed(s):
            reasons.append(f"{_op(s)} wrote it and exited {s.exit} (failed)")
        elif s.invoked > read.completed:
            reasons.append(f"{_op(s)} wrote it after the gather ended (a future read)")
        elif (later := _superseding(s, read, acked)) is not None:
            reasons.append(
                f"{_op(s)} wrote it, superseded by {_op(later)} before the gather began"
                f" (a stale read)"
            )
        else:
            return []
    return [f"{what} served {read.content[:12]}, which it may not: " + "; ".join(reasons)]


def _acknowledged(ops: list[Op]) -> dict[str, list[Op]]:
    """Per name, the writes a client was told are done: waited stores and rollbacks, and
    removes, that exited 0."""
    out: dict[str, list[Op]] = {}
    for op in ops:
        if (op.kind in WAITED or op.kind == "remove") and op.exit == 0:
            out.setdefault(op.name, []).append(op)
    return out


def _superseding(write: Op, read: Op, acked: dict[str, list[Op]]) -> Op | None:
    """An acknowledged write of other content (or a remove) to the name, wholly between
    `write`'s end and `read`'s start; None if there is none."""
    for later in acked.get(read.name, []):
        if later.content == write.content:
            continue
        if _end(write) < later.invoked and _end(later) < read.invoked:
            return later
    return None


def _end(op: Op) -> float:
    """When an operation ended; a killed one never did (it may still take effect)."""
    return math.inf if op.exit is None or op.completed is None else op.completed


def _removed_after(ops: list[Op]):
    """A predicate: whether a write's name had a remove invoked after it (one that failed
    may still have removed some versions)."""
    removes = [op for op in ops if op.kind == "remove"]

    def removed(write: Op) -> bool:
        return any(r.name == write.name and r.invoked >= write.invoked for r in removes)

    return removed


def _check_removes(ops: list[Op], final: Final) -> list[str]:
    """Once `rm` exited 0, no version of the name stored wholly before it is committed in
    the final listing (a gather after it is judged by the register model)."""
    bad: list[str] = []
    by_path = _requests_by_path(final)
    vkey_writes: dict[str, list[Op]] = {}
    for op in ops:
        if op.kind in WRITES and op.path in by_path:
            vkey_writes.setdefault(by_path[op.path][1].get("vkey", ""), []).append(op)
    for rm in (op for op in ops if op.kind == "remove" and op.exit == 0):
        for v in final.versions:
            if v["name"] != rm.name or v["state"] != "committed":
                continue
            writers = vkey_writes.get(v["vkey"], [])
            if writers and all(_end(w) < rm.invoked for w in writers):
                bad.append(
                    f"{_op(rm)} exited 0, but version {v['vkey']} ({_op(writers[0])},"
                    f" stored before it) is still committed"
                )
    return bad


def _check_hangs(ops: list[Op], faults: list[dict]) -> list[str]:
    """An operation killed at the harness's timeout is a violation unless a fault that
    took effect was held while it ran."""
    bad = []
    for op in ops:
        if op.exit is not None:
            continue
        ended = op.completed if op.completed is not None else math.inf
        if not any(
            f["applied_at"] <= ended and f.get("healed_at", math.inf) >= op.invoked for f in faults
        ):
            bad.append(f"{_op(op)} hung (killed at the timeout) with no fault held meanwhile")
    return bad


def _check_latest(final: Final, removed_names: set[str]) -> list[str]:
    """Each name whose current was read at the end serves the content of its latest
    accepted store request (order: the requests' sequence numbers) among those that
    committed."""
    states = {v["vkey"]: v["state"] for v in final.versions}
    content_of = {v["vkey"]: v.get("content") for v in final.versions}
    latest: dict[str, tuple[int, dict]] = {}
    for rec in final.requests.values():
        if rec.get("kind") != "store" or rec.get("state") != "done":
            continue
        name = json.loads(rec["args"])["name"]
        if name in removed_names or name not in final.current:
            continue
        if states.get(rec.get("vkey", "")) != "committed":
            continue
        seq = int(rec["seq"])
        if name not in latest or seq > latest[name][0]:
            latest[name] = (seq, rec)
    bad = []
    for name, (seq, rec) in sorted(latest.items()):
        want = rec.get("content") or content_of.get(rec["vkey"])
        got = final.current.get(name)
        if want is None:  # nothing to compare with: never a pass, whatever is served
            bad.append(
                f"{name}: the content its latest accepted request (seq {seq}, version"
                f" {rec['vkey'][:12]}) stored is unknown, so what it serves cannot be judged"
            )
        elif got != want:
            bad.append(
                f"{name} serves {str(got)[:12]}, but its latest accepted request (seq {seq},"
                f" version {rec['vkey'][:12]}) stored {str(want)[:12]}"
            )
    return bad


def _op(op: Op) -> str:
    return f"client {op.client} {op.kind} {op.name} @{op.invoked:.2f}"


def _vkey_from(output: str) -> str | None:
    with contextlib.suppress(ValueError, AttributeError):
        return json.loads(output).get("vkey")
    return None
