"""Per-rank trace streams (format "samestep.trace", version 2): Arrow IPC, append-only, crash-safe.

One file per rank, ``RUN/trace/rank_00000.arrows``, readable with ``pyarrow.ipc.open_stream`` (and so
pandas). Records are appended in record batches; each batch is flushed to the OS when written, so a
SIGKILL loses at most the batch being built. A reader returns every complete batch and reports a torn
tail instead of failing.

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
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

__all__ = ["COLUMNS", "END", "FORMAT", "KEY", "SCHEMA", "VERSION", "StreamWriter",
           "TraceStream", "iter_stream", "read_stream", "stream_path", "stream_segments", "traced_ranks"]

FORMAT, VERSION = "samestep.trace", 2
END = "step.end"  # the op of the record that closes a step that ended normally (phase "step", no tensors)
KEY = ("step", "microbatch", "phase", "scope", "op", "occurrence")
SCHEMA = pa.schema([
    ("seq", pa.int64()), ("step", pa.int32()), ("microbatch", pa.int32()), ("phase", pa.string()),
    ("scope", pa.string()), ("op", pa.string()), ("occurrence", pa.int32()),
    ("inputs", pa.binary()), ("outputs", pa.binary()),
])
COLUMNS = tuple(SCHEMA.names)


def stream_path(run_dir: str | os.PathLike[str], rank: int, segment: int = 0) -> Path:
    """Segment 0 is ``rank_00000.arrows``; a resumed run appends ``rank_00000.1.arrows``, ..."""
    suffix = f".{segment}" if segment else ""
    return Path(run_dir) / "trace" / f"rank_{rank:05d}{suffix}.arrows"


def stream_segments(run_dir: str | os.PathLike[str], rank: int) -> list[Path]:
    """A rank's stream segments in the order they were written (one per run invocation)."""
    out = []
    while (p := stream_path(run_dir, rank, len(out))).exists():
        out.append(p)
    return out


def traced_ranks(run_dir: str | os.PathLike[str]) -> list[int]:
    """The ranks that have a stream in ``run_dir``."""
    d = Path(run_dir) / "trace"
    if not d.is_dir():
        return []
    return sorted({int(p.name[5:10]) for p in d.glob("rank_*.arrows")})


class StreamWriter:
    """Appends record batches to one rank's stream."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "wb")
        schema = SCHEMA.with_metadata({"format": FORMAT, "version": str(VERSION), "meta": json.dumps(meta)})
        self._writer = pa.ipc.new_stream(self._file, schema)
        self.rows = 0

    def write(self, columns: dict[str, Any]) -> None:
        """Appends one record batch: each column a list of values or an Arrow array of the schema's type."""
        n = len(columns["seq"])
        if not n:
            return
        arrays = [columns[c] if isinstance(columns[c], pa.Array) else pa.array(columns[c], type=SCHEMA.field(c).type)
                  for c in COLUMNS]
        self._writer.write_batch(pa.record_batch(arrays, schema=SCHEMA))
        self._file.flush()  # in the OS after this: survives a SIGKILL of this process
        self.rows += n

    def close(self) -> None:
        self._writer.close()
        self._file.close()


@dataclass(slots=True)
class TraceStream:
    """A stream read back: its metadata, records, and a torn tail if the writer died mid-batch."""

    path: Path
    meta: dict[str, Any]
    table: pa.Table
    torn: str | None


def _open(path: Path):
    reader = pa.ipc.open_stream(pa.memory_map(str(path), "r"))
    md = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    if md.get("format") != FORMAT:
        raise ValueError(f"{path}: format {md.get('format')!r} is not {FORMAT!r}")
    if md.get("version") != str(VERSION):
        raise ValueError(f"{path}: trace schema version {md.get('version')!r}, this samestep reads {VERSION}; "
                         "compare traces written by the same samestep version")
    return reader, json.loads(md.get("meta", "{}"))


def iter_stream(path: Path) -> tuple[dict[str, Any], Iterator[pa.RecordBatch], list[str]]:
    """Streams a file's record batches (bounded memory); a torn tail is appended to the returned list."""
    try:
        reader, meta = _open(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: not a readable samestep trace stream ({e})") from None
    torn: list[str] = []

    def batches() -> Iterator[pa.RecordBatch]:
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError) as e:
                torn.append(f"torn tail: {e}")
                return
            yield batch

    return meta, batches(), torn


def read_stream(path: str | os.PathLike[str]) -> TraceStream:
    """Reads a whole stream; a torn tail (writer killed mid-batch) is reported in ``torn``, not raised."""
    meta, batches, torn = iter_stream(Path(path))
    got = list(batches)
    table = pa.Table.from_batches(got, schema=SCHEMA) if got else SCHEMA.empty_table()
    return TraceStream(Path(path), meta, table, torn[0] if torn else None)
