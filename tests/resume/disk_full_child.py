"""Background saves onto a small real file system that fills up; report what was seen.

Run as ``python disk_full_child.py MOUNT`` where MOUNT is a freshly mounted private tmpfs of a
few MiB (the test mounts it inside ``unshare --user --map-root-user --mount``). Prints one
JSON object on its last line; the test makes the assertions. At the very end it starts one
more background save that cannot fit and exits without waiting for it: the interpreter's exit
must still report that failure on stderr.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nbresume
from nbresume.checkpoint.store import LEASE_NAME


def fill(path: Path, leave: int) -> None:
    """Write ``path`` until fewer than ``leave`` bytes are free (a dataset cache, a log)."""
    with open(path, "ab") as handle:
        while True:
            stat = os.statvfs(path.parent)
            free = stat.f_bavail * stat.f_frsize
            if free <= leave:
                return
            try:
                handle.write(b"\0" * min(free - leave, 1 << 18))
                handle.flush()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return


def main() -> int:
    mount = Path(sys.argv[1])
    root = mount / "run"
    torch.manual_seed(0)
    model = nn.Linear(256, 256)  # 257 KiB of parameters, twice that of AdamW state
    optimizer = torch.optim.AdamW(model.parameters())
    events: list[list[Any]] = []
    ckpt = nbresume.Checkpointer(
        root, every=None, keep=2, deadline=None, async_save=True, model=model, optimizer=optimizer,
        callbacks=[lambda e: events.append([e.kind, e.step, str(e.data.get("error", ""))])],
    )  # fmt: skip
    ckpt.restore()

    def train_step() -> None:
        loss = model(torch.randn(8, 256)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    report: dict[str, Any] = {}
    train_step()
    ckpt.save(1)
    ckpt.wait()
    report["size"] = ckpt.latest().size  # type: ignore[union-attr]
    filler = mount / "cache.bin"
    fill(filler, leave=report["size"] // 2)

    train_step()
    report["save_returned"] = repr(ckpt.save(2))  # in the background: returns at once
    try:
        ckpt.wait()
    except nbresume.CheckpointError as exc:
        report["raised"] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "cause": type(exc.__cause__).__name__,
        }
    report["events_after_failure"] = list(events)
    report["verify_after_failure"] = nbresume.verify(root).summary
    report["steps_after_failure"] = [info.step for info in ckpt.list()]
    # Leftovers of the failed save; the live writer's lease is not one.
    report["hidden_after_failure"] = sorted(
        n for n in os.listdir(root) if n.startswith(".") and n != LEASE_NAME
    )
    try:
        ckpt.wait()  # the failure was reported once; it is not raised a second time
        report["raised_again"] = False
    except nbresume.CheckpointError:
        report["raised_again"] = True

    filler.unlink()  # space is back: saving works again
    train_step()
    ckpt.save(3)
    ckpt.wait()
    report["steps_after_recovery"] = [info.step for info in ckpt.list()]
    report["verify_after_recovery"] = nbresume.verify(root).summary

    fill(filler, leave=report["size"] // 2)
    train_step()
    ckpt.save(4)  # fails in the background while the interpreter exits
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
