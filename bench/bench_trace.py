"""Trace benchmarks: digest throughput, tracing overhead per level, and diff at scale.

    .venv/bin/python bench/bench_trace.py [--pairs 9] [--steps 8] [--levels step,module,op] [--own-share]
        [--recorder-calls]
        [--set KEY=VALUE] [--records 10000000] [--ranks 1024] [--device cpu|cuda] [--digest-triton auto|off]
        [--json]

All ratios are measured side by side in one run: the digest against a same-size tensor copy, each
trace level against the untraced step (alternating blocks of steps, median of per-pair ratios;
see trace_overhead), and the diff
timings on synthetic traces written by this script. With ``--device cuda`` the digest and the
training steps run on the GPU (every timing waits for the device); the diff runs on the host either way.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

import samestep
from samestep.analysis import diff_runs
from samestep.digests.rows import lanes
from samestep.loop.data import load_corpus
from samestep.tracing.stream import SCHEMA, StreamWriter, stream_path
from samestep.train import load_config
from samestep.train.loop import build


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def digest_throughput(threads: int, device: str = "cpu") -> dict:
    torch.set_num_threads(threads)
    out = {}
    sizes = (1 << 20, 1 << 24) if device == "cpu" else (1 << 20, 1 << 24, 1 << 28)
    for n in sizes:
        x = torch.randn(n, device=device)
        lanes(x)
        ratios = []
        for _ in range(5):
            _sync(device)
            t0 = time.perf_counter()
            x.clone()
            _sync(device)
            t1 = time.perf_counter()
            lanes(x)
            _sync(device)
            t2 = time.perf_counter()
            ratios.append((t1 - t0) / (t2 - t1))
        out[f"{n * 4 // (1 << 20)}MiB"] = round(statistics.median(ratios), 3)
    return {"device": device, "threads": threads, "digest_over_copy_throughput": out}


def median_ci(ratios: list[float], rounds: int = 2000) -> list[float]:
    """A 95% bootstrap interval of the median of per-pair ratios (pairs resampled with replacement, a
    fixed seed): how far this machine's noise lets one run pin the median down."""
    rng = np.random.default_rng(0)
    medians = np.sort(np.median(rng.choice(np.asarray(ratios), size=(rounds, len(ratios))), axis=1))
    return [round(float(medians[int(0.025 * rounds)]), 3), round(float(medians[int(0.975 * rounds) - 1]), 3)]


def own_share() -> None:
    """Makes the worker process drop every batch after the training thread has described and serialised
    it: what is left of the overhead is the training thread's own share."""
    worker = importlib.import_module("samestep.tracing.process_worker").ProcessWorker
    worker.submit = lambda self, b, events: self._payload(b, [])


# The recorder's entry points a training loop calls (and ModuleRecords.drain, where the module level's
# records are made when a microbatch ends): the time spent inside them is the training thread's own share,
# measured directly in the loop instead of as the difference of two noisy step times.
_RECORDER_CALLS = (
    ("recorder", "Recorder", ("grads", "state", "metric", "flush", "record", "collective")),
    ("module_level", "ModuleRecords", ("drain",)),
)


def time_recorder_calls() -> dict[int, float]:
    """Wraps the recorder's entry points; the returned dict sums, per recorder (by id), the seconds spent
    inside its outermost calls. Module hooks and the op-level dispatch mode are not included."""
    spent: dict[int, float] = {}
    depth = [0]
    for module, cls_name, names in _RECORDER_CALLS:
        cls = getattr(importlib.import_module(f"samestep.tracing.{module}"), cls_name)
        for name in names:

            def timed(self, *args, _f=getattr(cls, name), **kwargs):
                if depth[0]:
                    return _f(self, *args, **kwargs)
                depth[0] = 1
                t0 = time.perf_counter()
                try:
                    return _f(self, *args, **kwargs)
                finally:
                    key = id(getattr(self, "rec", self))  # a level's helper counts for its recorder
                    spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
                    depth[0] = 0

            setattr(cls, name, timed)
    return spent


def trace_overhead(
    pairs: int,
    steps: int,
    overrides: list[str],
    levels: list[str],
    device: str = "cpu",
    spent: dict[int, float] | None = None,
) -> dict:
    """Blocks of ``steps`` untraced then ``steps`` traced steps, alternating. After a traced block the
    digest worker is drained outside the timing, so the next untraced block is clean. A traced block
    then holds its steps' own costs and the worker's contention for all but its last batch: ``ratio``
    slightly understates steady state (by at most 1/steps of the contention), ``ratio_with_drain``
    (the drain counted too) overstates it. With ``spent`` (from ``time_recorder_calls``), also the
    time per traced step spent inside the recorder's calls, and its share of the untraced step."""
    corpus = load_corpus("stdlib")
    result = {}
    with tempfile.TemporaryDirectory() as d, samestep.enable(threads=1):
        base = build(load_config(None, overrides), corpus=corpus, device=device)
        for level in levels:
            traced = build(
                load_config(None, [*overrides, f"trace.level={level}"]),
                corpus=corpus,
                run_dir=Path(d) / level,
                device=device,
            )
            ratios, drained, t_off, t_on, inside = [], [], [], [], []
            key = id(traced.recorder)
            for p in range(pairs + 1):
                _sync(device)
                t0 = time.perf_counter()
                for s in range(steps):
                    base.step(p * steps + s)
                _sync(device)
                t1 = time.perf_counter()
                before = spent.get(key, 0.0) if spent is not None else 0.0
                for s in range(steps):
                    traced.step(p * steps + s)
                _sync(device)
                t2 = time.perf_counter()
                within = spent.get(key, 0.0) - before if spent is not None else 0.0
                traced.recorder.flush()  # waits for the last batch's digests
                t3 = time.perf_counter()
                if p:
                    ratios.append((t2 - t1) / (t1 - t0))
                    drained.append((t3 - t1) / (t1 - t0))
                    t_off.append((t1 - t0) / steps)
                    t_on.append((t2 - t1) / steps)
                    inside.append(within / (t1 - t0))
            traced.recorder.close()
            result[level] = {
                "ratio_median": round(statistics.median(ratios), 3),
                "ratio_ci95": median_ci(ratios),
                "ratio_with_drain_median": round(statistics.median(drained), 3),
                "step_ms_untraced": round(1000 * statistics.median(t_off), 1),
                "step_ms_traced": round(1000 * statistics.median(t_on), 1),
            }
            if spent is not None:
                share = statistics.median(inside)
                result[level].update(
                    recorder_calls_ms_per_step=round(1000 * share * statistics.median(t_off), 3),
                    recorder_calls_share=round(share, 4),
                )
    return result


# A digest worker child that digests the given spans of its parent's memory nonstop, read in groups of
# GROUP_BYTES as given (0: the worker's own value).
_NONSTOP = """
import importlib, json, sys
import torch
torch.set_num_threads(1)
child = importlib.import_module("samestep.tracing.process_child")
pid, group, spans = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
child.GROUP_BYTES = group or child.GROUP_BYTES
reader = child.Reader(pid)
spans = [tuple(s) for s in spans]
while True:
    child.digest_described(reader, [], spans)
"""


def worker_contention(rounds: int, steps: int = 4) -> dict:
    """How much a digest worker child slows the training steps through the memory they share: untraced
    reference steps with the child stopped, then with it digesting the model's parameters and optimizer
    state nonstop (SIGSTOP/SIGCONT, alternating, median of per-round ratios), for the child's layout (reads
    in groups of GROUP_BYTES, each hashed before the next) and for reading each batch at once.
    Nonstop is the worst case: a real child is busy for a fraction of each step."""
    layouts = {"in_groups": 0, "all_at_once": 1 << 40}
    corpus = load_corpus("stdlib")
    with samestep.enable(threads=1):
        base = build(load_config(None, []), corpus=corpus)
        for s in range(3):
            base.step(s)
        state = list(base.model.parameters()) + [v for st in base.optimizer.state.values() for v in st.values()]
        spans = json.dumps([(t.data_ptr(), t.nbytes) for t in state])
        children = {
            name: subprocess.Popen([sys.executable, "-c", _NONSTOP, str(os.getpid()), str(group), spans])
            for name, group in layouts.items()
        }
        try:
            time.sleep(5)  # torch imported, digesting
            for child in children.values():
                os.kill(child.pid, signal.SIGSTOP)
            ratios: dict[str, list[float]] = {name: [] for name in layouts}
            step = iter(range(3, 1 << 30))

            def timed(n: int) -> float:
                t0 = time.perf_counter()
                for _ in range(n):
                    base.step(next(step))
                return time.perf_counter() - t0

            for _ in range(rounds):
                for name, child in children.items():
                    alone = timed(steps)
                    os.kill(child.pid, signal.SIGCONT)
                    timed(1)  # while the child gets going
                    beside = timed(steps)
                    os.kill(child.pid, signal.SIGSTOP)
                    ratios[name].append(beside / alone)
        finally:
            for child in children.values():
                child.kill()
                child.wait()
    return {
        "bytes": sum(t.nbytes for t in state),
        "rounds": rounds,
        **{f"slowdown_{name}": round(statistics.median(r), 3) for name, r in ratios.items()},
    }


def _write_synthetic(run: Path, rank: int, n: int, flip_last: bool) -> None:
    """n records of one rank, written in 1M-record batches straight from numpy."""
    writer = StreamWriter(stream_path(run, rank), {"rank": rank})  # checksummed, as the recorder's streams are
    rng = np.random.default_rng(rank)
    ops = pa.array(["aten.mm.default", "aten.add.Tensor", "aten.gelu.default", "aten.native_layer_norm.default"])
    scopes = pa.array([f"transformer.h.{i}.mlp" for i in range(8)])
    try:
        for a in range(0, n, 1 << 20):
            m = min(1 << 20, n - a)
            idx = np.arange(a, a + m)
            dig_in = rng.integers(0, 256, size=(m, 16), dtype=np.uint8)
            dig = rng.integers(0, 256, size=(m, 16), dtype=np.uint8)
            if flip_last and a + m == n:
                dig[-1, 0] ^= 1
            binary = pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), m, [None, pa.py_buffer(dig.tobytes())])
            inputs = pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), m, [None, pa.py_buffer(dig_in.tobytes())])
            cols = [
                pa.array(idx, pa.int64()),
                pa.array(idx // 100_000 + 1, pa.int32()),
                pa.array((idx // 1000) % 8, pa.int32()),
                pa.DictionaryArray.from_arrays(
                    pa.array((idx // 500) % 2, pa.int8()), pa.array(["forward", "backward"])
                ).cast(pa.string()),
                pa.DictionaryArray.from_arrays(pa.array(idx % 8, pa.int8()), scopes).cast(pa.string()),
                pa.DictionaryArray.from_arrays(pa.array(idx % 4, pa.int8()), ops).cast(pa.string()),
                pa.array(idx // 32 % 1000, pa.int32()),
                inputs.cast(pa.binary()),
                binary.cast(pa.binary()),
            ]
            writer.write(dict(zip(SCHEMA.names, cols)))
    finally:
        writer.close()


def _run_json(run: Path, world: int) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.json").write_text(
        json.dumps(
            {"format": "samestep.run", "version": 1, "config": {}, "environment": {}, "layout": {"world_size": world}}
        )
    )


def diff_scale(records: int, ranks: int, per_rank: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        a, b = Path(d) / "a", Path(d) / "b"
        for run, flip in ((a, False), (b, True)):
            _run_json(run, 1)
            _write_synthetic(run, 0, records, flip)
        t0 = time.perf_counter()
        report = diff_runs(a, b)
        single = time.perf_counter() - t0
        assert report["origin"] is not None and report["per_rank"]["0"]["records_compared"] == records - 1
    with tempfile.TemporaryDirectory() as d:
        a, b = Path(d) / "a", Path(d) / "b"
        for run, flip in ((a, False), (b, True)):
            _run_json(run, ranks)
            for r in range(ranks):
                _write_synthetic(run, r, per_rank, flip and r == ranks - 1)
        t0 = time.perf_counter()
        report = diff_runs(a, b)
        many = time.perf_counter() - t0
        assert report["origin"]["rank"] == ranks - 1
    return {
        "single_rank_records": records,
        "single_rank_seconds": round(single, 2),
        "ranks": ranks,
        "records_per_rank": per_rank,
        "many_ranks_seconds": round(many, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--levels", default="step,module,op", help="trace levels to measure the overhead of")
    ap.add_argument(
        "--own-share",
        action="store_true",
        help="the worker process drops each batch unread: the training thread's own share",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for the overhead runs (as samestep train --set)",
    )
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--records-per-rank", type=int, default=10_000)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument(
        "--digest-triton",
        default="auto",
        choices=("auto", "on", "off"),
        help="the digest's fused Triton kernel: auto (on CUDA tensors), or off to time the PyTorch path",
    )
    ap.add_argument(
        "--contention-rounds", type=int, default=10, help="rounds of worker_contention (CPU only; 0 skips it)"
    )
    ap.add_argument(
        "--recorder-calls",
        action="store_true",
        help="also time the recorder's calls inside the traced steps (the training thread's own share)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.own_share:
        own_share()
    spent = time_recorder_calls() if args.recorder_calls else None
    importlib.import_module("samestep.digests.rows").TRITON = args.digest_triton  # in this process
    # the overhead first: samestep.enable() must run before CUDA starts (the digest timing would start it)
    overhead = trace_overhead(args.pairs, args.steps, args.set, args.levels.split(","), args.device, spent)
    result = {
        "digest": digest_throughput(2, args.device),
        "trace_overhead": overhead,
        "diff": diff_scale(args.records, args.ranks, args.records_per_rank),
    }
    if args.device == "cpu" and args.contention_rounds:
        result["worker_contention"] = worker_contention(args.contention_rounds)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
