"""A small DistributedDataParallel training run on the gloo backend, one process per rank.

Usage (through torchrun, with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, or with
--ranks N to start N ranks itself):
    python train_ddp.py DIR TOTAL_STEPS [--ranks N] [--every N] [--sync] [--sleep S]
        [--dump FILE] [--restore-only] [--fail-at STEP]

--ranks forks the ranks from one process that has imported torch already, which saves a
torch import per rank; it prints "rank R exit STATUS" for each and fails if any failed.

Each rank seeds torch, ``random`` and NumPy differently (so every rank has its own random
streams), draws dropout masks, augmentation (inside the Dataset) and a loss scale from them,
and reads its share of the data through a shuffled DistributedSampler. Every rank prints
"rank R pid P", "rank R start S", "rank R step S" per step, "rank R event KIND S" for the
Checkpointer's events other than "step", and at the end "rank R final HASH" (parameters and
optimizer state), then "rank R teardown" just before ``destroy_process_group()``. An exception
is printed as "rank R error KIND: MESSAGE" (exit status 1). With --ranks, what a rank wrote on
stderr is printed as "rank R stderr LINE" lines after it ended, before its "rank R exit STATUS".

--dump writes, per rank, FILE.R.json with the hashes of the weights, the optimizer state and
every RNG state, after the run (or, with --restore-only, right after restore()).
--fail-at makes rank 0's ``probe`` object return a value no checkpoint can hold from that
step on, so that rank 0's save fails.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import shutil
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import nbresume


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """64 points of 8 features, two classes; augmentation draws from the global torch RNG."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(64, 8, generator=g)
        self.y = torch.randint(0, 2, (64,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.05 * torch.randn(8), self.y[i]


class Probe:
    """A stateful object that rank 0 makes unsaveable from step ``fail_at`` on."""

    def __init__(self, ckpt_step: Any, fail_at: int | None) -> None:
        self.ckpt_step = ckpt_step
        self.fail_at = fail_at

    def state_dict(self) -> dict[str, Any]:
        if self.fail_at is not None and self.ckpt_step() >= self.fail_at:
            return {"broken": object()}
        return {"ok": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def say(rank: int, line: str) -> None:
    """One write per line keeps the lines of two processes on one pipe whole."""
    sys.stdout.write(f"rank {rank} {line}\n")
    sys.stdout.flush()


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def hashes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    state = optimizer.state_dict()["state"]
    rng = hashlib.sha256(repr(random.getstate()).encode())
    rng.update(repr(np.random.get_state()).encode())
    return {
        "weights": digest(*[t for _, t in sorted(model.state_dict().items())]),
        "optimizer": digest(*[state[i][k] for i in sorted(state) for k in sorted(state[i])]),
        "rng": rng.hexdigest() + digest(torch.get_rng_state()),
    }


def fork_ranks(count: int, args: argparse.Namespace) -> int:
    """Start ``count`` ranks as forked children, as ``torchrun`` would as fresh processes."""
    import rank_server  # a sibling: this file runs as a script

    def run_rank(rank: int, world: int, port: int, argv: list[str]) -> int:
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
        return train(args)

    codes, errors = rank_server.run_job(run_rank, count, [])
    for rank in sorted(codes):
        with open(os.path.join(errors, str(rank)), errors="replace") as written:
            for line in written:
                say(rank, f"stderr {line.rstrip()}")
        say(rank, f"exit {codes[rank]}")
    shutil.rmtree(errors, ignore_errors=True)
    return 1 if any(codes.values()) else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("total", type=int)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--dump")
    parser.add_argument("--restore-only", action="store_true")
    parser.add_argument("--fail-at", type=int)
    parser.add_argument("--ranks", type=int)
    args = parser.parse_args()
    if args.ranks:
        return fork_ranks(args.ranks, args)
    return train(args)


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    say(rank, f"pid {os.getpid()}")
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    model = DistributedDataParallel(module)  # takes rank 0's initial weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = DistributedSampler(Points(), num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = DataLoader(sampler.dataset, batch_size=4, sampler=sampler)

    def trace(event: nbresume.Event) -> None:
        if event.kind != "step":
            say(rank, f"event {event.kind} {event.step}")

    probe = Probe(lambda: 0, args.fail_at if rank == 0 else None)
    ckpt = nbresume.Checkpointer(
        args.dir, every=args.every, keep=2, deadline=None, async_save=not args.sync,
        callbacks=[trace], model=module, optimizer=optimizer, probe=probe,
    )  # fmt: skip
    ckpt["note"] = "ddp"
    probe.ckpt_step = lambda: ckpt.step
    data = ckpt.loader(loader)
    try:
        ckpt.restore()
        say(rank, f"start {ckpt.step}")
        if not args.restore_only:
            batches = data.batches()
            for step in ckpt.steps(args.total):
                x, y = next(batches)
                scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
                loss = nn.functional.cross_entropy(model(x), y) * scale
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                say(rank, f"step {step + 1}")
                if args.sleep:
                    time.sleep(args.sleep)
        ckpt.close()  # also after a restore only: the writer lease is released
    except nbresume.NbresumeError as exc:
        say(rank, f"error {type(exc).__name__}: {exc}")
        return 1
    if args.dump:
        with open(f"{args.dump}.{rank}.json", "w") as handle:
            json.dump({"step": ckpt.step, **hashes(module, optimizer)}, handle)
    say(rank, f"final {hashes(module, optimizer)['weights']}")
    # Both ranks reach the teardown together: a rank that closes its connections while the
    # other still uses them can abort gloo's threads at exit.
    dist.barrier()
    # Every result is reported: what follows is torch's teardown alone, which can still abort
    # (see tests/distributed/teardown.py).
    say(rank, "teardown")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
