"""The process worker: digests a flushed batch in a child process with its own interpreter (CPU tensors).

The child copies the batch's tensors out of the training process's memory itself
(``process_vm_readv``, which needs the right to trace the parent: the child checks first), so the
training thread only describes them (addresses, shapes, strides) and sends the record columns
(wire.py). It spares the training thread the interpreter lock that a thread worker's Python code would
take from it. The child checksums the state tensors itself (``xxh3-128``: host memory only), so it shares
no pass with the receipts, which hash them again on their thread in this process. The recorder keeps
every tensor of a batch alive until the child has read it; a batch with live tensors that must stay
unchanged (``copy="checked"``) is written only once the training thread has seen them unchanged (W), or
discarded (X).

If the training process dies, the child sees the socket close and exits after the messages it has: as
with a thread, a batch in flight may be lost, and every batch written before it reads back.
"""

from __future__ import annotations

import ctypes
import json
import marshal
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import torch

from samestep.digests import ROW_BYTES, rows_of
from samestep.hashing.state import tensor_header
from samestep.tracing.batch import Batch
from samestep.tracing.wire import describe, frame, recv, send
from samestep.tracing.writer import plain

__all__ = ["ProcessWorker"]

# The child's first word: whether it may read this process's memory (process_vm_readv needs the right
# to trace it, which a container or a security module can deny). Runs before torch is imported. The
# child ignores the signals that stop a run (a Ctrl-C or a scheduler's signal reaches a whole process
# group): it follows the trainer's stop, ending when the trainer closes the socket or dies.
_PROBE = """
import signal
for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
import ctypes, socket, sys
fd, pid, addr, n = map(int, sys.argv[1:5])
sock = socket.socket(fileno=fd)
buf = ctypes.create_string_buffer(n)
iov = (ctypes.c_void_p * 4)(ctypes.addressof(buf), n, addr, n)
libc = ctypes.CDLL(None, use_errno=True)
got = libc.process_vm_readv(pid, ctypes.byref(iov, 0), 1, ctypes.byref(iov, 16), 1, 0)
sock.sendall(buf.raw if got == n else b"errno %d" % ctypes.get_errno())
if got == n:
    from samestep.tracing.process_child import serve
    serve(sock, pid)
"""


def _forget_in_child(ref: weakref.ref) -> None:
    """In a process forked from the trainer (a DataLoader worker, say): close its copy of the socket, or
    the digest worker would see the trainer's death only when that process ends too."""
    worker = ref()
    if worker is not None:
        worker._sock.close()
        worker._pending = worker._unwritten = False
        worker._verdict = b""


def _described(tensors: list, known: dict[int, list[tuple]], entry: Any) -> list[tuple]:
    """Each of ``tensors``'s ``entry``, where ``known`` (first index -> entries from there) has none."""
    out: list[tuple] = []
    done = 0
    for first, given in sorted(known.items()):
        out += map(entry, tensors[done:first])
        out += given
        done = first + len(given)
    out += map(entry, tensors[done:])
    return out


class ProcessWorker:
    """Digests in a child process, which reads the tensors from this process's memory (CPU only)."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        token = os.urandom(16)
        probe = ctypes.create_string_buffer(token, len(token))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _PROBE,
                    str(child.fileno()),
                    str(os.getpid()),
                    str(ctypes.addressof(probe)),
                    str(len(token)),
                ],
                pass_fds=[child.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            child.close()
        self._sock = parent
        os.register_at_fork(after_in_child=lambda ref=weakref.ref(self): _forget_in_child(ref))
        self._pending = False  # a batch is being digested
        self._keep: list[torch.Tensor] = []  # plain forms of its live tensors (see _payload)
        self._unwritten = False  # a digested batch waits for W or X
        self._verdict = b""  # W or X, sent ahead of the next message (see commit)
        try:
            answer = parent.recv(64)
        except OSError:
            answer = b""
        if answer != token:
            parent.close()
            self._proc.wait()
            why = answer.decode(errors="replace") or f"it exited with status {self._proc.returncode}"
            raise OSError(
                f"the trace worker process cannot read this process's memory ({why}; process_vm_readv "
                "needs the right to trace it): use trace.worker=thread"
            )

    def _gone(self) -> RuntimeError:
        try:
            status = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        return RuntimeError(
            f"trace: the digest worker process exited (status {status}); its error, if any, is on stderr"
        )

    def _post(self, kind: bytes, payload: bytes = b"") -> None:
        data, self._verdict = self._verdict + frame(kind, payload), b""
        try:
            self._sock.sendall(data)
        except OSError:
            raise self._gone() from None

    def open(self, path: Path, meta: dict[str, Any]) -> None:
        self._post(b"O", marshal.dumps((str(path), json.dumps(meta))))

    def submit(self, b: Batch, events: list) -> None:
        keep: list[torch.Tensor] = []
        self._post(b"B", self._payload(b, keep))
        self._keep = keep  # the child reads these until it replies
        self._pending, self._unwritten = True, bool(b.check_live)

    @staticmethod
    def _payload(b: Batch, keep: list[torch.Tensor]) -> bytes:
        """A batch as the child reads it: where each staged tensor lies, and the record columns. A live
        tensor the child cannot read as it lies (a conjugate view, a sparse or a strided quantized one) is
        described by its plain form, taken now and added to ``keep``; a change since it was recorded is
        still caught by its version. Spans of ``tensors`` that ``b.described`` holds descriptions of (a
        gradient plan's: see step_level.GradPlan), and of ``hashed`` that ``b.hashed_described`` holds (a
        state plan's, with each one's checksum header), are not described again."""
        packs = [(p.buf.data_ptr(), sum(rows_of(n) for n in p.nbytes) * ROW_BYTES, p.nbytes) for p in b.packs]

        def entry(t: Any) -> tuple:
            if not isinstance(t, torch.Tensor):
                size = t[0].element_size()  # a contiguous copy, read as bytes: the pieces too
                return describe(t[0]), [n * size for n in t[1]], t[2]
            try:
                return describe(t)
            except ValueError:
                if not t.is_cpu:
                    raise
                keep.append(plain(t))
                return describe(keep[-1])

        def state_entry(t: torch.Tensor) -> tuple:
            kept = len(keep)
            desc = entry(t)
            if len(keep) > kept:  # described by its plain form: checksummed under that one's header
                t = keep[-1]
            return desc, tensor_header(t.dtype, tuple(t.shape))

        entries = _described(b.tensors, b.described, entry)
        hashed = _described(b.hashed, b.hashed_described, state_entry)
        return marshal.dumps((packs, entries, b.wire(), bool(b.check_live), hashed))

    def _reply(self) -> bytes:
        try:
            kind, payload = recv(self._sock)
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
        were read), else discarded. The verdict goes ahead of the next message (the next batch, a sync, a
        close), in the same send: one system call a step fewer. ``sync`` and ``close`` send it, so what
        they promise is unchanged."""
        if self._unwritten:
            self._unwritten = False
            self._verdict = frame(b"W" if write else b"X")

    def sync(self) -> None:
        """Waits for every batch submitted and committed so far to be written, then has the child make it
        durable."""
        self.wait()
        self._post(b"S")
        self._reply()

    def close(self) -> None:
        try:
            self.wait()
            self._post(b"C")
            self._reply()
        finally:
            try:
                send(self._sock, b"Q")
            except OSError:
                pass
            self._sock.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
