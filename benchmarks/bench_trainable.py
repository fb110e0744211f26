"""What a trainable-only checkpoint costs and saves, on a LoRA-style model with a large frozen base.

The model: ``layers`` frozen ``Linear(dim, dim)`` layers (float32; 32 layers of 2048 give
537 MB of frozen weights), each with a trainable LoRA pair of rank ``rank``, and AdamW over
the trainable parameters after one step. Measured, each ``reps`` times (medians reported):

  fingerprint, first       the first ``state_dict()`` of a new wrapper: hashes every frozen
                           tensor (SHA-256) and collects the trainable ones
  state_dict, cached       a later ``state_dict()``: the frozen digests come from the cache
  restore check            ``load_state_dict()`` on a new wrapper of a fresh copy of the base:
                           one hashing pass over the frozen part, compared, then the copy-in
  save, full               ``Checkpointer.save`` (blocking, verified) of model + optimizer
  save, trainable-only     the same with ``trainable_only=True``: its first save (which
                           fingerprints the base), then a later one (from the cache)

and the size of each checkpoint folder. ``python -m benchmarks`` runs it (the ``trainable``
suite, in a fresh process) and writes ``results/trainable.md``; alone, it prints the page and
writes nothing:

    .venv/bin/python benchmarks/bench_trainable.py --layers 32 --dim 2048 --reps 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

KEYS = ("fingerprint, first", "state_dict, cached", "restore check", "save, full",
        "save, trainable-only, first", "save, trainable-only, later")  # fmt: skip


def build(layers: int, dim: int, rank: int) -> Any:
    import torch
    from torch import nn

    class LoRALinear(nn.Module):
        def __init__(self, d: int, rank: int) -> None:
            super().__init__()
            self.base = nn.Linear(d, d).requires_grad_(False)
            self.lora_a = nn.Parameter(torch.randn(rank, d) * 0.02)
            self.lora_b = nn.Parameter(torch.zeros(d, rank))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + x @ self.lora_a.T @ self.lora_b.T

    torch.manual_seed(0)
    return nn.Sequential(*(LoRALinear(dim, rank) for _ in range(layers)))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def measure(layers: int, dim: int, rank: int, reps: int, root: Path) -> dict[str, Any]:
    """Every measurement (checkpoints go below ``root``, removed after each); the numbers."""
    import torch

    from nbresume import Checkpointer, trainable_only

    model = build(layers, dim, rank)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    trainable = [p for p in model.parameters() if p.requires_grad]
    share = sum(p.numel() for p in trainable) / sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    model(torch.randn(4, dim)).square().mean().backward()
    optimizer.step()
    fresh = build(layers, dim, rank)  # the same base, loaded again

    times: dict[str, list[float]] = {key: [] for key in KEYS}
    sizes: dict[str, int] = {}
    for rep in range(reps):
        wrapped = trainable_only(model)
        started = time.perf_counter()
        state = wrapped.state_dict()
        times["fingerprint, first"].append(time.perf_counter() - started)
        started = time.perf_counter()
        wrapped.state_dict()
        times["state_dict, cached"].append(time.perf_counter() - started)
        other = trainable_only(fresh)
        started = time.perf_counter()
        other.load_state_dict(state)
        times["restore check"].append(time.perf_counter() - started)
        for mode in ("full", "trainable-only"):
            folder = root / f"{mode}-{rep}"
            ckpt = Checkpointer(folder, model=model, optimizer=optimizer, every=None,
                                deadline=None, async_save=False,
                                trainable_only=mode == "trainable-only")  # fmt: skip
            started = time.perf_counter()
            ckpt.save(step=1)
            key = "save, full" if mode == "full" else "save, trainable-only, first"
            times[key].append(time.perf_counter() - started)
            sizes[mode] = folder_bytes(folder / "000000000001")
            if mode == "trainable-only":
                started = time.perf_counter()
                ckpt.save(step=2)
                times["save, trainable-only, later"].append(time.perf_counter() - started)
            ckpt.close()
            shutil.rmtree(folder)
    return {"layers": layers, "dim": dim, "rank": rank, "reps": reps, "frozen_bytes": frozen,
            "trainable_share": share, "times": times, "sizes": sizes}  # fmt: skip


def child(args: dict[str, Any]) -> dict[str, Any]:
    """The runner's entry (in a fresh process): ``measure`` below ``args["folder"]``."""
    root = Path(args["folder"])
    root.mkdir(parents=True, exist_ok=True)
    try:
        return measure(args["layers"], args["dim"], args["rank"], args["reps"], root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def render(result: dict[str, Any]) -> str:
    """The page: a title, then the tables (the runner adds the run's header line)."""
    mb = 1e6
    times, sizes = result["times"], result["sizes"]
    lines = [
        "# Trainable-only checkpoints: cost and size",
        "",
        f"Model: {result['layers']} frozen Linear({result['dim']}, {result['dim']}) layers, "
        f"{result['frozen_bytes'] / mb:.0f} MB of frozen float32 weights, LoRA rank "
        f"{result['rank']}: {result['trainable_share']:.2%} of the parameters train. AdamW over "
        f"the trainable parameters. {result['reps']} repetition(s), in one fresh process.",
        "",
        "| What | Median (s) | Every repetition (s) |",
        "|---|---|---|",
    ]
    for name, values in times.items():
        every = ", ".join(f"{v:.3f}" for v in values)
        lines.append(f"| {name} | {statistics.median(values):.3f} | {every} |")
    first = statistics.median(times["fingerprint, first"])
    lines += [
        "",
        f"Hashing the frozen part: {result['frozen_bytes'] / mb / first:.0f} MB/s (one thread).",
        "",
        "| Checkpoint | Size (MB) |",
        "|---|---|",
        f"| full (model + optimizer) | {sizes['full'] / mb:.1f} |",
        f"| trainable-only (+ fingerprint) | {sizes['trainable-only'] / mb:.2f} |",
        f"| ratio | {sizes['full'] / sizes['trainable-only']:.1f}x |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-trainable-", dir=args.dir) as root:
        result = measure(args.layers, args.dim, args.rank, args.reps, Path(root))
    print(render(result))


if __name__ == "__main__":
    main()
