"""``nbresume.lightning.CheckpointIO`` against Lightning's own checkpoint plugins.

One Lightning checkpoint dictionary (an MLP of ``--mb`` MB of weights, its AdamW state after a
step, the loop counters) is saved and loaded ``--reps`` times by each plugin, on the same disk:

  nbresume          ``nbresume.lightning.CheckpointIO``: safetensors + JSON through the pending
                    checkpoint, every file fsynced and hashed, the manifest, the rename, the
                    read-back verification; the load re-hashes every byte before parsing
  torch             Lightning's default ``TorchCheckpointIO``: ``torch.save`` of one pickle,
                    no fsync, nothing verified; ``torch.load`` to read it
  async             ``AsyncCheckpointIO(TorchCheckpointIO())``: the save call returns while a
                    thread writes; "done" is when that write finished

Medians, and nbresume's time as a ratio of each. Run from the repository root:

    .venv/bin/python -m benchmarks.bench_lightning --mb 50 --reps 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import conditions, measured, publish, timing

RESULTS = Path(__file__).with_name("results") / "lightning.md"


def checkpoint(mb: float) -> dict[str, Any]:
    """A Lightning checkpoint dictionary with about ``mb`` MB of weights (and twice that of
    AdamW state)."""
    import torch
    from torch import nn

    width = max(8, int((mb * 1e6 / 4 / 4) ** 0.5))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return {
        "epoch": 0,
        "global_step": 1,
        "pytorch-lightning_version": "2.6",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1}}}},
        "callbacks": {},
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [],
    }


def measure(mb: float, reps: int, scratch: Path) -> dict[str, Any]:
    """Save and load times of each plugin (seconds per repetition)."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    import nbresume.lightning

    state = checkpoint(mb)
    times: dict[str, list[float]] = {
        k: [] for k in ("nbresume_save", "nbresume_load", "torch_save", "torch_load",
                        "async_call", "async_done")
    }  # fmt: skip
    nbresume_io = nbresume.lightning.CheckpointIO()
    torch_io = TorchCheckpointIO()
    for rep in range(reps):
        path = scratch / f"nbresume-{rep}.ckpt"
        with timing(times["nbresume_save"]):
            nbresume_io.save_checkpoint(state, path)
        with timing(times["nbresume_load"]):
            nbresume_io.load_checkpoint(path)
        nbresume_io.remove_checkpoint(path)

        path = scratch / f"torch-{rep}.ckpt"
        with timing(times["torch_save"]):
            torch_io.save_checkpoint(state, path)
        with timing(times["torch_load"]):
            torch_io.load_checkpoint(path, weights_only=False)
        torch_io.remove_checkpoint(path)

        async_io = AsyncCheckpointIO(TorchCheckpointIO())
        path = scratch / f"async-{rep}.ckpt"
        with timing(times["async_done"]):
            with timing(times["async_call"]):
                async_io.save_checkpoint(state, path)
            async_io.teardown()  # waits for the write in flight
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    size = sum(t.numel() * t.element_size() for t in state["state_dict"].values())
    return {"times": times, "weights_bytes": size}


def render(result: dict[str, Any], meta: dict[str, Any]) -> str:
    median = {k: statistics.median(v) for k, v in result["times"].items()}

    def ratio(a: str, b: str) -> str:
        return f"{median[a] / median[b]:.2f}x" if median[b] > 0 else "n/a"

    return "\n".join([
        "# nbresume.lightning.CheckpointIO against Lightning's checkpoint plugins",
        "",
        f"Command: `{meta['command']}`",
        "",
        conditions(meta),
        "",
        f"One checkpoint: {result['weights_bytes'] / 1e6:.1f} MB of weights, plus AdamW's two "
        "moments.",
        "",
        "| Plugin | Save (s) | Load (s) | nbresume's save / this | nbresume's load / this |",
        "|---|---|---|---|---|",
        f"| nbresume CheckpointIO (fsync, verified) | {median['nbresume_save']:.3f} | "
        f"{median['nbresume_load']:.3f} | 1.00x | 1.00x |",
        f"| TorchCheckpointIO (no fsync, not verified) | {median['torch_save']:.3f} | "
        f"{median['torch_load']:.3f} | {ratio('nbresume_save', 'torch_save')} | "
        f"{ratio('nbresume_load', 'torch_load')} |",
        f"| AsyncCheckpointIO, the call returns | {median['async_call']:.3f} | "
        f"{median['torch_load']:.3f} | {ratio('nbresume_save', 'async_call')} | "
        f"{ratio('nbresume_load', 'torch_load')} |",
        f"| AsyncCheckpointIO, the write done | {median['async_done']:.3f} | "
        f"{median['torch_load']:.3f} | {ratio('nbresume_save', 'async_done')} | "
        f"{ratio('nbresume_load', 'torch_load')} |",
        "",
        "nbresume's save includes the fsync of every file and the read-back verification; its "
        "load re-hashes every byte before parsing. TorchCheckpointIO does neither.",
        "",
    ])  # fmt: skip


def run(mb: float, reps: int, scratch: Path, command: str) -> tuple[str, dict[str, Any]]:
    """Every measurement; the page and the raw numbers."""
    result = measured(lambda: measure(mb, reps, scratch), scratch, command)
    return render(result, result["meta"]), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    args = parser.parse_args()
    command = f".venv/bin/python -m benchmarks.bench_lightning --mb {args.mb:g} --reps {args.reps}"
    with tempfile.TemporaryDirectory(prefix="bench-lightning-", dir=args.dir) as scratch:
        page, _ = run(args.mb, args.reps, Path(scratch) / "lightning", command)
    publish(page, RESULTS)


if __name__ == "__main__":
    main()
