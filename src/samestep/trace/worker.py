"""The digest worker: digests a flushed batch of records and appends it to the rank's stream while the
training thread runs on.

Two kinds, same results (the digest is exact integer arithmetic wherever it runs):

- ``ThreadWorker``: a second thread of the training process. Any device; but its Python code (a few
  hundred operations per batch) takes the interpreter lock from the training thread: measured here as
  3-4% of a CPU step for the same digests that cost 0.5% when a second process runs them.
- ``ProcessWorker``: a child process with its own interpreter, for CPU tensors. It copies the batch's
  tensors out of the training process's memory itself (``process_vm_readv``, which needs the right to
  trace the parent: the child checks first), so the training thread only describes them: addresses,
  shapes, strides and the record columns, serialised with ``marshal`` (plain numbers, strings and
  bytes: loading it runs no code). The recorder keeps every tensor of a batch alive until the child
  has read it; a batch with live tensors that must stay unchanged (``copy="checked"``) is written only
  once the training thread has seen them unchanged (W), or discarded (X).

If the training process dies, the child sees the socket close and exits after the messages it has: as
with a thread, a batch in flight may be lost, and every batch written before it reads back.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import marshal
import os
import socket
import struct
import subprocess
import sys
import traceback
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from samestep.trace.digest import ROW_BYTES, Packed, lanes_packed, rows_of
from samestep.trace.digest import finish as digest_finish
from samestep.trace.stream import StreamWriter

__all__ = ["ProcessWorker", "ThreadWorker", "plain", "write_batch", "write_lanes"]

UNINIT = bytes(16)  # the digest recorded for uninitialised memory (torch.empty and friends)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A dense, strided tensor whose bytes stand for ``t``'s value, for tensors whose bytes cannot be
    copied or read as they are: sparse (its dense form), quantized (its integer values), nested (its
    components, flattened and joined), meta (no data: empty, under the meta tensor's own header), and a
    conjugate or negative view (resolved). A copy: ``t`` may change afterwards."""
    t = t.detach()
    if t.is_meta:
        return torch.empty(0, dtype=t.dtype)
    if t.is_quantized:
        return t.int_repr()
    if t.is_nested:
        return torch.cat([c.reshape(-1) for c in t.unbind()])
    out = t.to_dense() if t.layout != torch.strided else t.clone()
    return out.resolve_conj().resolve_neg()


def _readable(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be hashed (or read by the child) as they are, with ``t``'s meaning."""
    return t.layout == torch.strided and not (t.is_quantized or t.is_nested or t.is_meta)


def expand(entries: list) -> list[torch.Tensor]:
    """The tensors a batch's ``tensors`` entries stand for: a tensor, or (copy, sizes, keep): the pieces
    ``keep`` of ``copy.split(sizes)`` (one operation for a whole gradient buffer)."""
    out: list[torch.Tensor] = []
    for t in entries:
        if isinstance(t, torch.Tensor):
            out.append(t)
        else:
            pieces = t[0].split(t[1])
            out.extend(pieces[k] for k in t[2])
    return out


def write_batch(writer: StreamWriter, b: Any, packs: list[Packed], tensors: list[torch.Tensor]) -> None:
    """Digests a batch's staged tensors and appends its records to the stream (see ``recorder._Batch``
    for the columns ``b`` carries). Writes nothing if one of its checked live tensors changed before its
    digest was done (``b.changed()``): the recorder then raises."""
    try:
        lanes = lanes_packed(packs, tensors)
    except (ValueError, RuntimeError, NotImplementedError):
        # A live tensor whose bytes cannot be hashed as they are (sparse, quantized, nested): its plain form,
        # taken now. A change since it was recorded is still caught below (its version). Tried only after
        # a failure: the usual batch pays no check per tensor.
        lanes = lanes_packed(packs, [t if _readable(t) else plain(t) for t in tensors])
    if b.changed():
        return
    write_lanes(writer, b, [len(pack.nbytes) for pack in packs], lanes)


def write_lanes(writer: StreamWriter, b: Any, pack_sizes: list[int], lanes: list[list[int]]) -> None:
    """Appends a batch's records, given the lanes of its packs' entries (``pack_sizes`` of them per
    pack), then of its tensors."""
    first, in_packs = [], 0  # lanes come packs' entries first, then the tensors
    for size in pack_sizes:
        first.append(in_packs)
        in_packs += size
    at = [first[c] + e if c >= 0 else in_packs + e for c, e in zip(b.slot_chunk, b.slot_entry)]
    # One row per reference, then a zero row: NO_REF (-1) picks it (UNINIT).
    digests = np.frombuffer(b"".join([digest_finish(head, lanes[at[slot]]) for slot, head
                                      in zip(b.ref_slot, b.ref_head)]) + UNINIT, dtype=np.uint8).reshape(-1, 16)
    n = len(b.step)
    cols = {"seq": pa.array(np.arange(b.first_seq, b.first_seq + n, dtype=np.int64)), "step": b.step,
            "microbatch": b.mb, "phase": b.phase, "scope": b.scope, "op": b.op, "occurrence": b.occ}
    for name, refs, ends in (("inputs", b.ins, b.in_end), ("outputs", b.outs, b.out_end)):
        data = digests[np.asarray(refs, dtype=np.int64)].tobytes() if refs else b""
        offsets = np.zeros(n + 1, dtype=np.int32)
        offsets[1:] = np.asarray(ends, dtype=np.int32) * 16
        cols[name] = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    writer.write(cols)


class ThreadWorker:
    """Digests on a second thread of this process (any device)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="samestep-trace")
        self._writer: StreamWriter | None = None
        self._pending: Future | None = None

    def open(self, path: Path, meta: dict[str, Any]) -> None:
        self._writer = StreamWriter(path, meta)

    def submit(self, b: Any, events: list[tuple[torch.device, Any]]) -> None:
        self._pending = self._pool.submit(self._run, b, events)

    def _run(self, b: Any, events: list[tuple[torch.device, Any]]) -> None:
        for device, event in events:  # kernels on this thread's stream start after the staged copies
            torch.cuda.current_stream(device).wait_event(event)
        write_batch(self._writer, b, b.packs, expand(b.tensors))

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises a failure of the worker here, in the training thread

    def commit(self, write: bool) -> None:
        """Nothing to do: this thread checked the live tensors itself before it wrote the batch."""

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown()
            if self._writer is not None:
                self._writer.close()
                self._writer = None


# -- the process worker: wire format ---------------------------------------------------------------------
# A message is a header (kind, payload bytes) and the payload. To the child: O open the stream (path, meta
# as JSON), B a batch (reply R when digested, or E and the error), W write the last batch / X discard it
# (its live tensors changed), C close the stream (reply K, or E), Q quit.
_HEAD = struct.Struct("<cQ")
# The child reads the contiguous tensors of a batch (live tensors, gradient pieces) in groups of about this
# many bytes, each hashed before the next is read into the same buffer, which then stays in cache. Read all
# at once, a batch streamed twice through the cache and memory that the training process uses: a child
# digesting the reference model's 10 MB of parameters and optimizer state nonstop slowed the training
# steps 1.05-1.08x; in groups of 512 KiB, 1.01-1.03x, and of 1 MiB, 1.025-1.028x (bench_trace.py,
# "worker_contention"). Each group costs the child a few Python-level operations: 512 KiB groups took
# 1.5x its CPU time at step level, 1 MiB about 1.1x. Chunks of copies (the op level's) are still read
# whole: there, in groups, the child's CPU time (near a core at op level) grew by a third.
GROUP_BYTES = 1 << 20
_IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux's UIO_MAXIOV)


def _send(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    sock.sendall(_HEAD.pack(kind, len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise EOFError
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> tuple[bytes, bytes]:
    kind, n = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    return kind, _recv_exact(sock, n) if n else b""


def _span(t: torch.Tensor) -> int:
    """The bytes from ``t``'s first element to the end of its last (all of its elements lie within)."""
    if not t.numel():
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _describe(t: torch.Tensor) -> tuple:
    """Where the child finds ``t``'s bytes: (address, bytes) for a plain contiguous tensor (its digest
    depends only on its row-major bytes, the header aside: read as uint8), else (address, span, dtype,
    shape, strides)."""
    if t.is_cpu and t.layout == torch.strided:
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()):  # quantized, nested: their bytes as they lie
            return t.data_ptr(), t.nbytes
        if not (t.is_conj() or t.is_neg() or t.is_quantized or t.is_nested):
            return t.data_ptr(), _span(t), str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride()
    raise ValueError(f"trace.worker=process digests dense CPU tensors only, got one ({t.layout}, on {t.device}, "
                     f"conjugate or negative bit {t.is_conj() or t.is_neg()}); use trace.worker=thread "
                     "(samestep.trace(..., worker='thread'))")


def describe_all(tensors: list[torch.Tensor]) -> list[tuple] | None:
    """Each tensor's ``_describe``, or None if one of them is not read where it lies."""
    try:
        return [_describe(t) for t in tensors]
    except ValueError:
        return None


# The child's first word: whether it may read this process's memory (process_vm_readv needs the right
# to trace it, which a container or a security module can deny). Runs before torch is imported.
_PROBE = """
import ctypes, socket, sys
fd, pid, addr, n = map(int, sys.argv[1:5])
sock = socket.socket(fileno=fd)
buf = ctypes.create_string_buffer(n)
iov = (ctypes.c_void_p * 4)(ctypes.addressof(buf), n, addr, n)
libc = ctypes.CDLL(None, use_errno=True)
got = libc.process_vm_readv(pid, ctypes.byref(iov, 0), 1, ctypes.byref(iov, 16), 1, 0)
sock.sendall(buf.raw if got == n else b"errno %d" % ctypes.get_errno())
if got == n:
    from samestep.trace.worker import _child
    _child(sock, pid)
"""


def _forget_in_child(ref: weakref.ref) -> None:
    """In a process forked from the trainer (a DataLoader worker, say): close its copy of the socket, or
    the digest worker would see the trainer's death only when that process ends too."""
    worker = ref()
    if worker is not None:
        worker._sock.close()
        worker._pending = worker._unwritten = False


class ProcessWorker:
    """Digests in a child process, which reads the tensors from this process's memory (CPU only)."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        token = os.urandom(16)
        probe = ctypes.create_string_buffer(token, len(token))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _PROBE, str(child.fileno()), str(os.getpid()), str(ctypes.addressof(probe)),
                 str(len(token))], pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._sock = parent
        os.register_at_fork(after_in_child=lambda ref=weakref.ref(self): _forget_in_child(ref))
        self._pending = False  # a batch is being digested
        self._keep: list[torch.Tensor] = []  # plain forms of its live tensors (see _payload)
        self._unwritten = False  # a digested batch waits for W or X
        try:
            answer = parent.recv(64)
        except OSError:
            answer = b""
        if answer != token:
            parent.close()
            self._proc.wait()
            why = answer.decode(errors="replace") or f"it exited with status {self._proc.returncode}"
            raise OSError(f"the trace worker process cannot read this process's memory ({why}; process_vm_readv "
                          "needs the right to trace it): use trace.worker=thread")

    def _gone(self) -> RuntimeError:
        try:
            status = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        return RuntimeError(f"trace: the digest worker process exited (status {status}); its error, if any, is on "
                            "stderr")

    def _post(self, kind: bytes, payload: bytes = b"") -> None:
        try:
            _send(self._sock, kind, payload)
        except OSError:
            raise self._gone() from None

    def open(self, path: Path, meta: dict[str, Any]) -> None:
        self._post(b"O", marshal.dumps((str(path), json.dumps(meta))))

    def submit(self, b: Any, events: list) -> None:
        keep: list[torch.Tensor] = []
        self._post(b"B", self._payload(b, keep))
        self._keep = keep  # the child reads these until it replies
        self._pending, self._unwritten = True, bool(b.check_live)

    @staticmethod
    def _payload(b: Any, keep: list[torch.Tensor]) -> bytes:
        """A batch as the child reads it: where each staged tensor lies, and the record columns. A live
        tensor the child cannot read as it lies (a conjugate view, a sparse or a strided quantized one) is
        described by its plain form, taken now and added to ``keep``; a change since it was recorded is
        still caught by its version. Spans of ``tensors`` that ``b.described`` holds descriptions of (a
        state plan's: see recorder._StatePlan) are not described again."""
        packs = [(p.buf.data_ptr(), sum(rows_of(n) for n in p.nbytes) * ROW_BYTES, p.nbytes) for p in b.packs]

        def describe(t: Any) -> tuple:
            if not isinstance(t, torch.Tensor):
                size = t[0].element_size()  # a contiguous copy, read as bytes: the pieces too
                return _describe(t[0]), [n * size for n in t[1]], t[2]
            try:
                return _describe(t)
            except ValueError:
                if not t.is_cpu:
                    raise
                keep.append(plain(t))
                return _describe(keep[-1])

        entries: list[tuple] = []
        done = 0
        for first, known in sorted(b.described.items()):  # spans described already (a state plan's)
            entries += map(describe, b.tensors[done:first])
            entries += known
            done = first + len(known)
        entries += map(describe, b.tensors[done:])
        return marshal.dumps((packs, entries, b.first_seq, b.step, b.mb, b.phase, b.scope, b.op, b.occ, b.ins,
                              b.in_end, b.outs, b.out_end, b.ref_slot, b.ref_head, b.slot_chunk, b.slot_entry,
                              bool(b.check_live)))

    def _reply(self) -> bytes:
        try:
            kind, payload = _recv(self._sock)
        except (EOFError, OSError):
            raise self._gone() from None
        if kind == b"E":
            raise RuntimeError(f"trace: the digest worker failed:\n{payload.decode(errors='replace')}")
        return kind

    def wait(self) -> None:
        """Waits for the batch in flight to be read and digested."""
        if self._pending:
            self._pending = False
            try:
                self._reply()
            finally:
                self._keep = []

    def commit(self, write: bool) -> None:
        """A digested batch holding live tensors is written if ``write`` (they did not change before they
        were read), else discarded."""
        if self._unwritten:
            self._unwritten = False
            self._post(b"W" if write else b"X")

    def close(self) -> None:
        try:
            self.wait()
            self._post(b"C")
            self._reply()
        finally:
            try:
                _send(self._sock, b"Q")
            except OSError:
                pass
            self._sock.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


# -- the process worker: the child -----------------------------------------------------------------------
class _Columns:
    """A batch's record columns, as the child received them (the attributes ``write_batch`` reads)."""

    def __init__(self, fields: tuple) -> None:
        (self.first_seq, self.step, self.mb, self.phase, self.scope, self.op, self.occ, self.ins, self.in_end,
         self.outs, self.out_end, self.ref_slot, self.ref_head, self.slot_chunk, self.slot_entry) = fields


class _Reader:
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
        remote = np.stack([np.array([a for a, _ in spans], dtype=np.int64)[keep], lengths[keep]],
                          axis=1).astype(np.uint64)
        for a in range(0, len(local), _IOV_MAX):
            lo, re = np.ascontiguousarray(local[a:a + _IOV_MAX]), np.ascontiguousarray(remote[a:a + _IOV_MAX])
            want = int(lo[:, 1].sum())
            got = self._libc.process_vm_readv(self.pid, ctypes.c_void_p(lo.ctypes.data), len(lo),
                                              ctypes.c_void_p(re.ctypes.data), len(re), 0)
            if got != want:
                raise OSError(f"process_vm_readv read {got} of {want} bytes (errno {ctypes.get_errno()})")


def _digest(reader: _Reader, packs: list[tuple], entries: list[tuple]) -> list[list[int]]:
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
    flat, lanes = lanes[len(lanes) - len(spans):], lanes[: len(lanes) - len(spans)]
    other: list[list[int]] = []
    if strided:
        buf, starts = reader.read([(d[0], d[1]) for d in strided])
        views = []
        for (_, span, dtype, shape, stride), at in zip(strided, starts):
            typed = buf[at: at + span].view(getattr(torch, dtype))
            views.append(typed.as_strided(shape, stride))
        other = lanes_packed((), views)
    return lanes + [flat[i] if i >= 0 else other[~i] for i in order]


def _child(sock: socket.socket, pid: int) -> None:
    torch.set_num_threads(1)  # one core: the training process has the others
    reader = _Reader(pid)
    writer: StreamWriter | None = None
    error: str | None = None  # of opening or writing the stream: reported with the next reply
    held: tuple | None = None  # a digested batch waiting for W or X

    def write(b: _Columns, pack_sizes: list[int], lanes: list[list[int]]) -> None:
        nonlocal error
        try:
            write_lanes(writer, b, pack_sizes, lanes)
        except Exception:  # reported with the next reply
            error = traceback.format_exc()

    while True:
        try:
            kind, payload = _recv(sock)
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
                packs, entries, *fields, deferred = marshal.loads(payload)
                done = (_Columns(tuple(fields)), [len(nbytes) for _, _, nbytes in packs],
                        _digest(reader, packs, entries))
                if deferred:  # live tensors: written once the training process saw them unchanged
                    held = done
                else:
                    write(*done)
                _send(sock, b"R")
            except Exception:
                error = None
                if os.getppid() != pid:
                    break  # the training process is gone (it failed, or was killed): nothing to tell it
                _send(sock, b"E", traceback.format_exc().encode())
        elif kind in (b"W", b"X"):
            if kind == b"W" and held is not None:
                write(*held)
            held = None
        elif kind == b"C":
            if writer is not None:
                writer.close()
                writer = None
            if error is not None:
                _send(sock, b"E", error.encode())
                error = None
            else:
                _send(sock, b"K")
        elif kind == b"Q":
            break
    if writer is not None:
        writer.close()
