"""torchtitan's entry point (``python -m torchtitan.train ARGS``) on this CPU: what torchtitan needs CUDA for stood
in for in the trainer process, never in the shipped module. Run by the torchtitan tests in-process
(``on_cpu``), and as a program under torchrun where a replay runs it again:

    torchrun --standalone --nproc_per_node 2 titan_on_cpu.py --module samestep.integrations.torchtitan ...

The stand-ins: torchtitan's device-type fallback ("cuda" on a CPU-only torch), its device memory monitor, the
device barrier of its timeout change, FlexAttention (no CPU backward), for which each block runs torchtitan's
own SDPA module, and NCCL's PREMUL_SUM in FSDP2's own reduce-scatter (gloo has none: a sum, then the scale).
"""

import sys
import types

import torch


def on_cpu() -> None:
    """The stand-ins, in a trainer process before torchtitan builds anything."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.llama3 as llama3
    import torchtitan.tools.utils as utils
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for module in (utils, metrics, dist_utils, parallel_dims):
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu
    for name, fn in {
        "get_device_name": lambda *a: "cpu",
        "memory_stats": lambda *a: {},
        "get_device_properties": lambda *a: types.SimpleNamespace(total_memory=1 << 34),
        "reset_peak_memory_stats": lambda *a: None,
        "empty_cache": lambda *a: None,
    }.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: torch.distributed.barrier()
    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    divide = collectives._get_gradient_divide_factors  # NCCL's PREMUL_SUM, which gloo refuses: a sum, then a scale
    collectives._get_gradient_divide_factors = lambda group, all_reduce, dtype, kind="", factor=None, _=False: divide(
        group, all_reduce, dtype, kind, factor, True
    )


if __name__ == "__main__":
    on_cpu()
    from torchtitan.train import main

    sys.argv = ["torchtitan.train", *sys.argv[1:]]
    main()
