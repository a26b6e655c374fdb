"""Tensor parallelism in the reference run: parallel.tp and parallel.tp_chunks (docs/layouts.md, "Tensor
parallelism").

With parallel.tp_chunks set, every decoder block's linear layers are sharded with samestep's canonical styles
(``CanonicalColwiseParallel``, ``CanonicalRowwiseParallel``) over a mesh of the tensor-parallel ranks, a mesh
of one process included: the placements, and with them the bracketing of every sum (a layer's chunks, the
gradient norm's slices), are then the same at every degree. The token embedding and the output head are split
by vocabulary (``CanonicalVocabEmbedding``, a column-parallel head: the GPT's tied to the embedding's
sharded weight) and the loss is ``vocab_parallel_cross_entropy``. Position embeddings and norms stay whole on
every rank: their inputs and output gradients are whole and the same on every rank, so what they compute is
too, with no sum across ranks.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from samestep.train.config import Config
from samestep.train.config_values import not_with

__all__ = ["apply_tp", "check_tp", "data_ranks"]


def data_ranks(cfg: Config, world: int) -> int:
    """How many ranks split the data: the processes over the tensor- and pipeline-parallel degrees."""
    return world // (cfg.parallel.tp if cfg.parallel.tp_chunks else 1) // cfg.parallel.pp


def check_tp(cfg: Config, world: int, vocab: int | None = None) -> None:
    """Refuses a tensor-parallel config this run cannot keep on one numerical path, naming the fix
    (``vocab``: the model's vocabulary, where it is known).

    Raises:
        ValueError: the field, its value and what would do.
    """
    par, m, t = cfg.parallel, cfg.model, cfg.train
    if not par.tp_chunks:
        return
    from samestep.distributed.tensor_parallel import validate_tp  # loaded only for a TP run

    not_with(f"parallel.tp_chunks={par.tp_chunks}", {"train.compile=true": t.compile})
    head = m.n_embd // m.n_head
    dims = {"n_embd": m.n_embd, "n_head": m.n_head}
    if m.arch == "llama":
        dims |= {"n_kv_head": m.kv_heads, "n_kv_head x head size": m.kv_heads * head, "mlp width": m.mlp_width}
    else:
        dims |= {"4 x n_embd": 4 * m.n_embd}
    if par.sp:
        dims["model.block_size (parallel.sp)"] = m.block_size
    validate_tp(par.tp, par.tp_chunks, dims)
    if vocab is not None and vocab % par.tp_chunks:
        raise ValueError(
            f"model.vocab_size={vocab} (0: the data's) is not divisible by parallel.tp_chunks="
            f"{par.tp_chunks}: the embedding and the head split by vocabulary into whole chunks. Fix: "
            f"--set model.vocab_size={-(-vocab // par.tp_chunks) * par.tp_chunks}"
        )
    if world % par.tp:
        raise ValueError(
            f"parallel.tp={par.tp} does not divide the {world} process(es) into data ranks of "
            f"{par.tp} tensor ranks each. Fix: --nproc a multiple of {par.tp}"
        )


def _plan(model: nn.Module, chunks: int, sp: bool) -> dict[str, Any]:
    """The token embedding, each decoder block's linear layers and the Llama's head, each with its canonical
    style (fused projections split part by part; with ``sp`` the row-parallel layers' outputs cut to the
    rank's block of the sequence); the GPT's head is tied (see apply_tp)."""
    from samestep.distributed.tp_styles import (
        CanonicalColwiseParallel,
        CanonicalRowwiseParallel,
        CanonicalVocabEmbedding,
    )

    seq = 1 if sp else None  # with sequence parallelism the layers' outer sides are blocks of the sequence
    col, row = CanonicalColwiseParallel(chunks, sequence_dim=seq), CanonicalRowwiseParallel(chunks, sequence_dim=seq)
    if type(model).__name__ == "Llama":
        kv = CanonicalColwiseParallel(chunks, parts=2, sequence_dim=seq, fused="stacked")  # k, then v
        styles = {"attn.q": col, "attn.kv": kv, "attn.o": row}
        mlp = {"gate": col, "up": col, "down": row}
        blocks = model.layers  # type: ignore[attr-defined]
        prefix, ends = "layers", {"embed": CanonicalVocabEmbedding(chunks), "output": col}
    else:
        qkv = CanonicalColwiseParallel(chunks, parts=3, sequence_dim=seq, fused="stacked")  # q, then k, then v
        styles = {"attn.c_attn": qkv, "attn.c_proj": row}
        mlp = {"c_fc": col, "c_proj": row}
        blocks = model.transformer.h  # type: ignore[attr-defined]
        prefix, ends = "transformer.h", {"transformer.wte": CanonicalVocabEmbedding(chunks)}
    experts = model.cfg.moe_experts  # type: ignore[attr-defined]
    if experts:  # each expert split like the dense MLP; its rows are routed tokens, not a sequence
        plain = {
            name: (CanonicalRowwiseParallel(chunks) if style is row else CanonicalColwiseParallel(chunks))
            for name, style in mlp.items()
        }
        styles |= {f"mlp.experts.{e}.{name}": style for e in range(experts) for name, style in plain.items()}
    else:
        styles |= {f"mlp.{name}": style for name, style in mlp.items()}
    return ends | {f"{prefix}.{i}.{name}": style for i in range(len(blocks)) for name, style in styles.items()}


def _sequence_parallel(model: nn.Module, chunks: int, mesh: Any) -> None:
    """Splits the residual stream by sequence over the mesh (parallel.sp): every norm computes on the rank's
    block (the column-parallel layers after it gather it), and the modules that hold a ``sequence`` (the
    models, the attention and MLP, the MoE layer, a Llama block) learn the rank's block: they cut whole
    outputs, gather an MoE layer's input and key dropout by position. An expert's rows are routed tokens,
    so it keeps none."""
    import torch.nn.functional as F

    from samestep.distributed.sequence_parallel import parallelize_norm
    from samestep.distributed.tensor_parallel import sequence_shard

    shard = sequence_shard(mesh)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.LayerNorm):

            def normalize(x: Any, norm: nn.LayerNorm = module) -> Any:
                return F.layer_norm(x, norm.normalized_shape, None, None, norm.eps)

            parallelize_norm(module, normalize, chunks, shard)
        elif hasattr(module, "normalize"):  # the Llama's RMSNorm
            parallelize_norm(module, module.normalize, chunks, shard)
        if hasattr(module, "sequence") and ".experts." not in name:  # an expert's rows are routed tokens
            module.sequence = shard


def apply_tp(model: nn.Module, cfg: Config, world: int, rank: int, device_type: str, meshes: Any = None) -> Any:
    """Shards ``model``'s token embedding, decoder blocks and head over its rank's ``parallel.tp`` tensor ranks
    (one process: a mesh of one), sets its vocabulary-parallel loss and keys the GPT's attention dropout by
    head position; returns the process group of the data ranks
    that hold the same shards (None where there is one data rank). The processes form a (data, tensor) mesh,
    a data rank's tensor ranks consecutive (``meshes``: the (tensor, data) meshes of a job's larger mesh, a
    pipeline's, instead). A collective: every rank calls it, after the process group exists. Of a pipeline stage
    (train/pipeline.py) the modules it holds: the GPT's last stage shards its copy of the tied head alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    tp, chunks = cfg.parallel.tp, cfg.parallel.tp_chunks
    if meshes is not None:
        mesh, data = meshes
    elif world == tp:
        mesh, data = init_device_mesh(device_type, (tp,)), None
    else:
        grid = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("data", "tensor"))
        mesh, data = grid["tensor"], grid["data"]
    held = {name for name, _ in model.named_modules()}  # a pipeline stage holds some of them
    parallelize_module(model, mesh, {k: v for k, v in _plan(model, chunks, cfg.parallel.sp).items() if k in held})
    if getattr(model, "lm_head", None) is not None:  # the GPT's head: the embedding's weight, or a stage's copy
        from samestep.distributed.tp_styles import CanonicalColwiseParallel

        if "transformer.wte" in held:  # tied again to the embedding's sharded parameter
            model.lm_head.weight = model.transformer.wte.weight  # type: ignore[attr-defined]
        head = CanonicalColwiseParallel(chunks, sequence_dim=1 if cfg.parallel.sp else None)
        parallelize_module(model, mesh, {"lm_head": head})
    model.vocab_parallel = (chunks, mesh.get_group() if tp > 1 else None)  # type: ignore[assignment]
    mlp_width = cfg.model.mlp_width if cfg.model.arch == "llama" else 4 * cfg.model.n_embd
    for module in model.modules():
        if hasattr(module, "first_head"):
            module.first_head = (rank % tp) * (cfg.model.n_head // tp)
        if hasattr(module, "chunk_width"):  # an MLP's or expert's activation, chunk by chunk (model.chunkwise)
            module.chunk_width = mlp_width // chunks
    if cfg.parallel.sp:
        _sequence_parallel(model, chunks, mesh)
    return data
