"""The malformed-input corpus of bench/bench_faults.py: each case damages a copy of a finished run (or
writes a bad config), runs one command, and says what the documented outcome is.

An outcome is as documented when the exit code is the one named (2: bad input; 1: the verdict
"corrupt" or "incomplete"; 0: the damage is passed over, e.g. a strange `latest`), no traceback is
printed, and an input error is one line on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CASES", "Case", "run_case"]


@dataclass(frozen=True)
class Case:
    name: str
    damage: Callable[[Path], None]  # given a copy of the reference run directory
    command: tuple[str, ...]  # RUN stands for that copy, REF for the reference run
    code: int


def _write(rel: str, data: bytes) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        (run / rel).write_bytes(data)
    return damage


def _newest(run: Path) -> Path:
    return max((run / "checkpoints").glob("step_*"))


def _resigned(change: Callable[[dict], None], file: str = "manifest.json") -> Callable[[Path], None]:
    """Edits the newest checkpoint's manifest (or state.json, then its manifest entry) and makes the
    manifest's self-digest valid again: malformed, not damaged. manifest_sha256 is SHA-256 of the
    key-sorted compact JSON of the manifest without that field (docs/formats.md)."""
    def damage(run: Path) -> None:
        ckpt = _newest(run)
        manifest = json.loads((ckpt / "manifest.json").read_text())
        if file == "manifest.json":
            change(manifest)
        else:
            doc = json.loads((ckpt / file).read_text())
            change(doc)
            data = json.dumps(doc).encode()
            (ckpt / file).write_bytes(data)
            manifest["files"][file].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
        manifest["manifest_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                                                     .encode()).hexdigest()
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return damage


def _metrics_line(index: int, line: bytes) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
        lines[index] = line + b"\n"
        (run / "metrics.jsonl").write_bytes(b"".join(lines))
    return damage


_LATEST_KINDS: dict[str, Callable[[Path], None]] = {
    "not utf-8": lambda p: p.write_bytes(b"\xff\xfe\n"),
    "directory": Path.mkdir,
    "fifo": os.mkfifo,
    "outside the root": lambda p: p.write_text("../../elsewhere/step_000002\n"),
}


def _latest(kind: str) -> Callable[[Path], None]:
    """``checkpoints/latest`` replaced by something odd of ``kind``."""
    def damage(run: Path) -> None:
        latest = run / "checkpoints" / "latest"
        latest.unlink()
        _LATEST_KINDS[kind](latest)
    return damage


def _flip_trace(run: Path) -> None:
    path = run / "trace" / "rank_00000.arrows"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _cut_trace(run: Path) -> None:
    path = run / "trace" / "rank_00000.arrows"
    path.write_bytes(path.read_bytes()[:-300])  # no end-of-stream marker, the last batch cut: a killed writer


def _flip_model(run: Path) -> None:
    path = _newest(run) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))


def _config(text: str) -> Callable[[Path], None]:
    return _write("bad.toml", text.encode())


def _nothing(run: Path) -> None:
    return None


TRAIN = ("train", "--run-dir", "RUN/new", "--set", "train.steps=2")
CASES = [
    # configuration
    Case("config: a section that is no table (train = 5)", _config("train = 5\n"),
         ("train", "--run-dir", "RUN/new", "--config", "RUN/bad.toml"), 2),
    Case("config: TOML that does not parse", _config("[train\n"),
         ("train", "--run-dir", "RUN/new", "--config", "RUN/bad.toml"), 2),
    Case("config: a missing --config file", _nothing, ("train", "--run-dir", "RUN/new", "--config", "RUN/none.toml"), 2),
    Case("config: seed 2**64", _nothing, (*TRAIN, "--set", "train.seed=18446744073709551616"), 2),
    Case("config: determinism.threads=100000", _nothing, (*TRAIN, "--set", "determinism.threads=100000"), 2),
    Case("config: trace.steps=1-3000000000", _nothing, (*TRAIN, "--set", "trace.steps=1-3000000000"), 2),
    Case("config: train.lr=inf", _nothing, (*TRAIN, "--set", "train.lr=inf"), 2),
    Case("config: train.grad_clip=nan", _nothing, (*TRAIN, "--set", "train.grad_clip=nan"), 2),
    Case("config: model.n_embd=10000000", _nothing, (*TRAIN, "--set", "model.n_embd=10000000"), 2),
    Case("config: an unknown key", _nothing, (*TRAIN, "--set", "train.nope=1"), 2),
    Case("config: --nproc 0", _nothing, (*TRAIN, "--nproc", "0"), 2),
    # run.json
    *[Case(f"run.json {what}: {cmd[0]}", _write("run.json", data), cmd, 2)
      for what, data in (("[]", b"[]"), ("null", b"null"), ("not UTF-8", b"\xff\xfe{}"),
                         ("with a non-numeric world size",
                          b'{"format": "samestep.run", "version": 1, "config": {}, "layout": {"world_size": "x"}}'))
      for cmd in (("diff", "REF", "RUN"), ("trace", "certify", "RUN"), ("train", "--run-dir", "RUN", "--resume"))],
    # metrics.jsonl and final.json
    Case("metrics.jsonl: a line that is a list (resume)", _metrics_line(2, b"[1, 2]"),
         ("train", "--run-dir", "RUN", "--resume"), 2),
    Case("metrics.jsonl: a line that is a list (diff)", _metrics_line(2, b"[1, 2]"), ("diff", "REF", "RUN"), 2),
    Case("metrics.jsonl: a string step (diff)", _metrics_line(1, b'{"step": "2"}'), ("diff", "REF", "RUN"), 2),
    Case("metrics.jsonl: garbage in the middle (resume)", _metrics_line(3, b"\x00garbage"),
         ("train", "--run-dir", "RUN", "--resume"), 2),
    Case("final.json: a list (diff)", _write("final.json", b"[]"), ("diff", "REF", "RUN"), 2),
    Case("a run directory that does not exist (diff)", _nothing, ("diff", "REF", "RUN/missing"), 2),
    Case("report of a run with run.json []", _write("run.json", b"[]"), ("report", "RUN", "--out", "RUN/r.html"), 2),
    # checkpoints
    Case("manifest without 'files'", _resigned(lambda m: m.pop("files")), ("checkpoint", "verify", "RUN/checkpoints"), 1),
    Case("manifest 'files' a list", _resigned(lambda m: m.update(files=[])), ("checkpoint", "verify", "RUN/checkpoints"),
         1),
    Case("manifest entry without 'size'", _resigned(lambda m: m["files"]["state.json"].pop("size")),
         ("checkpoint", "verify", "RUN/checkpoints"), 1),
    Case("manifest naming ../../etc/passwd",
         _resigned(lambda m: m["files"].update({"../../etc/passwd": {"size": 1, "sha256": "0" * 64}})),
         ("checkpoint", "verify", "RUN/checkpoints"), 1),
    Case("state.json without 'environment'", _resigned(lambda s: s.pop("environment"), "state.json"),
         ("checkpoint", "verify", "RUN/checkpoints"), 1),
    Case("malformed newest manifest: resume falls back to the older checkpoint", _resigned(lambda m: m.pop("files")),
         ("train", "--run-dir", "RUN", "--resume"), 0),
    Case("a flipped bit in model.safetensors", _flip_model, ("checkpoint", "verify", "RUN/checkpoints"), 1),
    *[Case(f"latest {kind}", _latest(kind), ("checkpoint", "verify", "RUN/checkpoints"), 0)
      for kind in _LATEST_KINDS],
    Case("latest a FIFO: resume", _latest("fifo"), ("train", "--run-dir", "RUN", "--resume"), 0),
    Case("checkpoint verify given the run directory", _nothing, ("checkpoint", "verify", "RUN"), 0),
    # trace streams
    Case("a flipped bit in a trace stream (certify)", _flip_trace, ("trace", "certify", "RUN"), 2),
    Case("a flipped bit in a trace stream (diff)", _flip_trace, ("diff", "REF", "RUN"), 2),
    Case("a trace cut short by a kill (certify: incomplete)", _cut_trace, ("trace", "certify", "RUN"), 1),
]


def run_case(case: Case, work: Path, reference: Path, settings: tuple[str, ...],
             env: dict[str, str]) -> tuple[bool, str]:
    """Runs one case on a fresh copy of ``reference`` (a run of ``settings``, which a resume repeats);
    whether the outcome is as documented, and why not."""
    run = work / "corpus" / case.name.replace("/", "_").replace(" ", "_")
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(reference, run)
    case.damage(run)
    argv = [a.replace("RUN", str(run)).replace("REF", str(reference)) for a in case.command]
    if "--resume" in argv:
        argv += [x for setting in settings for x in ("--set", setting)]
    try:
        proc = subprocess.run([sys.executable, "-m", "samestep", *argv], capture_output=True, text=True, timeout=300,
                              env=env)
    except subprocess.TimeoutExpired:
        return False, "hung (300 s)"
    if proc.returncode != case.code:
        return False, f"exit {proc.returncode}, expected {case.code}: {(proc.stderr or proc.stdout)[-500:]}"
    if "Traceback" in proc.stderr:
        return False, "printed a traceback"
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.startswith("  ")]
    if case.code == 2 and len(lines) != 1:
        return False, f"{len(lines)} lines on stderr, expected 1: {proc.stderr[-500:]}"
    return True, ""
