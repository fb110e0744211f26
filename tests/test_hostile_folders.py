"""Checkpoint folders made to hang, exhaust or mislead nbresume, and what it does with them.

Each folder holds an older checkpoint that is good and a newer one that is hostile. Every
reader a user runs on it (``nbresume verify``, ``restore()``, ``nbresume.hf.last_checkpoint``,
``nbresume.lightning.last_checkpoint``, ``nbresume pull``) runs in a child process whose
address space is limited and which is killed when it takes too long; it must finish with no
traceback, fail or pass over the hostile checkpoint naming the file and the reason, and
take the good one. What verify passes, a restore loads: the two agree on every folder.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.test_loadable import reseal

from nbresume.hf.folders import FILES_NAME, commit_folder, open_store

CHILD = Path(__file__).with_name("hostile_child.py")
#: The child's address space: torch and nbresume take about 0.7 GB of it; what a hostile
#: folder could make a reader allocate (gigabytes) does not fit.
LIMIT = 3 << 30
#: Seconds a child may take for all its readers (each takes well under one).
TIMEOUT = 60


def bounded(*ops: tuple[str, str | Path]) -> list[dict[str, Any]]:
    """Run ``ops`` (operation, argument) in a child of bounded memory and time; their reports."""
    argv = [str(part) for op in ops for part in op]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBRESUME_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(CHILD.parent.parent / "src"), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, str(CHILD), str(LIMIT), *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, output
    assert "Traceback" not in done.stdout + done.stderr, output
    reports: list[dict[str, Any]] = json.loads(done.stdout.splitlines()[-1])["reports"]
    return reports


def failed_lines(report: dict[str, Any]) -> list[str]:
    return [line for line in report["out"].splitlines() if line.startswith("FAIL")]


# -- a Trainer's output_dir ----------------------------------------------------------------------


def safetensors_bytes(data: bytes) -> bytes:
    """A safetensors file of one uint8 tensor (the format written by hand: no torch)."""
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}
    )
    raw = header.encode() + b" " * (-len(header) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def trainer_checkpoint(output_dir: Path, step: int) -> Path:
    """What the Trainer writes into ``checkpoint-<step>``, committed as the callback does."""
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(safetensors_bytes(bytes([step]) * 64))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "optimizer.pt").write_bytes(pickle.dumps({"state": {}, "param_groups": []}))
    commit_folder(open_store(output_dir), step).commit()
    return folder


def fifo(folder: Path) -> str:
    (folder / "optimizer.pt").unlink()
    os.mkfifo(folder / "optimizer.pt")
    return "optimizer.pt"


def dev_zero(folder: Path) -> str:
    (folder / "optimizer.pt").unlink()
    (folder / "optimizer.pt").symlink_to("/dev/zero")
    return "optimizer.pt"


def unlisted_scaler(folder: Path) -> str:
    # The Trainer loads scaler.pt when it is there; the save never recorded it.
    (folder / "scaler.pt").write_bytes(pickle.dumps({"scale": 1.0}))
    return "scaler.pt"


def unlisted_fifo(folder: Path) -> str:
    os.mkfifo(folder / "scheduler.pt")
    return "scheduler.pt"


def nul_in_a_listed_name(folder: Path) -> str:
    document = json.loads((folder / FILES_NAME).read_text())
    document["files"]["optimizer\x00.pt"] = document["files"]["optimizer.pt"]
    (folder / FILES_NAME).write_text(json.dumps(document))
    reseal(folder)  # the hashes match: only the name betrays it
    return FILES_NAME


TRAINER_DAMAGES: dict[str, Callable[[Path], str]] = {
    "a FIFO": fifo,
    "a link to /dev/zero": dev_zero,
    "an unlisted scaler.pt": unlisted_scaler,
    "an unlisted FIFO": unlisted_fifo,
    "a NUL byte in a listed name": nul_in_a_listed_name,
}


@pytest.mark.parametrize("damage", list(TRAINER_DAMAGES))
def test_a_hostile_trainer_checkpoint_is_failed_and_passed_over_in_bounded_time(
    tmp_path: Path, damage: str
) -> None:
    out = tmp_path / "out"
    trainer_checkpoint(out, 2)
    victim = TRAINER_DAMAGES[damage](trainer_checkpoint(out, 4))
    verify, found = bounded(("verify", out), ("hf", out))
    assert verify["result"] == 1, verify["out"]
    lines = failed_lines(verify)
    assert len(lines) == 1, verify["out"]
    assert "checkpoint-4" in lines[0], verify["out"]
    assert victim.split(".")[0] in lines[0], verify["out"]
    assert "OK    checkpoint-2" in verify["out"]
    assert found["result"] == str(out / "checkpoint-2")
    assert any("checkpoint-4" in w and victim.split(".")[0] in w for w in found["warnings"])
