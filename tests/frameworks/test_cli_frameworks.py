"""``nbresume ls`` / ``verify`` / ``pull`` / ``status`` / ``run`` pointed at a framework's
folder: a Trainer's ``output_dir`` (``checkpoint-N``) or a Lightning ``ModelCheckpoint`` folder
(``.ckpt``)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nbresume.checkpoint.store import CheckpointStore
from nbresume.cli import main
from nbresume.hf.folders import FILES_NAME, commit_folder, open_store
from testkit.cli import run_command


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def safetensors_bytes(data: bytes) -> bytes:
    """A safetensors file of one uint8 tensor (the format written by hand: no torch)."""
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}
    )
    raw = header.encode() + b" " * (-len(header) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def trainer_checkpoint(output_dir: Path, step: int, *, commit: bool = True) -> Path:
    """What the Trainer writes into ``checkpoint-<step>`` (weights, its state, a pickled
    optimizer), committed as ``nbresume.hf.Callback`` does at ``on_save``."""
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(safetensors_bytes(bytes([step]) * 64))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    torch.save(tiny_optimizer_state(step), folder / "optimizer.pt")
    if commit:
        commit_folder(open_store(output_dir), step).commit()
    return folder


def tiny_optimizer_state(step: int) -> dict[str, Any]:
    """A real optimizer's state (a tiny model's), as the Trainer saves it."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=step / 1000, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return optimizer.state_dict()


def flip_a_bit(path: Path) -> None:
    """Damage ``path`` by one bit near its end, its size unchanged."""
    damaged = bytearray(path.read_bytes())
    damaged[-2] ^= 0x01
    path.write_bytes(bytes(damaged))


def test_verify_and_ls_read_a_trainer_output_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    trainer_checkpoint(out, 2)
    trainer_checkpoint(out, 4)
    code, text, _ = run(["verify", str(out)], capsys)
    assert code == 0, text
    assert "Hugging Face Trainer checkpoints" in text
    assert "OK    checkpoint-2  step 2" in text
    assert "OK    checkpoint-4  step 4" in text
    assert "OK 2/2, errors 0" in text

    code, text, _ = run(["ls", str(out)], capsys)
    assert code == 0
    assert "checkpoint-4" in text
    assert "2 checkpoint(s)" in text

    # A checkpoint written without the callback cannot be verified: said so, and it fails.
    trainer_checkpoint(out, 6, commit=False)
    code, text, _ = run(["ls", str(out)], capsys)
    assert "NOT COMMITTED checkpoint-6 (step 6): incomplete: it has no manifest.json" in text
    code, text, _ = run(["verify", str(out)], capsys)
    assert code == 1
    assert "FAIL  checkpoint-6  incomplete: it has no manifest.json" in text


def test_a_temporary_file_a_killed_save_left_is_no_part_of_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # safetensors writes through a hidden temporary file: a kill in the middle of the Trainer's
    # save leaves an empty .tmpXXXXXX in checkpoint-N, which the rerun saves into again.
    out = tmp_path / "out"
    folder = trainer_checkpoint(out, 8, commit=False)
    (folder / ".tmpy8qbCO").write_bytes(b"")
    commit_folder(open_store(out), 8).commit()
    assert not (folder / ".tmpy8qbCO").exists()
    assert (
        "optimizer.pt"
        in json.loads((folder / "nbresume_framework_files.json").read_text())["files"]
    )
    code, text, _ = run(["verify", str(out)], capsys)
    assert code == 0, text
    assert "OK    checkpoint-8  step 8" in text


def test_verify_names_a_damaged_framework_file_of_a_trainer_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    trainer_checkpoint(out, 2)
    folder = trainer_checkpoint(out, 4)
    flip_a_bit(folder / "optimizer.pt")
    code, text, _ = run(["verify", str(out)], capsys)
    assert code == 1
    assert "OK    checkpoint-2" in text
    assert "FAIL  checkpoint-4  optimizer.pt" in text


def verifies_until_a_bit_flips(
    out: Path, step: int, algorithm: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``nbresume verify`` passes on ``checkpoint-<step>`` of ``out``; once one bit of its
    ``optimizer.pt`` is flipped it fails, naming the file and the hash that caught it."""
    code, text, _ = run(["verify", str(out)], capsys)
    assert code == 0, text
    assert f"OK    checkpoint-{step}  step {step}" in text

    flip_a_bit(out / f"checkpoint-{step}" / "optimizer.pt")
    code, text, _ = run(["verify", str(out)], capsys)
    assert code == 1
    assert (
        f"FAIL  checkpoint-{step}  optimizer.pt: "
        f"its bytes differ from the ones recorded at the save ({algorithm})" in text
    )


@pytest.mark.parametrize("algorithm", ["xxh3-128", "sha256"])
def test_framework_files_are_listed_with_the_checkpoints_own_hash(
    algorithm: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import xxhash

    monkeypatch.setenv("NBRESUME_HASH", algorithm)
    out = tmp_path / "out"
    folder = trainer_checkpoint(out, 2)
    data = (folder / "optimizer.pt").read_bytes()
    hasher = xxhash.xxh3_128 if algorithm == "xxh3-128" else hashlib.sha256
    listed = json.loads((folder / FILES_NAME).read_text())["files"]
    assert listed == {"optimizer.pt": {"size": len(data), algorithm: hasher(data).hexdigest()}}
    manifest = json.loads((folder / "manifest.json").read_text())
    assert all(algorithm in entry for entry in manifest["files"].values())
    verifies_until_a_bit_flips(out, 2, algorithm, capsys)


def test_framework_files_listed_with_sha256_by_earlier_versions_still_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], forge_manifest: Callable[..., Path]
) -> None:
    # Earlier versions listed the framework's files with their SHA-256 under "sha256",
    # whatever hash the manifest used: such a folder, written by hand.
    out = tmp_path / "out"
    folder = trainer_checkpoint(out, 4, commit=False)
    data = (folder / "optimizer.pt").read_bytes()
    entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / FILES_NAME).write_text(json.dumps({"files": {"optimizer.pt": entry}}))
    forge_manifest(folder, step=4, files=["model.safetensors", "trainer_state.json", FILES_NAME])
    verifies_until_a_bit_flips(out, 4, "sha256", capsys)


def test_pull_of_a_trainer_output_dir_says_what_it_sees_and_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    trainer_checkpoint(out, 2)
    code, _, err = run(["pull", str(out), str(tmp_path / "copy")], capsys)
    assert code == 2
    assert "Hugging Face Trainer checkpoints" in err
    assert "nbresume verify" in err
    assert not (tmp_path / "copy").exists()  # nothing half-copied


def test_push_of_a_trainer_or_lightning_folder_says_what_it_sees_and_how_it_travels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbresume.lightning

    # Refused before any credential is read or any byte staged: no Kaggle account here.
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(tmp_path / "no-kaggle"))
    out = tmp_path / "out"
    trainer_checkpoint(out, 2)
    ckpts = tmp_path / "ckpts"
    nbresume.lightning.CheckpointIO().save_checkpoint({"global_step": 4}, ckpts / "last.ckpt")
    for folder, kind in ((out, "Hugging Face Trainer"), (ckpts, "Lightning")):
        code, text, err = run(["push", str(folder), "--kaggle-dataset", "you/run1"], capsys)
        assert code == 1, text + err  # as push's other refusals
        assert f"the source holds {kind} checkpoints" in err
        assert "nbresume push uploads nbresume checkpoint folders only" in err
        assert "kaggle datasets version -p DIR" in err
        assert "bucket" in err
        assert "uploaded" not in text


def test_verify_and_ls_read_a_lightning_checkpoint_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("lightning")
    import torch

    import nbresume.lightning

    ckpts = tmp_path / "ckpts"
    io = nbresume.lightning.CheckpointIO()
    for name, step in (("epoch=0-step=4.ckpt", 4), ("last.ckpt", 4), ("last.ckpt", 8)):
        io.save_checkpoint({"global_step": step, "w": torch.full((8,), float(step))}, ckpts / name)
    code, text, _ = run(["verify", str(ckpts)], capsys)
    assert code == 0, text
    assert "Lightning checkpoints" in text
    assert "OK    epoch=0-step=4.ckpt  step 4" in text
    assert "OK    last.ckpt  step 8" in text
    code, text, _ = run(["ls", str(ckpts)], capsys)
    assert "last.ckpt" in text
    assert "2 checkpoint(s)" in text

    # A pickled .ckpt (Lightning without the plugin): never opened, and the way over named.
    torch.save({"global_step": 1}, ckpts / "old.ckpt")
    # The step-8 folder by name: the step-4 one may still be there, hidden, being deleted.
    tensors = ckpts / "last.ckpt" / "000000000008" / "tensors.safetensors"
    damaged = bytearray(tensors.read_bytes())
    damaged[-1] ^= 0x01
    tensors.write_bytes(bytes(damaged))
    code, text, _ = run(["verify", str(ckpts)], capsys)
    assert code == 1
    assert "FAIL  last.ckpt" in text
    assert "FAIL  old.ckpt" in text
    assert "convert-lightning" in text


def test_reading_a_framework_folder_imports_neither_framework(tmp_path: Path) -> None:
    out = tmp_path / "out"
    trainer_checkpoint(out, 2)
    (tmp_path / "ckpts" / "last.ckpt").mkdir(parents=True)
    code = (
        "import sys\n"
        "from nbresume.cli import main\n"
        f"main(['ls', {str(out)!r}]); main(['ls', {str(tmp_path / 'ckpts')!r}])\n"
        f"main(['status', {str(tmp_path / 'ckpts')!r}])\n"
        "assert not {'lightning', 'transformers', 'torch'} & set(sys.modules), 'imported'\n"
        # Verifying loads the Trainer's optimizer.pt as its resume would: with torch.
        f"main(['verify', {str(out)!r}]); main(['status', {str(out)!r}])\n"
        "assert not {'lightning', 'transformers'} & set(sys.modules), 'imported'\n"
    )
    # A fresh interpreter: a fork of the warm server has torch imported already.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "OK    checkpoint-2" in done.stdout


def test_an_nbresume_folder_is_read_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = CheckpointStore(tmp_path / "run", keep=None)
    store.save(3, data={"x": 1})
    code, text, _ = run(["verify", str(tmp_path / "run")], capsys)
    assert code == 0
    assert "Trainer" not in text
    assert "Lightning" not in text


# -- status and run: the checkpoint the framework's own resume takes ----------------------------


def restart_line(ckpt_dir: Path, log: Path) -> str:
    """The line ``nbresume run --dir CKPT_DIR`` writes as an attempt starts (here of a job that
    does nothing), which names the checkpoint the job resumes from."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBRESUME_")}
    done = run_command(
        "run", "--retries", "0", "--dir", str(ckpt_dir), "--log", str(log), "--",
        sys.executable, "-c", "pass", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return next(line for line in log.read_text().splitlines() if "attempt 1 of 1:" in line)


def test_status_and_run_name_the_checkpoint_a_trainer_resumes_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    from tests.frameworks.test_hf import train

    import nbresume.hf

    out = tmp_path / "out"
    trained = train(out, "--steps", "8", "--save-steps", "4")  # a real Trainer run, 8 steps
    assert trained.returncode == 0, trained.describe()
    assert nbresume.hf.last_checkpoint(out) == str(out / "checkpoint-8")

    code, text, _ = run(["status", str(out)], capsys)
    assert code == 0, text
    assert "checkpoint: step 8 verified, " in text
    assert f"({out / 'checkpoint-8'})" in text
    assert (
        "Hugging Face Trainer checkpoints (checkpoint-N folders): nbresume.hf.last_checkpoint "
        "resumes from checkpoint-8"
    ) in text
    assert "last verified checkpoint: step 8, " in text
    assert "none yet" not in text
    assert (
        "newest verified checkpoint: checkpoint-8, step 8 (Hugging Face Trainer: "
        "nbresume.hf.last_checkpoint resumes from it)"
    ) in restart_line(out, tmp_path / "a.log")

    # The newest one damaged: status and run name the one the resume falls back to, as it does.
    flip_a_bit(out / "checkpoint-8" / "optimizer.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert nbresume.hf.last_checkpoint(out) == str(out / "checkpoint-4")
    code, text, _ = run(["status", str(out)], capsys)
    assert code == 1, text
    assert "checkpoint: step 4 verified, " in text
    assert "nbresume.hf.last_checkpoint resumes from checkpoint-4" in text
    assert "passed over: checkpoint-8 (step 8) does NOT verify: optimizer.pt: " in text
    assert "last verified checkpoint: step 4, " in text
    line = restart_line(out, tmp_path / "b.log")
    assert "newest verified checkpoint: checkpoint-4, step 4" in line
    assert "1 newer one(s) do NOT verify" in line


def test_status_and_run_name_the_checkpoint_a_lightning_run_resumes_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("lightning")
    from tests.frameworks.test_lightning import fit

    import nbresume.lightning

    trainer = fit(tmp_path, epochs=2)  # a real fit: last.ckpt and the 2 best .ckpt folders
    ckpts = tmp_path / "ckpts"
    step = trainer.global_step
    assert nbresume.lightning.last_checkpoint(ckpts) == str(ckpts / "last.ckpt")

    code, text, _ = run(["status", str(ckpts)], capsys)
    assert code == 0, text
    assert f"checkpoint: step {step} verified, " in text
    assert f"({ckpts / 'last.ckpt'})" in text
    assert (
        "Lightning checkpoints (.ckpt folders of nbresume.lightning.CheckpointIO): "
        "nbresume.lightning.last_checkpoint resumes from last.ckpt"
    ) in text
    assert f"last verified checkpoint: step {step}, " in text
    assert "none yet" not in text
    assert (
        f"newest verified checkpoint: last.ckpt, step {step} (Lightning: "
        "nbresume.lightning.last_checkpoint resumes from it)"
    ) in restart_line(ckpts, tmp_path / "a.log")

    # last.ckpt damaged: the resume takes the newest other .ckpt, and so do status and run.
    # The newest folder by name: an older one may still be there, hidden, being deleted.
    tensors = ckpts / "last.ckpt" / f"{step:012d}" / "tensors.safetensors"
    flip_a_bit(tensors)
    chosen = nbresume.lightning.last_checkpoint(ckpts)
    assert chosen is not None
    assert Path(chosen).name != "last.ckpt"
    code, text, _ = run(["status", str(ckpts)], capsys)
    assert code == 1, text
    assert f"({chosen})" in text
    assert f"nbresume.lightning.last_checkpoint resumes from {Path(chosen).name}" in text
    assert f"passed over: last.ckpt (step {step}) does NOT verify: " in text
    line = restart_line(ckpts, tmp_path / "b.log")
    assert f"newest verified checkpoint: {Path(chosen).name}, " in line
    assert "1 newer one(s) do NOT verify" in line
