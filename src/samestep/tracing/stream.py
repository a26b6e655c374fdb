"""Per-rank trace streams (format "samestep.trace", version 4): Arrow IPC, append-only, crash-safe, checked.

One file per rank, ``RUN/trace/rank_00000.arrows``, readable with ``pyarrow.ipc.open_stream`` (and so
pandas). Records are appended in record batches; each batch is flushed to the OS when written, so a
SIGKILL loses at most the batch being built. A reader returns every complete batch and reports a torn
tail (a last message cut short by a kill) instead of failing.

Each record batch carries, in its custom metadata, ``checksum``: the BLAKE2b-128 of its values (see
``batch_checksum``), and the schema's metadata one of the stream's metadata; a reader raises
``DamagedStream``, naming the file and the batch's byte offset, for a batch whose values do not match
it or that does not decode though it is whole, and returns nothing from it or after it.

Columns (one row per record):
    seq         int64   this rank's record counter (contiguity check only; never compared across ranks)
    step        int32   optimizer step, 1-based as in metrics.jsonl
    microbatch  int32   global microbatch index; -1 for step-level records
    phase       string  "forward", "backward" or "step"
    scope       string  module path ("" for the root), or a parameter name for step-level records
    op          string  ATen overload ("aten.mm.default"), or "output", "grad_output" (module level), or at
                        step level "grad", "param", "buffer", "optim.<key>", a metric's name, a collective's,
                        and "step.end", the last record of a step whose context closed normally
    occurrence  int32   how many records with the same (step, microbatch, phase, scope, op) came before
    inputs      binary  the inputs' 16-byte digests, concatenated
    outputs     binary  the outputs' 16-byte digests, concatenated (16 zero bytes: uninitialised memory)
Record identity is (step, microbatch, phase, scope, op, occurrence), never the arrival position.

A digest is samestep's tensor digest (``samestep.digests``), except in the records of ops "param" and
"optim.<key>": there it is the tensor's state checksum, as receipts take it (``checksums.state_hash_for``
where it lies: ``xxh3-128`` in host memory), so a step's receipt and its trace hash each tensor once.
Version 3 (every digest samestep's) is still read; a reader's ``meta`` names the version as
``stream_version`` (``state_records`` tells which state records two streams can compare).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from samestep.records.durable import fsync_dir
from samestep.records.rundir import trace_dir

__all__ = [
    "COLUMNS",
    "END",
    "FORMAT",
    "KEY",
    "SCHEMA",
    "VERSION",
    "DamagedStream",
    "StreamWriter",
    "TraceStream",
    "batch_checksum",
    "iter_stream",
    "read_stream",
    "state_records",
    "stream_path",
    "stream_segments",
    "traced_ranks",
]

FORMAT, VERSION = "samestep.trace", 4
READS = ("3", "4")  # the versions this samestep reads
END = "step.end"  # the op of the record that closes a step that ended normally (phase "step", no tensors)
KEY = ("step", "microbatch", "phase", "scope", "op", "occurrence")
SCHEMA = pa.schema(
    [
        ("seq", pa.int64()),
        ("step", pa.int32()),
        ("microbatch", pa.int32()),
        ("phase", pa.string()),
        ("scope", pa.string()),
        ("op", pa.string()),
        ("occurrence", pa.int32()),
        ("inputs", pa.binary()),
        ("outputs", pa.binary()),
    ]
)
COLUMNS = tuple(SCHEMA.names)
_FIXED = {pa.int32(): 4, pa.int64(): 8}


class DamagedStream(ValueError):
    """A trace stream's bytes changed after they were written (a flipped bit, an overwrite): nothing is
    concluded from the damaged batch or what follows it."""


def batch_checksum(batch: pa.RecordBatch) -> str:
    """BLAKE2b-128 of a batch's values, column by column: what a reader decodes, not how it lies in the
    file (so it holds for a batch read back, sliced or not)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<q", batch.num_rows))
    for arr in batch.columns:
        if arr.null_count:
            h.update(b"null")  # the writer writes no nulls: a null can only come from damage
        bufs, at, n = arr.buffers(), arr.offset, len(arr)
        if not n or bufs[1] is None:
            continue
        size = _FIXED.get(arr.type)
        if size is not None:
            h.update(memoryview(bufs[1])[at * size : (at + n) * size])
        else:  # string or binary: lengths (as offsets from the first), then the bytes
            offsets = np.frombuffer(bufs[1], dtype="<i4")[at : at + n + 1].astype(np.int64)
            first, last = int(offsets[0]), int(offsets[-1])
            h.update((offsets - first).tobytes())
            if bufs[2] is not None:
                h.update(memoryview(bufs[2])[max(first, 0) : max(last, 0)])
    return h.hexdigest()


def _meta_checksum(meta_json: str) -> str:
    return hashlib.blake2b(meta_json.encode(), digest_size=16).hexdigest()


def stream_path(run_dir: str | os.PathLike[str], rank: int, segment: int = 0) -> Path:
    """Segment 0 is ``rank_00000.arrows``; a resumed run appends ``rank_00000.1.arrows``, ..."""
    suffix = f".{segment}" if segment else ""
    return trace_dir(run_dir) / f"rank_{rank:05d}{suffix}.arrows"


def stream_segments(run_dir: str | os.PathLike[str], rank: int) -> list[Path]:
    """A rank's stream segments in the order they were written (one per run invocation)."""
    out = []
    while (p := stream_path(run_dir, rank, len(out))).exists():
        out.append(p)
    return out


def traced_ranks(run_dir: str | os.PathLike[str]) -> list[int]:
    """The ranks that have a stream in ``run_dir``."""
    d = trace_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted({int(p.name[5:10]) for p in d.glob("rank_*.arrows")})


class StreamWriter:
    """Appends record batches to one rank's stream."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "wb")
        meta_json = json.dumps(meta)
        schema = SCHEMA.with_metadata(
            {"format": FORMAT, "version": str(VERSION), "meta": meta_json, "checksum": _meta_checksum(meta_json)}
        )
        self._writer = pa.ipc.new_stream(self._file, schema)
        self.rows = 0

    def write(self, columns: dict[str, Any]) -> None:
        """Appends one record batch: each column a list of values or an Arrow array of the schema's type."""
        n = len(columns["seq"])
        if not n:
            return
        arrays = [
            columns[c] if isinstance(columns[c], pa.Array) else pa.array(columns[c], type=SCHEMA.field(c).type)
            for c in COLUMNS
        ]
        batch = pa.record_batch(arrays, schema=SCHEMA)
        self._writer.write_batch(batch, custom_metadata={"checksum": batch_checksum(batch)})
        self._file.flush()  # in the OS after this: survives a SIGKILL of this process
        self.rows += n

    def sync(self) -> None:
        """Makes every batch written so far durable (survives a power loss, not just a kill), and the
        file's name with it: called before a checkpoint commits, so the checkpointed steps' records
        outlive it."""
        self._file.flush()
        os.fsync(self._file.fileno())
        fsync_dir(self.path.parent)

    def close(self) -> None:
        """Writes the stream's end and makes it durable: a closed segment that run.json records as closed
        is whole after a power loss too."""
        self._writer.close()
        self.sync()
        self._file.close()


@dataclass(slots=True)
class TraceStream:
    """A stream read back: its metadata, records, and a torn tail if the writer died mid-batch."""

    path: Path
    meta: dict[str, Any]
    table: pa.Table
    torn: str | None


def _open(path: Path, source: pa.NativeFile):
    reader = pa.ipc.open_stream(source)
    md = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    if md.get("format") != FORMAT:
        raise ValueError(f"{path}: format {md.get('format')!r} is not {FORMAT!r}")
    if md.get("version") not in READS:
        raise ValueError(
            f"{path}: trace schema version {md.get('version')!r}, this samestep reads versions "
            f"{READS[0]} to {VERSION}; compare traces written by the same samestep version"
        )
    if md.get("checksum") != _meta_checksum(md.get("meta", "")) or not reader.schema.equals(SCHEMA):
        raise DamagedStream(
            f"{path}: damaged: its header (schema or run metadata, byte 0) does not match its "
            "checksum; the stream cannot be trusted"
        )
    meta = {**json.loads(md["meta"]), "stream_version": int(md["version"])}
    named = _NAMED.match(path.name)
    if named is not None and meta.get("rank") != int(named.group(1)):
        raise ValueError(
            f"{path}: its header says rank {meta.get('rank')!r}; a stream is named rank_RRRRR.arrows "
            "after the rank that wrote it (a file copied over another's: move it back, or remove it)"
        )
    return reader, meta


_NAMED = re.compile(r"^rank_(\d{5})(?:\.\d+)?\.arrows$")  # stream_path's names


def state_records(meta: dict[str, Any]) -> str:
    """How a stream (its ``meta`` as read) digests the records of ops "param" and "optim.<key>": by their
    state checksum (version 4 on), or by samestep's tensor digest (version 3). Two streams compare those
    records only where they say the same."""
    return "state checksum" if meta.get("stream_version", VERSION) >= 4 else "tensor digest"


_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # the end-of-stream marker a writer that closed wrote last


def _cut_short(path: Path, at: int) -> bool:
    """Whether the IPC message at byte ``at`` that failed to read is a torn tail: the stream was never
    closed (no end-of-stream marker: its writer was killed) and the message's declared length runs past
    the end of the file. Anything else that fails is damage."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(size - len(_EOS), 0))
        if f.read() == _EOS:
            return False
        f.seek(at)
        head = f.read(8)
        if len(head) < 8:
            return True
        marker, meta_len = struct.unpack("<Ii", head)
        if marker != 0xFFFFFFFF or meta_len < 0:
            return False  # not the start of a message
        if at + 8 + meta_len > size:
            return True
        meta = f.read(meta_len)
    try:  # the flatbuffer Message table's bodyLength (field 3)
        table = struct.unpack_from("<I", meta, 0)[0]
        vtable = table - struct.unpack_from("<i", meta, table)[0]
        vt_size = struct.unpack_from("<H", meta, vtable)[0]
        field = struct.unpack_from("<H", meta, vtable + 10)[0] if vt_size > 10 else 0
        body = struct.unpack_from("<q", meta, table + field)[0] if field else 0
    except struct.error:
        return False
    return at + 8 + meta_len + body > size


def _matches(got: pa.RecordBatchWithMetadata) -> bool:
    """Whether a batch read back has the values its writer wrote (its stored checksum)."""
    md = got.custom_metadata
    want = md.get(b"checksum") if md is not None else None
    try:
        return want is not None and want.decode(errors="replace") == batch_checksum(got.batch)
    except (ValueError, TypeError, IndexError):  # offsets or lengths past its buffers: damage
        return False


def iter_stream(path: Path) -> tuple[dict[str, Any], Iterator[pa.RecordBatch], list[str]]:
    """Streams a file's record batches (bounded memory); a torn tail is appended to the returned list.

    Raises:
        ValueError: the file is no readable stream of this version.
        DamagedStream: (also while iterating) a batch's values do not match its checksum, or a whole
            batch does not decode; the message names the file and the batch's byte offset.
    """
    try:
        source = pa.memory_map(str(path), "r")
        reader, meta = _open(path, source)
    except (pa.ArrowException, OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError) as e:
        raise ValueError(f"{path}: not a readable samestep trace stream ({e})") from None
    torn: list[str] = []

    def batches() -> Iterator[pa.RecordBatch]:
        while True:
            at = source.tell()
            try:
                got = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                return
            except (pa.ArrowException, OSError) as e:
                if not _cut_short(path, at):
                    raise DamagedStream(
                        f"{path}: damaged: the record batch at byte {at} does not decode ({e}); "
                        "nothing is concluded from it or what follows it"
                    ) from None
                torn.append(f"torn tail at byte {at}: {e}")
                return
            if not _matches(got):
                raise DamagedStream(
                    f"{path}: damaged: the record batch at byte {at} does not match its checksum; "
                    "nothing is concluded from it or what follows it"
                )
            yield got.batch

    return meta, batches(), torn


def read_stream(path: str | os.PathLike[str]) -> TraceStream:
    """Reads a whole stream; a torn tail (writer killed mid-batch) is reported in ``torn``, not raised."""
    meta, batches, torn = iter_stream(Path(path))
    got = list(batches)
    table = pa.Table.from_batches(got, schema=SCHEMA) if got else SCHEMA.empty_table()
    return TraceStream(Path(path), meta, table, torn[0] if torn else None)
