"""``nbresume demo``: the promise, shown on a local folder.

It trains a small model twice with the identical command: once without interruption, and once
killed with SIGKILL at two random moments (a kill can land in the middle of a save) and simply
started again each time. The interrupted run resumes from its newest verified checkpoint and
ends with weights bit-identical to the uninterrupted one; every checkpoint left on disk is then
verified against its manifest.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from nbresume.checkpoint.store import CheckpointStore

MARKER = ".nbresume-demo"
TOTAL_STEPS = 120


def _run(folder: Path, kill_after: int | None, rng: random.Random) -> tuple[int, str, int]:
    """Run the job once; SIGKILL it at a random instant after step ``kill_after``.

    Returns (step it started from, its final hash or "", last step it printed)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "nbresume.demo_job", str(folder), str(TOTAL_STEPS)],
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
