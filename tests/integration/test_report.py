"""samestep report: pictures of real run directories, with the first divergent step marked."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from samestep.analysis import DiffError
from samestep.analysis.report import KIND_COLOURS, make_report
from tests.support import cli_here, train_here

pytest.importorskip("matplotlib")  # a test extra: `make test` installs it
SETTINGS = ("train.steps=4", "train.warmup_steps=1", "train.checkpoint_every=0", "trace.level=op", "trace.steps=1-2")
PERTURB = "trace.perturb=rank=0,step=2,microbatch=1,phase=forward,scope=lm_head,op=aten.mm.default"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("report")
    out = {name: root / name for name in ("a", "twin", "ulp")}
    for name, extra in (("a", ()), ("twin", ()), ("ulp", (PERTURB,))):
        train_here(out[name], *SETTINGS, *extra)
    return out


def _has_colour(png: Path, hex_colour: str) -> bool:
    """Whether the picture holds pixels of this colour (the marker of the first divergent step)."""
    import matplotlib.image

    pixels = matplotlib.image.imread(png)[..., :3]
    want = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return bool((np.abs(pixels - want).max(axis=-1) < 0.05).any())


def test_a_report_of_two_diverging_runs_marks_the_step_and_names_the_origin(runs, tmp_path):
    """The report of a run and the same run with one ULP planted at step 2 marks step 2 on the curves
    (pixels of the marker's colour), shows the origin op and its module and the per-rank map, and writes
    the page and two PNG files. Negative control: two identical runs give no marker, and say identical."""
    result = make_report([runs["a"], runs["ulp"]], tmp_path / "out" / "report.html")
    assert result["verdict"] == "diverged" and result["first_divergent_step"] == 2
    page = (tmp_path / "out" / "report.html").read_text()
    assert "verdict: diverged" in page and "<code>aten.mm.default</code> in <code>lm_head</code>" in page
    assert page.count("data:image/png;base64,") == 2
    curves, ranks = (Path(p) for p in result["pngs"])
    assert curves.name == "report_curves.png" and ranks.name == "report_ranks.png"
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in (curves, ranks))
    assert _has_colour(curves, KIND_COLOURS["origin"]) and _has_colour(ranks, KIND_COLOURS["origin"])
    same = make_report([runs["a"], runs["twin"]], tmp_path / "same.html")
    assert same["verdict"] == "identical" and same["first_divergent_step"] is None
    assert not _has_colour(Path(same["pngs"][0]), KIND_COLOURS["origin"])
    assert "verdict: identical" in (tmp_path / "same.html").read_text()


def test_one_run_is_drawn_and_bad_input_is_one_line(runs, tmp_path):
    """One run: its curves only (nothing to compare). A directory that is no run: exit 2, one line naming
    it, nothing written. Without matplotlib: a clear error with the fix."""
    one = make_report([runs["a"]], tmp_path / "one.html")
    assert one["verdict"] is None and [Path(p).name for p in one["pngs"]] == ["one_curves.png"]
    proc = cli_here("report", str(runs["a"]), str(tmp_path / "nope"), "--out", str(tmp_path / "bad.html"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"samestep report: error: {tmp_path / 'nope' / 'run.json'}: missing; "
        f"{tmp_path / 'nope'} is not a samestep run directory"
    ]
    assert not (tmp_path / "bad.html").exists()


def test_without_matplotlib_the_error_names_the_fix(runs, tmp_path, monkeypatch):
    """matplotlib is optional (samestep[report]): without it, make_report says what to install."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(DiffError, match=r"pip install 'samestep\[report\]'"):
        make_report([runs["a"]], tmp_path / "x.html")


def test_the_pictures_show_a_divergence_the_losses_do_not_yet(tmp_path):
    """A bit flipped in a weight after step 2's update changes the state from step 2, the loss only from step 3:
    the figure's state row marks step 2 (red), its title names step 2 and where the trace saw it first, and
    the report says the receipts' states first differ at 2. A loop of one's own, with no metrics.jsonl, gets
    its curves from the receipts' bits of run.metric("loss"). Control: two identical runs mark no state."""
    import torch

    import samestep
    from tests.support import TINY

    fault = "train.fault=param:rank=0,step=2,name=transformer.h.0.mlp.c_fc.weight,bit=20"
    for name, extra in (("a", ()), ("b", (fault,)), ("c", ())):
        train_here(tmp_path / name, *TINY, "trace.level=step", *extra)
    result = make_report([tmp_path / "a", tmp_path / "b"], tmp_path / "flip.html", force=True)
    assert result["state_differs_at"] == 2 and result["first_divergent_step"] == 2
    assert result["title"].startswith("first divergent step: 2;"), result["title"]
    assert _has_colour(Path(result["pngs"][0]), KIND_COLOURS["origin"])
    same = make_report([tmp_path / "a", tmp_path / "c"], tmp_path / "same.html")
    assert same["state_differs_at"] is None and not _has_colour(Path(same["pngs"][0]), KIND_COLOURS["origin"])

    for name in ("own_a", "own_b"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with samestep.Run(tmp_path / name, model=model, optimizer=opt) as run:
            for step in run.steps(3):
                loss = model(torch.ones(2, 4) * step).square().mean()
                loss.backward()
                run.metric("loss", loss)
                opt.step()
                opt.zero_grad()
    own = make_report([tmp_path / "own_a", tmp_path / "own_b"], tmp_path / "own.html")
    assert [Path(p).name for p in own["pngs"]][0] == "own_curves.png" and own["verdict"] == "identical"
