"""Save checkpoints onto a small real file system until it is full; report what happened.

Run as ``python tmpfs_child.py DIR SCENARIO [DELAY]`` where DIR is a freshly mounted, private tmpfs
(the test mounts it inside ``unshare --user --map-root-user --mount``, so nothing outside
this process tree sees it). Prints one JSON object on its last line with the observations;
the test makes the assertions.

Scenarios:
    no-check   ``check_space=False`` and ``keep=None``: the up-front space check is switched
               off so that the disk fills up in the middle of a write, at a byte offset set by
               the file system's size (the test draws sizes at random).
    up-front   ``check_space=True`` and ``keep=None``: the store must refuse the save that no
               longer fits before writing anything.
    filler     ``check_space=True`` and ``keep=2`` while another process, started after a delay
               (seconds, the third argument), fills the disk: space runs out after the up-front
               check passed, or the check refuses.
    inodes     ``check_space=False`` on a file system with plenty of bytes but few inodes:
               creating a folder or a file fails with ENOSPC.

After the failure, space is given back (``mount -o remount`` to a larger size, or the log
file is deleted) and the same step is saved again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# Run as a script: its own folder is on sys.path (mypy, seeing a package, cannot tell).
from saver import state_for, state_mismatch  # type: ignore[import-not-found]

from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import NbresumeError, StorageFullError


def start_filler(path: Path, delay: float) -> threading.Thread:
    """After ``delay`` seconds, another process writes zeros to ``path`` until the disk is
    full, as a training log or a dataset download does."""

    def fill() -> None:
        time.sleep(delay)
        with open(path, "wb") as log:
            subprocess.run(["dd", "if=/dev/zero", "bs=256k"], stdout=log, stderr=subprocess.DEVNULL)

    thread = threading.Thread(target=fill, daemon=True)
    thread.start()
    return thread


def observe_error(exc: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, StorageFullError):
        out.update(needed=exc.needed, free=exc.free)
    if not isinstance(exc, NbresumeError):
        out["traceback"] = "".join(traceback.format_exception(exc))
    return out


def main() -> int:
    root, scenario = Path(sys.argv[1]), sys.argv[2]
    folder = root / "run"
    report: dict[str, Any] = {"scenario": scenario, "saved": []}
    keep = 2 if scenario == "filler" else None
    store = CheckpointStore(folder, keep=keep, check_space=scenario in ("up-front", "filler"))
    filler = None
    if scenario == "filler":
        filler = start_filler(root / "train.log", float(sys.argv[3]))
    step = 0
    try:
        for step in range(1, 400):
            store.save(step, **state_for(step))
            report["saved"].append(step)
    except Exception as exc:
        report["error"] = observe_error(exc)
    report["failed_step"] = step
    if filler is not None:
        filler.join()
    report["leftovers"] = sorted(os.listdir(folder)) if folder.exists() else []
    results = store.verify().results
    report["verified"] = [[r.step, r.ok, r.problem] for r in results]
    report["contents"] = {}
    for result in results:
        loaded = store.load(result.step, framework="numpy")
        report["contents"][result.step] = state_mismatch(result.step, loaded.tensors, loaded.data)

    # Give the space back, then the same step must save.
    if filler is not None:
        (root / "train.log").unlink()
    else:
        subprocess.run(["mount", "-o", "remount,size=256m,nr_inodes=100000", str(root)], check=True)
    try:
        store.save(step, **state_for(step))
        report["retry"] = "saved"
        report["verified_after_retry"] = [[r.step, r.ok] for r in store.verify().results]
    except Exception as exc:
        report["retry"] = observe_error(exc)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
