"""An IterableDataset that resumes exactly in the middle of an epoch."""

import sys

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import nbresume


class Shards(IterableDataset):
    """Examples read shard by shard (files, in real code), in a new order every epoch."""

    def __init__(self, shards):
        self.shards = shards
        self.epoch = 0

    def set_epoch(self, epoch):  # nbresume calls it before each epoch's stream starts
        self.epoch = epoch

    def __iter__(self):
        # The order of the shards: a function of the epoch, the same in every worker.
        epoch_generator = torch.Generator().manual_seed(self.epoch)
        order = torch.randperm(len(self.shards), generator=epoch_generator)
        worker = get_worker_info()
        if worker is not None:  # each worker reads its own shards
            order = order[worker.id :: worker.num_workers]
        for shard in order.tolist():
            x, y = self.shards[shard]
            # The global generators: seeded by nbresume for each epoch and worker.
            for i in torch.randperm(len(x)).tolist():
                yield x[i] + 0.05 * torch.randn(8), y[i]


if __name__ == "__main__":
    torch.manual_seed(0)
    shards = [(torch.randn(32, 8), torch.randn(32, 1)) for _ in range(8)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = nbresume.Checkpointer(
        sys.argv[1] if len(sys.argv) > 1 else "runs/iterable",
        every=20,
        model=model,
        optimizer=optimizer,
    )
    loader = ckpt.loader(DataLoader(Shards(shards), batch_size=16, num_workers=2))

    for _epoch in ckpt.epochs(5):
        for x, y in loader:  # resumed mid-epoch: the epoch's stream, the batches trained dropped
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    ckpt.close()
    print(f"done={ckpt.done} at step {ckpt.step}")
