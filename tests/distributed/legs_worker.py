"""One training run in legs of different shapes: each leg a fresh job of 1 or 2 ranks (gloo,
CPU) that resumes from the folder the previous leg left.

``python legs_worker.py`` imports torch once, then reads commands from stdin, one per line;
for each it forks RANKS fresh processes, ranks of a new process group (torch is not imported
again, which makes a dozen legs per test affordable), waits for them, prints ``exit RANK
CODE`` for each (a negative code: killed by that signal), then ``done``. Every line a rank
prints starts with ``rankN``; a rank that ended well prints ``rankN teardown`` last, just
before ``destroy_process_group()``; its stderr follows as ``rankN stderr LINE`` lines.

    leg RANKS ROOT [--model ddp|fsdp] [--stop-after S] [--global-batch G] [--batch B]

trains 2 epochs of 48 numbered samples under ``ck.epochs(2)`` from ``ck.loader(dl)``, the
DataLoader fed by ``DistributedSampler(shuffle=True, seed=0)``, with a per-rank batch of
``G // RANKS`` (G: 4) unless ``--batch`` says otherwise; the model is plain DDP, or sharded by
FSDP2's ``fully_shard`` (``--model fsdp``). Each rank seeds its own streams (``1234 + rank``)
and draws dropout and augmentation from them. With ``--stop-after S`` the leg asks for a stop
after step S (a save, then the loop ends). A rank prints ``start STEP`` after ``restore()``,
``rng-start HASH`` (its random streams then), ``batch STEP EPOCH I,J,...`` for every batch
(the sample indices), ``rng-end HASH``, ``final STEP DIGEST`` (DIGEST: the full model and
optimizer state), each RuntimeWarning and nbresume log line of level WARNING as ``warning
TEXT``, an nbresume error as ``error TYPE TEXT``.

    streams RANKS ROOT

seeds each rank's torch, ``random`` and NumPy streams with ``1234 + rank``, takes 3 batches
through ``ck.loader(dl)`` and draws from each stream after every batch; prints ``streams
same`` when the draws are those of the seeded streams with no loader in between, ``streams
differ`` otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import logging
import os
import random
import sys
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import nbresume

SAMPLES = 48


class This:
    """Which rank this forked process is."""

    rank = 0


def say(*words: object) -> None:
    # One write per line: the ranks share the pipe, and a line must not interleave.
    text = " ".join(str(w) for w in (f"rank{This.rank}", *words)).replace("\n", " ")
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class Numbered(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """48 points of 8 features, two classes, and each sample's index; augmentation draws from
    the global torch stream."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(99)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = torch.randint(0, 2, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i] + 0.05 * torch.randn(8), self.y[i], i


class Logged(logging.Handler):
    """nbresume's warnings, as ``warning`` lines."""

    def emit(self, record: logging.LogRecord) -> None:
        say("warning", record.getMessage())


def streams_hash() -> str:
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    h.update(repr(np.random.get_state()).encode())
    return h.hexdigest()[:16]


def seed_own_streams(rank: int) -> None:
    torch.manual_seed(1234 + rank)
    random.seed(1234 + rank)
    np.random.seed(1234 + rank)


def build(kind: str, world: int) -> tuple[nn.Module, nn.Module]:
    """The module to register and the one to train with (DDP wraps it; FSDP2 shards it)."""
    torch.manual_seed(0)  # the same initial weights in every rank and every leg
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 2))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return module, DistributedDataParallel(module)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in module:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module, module


def digest(module: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The full model and optimizer state (shards gathered: a collective)."""
    from torch.distributed.tensor import DTensor

    def whole(value: Any) -> Any:
        return value.full_tensor() if isinstance(value, DTensor) else value

    h = hashlib.sha256()
    for key, tensor in sorted(module.state_dict().items()):
        h.update(key.encode() + whole(tensor).detach().contiguous().numpy().tobytes())
    state = optimizer.state_dict()["state"]
    for index in sorted(state):
        for key in sorted(state[index]):
            value = whole(state[index][key])
            if isinstance(value, torch.Tensor):
                h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def leg(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    module, model = build(args.model, world)
    seed_own_streams(rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    sampler = DistributedSampler(Numbered(), shuffle=True, seed=0)
    batch = args.batch or args.global_batch // world
    loader = DataLoader(sampler.dataset, batch_size=batch, sampler=sampler)
    ck = nbresume.Checkpointer(
        args.root, every=3, keep=3, deadline=None, async_save=False, quiet=True,
        model=module, optimizer=optimizer,
    )  # fmt: skip
    data = ck.loader(loader)
    say("start", ck.restore())
    say("rng-start", streams_hash())
    for epoch in ck.epochs(2):
        for x, y, index in data:
            say("batch", ck.step + 1, epoch, ",".join(str(int(i)) for i in index))
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            if ck.step + 1 == args.stop_after:
                ck.request_stop("the leg ends here")
    say("rng-end", streams_hash())
    ck.close()
    say("final", ck.step, digest(module, optimizer))


def streams(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    seed_own_streams(rank)
    expected = [(torch.rand(1).item(), random.random(), float(np.random.rand())) for _ in range(3)]
    seed_own_streams(rank)
    sampler = DistributedSampler(Numbered(), shuffle=True, seed=0)
    ck = nbresume.Checkpointer(args.root, every=None, deadline=None, quiet=True)
    data = ck.loader(DataLoader(sampler.dataset, batch_size=2, sampler=sampler))
    ck.restore()
    drawn = []
    for _, _batch in zip(range(3), data, strict=False):
        drawn.append((torch.rand(1).item(), random.random(), float(np.random.rand())))
    ck.close()
    say("streams", "same" if drawn == expected else "differ")


def run_rank(rank: int, world: int, port: int, argv: list[str]) -> int:
    """One rank of one job, in a forked process."""
    This.rank = rank
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["leg", "streams"])
    parser.add_argument("ranks", type=int)
    parser.add_argument("root")
    parser.add_argument("--model", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--batch", type=int)
    args = parser.parse_args(argv)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    logging.getLogger("nbresume").addHandler(Logged(logging.WARNING))
    # A peer that dies must end this rank's wait, not leave it hanging for 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            {"leg": leg, "streams": streams}[args.mode](args)
        for warning in caught:
            if issubclass(warning.category, RuntimeWarning):
                say("warning", warning.message)
    except nbresume.NbresumeError as exc:
        say("error", type(exc).__name__, exc)
        dist.destroy_process_group()
        return 1
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()  # the ranks tear down together
    # Every result is reported: what follows is torch's teardown alone (see teardown.py).
    say("teardown")
    dist.destroy_process_group()
    return 0


def import_once() -> None:
    """Import here what every leg would import again in each rank (DDP imports torch's
    compiler stack, seconds of work on a busy machine)."""
    for module in (
        "torch._dynamo",
        "torch.distributed.checkpoint.state_dict",
        "torch.distributed.fsdp",
        "torch.distributed.tensor",
        "torch.nn.parallel",
        "nbresume.checkpoint.loop.checkpointer",
        "nbresume.checkpoint.parallel.sharded",
    ):
        importlib.import_module(module)


def main() -> None:
    import rank_server  # a sibling when run as a script (a test may import this module)

    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    import_once()
    rank_server.serve(run_rank, world=lambda argv: int(argv[1]))


if __name__ == "__main__":
    main()
