"""The framework-neutral parts of the callbacks: the resume fingerprint and the keyed sampler."""

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
        check_resume({**saved, "model": state_fingerprint(1, model, opt)["model"]}, state_fingerprint(1, model, fresh),
                     "here")
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
