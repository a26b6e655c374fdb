"""torchtitan's trainer on layouts through its own parallelize and pipelining functions, with samestep's canonical
styles and reductions in place of the order-free ones: tensor parallelism (TP 2, FSDP2 2 x TP 2) and pipeline
parallelism (PP 2, 1F1B and GPipe) give the one process's loss and grad-norm bits and checkpointed bytes, a run
killed on a layout resumes on one process to them, and torchtitan's own tensor and pipeline parallelism
(``--samestep.no-canonical``) end on other bytes than its one process; layouts it cannot keep are refused from
the config. Runs as tests/integration/test_torchtitan_trainer.py runs torchtitan (its helpers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_torchtitan_trainer import checkpointed, receipt_bits, seed, titan  # noqa: F401 (seed: a fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def own1(seed, tmp_path_factory) -> Path:
    """torchtitan's own order on one process (the controls' reference)."""
    dump = tmp_path_factory.mktemp("own1")
    titan(dump, "--samestep.no-canonical", seed=seed)
    return dump


TP = ("--samestep.tp_chunks", "8")  # the canonical tensor-parallel layers, cut alike on every layout


def test_tensor_parallelism_through_torchtitans_parallelize_gives_the_one_process_bits(seed, own1, tmp_path):
    """torchtitan's own parallelize function with samestep's canonical styles in place of its tensor-parallel
    step: TP 2 and FSDP2 2 x TP 2 give the loss and grad-norm bits of every step and the checkpointed model and
    optimizer bytes of one process (each with ``samestep.tp_chunks`` 8); a run killed at TP 2 in step 4 resumes
    from torchtitan's checkpoint on one process (without receipts, which are of the tensor ranks' shards) to
    the same bytes. Negative control: torchtitan's own tensor parallelism at TP 2 (``--samestep.no-canonical``:
    one matmul a rank, the partial sums all-reduced) ends on other bytes than its one process."""
    runs = {name: tmp_path / name for name in ("one", "tp2", "grid", "own2")}
    titan(runs["one"], *TP, seed=seed)
    titan(runs["tp2"], *TP, "--parallelism.tensor_parallel_degree", "2", nproc=2, seed=seed, kill_at=4)
    titan(runs["tp2"], *TP, "--samestep.no-receipts")
    titan(runs["grid"], *TP, "--parallelism.tensor_parallel_degree", "2", nproc=4, seed=seed)
    reference = checkpointed(runs["one"])
    assert len(receipt_bits(runs["one"])) == 4
    assert receipt_bits(runs["grid"]) == receipt_bits(runs["one"])
    assert receipt_bits(runs["tp2"]) == receipt_bits(runs["one"])[:3]  # the steps before the kill
    for name in ("tp2", "grid"):
        assert checkpointed(runs[name]) == reference, name
    titan(runs["own2"], "--samestep.no-canonical", "--parallelism.tensor_parallel_degree", "2", nproc=2, seed=seed)
    assert checkpointed(runs["own2"]) != checkpointed(own1)


PP = (
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--training.local_batch_size",
    "4",
    "--parallelism.pipeline_parallel_microbatch_size",
    "2",
)  # 2 schedule calls of 2 microbatches a step


def test_pipeline_parallelism_through_torchtitans_pipelining_gives_the_one_process_bits(seed, own1, tmp_path):
    """torchtitan's own pipelining function (its model split, its stages, PyTorch's schedule), each stage's
    microbatch gradients handed to samestep's canonical tree as their backwards end: PP 2 under 1F1B gives the
    loss and grad-norm bits of every step and the checkpointed model and optimizer bytes of one process (local
    batches of 2); a PP 2 run under GPipe killed in step 4 resumes on one process (without receipts, which are
    of the stages' parts) to the same bytes. Negative control: torchtitan's own pipeline parallelism
    (``--samestep.no-canonical``: gradients added into ``p.grad`` as microbatches arrive, the stages' norms
    combined) ends on other bytes than its one process."""
    runs = {name: tmp_path / name for name in ("one", "pp", "gpipe", "own")}
    titan(runs["one"], seed=seed)
    titan(runs["pp"], *PP, "--parallelism.pipeline_parallel_schedule", "1F1B", nproc=2, seed=seed)
    titan(runs["gpipe"], *PP, "--parallelism.pipeline_parallel_schedule", "GPipe", nproc=2, seed=seed, kill_at=4)
    titan(runs["gpipe"], "--samestep.no-receipts")
    assert len(receipt_bits(runs["one"])) == 4
    assert receipt_bits(runs["pp"]) == receipt_bits(runs["one"])
    assert receipt_bits(runs["gpipe"]) == receipt_bits(runs["one"])[:3]  # the steps before the kill
    reference = checkpointed(runs["one"])
    for name in ("pp", "gpipe"):
        assert checkpointed(runs[name]) == reference, name
    titan(
        runs["own"],
        "--samestep.no-canonical",
        *PP,
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        nproc=2,
        seed=seed,
    )
    assert checkpointed(runs["own"]) != checkpointed(own1)


def test_a_layout_it_cannot_keep_is_refused_from_the_config_before_anything_is_built(tmp_path):
    """Tensor parallelism without ``samestep.tp_chunks``, a chunk count not a power of two, another SPMD backend,
    a pipeline schedule that is not one full backward per microbatch in order (torchtitan's default
    Interleaved1F1B), pipeline stages beside tensor ranks or data ranks, and context parallelism: one line each,
    naming the field, the value and the fix, before torchtitan makes a process group or a model. Negative
    controls: the same configs with ``tp_chunks``, and with a 1F1B schedule alone, pass the check and fail later,
    in torchtitan (no process group here)."""
    from samestep.integrations.torchtitan import SamestepTrainer
    from samestep.integrations.torchtitan.config_registry import llama3_debugmodel

    def build(
        tp: int = 1,
        chunks: int = 0,
        backend: str = "partial_dtensor",
        pp: int = 1,
        schedule: str = "Interleaved1F1B",
        shard: int = -1,
        cp: int = 1,
    ) -> None:
        config = llama3_debugmodel()
        config.dump_folder = str(tmp_path)
        par = config.parallelism
        par.tensor_parallel_degree, par.pipeline_parallel_degree, par.pipeline_parallel_schedule = tp, pp, schedule
        par.data_parallel_shard_degree, par.context_parallel_degree = shard, cp
        par.spmd_backend, config.samestep.tp_chunks = backend, chunks
        SamestepTrainer(config)

    for kwargs, words in (
        ({"tp": 2}, "tensor_parallel_degree = 2 needs samestep's canonical"),
        ({"tp": 2, "chunks": 6}, "samestep.tp_chunks = 6 is not a power of two"),
        ({"tp": 2, "chunks": 8, "backend": "spmd_types"}, "not spmd_types. Fix:"),
        ({"pp": 2}, "pipeline_parallel_schedule = Interleaved1F1B is not supported"),
        (
            {"pp": 2, "schedule": "1F1B", "tp": 2, "chunks": 8},
            "pipeline_parallel_degree = 2 with parallelism.tensor_parallel_degree = 2 is not supported",
        ),
        (
            {"pp": 2, "schedule": "GPipe", "shard": 2},
            "with parallelism.data_parallel_shard_degree = 2 is not supported yet",
        ),
        ({"cp": 2}, "parallelism.context_parallel_degree = 2 (context parallelism) is not"),
    ):
        with pytest.raises(ValueError, match="SamestepTrainer") as e:
            build(**kwargs)
        assert words in str(e.value) and "\n" not in str(e.value), (kwargs, str(e.value))
    for kwargs in ({"tp": 2, "chunks": 8}, {"pp": 2, "schedule": "1F1B"}):
        with pytest.raises(Exception) as e:
            build(**kwargs)
        assert "SamestepTrainer" not in str(e.value), (kwargs, str(e.value))
