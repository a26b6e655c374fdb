"""The checks CI cannot run (it has no GPU), as one script for a CUDA machine.

    PYTHONPATH=src:. python bench/gpu_check.py --out DIR [--sections env,digest,...] [--workdir DIR]

Sections (each result is written to DIR/gpu_check.json as soon as it is known):
- env: torch, CUDA, device, Triton;
- digest: every dtype and layout gives the same digest on CUDA as on CPU, by the int8 path and the
  float64 path; a batch of 200 tensors reaches the host in a bounded number of copies (profiler);
- kernels: tests/kernels/test_triton.py on the GPU (the Triton kernels' bits equal the CPU path's);
- train: ``samestep demo`` on CUDA (repeat, SIGKILL + resume, the pair with determinism off and its
  diff); a run traced at op level against an untraced one (same final digest), certified;
- bench: bench_kernels.py and bench_trace.py with ``--device cuda``;
- chunks: whether cuBLAS's strided-batched GEMM gives each chunk of a canonical tensor-parallel layer the bits
  of its own GEMM at every batch count (distributed/chunk_products.py batches them on the CPU only), fp32 and
  bf16, by shape;
- suite: the whole test suite on this machine (pytest-xdist), for the CUDA paths it reaches.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from bench_trace import digest_throughput  # bench/ is this script's directory

from samestep.digests import digest, digest_many

dg = importlib.import_module("samestep.digests.rows")  # the paths and their switches

SECTIONS = ("env", "digest", "kernels", "train", "bench", "chunks", "suite")


def _cases() -> dict[str, Callable[[str], torch.Tensor]]:
    """Tensors built on the CPU from a seed, then moved; views are taken on the target device."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(4096, 1280, generator=g)  # 20 MiB: hashed where it lies (>= BIG_BYTES)
    small = torch.randn(37, 129, generator=g)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45])
    special_nan = special.clone()
    special_nan.view(torch.int32)[2] = 0x7FC00001  # another NaN payload
    ints = torch.randint(-(2**31), 2**31 - 1, (1000,), generator=g, dtype=torch.int64)

    def on(t: torch.Tensor) -> Callable[[str], torch.Tensor]:
        return lambda d: t.to(d)

    cases = {
        "float32": on(small),
        "float64": on(small.double()),
        "bfloat16": on(small.bfloat16()),
        "float16": on(small.half()),
        "complex64": on(torch.complex(small, small.flip(0))),
        "complex128": on(torch.complex(small.double(), small.double().flip(1))),
        "bool": on(small > 0),
        "int8": on(ints.to(torch.int8)),
        "uint8": on(ints.to(torch.uint8)),
        "int16": on(ints.to(torch.int16)),
        "int32": on(ints.to(torch.int32)),
        "int64": on(ints),
        "zero_dim": on(torch.tensor(3.5)),
        "empty": on(torch.empty(0)),
        "empty_2d": on(torch.empty(3, 0)),
        "odd_bytes": on(torch.arange(7, dtype=torch.uint8)),
        "special": on(special),
        "nan_payload": on(special_nan),
        "big_20MiB": on(base),
        "big_strided": lambda d: base.to(d)[::3, 1::2],
        "transposed": lambda d: small.to(d).t(),
        "conj_view": lambda d: torch.complex(small, small).to(d).conj(),
        "expanded": lambda d: small.to(d)[:1].expand(64, 129),
        "int8_path_rows": on(torch.randn(33 * 128, generator=g)),
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            cases[name] = on(small.to(getattr(torch, name)))
    return cases


def check_env() -> dict:
    out = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
        out["capability"] = list(torch.cuda.get_device_capability())
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def check_digest(dev: torch.device) -> dict:
    cases = _cases()
    cpu = {k: digest(f("cpu")) for k, f in cases.items()}
    out: dict = {
        "int8_path_on_cuda": dg._int_weights(dev) is not None,
        "cases": len(cases),
        "default_path_on_cuda": "triton" if dg._use_triton(dev) else "torch",
    }
    gpu = {k: digest(f(dev)) for k, f in cases.items()}
    out["mismatch_default_path"] = [k for k in cases if gpu[k] != cpu[k]]
    out["triton_fallback_warned"] = dev in dg._triton_failed
    saved, mode = dg._int_cache.get(dev), dg.TRITON
    try:
        dg.TRITON = "off"  # the int8 path
        gpu8 = {k: digest(f(dev)) for k, f in cases.items()}
        out["mismatch_int8_path"] = [k for k in cases if gpu8[k] != cpu[k]]
        dg._int_cache[dev] = None  # the float64 path
        gpu64 = {k: digest(f(dev)) for k, f in cases.items()}
        out["mismatch_float64_path"] = [k for k in cases if gpu64[k] != cpu[k]]
    finally:
        dg._int_cache[dev], dg.TRITON = saved, mode
    # throughput of each path against a same-size copy (bench_trace's measurement: 4 MiB, 64 MiB, 1 GiB)
    for path, name in (("on", "triton"), ("off", "torch")) if dev.type == "cuda" else ():
        dg.TRITON = path
        try:
            out[f"digest_over_copy_{name}"] = digest_throughput(2, "cuda")["digest_over_copy_throughput"]
        except Exception as e:
            out[f"digest_over_copy_{name}"] = repr(e)[:300]
        finally:
            dg.TRITON = mode
    names = sorted(cases)
    many = digest_many([cases[k](dev) for k in names])
    out["mismatch_digest_many"] = [k for k, d in zip(names, many) if d != cpu[k]]
    # negative control: one flipped bit in the 20 MiB tensor on the GPU changes its digest
    t = cases["big_20MiB"](dev).clone()
    t.view(torch.int32)[1234, 67] ^= 1
    out["flipped_bit_detected"] = digest(t) != cpu["big_20MiB"]
    out["distinct_digests"] = len(set(cpu.values()))
    out["ok"] = (
        not out["mismatch_default_path"]
        and not out["mismatch_int8_path"]
        and not out["mismatch_float64_path"]
        and not out["mismatch_digest_many"]
        and out["flipped_bit_detected"]
    )
    if dev.type != "cuda":
        return out

    # a step-like batch: 200 tensors (13 MB) -> how many device-to-host copies and synchronisations
    g = torch.Generator().manual_seed(1)
    batch = [torch.randn(int(n), generator=g).to(dev) for n in torch.randint(1, 40000, (200,), generator=g)]
    digest_many(batch)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            digest_many(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    out["sync_warnings_batch_of_200"] = len(caught)
    out["sync_warning_kinds"] = sorted({str(w.message).splitlines()[0][:120] for w in caught})
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        digest_many(batch)
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for e in prof.events():
        if "Memcpy" in e.name or "Synchronize" in e.name:
            counts[e.name] = counts.get(e.name, 0) + 1
    out["profiler_copy_and_sync_events"] = counts
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        digest_many(batch)
        times.append(time.perf_counter() - t0)
    out["batch_of_200_ms_median"] = round(1000 * sorted(times)[5], 2)
    return out


def _run(cmd: list[str], timeout: int, log: Path, **kw) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        proc = subprocess.CompletedProcess(cmd, 124, e.stdout or "", e.stderr or "")
        proc.stdout = proc.stdout if isinstance(proc.stdout, str) else proc.stdout.decode(errors="replace")
        proc.stderr = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode(errors="replace")
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}  (exit {proc.returncode}, {time.perf_counter() - t0:.1f} s)\n")
        f.write(proc.stdout[-6000:] + "\n" + proc.stderr[-6000:] + "\n")
    proc.seconds = round(time.perf_counter() - t0, 1)  # type: ignore[attr-defined]
    return proc


def _tail(proc: subprocess.CompletedProcess, n: int = 600) -> str:
    return (proc.stdout + proc.stderr)[-n:]


def _pytest() -> list[str]:
    """pytest, with samestep's plugin named when the package is not installed (PYTHONPATH=src)."""
    from importlib.metadata import entry_points

    installed = any(e.value == "samestep.testing" for e in entry_points(group="pytest11"))
    return [sys.executable, "-m", "pytest", "-q", *([] if installed else ["-p", "samestep.testing"])]


def check_kernels(log: Path) -> dict:
    proc = _run([*_pytest(), "tests/kernels/test_triton.py"], 300, log)
    return {"exit": proc.returncode, "seconds": proc.seconds, "tail": _tail(proc, 400)}


def _train(run_dir: Path, settings: list[str], log: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "samestep", "train", "--run-dir", str(run_dir), "--json"]
    return _run(cmd + [x for s in settings for x in ("--set", s)], 300, log)


def check_train(work: Path, log: Path, out_dir: Path) -> dict:
    out: dict = {}
    demo = _run([sys.executable, "-m", "samestep", "demo", "--workdir", str(work / "demo"), "--json"], 400, log)
    out["demo"] = {"exit": demo.returncode, "seconds": demo.seconds}
    try:
        out["demo"]["result"] = json.loads(demo.stdout)
    except ValueError:
        out["demo"]["tail"] = _tail(demo)
    small = ["train.steps=6", "train.checkpoint_every=3"]
    e = _train(work / "traced", [*small, "trace.level=op", "trace.steps=1-3"], log)
    f = _train(work / "untraced", small, log)
    out["traced_exit"], out["untraced_exit"] = e.returncode, f.returncode
    try:
        fe = json.loads((work / "traced" / "final.json").read_text())
        ff = json.loads((work / "untraced" / "final.json").read_text())
        out["traced_final"] = fe
        out["traced_equals_untraced"] = {k: fe[k] == ff[k] for k in fe if k in ff and not isinstance(fe[k], dict)}
        run = json.loads((work / "traced" / "run.json").read_text())
        (out_dir / "run_traced_cuda.json").write_text(json.dumps(run, indent=1))
    except (OSError, ValueError, KeyError) as exc:
        out["final_error"] = repr(exc)
    cert = _run([sys.executable, "-m", "samestep", "trace", "certify", str(work / "traced"), "--json"], 120, log)
    out["certify"] = {"exit": cert.returncode, "tail": _tail(cert, 400)}
    g = _train(work / "traced2", [*small, "trace.level=op", "trace.steps=1-3"], log)
    d = _run(
        [sys.executable, "-m", "samestep", "diff", str(work / "traced"), str(work / "traced2"), "--json"], 120, log
    )
    out["diff_two_traced_cuda_runs"] = {"train_exit": g.returncode, "exit": d.returncode, "tail": _tail(d, 400)}
    return out


def check_bench(log: Path) -> dict:
    out = {}
    k = _run([sys.executable, "bench/bench_kernels.py", "--device", "cuda", "--repeats", "5", "--json"], 300, log)
    out["kernels"] = json.loads(k.stdout) if k.returncode == 0 else {"exit": k.returncode, "tail": _tail(k)}
    torch_path = ["--digest-triton", "off", "--levels", "step,module"]  # the same, digests by the PyTorch path
    for name, extra in (("trace", []), ("trace_digest_torch_path", torch_path)):
        t = _run(
            [
                sys.executable,
                "bench/bench_trace.py",
                "--device",
                "cuda",
                "--pairs",
                "5",
                "--steps",
                "8",
                "--records",
                "100000",
                "--ranks",
                "4",
                "--records-per-rank",
                "1000",
                "--json",
                *extra,
            ],
            400,
            log,
        )
        out[name] = json.loads(t.stdout) if t.returncode == 0 else {"exit": t.returncode, "tail": _tail(t)}
    return out


def check_chunks(dev: torch.device) -> dict:
    """For each (rows, in, out) of a layer cut in 8 chunks, fp32 and bf16: whether ``bmm`` over 8, 4, 2 and 1 of
    them gives each the bytes ``mm`` gives it alone (a column layer's forward, ``x W_c^T``)."""
    out = {}
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = ((256, 128, 384), (8192, 1024, 3072), (8192, 4096, 4096), (16384, 8192, 8192))
    for rows, k, n in shapes if dev.type == "cuda" else shapes[:1]:  # the CPU's answer is its unit test's
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, k, device=dev, generator=g).to(dtype)
            w = torch.randn(n, k, device=dev, generator=g).to(dtype)
            alone = [x @ c.t() for c in w.chunk(8, 0)]
            same = {}
            for batch in (8, 4, 2, 1):
                part = w[: batch * n // 8].view(batch, n // 8, k).transpose(1, 2)
                items = torch.bmm(x.expand(batch, rows, k), part)
                same[batch] = all(torch.equal(items[i], alone[i]) for i in range(batch))
            out[f"{rows}x{k}x{n}/{str(dtype).removeprefix('torch.')}"] = same
    return out


def check_suite(log: Path, workers: int) -> dict:
    proc = _run(
        [*_pytest(), "-n", str(workers), "--timeout", "120", "-p", "no:cacheprovider", "--tb=short", "-rfE", "tests"],
        240,
        log,
    )
    (log.parent / "suite.log").write_text(proc.stdout + proc.stderr)
    lines = [
        ln
        for ln in (proc.stdout + proc.stderr).splitlines()
        if ln.startswith(("FAILED", "ERROR")) or " passed" in ln or " failed" in ln
    ]
    return {"exit": proc.returncode, "seconds": proc.seconds, "summary": lines[-40:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--workdir")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check_"))
    log = out_dir / "gpu_check.log"
    result: dict = {}
    path = out_dir / "gpu_check.json"
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            if name == "env":
                result[name] = check_env()
            elif name == "digest":
                result[name] = check_digest(
                    torch.device("cuda", torch.cuda.current_device())
                    if torch.cuda.is_available()
                    else torch.device("cpu")
                )
            elif name == "kernels":
                result[name] = check_kernels(log)
            elif name == "train":
                result[name] = check_train(work, log, out_dir)
            elif name == "bench":
                result[name] = check_bench(log)
            elif name == "chunks":
                result[name] = check_chunks(
                    torch.device("cuda", torch.cuda.current_device())
                    if torch.cuda.is_available()
                    else torch.device("cpu")
                )
            elif name == "suite":
                result[name] = check_suite(log, args.workers)
            else:
                raise ValueError(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        except Exception:  # one section's failure must not lose the others' results
            result[name] = {"error": traceback.format_exc()[-2000:]}
        result[name + "_seconds"] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(result, indent=1))
        print(json.dumps({name: result[name]})[:3000], flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
