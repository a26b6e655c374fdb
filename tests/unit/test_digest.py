"""samestep.digest: the spec's test vectors, bit sensitivity, order sensitivity, exactness."""

from __future__ import annotations

import hashlib
import importlib
import struct

import pytest
import torch

import samestep.digests as digests
from samestep.digests import digest, digest_many
from samestep.digests.spec import PRIMES, weight_table

rows_module = importlib.import_module("samestep.digests.rows")

VECTORS = [
    (lambda: torch.tensor([], dtype=torch.float32), "508e9f911f0522e6a654cc11b9fc4100"),
    (lambda: torch.tensor(0.0), "d471c7dcb1eb36271dc4bd790d20689f"),
    (lambda: torch.tensor(-0.0), "2b5adc5da1f6fb34ece193cbe7e00be3"),
    (lambda: torch.arange(10), "3472752f3744052ae9215548dc2b10de"),
    (lambda: torch.arange(1000000, dtype=torch.float32), "4824aad8c7ecbf92b5942c03e6b24bcc"),
    (lambda: torch.tensor([True, False]), "a96bf39411af1e22d35cd9b19272d0df"),
    (lambda: torch.ones(3, dtype=torch.complex64), "7f51d7271bc1039f371eb5c15d20dfd3"),
    (lambda: torch.zeros(2, dtype=torch.float8_e4m3fn), "e8d18b2ca6772c31419947276cf50cae"),
    (lambda: torch.ones(2, 2, dtype=torch.bfloat16), "4e03f1a5ec7b8359b6e844de2c3b1a4b"),
]


@pytest.mark.parametrize("make,expected", VECTORS)
def test_vectors_from_the_spec(make, expected):
    """The digests pinned in docs/digest.md."""
    assert digest(make()) == expected


def _reference(t: torch.Tensor) -> str:
    """docs/digest.md in plain Python integers: no floats, no torch reductions."""
    flat = t.contiguous().reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    data = bytes(flat.view(torch.uint8).tolist())
    nbytes = len(data)
    if len(data) % 2:
        data += b"\0"
    words = list(struct.unpack(f"<{len(data) // 2}h", data))
    table = weight_table()
    while True:
        rows = max(1, -(-len(words) // 256))
        words += [0] * (rows * 256 - len(words))
        h = [
            [sum(words[r * 256 + j] * table[j][lane] for j in range(256)) % p for lane, p in enumerate(PRIMES)]
            for r in range(rows)
        ]
        if rows == 1:
            break
        words = [v for row in h for lane in row for v in (lane & 0x3FFF, lane >> 14)]
    d = hashlib.blake2b(digest_size=16, person=b"samestep.dgst.v1")
    d.update(f"{str(t.dtype).removeprefix('torch.')}|{','.join(map(str, t.shape))}|{nbytes}|".encode())
    d.update(struct.pack("<4I", *h[0]))
    return d.hexdigest()


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((3,), torch.float32),
        ((300, 300), torch.float32),
        ((17, 5), torch.float16),
        ((7,), torch.uint8),
        ((0, 4), torch.int32),
    ],
)
def test_matches_the_integer_reference(shape, dtype):
    """The float64-matmul implementation equals the spec computed with Python integers (multi-level too)."""
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(shape, generator=g) * 1e4).to(dtype)
    assert digest(t) == _reference(t)


def test_every_bit_dtype_and_shape_matter():
    """A flipped bit, a NaN payload, a dtype or a shape change the digest."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    base = digest(x)
    for i in (0, 500, 999):
        y = x.clone()
        y.view(torch.int32)[i] ^= 1
        assert digest(y) != base
    nan1 = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert digest(nan1) != digest(nan2)
    assert digest(x.view(torch.int32)) != base
    assert digest(x.view(10, 100)) != base


def test_order_sensitive_and_no_cancellation():
    """Permutations, repeated pairs and zeros of another length all differ. Negative control:
    torch.hash_tensor (an XOR) is blind to the permutation and zero for a repeated pair."""
    x = torch.arange(1, 65, dtype=torch.float32)
    perm = x.flip(0)
    assert digest(x) != digest(perm)
    pair = torch.tensor([3.5, 3.5])
    zeros = [digest(torch.zeros(n)) for n in (0, 1, 2, 512, 513)]
    assert len(set(zeros)) == 5 and digest(pair) != digest(torch.zeros(2))
    if hasattr(torch, "hash_tensor"):
        assert torch.equal(torch.hash_tensor(x), torch.hash_tensor(perm))
        assert int(torch.hash_tensor(pair)) == 0


def test_int8_and_float64_paths_agree_on_extreme_words(monkeypatch):
    """The int8 product (with its digit split and recombination) equals the float64 product on every
    word value, the extremes -32768 and 32767 included, across blocks and a short last block."""
    g = torch.Generator().manual_seed(4)
    rows = rows_module.BLOCK_ROWS + 40
    data = torch.randint(0, 256, (rows * 512 + 3,), dtype=torch.uint8, generator=g)
    data[:512] = 0x80  # words 0x8080 and
    data[512:1024] = 0x7F  # 0x7F7F, then all-ones and all-zeros rows
    data[1024:1536] = 0xFF
    data[1536:2048] = 0x00
    assert rows_module._int_weights(data.device) is not None  # this machine has the int8 product
    fast = digest(data)
    monkeypatch.setitem(rows_module._int_cache, data.device, None)
    assert digest(data) == fast
    data[5] ^= 1  # negative control: the comparison sees one flipped bit
    assert digest(data) != fast


def test_block_size_does_not_matter(monkeypatch):
    """Blocks of 4096 rows (CPU), 65536 (GPU) or 37 give the same digest, by both paths, across a short
    last block; a flipped bit still shows (negative control)."""
    data = torch.randn(300_001, generator=torch.Generator().manual_seed(9))  # 4688 rows and a short one
    ref = digest(data)
    for rows in (37, rows_module.GPU_BLOCK_ROWS):
        monkeypatch.setattr(rows_module, "BLOCK_ROWS", rows)
        assert digest(data) == ref
        with monkeypatch.context() as m:
            m.setitem(rows_module._int_cache, data.device, None)
            assert digest(data) == ref
    flipped = data.clone()
    flipped.view(torch.int32)[123_457] ^= 1
    assert digest(flipped) != ref


def test_layouts_and_thread_counts_do_not_matter():
    """Non-contiguous views digest like their contiguous copy; 1 and 2 threads agree."""
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(2))
    assert digest(x.t()) == digest(x.t().contiguous()) and digest(x[:, ::3]) == digest(x[:, ::3].contiguous())
    big = torch.randn(2_000_000, generator=torch.Generator().manual_seed(3))
    torch.set_num_threads(1)
    one = digest(big)
    torch.set_num_threads(2)
    assert digest(big) == one
    # conjugate and negative views digest like their values, small (packed) and past BIG_BYTES (in place)
    for n in (300, 600_000):
        z = torch.complex(torch.randn(n), torch.randn(n))
        assert digest(z.conj()) == digest(z.conj().resolve_conj()) != digest(z)
        assert digest(z.conj().imag) == digest(-z.imag) and z.conj().imag.is_neg()


def test_digest_many_equals_one_by_one():
    """Batched digests (one host copy) equal individual ones."""
    ts = [torch.randn(5), torch.arange(3), torch.tensor(True), torch.empty(0)]
    assert digest_many(ts) == [digest(t) for t in ts]


def test_batched_levels_equal_the_per_tensor_recursion():
    """The batched path (packing, pads, all segments' levels at once, tensors hashed in place) gives each
    tensor the lanes of the plain per-tensor recursion, for sizes around row and level boundaries."""
    g = torch.Generator().manual_seed(5)
    sizes = [0, 1, 255, 256, 257, 511, 512, 513, 256 * 32, 256 * 32 + 1, 256 * 33, 256 * 1024 + 7]
    ts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    ts += [
        torch.randn(300, 301, generator=g).t(),
        torch.randn(1_100_000, generator=g),  # a view; one hashed in place
        torch.randn(3, generator=g).to(torch.complex64),
        torch.tensor(7, dtype=torch.int16),
    ]
    ts += [torch.randn(25_000 + k, generator=g) for k in range(30)]  # several packing groups
    expected = [rows_module.lanes(t).tolist() for t in ts]
    assert digests.lanes_many(ts) == expected
    assert digests.lanes_many(ts[::-1]) == expected[::-1]
    packed = digests.Packed(
        torch.full((sum(digests.rows_of(t.numel()) for t in ts[:12]) * 512,), 0xAB, dtype=torch.uint8),
        [t.numel() for t in ts[:12]],
    )
    offset = 0
    for t in ts[:12]:  # pads start dirty (0xAB): lanes_packed zeroes them
        if t.numel():
            digests.pack_into(packed.buf, offset, t)
        offset += digests.rows_of(t.numel()) * 512
    assert digests.lanes_packed([packed], ts[12:]) == expected
    ts[9][-1] ^= 1  # negative control: one bit of one tensor
    assert digests.lanes_many(ts) != expected


def test_concurrent_digests_in_threads_match_serial_ones():
    """Digests computed at once on several threads (a trace worker thread and user code) equal the serial
    ones: each thread has its own scratch buffers. Negative control: another tensor, another digest."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(300_000 + 4096 * i, generator=g) for i in range(8)]
    serial = [digest(x) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(digest, xs)) == serial
    assert len(set(serial)) == len(serial)


def test_a_triton_kernel_that_fails_falls_back_with_a_warning(monkeypatch):
    """In "auto" mode a device where the fused kernel cannot run gets the PyTorch path (same digest) and
    one warning; with the kernel forced ("on") the failure is raised, not hidden."""
    import sys
    import types
    import warnings

    data = torch.randn(20_000, generator=torch.Generator().manual_seed(6))
    ref = digest(data)
    broken = types.ModuleType("samestep.digests.triton_rows")

    def level_rows(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    broken.level_rows = level_rows
    monkeypatch.setitem(sys.modules, "samestep.digests.triton_rows", broken)
    monkeypatch.setattr(rows_module, "_triton_failed", set())
    monkeypatch.setattr(rows_module, "_TRITON_DEVICE_TYPES", ("cpu",))  # "auto" tries the kernel here
    monkeypatch.setattr(rows_module, "_HAVE_TRITON", True)
    with pytest.warns(RuntimeWarning, match=r"Triton kernel failed on cpu \(RuntimeError: no kernel.*same digests"):
        assert digest(data) == ref
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per device
        assert digest(data) == ref
    monkeypatch.setattr(rows_module, "TRITON", "on")
    with pytest.raises(RuntimeError, match="no kernel image"):
        digest(data)
