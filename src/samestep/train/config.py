"""The reference run's configuration: one dataclass per section, TOML files, ``--set`` overrides.

    [train]
    steps = 200
    [model]
    n_layer = 4

``load_config("run.toml", ["train.steps=50", "model.dropout=0.0"])`` (``config_file``) reads the file (if
any), applies the overrides in order, and validates every field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from samestep.determinism.preempt import parse_signals
from samestep.hashing.checksums import STATE_HASHES
from samestep.loop.data import SOURCES
from samestep.train.config_values import FLOAT32_MAX, MAX_STEPS, at_most, finite, positive
from samestep.train.model_config import ModelConfig

__all__ = ["PRESETS", "Config", "DataConfig", "DeterminismConfig", "TraceConfig", "TrainConfig"]

PRECISIONS = ("fp32", "bf16")
PP_SCHEDULES = ("1f1b", "gpipe")
# Named starting points (``--preset NAME``); a config file and --set apply on top.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # a 12.8M-parameter Llama-style decoder on byte tokens, a few hundred ms per step on one CPU core
    "small": {
        "model": {
            "arch": "llama",
            "n_layer": 8,
            "n_embd": 384,
            "n_head": 6,
            "n_kv_head": 2,
            "block_size": 128,
            "dropout": 0.0,
        },
        "train": {"global_batch": 4, "micro_batch": 1, "precision": "bf16"},
    },
    # a 133M-parameter Llama-style decoder (GPT-2-small class) for one GPU
    "gpu": {
        "model": {
            "arch": "llama",
            "n_layer": 12,
            "n_embd": 1024,
            "n_head": 16,
            "n_kv_head": 4,
            "block_size": 1024,
            "dropout": 0.0,
        },
        "train": {
            "device": "cuda",
            "global_batch": 32,
            "micro_batch": 8,
            "precision": "bf16",
            "lr": 6e-4,
            "min_lr": 6e-5,
        },
    },
}


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The optimisation loop."""

    steps: int = 200
    """Optimizer steps in the run."""
    seed: int = 1337
    """Seed of every counter-keyed random stream (init, data order, dropout)."""
    global_batch: int = 8
    """Sequences per optimizer step, over all processes."""
    micro_batch: int = 2
    """Sequences per forward/backward; global_batch / micro_batch microbatches per step."""
    lr: float = 3e-3
    """Peak learning rate, reached after the warmup."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on biases, norms or embeddings' positions)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    checkpoint_every: int = 50
    """Steps between checkpoints (0: only at the end)."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept; older ones are deleted after a commit."""
    log_every: int = 10
    """Steps between plain-text progress lines when not on a terminal."""
    device: str = "auto"
    """'auto' (CUDA if available, else CPU), 'cpu' or 'cuda'."""
    exit_signals: str = "SIGTERM,SIGUSR1,SIGINT"
    """Signals that stop the run at the end of the current step, with a checkpoint (exit 75); a second
    one stops at once. '' leaves every signal its default action."""
    precision: str = "fp32"
    """'fp32', or 'bf16': the forward under bf16 autocast; weights, gradients and optimizer state stay fp32."""
    compile: bool = False
    """Compile the model's forward (with its loss) with torch.compile (Inductor, deterministic mode); the
    optimizer step and the gradient reduction run eagerly."""
    receipts: bool = True
    """Write a receipt of every step (src/samestep/records/receipts.py): the state checksum after the update, the loss
    and grad-norm bits, chained by hash; what ``samestep verify``, ``bisect`` and ``receipts verify`` read."""
    receipt_hash: str = "auto"
    """The state checksum's hash in a new receipts file (src/samestep/hashing/checksums.py): 'auto' (xxh3-128 where
    the state lies in host memory, samestep-digest-1 on an accelerator), or one of them, or 'sha256'; a
    resumed run keeps its file's."""
    cross_rank_check: bool = True
    """Data parallel on several processes: compare every rank's reduced gradients and state each step (under
    tensor parallelism, each tensor rank's data ranks; train/checks.py); a rank that disagrees stops the run."""
    sdc_check_every: int = 0
    """Every N steps, run one microbatch's forward and backward again on each rank and compare bit for bit
    (0: never); a mismatch stops the run."""
    sdc_action: str = "stop"
    """What a fault check does on a mismatch: 'stop' (exit 4, naming it) or 'warn' (and go on)."""
    nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN or infinite: 'stop' before its update, with a checkpoint
    (exit 5), or 'continue'."""
    fault: str = ""
    """A bit flip planted on purpose, to test the fault checks (train/faults.py); empty: none."""

    def __post_init__(self) -> None:
        finite("train", self, "lr", "min_lr", "weight_decay", "beta1", "beta2", "grad_clip")
        positive("train", self, "steps", "global_batch", "micro_batch", "lr", "keep_checkpoints", "log_every")
        at_most("train", self, 2**63 - 1, "seed")
        at_most("train", self, MAX_STEPS, "steps", "warmup_steps")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"train.{name}={getattr(self, name)!r} must be in [0, 1)")
        # AdamW's first update moves by lr / (1 - beta1), which the fp32 parameters must be able to hold
        largest = FLOAT32_MAX * (1.0 - self.beta1)
        for name in ("lr", "min_lr"):
            if getattr(self, name) > largest:
                raise ValueError(
                    f"train.{name}={getattr(self, name)!r} overflows float32 in AdamW's update (at most "
                    f"{largest:.3g} with train.beta1={self.beta1}); choose a smaller learning rate"
                )
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"train.global_batch={self.global_batch} is not a multiple of "
                f"train.micro_batch={self.micro_batch}; make it one (e.g. "
                f"{self.global_batch - self.global_batch % self.micro_batch or self.micro_batch})"
            )
        parse_signals(self.exit_signals)
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r} must be one of {', '.join(PRECISIONS)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device={self.device!r} must be 'auto', 'cpu' or 'cuda'")
        if self.receipt_hash not in ("auto", *STATE_HASHES):
            raise ValueError(
                f"train.receipt_hash={self.receipt_hash!r} must be 'auto' or one of "
                f"{', '.join(map(repr, STATE_HASHES))}"
            )
        if self.sdc_action not in ("stop", "warn"):
            raise ValueError(f"train.sdc_action={self.sdc_action!r} must be 'stop' or 'warn'")
        if self.nonfinite not in ("stop", "continue"):
            raise ValueError(f"train.nonfinite={self.nonfinite!r} must be 'stop' or 'continue'")
        if self.fault:
            from samestep.train.faults import Fault

            Fault.parse(self.fault)
        for name in (
            "seed",
            "warmup_steps",
            "checkpoint_every",
            "sdc_check_every",
            "min_lr",
            "weight_decay",
            "grad_clip",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)!r} must not be negative")

    @property
    def microbatches(self) -> int:
        """Global microbatches per step."""
        return self.global_batch // self.micro_batch


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the tokens come from."""

    source: str = "stdlib"
    """'stdlib' (embedded default corpus), 'text' (a directory) or 'bin' (uint16 tokens)."""
    path: str = ""
    """The directory or file for 'text' and 'bin'."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source={self.source!r} is unknown; use one of {', '.join(SOURCES)}")
        if self.source != "stdlib" and not self.path:
            raise ValueError(f"data.source={self.source!r} needs data.path")


@dataclass(kw_only=True, slots=True)
class DeterminismConfig:
    """Deterministic mode (the knobs live together, as torchtitan's DebugConfig)."""

    enabled: bool = True
    """Turn on samestep.enable() and the canonical gradient reduction."""
    threads: int = 1
    """Intra-op threads per process; fixed (not taken from the machine) so that layouts agree."""
    warn_only: bool = False
    """Report settings that break determinism as warnings instead of errors."""
    env_mismatch: str = "refuse"
    """A process whose environment fingerprint differs from rank 0's (another torch, driver, CPU feature
    set, a numerics variable): 'refuse' stops the run before its first step, naming rank, host and fields;
    'warn' runs it and records the differences in run.json (its bits may then depend on the node)."""

    def __post_init__(self) -> None:
        if self.env_mismatch not in ("refuse", "warn"):
            raise ValueError(f"determinism.env_mismatch={self.env_mismatch!r} is unknown; use 'refuse' or 'warn'")
        positive("determinism", self, "threads")
        at_most("determinism", self, 4096, "threads")


@dataclass(kw_only=True, slots=True)
class TraceConfig:
    """The trace recorder (observing never changes a bit of the run)."""

    level: str = "off"
    """'off', 'step', 'module' or 'op' (each includes the ones before)."""
    steps: str = "all"
    """Steps to record, 1-based: 'all' or ranges like '1-5,8'."""
    ranks: str = "all"
    """Ranks that record: 'all' or a list like '0,1'."""
    perturb: str = ""
    """Fault injection to validate `samestep diff`: 'rank=R,step=S,microbatch=M,phase=P,scope=PATH,op=OP,
    occurrence=K' adds one ULP to element 0 of that record's output (needs level 'op' on that step)."""
    copy: bool = False
    """Digest copies (true), or the tensors themselves, checked unchanged until digested (false: cheaper; a
    change in place stops the run and names it): module outputs and gradients at module level, and the
    parameter gradients at step level (the module level copies these either way)."""
    worker: str = "auto"
    """Where digests are computed: 'thread' (any device; 'auto' is this) or, opted into, 'process' (a child
    process that reads this one's memory: CPU on Linux only). Same stream either way."""

    def __post_init__(self) -> None:
        from samestep.tracing import LEVELS, WORKERS, Perturb, parse_selection

        if self.level not in LEVELS:
            raise ValueError(f"trace.level={self.level!r} is unknown; use one of {', '.join(LEVELS)}")
        if self.worker not in WORKERS:
            raise ValueError(f"trace.worker={self.worker!r} is unknown; use one of {', '.join(WORKERS)}")
        parse_selection(self.steps, "trace.steps")
        parse_selection(self.ranks, "trace.ranks")
        if self.perturb:
            Perturb.parse(self.perturb)


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the processes share the model (the data split over them is the same either way)."""

    fsdp: bool = False
    """Shard parameters, gradients and optimizer state over the processes with FSDP2 (fully_shard); with
    deterministic mode on, its reduce-scatter follows the canonical order, so the bits are those of the
    unsharded run on any process count. One process runs unsharded; with parallel.tp, FSDP2 shards each tensor
    rank's part over the data ranks (a 2-D mesh), and one data rank runs unsharded."""
    overlap: bool = True
    """Start the combine across processes (its all-to-alls) during the last microbatch's backward, bucket by
    bucket, as DDP does; false waits for the whole backward. The same bits either way (docs/layouts.md)."""
    tp_chunks: int = 0
    """0: plain linear layers. N (a power of two, 8 is usual): every linear layer of the decoder blocks and the
    head computes in N fixed chunks of its split dimension, summed along the canonical tree, and the embedding
    and the loss split by vocabulary (model.vocab_size a multiple of N), the numerical path of tensor
    parallelism at every degree that divides N (one process included; docs/layouts.md)."""
    tp: int = 1
    """Tensor-parallel degree: the decoder's heads and MLP units and the vocabulary split over this many
    processes (needs parallel.tp_chunks), the data over --nproc / tp data ranks. Runs with the same
    parallel.tp_chunks give the same bits at any degree and data rank count, and a checkpoint resumes at any other."""
    sp: bool = False
    """Sequence parallelism (needs parallel.tp_chunks): between the tensor-parallel layers the residual stream,
    the norms and dropout are split by sequence position over the tensor ranks; each norm's weight gradient
    sums the sequence in parallel.tp_chunks fixed chunks and dropout masks are keyed by position, a numerical
    path of its own (a resume may not change it) with the same bits at every degree (docs/layouts.md)."""
    pp: int = 1
    """Pipeline-parallel degree: the blocks split into this many stages (torch.distributed.pipelining), the data
    over --nproc / pp (/ tp) data ranks; every degree gives one process's bits, a checkpoint resumes at any other."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts spread over groups of this many data ranks (all-to-all);
    every degree gives one process's bits, a checkpoint resumes at any other (docs/layouts.md)."""
    pp_schedule: str = "1f1b"
    """The pipeline's schedule: '1f1b' (Schedule1F1B) or 'gpipe' (ScheduleGPipe); the same bits either way."""

    def __post_init__(self) -> None:
        positive("parallel", self, "tp", "pp", "ep")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(
                f"parallel.pp_schedule={self.pp_schedule!r} is unknown; use "
                f"{' or '.join(PP_SCHEDULES)} (none with several stages a rank or a split backward)"
            )
        if self.tp_chunks < 0:
            raise ValueError(f"parallel.tp_chunks={self.tp_chunks} is negative; use 0 (plain layers) or 1, 2, 4, 8, 16")
        if self.tp > 1 and not self.tp_chunks:
            raise ValueError(
                f"parallel.tp={self.tp} needs parallel.tp_chunks, the fixed chunks every degree computes "
                "in. Fix: --set parallel.tp_chunks=8"
            )
        if self.sp and not self.tp_chunks:
            raise ValueError(
                "parallel.sp=true needs parallel.tp_chunks, the fixed chunks the norms' gradients sum "
                "the sequence in. Fix: --set parallel.tp_chunks=8"
            )


@dataclass(kw_only=True, slots=True)
class Config:
    """A whole run."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """The optimisation loop."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The token source."""
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)
    """Deterministic mode."""
    trace: TraceConfig = field(default_factory=TraceConfig)
    """The trace recorder."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Sharding over the processes."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def keys() -> list[tuple[str, Any, str]]:
        """Every config key as ``(section.key, default, its docstring)``, from the dataclasses' field docstrings
        (``samestep train --show-config``)."""
        import ast
        import inspect

        out = []
        for section in dataclasses.fields(Config):
            cls = section.default_factory
            docs: dict[str, str] = {}
            body = ast.parse(inspect.getsource(cls)).body[0].body
            for node, after in zip(body, body[1:]):
                if (
                    isinstance(node, ast.AnnAssign)
                    and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)
                ):
                    docs[node.target.id] = " ".join(after.value.value.split())
            for f in dataclasses.fields(cls):
                out.append((f"{section.name}.{f.name}", getattr(cls(), f.name), docs.get(f.name, "")))
        return out
