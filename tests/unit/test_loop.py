"""The reference loop's own pieces: clipping (samestep.distributed.clip_grad_norm_, out of place in the loop),
and the gradients its step level records."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import samestep
from samestep.digests import digest
from samestep.distributed import clip_grad_norm_
from samestep.loop.data import load_corpus
from samestep.tracing import read_stream, stream_path
from samestep.train import load_config
from samestep.train import trainer as trainer_module
from tests.support import TINY, spawn

SHAPES = [(7, 5), (5,), (3, 4, 2), ()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32)


def _params_on(buf: torch.Tensor) -> list[torch.nn.Parameter]:
    """Parameters whose gradients are views of one buffer, as the gradient reduction leaves them."""
    params, offset = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES], 0
    for p in params:
        p.grad = buf[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e6, float("inf")])
@pytest.mark.parametrize("special", [None, float("inf"), float("nan")])
def test_clip_out_of_place_has_the_bits_of_clip_grad_norm_and_leaves_the_gradients(max_norm, special):
    """The loop clips out of place (``clip_grad_norm_(..., out_of_place=True)``) so that the recorder can
    digest the reduced gradients where they lie: the norm and the clipped gradients have PyTorch's
    ``clip_grad_norm_``'s bits (``foreach=False``) on these shapes, with the limit active, inactive and off,
    and with a non-finite gradient; the buffer the gradients were views of keeps its bits and its version.
    samestep's in place gives the same bits. Negative control: clipped in place, an active limit changes
    that buffer."""
    torch.manual_seed(0)
    flat = torch.randn(sum(math.prod(s) for s in SHAPES)) * 3
    if special is not None:
        flat[4] = special
    ours_buf, ref_buf = flat.clone(), flat.clone()
    ours, ref = _params_on(ours_buf), _params_on(ref_buf)
    version = ours_buf._version
    norm = clip_grad_norm_(ours, max_norm, out_of_place=True)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=False)
    in_place_buf = flat.clone()
    in_place = _params_on(in_place_buf)
    assert torch.equal(_bits(clip_grad_norm_(in_place, max_norm)), _bits(ref_norm))
    for a, b in zip(in_place, ref):
        assert torch.equal(_bits(a.grad), _bits(b.grad))
    assert torch.equal(_bits(norm), _bits(ref_norm))
    for a, b in zip(ours, ref):
        assert torch.equal(_bits(a.grad), _bits(b.grad))
    assert ours_buf._version == version and torch.equal(_bits(ours_buf), _bits(flat))
    if max_norm == 0.5:
        assert not torch.equal(_bits(ref_buf), _bits(flat))


def _clip_dtensors(rank: int, init: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        locals_ = [torch.randn(6, 4), torch.randn(4, 6), torch.randn(5)]
        placements = [Shard(0), Shard(1), Replicate()]

        def params() -> list[torch.nn.Parameter]:
            out = []
            for g, place in zip(locals_, placements):
                p = torch.nn.Parameter(DTensor.from_local(torch.zeros_like(g), mesh, [place]))
                p.grad = DTensor.from_local(g.clone(), mesh, [place])
                out.append(p)
            return out

        kept, scaled = params(), params()
        before = [p.grad for p in kept]
        norm = clip_grad_norm_(kept, 0.5, out_of_place=True)
        assert torch.equal(_bits(clip_grad_norm_(scaled, 0.5)), _bits(norm))
        coef = float(torch.clamp(0.5 / (norm + 1e-6), max=1.0))
        assert coef < 1.0
        for g, old, p, q, place in zip(locals_, before, kept, scaled, placements):
            assert isinstance(p.grad, DTensor) and p.grad.placements == (place,) and p.grad is not old
            assert torch.equal(_bits(old.to_local()), _bits(g))  # out of place: the old gradient as it was
            for got in (p.grad, q.grad):
                assert torch.equal(_bits(got.to_local()), _bits(g * coef)), place
                assert not torch.equal(_bits(got.to_local()), _bits(g))
    finally:
        dist.destroy_process_group()


def test_clipping_scales_dtensor_gradients_on_their_shards(tmp_path):
    """Tensor-parallel gradients (DTensors placed Shard(0), Shard(1) and Replicate, on a mesh of one process)
    clipped in place and out of place: each becomes a DTensor of the same placement whose shard has the bits of
    the shard times the scale, and out of place the old gradient keeps its bits. Negative control: the scale is
    below 1, so every clipped shard differs from the unclipped one."""
    spawn(_clip_dtensors, (str(tmp_path / "init"),), 1)


def test_step_level_records_the_reduced_gradients_before_clipping(tmp_path, monkeypatch):
    """``samestep train`` at step level records each gradient as the reduction left it, before clipping
    (digested where it lies: nothing changes it after), as docs/formats.md says. Negative control: the
    clipped gradients' digests differ (clipping is active in these steps)."""
    before, after = [], []
    clip = trainer_module.clip_grad_norm_

    def watched(params, max_norm, **kw):
        before.append([digest(p.grad) for p in params])
        norm = clip(params, max_norm, **kw)
        after.append([digest(p.grad) for p in params])
        return norm

    monkeypatch.setattr(trainer_module, "clip_grad_norm_", watched)
    cfg = load_config(None, [*TINY, "train.grad_clip=0.5", "trace.level=step"])
    with samestep.enable(threads=1):
        trainer = trainer_module.build(cfg, corpus=load_corpus("stdlib"), run_dir=Path(tmp_path))
        for step in range(3):
            trainer.step(step)
        trainer.recorder.close()
    rows = [r for r in read_stream(stream_path(tmp_path, 0)).table.to_pylist() if r["op"] == "grad"]
    recorded = [[r["outputs"].hex() for r in rows if r["step"] == step] for step in (1, 2, 3)]
    assert recorded == before
    assert all(a != b for a, b in zip(after, before))
