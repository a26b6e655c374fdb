"""Pipeline parallelism in the reference run: parallel.pp and parallel.pp_schedule (docs/layouts.md, "Pipeline
parallelism").

The processes form a (data, pipe, tensor) mesh of the dimensions over one, a data rank's stages consecutive.
Every rank builds the whole model (the same initial draws), then keeps its stage: stage s runs blocks
``stage_blocks(n_layer, pp)[s]``, the first the embeddings too, the last the final norm and the head; the other
blocks become ``Skipped``, so each parameter keeps the name it has in one process. Tensor parallelism and FSDP2
then split what the stage holds. The stage's forward is the model's own call (``forward(part=...)``) under the
run's autocast, its loss the model's ``loss``, and the dropout generator of a microbatch travels with its
activations (its state as a uint8 tensor), so each stage draws the masks one process draws there.

``torch.distributed.pipelining`` runs the schedule; samestep's ``CanonicalStage`` hands each microbatch's
gradients to the stage's canonical reduction, ``TiedWeight`` joins the GPT's head to its embedding, and the
loss and norm are combined in a fixed order (``samestep.distributed.pipeline``). The whole state (a checkpoint,
a receipt, the final digest) is gathered from the stages as whole tensors: what one process would hold.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from samestep.determinism import rng
from samestep.train.config import Config
from samestep.train.config_values import not_with
from samestep.train.parts import Parts

__all__ = ["Pipeline", "Skipped", "check_pp", "stage_blocks"]


def stage_blocks(n_layer: int, pp: int) -> list[range]:
    """The blocks of each of ``pp`` stages: consecutive runs, the first stages one longer where they do not
    split evenly."""
    base, extra = divmod(n_layer, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


def check_pp(cfg: Config, world: int) -> None:
    """Refuses a pipeline-parallel config this run cannot keep on one numerical path, naming the fix.

    Raises:
        ValueError: the field, its value and what would do.
    """
    par, t = cfg.parallel, cfg.train
    if par.pp == 1:
        return
    why = {
        "parallel.fsdp with parallel.tp_chunks": par.fsdp and par.tp_chunks > 0,
        "parallel.fsdp with model.arch=gpt (its head tied to the embedding across stages)": par.fsdp
        and cfg.model.arch == "gpt",
        "train.compile": t.compile,
        "train.sdc_check_every": t.sdc_check_every > 0,
        "train.fault": bool(t.fault),
    }
    not_with(f"parallel.pp={par.pp}", why)
    if cfg.model.n_layer < par.pp:
        raise ValueError(
            f"parallel.pp={par.pp} stages need a block each, and model.n_layer={cfg.model.n_layer}. "
            f"Fix: --set parallel.pp={cfg.model.n_layer} or fewer"
        )
    tp = par.tp if par.tp_chunks else 1
    if world % (par.pp * tp):
        raise ValueError(
            f"parallel.pp={par.pp} does not divide the {world} process(es) into data ranks of {par.pp} "
            f"stages{f' of {tp} tensor ranks' if tp > 1 else ''} each. Fix: --nproc a multiple of "
            f"{par.pp * tp}"
        )
    k = t.microbatches // max(world // (par.pp * tp), 1)
    if par.pp_schedule == "1f1b" and k < par.pp:
        raise ValueError(
            f"parallel.pp_schedule=1f1b needs at least parallel.pp={par.pp} microbatches a data rank; "
            f"it has {k}. Fix: --set parallel.pp_schedule=gpipe, or more train.global_batch"
        )


class Skipped(nn.Module):
    """A block another stage runs: passes the residual stream through, holding no parameter."""

    def forward(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        return x


class _Stage(nn.Module):
    """The module pipelining runs: ``(tokens or activations, generator state) -> (activations, generator
    state)``, or the logits on the last stage."""

    def __init__(self, model: nn.Module, first: bool, last: bool, bf16: bool) -> None:
        super().__init__()
        self.model, self.first, self.last, self.bf16 = model, first, last, bf16

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> Any:
        gen = torch.Generator(device=x.device)
        gen.set_state(state[0].cpu().clone())  # a tensor of its own: set_state reads from its storage's start
        with torch.autocast(x.device.type, torch.bfloat16, enabled=self.bf16):
            # through the model's own call: FSDP2's hooks on it gather and reduce the stage's own parameters
            out = self.model(x, None, gen, part=(self.first, self.last))
        return out if self.last else (out, gen.get_state().to(x.device).unsqueeze(0))


def _blocks(model: nn.Module) -> nn.ModuleList:
    return model.layers if hasattr(model, "layers") else model.transformer.h  # type: ignore[return-value]


class Pipeline:
    """One rank's stage of a pipeline-parallel run and everything that joins it to the others. Built by
    ``Pipeline.build``, a collective: every rank calls it with the whole model, after the process group
    exists."""

    def __init__(self) -> None:
        self.stage = 0
        self.stages = 1
        self.params: list[nn.Parameter] = []  # what this stage's optimizer steps (a tied weight's copy not)
        self.reduced: list[nn.Parameter] = []  # of them, what the canonical reduction sums (a tied weight not)
        self.lead: list[nn.Parameter] = []  # of them, those the norm's rows start with (a tied weight the last owns)
        self.pipe_group: Any = None
        self.data_group: Any = None  # this stage's data ranks (None: one)
        self.last_rank = 0  # the global rank of this data rank's last stage
        self.tied: Any = None  # TiedWeight
        self.recorder: Any = None  # set by the trainer where it traces: each chunk's records in its microbatch
        self.schedule: Any = None
        self.grads: Any = None  # set by the trainer: CanonicalGradients over ``reduced``, or FSDP2's FsdpGradients
        self.microbatches = range(0)
        self.parts: Any = None  # Parts: this stage's part of the whole state
        self.mesh: Any = None  # the job's DeviceMesh
        self._tied = False  # the model's head is its embedding's weight (the GPT's)
        self._tied_groups: dict[tuple[int, int], Any] = {}  # (first, last stage's rank) -> their process group
        self._first_rank = 0  # the global rank of this data and tensor rank's first stage

    @classmethod
    def build(cls, model: nn.Module, cfg: Config, world: int, rank: int, device: torch.device) -> Pipeline:
        """The job's mesh, (data, pipe, tensor) of the dimensions over one, a data rank's stages consecutive and
        a stage's tensor ranks consecutive; ``model`` cut to this rank's stage (in place). Then, after tensor
        parallelism splits what the stage holds (``tensor_meshes``), ``join``."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self = cls()
        pp = self.stages = cfg.parallel.pp
        tp = cfg.parallel.tp if cfg.parallel.tp_chunks else 1
        data = world // (pp * tp)
        self.stage = s = rank // tp % pp
        self.parts = Parts(model)  # before the model is cut to the stage
        dims = [
            (n, size)
            for n, size in (("data", data), ("pipe", pp), ("tensor", tp))
            if size > 1 or n == "pipe" or (n == "tensor" and cfg.parallel.tp_chunks)
        ]
        mesh = init_device_mesh(device.type, tuple(size for _, size in dims), mesh_dim_names=tuple(n for n, _ in dims))
        self.mesh = mesh
        self.data_group = mesh["data"].get_group() if data > 1 else None
        self.pipe_group = mesh["pipe"].get_group()
        stride = tp  # global ranks between a rank and the same tensor rank of the next stage
        first_rank = rank - s * stride
        self.last_rank = first_rank + (pp - 1) * stride
        self._first_rank = first_rank
        head = getattr(model, "lm_head", None)
        self._tied = head is not None and head.weight is model.transformer.wte.weight  # type: ignore[union-attr]
        if self._tied:  # the first and last stage of each (data, tensor) rank, made by every rank in one order
            pairs = [(d * pp * tp + r, (d * pp + pp - 1) * tp + r) for d in range(data) for r in range(tp)]
            self._tied_groups = {pair: dist.new_group(list(pair)) for pair in pairs}
        # keep this stage's part, every parameter under its one-process name
        blocks = _blocks(model)
        mine = stage_blocks(len(blocks), pp)[s]
        for i in range(len(blocks)):
            if i not in mine:
                blocks[i] = Skipped()
        if s != 0:
            if hasattr(model, "transformer"):
                del model.transformer["wte"], model.transformer["wpe"]  # type: ignore[operator]
            else:
                model.embed = None
        if s != pp - 1:
            if hasattr(model, "transformer"):
                del model.transformer["ln_f"]  # type: ignore[operator]
                model.lm_head = None
            else:
                model.norm = model.output = None
        k = cfg.train.microbatches // data
        d = rank // (pp * tp)
        self.microbatches = range(d * k, (d + 1) * k)
        return self

    @property
    def data_mesh(self) -> Any:
        """The mesh of this stage's data ranks (FSDP2 shards over it), or None where there is one."""
        return self.mesh["data"] if "data" in self.mesh.mesh_dim_names else None

    @property
    def tensor_meshes(self) -> tuple[Any, Any]:
        """The (tensor, data) meshes tensor parallelism splits a stage over (``apply_tp``'s ``meshes``)."""
        names = self.mesh.mesh_dim_names
        return self.mesh["tensor"], self.mesh["data"] if "data" in names else None

    def join(self, model: nn.Module, cfg: Config, device: torch.device, tokens_per_step: int) -> None:
        """This stage's parameters, the tied weight's exchange and pipelining's stage and schedule, over the
        model as tensor parallelism and FSDP2 left it (its parameters DTensors then)."""
        from samestep.distributed.pipeline import CanonicalStage, TiedWeight

        s, pp = self.stage, self.stages
        copy, aliases = None, {}
        if self._tied and s in (0, pp - 1):
            weight = model.transformer.wte.weight if s == 0 else model.lm_head.weight  # type: ignore[union-attr]
            pair = (self._first_rank, self.last_rank)
            self.tied = TiedWeight(
                weight,
                is_first=s == 0,
                peer=self.last_rank if s == 0 else self._first_rank,
                group=self._tied_groups[pair],
                per_microbatch=cfg.determinism.enabled,
                data_group=self.data_group,
            )
            if not self.tied.owns:
                copy = weight
            elif s == pp - 1:  # the last stage owns the weight one process names after the embedding
                self.lead, aliases = [weight], {"lm_head.weight": "transformer.wte.weight"}
        self.params = [p for p in model.parameters() if p.requires_grad and p is not copy]
        self.reduced = [p for p in self.params if not any(p is q for q in self.lead)]
        self.parts.hold(model, self.params, aliases)
        bf16 = cfg.train.precision == "bf16"
        tp = cfg.parallel.tp if cfg.parallel.tp_chunks else 1
        b, n, c = cfg.train.micro_batch, cfg.model.block_size, cfg.model.n_embd
        meta = torch.device("meta")
        state = torch.empty(1, torch.Generator(device=device).get_state().numel(), dtype=torch.uint8, device=meta)
        # the residual stream (fp32 under autocast too): under sequence parallelism the rank's block of positions
        stream = torch.empty(b, n // tp if cfg.parallel.sp else n, c, device=meta, requires_grad=True)
        inputs = (torch.empty(b, n, dtype=torch.int64, device=meta) if s == 0 else stream, state)
        logits = torch.empty(
            b,
            n,
            model.vocab_size // tp,
            dtype=torch.bfloat16 if bf16 else torch.float32,
            device=meta,
            requires_grad=True,
        )  # this tensor rank's slice of the vocabulary
        outputs = (logits,) if s == pp - 1 else (stream, state)
        stage = CanonicalStage.make(
            _Stage(model, s == 0, s == pp - 1, bf16),
            s,
            pp,
            device,
            self.pipe_group,
            self._after_backward,
            inputs,
            outputs,
            self._scope,
        )

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                loss = model.loss(logits, targets)  # type: ignore[operator]
            return loss / tokens_per_step  # as Trainer.forward normalises

        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        kind = Schedule1F1B if cfg.parallel.pp_schedule == "1f1b" else ScheduleGPipe
        self.schedule = kind(stage, n_microbatches=len(self.microbatches), loss_fn=loss_fn, scale_grads=False)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def _scope(self, chunk: int) -> Any:
        """Where a chunk's forward and backward run: the trace recorder's microbatch (``recorder``), if any."""
        return contextlib.nullcontext() if self.recorder is None else self.recorder.microbatch(self.microbatches[chunk])

    def _after_backward(self, chunk: int, loss: torch.Tensor | None) -> None:
        if self.tied is not None:
            self.tied.after_backward()
        self.grads.accumulate(self.microbatches[chunk], extra=loss)

    def run(self, step: int, seed: int, samples: Any, device: torch.device) -> torch.Tensor:
        """One step's forwards and backwards of this rank's microbatches (``samples(i)``: microbatch i's inputs
        and targets); returns the loss summed along the canonical tree, the last stage's on every stage."""
        if self.first:
            xs = torch.cat([samples(i)[0] for i in self.microbatches]).to(device)
            states = torch.stack(
                [rng.generator(seed, step, i, "dropout", device).get_state() for i in self.microbatches]
            ).to(device)
            self.schedule.step(xs, states)
        elif self.last:
            ys = torch.cat([samples(i)[1] for i in self.microbatches]).to(device)
            self.schedule.step(target=ys, losses=[])
        else:
            self.schedule.step()
        from samestep.distributed.pipeline import broadcast_from

        if self.tied is not None:
            self.tied.add_step()
        loss = self.grads.reduce()
        return broadcast_from(
            loss if self.last else torch.zeros(1, dtype=loss.dtype, device=device), self.last_rank, self.pipe_group
        )

    def after_update(self) -> None:
        """After the optimizer step: a tied weight's copy takes its owner's."""
        if self.tied is not None:
            self.tied.sync()

    # -- the whole state ----------------------------------------------------------------------------------
    def whole_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The model's and optimizer's ``state_dict()`` as one process holds them, gathered from the stages
        (a collective over the stages: each rank of them calls it)."""
        return self.parts.whole_state(model, optimizer, self.pipe_group, device)

    def loaders(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """What a whole checkpoint is loaded into: this stage's part of each state (under tensor parallelism,
        each tensor rank's shards of it)."""
        return self.parts.loaders(model, optimizer)
