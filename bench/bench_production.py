"""Production benchmark: everything samestep's default turns on, against plain PyTorch, side by side.

    .venv/bin/python bench/bench_production.py [--preset small] [--set K=V ...] [--pairs 9] [--steps 4] [--trace]
        [--json]
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2 bench/bench_production.py [--json]

The sides are copies of the reference run (or ``--preset``) in one process (one per rank), taking blocks of
``--steps`` steps in turn, their order rotated each round, so the machine's noise hits them alike:

- ``plain``: PyTorch's defaults (no ``samestep.enable``), plain ``.grad`` accumulation; on several
  processes DDP's all-reduce with ``no_sync()`` on all but the last microbatch (bench_layout.py's step);
- ``deterministic``: deterministic mode and the canonical reduction (``samestep train``'s step);
- ``+receipts``: and a receipt of every step (``receipt_writer.ReceiptWriter``, the state checksum on its thread);
- ``+cross_rank`` (several processes): and the cross-rank check (every rank's sums, all-gathered);
- ``production``: all of them, what ``samestep train`` runs by default;
- with ``--trace``, ``production+trace``: and the step-level trace (``trace.level=step``), its state records
  taken from the receipts' pass (``checksums.StepChecksums``), as ``samestep train`` shares it; and
  ``production+trace apart``, the control: the recorder with a pass of its own, which hashes the state again.

Every side pins one intra-op thread (the bits depend on it). Reported on rank 0: each side's median step
time and process CPU time per step (all threads: what a feature takes from the machine, whatever the core
count), the median of per-round ratios to ``plain`` and of each feature to ``deterministic``, and the state
checksum's cost per byte.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import samestep
from samestep.hashing.checksums import Checksums
from samestep.hashing.state import flatten
from samestep.loop.data import load_corpus
from samestep.records.receipt_writer import ReceiptWriter
from samestep.records.receipts import genesis
from samestep.train import load_config
from samestep.train.checks import CrossRankCheck
from samestep.train.loop import build

sys.path.insert(0, str(Path(__file__).parent))
from bench_layout import ddp_step  # noqa: E402  (the DDP user's step, as bench_layout times it)


class Side:
    """One side: a trainer and the features on it."""

    def __init__(
        self, name: str, preset: str | None, settings: list[str], corpus, world: int, rank: int, tmp: Path
    ) -> None:
        import torch.distributed as dist

        self.name = name
        deterministic = name != "plain"
        traced = "+trace" in name
        cfg = load_config(
            None,
            [
                *settings,
                *([] if deterministic else ["determinism.enabled=false"]),
                *(["trace.level=step"] if traced else []),
            ],
            preset=preset,
        )
        self.parts = build(cfg, world=world, rank=rank, corpus=corpus, run_dir=tmp / name if traced else None)
        self.ddp = None
        if not deterministic and world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.ddp = DDP(self.parts.model, broadcast_buffers=False)
        receipts = name in ("+receipts", "production") or traced
        cross = world > 1 and (name in ("+cross_rank", "production") or traced)
        self.writer = self.check = None
        if receipts or cross:
            keeps = receipts and rank == 0
            self.writer = ReceiptWriter(tmp / name if keeps else None, rank, genesis(cfg.to_dict(), corpus.fingerprint))
            self.writer.watch(self.parts.optimizer)
            if name == "production+trace":  # as RunProtocol.adopt shares it
                self.parts.recorder.checksums = self.writer.shared
        if cross:
            self.parts.reduced = []
            self.check = CrossRankCheck(self.writer, torch.device("cpu"), tmp, "stop")
            self.check.watch(self.parts.optimizer)
        self.deterministic = deterministic
        self.barrier = dist.barrier if world > 1 else (lambda: None)
        self.times: list[float] = []
        self.cpu: list[float] = []

    def block(self, start: int, steps: int) -> None:
        mode = samestep.enable(threads=1) if self.deterministic else contextlib.nullcontext()
        with mode:
            torch.set_num_threads(1)
            self.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for s in range(start, start + steps):
                if self.ddp is not None:
                    ddp_step(self.parts, self.ddp, s)
                    continue
                loss, norm, _ = self.parts.step(s)
                if self.writer is not None:
                    sums = {"grads": self.parts.reduced, "params": self.parts.named_params} if self.check else None
                    self.writer.add(
                        s + 1, self.parts.receipt_state(s + 1) if self.writer.path else None, loss, norm, sums
                    )
            if self.writer is not None:
                self.writer.wait()  # the block's last receipt is in its time
            self.parts.recorder.flush()  # and the last trace batch's digests (nothing to wait for untraced)
            self.barrier()
            self.times.append((time.perf_counter() - t0) / steps)
            self.cpu.append((time.process_time() - c0) / steps)

    def close(self) -> None:
        if self.check is not None:
            self.check.final()
            self.check.close()
        if self.writer is not None:
            self.writer.close()
        self.parts.recorder.close()


def checksum_cost(parts, repeats: int = 20) -> dict:
    """The state checksum's time per byte over the trainer's state (one pass, as the receipt thread makes it)."""
    named: dict[str, torch.Tensor] = {}
    flatten(parts.receipt_state(1)(), "state", named)
    tensors = list(named.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        Checksums().of(tensors)
        best = min(best, time.perf_counter() - t0)
    return {"state_bytes": nbytes, "ms": round(1000 * best, 3), "ns_per_byte": round(1e9 * best / nbytes, 4)}


def run(preset: str | None, settings: list[str], pairs: int, steps: int, trace: bool = False) -> dict:
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    corpus = load_corpus("stdlib")
    names = [
        "plain",
        "deterministic",
        "+receipts",
        *(["+cross_rank"] if world > 1 else []),
        "production",
        *(["production+trace", "production+trace apart"] if trace else []),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        sides = [Side(n, preset, settings, corpus, world, rank, Path(tmp)) for n in names]
        for r in range(pairs + 1):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                side.block(r * steps, steps)
            if r == 0:  # the first round warms the allocator and caches
                for side in sides:
                    side.times.clear()
                    side.cpu.clear()
                    if side.writer is not None:
                        side.writer.cpu_seconds = 0.0
        for side in sides:
            side.close()
    by = {s.name: s for s in sides}
    result = {
        "preset": preset or "reference",
        "settings": settings,
        "world_size": world,
        "pairs": pairs,
        "steps_per_side": steps,
        "params": sum(p.numel() for p in by["plain"].parts.model.parameters()),
        "sides": {},
    }
    for s in sides:
        entry = {
            "step_ms": round(1000 * statistics.median(s.times), 2),
            "cpu_ms_per_step": round(1000 * statistics.median(s.cpu), 2),
            "vs_plain": round(statistics.median(a / b for a, b in zip(s.times, by["plain"].times)), 4),
        }
        if s.name not in ("plain", "deterministic"):
            entry["vs_deterministic"] = round(
                statistics.median(a / b for a, b in zip(s.times, by["deterministic"].times)), 4
            )
            entry["cpu_ms_over_deterministic"] = round(
                1000 * (statistics.median(s.cpu) - statistics.median(by["deterministic"].cpu)), 2
            )
            entry["receipt_thread_cpu_ms_per_step"] = round(1000 * s.writer.cpu_seconds / (pairs * steps), 3)
        if "+trace" in s.name:
            entry["vs_production"] = round(statistics.median(a / b for a, b in zip(s.times, by["production"].times)), 4)
        result["sides"][s.name] = entry
    result["checksum"] = checksum_cost(by["deterministic"].parts)
    if world > 1:
        dist.destroy_process_group()
    return result if rank == 0 else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None)
    ap.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="K=V",
        help="a config setting for every side (e.g. train.global_batch=32)",
    )
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--trace", action="store_true", help="also production with the step-level trace (and its control)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = run(args.preset, args.settings, args.pairs, args.steps, args.trace)
    if not result:
        return 0
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{result['preset']} {' '.join(result['settings'])} ({result['params']:,} parameters), "
        f"{result['world_size']} process(es), median of "
        f"{result['pairs']} rounds of {result['steps_per_side']} steps a side:"
    )
    for name, e in result["sides"].items():
        extra = (
            f", {e['vs_deterministic']:.4f}x of deterministic (+{e['cpu_ms_over_deterministic']} CPU ms; "
            f"receipt thread {e['receipt_thread_cpu_ms_per_step']} CPU ms)"
            if "vs_deterministic" in e
            else ""
        )
        extra += f", {e['vs_production']:.4f}x of production" if "vs_production" in e else ""
        print(
            f"  {name:23s} {e['step_ms']:8.2f} ms a step, {e['cpu_ms_per_step']:8.2f} CPU ms; "
            f"{e['vs_plain']:.4f}x of plain{extra}"
        )
    c = result["checksum"]
    print(f"  state checksum: {c['state_bytes']:,} bytes in {c['ms']} ms ({c['ns_per_byte']} ns a byte)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
