"""Blob spans: what a transfer sends of one blob, rebuilt from the manifest alone."""

from __future__ import annotations

import hashlib
import json

import pytest

from coordinator.plan.blob_spans import BlobSpan, blob_prefixes, blob_spans
from smoltorrent.errors import ManifestError


def test_blob_prefixes_are_rebuilt_from_the_manifest_alone(stored):
    _, manifest, _, plans = stored
    assert blob_prefixes(manifest) == tuple(plan.prefix for plan in plans)


def test_a_blob_span_is_what_a_transfer_sends_and_survives_json(stored):
    """A span alone (prefix + its range of the source) is the blob, byte for byte."""
    path, manifest, blobs, plans = stored
    source = path.read_bytes()
    spans = blob_spans(manifest)
    assert spans == blob_spans(manifest, [plan.prefix for plan in plans])
    for span, blob in zip(spans, blobs, strict=True):
        assert span.prefix + source[span.offset : span.offset + span.length] == blob
        assert (span.size, span.digest) == (len(blob), hashlib.sha256(blob).hexdigest())
        assert BlobSpan.from_json(span.to_json()) == span


@pytest.mark.parametrize(
    "change",
    [
        {"size": 1},  # not its prefix plus its range
        {"digest": "AB" * 32},
        {"prefix": "not base64!"},
        {"offset": -1},
        {"extra": 1},
    ],
)
def test_a_malformed_blob_span_is_refused(stored, change):
    _, manifest, _, _ = stored
    document = {**json.loads(blob_spans(manifest)[0].to_json()), **change}
    with pytest.raises(ManifestError):
        BlobSpan.from_json(json.dumps(document))
