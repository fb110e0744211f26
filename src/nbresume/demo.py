"""``nbresume demo``: the promise, shown on a local folder.

It trains a small model twice with the identical command: once without interruption, and once
killed with SIGKILL at two random moments (a kill can land in the middle of a save) and simply
started again each time. The interrupted run resumes from its newest verified checkpoint and
ends with weights bit-identical to the uninterrupted one; every checkpoint left on disk is then
verified against its manifest.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

MARKER = ".nbresume-demo"
TOTAL_STEPS = 120


def _train(folder: str, total: int) -> None:
    """The training job: the same code a user would write (run in a child process)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import nbresume

    torch.manual_seed(0)
    random.seed(0)  # its state is saved too: seeded, every checkpoint has the same bytes each time
    torch.set_num_threads(1)
    features = torch.randn(512, 32)
    labels = (features[:, :4].sum(dim=1) > 0).long()
    loader = DataLoader(TensorDataset(features, labels), batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)

    # The demo tells the story itself: no status line, and the takeover of the writer lease
    # of the process it just killed is expected here, not worth a warning.
    logging.getLogger("nbresume").setLevel(logging.ERROR)
    ckpt = nbresume.Checkpointer(
        folder,
        every=10,
        keep=3,
        quiet=True,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
    )
    start = ckpt.restore()
    print(f"start {start}", flush=True)
    batches = ckpt.loader(loader).batches()
    for step in ckpt.steps(total):
        x, y = next(batches)
        noisy = x + 0.05 * torch.randn_like(x)  # randomness in the loop, restored exactly
        loss = nn.functional.cross_entropy(model(noisy), y)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        scheduler.step()
        print(f"step {step + 1}", flush=True)
    ckpt.close()
    print(f"final {weights_hash(model)}", flush=True)


def weights_hash(model: Any) -> str:
    """SHA-256 over every parameter and buffer, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _run(folder: Path, kill_after: int | None, rng: random.Random) -> tuple[int, str, int]:
    """Run the job once; SIGKILL it at a random instant after step ``kill_after``.

    Returns (step it started from, its final hash or "", last step it printed)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "nbresume.demo", "--train", str(folder), str(TOTAL_STEPS)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert child.stdout is not None
    start, final, last = 0, "", 0
    for line in child.stdout:
        word, _, value = line.strip().partition(" ")
        if word == "start":
            start = int(value)
        elif word == "step":
            last = int(value)
            if kill_after is not None and last >= kill_after:
                # A random instant within the next few steps: it may land inside a save.
                deadline = rng.randint(0, 4)
                if last >= kill_after + deadline:
                    child.send_signal(signal.SIGKILL)
                    break
        elif word == "final":
            final = value
    child.wait()
    return start, final, last


def _prepare(folder: Path) -> None:
    if folder.exists() and any(folder.iterdir()) and not (folder / MARKER).exists():
        raise SystemExit(
            f"nbresume demo: {folder} exists and was not made by the demo; "
            "pass --dir with a new or empty folder"
        )
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("made by `nbresume demo`; safe to delete\n")


def run_demo(folder: str, *, seed: int | None = None) -> int:
    """Run the demo in ``folder``; return the exit status."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("nbresume demo trains a small PyTorch model: pip install torch", file=sys.stderr)
        return 1
    from nbresume.checkpoint.store import CheckpointStore

    rng = random.Random(seed)  # noqa: S311 - when to kill, not security
    root = Path(folder).resolve()
    _prepare(root)
    reference, interrupted = root / "uninterrupted", root / "interrupted"
    print(f"nbresume demo in {root}: {TOTAL_STEPS} steps of a small model, saved every 10 steps")

    _, expected, _ = _run(reference, None, rng)
    print(f"1. Uninterrupted run: final weights sha256 {expected[:16]}…")
    print("2. The identical command, killed twice with SIGKILL and started again:")

    kills = sorted(rng.sample(range(12, TOTAL_STEPS - 10), 2))
    final = ""
    for attempt in range(3):
        kill_after = kills[attempt] if attempt < len(kills) else None
        start, final, last = _run(interrupted, kill_after, rng)
        began = f"resumed from step {start}" if start else "started fresh"
        if kill_after is None:
            print(f"   run {attempt + 1}: {began + ',':<25} ran to step {last}, the end")
            continue
        cut = " (mid-save)" if any(interrupted.glob(".nbresume-tmp-*")) else ""
        print(f"   run {attempt + 1}: {began + ',':<25} killed after step {last}{cut}")
    same = final == expected
    print(f"3. Interrupted run:   final weights sha256 {final[:16]}…")
    print(f"   bit-identical to the uninterrupted run: {'yes' if same else 'NO'}")

    report = CheckpointStore(interrupted, keep=None).verify()
    print(f"4. nbresume verify {interrupted}:")
    for result in report.results:
        print(f"   {result}")
    print(f"   {report.summary}")
    if same and report.ok:
        print("The promise held: killed twice, resumed from verified checkpoints, same weights.")
        return 0
    print("The promise did not hold.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--train":
        _train(sys.argv[2], int(sys.argv[3]))
