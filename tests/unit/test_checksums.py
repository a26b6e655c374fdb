"""The state checksum (hashing/checksums.py) and receipts version 2 (records/receipts.py): one pass a step,
version 1 read."""

from __future__ import annotations

import json

import pytest
import torch
import xxhash

from samestep.digests import digest
from samestep.hashing import checksums
from samestep.hashing.checksums import Checksums, state_checksum
from samestep.hashing.state import state_digest
from samestep.records.receipt_writer import ReceiptWriter
from samestep.records.receipts import (
    ReceiptError,
    chain_break,
    check_restored,
    read_receipts,
    receipt_hash,
    receipt_state_of,
    receipts_path,
    state_hash_of,
)


def _tree(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {"w": w, "b": torch.zeros(32)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "step": 3,
    }


@pytest.mark.parametrize("hash_", checksums.STATE_HASHES)
def test_a_checksum_sees_one_bit_dtype_shape_and_structure(hash_):
    """Equal trees give equal checksums by every hash; a flipped bit, -0.0 for 0.0, another dtype, another
    shape or another scalar in the tree each change it (the controls)."""
    base = state_checksum(_tree(), hash_)
    assert base == state_checksum(_tree(), hash_)
    flipped = _tree()
    flipped["model"]["w"].view(torch.int32)[5, 7] ^= 1
    negzero = _tree()
    negzero["model"]["b"][0] = -0.0
    other_dtype, other_shape, other_step = _tree(), _tree(), _tree()
    other_dtype["model"]["b"] = other_dtype["model"]["b"].double()
    other_shape["model"]["w"] = other_shape["model"]["w"].reshape(32, 64)
    other_step["step"] = 4
    for changed in (flipped, negzero, other_dtype, other_shape, other_step):
        assert state_checksum(changed, hash_) != base


def test_each_hash_is_the_function_formats_md_names():
    """sha256 is the state digest exactly; samestep-digest-1 takes each tensor's digest; xxh3-128 reads a view's
    elements in row-major order (a transposed view checksums as its contiguous copy)."""
    tree = _tree()
    assert state_checksum(tree, "sha256") == state_digest(tree)
    t = tree["model"]["w"]
    assert Checksums("samestep-digest-1").of([t]) == [digest(t)]
    assert Checksums().of([t.t()]) == Checksums().of([t.t().contiguous()]) != Checksums().of([t])
    for x in (t, t.t(), torch.tensor(1.5)):  # formats.md's words, computed apart from checksums.py
        h = xxhash.xxh3_128(f"{x.dtype}|{tuple(x.shape)}|".encode())
        h.update(x.detach().contiguous().numpy().tobytes())
        assert Checksums().of([x]) == [h.hexdigest()]
    with pytest.raises(ValueError, match="state hash 'md5'"):
        Checksums("md5")


def test_one_pass_a_step_hashes_each_tensor_once(tmp_path, monkeypatch):
    """The receipt and the cross-rank sums of one step share one pass: a parameter in both (and again in the
    state's dict) is hashed once a step, and again the next step: a weight changed in place between steps
    changes its checksum to a fresh pass's. Control: two separate Checksums hash each parameter twice."""
    hashed = []
    real_hash = checksums._xxh3
    monkeypatch.setattr(checksums, "_xxh3", lambda t, key: hashed.append(t.data_ptr()) or real_hash(t, key))
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = ReceiptWriter(tmp_path, 0, "g")
    named = list(model.named_parameters())
    grads = [(n, torch.ones_like(p)) for n, p in named]
    sums = []
    for step in (1, 2, 3):
        if step == 3:
            with torch.no_grad():
                model.weight[0, 0] += 1.0
        writer.add(
            step,
            lambda: {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
            0.5,
            1.0,
            {"grads": grads, "params": named},
        )
        writer.wait()
        sums.append(writer.last.sums["params"])
    writer.close()
    per_step = len(named) + len(grads)  # the state's tensors are the parameters themselves
    assert len(hashed) == 3 * per_step
    assert sums[0] == sums[1] and sums[2]["weight"] != sums[1]["weight"] and sums[2]["bias"] == sums[1]["bias"]
    assert sums[2]["weight"] == Checksums().named(named)["weight"]
    both = Checksums(), Checksums()
    for memo in both:
        memo.of([p for _, p in named])
    assert sum(m.hashed for m in both) == 2 * len(named)


def test_a_steps_pass_is_shared_by_threads_and_renewed_each_step():
    """Two threads asking one step's pass (``StepChecksums``) for overlapping tensors at once hash each tensor
    once and get the values a pass of its own gives; the next step's pass hashes them again (an update may
    have changed them). Control: two separate passes hash the shared tensors twice."""
    import threading

    from samestep.hashing.checksums import StepChecksums

    started = threading.Barrier(2)
    tensors = [torch.full((256, 64), float(i)) for i in range(12)]
    mine, theirs = tensors[:8], tensors[4:]
    shared = StepChecksums()
    got: dict[str, list[str]] = {}

    def ask(name: str, which: list[torch.Tensor]) -> None:
        started.wait()
        got[name] = shared.of_step(1, "xxh3-128").of(which)

    threads = [threading.Thread(target=ask, args=a) for a in (("mine", mine), ("theirs", theirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = shared.of_step(1, "xxh3-128")
    assert first.hashed == len(tensors)
    assert got["mine"] == Checksums().of(mine) and got["theirs"] == Checksums().of(theirs)
    assert first.of(tensors) and first.hashed == len(tensors)
    second = shared.of_step(2, "xxh3-128")
    second.of(mine)
    assert second is not first and second.hashed == len(mine)
    apart = Checksums(), Checksums()
    apart[0].of(mine)
    apart[1].of(theirs)
    assert sum(m.hashed for m in apart) == len(tensors) + 4  # control: the 4 in both, hashed twice


def _v1_file(run_dir, tree: dict) -> None:
    """A receipts file as version 1 wrote it: state_of in the header, the SHA-256 state digest per receipt."""
    path = receipts_path(run_dir, 0)
    path.parent.mkdir(parents=True)
    header = {"format": "samestep.receipts", "version": 1, "rank": 0, "state_of": "run", "genesis": "g"}
    receipt = {
        "step": 1,
        "state": state_digest(tree),
        "loss_hex": (0.5).hex(),
        "grad_norm_hex": (1.0).hex(),
        "prev": "g",
    }
    receipt["hash"] = receipt_hash(receipt)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in (header, receipt)))


def test_version_1_is_read_checked_and_continued_as_version_1(tmp_path):
    """A version-1 file reads as sha256 state digests of the whole state; a restore is checked against it (a
    flipped weight is refused: the control); a writer resumed on it goes on in version 1, chain intact."""
    tree = _tree()
    _v1_file(tmp_path, tree)
    header, receipts = read_receipts(receipts_path(tmp_path, 0))
    assert state_hash_of(header) == "sha256" and receipt_state_of(header, receipts[0]) == "run"
    check_restored(tmp_path, 0, 1, tree)
    bad = _tree()
    bad["model"]["w"].view(torch.int32)[0, 0] ^= 1
    with pytest.raises(ReceiptError, match="restores state"):
        check_restored(tmp_path, 0, 1, bad)
    writer = ReceiptWriter(tmp_path, 0, receipts[-1]["hash"], start=1)
    writer.add(2, lambda: tree, 0.25, 1.0)
    writer.close()
    header, receipts = read_receipts(receipts_path(tmp_path, 0))
    assert header["version"] == 1 and "state_of" not in receipts[1] and chain_break(header, receipts) is None
    assert receipts[1]["state"] == state_digest(tree)


def test_version_2_says_its_hash_and_each_receipts_state_and_refuses_what_it_cannot_read(tmp_path):
    """A new file names its hash in the header and what each receipt's state is of; a file of a later version
    or an unknown hash is refused, naming the file and line."""
    tree = _tree()
    writer = ReceiptWriter(tmp_path, 0, "g", state_of="rank", hash="samestep-digest-1")
    writer.add(1, lambda: tree, 0.5, 1.0)
    writer.close()
    path = receipts_path(tmp_path, 0)
    header, receipts = read_receipts(path)
    assert (header["version"], header["state_hash"], receipts[0]["state_of"]) == (2, "samestep-digest-1", "rank")
    assert receipts[0]["state"] == state_checksum(tree, "samestep-digest-1") != state_checksum(tree)
    check_restored(tmp_path, 0, 1, tree)
    lines = path.read_text().splitlines()
    for edit, message in (({"version": 3}, "receipts version 3"), ({"state_hash": "crc32"}, "state_hash 'crc32'")):
        path.write_text("\n".join([json.dumps({**json.loads(lines[0]), **edit}), *lines[1:]]) + "\n")
        with pytest.raises(ReceiptError, match=f"{path.name}:1: {message}"):
            read_receipts(path)


def test_the_receipt_hash_is_a_setting_that_changes_no_bit(tmp_path):
    """`train.receipt_hash=sha256` writes sha256 receipts that `receipts verify` checks (final.json carries that
    checksum, the state digest itself); the default's final state digest and metrics bytes are the same run's
    (the hash changes no bit). Control: the two files' states differ, each by its own hash."""
    import samestep
    from samestep.analysis.receipt_check import check_receipts
    from samestep.train import load_config
    from samestep.train import loop as loop_module
    from tests.support import TINY

    finals = {}
    for name, extra in (("xxh", ()), ("sha", ("train.receipt_hash=sha256",))):
        cfg = load_config(None, [*TINY, "train.steps=3", *extra])
        with samestep.enable(threads=1):
            finals[name] = loop_module.train(cfg, tmp_path / name, out=lambda _: None)
        report = check_receipts(tmp_path / name)
        assert report["ok"], report["problems"]
        assert any("state against the last receipt" in c for c in report["checked"])
    header, receipts = read_receipts(receipts_path(tmp_path / "sha", 0))
    assert header["state_hash"] == "sha256" and receipts[-1]["state"] == finals["sha"]["state_digest"]
    assert finals["sha"]["state_digest"] == finals["xxh"]["state_digest"]
    assert (tmp_path / "sha" / "metrics.jsonl").read_bytes() == (tmp_path / "xxh" / "metrics.jsonl").read_bytes()
    assert read_receipts(receipts_path(tmp_path / "xxh", 0))[1][-1]["state"] != receipts[-1]["state"]


def test_a_rank_that_joined_at_a_resume_keeps_its_receipts_through_the_next_resume(tmp_path):
    """A receipts file begun after step 2 (its rank joined a run resumed there on more processes) says so in
    its header (start 2): a later resume from step 4 or 3 keeps its chain, and one from step 2 or before starts
    it afresh. Negative control: the same steps in a file without the start (a head cut off) are refused."""
    from samestep.records.receipts import truncate_receipts

    tree = _tree()
    writer = ReceiptWriter(tmp_path, 3, "g", state_of="rank", start=2)
    for step in (3, 4):
        writer.add(step, lambda: tree, 0.5, 1.0)
    writer.close()
    path = receipts_path(tmp_path, 3)
    header, receipts = read_receipts(path)
    assert header["start"] == 2 and [r["step"] for r in receipts] == [3, 4]
    assert truncate_receipts(tmp_path, 3, 4, check_only=True) == receipts[1]["hash"]
    assert truncate_receipts(tmp_path, 3, 3) == receipts[0]["hash"]
    assert [r["step"] for r in read_receipts(path)[1]] == [3]
    assert truncate_receipts(tmp_path, 3, 2) is None and not path.exists()

    writer = ReceiptWriter(tmp_path, 3, "g", state_of="rank", start=2)
    for step in (3, 4):
        writer.add(step, lambda: tree, 0.5, 1.0)
    writer.close()
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    del head["start"]
    path.write_text("\n".join([json.dumps(head, sort_keys=True), *lines[1:]]) + "\n")
    with pytest.raises(ReceiptError, match=r"holds steps 3\.\.4, not 1\.\.4"):
        truncate_receipts(tmp_path, 3, 4, check_only=True)
