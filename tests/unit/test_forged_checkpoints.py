"""Checkpoints whose metadata a forger rewrote with every digest resealed: "intact" means loadable (each file
the checkpoint's own layout needs is listed and present, each part of state.json of the shape loading reads),
and what still cannot load into the run is a CheckpointError naming the file and the part, never a KeyError
or TypeError."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import samestep
from samestep import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from samestep.loop.data import Corpus, DataCursor
from samestep.train import GPT, ModelConfig
from tests.forgery import reseal, reseal_manifest
from tests.support import cli_here

CFG = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, dropout=0.0)


def _parts():
    """A GPT (its head tied to the embedding: a model alias), AdamW and a data cursor."""
    model = GPT(CFG, 256, 0)
    corpus = Corpus(
        tokens=(np.arange(4000) * 7919 % 251).astype(np.uint8), vocab_size=256, fingerprint="forged", description="test"
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), DataCursor(corpus, CFG.block_size, 0)


def _saved(root: Path) -> None:
    """Checkpoints of steps 1 and 2."""
    model, opt, cursor = _parts()
    for step in (1, 2):
        x, y = cursor.samples(cursor.position, 2)
        model(x, y, samestep.rng.generator(0, step, 0, "dropout"))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cursor.advance(2)
        save_checkpoint(root, step, model=model, optimizer=opt, data_cursor=cursor)


def _edit_state(step_dir: Path, change) -> None:
    state = json.loads((step_dir / "state.json").read_text())
    change(state)
    reseal(step_dir, "state.json", json.dumps(state, sort_keys=True).encode())


def _drop(step_dir: Path, name: str) -> None:
    """Deletes a file and its manifest entry, and reseals the manifest."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    del manifest["files"][name]
    (step_dir / name).unlink()
    reseal_manifest(step_dir, manifest)


FORGED = {
    "optimizer a list": (
        lambda d: _edit_state(d, lambda s: s.update(optimizer=[1, 2])),
        "state.json: 'optimizer' is \\[1, 2\\], expected an optimizer's state dict",
    ),
    "optimizer state a list": (
        lambda d: _edit_state(d, lambda s: s["optimizer"].update(state=[3])),
        "state.json: 'optimizer' is .*expected an optimizer's state dict",
    ),
    "alias to nothing": (
        lambda d: _edit_state(d, lambda s: s["model_aliases"].update({"lm_head.weight": "nope"})),
        "model alias 'lm_head.weight' -> 'nope' names no tensor",
    ),
    "alias not a name": (
        lambda d: _edit_state(d, lambda s: s.update(model_aliases={"x": 5})),
        "model alias 'x' -> 5 names no tensor",
    ),
    "rank JSON garbage": (lambda d: reseal(d, "rank_00000.json", b"garbage"), "rank_00000.json: not valid JSON"),
    "rank JSON a list": (
        lambda d: reseal(d, "rank_00000.json", b"[1]"),
        "rank_00000.json: is \\[1\\], expected a rank's RNG state",
    ),
    "RNG file dropped": (
        lambda d: _drop(d, "rank_00000.safetensors"),
        "lists no 'rank_00000.safetensors', which rank 0 of the 1-rank layout",
    ),
    "shards of a world of 3": (
        lambda d: _edit_state(d, lambda s: s.update(shards={"world_size": 3, "model": {}, "optimizer": {}})),
        "its world_size is 3",
    ),
    "shard file not listed": (
        lambda d: _edit_state(d, lambda s: s.update(shards={"world_size": 1, "model": {}, "optimizer": {}})),
        "lists no 'model.rank_00000.safetensors'",
    ),
    "shard layout without a shape": (
        lambda d: _edit_state(
            d, lambda s: s.update(shards={"world_size": 1, "model": {"w": {"rows": 2}}, "optimizer": {}})
        ),
        "the shard layout of 'w'",
    ),
}


@pytest.mark.parametrize("forge", FORGED, ids=list(FORGED))
def test_a_checkpoint_that_cannot_load_is_not_intact_and_a_resume_falls_back(tmp_path, forge):
    """Each forgery (digests resealed) fails verify naming the file and field, `samestep checkpoint verify` says
    CORRUPT (exit 1, one line), and a resume with fallback loads step 1 instead. Negative control: before the
    forgery the same checkpoint verifies and loads as step 2."""
    edit, needle = FORGED[forge]
    root = tmp_path / "ckpt"
    _saved(root)
    model, opt, cursor = _parts()
    assert load_checkpoint(root, model=model, optimizer=opt, data_cursor=cursor).step == 2
    assert cli_here("checkpoint", "verify", str(root)).returncode == 0
    edit(root / "step_000002")
    with pytest.raises(CheckpointError, match=needle):
        verify_checkpoint(root)
    out = cli_here("checkpoint", "verify", str(root))
    assert out.returncode == 1 and out.stdout.startswith("CORRUPT: ") and out.stdout.count("\n") == 1, out
    model, opt, cursor = _parts()
    with pytest.warns(RuntimeWarning, match="skipping corrupt checkpoint"):
        assert load_checkpoint(root, model=model, optimizer=opt, data_cursor=cursor, fallback=True).step == 1


@pytest.mark.parametrize(
    "part,value",
    [
        ("data_cursor", "abc"),
        ("data_cursor", {"position": "x"}),
        ("optimizer", {"state": {}, "param_groups": [{"params": [0]}] * 3}),
    ],
)
def test_a_part_that_does_not_load_into_the_run_is_named(tmp_path, part, value):
    """A part of state.json of the right kind whose contents do not fit the object it restores (a cursor that is
    a string, an optimizer of three parameter groups): the checkpoint's files are intact, and loading raises a
    CheckpointError naming state.json and the part, not the object's own TypeError or KeyError. Negative
    control: untouched, it loads."""
    root = tmp_path / "ckpt"
    _saved(root)
    model, opt, cursor = _parts()
    assert load_checkpoint(root, model=model, optimizer=opt, data_cursor=cursor).step == 2
    _edit_state(root / "step_000002", lambda s: s.update({part: value}))
    verify_checkpoint(root)
    model, opt, cursor = _parts()
    with pytest.raises(CheckpointError, match=f"state.json: its {part} state does not load into this run's {part}"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_checkpoint(root, model=model, optimizer=opt, data_cursor=cursor)
