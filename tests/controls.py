"""Patches that take one mechanism out of `samestep train` (each a module-level function, for ``train_ranks``'s
``patch``): the negative controls that show a layout or resume claim rests on that mechanism. A layout control
runs the patched path on one process and on the layout, and the two must differ."""

from __future__ import annotations


def resume_without_the_optimizer() -> None:
    """A ``train_ranks`` patch (a negative control): a resume restores every part of the checkpoint but the
    optimizer's state."""
    from samestep.train import resume

    load = resume.load_checkpoint
    resume.load_checkpoint = lambda root, **kw: load(root, **{**kw, "optimizer": None})


def resume_without_the_optimizer_unchecked() -> None:
    """As ``resume_without_the_optimizer``, with the resume's checks lifted (they refuse or stop such a resume):
    of the restored state against the receipts, and of each step computed again against its old receipt
    (``records.resume_check``), so the run goes on from what it restored."""
    from samestep.records import receipt_writer

    resume_without_the_optimizer_restored_unchecked()
    receipt_writer.receipts_after = lambda *args, **kw: []


def resume_without_the_optimizer_restored_unchecked() -> None:
    """As ``resume_without_the_optimizer``, with only the check of the restored state against the receipts
    lifted: the steps computed again are still checked against their old receipts."""
    from samestep.train import loop

    resume_without_the_optimizer()
    loop.check_run_files = lambda *args, **kw: None


def plain_tensor_parallel_sums() -> None:
    """The tensor-parallel layers' sums across chunks as PyTorch's row-parallel style leaves them: each rank adds
    its chunks' products in turn, and an all-reduce adds the ranks' sums (with sequence parallelism, each rank
    keeps its block of that sum), instead of the canonical tree."""
    import torch.distributed as dist

    from samestep.distributed import tensor_parallel

    def in_turn(leaves):
        total = leaves[0]
        for leaf in leaves[1:]:
            total = total + leaf
        return total

    def plain(leaves, group=None):
        total = in_turn(leaves)
        if group is not None:
            dist.all_reduce(total, group=group)
        return total

    def plain_block(leaves, shard, dim=1):
        total = plain(leaves, shard.group)
        return total if shard.group is None else total.chunk(shard.degree, dim)[shard.rank].contiguous()

    tensor_parallel.tree_across_ranks, tensor_parallel.tree_to_block = plain, plain_block


def plain_norm_gradients() -> None:
    """A norm's weight and bias gradients as PyTorch's SequenceParallel leaves them: each rank sums its block of
    the sequence at once, and an all-reduce adds the ranks' sums."""
    import torch.distributed as dist

    from samestep.distributed import sequence_parallel

    def backward(ctx, grad):
        y, weight = ctx.saved_tensors
        dims = tuple(range(grad.dim() - 1))
        sums = [(grad * y).sum(dims)] + ([grad.sum(dims)] if ctx.has_bias else [])
        if ctx.group is not None:
            for t in sums:
                dist.all_reduce(t, group=ctx.group)
        return (
            (grad * weight).to(y.dtype),
            sums[0].to(weight.dtype),
            sums[1].to(weight.dtype) if ctx.has_bias else None,
            None,
            None,
        )

    sequence_parallel._Affine.backward = staticmethod(backward)
