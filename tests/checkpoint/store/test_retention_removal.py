"""Retention on a local folder: a deleted checkpoint leaves every reader's view before save()
returns; its files are removed in the background, and that removal is over before the next
save writes, before a Checkpointer gives the folder back, and before the interpreter exits.

The cases that need a process to end (or to die) run a child process whose audit hook makes
the removal slow, or blocks it until the script lets it go, the way a slow disk would: what
is checked then does not depend on how fast the machine is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from nbresume import Checkpointer, CheckpointStore
from nbresume.checkpoint.backends import DELETING_PREFIX
from nbresume.checkpoint.format import step_dirname
from testkit import warmfork
from testkit.stateful import Counter


def hidden(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("."))


def step_folders(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if not name.startswith("."))


def state(step: int) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {"w": torch.full((64, 64), float(step))}}


def test_a_deleted_checkpoint_is_out_of_view_at_once_and_off_the_disk_after_waiting(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    store.save(1, tensors=state(1))
    store.save(2, tensors=state(2))

    assert [info.step for info in store.list()] == [2]
    latest = store.latest()
    assert latest is not None
    assert latest.step == 2
    assert step_folders(tmp_path) == [step_dirname(2)]
    store.wait_removals()
    assert hidden(tmp_path) == []
    assert torch.equal(store.load().tensors["model"]["w"], state(2)["model"]["w"])


def test_a_checkpointer_leaves_no_hidden_folder_once_closed(tmp_path: Path) -> None:
    root = tmp_path / "run"
    ckpt = Checkpointer(root, every=1, keep=1, deadline=None, async_save=True, counter=Counter())
    for _ in ckpt.steps(5):
        pass
    ckpt.close()
    assert step_folders(root) == [step_dirname(5)]
    assert hidden(root) == []


# The child: saves with keep=1 through a disk whose removals are slow. Its audit hook sees
# every removal of a folder that retention took out of view, and every start of a save's
# writing (the creation of its temporary folder), where it notes which such folders are
# still on the disk. ``mode``:
#   exit: three saves, then the script ends at once;
#   gate: after the second save, prints what a reader sees while the removal is held back,
#         then lets it go and saves again; prints what the third save found as it began;
#   kill: the process is killed (SIGKILL) as the removal of the first checkpoint starts.
_CHILD = r"""
import json, os, signal, sys, threading, time
import numpy as np
from nbresume import CheckpointStore

root, mode = sys.argv[1], sys.argv[2]
DELETING, TEMP = ".nbresume-old-deleting-", ".nbresume-tmp-"
released = threading.Event()
found_at_start = []
busy = threading.local()

def on_audit(event, args):
    if getattr(busy, "on", False) or not args:
        return
    name = os.path.basename(str(args[0]))
    if event == "shutil.rmtree" and name.startswith(DELETING):
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "gate":
            released.wait(120)
        time.sleep(0.5)  # a slow disk: the removal is still going when the script goes on
    elif event == "os.mkdir" and name.startswith(TEMP):
        busy.on = True
        try:
            found_at_start.append(sorted(n for n in os.listdir(root) if n.startswith(DELETING)))
        finally:
            busy.on = False

sys.addaudithook(on_audit)
store = CheckpointStore(root, keep=1)

def save(step):
    store.save(step, tensors={"model": {"w": np.full(1000, step, dtype=np.float32)}})

save(1)
save(2)
if mode == "gate":
    seen = {
        "listed": [info.step for info in store.list()],
        "hidden": sorted(n for n in os.listdir(root) if n.startswith(DELETING)),
    }
    released.set()
    save(3)
    seen["at_third_start"] = found_at_start[-1]
    print(json.dumps(seen), flush=True)
elif mode == "kill":
    store.wait_removals()  # the kill comes first
else:
    save(3)
"""


def run_child(root: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return warmfork.run(
        [sys.executable, "-c", _CHILD, str(root), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )


def test_a_script_that_ends_right_after_its_last_save_leaves_no_hidden_folder(
    tmp_path: Path,
) -> None:
    done = run_child(tmp_path, "exit")
    assert done.returncode == 0, done.stderr
    assert step_folders(tmp_path) == [step_dirname(3)]
    assert hidden(tmp_path) == []


def test_the_next_save_begins_after_the_removal_it_follows(tmp_path: Path) -> None:
    done = run_child(tmp_path, "gate")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    # save() returned while the old checkpoint's files were still being removed, and no
    # reader saw it any more.
    assert seen["listed"] == [2]
    assert len(seen["hidden"]) == 1
    assert step_dirname(1) in seen["hidden"][0]
    # The third save started writing only once that removal was over.
    assert seen["at_third_start"] == []
    assert step_folders(tmp_path) == [step_dirname(3)]
    assert hidden(tmp_path) == []


def test_a_kill_during_a_background_removal_leaves_a_hidden_folder_the_next_writer_removes(
    tmp_path: Path,
) -> None:
    done = run_child(tmp_path, "kill")
    assert done.returncode == -signal.SIGKILL, done.stderr
    left = hidden(tmp_path)
    assert len(left) == 1
    assert left[0].startswith(DELETING_PREFIX + step_dirname(1))
    store = CheckpointStore(tmp_path, keep=2)
    assert [info.step for info in store.list()] == [2]
    assert store.verify().ok

    store.save(3, tensors=state(3))
    store.wait_removals()
    assert step_folders(tmp_path) == [step_dirname(2), step_dirname(3)]
    assert hidden(tmp_path) == []
