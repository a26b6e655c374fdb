"""samestep.testing's golden digests: compared where pinned, recorded only when asked, and an environment with
nothing pinned is said, never passed as compared."""

from __future__ import annotations

import json

import pytest
import torch

from samestep.testing import Golden

X = torch.arange(12, dtype=torch.float32) / 7


def test_recorded_digests_are_compared_and_a_flipped_bit_fails(tmp_path):
    """Recording is explicit (update=True); the recorded digests then hold for the same tensor. Control: the same
    tensor with one bit flipped fails, naming the case and the fix."""
    path = tmp_path / "golden.json"
    recorder = Golden(path, update=True)
    recorder.check("case", X)
    recorder.save()
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"]) == ("samestep.golden", 1)
    Golden(path, update=False).check("case", X.clone())
    flipped = X.clone()
    flipped.view(torch.int32)[5] ^= 1
    with pytest.raises(AssertionError, match="golden 'case' .* differ from the pinned .* --samestep-update-golden"):
        Golden(path, update=False).check("case", flipped)


@pytest.mark.parametrize("pinned", ["no file", "another environment", "another case"])
def test_an_environment_with_nothing_pinned_is_said_and_nothing_is_recorded(tmp_path, pinned):
    """Where this environment has no digest for the name (no file, only another environment's, only other
    names), check records nothing and calls ``missing`` with the environment and the fix (the pytest fixture
    skips with it); without ``missing``, it fails."""
    path = tmp_path / "golden.json"
    if pinned != "no file":
        recorder = Golden(path, update=True)
        recorder.check("other" if pinned == "another case" else "case", X)
        recorder.save()
        if pinned == "another environment":
            doc = json.loads(path.read_text())
            doc["environments"] = {"0" * 16: next(iter(doc["environments"].values()))}
            path.write_text(json.dumps(doc))
    before = path.read_bytes() if path.exists() else None
    said: list[str] = []
    golden = Golden(path, update=False, missing=said.append)
    golden.check("case", X)
    golden.save()
    assert len(said) == 1 and "no digests pinned for this environment" in said[0], said
    assert "torch.version=" in said[0] and "--samestep-update-golden" in said[0]
    assert (path.read_bytes() if path.exists() else None) == before
    with pytest.raises(AssertionError, match="no digests pinned"):
        Golden(path, update=False).check("case", X)


@pytest.mark.parametrize("text", ["{", '{"format": "samestep.golden", "version": 2, "environments": {}}', "[]"])
def test_a_golden_file_of_another_format_is_refused_by_name(tmp_path, text):
    path = tmp_path / "golden.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"{path}: not a samestep.golden"):
        Golden(path, update=False)
