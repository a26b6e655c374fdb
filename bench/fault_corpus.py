"""The malformed-input corpus of bench/bench_faults.py: each case damages a copy of a finished run (or
writes a bad config, or puts something odd where a path is), runs one command, and says what the
documented outcome is.

An outcome is as documented when the exit code is the one named (2: bad input; 1: the verdict
"corrupt", "incomplete" or "does not hold"; 5: a non-finite loss; 0: the damage is passed over, e.g. a
strange `latest`, or a damaged newest checkpoint a resume falls back from), no traceback is printed, an
input error is one line on stderr, and nothing blocks. Each command runs in this process, one at a
time (no interpreter to start per case), on a thread that must end within ``TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CASES", "TIMEOUT_S", "Case", "run_case"]

TIMEOUT_S = 300


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
        manifest["manifest_sha256"] = hashlib.sha256(
            json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
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


def _forged(name: str, edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    """Edits a file of the newest checkpoint and recomputes every digest the manifest holds of it, and the
    manifest's own: a forgery by someone who knows the format."""

    def damage(run: Path) -> None:
        from safetensors.torch import load as load_tensors

        ckpt = _newest(run)
        data = edit((ckpt / name).read_bytes())
        (ckpt / name).write_bytes(data)
        manifest = json.loads((ckpt / "manifest.json").read_text())
        entry = manifest["files"][name]
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        for key, t in load_tensors(data).items() if "tensors" in entry else ():
            h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.contiguous().reshape(-1).view(-1).numpy().tobytes())
            entry["tensors"][key] = h.hexdigest()
        body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
        manifest["manifest_sha256"] = hashlib.sha256(
            json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
        (ckpt / "manifest.json").write_text(json.dumps(manifest))

    return damage


def _flip_a_weight(data: bytes) -> bytes:
    from safetensors.torch import load as load_tensors
    from safetensors.torch import save as save_tensors

    tensors = load_tensors(data)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = tensors[name].view(-1)[0] * 2 + 1
    return save_tensors(tensors)


def _move_cursor(data: bytes) -> bytes:
    state = json.loads(data)
    state["data_cursor"]["position"] += 2
    return json.dumps(state).encode()


def _metrics(edit: Callable[[list[bytes]], list[bytes]]) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        path = run / "metrics.jsonl"
        path.write_bytes(b"".join(edit(path.read_bytes().splitlines(keepends=True))))

    return damage


def _gone(rel: str) -> Callable[[Path], None]:
    return lambda run: (run / rel).unlink()


def _fifo(rel: str) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        target = _newest(run) / rel if rel in ("model.safetensors", "manifest.json") else run / rel
        target.unlink(missing_ok=True)
        os.mkfifo(target)

    return damage


def _odd(kind: str) -> Callable[[Path], None]:
    """Something odd where a path of the command will point (RUN/odd)."""

    def damage(run: Path) -> None:
        odd = run / "odd"
        if kind == "file":
            odd.write_text("x")
        elif kind == "fifo":
            os.mkfifo(odd)
        elif kind == "loop":
            odd.symlink_to(odd)
        else:
            odd.mkdir()

    return damage


def _final_loss(run: Path) -> None:
    doc = json.loads((run / "final.json").read_text())
    doc["loss_hex"] = (1.5).hex()
    (run / "final.json").write_text(json.dumps(doc))


def _newest_gone_and(what: Callable[[Path], None]) -> Callable[[Path], None]:
    """The newest checkpoint removed (a resume starts from the one before and saves the last step again),
    then ``what``."""

    def damage(run: Path) -> None:
        shutil.rmtree(_newest(run))
        what(run)

    return damage


def _named_like_the_last_step(run: Path) -> None:
    (run / "checkpoints" / "step_000008").write_text("not a checkpoint")


def _latest_a_directory(run: Path) -> None:
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "latest").mkdir()


def _model_a_directory(run: Path) -> None:
    target = _newest(run) / "model.safetensors"
    target.unlink()
    target.mkdir()


TRAIN = ("train", "--run-dir", "RUN/new", "--set", "train.steps=2")
RESUME = ("train", "--run-dir", "RUN", "--resume")
CASES = [
    # configuration
    Case(
        "config: a section that is no table (train = 5)",
        _config("train = 5\n"),
        ("train", "--run-dir", "RUN/new", "--config", "RUN/bad.toml"),
        2,
    ),
    Case(
        "config: TOML that does not parse",
        _config("[train\n"),
        ("train", "--run-dir", "RUN/new", "--config", "RUN/bad.toml"),
        2,
    ),
    Case(
        "config: a missing --config file", _nothing, ("train", "--run-dir", "RUN/new", "--config", "RUN/none.toml"), 2
    ),
    Case("config: seed 2**64", _nothing, (*TRAIN, "--set", "train.seed=18446744073709551616"), 2),
    Case("config: determinism.threads=100000", _nothing, (*TRAIN, "--set", "determinism.threads=100000"), 2),
    Case("config: trace.steps=1-3000000000", _nothing, (*TRAIN, "--set", "trace.steps=1-3000000000"), 2),
    Case("config: train.lr=inf", _nothing, (*TRAIN, "--set", "train.lr=inf"), 2),
    Case("config: train.grad_clip=nan", _nothing, (*TRAIN, "--set", "train.grad_clip=nan"), 2),
    Case("config: model.n_embd=10000000", _nothing, (*TRAIN, "--set", "model.n_embd=10000000"), 2),
    Case("config: an unknown key", _nothing, (*TRAIN, "--set", "train.nope=1"), 2),
    Case("config: --nproc 0", _nothing, (*TRAIN, "--nproc", "0"), 2),
    # run.json
    *[
        Case(f"run.json {what}: {cmd[0]}", _write("run.json", data), cmd, 2)
        for what, data in (
            ("[]", b"[]"),
            ("null", b"null"),
            ("not UTF-8", b"\xff\xfe{}"),
            (
                "with a non-numeric world size",
                b'{"format": "samestep.run", "version": 1, "config": {}, "layout": {"world_size": "x"}}',
            ),
        )
        for cmd in (("diff", "REF", "RUN"), ("trace", "certify", "RUN"), ("train", "--run-dir", "RUN", "--resume"))
    ],
    # metrics.jsonl and final.json
    Case(
        "metrics.jsonl: a line that is a list (resume)",
        _metrics_line(2, b"[1, 2]"),
        ("train", "--run-dir", "RUN", "--resume"),
        2,
    ),
    Case("metrics.jsonl: a line that is a list (diff)", _metrics_line(2, b"[1, 2]"), ("diff", "REF", "RUN"), 2),
    Case("metrics.jsonl: a string step (diff)", _metrics_line(1, b'{"step": "2"}'), ("diff", "REF", "RUN"), 2),
    Case(
        "metrics.jsonl: garbage in the middle (resume)",
        _metrics_line(3, b"\x00garbage"),
        ("train", "--run-dir", "RUN", "--resume"),
        2,
    ),
    Case("final.json: a list (diff)", _write("final.json", b"[]"), ("diff", "REF", "RUN"), 2),
    Case("a run directory that does not exist (diff)", _nothing, ("diff", "REF", "RUN/missing"), 2),
    Case("report of a run with run.json []", _write("run.json", b"[]"), ("report", "RUN", "--out", "RUN/r.html"), 2),
    # checkpoints
    Case(
        "manifest without 'files'", _resigned(lambda m: m.pop("files")), ("checkpoint", "verify", "RUN/checkpoints"), 1
    ),
    Case(
        "manifest 'files' a list",
        _resigned(lambda m: m.update(files=[])),
        ("checkpoint", "verify", "RUN/checkpoints"),
        1,
    ),
    Case(
        "manifest entry without 'size'",
        _resigned(lambda m: m["files"]["state.json"].pop("size")),
        ("checkpoint", "verify", "RUN/checkpoints"),
        1,
    ),
    Case(
        "manifest naming ../../etc/passwd",
        _resigned(lambda m: m["files"].update({"../../etc/passwd": {"size": 1, "sha256": "0" * 64}})),
        ("checkpoint", "verify", "RUN/checkpoints"),
        1,
    ),
    Case(
        "state.json without 'environment'",
        _resigned(lambda s: s.pop("environment"), "state.json"),
        ("checkpoint", "verify", "RUN/checkpoints"),
        1,
    ),
    Case(
        "malformed newest manifest: resume falls back to the older checkpoint",
        _resigned(lambda m: m.pop("files")),
        ("train", "--run-dir", "RUN", "--resume"),
        0,
    ),
    Case("a flipped bit in model.safetensors", _flip_model, ("checkpoint", "verify", "RUN/checkpoints"), 1),
    *[Case(f"latest {kind}", _latest(kind), ("checkpoint", "verify", "RUN/checkpoints"), 0) for kind in _LATEST_KINDS],
    Case("latest a FIFO: resume", _latest("fifo"), ("train", "--run-dir", "RUN", "--resume"), 0),
    Case("checkpoint verify given the run directory", _nothing, ("checkpoint", "verify", "RUN"), 0),
    # trace streams
    Case("a flipped bit in a trace stream (certify)", _flip_trace, ("trace", "certify", "RUN"), 2),
    Case("a flipped bit in a trace stream (diff)", _flip_trace, ("diff", "REF", "RUN"), 2),
    Case("a trace cut short by a kill (certify: incomplete)", _cut_trace, ("trace", "certify", "RUN"), 1),
    # forged checkpoints: every digest of the manifest recomputed
    Case(
        "forged: the manifest's step (checkpoint verify)",
        _resigned(lambda m: m.update(step=m["step"] + 2)),
        ("checkpoint", "verify", "RUN/checkpoints"),
        1,
    ),
    *[
        Case(f"forged: {what} ({' '.join(cmd[:2])})", _forged(name, edit), cmd, code)
        for what, name, edit in (
            ("a weight", "model.safetensors", _flip_a_weight),
            ("the data cursor", "state.json", _move_cursor),
        )
        for cmd, code in ((("receipts", "verify", "RUN"), 1), (RESUME, 2))
    ],
    # metrics.jsonl and final.json against the receipts
    *[
        Case(f"metrics: {what} (receipts verify)", damage, ("receipts", "verify", "RUN"), 1)
        for what, damage in (
            ("a row deleted", _metrics(lambda ls: ls[:3] + ls[4:])),
            ("a torn last row", _metrics(lambda ls: ls + [ls[-1][:20]])),
            ("emptied", _metrics(lambda ls: [])),
            ("deleted", _gone("metrics.jsonl")),
            ("two rows swapped", _metrics(lambda ls: ls[:2] + [ls[3], ls[2]] + ls[4:])),
            ("a row repeated", _metrics(lambda ls: ls[:3] + ls[2:])),
            ("final.json's loss", _final_loss),
        )
    ],
    Case("metrics deleted: resume of the finished run", _gone("metrics.jsonl"), RESUME, 2),
    Case(
        "receipts verify of a run without receipts",
        _gone("receipts/rank_00000.jsonl"),
        ("receipts", "verify", "RUN"),
        2,
    ),
    # a FIFO where a file is read: no command waits on it
    *[
        Case(f"a FIFO as {rel} ({' '.join(cmd[:2])})", _fifo(rel), cmd, code)
        for rel, cmds in (
            (
                "run.json",
                (
                    (("diff", "REF", "RUN"), 2),
                    (("trace", "certify", "RUN"), 2),
                    (("receipts", "verify", "RUN"), 2),
                    (RESUME, 2),
                ),
            ),
            ("final.json", ((("diff", "REF", "RUN"), 2), (("receipts", "verify", "RUN"), 2))),
            ("metrics.jsonl", ((("diff", "REF", "RUN"), 2), (RESUME, 2))),
            ("receipts/rank_00000.jsonl", ((("receipts", "verify", "RUN"), 2), (RESUME, 2))),
            ("manifest.json", ((("checkpoint", "verify", "RUN/checkpoints"), 1), (RESUME, 0))),
            ("model.safetensors", ((("checkpoint", "verify", "RUN/checkpoints"), 1), (RESUME, 0))),
        )
        for cmd, code in cmds
    ],
    Case("a FIFO as --config", _odd("fifo"), ("train", "--run-dir", "RUN/new", "--config", "RUN/odd"), 2),
    # paths that are no run directory, file or checkpoint
    *[
        Case(f"--run-dir {what}", damage, ("train", "--run-dir", where, "--set", "train.steps=2"), 2)
        for what, damage, where in (
            ("''", _nothing, ""),
            ("a file", _odd("file"), "RUN/odd"),
            ("a FIFO", _odd("fifo"), "RUN/odd"),
            ("a symlink loop", _odd("loop"), "RUN/odd"),
            ("too long", _nothing, "RUN/" + "x" * 300),
            ("under /proc", _nothing, "/proc/samestep-run"),
        )
    ],
    Case("--config a directory", _odd("dir"), ("train", "--run-dir", "RUN/new", "--config", "RUN/odd"), 2),
    Case("--config a symlink loop", _odd("loop"), ("train", "--run-dir", "RUN/new", "--config", "RUN/odd"), 2),
    Case("diff given a file", _odd("file"), ("diff", "RUN/odd", "REF"), 2),
    Case("receipts verify given a file", _odd("file"), ("receipts", "verify", "RUN/odd"), 2),
    *[
        Case(f"checkpoint verify of {what}", damage, ("checkpoint", "verify", where), 2)
        for what, damage, where in (
            ("a file", _odd("file"), "RUN/odd"),
            ("/dev/zero", _nothing, "/dev/zero"),
            ("a FIFO", _odd("fifo"), "RUN/odd"),
            ("an empty directory", _odd("dir"), "RUN/odd"),
        )
    ],
    # configurations past what the machine or the data hold
    Case(
        "config: train.global_batch=1000000000 (past the corpus)",
        _nothing,
        (*TRAIN, "--set", "train.global_batch=1000000000"),
        2,
    ),
    Case("config: model.n_layer=1000000 (past memory)", _nothing, (*TRAIN, "--set", "model.n_layer=1000000"), 2),
    Case("config: train.lr=1e308 (past float32)", _nothing, (*TRAIN, "--set", "train.lr=1e308"), 2),
    Case("config: trace.steps=5-1", _nothing, (*TRAIN, "--set", "trace.steps=5-1"), 2),
    Case("a non-finite loss (train.lr=1e30)", _nothing, ("train", "--run-dir", "RUN/new", "--set", "train.lr=1e30"), 5),
    # layouts no save wrote
    Case("latest a directory: a resume that saves", _newest_gone_and(_latest_a_directory), RESUME, 2),
    Case(
        "a file named like the last step: a resume that saves", _newest_gone_and(_named_like_the_last_step), RESUME, 2
    ),
    Case("model.safetensors a directory: resume falls back", _model_a_directory, RESUME, 0),
]


def run_case(case: Case, work: Path, reference: Path, settings: tuple[str, ...]) -> tuple[bool, str]:
    """Runs one case on a fresh copy of ``reference`` (a run of ``settings``, which a command that trains
    repeats); whether the outcome is as documented, and why not."""
    from samestep.cli import main

    run = work / "corpus" / case.name.replace("/", "_").replace(" ", "_")[:120]
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(reference, run)
    case.damage(run)
    argv = [a.replace("RUN", str(run)).replace("REF", str(reference)) for a in case.command]
    if argv[0] == "train":
        argv += [
            x
            for setting in settings
            for x in ("--set", setting)
            if "--resume" in argv or not setting.startswith("train.steps")
        ]
        if "--set" in case.command:  # the case's own settings last: they win
            argv += list(case.command[case.command.index("--set") :])
    out, err, code = io.StringIO(), io.StringIO(), []

    def command() -> None:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code.append(main(argv))

    worker = threading.Thread(target=command, daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)
    if worker.is_alive():
        return False, f"blocked ({TIMEOUT_S} s)"
    stderr = err.getvalue()
    if not code or code[0] != case.code:
        return False, f"exit {code[0] if code else None}, expected {case.code}: {(stderr or out.getvalue())[-500:]}"
    if "Traceback" in stderr:
        return False, "printed a traceback"
    lines = [
        line for line in stderr.splitlines() if line.strip() and "Warning" not in line and not line.startswith("  ")
    ]
    if case.code == 2 and len(lines) != 1:
        return False, f"{len(lines)} lines on stderr, expected 1: {stderr[-500:]}"
    return True, ""
