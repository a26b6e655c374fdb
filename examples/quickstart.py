import sys

import torch

import samestep


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 8, generator=samestep.rng.generator(0, step, 0, "data"))  # a function of the step
    return x, x.sum(dim=1, keepdim=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with samestep.Run(sys.argv[1], model=model, optimizer=optimizer, checkpoint_every=20) as run:  # resumes too
        for step in run.steps(200):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            run.metric("loss", loss)
            optimizer.step()
            optimizer.zero_grad()
    if run.stopped:  # Ctrl-C or SIGTERM: saved after the step it came in; run it again to go on
        sys.exit(samestep.preempt.EXIT_PREEMPTED)
    print(samestep.digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
