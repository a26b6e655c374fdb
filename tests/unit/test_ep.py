"""Expert parallelism's refusals of what it cannot keep on one numerical path, each naming the field and the
fix."""

from __future__ import annotations

import pytest

from samestep.train import load_config
from samestep.train.expert_parallel import check_ep


@pytest.mark.parametrize(
    "settings,world,words",
    [
        (("model.moe_experts=0",), 2, "Fix: --set model.moe_experts=8"),
        (("parallel.tp_chunks=8",), 2, "parallel.tp_chunks is not supported yet"),
        (("parallel.pp=2",), 4, "parallel.pp is not supported yet"),
        (("model.moe_experts=6", "parallel.ep=4"), 4, "Fix: --set parallel.ep to a divisor of 6"),
        ((), 3, "Fix: --nproc a multiple of 2"),
        (("model.arch=gpt", "model.dropout=0.1"), 2, "Fix: --set model.dropout=0, or model.arch=llama"),
    ],
)
def test_expert_parallelism_refuses_what_it_cannot_keep_on_one_path_naming_the_fix(settings, world, words):
    cfg = load_config(None, ["parallel.ep=2", "model.arch=llama", "model.moe_experts=4", *settings])
    with pytest.raises(ValueError, match="parallel.ep=") as e:
        check_ep(cfg, world)
    assert words in str(e.value)
