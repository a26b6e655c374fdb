"""A training loop of your own with samestep: deterministic, resumable to the bit, traced for `samestep diff`.

python examples/own_loop.py runs/mine                  # 6 steps
python examples/own_loop.py runs/cut --stop-after 3    # a stop signal after step 3: saves, exits 75 ...
python examples/own_loop.py runs/cut                   # ... and resumes: the same bits as runs/mine
samestep diff runs/mine runs/cut                       # exit 0: identical
"""

import argparse
import signal
import sys
from pathlib import Path

import torch

import samestep


def batch(seed: int, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch is a pure function of where the run stands, so a resume needs nothing more (a loader with a
    position of its own is passed as Run(data_cursor=...), and its state_dict is checkpointed)."""
    g = samestep.rng.generator(seed, step, microbatch, "data")
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def main(run_dir: Path, steps: int, stop_after: int | None, seed: int) -> tuple[str, int]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # deterministic mode, resume from the newest intact checkpoint, trace, checkpoints, stop signals
    with samestep.Run(run_dir, model=model, optimizer=optimizer, level="step") as run:
        for step in run.steps(steps):  # 1-based; a resumed run starts after its checkpoint
            total = torch.zeros(())
            for i in range(2):  # global microbatch indices, whatever the number of processes
                with run.microbatch(i):
                    x, y = batch(seed, step, i)
                    loss = torch.nn.functional.mse_loss(model(x), y) / 2
                    loss.backward()
                total += loss.detach()
            run.metric("loss", total)
            optimizer.step()  # the gradients are recorded before the update, the state after it
            optimizer.zero_grad(set_to_none=True)
            if step == stop_after:
                signal.raise_signal(signal.SIGTERM)  # as a scheduler would: the step ends, is saved, the loop stops
    digest = samestep.digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return digest, samestep.preempt.EXIT_PREEMPTED if run.stopped else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    digest, code = main(args.run_dir, args.steps, args.stop_after, args.seed)
    print(digest)
    sys.exit(code)
