"""The checker: the promises a run's history and its final state must keep, one sentence
per breach. Pure: it reads what the run recorded and touches nothing but the gathered
files' paths."""

from __future__ import annotations

import contextlib
import json
import os

from coordinator.local.chaos.history import Final, Op


def check(ops: list[Op], final: Final, content_names: dict[str, set[str]]) -> list[str]:
    """Every promise the history and the final state must keep; one sentence per breach.

    content_names: for each name, the SHA-256 of every content any store of it sent."""
    bad: list[str] = []
    by_path = {
        json.loads(r["args"]).get("path"): (rid, r)
        for rid, r in final.requests.items()
        if r.get("kind") == "store"
    }
    states = {v["vkey"]: v["state"] for v in final.versions}
    removed_names = {op.name for op in ops if op.kind == "remove"}
    for op in ops:
        if op.kind in ("store", "store-no-wait"):
            rid, req = by_path.get(op.path, (None, None))
            if op.exit == 0 and req is None:
                bad.append(f"{_op(op)} exited 0 but no request of it is recorded (lost)")
            if op.kind == "store" and op.exit == 0 and op.name not in removed_names:
                vkey = _vkey_from(op.output)
                got = final.gathered.get(vkey) if vkey else None
                if got != op.content:
                    bad.append(
                        f"{_op(op)} was acknowledged (version {vkey}) but gathers "
                        f"{got or 'nothing'}, not {op.content[:12]}"
                    )
            done = req is not None and req.get("state") == "done"
            # Exit 3: recorded, outcome unknown (not a failure). Under --json the error
            # is on stdout, so it is quoted from there when stderr has none.
            failed = op.exit not in (0, 3, None)
            if failed and done and states.get(req.get("vkey")) == "committed":
                said = (op.error.strip() or op.output.strip())[-300:]
                bad.append(
                    f"{_op(op)} exited {op.exit} (failed) but its request {rid} "
                    f"committed version {req['vkey']}: {said}"
                )
        elif op.kind == "gather":
            if op.exit == 0 and op.content not in content_names.get(op.name, set()):
                bad.append(f"{_op(op)} exited 0 with bytes no store of {op.name} sent")
            if op.exit not in (0, None) and os.path.exists(op.path):
                bad.append(f"{_op(op)} exited {op.exit} but left a file at {op.path}")
    bad += _check_latest(final, removed_names)
    if final.open_requests:
        bad.append(f"requests still open after healing: {sorted(final.open_requests)}")
    if final.unsettled:
        bad.append(f"versions still pending or removing after healing: {final.unsettled}")
    if final.under_replicated:
        bad.append(f"under-replicated after healing: {final.under_replicated}")
    return bad


def _check_latest(final: Final, removed_names: set[str]) -> list[str]:
    """Each name serves the content of its latest accepted store request (order: the
    requests' sequence numbers) among those that committed."""
    states = {v["vkey"]: v["state"] for v in final.versions}
    content_of = {v["vkey"]: v.get("content") for v in final.versions}
    latest: dict[str, tuple[int, dict]] = {}
    for rec in final.requests.values():
        if rec.get("kind") != "store" or rec.get("state") != "done":
            continue
        name = json.loads(rec["args"])["name"]
        if name in removed_names or states.get(rec.get("vkey", "")) != "committed":
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
