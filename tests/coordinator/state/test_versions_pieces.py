"""A version's manifest written to Redis in pieces before its version is recorded, and
read back in pieces, on a real redis-server (worker memory, issue 25): a version is
never recorded with part of its manifest, a retry of the store is one clean run, and a
reader sees one whole manifest, never a mix of two."""

from __future__ import annotations

import dataclasses
import json

import pytest

from coordinator.plan.manifest import Manifest
from coordinator.plan.version_ids import storage_key
from coordinator.state import redis_keys as K
from coordinator.state.versions import COMMITTED, PENDING, REMOVING, Versions
from smoltorrent import defaults
from smoltorrent.errors import ManifestError, NotFoundError
from tests.coordinator.plan.test_manifest import many_chunks

PIECE = 1000  # bytes a round trip here: a 300-chunk manifest (~75 KB) in many pieces


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(defaults, "MANIFEST_PIECE_BYTES", PIECE)


@pytest.fixture
def manifest() -> Manifest:
    return many_chunks(300)


def vkey_of(m: Manifest) -> str:
    return storage_key(m.name, m.version_id)


def staged_keys(md) -> list[str]:
    return list(md.r.scan_iter(K.MANIFEST_STAGED.format(vkey="*", token="*")))


def plan_of(m: Manifest) -> list[tuple[str, ...]]:
    return [("node-a", "node-b")] * len(m.chunks)


def test_a_manifest_staged_in_pieces_becomes_the_versions_whole(md, manifest):
    vkey = vkey_of(manifest)
    assert len(manifest.to_json()) > 50 * PIECE
    assert md.versions.create_pending(manifest, vkey, {}, plan_of(manifest)) == "created"
    assert md.r.get(K.MANIFEST.format(vkey=vkey)) == manifest.to_json().decode()
    assert md.r.ttl(K.MANIFEST.format(vkey=vkey)) == -1  # kept: the staging's TTL is gone
    assert md.versions.manifest(vkey) == manifest
    assert staged_keys(md) == []


def test_a_manifest_half_staged_by_a_store_that_died_is_no_version(md, manifest):
    """The store died after a few pieces: nothing of the version exists, the piece
    expires, and the store's retry records the version with its whole manifest."""
    vkey = vkey_of(manifest)
    dead = K.MANIFEST_STAGED.format(vkey=vkey, token="dead")
    md.r.set(dead, manifest.to_json()[: 3 * PIECE], ex=defaults.MANIFEST_STAGED_TTL_S)
    with pytest.raises(NotFoundError):
        md.versions.version(vkey)
    with pytest.raises(NotFoundError):
        md.versions.manifest(vkey)
    assert md.versions.names() == [] and md.r.hlen(K.VERSION_ROWS) == 0
    assert 0 < md.r.ttl(dead) <= defaults.MANIFEST_STAGED_TTL_S
    assert md.versions.create_pending(manifest, vkey, {}, plan_of(manifest)) == "created"
    assert md.versions.manifest(vkey) == manifest
    assert staged_keys(md) == [dead]  # the dead store's piece, left to expire


def test_a_store_retried_joins_its_version_and_leaves_nothing_staged(md, manifest):
    vkey = vkey_of(manifest)
    plan = plan_of(manifest)
    assert md.versions.create_pending(manifest, vkey, {}, plan, seq=5) == "created"
    assert md.versions.create_pending(manifest, vkey, {}, plan, seq=6) == PENDING
    md.versions.commit(vkey, manifest.name)
    assert md.versions.create_pending(manifest, vkey, {}, plan, seq=7) == COMMITTED
    assert md.versions.manifest(vkey) == manifest
    assert md.versions.version(vkey)["seq"] == "7"
    assert staged_keys(md) == []


def test_a_store_meeting_its_version_being_removed_leaves_nothing_staged(md, manifest):
    vkey = vkey_of(manifest)
    md.versions.create_pending(manifest, vkey, {}, plan_of(manifest))
    md.removals.begin_remove(vkey)
    assert md.versions.create_pending(manifest, vkey, {}, plan_of(manifest)) == REMOVING
    assert staged_keys(md) == []


def test_a_staged_manifest_gone_before_its_script_ran_is_staged_again(md, manifest):
    """It expired (a store held up for an hour between the two): the script changes
    nothing and says so, and create_pending stages it again."""
    vkey = vkey_of(manifest)
    script = md.versions._create
    answers = []

    def expire_first(keys, args):
        if not answers:
            md.r.delete(keys[14])  # KEYS[15]: the staged manifest
        answers.append(script(keys=keys, args=args))
        return answers[-1]

    md.versions._create = expire_first
    assert md.versions.create_pending(manifest, vkey, {}, plan_of(manifest)) == "created"
    assert answers == ["unstaged", "created"]
    assert md.versions.manifest(vkey) == manifest
    assert staged_keys(md) == []


def test_a_create_script_without_its_staged_manifest_changes_nothing(md, manifest):
    """No version, no reference from any of its blobs: the caller stages it again."""
    vkey = vkey_of(manifest)
    real = md.versions._stage
    md.versions._stage = lambda m, v: (K.MANIFEST_STAGED.format(vkey=v, token="gone"), 0)
    seen = []
    script = md.versions._create

    def once(keys, args):
        seen.append(script(keys=keys, args=args))
        if len(seen) == 1:
            assert md.r.exists(K.VERSION.format(vkey=vkey), K.MANIFEST.format(vkey=vkey)) == 0
            assert md.r.exists(*keys[15:]) == 0  # no blob references it
            md.versions._stage = real  # the next stage is a real one
        return seen[-1]

    md.versions._create = once
    assert md.versions.create_pending(manifest, vkey, {}, plan_of(manifest)) == "created"
    assert seen == ["unstaged", "created"]


def test_a_manifest_changed_while_read_in_pieces_is_read_again(md, manifest, monkeypatch):
    """A rewrite between two pieces (its replicas changed, say) is caught (WATCH) and the
    manifest read again: the reader gets the new one whole, never a mix."""
    vkey = vkey_of(manifest)
    md.versions.create_pending(manifest, vkey, {}, plan_of(manifest))
    changed = dataclasses.replace(manifest, replicas=3)
    key = K.MANIFEST.format(vkey=vkey)
    read = Versions._pieces

    def rewritten_after_the_first(p, key_, size):
        pieces = read(p, key_, size)
        yield next(pieces)
        if md.r.get(key) != changed.to_json().decode():
            md.r.set(key, changed.to_json())
        yield from pieces

    monkeypatch.setattr(Versions, "_pieces", staticmethod(rewritten_after_the_first))
    assert md.versions.manifest(vkey) == changed


def test_a_manifest_not_in_to_json_s_form_is_read_whole(md, manifest):
    """Written by hand (spaces), it still reads; corrupt, it is refused as it always was."""
    vkey = vkey_of(manifest)
    key = K.MANIFEST.format(vkey=vkey)
    md.r.set(key, json.dumps(json.loads(manifest.to_json()), indent=1))
    assert md.versions.manifest(vkey) == manifest
    md.r.set(key, manifest.to_json()[:-1])
    with pytest.raises(ManifestError, match="not JSON"):
        md.versions.manifest(vkey)
