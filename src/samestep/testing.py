"""Byte-for-byte kernel testing, as a pytest plugin (registered by entry point ``pytest11``).

    from samestep.testing import assert_replays_bit_exact, count_differing_replays

    def test_my_kernel():
        assert_replays_bit_exact(my_kernel, x, idx, replays=8, contention=True)

    def test_torch_default_races():                      # the negative control
        assert count_differing_replays(torch_kernel, x, idx, replays=8) > 0

    def test_bits_do_not_move_across_upgrades(golden):   # digests pinned per environment
        golden.check("my_kernel", my_kernel(x, idx))

Bits are compared as integers (signed zeros and NaN payloads included), never with a tolerance.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["Golden", "assert_replays_bit_exact", "count_differing_replays", "first_difference"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(_INT_VIEW[t.element_size()]) if t.dtype.is_floating_point else t


def _outputs(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (list, tuple)):
        return [t for r in result for t in _outputs(r)]
    if isinstance(result, dict):
        return [t for k in sorted(result) for t in _outputs(result[k])]
    return []


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """``None`` if bit-identical, else: how many elements differ, the first index, both values in hex."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape differ: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ba, bb = _bits(a).cpu(), _bits(b).cpu()
    diff = (ba != bb).reshape(ba.shape)
    if diff.dim() > ba.dim():
        diff = diff.any(-1)
    n = int(diff.sum())
    if not n:
        return None
    first = tuple(int(i) for i in diff.nonzero()[0])
    va, vb = a.detach()[first], b.detach()[first]
    hex_a = va.item().hex() if a.is_floating_point() else hex(int(_bits(va.reshape(1))[0]))
    hex_b = vb.item().hex() if b.is_floating_point() else hex(int(_bits(vb.reshape(1))[0]))
    return f"{n} of {a.numel()} elements differ; first at index {first}: {hex_a} vs {hex_b}"


def _clone(x: Any) -> Any:
    """A layout-preserving clone (same strides), so the kernel sees what it saw the first time."""
    if isinstance(x, torch.Tensor):
        out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
        out.copy_(x.detach())
        return out.requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


class _Contention:
    """Competing work on another thread (and a side stream on GPU) while the kernel runs."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.stop = device, threading.Event()
        self.thread = threading.Thread(target=self._work, daemon=True)

    def _work(self) -> None:
        a = torch.randn(256, 256, device=self.device)
        stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        while not self.stop.is_set():
            if stream is not None:
                with torch.cuda.stream(stream):
                    a = (a @ a).tanh_()
            else:
                a = (a @ a).tanh_()

    def __enter__(self) -> _Contention:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def _device(inputs: Sequence[Any]) -> torch.device:
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _replay(fn: Callable[..., Any], inputs: Sequence[Any], replays: int, contention: bool) -> list[list[torch.Tensor]]:
    runs = []
    for i in range(replays):
        # Replays alternate with and without competing work: a race shows up when timing changes.
        if contention and i % 2:
            with _Contention(_device(inputs)):
                runs.append([t.detach().clone() for t in _outputs(fn(*_clone(list(inputs))))])
        else:
            runs.append([t.detach().clone() for t in _outputs(fn(*_clone(list(inputs))))])
    return runs


def assert_replays_bit_exact(fn: Callable[..., Any], *inputs: Any, replays: int = 6, contention: bool = True) -> None:
    """Runs ``fn`` on fresh clones of ``inputs`` ``replays`` times and requires bit-identical outputs.

    Raises:
        AssertionError: names the output, how many elements differ, the first index and both values in hex.
    """
    runs = _replay(fn, inputs, replays, contention)
    first = runs[0]
    for r, outs in enumerate(runs[1:], start=1):
        if len(outs) != len(first):
            raise AssertionError(f"replay {r} returned {len(outs)} tensors, replay 0 returned {len(first)}")
        for k, (a, b) in enumerate(zip(first, outs)):
            problem = first_difference(a, b)
            if problem is not None:
                raise AssertionError(f"output {k} of replay {r} differs from replay 0: {problem}")


def count_differing_replays(
    fn: Callable[..., Any], *inputs: Any, replays: int = 6, contention: bool = True, attempts: int = 1
) -> int:
    """How many replays differ from the first (for negative controls: a racy kernel gives > 0). With
    ``attempts`` > 1, sets of ``replays`` run until one differs, at most ``attempts`` of them: on a busy
    machine a race may not show in one set."""
    for _ in range(attempts):
        runs = _replay(fn, inputs, replays, contention)
        differing = sum(any(first_difference(a, b) is not None for a, b in zip(runs[0], outs)) for outs in runs[1:])
        if differing:
            return differing
    return 0


# Fields of the environment fingerprint that decide a kernel's bits.
GOLDEN_ENV_FIELDS = (
    "python.version",
    "torch.version",
    "torch.git",
    "torch.cpu_capability",
    "torch.blas",
    "cpu.model",
    "cuda.version",
    "cuda.gpu0",
    "platform.system",
)


class Golden:
    """Digests pinned in a JSON file, per environment: a library upgrade that moves a kernel's bits fails.

    Recording is an explicit action (``update``, the plugin's ``--samestep-update-golden``): where this
    environment has no digests pinned for a name, ``check`` compares nothing, so it calls ``missing`` with a
    line naming the environment and the fix (the fixture skips the test with it; by default an AssertionError).
    """

    def __init__(self, path: Path, update: bool, missing: Callable[[str], Any] | None = None) -> None:
        from samestep.determinism.env import environment

        self.path, self.update = path, update
        self.missing = missing if missing is not None else _fail
        env = environment()
        fields = {k: env.get(k) for k in GOLDEN_ENV_FIELDS}
        self.env_key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        self.fields = fields
        self.data = (
            _read_golden(path) if path.exists() else {"format": "samestep.golden", "version": 1, "environments": {}}
        )
        self.dirty = False

    def check(self, name: str, result: Any) -> None:
        """Compares the digests of ``result``'s tensors with the ones pinned for this environment (with
        ``update``: records them)."""
        from samestep.digests import digest_many

        digests = digest_many(_outputs(result))
        if self.update:
            entry = self.data["environments"].setdefault(self.env_key, {"fields": self.fields, "digests": {}})
            entry["digests"][name] = digests
            self.dirty = True
            return
        pinned = self.data["environments"].get(self.env_key, {}).get("digests", {}).get(name)
        if pinned is None:
            about = ", ".join(
                f"{k}={self.fields[k]}"
                for k in ("torch.version", "torch.cpu_capability", "cpu.model", "cuda.gpu0")
                if self.fields[k] is not None
            )
            self.missing(
                f"golden {name!r} in {self.path}: no digests pinned for this environment ({self.env_key}: "
                f"{about}), so nothing is compared; record them with --samestep-update-golden"
            )
            return
        if pinned != digests:
            raise AssertionError(
                f"golden {name!r} in {self.path}: digests {digests} differ from the pinned {pinned} for this "
                f"environment ({self.env_key}); if the change is intended (a library upgrade), rerun with "
                "--samestep-update-golden"
            )

    def save(self) -> None:
        if self.dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=1, sort_keys=True) + "\n")


def _fail(line: str) -> None:
    raise AssertionError(line)


def _read_golden(path: Path) -> dict[str, Any]:
    """A golden file, refused unless it is a samestep.golden version 1 document."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{path}: not a samestep.golden file ({e}); delete it and record again with --samestep-update-golden"
        ) from None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != "samestep.golden"
        or doc.get("version") != 1
        or not isinstance(doc.get("environments"), dict)
    ):
        seen = (doc.get("format"), doc.get("version")) if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(
            f"{path}: not a samestep.golden version 1 document (format, version: {seen}); delete it "
            "and record again with --samestep-update-golden"
        )
    return doc


# -- pytest plugin -------------------------------------------------------------------------------------
def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("samestep")
    group.addoption("--samestep-update-golden", action="store_true", help="rewrite pinned golden digests")
    group.addoption("--samestep-golden-dir", default="tests/golden", help="where golden digest files live")


try:
    import pytest

    @pytest.fixture
    def golden(request: Any):
        """Pinned digests for this test module, keyed by environment (see ``Golden``); a test whose digests
        this environment has not pinned is skipped with the reason."""
        root = Path(request.config.rootpath) / request.config.getoption("--samestep-golden-dir")
        g = Golden(
            root / f"{request.module.__name__.rpartition('.')[2]}.json",
            request.config.getoption("--samestep-update-golden"),
            missing=pytest.skip,
        )
        yield g
        g.save()
except ImportError:  # pytest is a test extra; the helpers above work without it
    pass
