"""A Lightning run on a simulated Colab: its ``.ckpt`` folders on Google Drive itself.

Google's side (the Drive API server on loopback over a cloud folder) lives in the test process;
the VM is ``lightning_train.py --drive`` with the stand-in ``google.colab``, whose mount uploads
with a lag and loses what it has not uploaded when the VM is killed. What the cloud holds is
read straight from the cloud, never through nbresume's mount.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("googleapiclient", reason="needs google-api-python-client (test extra)")
pytest.importorskip("colab_standin", reason="needs the google.colab stand-in (scripts/setup)")

import torch
from colab_standin.cloud import Cloud, copy_tree_out
from colab_standin.server import DriveServer
from safetensors.torch import load_file
from tests.colab.godview import landed

import nbresume
from testkit import warmfork

SCRIPT = Path(__file__).with_name("lightning_train.py")
pytestmark = pytest.mark.slow


def vm(
    vm_env: Callable[..., dict[str, str]], tmp: Path, name: str, lag: float, kill: str = ""
) -> int:
    """A fresh VM (a new process with a new, empty mount over the same cloud) training to
    the end, or until ``kill``; its exit status."""
    # One mount point, as /content/drive on every Colab VM (ModelCheckpoint keeps its state
    # only when its folder is the same); a new VM starts with it empty.
    env = vm_env(lag, tmp / "drive", NBRESUME_TEST_KILL=kill)
    (tmp / name).mkdir()
    shutil.rmtree(tmp / "drive", ignore_errors=True)
    done = warmfork.run(
        [sys.executable, str(SCRIPT), str(tmp / "local"), "--epoch-end", "--drive"],
        env=env, cwd=tmp / name, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode in (0, -9), done.stderr[-3000:]
    return done.returncode


def test_on_drive_every_ckpt_lands_whole_and_a_new_vm_resumes_exactly(
    cloud: tuple[Cloud, DriveServer], vm_env: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    god = cloud[0]
    reference = tmp_path / "reference"
    done = warmfork.run(
        [sys.executable, str(SCRIPT), str(reference), "--epoch-end"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    # VM 1 is killed in the middle of epoch 3, its uploads lagging behind; VM 2, a new
    # machine with an empty mount, resumes from what Drive holds and trains to the end.
    assert vm(vm_env, tmp_path, "vm1", 0.5, kill="step:40:0") == -9
    assert vm(vm_env, tmp_path, "vm2", 0.1) == 0
    starts = [x for x in (tmp_path / "local" / "events.log").read_text().splitlines()
              if x.startswith("start ")]  # fmt: skip
    print(starts)
    assert starts[0] == "start None"
    assert starts[1] != "start None"  # resumed from what had reached Drive

    final, expected = (
        load_file(tmp_path / "local" / "final.safetensors"),
        load_file(reference / "final.safetensors"),
    )
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    out = tmp_path / "from-the-cloud"
    copy_tree_out(god, out)
    ckpts = out / "lightning-run" / "ckpts"
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == sorted(p.name for p in (reference / "ckpts").iterdir())  # nothing hidden
    for name in names:
        assert nbresume.verify(ckpts / name).ok, name
    # Removals went through Drive's API: nothing in the trash using the quota.
    assert god.usage()[1] == 0


REMOVAL = Path(__file__).with_name("lightning_drive_removal.py")


def replace_on_drive(
    vm_env: Callable[..., dict[str, str]], tmp: Path, mode: str
) -> subprocess.CompletedProcess[str]:
    """A VM that saves epoch=1.ckpt and removes epoch=0.ckpt (save_top_k=1) while Drive has
    only epoch=0.ckpt; ``kill``: it dies right after."""
    env = vm_env(0.1, tmp / "drive")
    return warmfork.run(
        [sys.executable, str(REMOVAL), mode],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def on_cloud(god: Cloud) -> dict[str, dict[int, bool]]:
    """{.ckpt: {step: landed whole}} as Drive itself holds them."""
    found = god.find("lightning-run/ckpts")
    names = {i.name for f in found for i in god.children(f.id, trashed=False)}
    return {n: landed(god, ["lightning-run", "ckpts", n]) for n in sorted(names)}


def test_save_top_k_never_removes_the_only_checkpoint_drive_has(
    cloud: tuple[Cloud, DriveServer], vm_env: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    god = cloud[0]
    done = replace_on_drive(vm_env, tmp_path, "kill")
    assert done.returncode == -9, done.stderr[-3000:]
    # The VM died before Drive had epoch=1.ckpt: Drive still holds epoch=0.ckpt, whole.
    held = on_cloud(god)
    assert held.get("epoch=0.ckpt") == {4: True}, held
    assert not any(held.get("epoch=1.ckpt", {}).values())


def test_the_removal_happens_once_drive_confirmed_the_replacement(
    cloud: tuple[Cloud, DriveServer], vm_env: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    god = cloud[0]
    done = replace_on_drive(vm_env, tmp_path, "finish")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kept [] local ['epoch=1.ckpt']" in done.stdout
    held = on_cloud(god)
    assert held == {"epoch=1.ckpt": {8: True}}, held
    assert god.usage()[1] == 0  # removed through Drive's API: nothing in the trash


def test_what_a_killed_save_left_is_removed_through_drives_api_too(
    cloud: tuple[Cloud, DriveServer], vm_env: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    """A .ckpt that save_top_k removes may hold a temporary folder of a save killed
    mid-write (a VM that died): it goes with the checkpoint, past the trash."""
    god = cloud[0]
    done = replace_on_drive(vm_env, tmp_path, "leftover")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kept [] local ['epoch=1.ckpt']" in done.stdout
    assert on_cloud(god) == {"epoch=1.ckpt": {8: True}}
    assert god.usage()[1] == 0  # nothing in Drive's trash
