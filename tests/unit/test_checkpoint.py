"""Checkpoints: exact round trip, atomic commit, and refusal of every kind of corruption."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import samestep
from samestep import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from samestep.hashing.state import state_digest
from samestep.loop.data import Corpus, DataCursor
from samestep.train import GPT, ModelConfig

CFG = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, dropout=0.1)


def _corpus() -> Corpus:
    import numpy as np

    tokens = (np.arange(5000) * 7919 % 251).astype(np.uint8)
    return Corpus(tokens=tokens, vocab_size=256, fingerprint="test-corpus", description="test")


def _setup(seed: int = 0):
    """A model initialised from ``seed``; the data cursor always uses seed 0 (a checkpoint must match it)."""
    model = GPT(CFG, 256, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return model, opt, DataCursor(_corpus(), CFG.block_size, 0)


def _steps(model, opt, cursor, start: int, n: int) -> None:
    for step in range(start, start + n):
        x, y = cursor.samples(cursor.position, 4)
        _, loss = model(x, y, samestep.rng.generator(0, step, 0, "dropout"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cursor.advance(4)


def _digest(model, opt, cursor) -> str:
    return state_digest({"m": model.state_dict(), "o": opt.state_dict(), "c": cursor.state_dict()})


def test_round_trip_then_continue_is_bit_identical(tmp_path):
    """Train 3, save, train 3 == load in fresh objects, train 3. Negative control: no optimizer restore."""
    model, opt, cursor = _setup()
    _steps(model, opt, cursor, 0, 3)
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=opt, data_cursor=cursor, config={"a": 1})
    assert path == tmp_path / "step_000003" and (tmp_path / "latest").read_text() == "step_000003\n"
    _steps(model, opt, cursor, 3, 3)
    reference = _digest(model, opt, cursor)

    model2, opt2, cursor2 = _setup(seed=1)  # different init: everything must come from the checkpoint
    loaded = load_checkpoint(tmp_path, model=model2, optimizer=opt2, data_cursor=cursor2)
    assert loaded.step == 3 and loaded.config == {"a": 1} and loaded.env_diff == {}
    assert isinstance(opt2.state_dict()["param_groups"][0]["betas"], tuple)
    _steps(model2, opt2, cursor2, 3, 3)
    assert _digest(model2, opt2, cursor2) == reference

    model3, opt3, cursor3 = _setup(seed=1)
    load_checkpoint(tmp_path, model=model3, data_cursor=cursor3)  # optimizer moments not restored
    _steps(model3, opt3, cursor3, 3, 3)
    assert _digest(model3, opt3, cursor3) != reference


def test_user_loop_with_global_rng_needs_rng_restore(tmp_path):
    """A loop drawing dropout from the global RNG resumes exactly with RNG restore; without it, it differs."""

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def run(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> torch.Tensor:
        for _ in range(n):
            model(torch.ones(8, 8)).square().sum().backward()  # nn.Dropout: global generator
            opt.step()
            opt.zero_grad()
        return model[0].weight.detach().clone()

    torch.manual_seed(0)
    model, opt = make()
    run(model, opt, 2)
    save_checkpoint(tmp_path, 2, model=model, optimizer=opt)
    reference = run(model, opt, 2)
    results = {}
    for restore in (True, False):
        torch.manual_seed(123)  # a new process: the global generator is elsewhere
        model, opt = make()
        load_checkpoint(tmp_path, model=model, optimizer=opt, restore_rng=restore)
        results[restore] = run(model, opt, 2)
    assert torch.equal(results[True].view(torch.int32), reference.view(torch.int32))
    assert not torch.equal(results[False], reference)


def _saved(tmp_path: Path, steps=(2, 4)) -> Path:
    model, opt, cursor = _setup()
    for s in steps:
        _steps(model, opt, cursor, 0, 1)
        save_checkpoint(tmp_path, s, model=model, optimizer=opt, data_cursor=cursor)
    return tmp_path


def _flip_bit(path: Path, offset_from_end: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_intact_checkpoint_verifies(tmp_path):
    """An untouched checkpoint verifies (the negative side of the corruption tests)."""
    root = _saved(tmp_path)
    assert verify_checkpoint(root) == root / "step_000004"
    assert verify_checkpoint(root / "step_000002") == root / "step_000002"


def test_flipped_bit_names_file_and_tensor(tmp_path):
    """One flipped bit in a tensor's bytes: the error names the file and the tensor."""
    root = _saved(tmp_path)
    _flip_bit(root / "step_000004" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt: tensor\(s\) '[^']+' differ"):
        verify_checkpoint(root)


def test_truncated_and_missing_files_are_named(tmp_path):
    """A truncated file and a missing file are refused with their names."""
    root = _saved(tmp_path)
    f = root / "step_000004" / "optimizer.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: \d+ bytes, manifest says"):
        verify_checkpoint(root)
    (root / "step_000002" / "rank_00000.json").unlink()
    with pytest.raises(CheckpointError, match=r"rank_00000\.json: missing"):
        verify_checkpoint(root / "step_000002")


def test_tampered_manifest_is_refused(tmp_path):
    """Editing a value in the manifest (here the step) breaks its self-digest."""
    root = _saved(tmp_path)
    m = root / "step_000004" / "manifest.json"
    doc = json.loads(m.read_text())
    doc["step"] = 5
    m.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="manifest.json: its contents do not match manifest_sha256"):
        verify_checkpoint(root)
    m.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        verify_checkpoint(root)


def test_fallback_skips_corrupt_newest_and_says_so(tmp_path):
    """fallback=True loads the newest intact checkpoint and warns about the corrupt one; without it, refuses."""
    root = _saved(tmp_path)
    _flip_bit(root / "step_000004" / "model.safetensors")
    model, opt, cursor = _setup()
    with pytest.raises(CheckpointError):
        load_checkpoint(root, model=model)
    with pytest.warns(RuntimeWarning, match="skipping corrupt checkpoint .*step_000004"):
        loaded = load_checkpoint(root, model=model, optimizer=opt, data_cursor=cursor, fallback=True)
    assert loaded.step == 2 and [p.name for p, _ in loaded.skipped] == ["step_000004"]
    _flip_bit(root / "step_000002" / "state.json", 3)
    with pytest.raises(CheckpointError, match="no intact checkpoint"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_checkpoint(root, model=model, fallback=True)


def test_uncommitted_leftovers_are_ignored(tmp_path):
    """A temp directory left by a crash mid-save is never loaded; a later save of that step cleans it."""
    root = _saved(tmp_path, steps=(2,))
    shutil.copytree(root / "step_000002", root / ".step_000004.tmp")
    (root / ".step_000004.tmp" / "manifest.json").unlink()
    assert load_checkpoint(root, restore_rng=False).step == 2
    model, opt, cursor = _setup()
    save_checkpoint(root, 4, model=model, optimizer=opt, data_cursor=cursor)
    assert not (root / ".step_000004.tmp").exists() and verify_checkpoint(root).name == "step_000004"


def test_environment_mismatch_warns_or_refuses(tmp_path, monkeypatch):
    """A different environment fingerprint warns with the fields; strict_env=True refuses."""
    root = _saved(tmp_path, steps=(2,))
    import samestep.checkpoint.load as load_mod

    real = load_mod.environment
    monkeypatch.setattr(load_mod, "environment", lambda: {**real(), "torch.version": "9.9.9"})
    with pytest.warns(RuntimeWarning, match=r"torch\.version \('.*' -> '9\.9\.9'\)"):
        loaded = load_checkpoint(root)
    assert "torch.version" in loaded.env_diff
    with pytest.raises(CheckpointError, match="torch.version"):
        load_checkpoint(root, strict_env=True)


def test_a_launchers_thread_variable_under_one_pinned_thread_count_is_recorded_not_refused(tmp_path, monkeypatch):
    """A checkpoint written under torchrun (OMP_NUM_THREADS=1) loads in a process without the variable at the
    same intra-op thread count, as deterministic mode pins it: no warning, strict_env=True loads it, and the
    difference is recorded in env_diff. Negative control: another intra-op thread count is refused by name."""
    import warnings

    import samestep.checkpoint.load as load_mod

    real = load_mod.environment()
    root = _saved(tmp_path, steps=(2,))
    saved = json.loads((root / "step_000002" / "state.json").read_text())["environment"]
    assert saved.get("threads.intra_op") is not None
    monkeypatch.setattr(load_mod, "environment", lambda: {**real, "env.OMP_NUM_THREADS": "7"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_checkpoint(root, strict_env=True)
    assert loaded.env_diff == {"env.OMP_NUM_THREADS": (saved.get("env.OMP_NUM_THREADS"), "7")}
    other = saved["threads.intra_op"] + 1
    monkeypatch.setattr(
        load_mod, "environment", lambda: {**real, "env.OMP_NUM_THREADS": "7", "threads.intra_op": other}
    )
    with pytest.raises(CheckpointError, match=r"env\.OMP_NUM_THREADS .*threads\.intra_op|threads\.intra_op.*env\.OMP"):
        load_checkpoint(root, strict_env=True)


def test_keep_deletes_old_checkpoints_and_tied_weights_load(tmp_path):
    """keep=2 leaves the two newest; the tied lm_head/wte weight is stored once and restored into both."""
    model, opt, cursor = _setup()
    for s in (1, 2, 3):
        save_checkpoint(tmp_path, s, model=model, optimizer=opt, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003"]
    stored = load_file(tmp_path / "step_000003" / "model.safetensors")
    assert ("lm_head.weight" in stored) != ("transformer.wte.weight" in stored)
    model2, _, _ = _setup(seed=5)
    load_checkpoint(tmp_path, model=model2, restore_rng=False)
    assert model2.lm_head.weight is model2.transformer.wte.weight
    assert torch.equal(model2.lm_head.weight, model.lm_head.weight)


def test_unstorable_state_is_refused_by_name(tmp_path):
    """State that would need pickle (an arbitrary object) is refused, naming the entry."""
    model, _, _ = _setup()
    with pytest.raises(ValueError, match="extra.fn"):
        save_checkpoint(tmp_path, 1, model=model, extra={"fn": object()})


def test_same_world_size_restores_rng_when_the_layout_matches(tmp_path):
    """restore_rng="same_world_size" restores RNG state written by as many ranks as now (here 1);
    without any restore the next draw differs (negative control)."""
    model, _, _ = _setup()
    torch.manual_seed(4)
    save_checkpoint(tmp_path, 1, model=model)
    expected = torch.rand(3)
    torch.manual_seed(99)
    load_checkpoint(tmp_path, restore_rng=False)
    assert not torch.equal(torch.rand(3), expected)
    torch.manual_seed(99)
    load_checkpoint(tmp_path, restore_rng="same_world_size")
    assert torch.equal(torch.rand(3).view(torch.int32), expected.view(torch.int32))


def _two_checkpoints(root: Path) -> tuple[str, str]:
    """Checkpoints at steps 1 and 2 of a small run; the state digests after each."""
    model, opt, cursor = _setup()
    digests = []
    for step in (1, 2):
        _steps(model, opt, cursor, step - 1, 1)
        save_checkpoint(root, step, model=model, optimizer=opt, data_cursor=cursor)
        digests.append(_digest(model, opt, cursor))
    return digests[0], digests[1]


def _resign(manifest_path: Path, change) -> None:
    """Edits a manifest and gives it a valid self-digest again (a malformed manifest that is not damaged)."""
    from samestep.checkpoint._format import manifest_digest

    manifest = json.loads(manifest_path.read_text())
    change(manifest)
    if isinstance(manifest, dict):
        manifest["manifest_sha256"] = manifest_digest(manifest)
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda m: m.pop("files"), "'files' is NoneType"),
        (lambda m: m.update(files=["model.safetensors"]), "'files' is list"),
        (
            lambda m: m["files"]["model.safetensors"].pop("size"),
            "the entry of 'model.safetensors' needs an integer 'size'",
        ),
        (
            lambda m: m["files"].update({"../../etc/passwd": {"size": 1, "sha256": "x"}}),
            "file name '../../etc/passwd' is not a plain name",
        ),
        (lambda m: m.update(world_size="two"), "'world_size' is 'two'"),
    ],
)
def test_a_malformed_manifest_is_named_and_resume_falls_back(tmp_path, change, needle):
    """A manifest with a valid self-digest but the wrong shape is a CheckpointError naming the field (no
    KeyError or AttributeError), and a resume with fallback loads the older good checkpoint. Negative
    control: the untouched newest checkpoint loads as itself."""
    root = tmp_path / "ckpt"
    first, second = _two_checkpoints(root)
    model, opt, cursor = _setup()
    assert load_checkpoint(root, model=model, optimizer=opt, data_cursor=cursor).step == 2
    _resign(root / "step_000002" / "manifest.json", change)
    with pytest.raises(CheckpointError, match=needle):
        verify_checkpoint(root)
    model, opt, cursor = _setup()
    with pytest.warns(RuntimeWarning, match="skipping corrupt checkpoint"):
        loaded = load_checkpoint(root, model=model, optimizer=opt, data_cursor=cursor, fallback=True)
    assert loaded.step == 1 and _digest(model, opt, cursor) == first


def test_state_json_without_its_fields_is_not_intact(tmp_path):
    """state.json without 'environment' (its digests rewritten to match) fails verify, naming the field."""
    from samestep.checkpoint._format import sha256_bytes

    root = tmp_path / "ckpt"
    _two_checkpoints(root)
    state_path = root / "step_000002" / "state.json"
    state = json.loads(state_path.read_text())
    del state["environment"]
    data = json.dumps(state).encode()
    state_path.write_bytes(data)
    _resign(
        root / "step_000002" / "manifest.json",
        lambda m: m["files"]["state.json"].update(size=len(data), sha256=sha256_bytes(data)),
    )
    with pytest.raises(CheckpointError, match=r"state.json: 'environment' is None, expected a dict"):
        verify_checkpoint(root)


@pytest.mark.parametrize("kind", ["directory", "fifo", "not utf-8", "outside the root", "older"])
def test_loaders_take_the_newest_committed_checkpoint_whatever_latest_says(tmp_path, kind):
    """`latest` is never what a loader goes by: a directory, a FIFO (never opened: it would hang), not
    UTF-8, a path that leaves the checkpoint root, or one naming the older step 1 (a crash between the
    commit of step 2 and the update of `latest`): verify and load use the newest committed checkpoint.
    Negative control: with step 2 gone, step 1 is taken."""
    import os

    root = tmp_path / "ckpt"
    _two_checkpoints(root)
    other = tmp_path / "other" / "step_000009"
    other.mkdir(parents=True)
    latest = root / "latest"
    latest.unlink()
    if kind == "directory":
        latest.mkdir()
    elif kind == "fifo":
        os.mkfifo(latest)
    elif kind == "not utf-8":
        latest.write_bytes(b"\xff\xfe step")
    elif kind == "outside the root":
        latest.write_text("../other/step_000009\n")
    else:
        latest.write_text("step_000001\n")
    assert verify_checkpoint(root) == root / "step_000002"
    model, opt, cursor = _setup()
    assert load_checkpoint(root, model=model, optimizer=opt, data_cursor=cursor).step == 2
    shutil.rmtree(root / "step_000002")
    assert verify_checkpoint(root) == root / "step_000001"


def test_a_failed_save_leaves_no_temporary_directory_and_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    """A write that fails mid-save (the disk full) raises one CheckpointError naming the file and the cause;
    the temporary directory is gone and the previous checkpoint is still latest and loads. Negative
    control: the same save with room succeeds."""
    import errno

    from samestep.checkpoint import files as files_mod

    root = tmp_path / "ckpt"
    first, _ = _two_checkpoints(root)
    shutil.rmtree(root / "step_000002")
    (root / "latest").write_text("step_000001\n")
    model, opt, cursor = _setup()
    real = files_mod.write_durable

    def full(path, data):
        if path.name == "optimizer.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(files_mod, "write_durable", full)
    with pytest.raises(
        CheckpointError,
        match=r"step_000002: not saved: writing .*optimizer.safetensors failed "
        r"\(No space left on device\)",
    ):
        save_checkpoint(root, 2, model=model, optimizer=opt, data_cursor=cursor)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    model2, opt2, cursor2 = _setup()
    assert load_checkpoint(root, model=model2, optimizer=opt2, data_cursor=cursor2).step == 1
    assert _digest(model2, opt2, cursor2) == first
    monkeypatch.setattr(files_mod, "write_durable", real)
    save_checkpoint(root, 2, model=model, optimizer=opt, data_cursor=cursor)
    assert verify_checkpoint(root) == root / "step_000002"


@pytest.mark.parametrize("point", ["temporary directory", "manifest", "commit rename", "latest"])
def test_a_full_disk_anywhere_in_a_save_leaves_nothing_partial(tmp_path, monkeypatch, point):
    """The disk fills at each write a save makes outside the tensor files (its temporary directory, the
    manifest, the commit's rename, ``latest``): one CheckpointError naming the file and the cause, and no
    ``.step_N.tmp``, ``.latest.tmp`` or ``.step_N.prune`` left; before the commit the previous checkpoint stays
    newest and loads, after it the new one does. Control: the same save with room succeeds."""
    import errno
    import os

    from samestep.checkpoint import _format
    from samestep.checkpoint import save as save_mod
    from samestep.records import durable

    root = tmp_path / "ckpt"
    first, second = _two_checkpoints(root)
    shutil.rmtree(root / "step_000002")
    (root / "latest").write_text("step_000001\n")
    model, opt, cursor = _setup()
    _steps(model, opt, cursor, 0, 2)

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    real_write, real_replace, real_mkdir = durable.write_durable, os.replace, Path.mkdir
    if point == "temporary directory":
        monkeypatch.setattr(
            Path, "mkdir", lambda self, *a, **k: full(self) if self.name.endswith(".tmp") else real_mkdir(self, *a, **k)
        )
    elif point == "manifest":
        monkeypatch.setattr(
            _format,
            "write_durable",
            lambda path, data: full(path) if path.name == "manifest.json" else real_write(path, data),
        )
    elif point == "commit rename":
        monkeypatch.setattr(
            save_mod.os, "replace", lambda a, b: full(b) if Path(b).name == "step_000002" else real_replace(a, b)
        )
    else:
        monkeypatch.setattr(
            durable,
            "write_durable",
            lambda path, data: full(path) if path.name == ".latest.tmp" else real_write(path, data),
        )
    with pytest.raises(
        CheckpointError,
        match=r"step_000002: (not saved|saved, but): .*No space left on device"
        if point != "latest"
        else r"step_000002: saved, but writing",
    ):
        save_checkpoint(root, 2, model=model, optimizer=opt, data_cursor=cursor)
    monkeypatch.undo()
    left = sorted(p.name for p in root.iterdir())
    assert not [n for n in left if n.startswith(".")], left
    model2, opt2, cursor2 = _setup()
    loaded = load_checkpoint(root, model=model2, optimizer=opt2, data_cursor=cursor2).step
    assert (loaded, _digest(model2, opt2, cursor2)) == ((2, second) if point == "latest" else (1, first))
    save_checkpoint(root, 2, model=model, optimizer=opt, data_cursor=cursor)
    assert verify_checkpoint(root) == root / "step_000002"


@pytest.mark.parametrize("odd", ["latest is a directory", "a file named like the step"])
def test_a_save_over_what_no_save_wrote_is_refused_before_writing(tmp_path, odd):
    """``checkpoints/latest`` as a directory, or a file named ``step_000002``: the save is refused naming it,
    before anything is written (nothing committed, no temporary left)."""
    root = tmp_path / "ckpt"
    _two_checkpoints(root)
    shutil.rmtree(root / "step_000002")
    if odd == "latest is a directory":
        (root / "latest").unlink()
        (root / "latest").mkdir()
    else:
        (root / "step_000002").write_text("not a checkpoint")
    before = sorted(p.name for p in root.iterdir())
    model, opt, cursor = _setup()
    with pytest.raises(CheckpointError, match="move it away"):
        save_checkpoint(root, 2, model=model, optimizer=opt, data_cursor=cursor)
    assert sorted(p.name for p in root.iterdir()) == before


def test_a_directory_in_place_of_a_tensor_file_falls_back_to_the_older_checkpoint(tmp_path):
    """``model.safetensors`` of the newest checkpoint is a directory: a loader with fallback skips it as it skips
    any damage and loads the older one, bit for bit; without fallback it names the file."""
    root = tmp_path / "ckpt"
    first, _ = _two_checkpoints(root)
    target = root / "step_000002" / "model.safetensors"
    target.unlink()
    target.mkdir()
    with pytest.raises(CheckpointError, match="model.safetensors: is a directory"):
        verify_checkpoint(root)
    model, opt, cursor = _setup()
    with pytest.warns(RuntimeWarning, match="skipping corrupt checkpoint"):
        assert load_checkpoint(root, model=model, optimizer=opt, data_cursor=cursor, fallback=True).step == 1
    assert _digest(model, opt, cursor) == first


def test_a_model_of_other_dtypes_than_its_checkpoint_is_refused_by_name(tmp_path):
    """A model cast after it was saved (saved as float64, built as float32 here): load_state_dict would cast
    the tensors and the run go on from other bits; refused, naming the tensor, both dtypes and the fix, before
    the model changes. Negative control: the model in the saved dtype loads to the saved bytes."""
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 2).double()
    save_checkpoint(tmp_path, 1, model=saved)
    here = torch.nn.Linear(4, 2)
    before = here.weight.detach().clone()
    with pytest.raises(
        CheckpointError, match=r"holds 'weight' as torch.float64, but the model here has it as torch.float32"
    ):
        load_checkpoint(tmp_path, model=here)
    assert torch.equal(here.weight.detach().view(torch.int32), before.view(torch.int32))
    here.double()
    load_checkpoint(tmp_path, model=here)
    assert torch.equal(here.weight.detach().view(torch.int64), saved.weight.detach().view(torch.int64))
