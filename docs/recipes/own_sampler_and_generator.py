"""A sampler that shuffles with Python's random module, and a generator of your own."""

import random
import sys

import numpy as np
import torch

import nbresume


class BucketBatchSampler(torch.utils.data.Sampler):
    """Batches of similar lengths, shuffled with the global `random` (as many NLP codes do)."""

    def __init__(self, lengths, batch_size):
        self.order = sorted(range(len(lengths)), key=lengths.__getitem__)
        self.batch_size = batch_size

    def __iter__(self):
        buckets = [
            self.order[i : i + self.batch_size] for i in range(0, len(self.order), self.batch_size)
        ]
        random.shuffle(buckets)
        return iter(buckets)

    def __len__(self):
        return (len(self.order) + self.batch_size - 1) // self.batch_size


torch.manual_seed(0)
features = torch.randn(120, 4)
lengths = torch.randint(1, 50, (120,)).tolist()
data = torch.utils.data.TensorDataset(features, torch.randn(120, 1))
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
noise = np.random.default_rng(0)  # your own generator: give it to the Checkpointer
ckpt = nbresume.Checkpointer(
    sys.argv[1] if len(sys.argv) > 1 else "runs/buckets",
    every=7,
    model=model,
    optimizer=optimizer,
    noise=noise,
)
loader = ckpt.loader(
    torch.utils.data.DataLoader(data, batch_sampler=BucketBatchSampler(lengths, 8))
)

for _epoch in ckpt.epochs(4):
    for x, y in loader:
        jitter = torch.from_numpy(noise.normal(0, 0.01, x.shape)).float()
        loss = torch.nn.functional.mse_loss(model(x + jitter), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
ckpt.close()
