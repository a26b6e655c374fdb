"""The framework-neutral parts of the callbacks: the resume fingerprint, the keyed sampler, the receipts of
the hooked steps."""

from __future__ import annotations

import pytest
import torch

from samestep.integrations.fingerprint import ResumeMismatch, check_resume, rng_digest, state_fingerprint
from samestep.integrations.sampler import KeyedSampler


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def test_a_fingerprint_matches_the_same_state_and_names_what_differs():
    """The same state fingerprints the same; one ULP in one weight, an optimizer not restored, or another
    RNG state is refused naming the part. A document of another format is refused naming its format."""
    model, opt = _trained()
    saved = {**state_fingerprint(1, model, opt), "rng": rng_digest()}
    check_resume(saved, {**state_fingerprint(1, model, opt), "rng": rng_digest()}, "here")
    with torch.no_grad():
        w = model.weight.view(-1).view(torch.int32)
        w[0] += 1
    with pytest.raises(ResumeMismatch, match="here: the resumed run's model differs"):
        check_resume(saved, state_fingerprint(1, model, opt), "here")
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(ResumeMismatch, match="optimizer differs"):
        check_resume(
            {**saved, "model": state_fingerprint(1, model, opt)["model"]}, state_fingerprint(1, model, fresh), "here"
        )
    torch.rand(1)
    with pytest.raises(ResumeMismatch, match="rng differs"):
        check_resume(saved, {"rng": rng_digest()}, "here", parts=("rng",))
    with pytest.raises(ResumeMismatch, match="not a samestep.resume-fingerprint version 1"):
        check_resume({"format": "other"}, saved, "here")


def test_the_keyed_sampler_is_a_pure_function_of_seed_and_epoch_and_resumes_part_way():
    """An epoch's order depends on the seed and the epoch alone (torch's global RNG is not drawn);
    resume_at(k) starts the next pass at the k-th index of that order, once. Negative control: another
    epoch gives another order."""
    a, b = KeyedSampler(10, seed=3), KeyedSampler(10, seed=3)
    torch.manual_seed(0)
    first = list(a)
    torch.manual_seed(1)
    assert list(b) == first and sorted(first) == list(range(10))
    b.set_epoch(1)
    assert list(b) != first
    a.resume_at(4)
    assert list(a) == first[4:] and list(a) == first
    with pytest.raises(ValueError, match="an epoch has 10 samples"):
        a.resume_at(11)


def _hooked_run(run_dir, model, opt, steps: range, start: int = 0):
    """A framework's loop as the callbacks drive HookedSteps: a step per batch, a receipt at each step's end."""
    from samestep.integrations.steps import HookedSteps
    from samestep.loop.protocol import RunProtocol

    hooked = HookedSteps.start(
        RunProtocol(),
        run_dir,
        level="step",
        steps=None,
        resume=start > 0,
        model=model,
        how_to_resume="-",
        receipts=True,
        start=start,
        optimizer=opt,
        source="a framework",
    )
    try:
        for step in steps:
            hooked.begin_step(step)
            hooked.begin_microbatch(0)
            loss = model(torch.full((1, 3), float(step))).square().sum()
            loss.backward()
            hooked.end_microbatch()
            opt.step()
            opt.zero_grad()
            hooked.end_step(float(loss.detach()))
        hooked.sync()
    finally:
        hooked.close()


def _restored(saved: tuple[dict, dict], optimizer: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A new model and optimizer (as a resumed process makes them), loaded from ``saved``; the optimizer's
    state left out unless ``optimizer``."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.load_state_dict(saved[0])
    if optimizer:
        opt.load_state_dict(saved[1])
    return model, opt


def test_hooked_steps_write_receipts_that_a_resume_continues_and_a_changed_state_is_refused(tmp_path):
    """The callbacks' receipts (integrations/steps.py): a run of 4 steps and one resumed after step 2 into a new
    model and optimizer loaded from its saved state write the same receipts file byte for byte, and `receipts
    verify` holds. Negative controls: the same resume with one weight one ULP off, or with the optimizer's state
    left out, is refused by the receipt of step 2 before any file changes."""
    import copy
    import shutil

    from samestep.analysis.receipt_check import check_receipts
    from samestep.records.receipts import ReceiptError

    model, opt = _trained()
    _hooked_run(tmp_path / "straight", model, opt, range(1, 5))
    model, opt = _trained()
    _hooked_run(tmp_path / "cut", model, opt, range(1, 3))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    shutil.copytree(tmp_path / "cut", tmp_path / "off")
    _hooked_run(tmp_path / "cut", *_restored(saved), range(3, 5), start=2)
    straight = (tmp_path / "straight" / "receipts" / "rank_00000.jsonl").read_bytes()
    assert (tmp_path / "cut" / "receipts" / "rank_00000.jsonl").read_bytes() == straight
    assert straight.count(b"\n") == 5  # the header and 4 receipts
    assert check_receipts(tmp_path / "cut")["ok"]

    off_by_one_ulp = _restored(saved)
    with torch.no_grad():
        off_by_one_ulp[0].weight.view(-1).view(torch.int32)[0] += 1
    before = {p: p.read_bytes() for p in sorted((tmp_path / "off").rglob("*")) if p.is_file()}
    for model, opt in (off_by_one_ulp, _restored(saved, optimizer=False)):
        with pytest.raises(ReceiptError, match="the checkpoint of step 2 restores state"):
            _hooked_run(tmp_path / "off", model, opt, range(3, 5), start=2)
        assert {p: p.read_bytes() for p in sorted((tmp_path / "off").rglob("*")) if p.is_file()} == before


@pytest.mark.parametrize("framework", ["huggingface", "lightning"])
def test_a_callback_on_several_processes_is_refused_at_its_start_unless_told(tmp_path, framework):
    """The HF callback at the Trainer's construction, the Lightning one at fit's setup: a Trainer on 2 processes
    (whose DDP all-reduce sums in its collective's order) is refused in one line naming the count and the fixes,
    before deterministic mode is on or anything is written. Negative controls: 1 process, and 2 with
    multiprocess=True, pass the check."""
    from types import SimpleNamespace

    import samestep
    from samestep.integrations.steps import refuse_processes

    if framework == "huggingface":
        from samestep.integrations.huggingface import SamestepCallback

        callback = SamestepCallback(tmp_path)

        def start():
            return callback.on_init_end(SimpleNamespace(world_size=2, output_dir=str(tmp_path)), None, None)
    else:
        from samestep.integrations.lightning import SamestepCallback

        callback = SamestepCallback(tmp_path)

        def start():
            return callback.setup(SimpleNamespace(world_size=2), None, "fit")

    with pytest.raises(ValueError, match="on 2 processes") as e:
        start()
    assert "multiprocess=True" in str(e.value) and "canonical_ddp_hook" in str(e.value) and "\n" not in str(e.value)
    assert samestep.determinism.mode.active_report() is None and not any(tmp_path.iterdir())
    refuse_processes(1, "SamestepCallback", False)
    refuse_processes(2, "SamestepCallback", True)


def test_hooked_steps_of_a_rank_keeping_no_receipts_agree_with_the_others_before_anything_is_written(tmp_path):
    """Under ``agree`` every rank's HookedSteps checks, a rank that keeps no receipts too (it checks nothing of
    its own): where another rank refused, it raises ``RefusedElsewhere`` and writes nothing (no trace, no run
    directory); where none did, it starts. Negative control: without ``agree`` the same rank starts whatever
    the others found."""
    from samestep.integrations.steps import HookedSteps
    from samestep.loop.protocol import RunProtocol
    from samestep.records.receipts import RefusedElsewhere

    model, opt = _trained()
    told: list[bool] = []

    def start(run_dir, agree):
        return HookedSteps.start(
            RunProtocol(),
            run_dir,
            level="step",
            steps=None,
            resume=False,
            model=model,
            how_to_resume="-",
            receipts=False,
            start=0,
            optimizer=opt,
            rank=1,
            agree=agree,
        )

    def refused(flag: bool) -> bool:
        told.append(flag)
        return True

    with pytest.raises(RefusedElsewhere, match="another rank refused this resume"):
        start(tmp_path / "refused", refused)
    assert told == [False] and not (tmp_path / "refused").exists()
    start(tmp_path / "agreed", lambda flag: told.append(flag) or flag).close()
    assert told == [False, False] and (tmp_path / "agreed").is_dir()
    start(tmp_path / "alone", None).close()  # the control: no agreement asked, it starts
    assert told == [False, False] and (tmp_path / "alone").is_dir()


def test_a_replay_leaves_its_refusal_to_the_rank_that_refused(tmp_path):
    """``ReplayRequest.refusing`` writes the refusal of the rank whose check refused; a rank that only learned
    of it (``RefusedElsewhere``) re-raises and leaves the file alone, so the verdict reads the reason. Control:
    a ``ReceiptError`` of its own is written."""
    from samestep.records.receipts import ReceiptError, RefusedElsewhere
    from samestep.replay.request import REFUSAL, ReplayRequest

    request = ReplayRequest(run_dir=str(tmp_path / "run"), into=str(tmp_path / "into"), stop_after=3)
    with pytest.raises(ReceiptError), request.refusing(ReceiptError):
        raise ReceiptError("rank_00001.jsonl: the checkpoint of step 2 restores state 0x1")
    assert (tmp_path / "into" / REFUSAL).read_text() == (
        "ReceiptError: rank_00001.jsonl: the checkpoint of step 2 restores state 0x1\n"
    )
    with pytest.raises(RefusedElsewhere), request.refusing(ReceiptError):
        raise RefusedElsewhere("another rank refused this resume")
    assert "rank_00001.jsonl" in (tmp_path / "into" / REFUSAL).read_text()
