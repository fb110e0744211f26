"""The Trainer on a simulated Colab: "saved" means Google Drive itself has the checkpoint.

Google's side (the Drive API server on loopback over a cloud folder) lives in the test process;
the VM is ``hf_train.py --drive`` with the stand-in ``google.colab``, whose mount uploads with
a lag and loses what it has not uploaded when the VM is killed. What the cloud holds is read
straight from the cloud, never through nbresume.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

pytest.importorskip("transformers")
pytest.importorskip("googleapiclient", reason="needs google-api-python-client (test extra)")
pytest.importorskip("colab_standin", reason="needs the google.colab stand-in (scripts/setup)")

from colab_standin.cloud import Cloud
from colab_standin.server import DriveServer

from testkit import warmfork

SCRIPT = Path(__file__).with_name("hf_train.py")
RUN = "hf-run"
pytestmark = pytest.mark.slow


def vm(
    vm_env: Callable[..., dict[str, str]], tmp: Path, name: str, lag: float, *args: str
) -> warmfork.WarmProcess:
    """A fresh VM (a new process with a new, empty mount over the same cloud) training."""
    env = vm_env(
        lag,
        tmp / name / "drive",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp / "hf-home"),
    )
    (tmp / name).mkdir()
    return warmfork.popen(
        [sys.executable, str(SCRIPT), RUN, "--drive", "--events", str(tmp / f"{name}.jsonl"),
         *args],
        env=env, cwd=tmp / name, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by the kill
    return out


def landed(cloud: Cloud) -> dict[int, bool]:
    """{step: whether the cloud holds all of checkpoint-<step>}: the manifest, every file it
    names with its size, and every Trainer file the files list names, byte for byte."""
    out: dict[int, bool] = {}
    for run in cloud.find(RUN):
        for folder in cloud.children(run.id, trashed=False):
            if folder.is_folder and folder.name.startswith("checkpoint-"):
                step = int(folder.name.split("-")[1])
                out[step] = out.get(step, False) or complete(cloud, folder.id)
    return out


def complete(cloud: Cloud, folder_id: str) -> bool:
    files = {i.name: i for i in cloud.children(folder_id, trashed=False) if not i.is_folder}
    try:
        manifest = json.loads(cloud.read(files["manifest.json"]))
        framework = json.loads(cloud.read(files["nbresume_framework_files.json"]))["files"]
    except (KeyError, ValueError):
        return False
    for name, entry in manifest["files"].items():
        if name not in files or files[name].size != entry["size"]:
            return False
    for name, entry in framework.items():
        if name not in files or not same_bytes(entry, cloud.read(files[name])):
            return False
    return True


def same_bytes(entry: dict[str, Any], data: bytes) -> bool:
    """Whether ``data`` has the hash a files list entry records (SHA-256 in earlier versions,
    the checkpoint's own hash, XXH3-128 by default, now)."""
    if "sha256" in entry:
        return hashlib.sha256(data).hexdigest() == entry["sha256"]
    return bool(xxhash.xxh3_128(data).hexdigest() == entry.get("xxh3-128"))


def test_a_trainer_checkpoint_is_saved_only_once_drive_has_it_and_keep_1_never_leaves_none(
    cloud: tuple[Cloud, DriveServer], vm_env: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    god = cloud[0]
    reference = warmfork.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "reference")],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")},
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    final = reference.stdout.split("final ")[1].split()[0]

    # VM 1 saves every 4 steps with save_total_limit=1; uploads lag 1.5 s behind. It is killed
    # once a checkpoint verified locally while an older one is confirmed on Drive.
    first = vm(vm_env, tmp_path, "vm1", 1.5, "--keep", "1")
    log = tmp_path / "vm1.jsonl"

    def lost_one_pending() -> bool:
        seen = events(log)
        durable = [e["step"] for e in seen if e["kind"] == "durable"]
        verified = [e for e in seen if e["kind"] == "verified"]
        return (
            bool(durable)
            and verified[-1]["step"] > max(durable)
            and (time.time() - verified[-1]["t"] < 0.5)
        )

    deadline = time.monotonic() + 300
    while not lost_one_pending() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.poll() is None, first.communicate()[1][-3000:]
    os.kill(first.pid, signal.SIGKILL)
    first.communicate()

    seen = events(log)
    present = landed(god)
    on_cloud = {step for step, whole in present.items() if whole}
    verified = {e["step"] for e in seen if e["kind"] == "verified"}
    durable = {e["step"] for e in seen if e["kind"] == "durable"}
    lost = {step for step in verified if step > max(on_cloud, default=0)}
    assert lost, "the scenario needs a checkpoint that verified locally but never uploaded"
    # Nothing was reported saved that Drive does not hold (or that retention deleted after a
    # newer one was confirmed), and what never uploaded was never reported saved.
    assert not durable & lost
    assert durable
    assert all(present.get(step, True) for step in durable)  # whole, or deleted by retention
    assert on_cloud, "save_total_limit=1 left no complete checkpoint on Drive"
    # Retention deleted through Drive's API: nothing in the trash using the quota.
    assert god.usage()[1] == 0

    # A fresh VM (new process, new empty mount, same Drive) resumes from what really landed
    # and ends with the weights of a run that was never interrupted.
    second = vm(vm_env, tmp_path, "vm2", 0.2, "--keep", "1")
    out, err = second.communicate(timeout=600)
    assert second.returncode == 0, err[-3000:]
    assert f"/checkpoint-{max(on_cloud)}\n" in out, out
    assert f"final {final}" in out


def test_a_step_saved_again_over_the_scratch_folder_a_killed_vm_left_on_drive(
    cloud: tuple[Cloud, DriveServer], vm_env: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    # A VM killed in the middle of a save leaves checkpoint-4 on Drive without its content
    # (Drive shows a new file at once, empty until uploaded) and with the folder where the
    # Trainer's other files waited during the commit: Drive shows a new folder at once and
    # syncs its removal only later.
    god = cloud[0]
    run = god.create(god.root_id, RUN, folder=True)
    folder = god.create(run, "checkpoint-4", folder=True)
    for name in ("manifest.json", "optimizer.pt"):
        god.create(folder, name, folder=False)
    aside = god.create(folder, ".framework", folder=True)
    god.create(aside, "rng_state.pth", folder=False)

    fresh = vm(vm_env, tmp_path, "vm", 0.2, "--steps", "8")
    out, err = fresh.communicate(timeout=600)
    assert fresh.returncode == 0, err[-3000:]
    assert "resume None" in out  # the damaged checkpoint-4 is passed over
    assert "final " in out
    # Step 4 was saved again and verified; what was reported on Drive is there in full, and
    # the scratch folder went with the old copy (deleted through Drive's API).
    seen = events(tmp_path / "vm.jsonl")
    assert {e["step"] for e in seen if e["kind"] == "verified"} == {4, 8}
    present = landed(god)
    assert all(present[e["step"]] for e in seen if e["kind"] == "durable")
    assert not [path for path, _ in god.walk() if ".framework" in path]
