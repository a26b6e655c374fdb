"""A training loop of your own with samestep: deterministic, resumable to the bit, traced for `samestep diff`.

    python examples/own_loop.py runs/mine                  # 6 steps
    python examples/own_loop.py runs/killed --stop-after 3 # leave after step 3 (as if killed) ...
    python examples/own_loop.py runs/killed                # ... and resume: the same bits as runs/mine
    samestep diff runs/mine runs/killed                    # exit 0: identical
"""

import argparse
from pathlib import Path

import torch

import samestep


class Cursor:
    """Where the data stands. A batch is a pure function of (seed, step, microbatch), so the position
    is all a resume needs: samestep saves and restores it through state_dict/load_state_dict."""

    def __init__(self, seed: int) -> None:
        self.seed, self.step = seed, 0

    def batch(self, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = samestep.rng.generator(self.seed, self.step, microbatch, "data")
        x = torch.randn(16, 8, generator=g)
        return x, x.sum(dim=1, keepdim=True)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def main(run_dir: Path, steps: int, stop_after: int | None, seed: int) -> str:
    samestep.enable(threads=1)  # every knob set, validated, recorded; fails closed
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cursor = Cursor(seed)
    checkpoints, start = run_dir / "checkpoints", 0
    if checkpoints.is_dir():  # resume: the newest intact checkpoint, every byte checked first
        start = samestep.load_checkpoint(checkpoints, model=model, optimizer=optimizer, data_cursor=cursor,
                                         fallback=True).step
    rec = samestep.trace(run_dir, level="step", resume=start > 0)  # "module" or "op" level record more
    rec.attach(model)
    end = steps if stop_after is None else min(steps, start + stop_after)
    for step in range(start, end):
        with rec.step(step + 1):  # steps are numbered from 1
            total = torch.zeros(())
            for i in range(2):  # global microbatch indices, whatever the number of processes
                with rec.microbatch(i):
                    x, y = cursor.batch(i)
                    loss = torch.nn.functional.mse_loss(model(x), y) / 2
                    loss.backward()
                total += loss.detach()
            rec.grads(model.named_parameters())  # after the gradient reduction, before the update
            rec.metric("loss", total)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rec.state(model, optimizer)  # parameters and optimizer state after the update
        cursor.step += 1
        rec.sync()  # the trace of every step the checkpoint holds is on disk first
        samestep.save_checkpoint(checkpoints, step + 1, model=model, optimizer=optimizer, data_cursor=cursor)
    rec.close()
    samestep.disable()
    return samestep.digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(main(args.run_dir, args.steps, args.stop_after, args.seed))
