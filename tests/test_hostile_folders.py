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
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from tests.test_loadable import reseal

from nbresume.hf.folders import FILES_NAME, commit_folder, hash_file, open_store
from nbresume.pull import SAFE_LINE
from testkit import warmfork

CHILD = Path(__file__).with_name("hostile_child.py")
#: The child's address space beyond what torch and nbresume take once imported (0.6 GB with
#: a CPU build of torch, 3.2 GB with a CUDA one): what a hostile folder could make a reader
#: allocate (gigabytes) does not fit.
BUDGET = 2400 << 20
#: Seconds a child may take for each of its readers (each takes a few; hashing a sparse file of
#: 3 GiB takes the most): only a child that hangs is stopped by it.
TIMEOUT = 60


def run_child(*ops: tuple[str, str | Path]) -> dict[str, Any]:
    """Run ``ops`` (operation, argument) in a child of bounded memory and time; its report:
    ``reports`` (one per operation), ``peak`` (the most resident memory it used) and
    ``imports`` (what it used once torch and nbresume were imported). The child is forked
    from the warm server: its address space is bounded from what it has at its start, and its
    peak (``VmHWM``, its own after a fork) is its own resident memory, as in a new process
    (growth measured both ways: within 1-76 MB, fork or not)."""
    argv = [str(part) for op in ops for part in op]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBRESUME_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(CHILD.parent.parent / "src"), env.get("PYTHONPATH", "")]
    )
    done = warmfork.run(
        [sys.executable, str(CHILD), str(BUDGET), *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT * len(ops),
        env=env,
    )
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, output
    assert "Traceback" not in done.stdout + done.stderr, output
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return report


def bounded(*ops: tuple[str, str | Path], peak_below: int | None = None) -> list[dict[str, Any]]:
    """The reports of ``ops`` run in a bounded child (:func:`run_child`); ``peak_below``: the
    most resident memory the child may have used at its peak beyond what its imports took
    (about 0.2 GB with a CPU build of torch, 0.6 GB with a CUDA one)."""
    report = run_child(*ops)
    if peak_below is not None:
        assert report["peak"] - report["imports"] < peak_below, report
    reports: list[dict[str, Any]] = report["reports"]
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


def trainer_pickles(folder: Path, step: int) -> None:
    """The files the Trainer writes with ``torch.save``, as it writes them: a real optimizer's
    and scheduler's state (a tiny model's), its RNG states, and its arguments (a full pickle
    that its resume never loads)."""
    import argparse
    import random

    import torch

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=step / 1000)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    scheduler.step()
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    torch.save(scheduler.state_dict(), folder / "scheduler.pt")
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
    }
    torch.save(rng, folder / "rng_state.pth")
    torch.save(argparse.Namespace(step=step), folder / "training_args.bin")


def trainer_checkpoint(output_dir: Path, step: int) -> Path:
    """What the Trainer writes into ``checkpoint-<step>``, committed as the callback does."""
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(safetensors_bytes(bytes([step]) * 64))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    trainer_pickles(folder, step)
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
    os.mkfifo(folder / "scaler.pt")
    return "scaler.pt"


def nul_in_a_listed_name(folder: Path) -> str:
    document = json.loads((folder / FILES_NAME).read_text())
    document["files"]["optimizer\x00.pt"] = document["files"]["optimizer.pt"]
    (folder / FILES_NAME).write_text(json.dumps(document))
    reseal(folder)  # the hashes match: only the name betrays it
    return FILES_NAME


def swap(folder: Path, name: str, value: Any, *, plain: bool = False) -> str:
    """Replace the Trainer's file ``name`` with ``value`` saved by ``torch.save`` (``plain``:
    by ``pickle``) and record its hash anew: only what the file holds betrays it."""
    import torch

    if plain:
        (folder / name).write_bytes(pickle.dumps(value))
    else:
        torch.save(value, folder / name)
    document = json.loads((folder / FILES_NAME).read_text())
    document["files"][name] = hash_file(folder / name, "xxh3-128", md5=False).to_json()
    (folder / FILES_NAME).write_text(json.dumps(document))
    reseal(folder)
    return name


class Runs:
    """An object whose unpickling runs code: it makes the folder its ``marker`` names."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def optimizer_that_runs_code(folder: Path) -> str:
    state = {"state": {}, "param_groups": [], "x": Runs(folder.parent / "ran")}
    return swap(folder, "optimizer.pt", state)


def optimizer_of_another_shape(folder: Path) -> str:
    return swap(folder, "optimizer.pt", {"step": 4})


def scheduler_as_a_plain_pickle(folder: Path) -> str:
    return swap(folder, "scheduler.pt", {"last_epoch": 4}, plain=True)


def rng(folder: Path, change: Callable[[dict[str, Any]], None]) -> str:
    import torch

    with torch.serialization.safe_globals(
        [np.core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    ):
        states = torch.load(folder / "rng_state.pth", weights_only=True)
    change(states)
    return swap(folder, "rng_state.pth", states)


def numpy_position(states: dict[str, Any]) -> None:
    states["numpy"] = (*states["numpy"][:2], 700, *states["numpy"][3:])


def cpu_state_size(states: dict[str, Any]) -> None:
    states["cpu"] = states["cpu"][:-8].clone()


def python_missing(states: dict[str, Any]) -> None:
    del states["python"]


TRAINER_DAMAGES: dict[str, Callable[[Path], str]] = {
    "a FIFO": fifo,
    "a link to /dev/zero": dev_zero,
    "an unlisted scaler.pt": unlisted_scaler,
    "an unlisted FIFO": unlisted_fifo,
    "a NUL byte in a listed name": nul_in_a_listed_name,
    "an optimizer.pt whose unpickling runs code": optimizer_that_runs_code,
    "an optimizer.pt of another shape": optimizer_of_another_shape,
    "a scheduler.pt pickled without torch": scheduler_as_a_plain_pickle,
    "an rng_state.pth whose NumPy position is out of range": lambda f: rng(f, numpy_position),
    "an rng_state.pth whose torch CPU state is cut": lambda f: rng(f, cpu_state_size),
    "an rng_state.pth without Python's state": lambda f: rng(f, python_missing),
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
    assert not (out / "ran").exists()  # nothing in a pickle ran


# -- a Checkpointer's run -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run saved at steps 10 and 20 from the model :func:`hostile_child.build` makes."""
    from tests.hostile_child import build

    from nbresume import Checkpointer

    folder = tmp_path_factory.mktemp("template") / "run"
    model, optimizer = build()
    ckpt = Checkpointer(
        folder, model=model, optimizer=optimizer, every=None, deadline=None,
        async_save=False, keep=None, quiet=True,
    )  # fmt: skip
    ckpt.save(10)
    ckpt.save(20)
    ckpt.close()
    return folder


@pytest.fixture
def run(tmp_path: Path, run_template: Path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(run_template, folder)
    return folder


def edit_rng(folder: Path, change: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Change the generator states (``state.json``'s tree, ``rng.safetensors``' arrays) of the
    checkpoint ``folder`` and reseal its manifest: only the states' values betray it."""
    state = json.loads((folder / "state.json").read_text())
    arrays = safetensors.numpy.load_file(folder / "rng.safetensors")
    change(state["rng"], arrays)
    (folder / "state.json").write_text(json.dumps(state))
    safetensors.numpy.save_file(arrays, folder / "rng.safetensors")
    reseal(folder)


def torch_state_key(tree: dict[str, Any]) -> str:
    key: str = tree["torch"]["key"]
    return key


def torch_position(tree: dict[str, Any], arrays: dict[str, Any]) -> None:
    # `left`, the Mersenne Twister's position, out of its range 1..624: torch refuses the state.
    raw = bytearray(arrays[torch_state_key(tree)].tobytes())
    raw[8:12] = (0).to_bytes(4, "little")
    arrays[torch_state_key(tree)] = np.frombuffer(bytes(raw), dtype=np.uint8).copy()


def torch_size(tree: dict[str, Any], arrays: dict[str, Any]) -> None:
    key = torch_state_key(tree)
    arrays[key] = arrays[key][:-8].copy()
    tree["torch"]["shape"] = [arrays[key].size]


def cuda_offset(tree: dict[str, Any], arrays: dict[str, Any]) -> None:
    # A CUDA state whose Philox offset is not a multiple of 4: torch refuses it, on a GPU only.
    state = (7).to_bytes(8, "little") + (6).to_bytes(8, "little")
    arrays["cuda/0"] = np.frombuffer(state, dtype=np.uint8).copy()
    tree["cuda"] = [{"$t": "tensor", "key": "cuda/0", "dtype": "U8", "shape": [16]}]


def python_position(tree: dict[str, Any], arrays: dict[str, Any]) -> None:
    tree["python"]["items"][1]["items"][-1] = 625


RNG_DAMAGES: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "torch CPU state position out of range": torch_position,
    "torch CPU state of another size": torch_size,
    "CUDA state offset not a multiple of 4": cuda_offset,
    "Python random position out of range": python_position,
}


@pytest.mark.parametrize("damage", list(RNG_DAMAGES))
def test_an_rng_state_that_cannot_be_applied_fails_verify_and_restore_takes_the_one_before(
    run: Path, tmp_path: Path, damage: str
) -> None:
    edit_rng(run / "000000000020", RNG_DAMAGES[damage])
    verify, restored, pulled = bounded(
        ("verify", run), ("restore", run), ("pull", f"{run}:{tmp_path / 'pulled'}")
    )
    assert verify["result"] == 1, verify["out"]
    lines = failed_lines(verify)
    assert len(lines) == 1, verify["out"]
    assert "000000000020" in lines[0], verify["out"]
    assert "RNG state cannot be restored" in lines[0], verify["out"]
    assert "OK    000000000010" in verify["out"]
    assert restored["result"] == 10
    skipped = [w for w in restored["warnings"] if "skipped" in w]
    assert len(skipped) == 1, skipped
    assert "RNG state cannot be restored" in skipped[0], skipped
    assert pulled["result"] == 1, pulled["out"]
    assert SAFE_LINE not in pulled["out"]


# -- a Lightning ModelCheckpoint folder ---------------------------------------------------------


def lightning_ckpt(folder: Path, step: int) -> Path:
    """A ``.ckpt`` folder as ``nbresume.lightning.CheckpointIO`` writes it (without Lightning)."""
    import torch

    from nbresume import CheckpointStore
    from nbresume.checkpoint.format import flatten

    checkpoint = {"global_step": step, "state_dict": {"w": torch.full((3,), float(step))}}
    tree, tensors = flatten(checkpoint, name="checkpoint")
    document = {"format": "nbresume-lightning", "version": 1, "checkpoint": tree}
    info = CheckpointStore(folder, keep=None).save(
        step, tensors={"tensors": tensors}, data={"checkpoint": document}
    )
    return Path(info.location)


def edit_document(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / "checkpoint.json"
        document = json.loads(path.read_text())
        path.write_text(json.dumps(change(document)))
        reseal(folder)

    return damage


def deep(document: dict[str, Any]) -> str:
    # Deeper than Python's recursion limit: json.loads itself raises RecursionError.
    return (
        '{"format": "nbresume-lightning", "version": 1, "checkpoint": '
        + "[" * 100_000
        + "]" * 100_000
        + "}"
    )


def deep_document(folder: Path) -> None:
    (folder / "checkpoint.json").write_text(deep({}))
    reseal(folder)


LIGHTNING_DAMAGES: dict[str, Callable[[Path], None]] = {
    "another format": edit_document(lambda d: {**d, "format": "nbresume-lightnin"}),
    "a future version": edit_document(lambda d: {**d, "version": 2}),
    "not a dictionary": edit_document(lambda d: {**d, "checkpoint": [1, 2]}),
    "a tensor missing": edit_document(
        lambda d: {**d, "checkpoint": {**d["checkpoint"], "extra": {"$t": "tensor", "key": "gone"}}}
    ),
    "nested 100 000 deep": deep_document,
}


@pytest.mark.parametrize("damage", list(LIGHTNING_DAMAGES))
def test_a_lightning_checkpoint_that_does_not_load_fails_verify_and_is_passed_over(
    tmp_path: Path, damage: str
) -> None:
    folder = tmp_path / "checkpoints"
    lightning_ckpt(folder / "epoch=0-step=2.ckpt", 2)
    LIGHTNING_DAMAGES[damage](lightning_ckpt(folder / "epoch=0-step=4.ckpt", 4))
    verify, found, loaded = bounded(
        ("verify", folder), ("lightning", folder), ("load", folder / "epoch=0-step=4.ckpt")
    )
    assert verify["result"] == 1, verify["out"]
    lines = failed_lines(verify)
    assert len(lines) == 1, verify["out"]
    assert "epoch=0-step=4.ckpt" in lines[0], verify["out"]
    assert "invalid saved state" in lines[0] or "checkpoint.json" in lines[0], verify["out"]
    assert "OK    epoch=0-step=2.ckpt" in verify["out"]
    assert found["result"] == str(folder / "epoch=0-step=2.ckpt")
    assert str(loaded["result"]).startswith("error: no checkpoint verifies"), loaded


def test_a_deep_lightning_document_beside_the_checkpoints_never_breaks_a_resume(
    tmp_path: Path,
) -> None:
    # The resume reads every .ckpt folder's document beside the one it resumes (to find what
    # Lightning's retention removes): one nested too deep is not this run's, never an error.
    pytest.importorskip("lightning")
    from nbresume.lightning.checkpoint_io import read_document

    folder = tmp_path / "checkpoints"
    good = lightning_ckpt(folder / "epoch=0-step=2.ckpt", 2).parent
    deep_document(lightning_ckpt(folder / "epoch=0-step=4.ckpt", 4))
    assert read_document(folder / "epoch=0-step=4.ckpt") is None
    assert read_document(good)["checkpoint"]["global_step"] == 2


# -- nbresume pull --------------------------------------------------------------------------------


def test_pull_fails_a_source_checkpoint_missing_a_file_instead_of_calling_it_deleted(
    run: Path, tmp_path: Path
) -> None:
    # Its manifest is still there: the checkpoint was not deleted by a writer, it lacks a file
    # (and would not load); the copy is not safe to rely on.
    (run / "000000000020" / "model.safetensors").unlink()
    (pulled,) = bounded(("pull", f"{run}:{tmp_path / 'pulled'}"))
    assert pulled["result"] == 1, pulled["out"]
    assert SAFE_LINE not in pulled["out"]
    assert "deleted on the remote" not in pulled["out"]
    assert "FAIL  000000000020" in pulled["out"]
    assert "model.safetensors: the file is missing" in pulled["out"]
    assert "OK    000000000010" in pulled["out"]


def test_pull_copies_a_run_log_of_gigabytes_in_bounded_memory(run: Path, tmp_path: Path) -> None:
    # The same pull without the log first: what the child itself takes (torch, nbresume, the
    # checkpoints) varies with the machine. Read whole, the log would add its gigabyte; read
    # in pieces, a few megabytes (the margin allows for the allocator's noise).
    baseline = run_child(("pull", f"{run}:{tmp_path / 'baseline'}"))
    without_log: int = baseline["peak"] - baseline["imports"]
    log = run / "nbresume-run.log"
    with open(log, "wb") as handle:  # sparse: costs no disk to make
        handle.truncate(1 << 30)
    (pulled,) = bounded(
        ("pull", f"{run}:{tmp_path / 'pulled'}"), peak_below=without_log + (384 << 20)
    )
    assert pulled["result"] == 0, pulled["out"]
    assert SAFE_LINE in pulled["out"]
    copy = tmp_path / "pulled" / "nbresume-run.log"
    assert copy.stat().st_size == 1 << 30
    copy.unlink()  # a gigabyte on the disk (the source is sparse): not kept with the test's folder


# -- what a checkpoint can make a reader allocate ------------------------------------------------


def big_state_json(folder: Path) -> str:
    # 64 MB of valid JSON (a list of empty lists: 50 times its size once parsed), hashes
    # matching: refused by the size its manifest records, before a byte is read.
    with open(folder / "state.json", "wb") as handle:
        handle.write(b"[" + b"[]," * ((64 << 20) // 3) + b"[]]")
    return "state.json"


def big_header(folder: Path) -> str:
    # A safetensors header of 95 MB (the official limit is 100 MB) that parses: refused by
    # its length, before it is parsed or the file hashed.
    entry = b'"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},'
    body = b"".join(entry % i for i in range(95_000_000 // len(entry % 10**6)))
    header = b"{" + body + b'"w":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'
    header += b" " * (-len(header) % 8)
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return "model.safetensors"


MEMORY_DAMAGES: dict[str, Callable[[Path], str]] = {
    "a 64 MB state.json": big_state_json,
    "a 95 MB safetensors header": big_header,
}


@pytest.mark.parametrize("damage", list(MEMORY_DAMAGES))
def test_a_checkpoint_cannot_make_a_reader_allocate_gigabytes(
    run: Path, tmp_path: Path, damage: str
) -> None:
    victim = MEMORY_DAMAGES[damage](run / "000000000020")
    reseal(run / "000000000020")
    verify, restored = bounded(("verify", run), ("restore", run), peak_below=800 << 20)
    lines = failed_lines(verify)
    assert len(lines) == 1, verify["out"]
    assert f"000000000020/{victim}" in lines[0], verify["out"]
    assert "limit" in lines[0] or "header length" in lines[0], verify["out"]
    assert restored["result"] == 10
    assert any(victim in w for w in restored["warnings"]), restored["warnings"]


def test_a_tensor_file_of_gigabytes_that_does_not_fit_is_passed_over_before_it_is_read(
    run: Path,
) -> None:
    # A valid, hash-consistent checkpoint whose model.safetensors declares a weight of 3 GiB
    # (a sparse file: no disk), state.json agreeing: verify passes it, and a restore refuses
    # it from its header, before a byte of the weight is read or memory is taken for it.
    folder = run / "000000000020"
    path = folder / "model.safetensors"
    size = path.stat().st_size
    tensors = safetensors.numpy.load_file(path)
    small = sorted(k for k in tensors if k != "0.weight")
    columns = (3 << 30) // (16 * 4)
    layout: dict[str, Any] = {}
    offset = 0
    for key in small:
        layout[key] = {"dtype": "F32", "shape": list(tensors[key].shape)}
        layout[key]["data_offsets"] = [offset, offset + tensors[key].nbytes]
        offset += tensors[key].nbytes
    layout["0.weight"] = {"dtype": "F32", "shape": [16, columns]}
    layout["0.weight"]["data_offsets"] = [offset, offset + 16 * columns * 4]
    raw = json.dumps(layout).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little") + raw)
        for key in small:
            handle.write(tensors[key].tobytes())
        handle.truncate(8 + len(raw) + layout["0.weight"]["data_offsets"][1])
    assert path.stat().st_size > 3 << 30 > size
    state = json.loads((folder / "state.json").read_text())
    state["objects"]["model"]["0.weight"]["shape"] = [16, columns]
    (folder / "state.json").write_text(json.dumps(state))
    reseal(folder)
    verify, restored, verified = bounded(
        ("verify", run), ("restore", run), ("verify-objects", run), peak_below=800 << 20
    )
    assert verify["result"] == 0, verify["out"]  # whole: nothing to compare it with
    assert restored["result"] == 10
    skipped = [w for w in restored["warnings"] if "skipped" in w]
    assert len(skipped) == 1, restored["warnings"]
    misfit = "model.0.weight is [16, 50331648] float32 in the checkpoint"
    assert misfit in skipped[0], skipped
    # Checkpointer.verify() has the objects: restore's verdict, from the same headers.
    assert verified["result"] == 1, verified["out"]
    (failed,) = failed_lines(verified)
    assert failed.startswith("FAIL  000000000020 "), verified["out"]
    assert f"does not fit the objects given: {misfit}" in failed, failed
    assert "Fix: build the model and optimizer exactly as" in failed, failed
    assert "OK    000000000010" in verified["out"], verified["out"]
    path.unlink()  # sparse, but 3 GiB to anything that copies the test's folder


def test_a_save_never_writes_a_json_file_larger_than_a_reader_takes(tmp_path: Path) -> None:
    from nbresume import CheckpointStore
    from nbresume.checkpoint.format import MAX_JSON_BYTES
    from nbresume.errors import CheckpointError

    store = CheckpointStore(tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"state\.json would be .* bytes, more than"):
        store.save(1, data={"state": {"big": "x" * MAX_JSON_BYTES}})
    assert store.list() == []
