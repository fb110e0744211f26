"""Two-rank FSDP2 runs on CPU (gloo) that save and restore sharded checkpoints.

``python sharded_worker.py`` imports torch once, then reads commands from stdin, one per line;
for each it forks two fresh processes, ranks 0 and 1 of a new process group (torch is not
imported again: that is what makes several runs per test affordable), waits for both, and
prints ``exit RANK CODE`` for each (a negative code: killed by that signal), then ``done``.
Every line a rank prints starts with ``rankN``; a rank that ended well prints ``rankN teardown``
last, just before ``destroy_process_group()``; what a rank wrote on stderr follows, after it
ended, as ``rankN stderr LINE`` lines. Commands:

    save ROOT EXPECTED [--kill-at-step S --kill-rank R --kill-file NAME|commit [--kill-only]]
    restore ROOT EXPECTED

``save`` trains a small model sharded with ``fully_shard``, saves steps 1, 2 and 3 through
:func:`save_sharded` (``saved STEP``), and writes the full state of each step (gathered from
the shards) to EXPECTED/step-N.* for the restore to compare with. With ``--kill-at-step S``
it trains on and saves step S, and rank R (default 1) sends SIGKILL to itself just before it
creates the file NAME in the checkpoint's temporary folder, or with ``commit`` just before
it renames the complete temporary folder into place (seen through Python's audit hooks);
with ``--kill-only`` it trains steps 1-3 without saving them (ROOT already holds them).

``train ROOT EXPECTED [--total N] [--stop-after S]`` trains to step N under a Checkpointer
holding the sharded model and optimizer (``every=2``), after restoring (``start STEP``); with
``--stop-after S`` it asks for a stop after step S, which saves and ends the loop. It prints
``final STEP DIGEST``, DIGEST a SHA-256 of the full state, and rank 0 writes that full state
(every DTensor gathered) to EXPECTED/final.safetensors.

``restore`` builds a fresh model and optimizer (other random weights), loads the newest
checkpoint that verifies through :func:`load_sharded`, and prints ``restored STEP same``
when the full state equals EXPECTED/step-STEP, ``restored STEP differs KEY`` otherwise;
each warning is printed as ``warning TEXT`` first, an error as ``error TYPE TEXT``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from nbresume.checkpoint.format import TEMP_PREFIX, flatten
from nbresume.checkpoint.loop import Checkpointer
from nbresume.checkpoint.parallel import load_sharded, save_sharded
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import NbresumeError


class This:
    """Which rank this forked process is."""

    rank = 0


def say(*words: object) -> None:
    # One write per line: both ranks share the pipe, and a line must not interleave.
    sys.stdout.write(" ".join(str(w) for w in (f"rank{This.rank}", *words)) + "\n")
    sys.stdout.flush()


def build(seed: int, width: int = 32) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 8, bias=True)
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    data = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(4, 16, generator=data)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def full_state(state: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The whole state, every DTensor gathered: (JSON document, {key: tensor})."""

    def gather(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.full_tensor()
        if isinstance(value, dict):
            return {k: gather(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(gather(v) for v in value)
        return value

    document, tensors = flatten(gather(state), name="state")
    return document, {k: v.contiguous() for k, v in tensors.items()}


def save(args: argparse.Namespace) -> None:
    store = CheckpointStore(args.root, keep=3)
    model, optimizer = build(seed=0)
    for step in range(1, 4):
        train_step(model, optimizer, step)
        if args.kill_only:
            continue
        state = sharded_state(model, optimizer)
        save_sharded(store, step, state, data={"progress": {"step": step}})
        document, tensors = full_state(state)
        if dist.get_rank() == 0:
            save_file(tensors, str(args.expected / f"step-{step}.safetensors"))
            (args.expected / f"step-{step}.json").write_text(json.dumps(document))
        say("saved", step)
    if args.kill_at_step is None:
        return
    train_step(model, optimizer, args.kill_at_step)
    state = sharded_state(model, optimizer)

    def die_at(event: str, event_args: tuple[Any, ...]) -> None:
        if not event_args or not isinstance(event_args[0], (str, os.PathLike)):
            return
        path = Path(event_args[0])
        if args.kill_file == "commit":
            # The rename of the complete temporary folder (manifest written) into place.
            hit = event == "os.rename" and path.name.startswith(TEMP_PREFIX)
        else:
            hit = event == "open" and path.name == args.kill_file
            hit = hit and path.parent.name.startswith(TEMP_PREFIX)
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)

    if args.kill_rank == This.rank:
        sys.addaudithook(die_at)
    say("saving", args.kill_at_step)
    save_sharded(store, args.kill_at_step, state, data={"progress": {"step": args.kill_at_step}})
    say("saved", args.kill_at_step)


def restore(args: argparse.Namespace) -> None:
    store = CheckpointStore(args.root, keep=3)
    model, optimizer = build(seed=12345)  # other weights than any saved step
    state = sharded_state(model, optimizer)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = load_sharded(store, state)
    except NbresumeError as exc:
        say("error", type(exc).__name__, str(exc).replace("\n", " "))
        return
    for warning in caught:
        if issubclass(warning.category, RuntimeWarning):
            say("warning", str(warning.message).replace("\n", " "))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    if loaded.data != {"progress": {"step": loaded.step}}:
        say("restored", loaded.step, "differs", "progress")
        return
    document, tensors = full_state(sharded_state(model, optimizer))
    want_tensors = load_file(str(args.expected / f"step-{loaded.step}.safetensors"))
    want_document = json.loads((args.expected / f"step-{loaded.step}.json").read_text())
    differs = [k for k in want_tensors if not torch.equal(tensors.get(k), want_tensors[k])]
    if set(tensors) != set(want_tensors) or differs:
        say("restored", loaded.step, "differs", (differs or ["keys"])[0])
    elif json.loads(json.dumps(document)) != want_document:
        say("restored", loaded.step, "differs", "values")
    else:
        say("restored", loaded.step, "same")


def train(args: argparse.Namespace) -> None:
    """A training loop under a Checkpointer that holds the FSDP2 model and its optimizer."""
    model, optimizer = build(seed=0, width=args.width)
    ckpt = Checkpointer(args.root, every=2, keep=2, deadline=None, model=model, optimizer=optimizer)
    report = ckpt.verify()  # before the restore: with the objects to fit
    for result in report.results:
        if not result.ok:
            say("failed", result.step, result.problem.replace("\n", " "))
    say("verified", report.summary)
    say("start", ckpt.restore())
    for step in ckpt.steps(args.total):
        train_step(model, optimizer, step + 1)
        if step + 1 == args.stop_after:
            ckpt.request_stop("asked to")
    document, tensors = full_state(sharded_state(model, optimizer))
    if dist.get_rank() == 0:  # the full state the run ended with, for a plain restore
        save_file(tensors, str(args.expected / "final.safetensors"))
    digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode())
    for key in sorted(tensors):
        digest.update(key.encode() + tensors[key].numpy().tobytes())
    say("final", ckpt.step, digest.hexdigest())


def run_rank(rank: int, port: int, argv: list[str]) -> int:
    """One rank of one run, in a forked process."""
    This.rank = rank
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "restore", "train"])
    parser.add_argument("root")
    parser.add_argument("expected", type=Path)
    parser.add_argument("--total", type=int, default=6)
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--width", type=int, default=32, help="of the model's hidden layer")
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-file", default="")
    parser.add_argument("--kill-only", action="store_true")
    args = parser.parse_args(argv)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    # A peer that dies must end this rank's wait, not leave it hanging for the default 30 min.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        {"save": save, "restore": restore, "train": train}[args.mode](args)
    except Exception as exc:
        say("error", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        dist.destroy_process_group()
        return 1
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every result is reported: what follows is torch's teardown alone, which can still abort
    # (see teardown.py).
    say("teardown")
    dist.destroy_process_group()
    return 0


def main() -> None:
    import rank_server  # a sibling when run as a script (a test may import this module)

    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    rank_server.serve(
        lambda rank, world, port, argv: run_rank(rank, port, argv), world=lambda argv: 2
    )


if __name__ == "__main__":
    main()
