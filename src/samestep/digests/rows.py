"""The digest's first level on a device: rows of 256 words hashed into 4 lanes, exactly.

Every partial sum of ``sum_j word_j * W[j, lane]`` is an integer below 2**51, so computing the rows
with a float64 matrix product is exact whatever order BLAS (or cuBLAS) adds in; where the device has
an int8 matrix product (``torch._int_mm``), the same sums are computed from 7-bit digits of the weights
in int32, exactly too, and faster. On a GPU with Triton, one fused kernel (``triton_rows``) does it.
Every path gives the same lanes.
"""

from __future__ import annotations

import importlib.util
import threading
import warnings

import torch

from samestep.digests.spec import COLS, PRIMES, weight_table

__all__ = ["BLOCK_ROWS", "GPU_BLOCK_ROWS", "TRITON", "lanes", "level", "weights", "words"]

# Rows hashed at a time. On CPU a block stays in cache between its passes; on a GPU each pass is a kernel
# launch, so blocks are large (bench/gpu_check.py times both). The digest does not depend on the block size.
BLOCK_ROWS = 4096
GPU_BLOCK_ROWS = 65536
_weights_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device not in _weights_cache:
        w = torch.tensor(weight_table(), dtype=torch.float64, device=device)  # (256, 4)
        p = torch.tensor(PRIMES, dtype=torch.int64, device=device)
        _weights_cache[device] = (w, p)
    return _weights_cache[device]


# The int8 form of the same product, for torch._int_mm: a word x (int16) is stored as the bytes
# (lo, hi); flipping bit 7 of lo makes both bytes signed int8 with x = 256*hi + lo' + 128. Modulo p, byte
# column 2j carries weight W[j] and column 2j+1 weight 256*W[j] mod p (both below 2**28); each weight is cut
# into 4 base-128 digits, so every int8 x int8 product sum stays below 2**23 in int32. A float64 product
# with the digit scales (every partial sum an integer below 2**46, so exact) recombines the digits.
_DIGITS = 4
_int_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}


def _int_weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if device not in _int_cache:
        table = weight_table()
        lanes = len(PRIMES)
        digits = torch.tensor(
            [
                [(value >> (7 * q)) & 0x7F for value in values for q in range(_DIGITS)]
                for j in range(COLS)
                for values in (
                    [table[j][lane] for lane in range(lanes)],  # low byte of word j
                    [(table[j][lane] << 8) % p for lane, p in enumerate(PRIMES)],
                )
            ],
            dtype=torch.int8,
        )  # (512, 16): row 2j low byte, row 2j+1 high byte
        scale = torch.tensor([float(1 << (7 * q)) for q in range(_DIGITS)], dtype=torch.float64)
        const = torch.tensor(
            [128 * sum(table[j][lane] for j in range(COLS)) % p for lane, p in enumerate(PRIMES)], dtype=torch.int64
        )
        entry = (digits.to(device), scale.to(device), const.to(device))
        try:  # the int8 matrix product is missing on some builds and devices: then float64 does it
            probe = torch._int_mm(torch.zeros(32, 2 * COLS, dtype=torch.int8, device=device), entry[0])
            entry = entry if probe.dtype == torch.int32 else None
        except (RuntimeError, AttributeError, NotImplementedError):
            entry = None
        _int_cache[device] = entry
    return _int_cache[device]


# "auto": the fused Triton kernel (digest_triton) hashes the rows of CUDA tensors when Triton is
# installed; "off" never; "on" always (CPU tensors then need TRITON_INTERPRET=1: tests compare the paths).
# Every path gives the same lanes, so a device where the kernel fails falls back with a warning.
TRITON = "auto"
_HAVE_TRITON = importlib.util.find_spec("triton") is not None
_TRITON_DEVICE_TYPES = ("cuda",)  # where "auto" uses it (a test adds "cpu", with the kernel replaced)
_triton_failed: set[torch.device] = set()


def _use_triton(device: torch.device) -> bool:
    if TRITON == "auto":
        return device.type in _TRITON_DEVICE_TYPES and _HAVE_TRITON and device not in _triton_failed
    return TRITON == "on"


def _triton_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """The fused kernel's lanes of the full rows ``x`` into ``out``; False (and a warning, once per
    device) if it cannot run there, in "auto" mode."""
    try:
        from samestep.digests.triton_rows import level_rows

        level_rows(x, w, out)
        return True
    except Exception as e:  # a Triton or driver that cannot build or run it: the other paths give the same lanes
        if TRITON != "auto":
            raise
        _triton_failed.add(x.device)
        warnings.warn(
            f"samestep.digest: the Triton kernel failed on {x.device} ({type(e).__name__}: "
            f"{str(e).strip()[:300]}); using the PyTorch path there (same digests)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False


_local = threading.local()


def _scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-thread buffers for one block of the int8 path (reused: a fresh multi-MB buffer per block
    costs its page faults every time)."""
    cache = _local.__dict__.setdefault("scratch", {})
    rows = _block_rows(device)
    if (device, rows) not in cache:
        cache[(device, rows)] = (
            torch.empty(rows, COLS, dtype=torch.int16, device=device),
            torch.empty(rows, len(PRIMES) * _DIGITS, dtype=torch.int32, device=device),
            torch.empty(rows, len(PRIMES) * _DIGITS, dtype=torch.float64, device=device),
        )
    return cache[(device, rows)]


def _block_rows(device: torch.device) -> int:
    return BLOCK_ROWS if device.type == "cpu" else GPU_BLOCK_ROWS


def words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 1-D signed 16-bit words (a zero byte pads an odd count)."""
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()  # a conjugate view's values
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    b = flat.view(torch.uint8)
    if b.numel() % 2:
        b = torch.cat([b, b.new_zeros(1)])
    return b.view(torch.int16)


def level(words: torch.Tensor, w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Hashes rows of 256 words into (rows, 4) int64 lane values below 2**28 (a short last row is zero-padded)."""
    n = words.numel()
    full, rem = divmod(n, COLS)
    rows = full + (1 if rem or not n else 0)
    out = torch.empty(rows, len(PRIMES), dtype=torch.int64, device=words.device)
    if full:
        x = words[: full * COLS].view(full, COLS)
        if not (_use_triton(words.device) and _triton_rows(x, w, out[:full])):  # the kernel reduces mod p itself
            _torch_rows(x, w, out[:full])
    if rows > full:
        tail = torch.zeros(1, COLS, dtype=torch.float64, device=words.device)
        tail[0, :rem].copy_(words[full * COLS :])
        out[full:] = torch.mm(tail, w).to(torch.int64)
    return torch.remainder(out, p)


def _torch_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The lanes (before the remainder) of the full rows ``x`` ((rows, 256) int16) into ``out``, by the
    int8 product where the device has one, else by float64 products."""
    full = x.shape[0]
    fast = _int_weights(x.device) if full >= 32 else None
    if fast is not None:
        digits, scale, const = fast
        lanes = torch.empty(full * len(PRIMES), dtype=torch.float64, device=x.device)
        signed, acc, accf = _scratch(x.device)
        step = _block_rows(x.device)
        for a in range(0, full, step):  # on CPU, blocks stay in cache between the three passes
            b = min(a + step, full)
            m = max(32, b - a)  # torch._int_mm wants at least 32 rows: zero words pad the rest
            if b - a < 32:
                signed[b - a : 32].zero_()
            torch.bitwise_xor(x[a:b], 0x80, out=signed[: b - a])  # lo', hi per word: 512 int8 per row
            torch._int_mm(signed[:m].view(torch.int8), digits, out=acc[:m])  # (rows, 16) int32, exact
            accf[: b - a].copy_(acc[: b - a])
            torch.mv(accf[: b - a].view(-1, _DIGITS), scale, out=lanes[a * len(PRIMES) : b * len(PRIMES)])
        torch.add(lanes.view(full, len(PRIMES)).to(torch.int64), const, out=out)
    else:
        block = min(full, _block_rows(x.device))
        buf = torch.empty(block, COLS, dtype=torch.float64, device=x.device)
        res = torch.empty(block, len(PRIMES), dtype=torch.float64, device=x.device)
        for a in range(0, full, block):
            b = min(a + block, full)
            buf[: b - a].copy_(x[a:b])
            torch.mm(buf[: b - a], w, out=res[: b - a])
            out[a:b] = res[: b - a].to(torch.int64)


def lanes(t: torch.Tensor) -> torch.Tensor:
    """The 4 final lanes of one tensor's bytes, level by level (the plain path: ``lanes.lanes_packed``
    batches many tensors)."""
    w, p = weights(t.device)
    h = level(words(t), w, p)
    while h.shape[0] > 1:
        h = level(torch.stack((h & 0x3FFF, h >> 14), dim=-1).reshape(-1), w, p)
    return h[0]
