"""Per-rank sharded checkpoints on a real cluster, every rank its own process: a step
commits only once every rank's part is stored, and resume refuses a world-size change,
a partial step and a missing rank, each with its own error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from coordinator.state import redis_keys as K
from tests.smoltorrent.conftest import ROOT, ApiSession, run_api
from tests.tasks.conftest import wait_until

# What rank RANK saves at step STEP: numpy, not torch (the steps' commits and refusals are
# what these tests are about, not the framework), so a rank's process imports no torch,
# ~2 s of CPU each: the tests start 16 of them.
RANK_STATE = """
import numpy as np

def rank_state(step, rank):
    rng = np.random.default_rng(1000 * step + rank)
    return {"w": rng.standard_normal((32, 16)).astype(np.float32),
            "ids": rng.integers(-(1 << 40), 1 << 40, 48, dtype=np.int64),
            "flags": rng.standard_normal(7) > 0}

def same(got, want):
    return sorted(got) == sorted(want) and all(
        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        and got[k].tobytes() == want[k].tobytes() for k in want)
"""

RANK = (
    """
import json, sys
import smoltorrent
"""
    + RANK_STATE
    + """
name, step, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
keep = int(sys.argv[5]) if len(sys.argv) > 5 else None
sd = rank_state(step, rank)
# This rank's part only: some tests leave a step partial on purpose, which wait=True
# (the whole step) would wait out.
saved = smoltorrent.save_sharded(sd, name, step, rank, world, keep_last=keep, wait=False).result()
print(json.dumps({"version_id": saved.version_id}))
"""
)

# Tries each call of CALLS in turn, in one process (one import of torch and the API, not
# one per call): per call, the error's class and message, or what CHECK made of its result.
TRY = (
    """
import json
import smoltorrent
from smoltorrent.errors import ShardedCheckpointError
from tests.checkpoints import llm_like_tensors
"""
    + RANK_STATE
    + """
results = []
for call, check in json.loads(CALLS):
    try:
        out = eval(call)
    except ShardedCheckpointError as exc:
        results.append({"error": type(exc).__name__, "message": str(exc)})
    else:
        results.append({"value": eval(check)})
print(json.dumps(results))
"""
)


RESHARD = """
import json, torch, smoltorrent
from smoltorrent.errors import PartialStepError, WorldSizeMismatchError

flat = torch.arange(10, dtype=torch.float32) * 1.5  # the whole, as one rank would hold it
rows = torch.arange(7 * 3, dtype=torch.bfloat16).reshape(7, 3)

def share(rank, world):
    fo, fn = smoltorrent.partition(10, rank, world)
    ro, rn = smoltorrent.partition(7, rank, world)
    state = {"optim": {"flat_fp32": flat[fo:fo + fn].clone(), "step": 5},
             "model": {"embed": rows[ro:ro + rn].clone(), "bias": torch.ones(2)}}
    return state, {"optim/flat_fp32": ("flat", fo, 10), "model/embed": ("rows", ro, 7)}

handles = [smoltorrent.save_sharded(*share(r, 4)[:1], "zero", 1, r, 4,
                                    partitions=share(r, 4)[1], wait=False) for r in range(4)]
smoltorrent.save_sharded({"w": torch.ones(2)}, "plain", 1, 0, 1)
[h.result() for h in handles]

def bits(x):
    if isinstance(x, dict):
        return {k: bits(v) for k, v in x.items()}
    return x.view(torch.uint8).tolist() if isinstance(x, torch.Tensor) else x

out = {}
for world in (2, 8):
    out[str(world)] = all(
        bits(smoltorrent.load_sharded("zero", 1, r, world, reshard=True))
        == bits(share(r, world)[0])
        for r in range(world)
    )
try:
    smoltorrent.load_sharded("plain", 1, 0, 2, reshard=True)  # no partitions= recorded
except WorldSizeMismatchError as exc:
    out["refused"] = type(exc).__name__
# Step 2 of the 4 ranks: rank 2 never stores its part. Resharding it onto 2 or 8 ranks is
# refused, naming the stored step's missing rank (not ranks of the world loading it).
for r in (0, 1, 3):
    smoltorrent.save_sharded(*share(r, 4)[:1], "zero", 2, r, 4, partitions=share(r, 4)[1],
                             wait=False).result()
for world in (2, 8):
    try:
        smoltorrent.load_sharded("zero", 2, 0, world, reshard=True)
    except PartialStepError as exc:
        out[f"partial{world}"] = str(exc)
print(json.dumps(out))
"""


def ranks(cluster, name: str, step: int, rank_ids, world: int, keep: int | None = None) -> None:
    """Run one process per rank at once, as a launcher does; wait for them all."""
    extra = [] if keep is None else [str(keep)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, name, str(step), str(r), str(world), *extra],
            env=cluster.env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in rank_ids
    ]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        assert "version_id" in json.loads(out.strip().splitlines()[-1])


def attempts(api: ApiSession, *calls: str | tuple[str, str]) -> list[dict]:
    """Each call tried in order in the API session: a call alone (its result unchecked) or
    (call, check), check an expression of its result `out`."""
    pairs = [(c, "None") if isinstance(c, str) else c for c in calls]
    results = api.run(TRY.replace("CALLS", repr(json.dumps(pairs))))
    assert len(results) == len(pairs)
    return results


def test_a_step_commits_when_every_rank_is_stored_and_resume_refuses_bad_steps(
    make_cluster, api_session
):
    c = make_cluster(3)
    api = api_session(c)  # one API process for this test's attempts
    # Ranks 0 and 1 of 3 store step 100; rank 2 never does: the step stays partial.
    ranks(c, "run", 100, [0, 1], 3)
    latest, partial = attempts(
        api, ("smoltorrent.latest_step('run')", "out"), "smoltorrent.load_sharded('run', 100, 0, 3)"
    )
    assert latest == {"value": None}
    assert partial["error"] == "PartialStepError" and "rank 2 never finished" in partial["message"]

    ranks(c, "run", 100, [2], 3)
    # World-size change: resuming step 100 on 4 ranks, or adding a 4th rank's part to it.
    changes = (
        "smoltorrent.load_sharded('run', 100, 0, 4)",
        "smoltorrent.save_sharded(llm_like_tensors(layers=1), 'run', 100, 3, 4)",
    )
    latest, *loaded = attempts(
        api,
        ("smoltorrent.latest_step('run')", "out"),
        *(
            (
                f"smoltorrent.load_sharded('run', 100, {r}, 3, framework='numpy')",
                f"same(out, rank_state(100, {r}))",
            )
            for r in range(3)
        ),
        *changes,
    )
    assert latest == {"value": 100}
    for r, same in enumerate(loaded[:3]):
        assert same == {"value": True}, r
    for call, refused in zip(changes, loaded[3:], strict=True):
        assert refused["error"] == "WorldSizeMismatchError", call
        assert "world size 3" in refused["message"] or "by 3 ranks" in refused["message"]

    # With reshard=True the same change re-partitions what the ranks recorded: a step of 4
    # ranks (a flat ZeRO partition of 10 elements, 7 rows of a dim-0 shard, a replicated
    # step) loads on 2 and on 8 ranks, byte-equal with the same cut of the whole.
    resharded = api.run(RESHARD)
    assert {k: resharded.pop(k) for k in ("2", "8", "refused")} == {
        "2": True,
        "8": True,
        "refused": "WorldSizeMismatchError",
    }
    # A partial step of 4 ranks (rank 2 never stored) loaded with reshard=True on 2 or 8
    # ranks: the error names rank 2 of the 4, no rank of the loading world, and what to do.
    for world in (2, 8):
        message = resharded[f"partial{world}"]
        assert "of its 4 ranks, rank 2 never finished" in message, message
        assert "newest complete step, 1" in message, message
        assert "save_sharded(state, 'zero', 2, 2, 4)" in message, message

    # A missing rank: one rank's part of the committed step removed behind its back.
    c.cli("rm", "run/step-00000100/rank-00001-of-00003.safetensors", "--yes")
    # Resuming it on 3 ranks, or resharding it onto 2, names the rank and what to do.
    calls = (
        "smoltorrent.load_sharded('run', 100, 0, 3)",
        "smoltorrent.load_sharded('run', 100, 0, 2, reshard=True)",
    )
    for call, missing in zip(calls, attempts(api, *calls), strict=True):
        assert missing["error"] == "MissingRankError", call
        assert "the part of rank 1 of its 3 ranks" in missing["message"], missing
        assert "No older step of it has every part" in missing["message"], missing


def test_keep_last_removes_old_committed_steps_never_one_in_flight(make_cluster, api_session):
    c = make_cluster(2)
    api = api_session(c)  # one API process for this test's attempts
    ranks(c, "keep", 1, [0, 1], 2, keep=2)
    ranks(c, "keep", 2, [0, 1], 2, keep=2)
    ranks(c, "keep", 3, [0], 2, keep=1)  # step 3 in flight: rank 1 has not stored it yet
    ranks(c, "keep", 4, [0, 1], 2, keep=1)  # committing step 4 keeps 1: steps 1, 2 go
    latest, gone = attempts(
        api, ("smoltorrent.latest_step('keep')", "out"), "smoltorrent.load_sharded('keep', 1, 0, 2)"
    )
    assert latest == {"value": 4}
    assert gone["error"] == "StepNotFoundError"
    names = {"keep/step-00000001", "keep/step-00000002"}
    wait_until(
        lambda: not any(v["name"].rsplit("/", 1)[0] in names for v in c.cli_json("ls")),
        what="the parts of steps 1 and 2 removed",
    )
    # Step 3 was pending throughout: untouched, and it commits when rank 1 stores it.
    ranks(c, "keep", 3, [1], 2)
    same, latest = attempts(
        api,
        (
            "smoltorrent.load_sharded('keep', 3, 1, 2, framework='numpy')",
            "same(out, rank_state(3, 1))",
        ),
        ("smoltorrent.latest_step('keep')", "out"),
    )
    assert same == {"value": True}
    assert latest == {"value": 4}


def test_rebuild_after_losing_redis_restores_complete_steps_only(make_cluster, api_session):
    c = make_cluster(2)
    api = api_session(c)  # one API process for this test's attempts
    ranks(c, "lost", 7, [0, 1], 2)
    ranks(c, "lost", 8, [0], 2)  # partial: rank 1 never stored step 8
    c.md.r.flushall()
    summary = c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    assert summary["steps"] == 1
    latest, same, partial = attempts(
        api,
        ("smoltorrent.latest_step('lost')", "out"),
        (
            "smoltorrent.load_sharded('lost', 7, 1, 2, framework='numpy')",
            "same(out, rank_state(7, 1))",
        ),
        "smoltorrent.load_sharded('lost', 8, 0, 2)",
    )
    assert latest == {"value": 7}
    assert same == {"value": True}
    assert partial["error"] == "StepNotFoundError"


MIXED = """
import json, os, random
import numpy as np, torch, smoltorrent
from smoltorrent.errors import StateDictError

np.random.seed(7)
torch.manual_seed(7)
random.seed(7)
np.random.random(3)  # a state part way through its stream
state = {"model": {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)},
         "rng": {"numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                 "python": random.getstate()},
         "extra": np.arange(4, dtype=np.int16)[::-1], "step": 3}
draws = (np.random.random(4).tolist(), torch.rand(3).tolist(), random.random())

def draws_after(back):
    np.random.set_state(back["rng"]["numpy"])
    torch.set_rng_state(back["rng"]["torch"])
    random.setstate(back["rng"]["python"])
    return (np.random.random(4).tolist(), torch.rand(3).tolist(), random.random())

def same(back):
    return {"draws": draws_after(back) == draws,
            "numpy": isinstance(back["rng"]["numpy"][1], np.ndarray)
                     and back["rng"]["numpy"][1].dtype == np.uint32
                     and isinstance(back["extra"], np.ndarray)
                     and back["extra"].tolist() == [3, 2, 1, 0],
            "w": torch.equal(back["model"]["w"], state["model"]["w"]), "step": back["step"]}

out = {}
smoltorrent.save(state, "mixed/one")
out["save"] = same(smoltorrent.load("mixed/one"))
smoltorrent.save_sharded(state, "mixed/ranks", 1, 0, 1)
out["save_sharded"] = same(smoltorrent.load_sharded("mixed/ranks", 1, 0, 1))

print(json.dumps(out))
"""


def test_numpy_rng_state_in_a_torch_state_is_saved_as_it_is(make_cluster):
    """Issue 39: np.random.get_state() in a torch state was refused ("mixes numpy and
    torch"). save() and save_sharded() store it as it is: numpy arrays load back as numpy,
    every RNG goes on with the same draws."""
    out = run_api(make_cluster(2), MIXED)
    want = {"draws": True, "numpy": True, "w": True, "step": 3}
    assert out["save"] == want and out["save_sharded"] == want, out


OUTAGE = """
import json, sys, time, torch, smoltorrent

def steps(numbers):
    handles, slowest = [], 0.0
    for step in numbers:
        for rank in (0, 1):
            started = time.monotonic()
            handles.append(smoltorrent.save_sharded(
                {"w": torch.full((8, 8), float(10 * step + rank))}, "outage", step, rank, 2,
                wait=False))
            slowest = max(slowest, time.monotonic() - started)
    print(json.dumps({"slowest": slowest}), flush=True)
    sys.stdin.readline()  # Redis is back
    return [h.result(timeout=180).version_id for h in handles]

down = steps((1, 2, 3))  # Redis killed
print(json.dumps({"stored": len(set(down))}), flush=True)
sys.stdin.readline()  # Redis is frozen now
frozen = steps((4,))
print(json.dumps({"stored": len(set(down + frozen)), "latest": smoltorrent.latest_step("outage"),
                  "w": float(smoltorrent.load_sharded("outage", 4, 1, 2)["w"][0, 0])}))
"""


def test_save_sharded_rides_out_redis_down_and_frozen_as_save_does(make_cluster):
    """Issue 39: with Redis down, save_sharded(wait=False) raised MetadataError on every
    call and those steps were lost; with Redis frozen it blocked the step. Invariant 12:
    each call returns a handle at once, the save is journalled, and once Redis is back
    every part is stored and every step committed."""
    c = make_cluster(2)
    c.kill_redis()
    trainer = subprocess.Popen(
        [sys.executable, "-c", OUTAGE],
        env=c.env(),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None and trainer.stdin is not None
        first = trainer.stdout.readline()  # every call returned, or the trainer raised
        assert first.startswith("{"), trainer.stderr.read() if trainer.stderr else first
        assert json.loads(first)["slowest"] < 5.0
        c.start_redis()

        def line(what: str) -> dict:
            assert trainer.stdin is not None and trainer.stdout is not None
            trainer.stdin.write(what + "\n")
            trainer.stdin.flush()
            got = trainer.stdout.readline()
            assert got.startswith("{"), trainer.stderr.read() if trainer.stderr else got
            return json.loads(got)

        assert line("back") == {"stored": 6}  # the three steps saved while Redis was down
        os.kill(c.redis_pid, signal.SIGSTOP)
        try:
            assert line("frozen")["slowest"] < 5.0  # step 4 saved while Redis is frozen
        finally:
            os.kill(c.redis_pid, signal.SIGCONT)
        trainer.stdin.write("thawed\n")
        trainer.stdin.flush()
        out, err = trainer.communicate(timeout=240)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"stored": 8, "latest": 4, "w": 41.0}


DTENSOR = """
import json, os, torch, smoltorrent
from smoltorrent.errors import StateDictError
out = {}
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
dt = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
for label, call in {"dt_save": lambda: smoltorrent.save({"w": dt}, "mixed/dt"),
                    "dt_sharded": lambda: smoltorrent.save_sharded({"m": {"w": dt}}, "mixed/dt",
                                                                   1, 0, 1)}.items():
    try:
        call()
        out[label] = None
    except StateDictError as exc:
        out[label] = str(exc)
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_a_dtensor_is_refused_with_a_pointer_to_smoltorrent_dcp(tmp_path):
    """Issue 39: save_sharded refused a DTensor as any other unknown value ("a saved state
    holds torch tensors..."). The message now says to save it through smoltorrent.dcp.
    Refused before anything is stored or any server is asked: no cluster here."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "TEST_PORT": str(port),
        "SMOLTORRENT_HOME": str(tmp_path),
        "SMOLTORRENT_REDIS_URL": "redis://127.0.0.1:1/0",  # nothing answers there
    }
    proc = subprocess.run(
        [sys.executable, "-c", DTENSOR],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for label in ("dt_save", "dt_sharded"):
        assert out[label] is not None and "smoltorrent.dcp" in out[label], out[label]
        assert "DTensor" in out[label], out[label]


def test_latest_step_never_picks_a_step_of_another_world_size_unless_asked(
    make_cluster, api_session
):
    """Issue 39: a 1-rank step saved by mistake under a 2-rank run's name was picked by
    latest_step and resharded silently. latest_step(name, world_size) takes the newest
    step of that world size; without one (and no process group to say it) a name whose
    steps were saved by several world sizes is refused; reshard=True asks for any."""
    c = make_cluster(2)
    api = api_session(c)  # one API process for this test's attempts
    ranks(c, "mix", 1, [0, 1], 2)
    ranks(c, "mix", 2, [0], 1)  # the mistake: a 1-rank step, newer
    two, one, unknown, any_size, refused = attempts(
        api,
        ("smoltorrent.latest_step('mix', 2)", "out"),
        ("smoltorrent.latest_step('mix', world_size=1)", "out"),
        "smoltorrent.latest_step('mix')",
        ("smoltorrent.latest_step('mix', reshard=True)", "out"),
        "smoltorrent.latest_step('mix', 0)",
    )
    assert two == {"value": 1} and one == {"value": 2} and any_size == {"value": 2}
    assert unknown["error"] == "WorldSizeMismatchError", unknown
    assert "world sizes 1 and 2" in unknown["message"], unknown
    assert "world_size=" in unknown["message"], unknown
    assert refused["error"] == "ShardedCheckpointError", refused


# One rank of a 2-rank step: rank 0 saves after `delay` s (the slower rank), the other
# at once; each loads its part right after save_sharded(wait=True) returns. numpy, as
# RANK: no torch to import in these processes.
WHOLE = """
import json, sys, time
import numpy as np
import smoltorrent
from smoltorrent.errors import SmoltorrentError

name, step, rank, delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
time.sleep(delay)
started = time.time()
out = {"started": started}
try:
    smoltorrent.save_sharded({"w": np.full((256, 256), rank, np.float32)}, name, step, rank, 2)
    out["returned"] = time.time()
    back = smoltorrent.load_sharded(name, step, rank, 2, framework="numpy")
    out["loaded"] = float(back["w"][0, 0])
except SmoltorrentError as exc:
    out.update(returned=time.time(), error=type(exc).__name__, message=str(exc))
print(json.dumps(out))
"""


def both_ranks(cluster, name: str, step: int, delays, env=None) -> list[dict]:
    """Each rank of `delays` ({rank: delay} or delays in rank order) its own process."""
    delays = delays if isinstance(delays, dict) else dict(enumerate(delays))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WHOLE, name, str(step), str(r), str(d)],
            env={**cluster.env(), **(env or {})},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, d in delays.items()
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_save_sharded_wait_returns_once_the_whole_step_is_stored(make_cluster):
    """Issue 39: save_sharded(wait=True) returned once this rank's part was stored, so a
    load right after it on the faster rank raised PartialStepError while rank 0 was still
    saving. It returns once every rank's part is committed: the load right after it
    finds the step, on either rank."""
    c = make_cluster(2)
    slow, fast = both_ranks(c, "whole", 1, (2.5, 0))
    assert "error" not in fast, fast["message"]
    assert fast["returned"] > slow["started"], (fast, slow)  # it waited for rank 0
    assert fast["loaded"] == 1.0 and slow["loaded"] == 0.0, (fast, slow)


HOLD = """
import json, sys
import numpy as np
import smoltorrent
from smoltorrent import api

rank = int(sys.argv[1])
handle = smoltorrent.save_sharded({"w": np.ones(4, np.float32)}, "held", 1, rank, 2, wait=False)
if rank == 1:
    handle.result()
print(json.dumps({"writer": next(iter(api._writers.values())).proc.pid}))
"""


def test_a_partial_step_says_whether_a_part_is_in_flight_or_abandoned(make_cluster, api_session):
    """Issue 39: PartialStepError said rank 0 "never finished storing" and to call
    save_sharded while rank 0 was still saving. A pending step now records when each
    rank's writer began its part, its heartbeat and its failure, and the error says which:
    still being stored, abandoned (failed, or its writer silent: died), or not begun."""
    c = make_cluster(2)
    api = api_session(c)  # one API process for this test's attempts
    hold = [sys.executable, "-c", HOLD]
    run = subprocess.run([*hold, "1"], env=c.env(), cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    c.kill_worker()  # rank 0's part is begun, and its store waits for a worker
    run = subprocess.run([*hold, "0"], env=c.env(), cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    writer = json.loads(run.stdout.strip().splitlines()[-1])["writer"]
    key = K.STEP.format(name="held", step=1)
    wait_until(lambda: c.md.r.hexists(key, "begun:0"), what="rank 0's part begun")
    load = "smoltorrent.load_sharded('held', 1, 1, 2)"
    (flight,) = attempts(api, load)
    assert flight["error"] == "PartialStepError", flight
    assert "rank 0's part is still being stored (began" in flight["message"], flight
    assert "It may still commit" in flight["message"], flight
    assert "never finished" not in flight["message"], flight

    # Its writer dies (the trainer went first): its heartbeat stops. Dated back past
    # STEP_STALE_S rather than waited for.
    os.kill(writer, signal.SIGKILL)
    c.md.r.hset(key, "beat:0", float(c.md.r.hget(key, "beat:0")) - 120)
    (dead,) = attempts(api, load)
    assert "rank 0 began" in dead["message"] and "abandoned" in dead["message"], dead
    assert "save_sharded(state, 'held', 1, 0, 2)" in dead["message"], dead

    # A rank that never begins its part: wait=True gives up after the step's patience.
    c.start_worker(env={"SMOLTORRENT_NO_NODE_RETRIES": "0"})
    (alone,) = both_ranks(c, "never", 1, {1: 0}, env={"SMOLTORRENT_STEP_PATIENCE_S": "1"})
    assert alone["error"] == "PartialStepError", alone
    assert "rank 0 never finished storing its part: it has not begun" in alone["message"]
    assert "waited 1 s" in alone["message"], alone

    # A part that fails for good (no node left, and no retry of that): rank 1, stored and
    # waiting for it, stops at once, naming it, rather than waiting out its patience.
    waiter = _waiting_rank_1(c, "failed")
    failed = K.STEP.format(name="failed", step=1)
    wait_until(lambda: c.md.r.hexists(failed, "rank:1"), what="rank 1's part recorded")
    for node in c.node_procs:
        node.kill()
    (failing,) = both_ranks(c, "failed", 1, {0: 0})
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, err
    waiting = json.loads(out.strip().splitlines()[-1])
    assert "error" in failing, failing
    assert waiting["error"] == "PartialStepError", waiting
    assert "rank 0 began" in waiting["message"] and "failed" in waiting["message"], waiting
    assert "rank 1's part is stored" in waiting["message"], waiting
    assert waiting["returned"] - failing["returned"] < 5, (waiting, failing)


def _waiting_rank_1(c, name: str) -> subprocess.Popen:
    """Rank 1 of 2 saving step 1 of `name` with wait=True, in a process of its own."""
    return subprocess.Popen(
        [sys.executable, "-c", WHOLE, name, "1", "1", "0"],
        env=c.env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_save_sharded_wait_rides_out_redis_down_while_it_waits_for_the_step(make_cluster):
    """wait=True waits on Redis for the other ranks' parts: with Redis killed meanwhile it
    raised ConnectionError into the step, though every rank's writer rides the outage out
    (invariant 12). It waits for Redis too, and returns once the step commits."""
    c = make_cluster(2)
    waiter = _waiting_rank_1(c, "outage")
    key = K.STEP.format(name="outage", step=1)
    wait_until(lambda: c.md.r.hexists(key, "rank:1"), what="rank 1's part recorded")
    c.kill_redis()
    time.sleep(3)  # rank 1 finds Redis gone while it waits
    c.start_redis()
    (slow,) = both_ranks(c, "outage", 1, {0: 0})
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, err
    fast = json.loads(out.strip().splitlines()[-1])
    assert "error" not in fast and "error" not in slow, (fast, slow)
    assert fast["loaded"] == 1.0 and slow["loaded"] == 0.0, (fast, slow)
