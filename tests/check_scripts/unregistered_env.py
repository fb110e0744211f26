"""An RL-style loop whose environment draws from a ``random.Random`` of its own, and is not
given to the Checkpointer: a resumed run's environment starts over from its seed."""

import random

import torch
from torch import nn

import nbresume


class Env:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def observe(self) -> torch.Tensor:
        return torch.tensor([self.rng.uniform(-1, 1) for _ in range(4)])


torch.manual_seed(0)
env = Env(seed=1)
policy = nn.Linear(4, 1)
optimizer = torch.optim.SGD(policy.parameters(), lr=1e-2)

ckpt = nbresume.Checkpointer("runs/rl", model=policy, optimizer=optimizer)
ckpt.restore()
for _ in ckpt.steps(12):
    obs = env.observe()
    loss = (policy(obs) - obs.sum()).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("finished:", ckpt.done, "at step", ckpt.step)
