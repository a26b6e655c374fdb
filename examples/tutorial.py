"""The loop of docs/tutorial.md: a small regression model trained under ``samestep.Run``.

python examples/tutorial.py runs/tut_a                    # 40 steps; prints the weights' digest
python examples/tutorial.py runs/tut_b --stop-after 20    # stops after step 20 as Ctrl-C would (exit 75)
python examples/tutorial.py runs/tut_b                    # goes on from step 20: the same digest
python examples/tutorial.py runs/tut_p --plant 30         # one ULP planted in step 30's last layer
"""

import argparse
import signal
import sys

import torch

import samestep

STEPS, MICROBATCHES = 40, 2


def batch(step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data is a function of where the run stands, so a resume needs nothing more."""
    x = torch.randn(16, 8, generator=samestep.rng.generator(0, step, microbatch, "data"))
    return x, x.sum(dim=1, keepdim=True)


def main(run_dir: str, stop_after: int | None, plant: int | None) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    traced = {"level": "step"}
    if plant is not None:  # one ULP in the last layer's output of microbatch 0, where that step is traced by op
        traced = {
            "level": "op",
            "trace_steps": {plant},
            "perturb": f"rank=0,step={plant},microbatch=0,phase=forward,scope=2,op=aten.addmm.default",
        }
    with samestep.Run(run_dir, model=model, optimizer=optimizer, checkpoint_every=10, **traced) as run:
        for step in run.steps(STEPS):
            last = step
            total = torch.zeros(())
            for i in range(MICROBATCHES):
                with run.microbatch(i):
                    x, y = batch(step, i)
                    loss = torch.nn.functional.mse_loss(model(x), y) / MICROBATCHES
                    loss.backward()
                total += loss.detach()
            run.metric("loss", total)
            optimizer.step()
            optimizer.zero_grad()
            if step == stop_after:
                signal.raise_signal(signal.SIGINT)  # what Ctrl-C does: the step ends, is saved, the loop stops
    if run.stopped:
        print(f"stopped after step {last}, saved: run it again to go on")
        return samestep.preempt.EXIT_PREEMPTED
    print("digest", samestep.digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--stop-after", type=int, metavar="STEP", help="stop after this step, as Ctrl-C would")
    parser.add_argument("--plant", type=int, metavar="STEP", help="plant one ULP in this step's last layer")
    args = parser.parse_args()
    sys.exit(main(args.run_dir, args.stop_after, args.plant))
