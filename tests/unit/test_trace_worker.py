"""The digest worker: a child process and a thread write the same stream; failures are reported."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch

import samestep.digests as digests
from samestep.digests import digest
from samestep.tracing import Recorder, read_stream, stream_path

worker_module = importlib.import_module("samestep.tracing.process_worker")
child_module = importlib.import_module("samestep.tracing.process_child")
rows_module = importlib.import_module("samestep.digests.rows")


class Mixed(torch.nn.Module):
    """Outputs of several layouts: a transposed view (non-contiguous), a tuple, a plain tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 6), torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)).t()  # (6, B), not contiguous
        return self.b(h.t()).sum()


def _odd_tensors(scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(5 << 18, generator=g) * scale  # 5 MiB: hashed where it lies, not packed
    return [
        torch.randn(3, 5, generator=g).t() * scale,
        (torch.randn(7, generator=g) * scale).to(torch.bfloat16),
        torch.randn(4, dtype=torch.complex64, generator=g) * scale,
        torch.tensor([True, False, True]),
        torch.arange(-3, 4, dtype=torch.int8),
        torch.tensor(scale),
        torch.empty(0, 3),
        big,
        big[1::3],
    ]


def _run(run: Path, level: str, worker: str, scale: float = 1.0) -> Recorder:
    torch.manual_seed(0)
    model = Mixed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(run, level=level, worker=worker)
    rec.attach(model)
    for step in (1, 2):
        with rec.step(step):
            for mb in (0, 1):
                with rec.microbatch(mb):
                    model(torch.ones(3, 4) * scale * (mb + 1)).backward()
            rec.grads(model.named_parameters())
            rec.record("odd", _odd_tensors(scale), scope="user")
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec.state(model, opt)
    rec.close()
    return rec


@pytest.mark.parametrize("level", ["step", "module", pytest.param("op", marks=pytest.mark.slow)])
def test_process_and_thread_workers_write_the_same_stream(tmp_path, level):
    """The same run traced with a worker process and a worker thread gives byte-identical streams; the
    odd tensors' digests are those of samestep.digest. Negative control: other inputs, other stream."""
    tables = {}
    for worker, scale in (("process", 1.0), ("thread", 1.0), ("process", 2.0)):
        rec = _run(tmp_path / f"{worker}{scale}", level, worker, scale)
        assert rec.worker == worker
        tables[worker, scale] = read_stream(stream_path(tmp_path / f"{worker}{scale}", 0)).table
    assert tables["process", 1.0].num_rows > 0 and tables["process", 1.0].equals(tables["thread", 1.0])
    assert tables["process", 1.0].column("outputs") != tables["process", 2.0].column("outputs")
    odd = [r for r in tables["process", 1.0].to_pylist() if r["op"] == "odd"]
    want = b"".join(bytes.fromhex(digest(t)) for t in _odd_tensors(1.0))
    assert len(odd) == 2 and all(r["outputs"] == want for r in odd)


def test_auto_is_a_thread_and_a_process_that_cannot_read_this_one_refuses(tmp_path, monkeypatch):
    """'auto' digests on a thread without trying a child (the process worker is opt-in), even where a child
    may not read the training process (process_vm_readv denied); an explicit 'process' there stops with the
    reason and the fix. Control: the thread's stream is the one a plain 'thread' writes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(
        worker_module, "_PROBE", "import socket, sys\nsocket.socket(fileno=int(sys.argv[1])).sendall(b'errno 1')\n"
    )
    rec = _run(tmp_path / "auto", "step", "auto")
    assert rec.worker == "thread"
    assert read_stream(stream_path(tmp_path / "auto", 0)).table.equals(
        read_stream(stream_path(_run(tmp_path / "thread", "step", "thread").run_dir, 0)).table
    )
    with pytest.raises(RuntimeError, match=r"trace.worker=process: .*errno 1.*use trace.worker=thread"):
        _run(tmp_path / "process", "step", "process")


def test_a_dead_worker_process_is_reported_not_waited_for(tmp_path):
    """A worker process that dies (killed) makes the next wait raise, naming it; nothing hangs."""
    rec = Recorder(tmp_path, level="step", worker="process")
    with rec.step(1):
        rec.record("x", [torch.ones(3)])
    rec._handoff.worker._proc.kill()
    with pytest.raises(RuntimeError, match="digest worker process exited"):
        rec.close()


def test_worker_process_writes_what_it_got_and_exits_when_the_trainer_goes(tmp_path):
    """When the training process's end of the socket closes (as at a SIGKILL), the child finishes the
    stream and exits: every batch it acknowledged reads back, with no torn tail."""
    rec = Recorder(tmp_path, level="step", worker="process")
    for step in (1, 2):
        with rec.step(step):
            rec.record("x", [torch.full((3,), float(step))])
    rec._handoff.wait()
    proc = rec._handoff.worker._proc
    rec._handoff.worker._sock.close()
    assert proc.wait(timeout=30) == 0
    s = read_stream(stream_path(tmp_path, 0))
    assert s.torn is None and s.table.column("step").to_pylist() == [1, 1, 2, 2]  # each step: x, then step.end
    assert s.table.column("outputs").to_pylist()[2] == bytes.fromhex(digest(torch.full((3,), 2.0)))


@pytest.mark.parametrize("forget", [True, False])
def test_a_forked_process_does_not_keep_the_worker_waiting(tmp_path, monkeypatch, forget):
    """A process forked from the trainer (as DataLoader workers are) closes its copy of the worker's
    socket, so the worker still sees the trainer's end at once. Negative control: without that, the
    worker waits until the forked process exits too."""
    import os
    import signal
    import subprocess
    import time

    if not forget:
        monkeypatch.setattr(worker_module.os, "register_at_fork", lambda **kw: None)
    rec = Recorder(tmp_path, level="step", worker="process")
    with rec.step(1):
        rec.record("x", [torch.ones(3)])
    rec._handoff.wait()
    pid = os.fork()
    if pid == 0:  # the forked process: lives on, like a DataLoader worker, until killed
        time.sleep(120)
        os._exit(0)
    try:
        proc = rec._handoff.worker._proc
        rec._handoff.worker._sock.close()  # the trainer's end closes, as at a SIGKILL
        if forget:
            assert proc.wait(timeout=30) == 0
        else:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=3)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert proc.wait(timeout=30) == 0
    assert read_stream(stream_path(tmp_path, 0)).table.column("op").to_pylist() == ["x", "step.end"]


def test_the_child_reads_and_hashes_in_groups_with_the_lanes_of_the_whole(monkeypatch):
    """The child reads a chunk of staged copies whole and the contiguous tensors in groups (one buffer,
    reused); at any group and block size the lanes are those of the tensors themselves. Negative control:
    one changed element changes that tensor's lanes, and only those."""
    g = torch.Generator().manual_seed(5)
    copied = [torch.randn(n, generator=g) for n in (100, 0, 3000, 1)]
    chunk, at = torch.full((1 << 16,), 7, dtype=torch.uint8), 0  # its padding is not zero, as in a reused chunk
    for t in copied:
        digests.pack_into(chunk, at, t)
        at += digests.rows_of(t.nbytes) * digests.ROW_BYTES
    packs = [(chunk.data_ptr(), at, [t.nbytes for t in copied])]
    tensors = [torch.randn(n, generator=g) for n in (1, 0, 300, 128, 5000, 7, 70000, 0, 129)]
    entries = [(t.data_ptr(), t.nbytes) for t in tensors]
    whole = digests.lanes_many(copied + tensors)
    reader = child_module.Reader(os.getpid())  # reading this process's own memory
    for group, block in ((1 << 40, 4096), (1024, 2), (4096, 32), (600, 1)):
        monkeypatch.setattr(child_module, "GROUP_BYTES", group)
        monkeypatch.setattr(rows_module, "BLOCK_ROWS", block)
        assert child_module.digest_described(reader, packs, entries) == whole, (group, block)
    tensors[6][40000] += 1.0
    changed = child_module.digest_described(reader, packs, entries)
    assert [i for i, (a, b) in enumerate(zip(changed, whole)) if a != b] == [len(copied) + 6]
