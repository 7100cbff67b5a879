"""Version ids (content only, framed, chunked apart), version keys and their checks."""

from __future__ import annotations

import hashlib

import pytest

from coordinator.plan.version_ids import check_version_key, chunked_version_id, version_id_for
from smoltorrent.errors import UnsafeNameError
from tests.coordinator.plan.in_memory import store_in_memory


def test_version_id_is_content_only_and_framed():
    digests = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]
    version = version_id_for(b"{}", digests)
    assert len(version) == 64 and version == version_id_for(b"{}", list(digests))
    assert version != version_id_for(b"{}", digests[::-1])
    assert version != version_id_for(b"{} ", digests)
    assert version != version_id_for(b"{}", digests[:2])
    with pytest.raises(ValueError, match="64 lowercase hex"):
        version_id_for(b"{}", ["ABC"])


def test_storage_key_differs_per_name_for_the_same_content(tmp_path, stored):
    path, manifest, _, _ = stored
    copy, _, _ = store_in_memory(path, name="grpo/run1/latest.safetensors")
    assert copy.version_id == manifest.version_id
    assert copy.storage_key() != manifest.storage_key()
    assert len(manifest.storage_key()) == 32 and int(manifest.storage_key(), 16) >= 0


@pytest.mark.parametrize(
    "vkey", ["/home/u", "..", "../" + "0" * 29, "0" * 31, "0" * 33, "A" * 32, "0" * 31 + "/", 7]
)
def test_only_a_storage_key_passes_for_a_version_key(vkey, stored):
    _, manifest, _, _ = stored
    assert check_version_key(manifest.storage_key()) == manifest.storage_key()
    with pytest.raises(UnsafeNameError, match="32 lowercase hex digits"):
        check_version_key(vkey)


def test_a_chunked_version_id_is_apart_from_a_shard_version_id():
    digests = ["ab" * 32, "cd" * 32]
    assert chunked_version_id(b"{}", digests) != version_id_for(b"{}", digests)
    assert chunked_version_id(b"{}", digests) == chunked_version_id(b"{}", list(digests))
