"""`samestep verify` and `samestep bisect` on loops of one's own: a samestep.Run program (tests/programs/
replayed_loop.py, copied into the test's directory, its working tree) run as a user runs it, with python or
torchrun, is run again from its recorded command under a replay request."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forgery import flip_a_weight, reseal, rewrite_receipts
from tests.support import cli_here

pytestmark = pytest.mark.slow

PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "replayed_loop.py"


def _start(where: Path, name: str, *args: str, nproc: int = 1) -> subprocess.Popen:
    """The program into ``where / name``, as a user starts it there: ``python replayed_loop.py`` (``torchrun
    --nproc_per_node nproc`` for several processes)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
    env = {k: v for k, v in os.environ.items() if k != "SAMESTEP_REPLAY"}
    return subprocess.Popen(
        [sys.executable, *launcher, "replayed_loop.py", name, *args],
        cwd=where,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def _finish(*procs: subprocess.Popen) -> list[str]:
    """Each program's printed digest, once it has ended (exit 0)."""
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(stdout.split()[-1])
    return out


def _json(proc: subprocess.CompletedProcess, code: int) -> dict:
    assert proc.returncode == code, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The program's working tree with two deterministic runs of 4 steps, a and b, made side by side; a's final
    digest is in ``a.digest``."""
    root = tmp_path_factory.mktemp("own")
    shutil.copy(PROGRAM, root)
    digest, _ = _finish(_start(root, "a"), _start(root, "b"))
    (root / "a.digest").write_text(digest)
    return root


def test_verify_replays_an_own_loop_and_catches_a_forged_checkpoint_or_loss_and_a_changed_program(runs, tmp_path):
    """run.json records the program (its argv, directory, launcher and the script's hash); verify runs it again
    from the checkpoint before step 3 and steps 3-4 reproduce. Negative controls: a weight flipped in the
    checkpoint of step 2 and resealed is not the run's; a loss edited in the receipts with the chain rehashed
    is NOT REPRODUCED at its step; the script edited since is refused by name (exit 2), and with --force
    replayed, its receipts equal but the verdict not "reproduced" (exit 1): other code than the run's ran."""
    program = json.loads((runs / "a" / "run.json").read_text())["programs"][0]
    assert program["argv"][1:] == ["replayed_loop.py", "a"] and (program["cwd"], program["run_dir"]) == (str(runs), "a")
    assert program["launcher"]["name"] == "python" and set(program["sources"]) == {"replayed_loop.py"}
    report = _json(cli_here("verify", "--yes", str(runs / "a"), "--steps", "3-4", "--json"), 0)
    assert report["reproduced"] and report["replayed_from"] == 2 and report["compared"] == 2
    said = cli_here("verify", "--yes", str(runs / "a"), "--steps", "3-4")
    sha = hashlib.sha256((runs / "replayed_loop.py").read_bytes()).hexdigest()
    assert said.returncode == 0 and f"reproduced by replayed_loop.py sha256:{sha[:12]}" in said.stdout, said.stdout
    assert report["by"]["files"] == {"replayed_loop.py": sha}

    forged = runs / "forged"
    shutil.copytree(runs / "a", forged)
    step_dir = forged / "checkpoints" / "step_000002"
    reseal(step_dir, "model.safetensors", flip_a_weight((step_dir / "model.safetensors").read_bytes()))
    proc = cli_here("verify", "--yes", str(forged), "--steps", "3-4")
    assert proc.returncode == 1 and "NOT THE RUN'S: the checkpoint of step 2" in proc.stdout, proc.stdout + proc.stderr
    shutil.rmtree(forged)
    shutil.copytree(runs / "a", forged)
    rewrite_receipts(forged / "receipts" / "rank_00000.jsonl", lambda rs: rs[3].update(loss_hex=(0.5).hex()))
    proc = cli_here("verify", "--yes", str(forged), "--steps", "4")
    assert proc.returncode == 1 and "NOT REPRODUCED: step 4 (rank 0): loss" in proc.stdout, proc.stdout + proc.stderr
    shutil.rmtree(forged)

    edited = tmp_path / "tree"
    shutil.copytree(runs, edited, ignore=shutil.ignore_patterns("b", "forged"))
    doc = json.loads((edited / "a" / "run.json").read_text())
    doc["programs"][0]["cwd"] = str(edited)  # the same tree, moved: its script edited since
    (edited / "a" / "run.json").write_text(json.dumps(doc))
    with open(edited / "replayed_loop.py", "a") as f:
        f.write("# edited\n")
    proc = cli_here("verify", "--yes", str(edited / "a"), "--steps", "4")
    assert proc.returncode == 2 and "replayed_loop.py: edited since the run" in proc.stderr, proc.stderr
    forced = _json(cli_here("verify", "--yes", str(edited / "a"), "--steps", "4", "--force", "--json"), 1)
    assert not forced["reproduced"] and forced["first_mismatch"] is None, forced  # the receipts agree, ...
    assert forced["program_differs"] == ["replayed_loop.py: edited since the run"], forced  # ... by other code
    assert any("replayed as it is now (--force)" in n for n in forced["notes"])


def test_bisect_names_step_s_of_a_parameter_planted_there_and_diff_points_to_bisect(runs, tmp_path):
    """One ULP added to a head weight after step 3's update: diff names step 3 and sends the user to bisect,
    and bisect (both programs replayed from step 2, step 3 at op level) names step 3. Control: the two
    unplanted runs are identical to bisect, with no replay."""
    shutil.copy(PROGRAM, tmp_path)
    _finish(_start(tmp_path, "planted", "--plant-step", "3"))
    diff = cli_here("diff", str(runs / "a"), str(tmp_path / "planted"))
    assert diff.returncode == 1 and diff.stdout.startswith("diverged at step 3") and "samestep bisect" in diff.stdout, (
        diff.stdout
    )
    report = _json(cli_here("bisect", "--yes", str(runs / "a"), str(tmp_path / "planted"), "--json"), 1)
    assert report["first_divergent_step"] == 3 and report["replayed_from"] == 2, report["summary"]
    same = _json(cli_here("bisect", "--yes", str(runs / "a"), str(runs / "b"), "--json"), 0)
    assert same["identical"] and same["attempts"] == 0, same["summary"]


def test_bisect_names_a_real_race_in_an_own_loops_lookup(tmp_path):
    """Two runs of the program with deterministic mode off at 2 threads: the lookup's backward (index_put with
    accumulation over 65,536 elements) races. bisect finds the first step whose receipts differ, replays both
    programs from the checkpoint before it with op tracing of that step, and names aten.index_put in the
    lookup's backward on rank 0. (Its control, deterministic mode on: the pair above is identical.)"""
    shutil.copy(PROGRAM, tmp_path)
    for attempt in range(3):  # the race is real; a pair can (rarely) agree on every step, or a replay not race
        a, b = f"a{attempt}", f"b{attempt}"
        _finish(_start(tmp_path, a, "--nondeterministic"), _start(tmp_path, b, "--nondeterministic"))
        proc = cli_here("bisect", "--yes", str(tmp_path / a), str(tmp_path / b), "--json")
        assert proc.returncode in (0, 1), proc.stderr
        report = json.loads(proc.stdout)
        if proc.returncode == 1 and report["reproduced"]:
            break
    assert proc.returncode == 1 and report["reproduced"], report["summary"]
    o = report["origin"]
    assert o["op"].startswith("aten.index_put") and o["scope"] == "embed" and o["phase"] == "backward", o
    assert o["inputs_matched"] and o["step"] == report["first_divergent_step"] and o["rank"] == 0
    assert report["replayed_from"] == report["first_divergent_step"] - 1


def test_bisect_names_the_rank_of_a_difference_in_a_ddp_loop_under_torchrun(runs, tmp_path):
    """The program on 2 processes under torchrun (DDP, the canonical reduction), step 2 traced at op level; one
    run with one ULP planted on rank 1 in microbatch 1's head backward: run.json records torchrun and 2
    processes a node, and bisect relaunches both under torchrun and names the op, module, microbatch and rank 1.
    Control: the unplanted 2-process run ends on run a's parameters (one process), the planted one elsewhere."""
    shutil.copy(PROGRAM, tmp_path)
    plant = "rank=1,step=2,microbatch=1,phase=backward,scope=module.head,op=aten.mm.default,occurrence=0"
    two, planted = _finish(
        _start(tmp_path, "two", "--trace-steps", "2", nproc=2),
        _start(tmp_path, "planted", "--trace-steps", "2", "--perturb", plant, nproc=2),
    )
    assert two == (runs / "a.digest").read_text() != planted
    launcher = json.loads((tmp_path / "two" / "run.json").read_text())["programs"][0]["launcher"]
    assert launcher == {"name": "torchrun", "nproc_per_node": 2, "nnodes": 1}
    report = _json(cli_here("bisect", "--yes", str(tmp_path / "two"), str(tmp_path / "planted"), "--json"), 1)
    o = report["origin"]
    assert (o["step"], o["rank"], o["microbatch"], o["phase"], o["scope"], o["op"]) == (
        2,
        1,
        1,
        "backward",
        "module.head",
        "aten.mm.default",
    ), report["summary"]
