"""What a traced op's output is taken to be: a planted perturbation lands where it is asked and fails its step
where it plants nothing; memory a collective or set_ may write is uninitialised until written."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from samestep.digests import digest
from samestep.tracing import Perturb, Recorder, read_stream, stream_path

module_level = importlib.import_module("samestep.tracing.module_level")
step_level = importlib.import_module("samestep.tracing.step_level")


def test_a_perturbation_lands_in_an_output_of_any_layout():
    """The planted ULP goes to element 0 of an output that is no contiguous block (a transposed one, as
    SDPA's backward gives, and an expanded-then-sliced one), and of a 0-dim one; exactly one element moves,
    by one ULP. Control: another occurrence changes nothing."""
    perturb = Perturb(rank=0, step=1, microbatch=0, phase="backward", scope="attn", op="aten.op", occurrence=0)
    identity = (0, 1, 0, "backward", "attn", "aten.op", 0)
    for out in (torch.arange(12, dtype=torch.float32).view(3, 4).t(), torch.ones(4, 6)[:, ::2], torch.tensor(2.5)):
        before = out.clone()
        perturb.apply((*identity[:-1], 1), [out])
        assert torch.equal(out.view(torch.int32), before.view(torch.int32))
        perturb.apply(identity, [out])
        moved = (out.view(torch.int32) - before.view(torch.int32)).flatten()
        assert moved[0].item() == 1 and moved.count_nonzero().item() == 1


def test_a_collective_forgets_what_it_may_write_and_keeps_memory_still_uninitialised():
    """After a collective the op recorder stages anew whatever the collective may write (its arguments, any view
    of their storage) but keeps knowing that memory made elsewhere is uninitialised: digesting it would record
    whatever bytes lie there, another value in every run (a buffer made before an all-gather and filled after
    it). Negative control: a tensor the collective writes is forgotten, as is an initialised one."""
    from samestep.tracing.batch import NO_REF
    from samestep.tracing.staging import Staging

    st = Staging()
    spare, target, filled = torch.empty(8), torch.empty(8), torch.ones(8)
    assert st.stage(spare, uninit=True) == NO_REF and st.stage(target, uninit=True) == NO_REF
    st.stage(filled)
    st.forget([target[2:]])  # a view: the storage is what counts
    assert st.cached(spare, spare._version) == NO_REF
    assert st.cached(target, target._version) is None and st.cached(filled, filled._version) is None


def test_a_tensor_set_to_a_storage_object_is_recorded_uninitialised_until_written(tmp_path):
    """empty then set_ to a new storage (a DataLoader's collate does this before stack(out=) fills it): the
    set_'s output and the out= destination are uninitialised (UNINIT, not whatever bytes lay there), and the
    written result is digested. Control: set_ to another tensor (its bytes known) records them."""
    rec = Recorder(tmp_path, level="op")
    with rec.step(1), rec.microbatch(0):
        parts = [torch.full((3,), float(i)) for i in range(2)]
        out = torch.empty(0).set_(torch.UntypedStorage(6 * 4), 0, (2, 3), (3, 1))
        torch.stack(parts, out=out)
        (out + 0).sum()
        torch.empty(0).set_(parts[1])
    rec.close()
    rows = read_stream(stream_path(tmp_path, 0)).table.to_pylist()
    by_op = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append(r)
    stored = [r for r in by_op["aten.set_.source_Storage_storage_offset"]]
    assert len(stored) == 1 and stored[0]["outputs"] == bytes(16)
    assert by_op["aten.stack.out"][0]["outputs"] == bytes.fromhex(digest(torch.tensor([[0.0] * 3, [1.0] * 3])))
    assert by_op["aten.add.Tensor"][0]["inputs"] == bytes.fromhex(digest(torch.tensor([[0.0] * 3, [1.0] * 3])))
    assert by_op["aten.set_.source_Tensor"][0]["outputs"] == bytes.fromhex(digest(parts[1]))


def test_a_perturbation_that_plants_nothing_is_an_error_at_the_end_of_its_step(tmp_path):
    """A perturb spec that matches no op of its step (a scope misspelt), or whose step is not traced at op
    level, raises at that step's end naming the spec, instead of leaving the run unperturbed and a diff of it
    "identical". Control: the spec of a record the step makes plants its ULP and the step ends."""

    def run(path: Path, perturb: Perturb, level: str = "op") -> None:
        rec = Recorder(path, level=level, perturb=perturb)
        try:
            with rec.step(1), rec.microbatch(0):
                (torch.ones(4) * 3).sum()
        finally:
            rec.close()

    hit = Perturb(rank=0, step=1, microbatch=0, phase="forward", scope="", op="aten.mul.Tensor")
    run(tmp_path / "hit", hit)
    assert hit.fired
    missed = Perturb(rank=0, step=1, microbatch=0, phase="forward", scope="lm_haed", op="aten.mul.Tensor")
    with pytest.raises(
        ValueError,
        match=r"trace.perturb: rank=0,step=1,microbatch=0,phase=forward,scope=lm_haed,"
        r"op=aten.mul.Tensor,occurrence=0 matched no floating-point op output",
    ):
        run(tmp_path / "missed", missed)
    with pytest.raises(ValueError, match="nothing was planted"):
        run(
            tmp_path / "untraced",
            Perturb(rank=0, step=1, microbatch=0, phase="forward", scope="", op="aten.mul.Tensor"),
            level="step",
        )
