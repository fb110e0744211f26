"""Fork while nbresume's locks are held by another thread, as a background save, the lease
heartbeat or a worker pool holds them at any moment, and run nbresume in the child.

``python fork_while_locked.py PARENT CHILD``: a Checkpointer writes to PARENT; a thread takes
nbresume's locks and keeps them while the main thread forks. The child saves its parent's
Checkpointer (refused: the parent holds the folder), trains and saves with a Checkpointer of
its own in CHILD (the lease, the status line, the loop, the fsync and copy workers, a
retention removal), and ends normally, so the exit hooks run too. Prints ``child refused``,
``child saved N``, ``child ended STATUS`` (or ``child hung``: killed after a minute), then
``parent lease kept`` and ``parent saved N``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import nbresume
from nbresume.checkpoint.backends import local
from nbresume.checkpoint.state import health, snapshot
from nbresume.checkpoint.store import hashing, lease
from nbresume.errors import FolderInUseError
from nbresume.notebook import progress


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def child(ck: nbresume.Checkpointer, model: torch.nn.Linear, folder: Path) -> None:
    try:
        ck.save()
    except FolderInUseError:
        say("child refused")
    own = nbresume.Checkpointer(folder, every=1, keep=1, deadline=None, model=model)
    for _ in own.steps(3):
        model.weight.data.add_(1.0)
    hashing._WORKERS.submit(lambda: None)  # what a save of larger files hands over
    snapshot._COPIER.submit(lambda: None)
    own.close()
    say(f"child saved {own.step}")


def main() -> int:
    parent_folder, child_folder = Path(sys.argv[1]), Path(sys.argv[2])
    model = torch.nn.Linear(2, 2)
    ck = nbresume.Checkpointer(
        parent_folder, every=None, keep=1, deadline=None, async_save=False, model=model
    )
    ck.save()
    assert ck._lease is not None
    assert (parent_folder / lease.LEASE_NAME).exists()
    locks: list[Any] = [
        lease._REGISTRY_LOCK,
        ck._lease._lock,
        hashing._WORKERS._lock,
        snapshot._COPIER._lock,
        local.REMOVALS._changed,
        health._lock,
        progress._TRACKER.lock,
        progress.tracker()._lock,
    ]
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait()
        for lock in reversed(locks):
            lock.release()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        try:
            child(ck, model, child_folder)
        except BaseException:
            say("child error " + traceback.format_exc().replace("\n", " | "))
            os._exit(1)
        sys.exit(0)  # a normal end: the exit hooks of nbresume run in the child
    release.set()
    holder.join()
    deadline = time.monotonic() + 60
    while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            say("child hung")
            return 1
        time.sleep(0.01)
    say(f"child ended {os.waitstatus_to_exitcode(ended[1])}")
    if (parent_folder / lease.LEASE_NAME).exists():
        say("parent lease kept")
    ck.save()
    say(f"parent saved {ck.step}")
    ck.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
