"""The process worker's wire protocol: framed messages on a socket, and where a tensor's bytes lie.

A message is a header (kind, payload bytes) and the payload. To the child: O open the stream (path,
meta as JSON), B a batch (reply R when digested, or E and the error), W write the last batch / X
discard it (its live tensors changed), S make what is written durable (reply K, or E), C close the
stream (reply K, or E), Q quit. A batch's payload is ``marshal`` data (plain numbers, strings and
bytes: loading it runs no code): the packs, a description of each staged tensor (``describe``), the
record columns in ``Columns.WIRE`` order, whether it holds live tensors that must be seen
unchanged before it is written, and the state tensors' (description, checksum header) pairs.
"""

from __future__ import annotations

import socket
import struct

import torch

__all__ = ["HEAD", "describe", "describe_all", "frame", "recv", "send"]

HEAD = struct.Struct("<cQ")


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    """One message as sent: its kind (one byte), its payload's length, and the payload."""
    return HEAD.pack(kind, len(payload)) + payload


def send(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    """One message: its kind (one byte) and payload."""
    sock.sendall(frame(kind, payload))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise EOFError
        got += k
    return bytes(buf)


def recv(sock: socket.socket) -> tuple[bytes, bytes]:
    """The next message's kind and payload (EOFError once the other end is gone)."""
    kind, n = HEAD.unpack(_recv_exact(sock, HEAD.size))
    return kind, _recv_exact(sock, n) if n else b""


def _span(t: torch.Tensor) -> int:
    """The bytes from ``t``'s first element to the end of its last (all of its elements lie within)."""
    if not t.numel():
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def describe(t: torch.Tensor) -> tuple:
    """Where the child finds ``t``'s bytes: (address, bytes) for a plain contiguous tensor (its digest
    depends only on its row-major bytes, the header aside: read as uint8), else (address, span, dtype,
    shape, strides)."""
    if t.is_cpu and t.layout == torch.strided:
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()):  # quantized, nested: their bytes as they lie
            return t.data_ptr(), t.nbytes
        if not (t.is_conj() or t.is_neg() or t.is_quantized or t.is_nested):
            return t.data_ptr(), _span(t), str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride()
    raise ValueError(
        f"trace.worker=process digests dense CPU tensors only, got one ({t.layout}, on {t.device}, "
        f"conjugate or negative bit {t.is_conj() or t.is_neg()}); use trace.worker=thread "
        "(samestep.trace(..., worker='thread'))"
    )


def describe_all(tensors: list[torch.Tensor]) -> list[tuple] | None:
    """Each tensor's ``describe``, or None if one of them is not read where it lies."""
    try:
        return [describe(t) for t in tensors]
    except ValueError:
        return None


# The child's first word: whether it may read this process's memory (process_vm_readv needs the right
