"""The process worker's child: reads each batch's tensors out of the training process's memory
(``process_vm_readv``), digests them (the state tensors by their checksum) and appends the batch's records
to the stream."""

from __future__ import annotations

import ctypes
import itertools
import json
import marshal
import os
import socket
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from samestep.digests import ROW_BYTES, Packed, lanes_packed, rows_of
from samestep.hashing.checksums import xxh3_tensor
from samestep.hashing.state import tensor_bytes
from samestep.tracing.batch import Columns
from samestep.tracing.stream import StreamWriter
from samestep.tracing.wire import recv, send
from samestep.tracing.writer import write_lanes

__all__ = ["GROUP_BYTES", "Reader", "checksum_described", "digest_described", "serve"]

# The child reads the contiguous tensors of a batch (live tensors, gradient pieces) in groups of about this
# many bytes, each hashed before the next is read into the same buffer, which then stays in this core's
# cache: read all at once, a batch would stream twice through the cache and memory that the training
# process uses, and slow its steps (bench_trace.py measures that as "worker_contention"). Each group costs
# the child a few Python-level operations, so groups are not smaller. Chunks of copies (the op level's)
# are read whole: in groups, the child's CPU time there grows by a third.
GROUP_BYTES = 1 << 20
_IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux's UIO_MAXIOV)


class Reader:
    """Copies spans of the training process's memory into one local buffer (process_vm_readv)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._buf = torch.empty(0, dtype=torch.uint8)

    def read(self, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, list[int]]:
        """Reads the bytes at each (address, length) into the buffer, each at a 64-byte boundary. Returns
        the buffer (as far as used) and each span's offset in it."""
        step = (np.array([n for _, n in spans], dtype=np.int64) + 63) // 64 * 64
        starts = np.cumsum(step) - step
        total = int(step.sum())
        self._room(total)
        self._read_at(spans, starts)
        return self._buf[:total], starts.tolist()

    def packs(self, spans: list[tuple[int, int]], limit: int) -> Iterator[Packed]:
        """The spans read as ``Packed`` groups: each span at the start of its own whole rows (the reads are
        the packing), a group for the spans that start within each ``limit`` bytes of rows. Every group
        is read into the start of the buffer when the next is asked for, so the one before must be
        hashed by then (``lanes_packed`` does that)."""
        if not spans:
            return
        nbytes = [n for _, n in spans]
        step = np.array([rows_of(n) * ROW_BYTES for n in nbytes], dtype=np.int64)
        ends = np.cumsum(step)
        starts = ends - step
        bounds = [0, *(np.flatnonzero(np.diff(starts // limit)) + 1).tolist(), len(spans)]
        groups = list(zip(bounds, bounds[1:]))
        self._room(max(int(ends[hi - 1] - starts[lo]) for lo, hi in groups))
        for lo, hi in groups:
            self._read_at(spans[lo:hi], starts[lo:hi] - starts[lo])
            yield Packed(self._buf[: int(ends[hi - 1] - starts[lo])], nbytes[lo:hi])

    def _room(self, total: int) -> None:
        if self._buf.numel() < total:
            self._buf = torch.empty(max(total, 2 * self._buf.numel()), dtype=torch.uint8)

    def _read_at(self, spans: list[tuple[int, int]], offsets: np.ndarray) -> None:
        """Reads each (address, length) span into the buffer at its offset (empty spans read nothing)."""
        lengths = np.array([n for _, n in spans], dtype=np.int64)
        keep = lengths > 0
        local = np.stack([self._buf.data_ptr() + offsets[keep], lengths[keep]], axis=1).astype(np.uint64)
        remote = np.stack([np.array([a for a, _ in spans], dtype=np.int64)[keep], lengths[keep]], axis=1).astype(
            np.uint64
        )
        for a in range(0, len(local), _IOV_MAX):
            lo, re = np.ascontiguousarray(local[a : a + _IOV_MAX]), np.ascontiguousarray(remote[a : a + _IOV_MAX])
            want = int(lo[:, 1].sum())
            got = self._libc.process_vm_readv(
                self.pid, ctypes.c_void_p(lo.ctypes.data), len(lo), ctypes.c_void_p(re.ctypes.data), len(re), 0
            )
            if got != want:
                raise OSError(f"process_vm_readv read {got} of {want} bytes (errno {ctypes.get_errno()})")


def digest_described(reader: Reader, packs: list[tuple], entries: list[tuple]) -> list[list[int]]:
    """The lanes of a batch as the training process described it (``ProcessWorker.submit``): the packs'
    entries, then every tensor the entries expand to, in ``lanes_packed``'s order.

    A chunk of copies is read whole. Every tensor whose bytes lie contiguously (the whole tensor, or a
    piece of a gradient copy) is read straight into rows of packed buffers; only strided ones are read
    as spans and viewed."""
    spans: list[tuple[int, int]] = []  # contiguous tensors, in order
    strided: list[tuple] = []  # the others' descriptions
    order: list[int] = []  # per tensor: its index in spans, or ~its index in strided
    for e in entries:
        if not isinstance(e[0], int):  # pieces ``keep`` of a contiguous copy cut at byte ``sizes``
            (addr, _), sizes, keep = e
            offsets = np.cumsum([0, *sizes]).tolist()
            for k in keep:
                order.append(len(spans))
                spans.append((addr + offsets[k], sizes[k]))
        elif len(e) == 2:
            order.append(len(spans))
            spans.append(e)
        else:
            order.append(~len(strided))
            strided.append(e)
    # Each chunk is read whole; the contiguous tensors are read and hashed in groups of about GROUP_BYTES
    # through one buffer that stays in this core's cache (see GROUP_BYTES).
    chunks = (Packed(reader.read([(addr, used)])[0], nbytes) for addr, used, nbytes in packs)
    lanes = lanes_packed(itertools.chain(chunks, reader.packs(spans, GROUP_BYTES)))
    flat, lanes = lanes[len(lanes) - len(spans) :], lanes[: len(lanes) - len(spans)]
    other: list[list[int]] = []
    if strided:
        buf, starts = reader.read([(d[0], d[1]) for d in strided])
        views = []
        for (_, span, dtype, shape, stride), at in zip(strided, starts):
            typed = buf[at : at + span].view(getattr(torch, dtype))
            views.append(typed.as_strided(shape, stride))
        other = lanes_packed((), views)
    return lanes + [flat[i] if i >= 0 else other[~i] for i in order]


def checksum_described(reader: Reader, hashed: list[tuple]) -> list[bytes]:
    """The state checksums (``xxh3-128``, raw) of the state tensors as the training process described them:
    (description, checksum header) each."""
    if not hashed:
        return []
    buf, starts = reader.read([(d[0], d[1]) for d, _ in hashed])
    out = []
    for (d, head), at in zip(hashed, starts):
        data = buf[at : at + d[1]]
        if len(d) != 2:  # strided: its elements in row-major order
            data = data.view(getattr(torch, d[2])).as_strided(d[3], d[4])
        out.append(xxh3_tensor(head, tensor_bytes(data)))
    return out


def serve(sock: socket.socket, pid: int) -> None:
    """The child's loop: answers the training process's messages (wire.py) until it quits or is gone."""
    torch.set_num_threads(1)  # one core: the training process has the others
    reader = Reader(pid)
    writer: StreamWriter | None = None
    error: str | None = None  # of opening or writing the stream: reported with the next reply
    held: tuple | None = None  # a digested batch waiting for W or X

    def write(b: Columns, pack_sizes: list[int], lanes: list[list[int]], hashed: list[bytes]) -> None:
        nonlocal error
        try:
            write_lanes(writer, b, pack_sizes, lanes, hashed)
        except Exception:  # reported with the next reply
            error = traceback.format_exc()

    while True:
        try:
            kind, payload = recv(sock)
        except (EOFError, OSError):
            break  # the training process is gone
        if kind == b"O":
            path, meta = marshal.loads(payload)
            try:
                writer = StreamWriter(Path(path), json.loads(meta))
            except Exception:
                error = traceback.format_exc()
        elif kind == b"B":
            try:
                if error is not None:
                    raise RuntimeError(error)
                packs, entries, columns, deferred, hashed = marshal.loads(payload)
                done = (
                    Columns(*columns),
                    [len(nbytes) for _, _, nbytes in packs],
                    digest_described(reader, packs, entries),
                    checksum_described(reader, hashed),
                )
                if deferred:  # live tensors: written once the training process saw them unchanged
                    held = done
                else:
                    write(*done)
                send(sock, b"R")
            except Exception:
                error = None
                if os.getppid() != pid:
                    break  # the training process is gone (it failed, or was killed): nothing to tell it
                send(sock, b"E", traceback.format_exc().encode())
        elif kind in (b"W", b"X"):
            if kind == b"W" and held is not None:
                write(*held)
            held = None
        elif kind == b"S":
            try:
                if error is not None:
                    raise RuntimeError(error)
                if writer is not None:
                    writer.sync()
                send(sock, b"K")
            except Exception:
                error = None
                send(sock, b"E", traceback.format_exc().encode())
        elif kind == b"C":
            if writer is not None:
                writer.close()
                writer = None
            if error is not None:
                send(sock, b"E", error.encode())
                error = None
            else:
                send(sock, b"K")
        elif kind == b"Q":
            break
    if writer is not None:
        writer.close()
