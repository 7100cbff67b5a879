"""Every Lua script against its header and its callers: the header names each key and
argument, every call passes exactly the keys the header names (checked by the template
each key is made from, in order), and no script builds a key itself."""

from __future__ import annotations

import re

import pytest

from coordinator.local.synthetic import synthetic_manifest
from coordinator.plan.version_ids import storage_key
from coordinator.state import redis_keys as K
from coordinator.state import repairs, scripts, trim_marks
from coordinator.state.directories import Directories, DirectoryVersion, Member
from coordinator.state.steps import Part, Steps
from smoltorrent.errors import MetadataError

NAMES = sorted(
    str(p.relative_to(scripts.LUA).with_suffix(""))
    for p in scripts.LUA.rglob("*.lua")
    if p.parent.name != "includes"
)
TEMPLATES = {
    name: value
    for name, value in vars(K).items()
    if name.isupper() and isinstance(value, str) and value.startswith(K.PREFIX) and name != "PREFIX"
}
MATCHERS = {
    name: re.compile(re.sub(r"\\\{\w+\\\}", "[^:]+", re.escape(t))) for name, t in TEMPLATES.items()
}


def template_of(key: str) -> str:
    """The name in redis_keys.py of the template `key` was made from."""
    (name,) = [n for n, rx in MATCHERS.items() if rx.fullmatch(key)]
    return name


def keys_pattern(header: scripts.Header) -> re.Pattern:
    """The header's keys as a pattern over the template names of a call's keys, each
    followed by a space: `A|B` one of them, `(A, B)*` any number of pairs, `A*` any number."""

    def slot(spec: str) -> str:
        spec = re.sub(r"[A-Z][A-Z_]*", lambda m: f"(?:{m[0]} )", spec).replace(", ", "")
        return "(?:" + re.sub(r"\((?!\?)", "(?:", spec) + ")"

    return re.compile("".join(slot(s) for s in header.keys))


def fits(name: str, keys: list[str]) -> bool:
    return bool(
        keys_pattern(scripts.header(name)).fullmatch("".join(f"{template_of(k)} " for k in keys))
    )


def test_every_script_opens_with_a_header_naming_its_keys_args_and_output():
    assert len(NAMES) >= 20
    for name in NAMES:
        text = (scripts.LUA / f"{name}.lua").read_text()
        assert text.startswith("--[[\n"), name
        opening = text.split("]]", 1)[0]
        assert "Input:" in opening and "Output:" in opening, name
        header = scripts.header(name)
        assert header.keys, name
        for spec in header.keys:
            for template in re.findall(r"[A-Z][A-Z_]*", spec):
                assert template in TEMPLATES, f"{name}: {template} is not in redis_keys.py"
        keys_pattern(header)  # a pattern that compiles


def test_no_script_builds_a_key():
    """Every key a redis.call touches is one of KEYS (or a local holding one of them), never
    a string put together in Lua: a script's header is then the whole of what it touches."""
    call = re.compile(r"redis\.call\('(\w+)'(?:, ([^,)]+))?")
    keyless = {"TIME"}
    # Locals that hold one of KEYS: make_current's, the listing's HMGET helper's, and the
    # tables of the version hashes and placements a caller passed.
    holders = re.compile(r"^(KEYS\[.+\]|kcur|kseq|key|hash_of\[\w+\]|placement_of\[\w+\])$")
    for path in scripts.LUA.rglob("*.lua"):
        text = path.read_text()
        assert K.PREFIX not in text and "smoltorrent:" not in text, path
        for command, key in call.findall(text):
            if command in keyless:
                continue
            assert ".." not in key and holders.match(key.strip()), f"{path}: {command} {key}"


@pytest.fixture
def calls(monkeypatch):
    """Every script call made, as (script name, keys, args)."""
    made = []
    call, queue = scripts.Script.__call__, scripts.Script.queue_loaded

    def record_call(self, keys, args=(), client=None):
        made.append((self.name, list(keys), list(args)))
        return call(self, keys, args, client)

    def record_queued(self, p, keys, args):
        made.append((self.name, list(keys), list(args)))
        return queue(self, p, keys, args)

    monkeypatch.setattr(scripts.Script, "__call__", record_call)
    monkeypatch.setattr(scripts.Script, "queue_loaded", record_queued)
    return made


def committed(md, name: str, index: int, nodes=("node-a", "node-b")) -> tuple[str, object]:
    m = synthetic_manifest(name, index)
    vkey = storage_key(name, m.version_id)
    md.versions.create_pending(m, vkey, {"request_id": f"t{index}"}, [nodes] * len(m.entries))
    for s, shard in enumerate(m.entries):
        for r, node in enumerate(nodes):
            md.transfers.settle(vkey, s, r, node, shard.blob_sha256)
    md.versions.commit(vkey, name)
    return vkey, m


def test_every_caller_passes_the_keys_its_script_names(md, calls):
    """Run every script through its caller, and the harder paths (a remove of the current
    version, a listing that needs versions and placements passed); each call's keys, by
    template and in order, and their number with the arguments', fit the header."""
    a, _ = committed(md, "ckpt", 1)
    b, mb = committed(md, "ckpt", 2)
    c, mc = committed(md, "ckpt", 3)
    pend = synthetic_manifest("ckpt", 4)
    pv = storage_key("ckpt", pend.version_id)
    md.versions.create_pending(pend, pv, {}, [("node-a", "node-b")] * len(pend.entries))
    md.transfers.replace_target(pv, 0, 0, "node-a", "node-c")
    md.transfers.reopen_shards(pv, [0])
    gone = synthetic_manifest("other", 5)
    gv = storage_key("other", gone.version_id)
    md.versions.create_pending(gone, gv, {}, [("node-a",)] * len(gone.entries))
    md.versions.abort(gv, "source changed")
    # A listing meets pending and aborted versions and unplaced blobs: it asks for them.
    rows = md.listing.version_summaries(None, ["node-a", "node-b"], live=["node-a"], digests=True)
    assert {r["vkey"]: r["state"] for r in rows}[gv] == "aborted"
    assert len([n for n, *_ in calls if n == "listing/slice"]) == 2
    md.listing.version_summaries("ckpt", ["node-a"], notable=[mb.entries[0].blob_sha256])
    md.r.delete(K.SUMMARIES_FILLED)
    md.listing.version_states()  # fills the summaries again, version by version
    assert md.removals.start_reading(b, "reader-1", 30) == "committed"
    assert md.removals.retire(a, 1) == "retired"
    assert md.versions.pin(b) == "committed"
    assert md.versions.tag(b, "ckpt", "best") == "committed"
    assert md.removals.retire(c, 1, before=0) == "kept"  # by prefix: ckpt was asked for since
    assert md.removals.begin_remove(c) == "committed"  # the current one: b becomes current
    assert md.versions.current("ckpt") == b
    for d in md.blobs.blobs_to_delete(c):
        assert md.blobs.claim_delete(c, d)
        md.blobs.blob_deleted(c, d, ["node-a"])
    assert md.removals.finish_remove(c)
    digest = mc.entries[0].blob_sha256
    assert md.blobs.claim_orphan(digest, "crosscheck-1")
    md.blobs.orphan_deleted(digest, "crosscheck-1", ["node-b"])
    shared = mb.entries[0].blob_sha256
    assert md.blobs.record_copy(shared, "node-c")
    assert trim_marks.mark(md, shared, "node-c", 2, ["node-a", "node-b", "node-c"]) == 1
    assert repairs.placed(md, shared, "node-c")
    seq = md.requests.open_request("r1", "store", "host", {"path": "/x"})
    assert seq > 0 and md.requests.start_request("r1", "boot", "boot:1").found == "queued"
    assert md.requests.renew_lease("r1", "boot:1", 30)
    steps = Steps(md.r)
    assert steps.begin("sharded", 7, 1, 0) == ["ok"]
    assert steps.beat("sharded", 7, 0)
    assert steps.fail("sharded", 7, 0, "its store failed")
    assert steps.get("sharded", 7).failed[0][1] == "its store failed"
    part = Part(rank=0, name="sharded/rank0", vkey=b, version_id="v", size=1)
    assert steps.complete("sharded", 7, 1, part) == ["committed"]
    assert steps.mark_removing("sharded", 7)
    member = Member(name="dir/a.safetensors", vkey=b, version_id="v", size=1)
    version = DirectoryVersion("dir", "d1", {"a.safetensors": member}, None, None, 0.0)
    assert Directories(md.r).commit(version, seq)
    md.r.hset(K.CHUNKS, "raw", f"{shared} 1")
    assert md.chunks.forget([("raw", shared), ("other", shared)]) == 1

    assert sorted({n for n, *_ in calls}) == NAMES  # every script ran
    for name, keys, args in calls:
        header = scripts.header(name)
        assert header.takes(len(keys), len(args)), (name, len(keys), len(args))
        assert fits(name, keys), (name, [template_of(k) for k in keys], header.keys)
    begins = [keys for n, keys, _ in calls if n == "removals/begin"]
    assert [template_of(k) for k in begins[-1]].count("VERSION") == 3  # and p's, b's


def test_a_call_the_header_does_not_take_is_refused(md):
    with pytest.raises(MetadataError, match="header"):
        scripts.load(md.r, "versions/abort")(keys=[K.VERSION.format(vkey="x")], args=["r", "x"])
    # Keys in another order than the header's, or one of another kind, do not fit.
    assert fits("versions/abort", [K.VERSION.format(vkey="x"), K.VERSION_STATES])
    assert not fits("versions/abort", [K.VERSION_STATES, K.VERSION.format(vkey="x")])
    blob = [K.BLOB_REFS.format(digest="d"), K.BLOB_DELETING.format(digest="d")]
    fixed = [
        K.VERSION.format(vkey="x"),
        K.VERSIONS.format(name="n"),
        K.CURRENT,
        K.CURRENT_SEQ,
        K.REMOVE_BLOBS.format(vkey="x"),
        K.VERSION_STATES,
    ]
    assert fits("removals/begin", [*fixed, *blob, *blob, K.VERSION.format(vkey="y")])
    assert not fits("removals/begin", [*fixed, K.VERSION.format(vkey="y"), *blob])
    assert not fits("removals/begin", [*fixed, blob[0]])
