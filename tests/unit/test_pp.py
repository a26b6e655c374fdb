"""Pipeline parallelism's parts that need no process group: the stages' blocks, the refusals of what a pipeline
cannot keep on one numerical path (each naming the field and the fix), the generator state a stage hands on."""

from __future__ import annotations

import pytest
import torch

from samestep.determinism import rng
from samestep.train import load_config
from samestep.train.pipeline import check_pp, stage_blocks


def test_stages_take_consecutive_blocks_the_first_ones_longer():
    assert stage_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_blocks(4, 4) == [range(i, i + 1) for i in range(4)]
    assert [i for r in stage_blocks(7, 3) for i in r] == list(range(7))


@pytest.mark.parametrize(
    "settings,world,words",
    [
        (("parallel.tp_chunks=8", "parallel.tp=2"), 6, "Fix: --nproc a multiple of 4"),
        (
            ("parallel.fsdp=true",),
            4,
            "parallel.fsdp with model.arch=gpt (its head tied to the embedding across stages) is not supported yet",
        ),
        (
            ("parallel.fsdp=true", "model.arch=llama", "parallel.tp_chunks=8"),
            4,
            "parallel.fsdp with parallel.tp_chunks is not supported yet",
        ),
        (("train.compile=true",), 2, "train.compile is not supported yet"),
        (("train.sdc_check_every=2",), 2, "train.sdc_check_every is not supported yet"),
        (("model.n_layer=2", "parallel.pp=4"), 4, "Fix: --set parallel.pp=2 or fewer"),
        (("parallel.pp=2",), 3, "Fix: --nproc a multiple of 2"),
        (
            ("train.global_batch=2", "train.micro_batch=1", "parallel.pp=4", "model.n_layer=4"),
            4,
            "Fix: --set parallel.pp_schedule=gpipe",
        ),
    ],
)
def test_a_pipeline_refuses_what_it_cannot_keep_on_one_path_naming_the_fix(settings, world, words):
    cfg = load_config(None, ["parallel.pp=2", *settings])
    with pytest.raises(ValueError, match="parallel.pp=") as e:
        check_pp(cfg, world)
    assert words in str(e.value)


def test_one_stage_is_no_pipeline_and_gpipe_takes_fewer_microbatches_than_stages():
    check_pp(load_config(None, ["parallel.tp_chunks=8", "train.compile=true"]), 3)
    check_pp(
        load_config(
            None,
            [
                "train.global_batch=2",
                "train.micro_batch=1",
                "parallel.pp=4",
                "model.n_layer=4",
                "parallel.pp_schedule=gpipe",
            ],
        ),
        4,
    )


@pytest.mark.parametrize(
    "setting,words",
    [("parallel.pp=0", "parallel.pp"), ("parallel.pp_schedule=interleaved1f1b", "parallel.pp_schedule")],
)
def test_the_config_refuses_a_degree_below_one_and_an_unknown_schedule(setting, words):
    with pytest.raises(ValueError, match=words):
        load_config(None, [setting])


def test_a_generator_state_handed_on_draws_what_the_generator_would_have():
    """The stages' dropout: a generator's state taken after some draws and set into a fresh generator (as a
    tensor of its own: ``set_state`` reads its storage from the start) draws the same next masks, bit for bit;
    a fresh generator of the same key does not."""
    gen = rng.generator(7, 3, 1, "dropout")
    torch.empty(100).bernoulli_(0.9, generator=gen)
    handed = torch.stack([torch.zeros_like(gen.get_state()), gen.get_state()])[1].clone()
    after = torch.Generator()
    after.set_state(handed)
    expected = torch.empty(1000).bernoulli_(0.9, generator=gen)
    assert torch.equal(torch.empty(1000).bernoulli_(0.9, generator=after).view(torch.int32), expected.view(torch.int32))
    fresh = rng.generator(7, 3, 1, "dropout")
    assert not torch.equal(torch.empty(1000).bernoulli_(0.9, generator=fresh), expected)


@pytest.mark.parametrize(
    "layout,rank,words",
    [
        ({"world_size": 4}, 3, None),
        ({"world_size": 4, "pipeline_parallel": 2}, 3, "data rank 1, pipeline stage 1"),
        (
            {"world_size": 8, "pipeline_parallel": 2, "tensor_parallel": 2},
            6,
            "data rank 1, pipeline stage 1, tensor rank 0",
        ),
        ({"world_size": 4, "expert_parallel": 2}, 3, "data rank 3, expert rank 1 of group 1"),
    ],
)
def test_a_rank_is_named_by_its_place_in_the_layout(layout, rank, words):
    """What diff and bisect say of a rank: its data rank, pipeline stage, tensor rank and expert rank, of the
    dimensions over one (a data rank's stages consecutive, a stage's tensor ranks consecutive)."""
    from samestep.analysis.layouts import rank_coordinates

    assert rank_coordinates(layout, rank) == words
