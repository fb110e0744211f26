"""A Colab VM whose ``ModelCheckpoint(save_top_k=1)`` replaces a checkpoint on Google Drive.

    python lightning_drive_removal.py kill|finish|leftover

Saves ``epoch=0.ckpt`` and waits until Drive has it; from then on the mount uploads nothing
on its own (the upload lags), as on a slow Drive. Saves ``epoch=1.ckpt`` and removes
``epoch=0.ckpt``, the plugin's calls in ModelCheckpoint's order. ``kill``: the VM dies at once
(SIGKILL). ``finish``: uploads resume and the end of training's wait for the removals runs.
``leftover``: as ``finish``, with what a save killed mid-write leaves in ``epoch=0.ckpt`` (a
temporary step folder, uploaded) before the replacement.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import nbresume.lightning
from nbresume import CheckpointStore, knobs
from nbresume.checkpoint.format import TEMP_PREFIX
from nbresume.checkpoint.loop import confirm
from nbresume.platforms.drive import mount_drive


def checkpoint(step: int) -> dict[str, object]:
    return {"global_step": step, "state_dict": {"w": torch.full((1000,), float(step))}}


def main(mode: str) -> None:
    from colab_standin import MOUNTS

    ckpts = mount_drive(str(knobs.drive_mount())) / "lightning-run" / "ckpts"
    io = nbresume.lightning.CheckpointIO()
    io.save_checkpoint(checkpoint(4), ckpts / "epoch=0.ckpt")
    confirm(CheckpointStore(ckpts / "epoch=0.ckpt"), timeout=60)
    if mode == "leftover":
        killed = ckpts / "epoch=0.ckpt" / (TEMP_PREFIX + "000000000005-killed")
        killed.mkdir()
        (killed / "model.tensors").write_bytes(b"\x01" * 20_000)
        for mount in MOUNTS.values():
            mount.flush(30)  # Drive has the half-written save's files too
    for mount in MOUNTS.values():
        mount.lag = 3600.0
    io.save_checkpoint(checkpoint(8), ckpts / "epoch=1.ckpt")
    io.remove_checkpoint(ckpts / "epoch=0.ckpt")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    for mount in MOUNTS.values():
        mount.lag = 0.1
    kept = io.finish_removals(timeout=60)
    print("kept", kept, "local", sorted(p.name for p in ckpts.iterdir()), flush=True)
    for mount in MOUNTS.values():
        mount.flush(30)  # the removal's own changes reach the cloud before the VM goes


if __name__ == "__main__":
    main(sys.argv[1])
