"""``nbresume demo``: the promise, shown on a local folder.

A child process saves a checkpoint at every step; the demo kills it with SIGKILL at a random
instant (often in the middle of a save); then it loads the newest checkpoint, checks that its
weights are exactly the ones saved at that step, and verifies every checkpoint byte by byte.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MARKER = ".nbresume-demo"
KEEP = 3


def model_state(step: int) -> dict[str, Any]:
    """The weights the demo's "training" has reached at ``step`` (a pure function of it)."""
    try:
        import torch
    except ImportError:
        import numpy as np

        rng = np.random.default_rng(step)
        return {
            "encoder.weight": rng.standard_normal((512, 1024), dtype=np.float32),
            "encoder.bias": rng.standard_normal(512, dtype=np.float32),
            "head.weight": rng.standard_normal((10, 512), dtype=np.float32),
        }
    generator = torch.Generator().manual_seed(step)
    return {
        "encoder.weight": torch.randn(512, 1024, generator=generator),
        "encoder.bias": torch.randn(512, generator=generator),
        "head.weight": torch.randn(10, 512, generator=generator),
    }


def fingerprint(tensors: dict[str, Any]) -> str:
    """SHA-256 over names and raw bytes, in name order."""
    from nbresume.checkpoint.tensorfile import to_raw

    digest = hashlib.sha256()
    for name in sorted(tensors):
        raw = to_raw(tensors[name], name=name)
        digest.update(f"{name}:{raw.dtype}:{raw.shape}".encode())
        digest.update(raw.data)
    return digest.hexdigest()


def _child(folder: str) -> None:
    from nbresume.checkpoint.store import CheckpointStore

    store = CheckpointStore(folder, keep=KEEP)
    step = 0
    while True:
        step += 1
        store.save(step, tensors={"model": model_state(step)}, data={"state": {"step": step}})
        print(step, flush=True)


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
    from nbresume.checkpoint.store import CheckpointStore, format_bytes
    from nbresume.errors import NbresumeError

    rng = random.Random(seed)  # noqa: S311 - timing of a demo, not security
    path = Path(folder).resolve()
    _prepare(path)
    size = sum(raw.nbytes for raw in _raws(model_state(0)))
    print(f"nbresume demo in {path}")
    print(f"1. A child process saves a {format_bytes(size)} model at every step (keep={KEEP}).")
    child = subprocess.Popen(
        [sys.executable, "-m", "nbresume.demo", "--child", str(path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    target = rng.randint(3, 8)
    reported = 0
    for line in child.stdout:
        reported = int(line)
        if reported >= target:
            break
    if reported < target:
        print(f"   the child stopped early (exit status {child.wait()}).", file=sys.stderr)
        return 1
    # Land the kill anywhere in the next save: payload writes, manifest, rename, retention.
    delay = rng.uniform(0.0, 0.05)
    time.sleep(delay)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    print(f"   it reported steps 1..{reported} as saved.")
    print(f"2. SIGKILL, {delay * 1000:.0f} ms after the child reported step {reported}.")
    hidden = sorted(
        p.name for p in path.iterdir() if p.name.startswith(".nbresume-") and p.is_dir()
    )
    if hidden:
        print(f"   it left {len(hidden)} unfinished folder(s) behind: {', '.join(hidden)}")

    store = CheckpointStore(path, keep=KEEP)
    try:
        loaded = store.load()
    except NbresumeError as exc:
        print(f"3. Restore failed: {exc}", file=sys.stderr)
        return 1
    got = fingerprint(loaded.tensors["model"])
    expected = fingerprint(model_state(loaded.step))
    same = got == expected
    print(f"3. A fresh process restores step {loaded.step}: the newest checkpoint that verifies.")
    print(f"   weights sha256 {got[:16]}… {'==' if same else '!='} expected {expected[:16]}…")
    if loaded.step < reported:
        print(f"   step {reported} was reported saved but is missing: the promise is broken.")
        same = False

    report = store.verify()
    print("4. nbresume verify:")
    for result in report.results:
        print(f"   {result}")
    print(f"   {report.summary}")
    if same and report.ok:
        print("The promise held: every step reported saved is there, loads, and matches.")
        return 0
    print("The promise did not hold.", file=sys.stderr)
    return 1


def _raws(tensors: dict[str, Any]) -> list[Any]:
    from nbresume.checkpoint.tensorfile import to_raw

    return [to_raw(v, name=k) for k, v in tensors.items()]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
