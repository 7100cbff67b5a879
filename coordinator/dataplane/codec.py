"""The encoded chunk: a chunk's raw bytes made smaller, losslessly, and back again.

Float weights compress poorly as they are (zstd gains about 1.28x on bf16): each
element mixes a sign and exponent, which take few values, with mantissa bits that are
close to random. Grouping the bytes by their place in the element (plane i holds byte i
of every element: for bf16 the high bytes, sign and exponent, apart from the low bytes)
gives zstd one plane it shrinks well and one it cannot shrink, which is then kept as it
is: 1.46x on N(0, 0.02) bf16, the observation ZipNN builds on (arXiv 2411.05239).

The coordinator encodes on the store path, a gatherer decodes; a node keeps and verifies
the encoded bytes and never decodes. Everything needed to decode is in the chunk itself
(all integers little-endian):

    chunk header (20 bytes)
        magic b"STCK", format version u8, encoding u8, reserved u16 (0),
        largest frame u32 (raw bytes: the one buffer a decoder needs), raw length u64
    encoding RAW: the raw bytes as they are. A chunk that no encoding shrinks by
        CODEC_MIN_GAIN is sent this way: the source's bytes (sendfile), with no header.
        A bare RAW chunk's digest is its raw digest, so a store hashes it once, not
        twice (on loopback, where nothing is encoded, that second pass was 0.6 s of
        CPU per GB before the first byte went out). Versions stored before kept a RAW
        chunk behind its header; raw_prefix tells the three forms apart by size.
    encoding FRAMED: frames until the raw length is reached, each
        raw length u32, width u8 (1, 2, 4 or 8: the byte grouping), coded u8 (bit i:
        plane i is one zstd frame, else it is stored as it is), width x u32 stored length
        of each plane, the planes, then the last (raw length % width) bytes as they are

A frame never spans two runs of the chunk's layout (a run is bytes of one grouping
width, whole tensors in data order), so a tensor is grouped by its own element size and
from its own first byte, and a frame holds at most CODEC_FRAME_BYTES raw bytes. Encoding
and decoding go frame by frame through buffers of that size: a chunk never becomes one
Python object, however big it is. The byte grouping is bytes slicing with a step, which
runs in C (the store/gather path takes no numpy).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO, NoReturn

import zstandard

from smoltorrent import defaults
from smoltorrent.errors import ChunkFormatError, SourceChangedError

MAGIC = b"STCK"
FORMAT_VERSION = 1
RAW = 0
FRAMED = 1
ENCODINGS = {RAW: "raw", FRAMED: "framed"}
WIDTHS = (1, 2, 4, 8)  # bytes per element a frame is grouped by; 1 is no grouping

_HEADER = struct.Struct("<4sBBHIQ")
HEADER_BYTES = _HEADER.size
_FRAME_HEAD = struct.Struct("<IBB")
_PLANE_LENGTH = struct.Struct("<I")
_WIDEN = {2: "utf-16-le", 4: "utf-32-le"}  # see _decode_frame

# (raw bytes, grouping width) runs that cover a chunk in order
Layout = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class ChunkHeader:
    encoding: int  # RAW or FRAMED
    raw_length: int
    frame_bytes: int  # raw bytes of the largest frame; 0 for RAW

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC, FORMAT_VERSION, self.encoding, 0, self.frame_bytes, self.raw_length
        )

    @classmethod
    def unpack(cls, data: bytes) -> ChunkHeader:
        """Read and check a chunk header; ChunkFormatError says what is wrong with it."""
        if len(data) != HEADER_BYTES:
            _corrupt(f"it ends after {len(data)} bytes, inside its {HEADER_BYTES}-byte header")
        magic, version, encoding, reserved, frame_bytes, raw_length = _HEADER.unpack(data)
        if magic != MAGIC:
            _corrupt(f"it starts with {magic!r}, not the chunk magic {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise ChunkFormatError(
                f"an encoded chunk is in format version {version}; this smoltorrent reads"
                f" version {FORMAT_VERSION}. Gather it with the smoltorrent that stored it,"
                " or upgrade this one."
            )
        if encoding not in ENCODINGS or reserved:
            _corrupt(f"its header names encoding {encoding} (reserved field {reserved})")
        if raw_length > defaults.MAX_BLOB_BYTES:
            _corrupt(f"its header declares {raw_length} raw bytes")
        if encoding == FRAMED and not 0 < frame_bytes <= defaults.CODEC_MAX_FRAME_BYTES:
            # Checked before the decoder sizes its buffer by it.
            _corrupt(f"its header declares frames of {frame_bytes} bytes")
        return cls(encoding, raw_length, frame_bytes if encoding == FRAMED else 0)


def raw_header(raw_length: int) -> bytes:
    """The header a RAW chunk was kept behind before RAW chunks were kept bare."""
    return ChunkHeader(RAW, raw_length, 0).pack()


def raw_prefix(blob_size: int, raw_length: int) -> bytes | None:
    """What a chunk's blob holds before its raw bytes when it holds them as they are: b""
    for a bare RAW chunk, raw_header(raw_length) for a RAW chunk of a version stored
    before they were bare; None for an encoded chunk, which decode_chunk reads. The size
    says which: an encoding is kept only when it is smaller than the raw bytes."""
    if blob_size == raw_length:
        return b""
    if blob_size == HEADER_BYTES + raw_length:
        return raw_header(raw_length)
    return None


@dataclass(frozen=True)
class EncodedChunk:
    """What encoding a chunk found: its raw digest, and the encoded form a node keeps."""

    encoding: int
    raw_length: int
    raw_sha256: str
    size: int  # bytes of the chunk a node keeps: a FRAMED one's header included
    sha256: str  # of the encoded chunk: what a node stores, verifies and is asked for

    @property
    def ratio(self) -> float:
        """Raw bytes per encoded byte."""
        return self.raw_length / self.size if self.size else 1.0


@functools.lru_cache(maxsize=defaults.CODEC_ENCODINGS_KEPT)
def encoding_of(layout: tuple[tuple[int, int], ...]) -> str:
    """What a chunk's encoded bytes depend on besides its raw bytes, as a short name: its
    layout's byte grouping, this codec's format, zstd's version and level, the frame size
    and the least gain. The same raw bytes encode to the same blob only where this agrees:
    256 KiB of zeros are three blobs grouped by 1, 2 and 4 bytes. A store counts on a
    stored chunk only if it would encode it as that blob again, as it must when a copy
    is to be sent from the source (coordinator/state/chunks.py). A RAW chunk's blob, the
    raw bytes themselves, depends on none of it (RAW_ENCODING)."""
    text = repr(
        (
            FORMAT_VERSION,
            zstandard.ZSTD_VERSION,
            defaults.CODEC_ZSTD_LEVEL,
            defaults.CODEC_FRAME_BYTES,
            defaults.CODEC_MIN_GAIN,
            layout,
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[: 2 * defaults.CODEC_ENCODING_NAME_BYTES]


# The encoding of a chunk kept RAW, bare or behind its header: its blob is the same
# whatever the chunk's layout or the codec.
RAW_ENCODING = "raw"


def blob_encoding(blob_size: int, raw_length: int, encoding: str) -> str:
    """The encoding a chunk's blob was made with: RAW_ENCODING for a RAW blob (its size
    says it, raw_prefix), else `encoding`, the layout's (encoding_of)."""
    return RAW_ENCODING if raw_prefix(blob_size, raw_length) is not None else encoding


def encode_chunk(
    source: BinaryIO,
    raw_length: int,
    layout: Layout,
    sink: BinaryIO,
    *,
    level: int = defaults.CODEC_ZSTD_LEVEL,
    frame_bytes: int = defaults.CODEC_FRAME_BYTES,
    min_gain: float = defaults.CODEC_MIN_GAIN,
) -> EncodedChunk:
    """Encode the next raw_length bytes of `source` in one pass, hashing them as they go.

    The FRAMED form is written to `sink` (from its current position). When it does not
    shrink the chunk by `min_gain`, the sink is cut back to where it was and the chunk is
    RAW: the source's bytes, which the caller sends as they are. Either way the result
    names the form and its digest.
    """
    if not 0 < frame_bytes <= defaults.CODEC_MAX_FRAME_BYTES:
        raise ValueError(
            f"frame_bytes {frame_bytes} is outside 1..{defaults.CODEC_MAX_FRAME_BYTES}"
        )
    frames = list(_frames(layout, raw_length, frame_bytes))
    raw_hash = hashlib.sha256()
    framed = hashlib.sha256()
    start = sink.tell()
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=False)
    largest = max((length for length, _ in frames), default=0)
    buffer = bytearray(largest)
    view = memoryview(buffer)
    size = 0

    def put(piece: bytes | memoryview) -> None:
        nonlocal size
        sink.write(piece)
        framed.update(piece)
        size += len(piece)

    put(ChunkHeader(FRAMED, raw_length, largest).pack())
    for length, width in frames:
        if not _fill(source, view[:length]):
            _source_ended(raw_length)
        raw_hash.update(view[:length])
        for piece in _encode_frame(compressor, buffer, length, width, min_gain):
            put(piece)
    raw_sha256 = raw_hash.hexdigest()
    # Strictly smaller, whatever min_gain: a blob of the raw size is a bare RAW chunk.
    if size < raw_length and size <= raw_length * (1 - min_gain):
        return EncodedChunk(FRAMED, raw_length, raw_sha256, size, framed.hexdigest())
    sink.seek(start)
    sink.truncate()
    return EncodedChunk(RAW, raw_length, raw_sha256, raw_length, raw_sha256)


def raw_chunk(source: BinaryIO, raw_length: int) -> EncodedChunk:
    """The RAW form of the next raw_length bytes of `source`, without trying to encode
    them (a link faster than the encoder): one pass, hashing the raw bytes, which are
    also the chunk a node keeps."""
    raw_hash = hashlib.sha256()
    view = memoryview(bytearray(min(raw_length, defaults.IO_CHUNK_BYTES)))
    left = raw_length
    while left:
        piece = view[: min(left, len(view))]
        if not _fill(source, piece):
            _source_ended(raw_length)
        raw_hash.update(piece)
        left -= len(piece)
    digest = raw_hash.hexdigest()
    return EncodedChunk(RAW, raw_length, digest, raw_length, digest)


def decode_chunk(
    source: BinaryIO,
    encoded_length: int,
    write: Callable[[memoryview], object],
    raw_length: int | None = None,
) -> ChunkHeader:
    """Decode the encoded chunk of `encoded_length` bytes that `source` reads next.

    `write` is called with the raw bytes in order, a piece at a time; a piece is only
    valid during the call (its buffer is reused). Anything that is not a whole, valid
    chunk of exactly that length (and of `raw_length` raw bytes, the manifest's, when
    given: checked before anything is allocated) raises ChunkFormatError; the raw digest
    is the caller's to check (the manifest holds it).
    """
    steps = _decode_steps(encoded_length, raw_length, write)
    try:
        need = next(steps)
        while True:
            data = source.read(need)
            while len(data) < need:  # a short read of a pipe or socket: read on
                more = source.read(need - len(data))
                if not more:
                    _corrupt("its source ends early")
                data += more
            need = steps.send(data)
    except StopIteration as done:
        return done.value


class ChunkDecoder:
    """decode_chunk for bytes that arrive in pieces of any size (a node's answer on a
    socket): feed() each piece, then finish(). Holds at most one frame's planes."""

    def __init__(
        self,
        encoded_length: int,
        write: Callable[[memoryview], object],
        raw_length: int | None = None,
    ) -> None:
        self._steps = _decode_steps(encoded_length, raw_length, write)
        self._pending = bytearray()
        self._need: int | None = next(self._steps)
        self.header: ChunkHeader | None = None

    def feed(self, data: bytes | memoryview) -> None:
        if self._need is None:
            _corrupt(f"{len(data)} bytes follow its end")
        self._pending += data
        used = 0
        with memoryview(self._pending) as pending:
            # Units are cut at an offset and the buffer trimmed once: trimming it for
            # each 6-byte frame head would move the whole rest of it every time.
            while self._need is not None and len(pending) - used >= self._need:
                unit = bytes(pending[used : used + self._need])
                used += self._need
                try:
                    self._need = self._steps.send(unit)
                except StopIteration as done:
                    self._need, self.header = None, done.value
        del self._pending[:used]
        if self._need is None and self._pending:
            _corrupt(f"{len(self._pending)} bytes follow its end")

    def finish(self) -> ChunkHeader:
        """The chunk's header, once every byte has been fed; ChunkFormatError before."""
        if self.header is None:
            _corrupt("it ends early")
        return self.header


# A decode is a generator: it yields how many bytes it needs next and is sent them,
# so one implementation serves a pulling reader (decode_chunk) and pushed pieces
# (ChunkDecoder). It returns the chunk's header.
_Steps = Generator[int, bytes, ChunkHeader]


class _Budget:
    """What is left of an encoded chunk of known length: a read past its end is corruption."""

    def __init__(self, length: int) -> None:
        self.left = length

    def take(self, count: int, what: str) -> Generator[int, bytes, bytes]:
        if count > self.left:
            _corrupt(f"it ends inside {what}")
        self.left -= count
        return (yield count) if count else b""


def _decode_steps(
    encoded_length: int, raw_length: int | None, write: Callable[[memoryview], object]
) -> _Steps:
    budget = _Budget(encoded_length)
    header = ChunkHeader.unpack((yield from budget.take(HEADER_BYTES, "its header")))
    if raw_length is not None and header.raw_length != raw_length:
        _corrupt(
            f"its header declares {header.raw_length} raw bytes, not the {raw_length} expected"
        )
    if header.encoding == RAW:
        if budget.left != header.raw_length:
            _corrupt(f"it holds {budget.left} raw bytes; its header declares {header.raw_length}")
        while budget.left:
            piece = yield from budget.take(min(budget.left, defaults.IO_CHUNK_BYTES), "its data")
            write(memoryview(piece))
        return header
    decompressor = zstandard.ZstdDecompressor()
    buffer = bytearray(header.frame_bytes)
    view = memoryview(buffer)
    done = largest = 0
    while done < header.raw_length:
        length = yield from _decode_frame(budget, decompressor, buffer, header, done)
        write(view[:length])
        done += length
        largest = max(largest, length)
    if budget.left:
        _corrupt(f"{budget.left} bytes follow its last frame")
    if largest != header.frame_bytes:
        _corrupt(f"its largest frame holds {largest} bytes; its header says {header.frame_bytes}")
    return header


def _decode_frame(
    budget: _Budget,
    decompressor: zstandard.ZstdDecompressor,
    buffer: bytearray,
    header: ChunkHeader,
    done: int,
) -> Generator[int, bytes, int]:
    """Decode the next frame into the front of buffer; returns its raw length."""
    what = f"the frame at raw byte {done}"
    length, width, coded = _FRAME_HEAD.unpack((yield from budget.take(_FRAME_HEAD.size, what)))
    if not 0 < length <= min(header.frame_bytes, header.raw_length - done):
        _corrupt(f"{what} declares {length} raw bytes")
    if width not in WIDTHS or coded >> width:
        _corrupt(f"{what} has width {width} and coded planes {coded:#x}")
    lengths = yield from budget.take(width * _PLANE_LENGTH.size, what)
    stored = struct.unpack(f"<{width}I", lengths)
    elements, tail = divmod(length, width)
    grouped = elements * width
    for plane, stored_length in enumerate(stored):
        where = f"plane {plane} of {what}"
        is_coded = coded >> plane & 1
        if stored_length > (_zstd_bound(elements) if is_coded else elements):
            _corrupt(f"{where} declares {stored_length} stored bytes for {elements} raw")
        data = yield from budget.take(stored_length, where)
        if is_coded:
            data = _decompress(decompressor, data, elements, where)
        elif stored_length != elements:
            _corrupt(f"{where} holds {stored_length} of its {elements} bytes")
        if not elements:
            continue  # an empty step assignment would try to resize the buffer
        if plane == 0 and width in _WIDEN:
            # A latin-1 str encoded as UTF-16/32 puts each byte at the head of a zeroed
            # 2- or 4-byte unit, in C at memcpy speed; the other planes then fill the
            # zeros. Twice as fast as the step assignment this plane would take.
            memoryview(buffer)[:grouped] = data.decode("latin-1").encode(_WIDEN[width])
        else:
            buffer[plane:grouped:width] = data  # equal lengths: copies in place
    if tail:
        buffer[grouped:length] = yield from budget.take(tail, what)
    return length


def _frames(layout: Layout, raw_length: int, frame_bytes: int) -> Iterator[tuple[int, int]]:
    """(raw length, width) of each frame: every run cut into pieces of at most frame_bytes."""
    covered = 0
    for length, width in layout:
        if width not in WIDTHS or length < 0:
            raise ValueError(
                f"a layout run of {length} bytes has width {width}, not one of {WIDTHS}"
            )
        covered += length
        while length:
            piece = min(length, frame_bytes)
            yield piece, width
            length -= piece
    if covered != raw_length:
        raise ValueError(f"the layout covers {covered} bytes of a {raw_length}-byte chunk")


def _encode_frame(
    compressor: zstandard.ZstdCompressor,
    buffer: bytearray,
    length: int,
    width: int,
    min_gain: float,
) -> list[bytes | bytearray | memoryview]:
    """The pieces of one frame: its head, then each plane coded if that gains min_gain."""
    elements, tail = divmod(length, width)
    grouped = elements * width
    # A step slice of a bytearray copies in C; one of a memoryview goes byte by byte.
    planes = (
        [memoryview(buffer)[:length]]
        if width == 1
        else [buffer[i:grouped:width] for i in range(width)]
    )
    stored: list[bytes | bytearray | memoryview] = []
    coded = 0
    for index, plane in enumerate(planes):
        packed = compressor.compress(plane)
        if len(packed) <= elements * (1 - min_gain):
            stored.append(packed)
            coded |= 1 << index
        else:
            stored.append(plane)
    head = _FRAME_HEAD.pack(length, width, coded) + struct.pack(
        f"<{width}I", *(len(s) for s in stored)
    )
    pieces = [head, *stored]
    if tail:
        pieces.append(buffer[grouped:length])
    return pieces


def _decompress(
    decompressor: zstandard.ZstdDecompressor, data: bytes, expected: int, what: str
) -> bytes:
    try:
        declared = zstandard.get_frame_parameters(data).content_size
        # The declared size is checked first: it is what zstd would allocate.
        if declared != expected:
            _corrupt(f"{what} declares {declared} bytes, not {expected}")
        out = decompressor.decompress(data)
    except zstandard.ZstdError as error:
        _corrupt(f"{what} does not decompress ({error})")
    if len(out) != expected:
        _corrupt(f"{what} decompresses to {len(out)} bytes, not {expected}")
    return out


def _zstd_bound(size: int) -> int:
    """ZSTD_COMPRESSBOUND: the most bytes zstd writes for `size` input bytes."""
    small = (128 * 1024 - size) >> 11 if size < 128 * 1024 else 0
    return size + (size >> 8) + small


def _fill(source: BinaryIO, view: memoryview) -> bool:
    """Read exactly len(view) bytes into view; False if the source ends first."""
    done = 0
    while done < len(view):
        n = source.readinto(view[done:])
        if not n:
            return False
        done += n
    return True


def _source_ended(raw_length: int) -> NoReturn:
    raise SourceChangedError(
        f"the source ended inside a {raw_length}-byte chunk; it is being rewritten."
        " Store it again once training has finished writing it."
    )


def _corrupt(problem: str) -> NoReturn:
    raise ChunkFormatError(
        f"an encoded chunk is corrupt: {problem}. The copy is bad; gather from another"
        " replica, or let the scrub replace it."
    )
