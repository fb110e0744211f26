"""One training run, continued wherever a session is free: the same script in one process
(Colab, an SSH box) or in two (Kaggle's two T4s, under torchrun).

    python hop_train.py DIR                                      # one process
    torchrun --standalone --nproc_per_node 2 hop_train.py DIR    # two processes
"""

import hashlib
import os
import random
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nbresume

EPOCHS = 3
GLOBAL_BATCH = 8  # kept on every platform: each process takes GLOBAL_BATCH // processes

distributed = "RANK" in os.environ  # torchrun sets it
cuda = torch.cuda.is_available()
if distributed:
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before the process group
    dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank() if distributed else 0
processes = dist.get_world_size() if distributed else 1
device = torch.device("cuda") if cuda else torch.device("cpu")

data = TensorDataset(*torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(0)))
torch.manual_seed(0)  # the same initial weights in every process
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 8)).to(device)
trained = DistributedDataParallel(model) if distributed else model
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
# Each process its own random streams, every one seeded: a process added in a later leg gets
# streams derived from rank 0's saved ones, which are then the same in every repeat.
torch.manual_seed(1234 + rank)
random.seed(1234 + rank)
sampler = DistributedSampler(data, num_replicas=processes, rank=rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=GLOBAL_BATCH // processes, sampler=sampler)

ckpt = nbresume.Checkpointer(sys.argv[1], every=4, model=model, optimizer=optimizer)
batches = ckpt.loader(loader)
start = ckpt.restore()
if rank == 0:
    print(f"continuing from step {start} on {processes} process(es)")
for _ in ckpt.epochs(EPOCHS):
    for x, y in batches:
        loss = nn.functional.mse_loss(trained(x.to(device)), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
ckpt.close()
if rank == 0:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    state = "the training is done" if ckpt.done else "to be continued"
    print(f"stopped at step {ckpt.step} ({state}); weights {digest.hexdigest()[:16]}")
if distributed:
    dist.barrier()  # the processes tear down together
    dist.destroy_process_group()
