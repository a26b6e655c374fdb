"""parallelize_experts: stacked experts (transformers' MixtralExperts) spread over the data ranks, on one rank
here: the spread layer's output and gradients are the module's own bits, in each of transformers' experts loops
(samestep.distributed.stacked_experts); its refusals. The same bits at EP 2 and 4: test_own_layouts."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from samestep.distributed import parallelize_experts
from tests.support import spawn


def _block(implementation: str, top_k: int) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(
        MixtralConfig(
            hidden_size=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=top_k,
            experts_implementation=implementation,
        )
    )
    for p in block.parameters():  # transformers leaves the stacked experts uninitialised until its model's init
        torch.nn.init.normal_(p, std=0.2)
    return block


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _step(block: torch.nn.Module, spread: object = None) -> list[torch.Tensor]:
    """Two microbatches through ``block`` (the second's gradients added to the first's): each output, the
    inputs' gradients and every parameter's gradient, whole."""
    outs = []
    for i in range(2):
        x = torch.randn(1, 24, 16, generator=torch.Generator().manual_seed(i), requires_grad=True)
        y = block(x)
        y.square().sum().backward()
        outs += [y, x.grad]
        if spread is not None:
            spread.accumulate()
    if spread is not None:
        spread.reduce()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in block.parameters()]
    return [_bits(t) for t in outs + grads]


def _one_rank(rank: int, init: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        for implementation in ("eager", "grouped_mm"):
            plain = _block(implementation, 3)
            spread = copy.deepcopy(plain)
            experts = parallelize_experts(spread, MixtralExperts, mesh, microbatches_per_process=2)
            assert type(spread.experts.gate_up_proj).__name__ == "DTensor"
            mine, own = _step(spread, experts), _step(plain)
            assert all(torch.equal(a, b) for a, b in zip(mine, own)), implementation
        # control: the eager loop's order on a grouped_mm module (three slots summed in expert order, not slot
        # order) gives other bits than the module's own
        plain = _block("grouped_mm", 3)
        spread = copy.deepcopy(plain)
        experts = parallelize_experts(spread, MixtralExperts, mesh, microbatches_per_process=2)
        experts.loop = "eager"
        assert not all(torch.equal(a, b) for a, b in zip(_step(spread, experts), _step(plain)))
    finally:
        dist.destroy_process_group()


def test_spread_experts_keep_the_module_bits_in_either_experts_loop(tmp_path):
    spawn(_one_rank, (str(tmp_path / "init"),), 1)


def _mesh(size: int, ndim: int = 1) -> SimpleNamespace:
    """What parallelize_experts reads of a mesh before it refuses (no process group needed)."""
    return SimpleNamespace(ndim=ndim, size=lambda: size, mesh_dim_names=("dp", "ep")[:ndim])


def test_parallelize_experts_refuses_by_name():
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    block = _block("grouped_mm", 2)
    with pytest.raises(ValueError, match="no module of class Linear. Fix: pass the class"):
        parallelize_experts(torch.nn.Sequential(torch.nn.ReLU()), torch.nn.Linear, _mesh(2), microbatches_per_process=1)
    with pytest.raises(ValueError, match=r"a mesh of 2 dimensions \('dp', 'ep'\).*Fix: pass a 1-D mesh"):
        parallelize_experts(block, MixtralExperts, _mesh(2, 2), microbatches_per_process=1)
    with pytest.raises(ValueError, match="4 experts over 3 ranks. Fix: a number of ranks that divides 4"):
        parallelize_experts(block, MixtralExperts, _mesh(3), microbatches_per_process=1)
    block.experts.config._experts_implementation = "batched_mm"
    with pytest.raises(ValueError, match="runs the 'batched_mm' experts implementation.*Fix: experts_impl"):
        parallelize_experts(block, MixtralExperts, _mesh(2), microbatches_per_process=1)
    block.experts.config._experts_implementation = "eager"
    block.experts.has_bias = True
    with pytest.raises(ValueError, match="has_bias\\) is not a gated transformers experts module.*Fix: pass expert="):
        parallelize_experts(block, MixtralExperts, _mesh(2), microbatches_per_process=1)
    assert type(block.experts.gate_up_proj).__name__ == "Parameter"  # nothing changed by a refusal
