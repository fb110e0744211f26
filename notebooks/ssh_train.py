"""The SSH quickstart as a script, for runs that must outlive the SSH connection.

Start it detached; it is started again if something kills it, and continues from its newest
verified checkpoint:

    nbresume run --detach -- python ssh_train.py --steps 3000
    nbresume status ~/nbresume/ssh-quickstart

The training is the one of ssh_quickstart.ipynb: with the same settings both end with the
same weights, bit for bit.
"""

import argparse
import hashlib

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import nbresume

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--name", default="ssh-quickstart", help="the run's name")
parser.add_argument("--steps", type=int, default=3000, help="training steps in total")
parser.add_argument("--every", default="500", help="steps between saves, a duration or auto")
parser.add_argument("--dir", default=None, help="checkpoint folder or URL")
args = parser.parse_args()
name, steps, folder = args.name, args.steps, args.dir
every = int(args.every) if args.every.isdigit() else args.every

run = nbresume.init(name, dir=folder)
nbresume.cap_threads()

device = "cuda" if torch.cuda.is_available() else "cpu"


class Stripes(Dataset):
    """Synthetic 16x16 images of stripes in one of four directions: data that needs no
    download. Every sample gets fresh noise, the kind of randomness augmentation adds."""

    def __init__(self, size, seed):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (size,), generator=g)
        angle = self.labels * (torch.pi / 4)
        phase = 2 * torch.pi * torch.rand(size, generator=g)
        yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
        along = torch.cos(angle)[:, None, None] * xx + torch.sin(angle)[:, None, None] * yy
        self.images = torch.sin(1.2 * along + phase[:, None, None]).unsqueeze(1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i] + torch.randn(1, 16, 16), self.labels[i]


torch.manual_seed(0)
train_data, test_data = Stripes(2048, seed=1), Stripes(512, seed=2)
loader = DataLoader(train_data, batch_size=32, shuffle=True)
model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Conv2d(16, 32, 3, padding=1),
    nn.ReLU(),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Dropout(0.2),
    nn.Linear(32, 4),
).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)

ckpt = run.checkpointer(
    model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, every=every
)
batches = ckpt.loader().batches()  # the DataLoader, resumable at the exact next batch
start = ckpt.restore()  # 0 on a fresh run; else the step of the newest verified checkpoint
print(f"training from step {start} of {steps}")

model.train()
for step in ckpt.steps(steps):
    x, y = next(batches)
    loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    if (step + 1) % max(1, steps // 10) == 0:
        print(f"step {step + 1}: loss {loss.item():.3f}")

if ckpt.done:
    print(f"training finished at step {ckpt.step}")
else:
    print(f"stopped at step {ckpt.step}: {ckpt.stop_reason}")


def accuracy(model, data):
    """Accuracy on held-out images, with noise drawn from a generator of its own."""
    noise = torch.randn(data.images.shape, generator=torch.Generator().manual_seed(3))
    model.eval()
    with torch.no_grad():
        predicted = model((data.images + noise).to(device)).argmax(1).cpu()
    model.train()
    return (predicted == data.labels).float().mean().item()


def weights_sha256(model):
    """One fingerprint of every weight: equal only for bit-identical models."""
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


print(f"test accuracy: {accuracy(model, test_data):.3f}")
print("checkpoints:", [info.step for info in ckpt.list()], ckpt.verify().summary)
print(f"weights sha256: {weights_sha256(model)}")
