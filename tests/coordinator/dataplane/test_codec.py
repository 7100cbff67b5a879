"""The encoded chunk, on bytes: every form round-trips, and bad input is an error, not a crash."""

from __future__ import annotations

import hashlib
import io
import os
import random
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import zstandard

from coordinator.dataplane import codec
from smoltorrent import defaults
from smoltorrent.errors import ChunkFormatError, SourceChangedError

FRAME = 64 * 1024  # small frames, so a few hundred KB exercise many of them


def _floats(count: int, fmt: str, seed: int = 0) -> bytes:
    """count N(0, 0.02) values as little-endian `fmt` ('e' fp16, 'f' fp32, 'd' fp64)."""
    rng = random.Random(seed)
    return struct.pack(f"<{count}{fmt}", *(rng.gauss(0, 0.02) for _ in range(count)))


def _bf16(count: int, seed: int = 0) -> bytes:
    """bf16 is the high half of an fp32."""
    fp32 = _floats(count, "f", seed)
    return b"".join(fp32[i + 2 : i + 4] for i in range(0, len(fp32), 4))


def _encode(data: bytes, layout: codec.Layout, **kw: object) -> tuple[codec.EncodedChunk, bytes]:
    """The result and the whole chunk a node keeps (a RAW one is the data as it is)."""
    sink = io.BytesIO()
    result = codec.encode_chunk(io.BytesIO(data), len(data), layout, sink, **kw)
    if result.encoding == codec.RAW:
        assert sink.getvalue() == b""  # the caller sends the source as it is
        assert (result.size, result.sha256) == (len(data), result.raw_sha256)
        encoded = data
    else:
        encoded = sink.getvalue()
    assert (len(encoded), hashlib.sha256(encoded).hexdigest()) == (result.size, result.sha256)
    assert result.raw_sha256 == hashlib.sha256(data).hexdigest()
    return result, encoded


def _decode(encoded: bytes) -> bytes:
    """Decoded by a pulling reader and, fed in pieces of random sizes, by a ChunkDecoder:
    both give the same bytes, or both raise ChunkFormatError."""
    pulled, pushed = bytearray(), bytearray()
    outcomes = []
    try:
        codec.decode_chunk(io.BytesIO(encoded), len(encoded), pulled.extend)
        outcomes.append(None)
    except ChunkFormatError as error:
        outcomes.append(error)
    rng = random.Random(len(encoded))
    try:
        decoder = codec.ChunkDecoder(len(encoded), pushed.extend)
        at = 0
        while at < len(encoded):
            step = rng.choice((1, 7, 100, 4096, 70_000))
            decoder.feed(memoryview(encoded)[at : at + step])
            at += step
        decoder.finish()
        outcomes.append(None)
    except ChunkFormatError as error:
        outcomes.append(error)
    pulled_error, pushed_error = outcomes
    assert (pulled_error is None) == (pushed_error is None), outcomes
    if pulled_error:
        raise pulled_error
    assert pulled == pushed
    return bytes(pulled)


@pytest.mark.parametrize(
    ("name", "data", "width", "least_ratio"),
    [
        ("bf16", _bf16(150_000), 2, 1.35),
        ("fp16", _floats(150_000, "e"), 2, 1.1),
        ("fp32", _floats(75_000, "f"), 4, 1.1),
        ("fp64", _floats(40_000, "d"), 8, 1.05),
        ("i64 token ids", struct.pack("<40000q", *range(40_000)), 8, 3.0),
        ("text", b"the same words again and again " * 10_000, 1, 10.0),
    ],
)
def test_every_element_width_round_trips_and_shrinks(
    name: str, data: bytes, width: int, least_ratio: float
) -> None:
    result, encoded = _encode(data, [(len(data), width)], frame_bytes=FRAME)
    assert result.encoding == codec.FRAMED, name
    assert result.ratio >= least_ratio, name
    assert _decode(encoded) == data


def test_byte_grouping_is_what_shrinks_bf16() -> None:
    data = _bf16(150_000)
    grouped, _ = _encode(data, [(len(data), 2)], frame_bytes=FRAME)
    plain, _ = _encode(data, [(len(data), 1)], frame_bytes=FRAME)
    assert grouped.size < plain.size * 0.9


def test_a_mixed_layout_groups_each_run_by_its_own_width() -> None:
    runs = [_floats(1000, "f", 1), _bf16(70_000, 2), b"\x01\x02\x03", _bf16(5000, 3), b"\0" * 8]
    layout = [(len(runs[0]), 4), (len(runs[1]), 2), (3, 1), (len(runs[3]), 2), (8, 8)]
    data = b"".join(runs)
    result, encoded = _encode(data, layout, frame_bytes=FRAME)
    assert result.encoding == codec.FRAMED
    assert _decode(encoded) == data


@pytest.mark.parametrize("length", [1, 3, 7, 1001, FRAME - 1, FRAME + 5, 3 * FRAME + 3])
@pytest.mark.parametrize("width", codec.WIDTHS)
def test_odd_lengths_round_trip(length: int, width: int) -> None:
    # Compressible (small values), so the frames and their tails are really exercised.
    data = bytes(random.Random(length).choice((0, 1, 2, 255)) for _ in range(length))
    result, encoded = _encode(data, [(length, width)], frame_bytes=FRAME)
    assert (encoded if result.encoding == codec.RAW else _decode(encoded)) == data


def test_a_frame_size_no_width_divides_leaves_tails_in_every_frame() -> None:
    data = _floats(20_000, "f")
    result, encoded = _encode(data, [(len(data), 4)], frame_bytes=1001)
    assert result.encoding == codec.FRAMED
    assert _decode(encoded) == data


def test_empty_chunk_is_raw_and_decodes_to_nothing() -> None:
    result, encoded = _encode(b"", [])
    assert (result.encoding, result.size, encoded) == (codec.RAW, 0, b"")


def test_incompressible_data_stays_raw() -> None:
    data = os.urandom(300_000)
    result, encoded = _encode(data, [(len(data), 2)], frame_bytes=FRAME)
    assert (result.encoding, encoded) == (codec.RAW, data)


def test_a_gain_under_the_threshold_stays_raw() -> None:
    # Random bytes with one byte in 16 zeroed compress by a few percent only.
    rng = random.Random(5)
    data = bytes(0 if i % 16 == 0 else rng.randrange(256) for i in range(200_000))
    assert _encode(data, [(len(data), 1)], min_gain=0.0)[0].encoding == codec.FRAMED
    assert _encode(data, [(len(data), 1)], min_gain=0.05)[0].encoding == codec.RAW


def test_the_encoding_is_deterministic() -> None:
    data = _bf16(50_000)
    assert _encode(data, [(len(data), 2)])[0] == _encode(data, [(len(data), 2)])[0]


def test_the_sink_keeps_what_it_held_before_the_chunk() -> None:
    data = _bf16(50_000)
    sink = io.BytesIO(b"earlier")
    sink.seek(0, io.SEEK_END)
    result = codec.encode_chunk(io.BytesIO(data), len(data), [(len(data), 2)], sink)
    assert sink.getvalue()[:7] == b"earlier"
    assert len(sink.getvalue()) == 7 + result.size
    sink = io.BytesIO(b"earlier")
    sink.seek(0, io.SEEK_END)
    codec.encode_chunk(io.BytesIO(os.urandom(1000)), 1000, [(1000, 1)], sink)
    assert sink.getvalue() == b"earlier"


def test_a_source_that_ends_early_is_a_changed_source() -> None:
    with pytest.raises(SourceChangedError, match="being rewritten"):
        codec.encode_chunk(io.BytesIO(b"x" * 100), 200, [(200, 1)], io.BytesIO())


def test_a_layout_that_does_not_cover_the_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="covers 10 bytes of a 20-byte chunk"):
        codec.encode_chunk(io.BytesIO(b"x" * 20), 20, [(10, 1)], io.BytesIO())
    with pytest.raises(ValueError, match="width 3"):
        codec.encode_chunk(io.BytesIO(b"x" * 20), 20, [(20, 3)], io.BytesIO())


# --- corrupt input ----------------------------------------------------------------------

_SMALL = _bf16(3000) + _floats(500, "f") + b"tail!"
_SMALL_LAYOUT = [(6000, 2), (2000, 4), (5, 1)]


def _small_encoded() -> bytes:
    result, encoded = _encode(_SMALL, _SMALL_LAYOUT, frame_bytes=1024)
    assert result.encoding == codec.FRAMED
    return encoded


def test_every_truncation_is_a_format_error() -> None:
    encoded = _small_encoded()
    for cut in range(len(encoded)):
        with pytest.raises(ChunkFormatError):
            codec.decode_chunk(io.BytesIO(encoded[:cut]), cut, lambda _: None)
        # The length promised but the source ending early is the same error.
        with pytest.raises(ChunkFormatError):
            codec.decode_chunk(io.BytesIO(encoded[:cut]), len(encoded), lambda _: None)


def _structure(encoded: bytes) -> tuple[set[int], set[int]]:
    """Offsets of a FRAMED chunk's header and frame heads, and of its zstd-coded planes."""
    heads, coded_planes = set(range(codec.HEADER_BYTES)), set()
    at = codec.HEADER_BYTES
    while at < len(encoded):
        length, width, coded = struct.unpack_from("<IBB", encoded, at)
        stored = struct.unpack_from(f"<{width}I", encoded, at + 6)
        heads.update(range(at, at + 6 + 4 * width))
        at += 6 + 4 * width
        for plane, size in enumerate(stored):
            if coded >> plane & 1:
                coded_planes.update(range(at, at + size))
            at += size
        at += length % width
    return heads, coded_planes


def test_every_flipped_byte_is_caught_or_decodes_to_other_bytes_never_a_crash() -> None:
    encoded = _small_encoded()
    heads, coded = _structure(encoded)
    missed_heads = []
    for at in range(len(encoded)):
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(encoded)
            damaged[at] ^= flip
            try:
                decoded = _decode(bytes(damaged))
            except ChunkFormatError:
                continue
            missed_heads += [at] if at in heads else []
            # A flip inside a plane decodes to other bytes (the raw digest catches them);
            # zstd ignores a few bits of its own.
            assert decoded != _SMALL or at in coded, at
    assert missed_heads == []


def test_random_garbage_is_a_format_error() -> None:
    rng = random.Random(7)
    for length in (0, 1, 19, 20, 21, 100, 5000):
        garbage = bytes(rng.randrange(256) for _ in range(length))
        with pytest.raises(ChunkFormatError):
            _decode(garbage)
        with pytest.raises(ChunkFormatError):
            _decode(codec.MAGIC + bytes([codec.FORMAT_VERSION, codec.FRAMED]) + garbage)


def test_bytes_after_the_last_frame_are_a_format_error() -> None:
    with pytest.raises(ChunkFormatError, match="follow its last frame"):
        _decode(_small_encoded() + b"\0")
    with pytest.raises(ChunkFormatError, match="raw bytes; its header declares"):
        _decode(codec.raw_header(3) + b"abcd")


def test_an_unknown_format_version_asks_for_an_upgrade() -> None:
    encoded = bytearray(_small_encoded())
    encoded[4] = codec.FORMAT_VERSION + 1
    with pytest.raises(ChunkFormatError, match="upgrade"):
        _decode(bytes(encoded))


def test_a_huge_declared_frame_is_refused_before_anything_is_allocated() -> None:
    header = codec.ChunkHeader(codec.FRAMED, 1 << 40, 1 << 31).pack()
    with pytest.raises(ChunkFormatError, match="frames of"):
        _decode(header)


def test_a_coded_plane_declaring_another_size_is_refused() -> None:
    plane = zstandard.ZstdCompressor().compress(b"\0" * 2000)  # 2000, the frame wants 1000
    frame = struct.pack("<IBBI", 1000, 1, 1, len(plane)) + plane
    encoded = codec.ChunkHeader(codec.FRAMED, 1000, 1000).pack() + frame
    with pytest.raises(ChunkFormatError, match="declares 2000 bytes, not 1000"):
        _decode(encoded)


# --- memory ---------------------------------------------------------------------------


def test_memory_stays_within_a_few_frames_whatever_the_chunk_size() -> None:
    size = 48 * 1024 * 1024
    source = io.BytesIO(bytes(size))  # zeros: the encoded chunk is small, the raw one not
    sink = io.BytesIO()
    tracemalloc.start()
    try:
        codec.encode_chunk(source, size, [(size, 2)], sink)
        _, encode_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        encoded = sink.getvalue()
        written = 0

        def count(piece: memoryview) -> None:
            nonlocal written
            written += len(piece)

        tracemalloc.reset_peak()
        codec.decode_chunk(io.BytesIO(encoded), len(encoded), count)
        _, decode_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert written == size
    bound = 4 * defaults.CODEC_FRAME_BYTES + len(encoded)
    assert encode_peak < bound and decode_peak < bound, (encode_peak, decode_peak)


def test_the_codec_takes_no_tensor_library() -> None:
    # The store/gather path stays torch/numpy/mlx-free: a coordinator may have none.
    code = (
        "import sys, coordinator.dataplane.codec; "
        "print(sorted(m for m in ('numpy', 'torch', 'mlx') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_a_pushed_decoder_refuses_bytes_past_the_end_and_an_early_finish() -> None:
    data = _bf16(20_000)
    _, encoded = _encode(data, [(len(data), 2)])
    decoder = codec.ChunkDecoder(len(encoded), lambda _: None)
    decoder.feed(encoded[:100])
    with pytest.raises(ChunkFormatError, match="ends early"):
        decoder.finish()
    decoder.feed(encoded[100:])
    assert decoder.finish().raw_length == len(data)
    with pytest.raises(ChunkFormatError, match="follow its end"):
        decoder.feed(b"x")
    with pytest.raises(ChunkFormatError, match="1 bytes follow its last frame"):
        codec.ChunkDecoder(len(encoded) + 1, lambda _: None).feed(encoded + b"x")


def test_the_raw_form_without_trying_to_encode() -> None:
    data = _bf16(50_000)  # would compress: raw_chunk does not try
    result = codec.raw_chunk(io.BytesIO(data), len(data))
    # A RAW chunk is kept as its bytes are: one digest names both, so it is hashed once.
    assert (result.encoding, result.size) == (codec.RAW, len(data))
    assert result.sha256 == result.raw_sha256 == hashlib.sha256(data).hexdigest()
    with pytest.raises(SourceChangedError):
        codec.raw_chunk(io.BytesIO(data[:-1]), len(data))


def test_a_blob_says_by_its_size_whether_it_holds_the_raw_bytes_as_they_are() -> None:
    """A RAW chunk is kept bare; versions stored before kept it behind a chunk header;
    an encoded one is smaller than its raw bytes. The manifest's sizes tell which."""
    assert codec.raw_prefix(1000, 1000) == b""
    assert codec.raw_prefix(codec.HEADER_BYTES + 1000, 1000) == codec.raw_header(1000)
    assert codec.raw_prefix(700, 1000) is None
    assert codec.raw_prefix(0, 0) == b""


def test_the_same_raw_bytes_grouped_otherwise_are_another_encoding_and_blob():
    """256 KiB of zeros grouped by 1, 2 and 4 bytes encode to three blobs, and
    encoding_of names three encodings: what Redis's chunks room tells apart."""
    zeros = bytes(256 * 1024)
    blobs, names = set(), set()
    for width in (1, 2, 4):
        layout = ((len(zeros), width),)
        blobs.add(codec.encode_chunk(io.BytesIO(zeros), len(zeros), layout, io.BytesIO()).sha256)
        names.add(codec.encoding_of(layout))
    assert len(blobs) == 3 and len(names) == 3
    assert codec.encoding_of(((len(zeros), 2),)) == codec.encoding_of(((len(zeros), 2),))
    assert codec.RAW_ENCODING not in names


def _hostile_blob(frame_bytes: int) -> bytes:
    """~2 KB that declares one frame of `frame_bytes` zeros grouped by 4, every plane
    zstd-coded: what a node may serve under any digest (it is checked at the end)."""
    planes = [zstandard.ZstdCompressor().compress(bytes(frame_bytes // 4)) for _ in range(4)]
    header = codec.ChunkHeader(codec.FRAMED, frame_bytes, frame_bytes).pack()
    lengths = struct.pack("<4I", *map(len, planes))
    return header + struct.pack("<IBB", frame_bytes, 4, 0b1111) + lengths + b"".join(planes)


def test_a_hostile_blob_cannot_make_the_decoder_allocate_more_than_a_frame() -> None:
    """A 2 KB blob declaring 64 MiB frames made each decoding thread allocate ~200 MiB
    (the frame, its planes, the widening): frames are capped at the encoder's own size,
    and a header declaring another raw length than the manifest's is refused first."""
    hostile = _hostile_blob(64 * 1024 * 1024)
    assert len(hostile) < 16 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(ChunkFormatError):
            codec.decode_chunk(io.BytesIO(hostile), len(hostile), lambda _: None)
        with pytest.raises(ChunkFormatError):
            codec.ChunkDecoder(len(hostile), lambda _: None).feed(hostile)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * defaults.CODEC_FRAME_BYTES, peak
    # The encoder's own frame size decodes, and only at the raw length the manifest says.
    honest = _hostile_blob(defaults.CODEC_FRAME_BYTES)
    out = bytearray()
    codec.ChunkDecoder(len(honest), out.extend, raw_length=defaults.CODEC_FRAME_BYTES).feed(honest)
    assert out == bytes(defaults.CODEC_FRAME_BYTES)
    with pytest.raises(ChunkFormatError, match="raw bytes"):
        codec.ChunkDecoder(len(honest), out.extend, raw_length=1000).feed(honest[:100])
