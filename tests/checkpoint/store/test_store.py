"""The checkpoint store end to end on a real folder: save, load, verify, retention, re-saving a
step, recovery after a killed writer, and refusing a save that cannot fit."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import nbresume
from nbresume import (
    CheckpointError,
    CheckpointStore,
    CorruptCheckpointError,
    NoCheckpointError,
)
from nbresume.checkpoint.format import step_dirname
from nbresume.checkpoint.store.store import format_bytes
from testkit.tinydisk import on_a_tiny_disk


def bits(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def model_state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 4, generator=gen), "b": torch.randn(4, generator=gen)}


def save_step(store: CheckpointStore, step: int, **metrics: float) -> None:
    store.save(
        step,
        tensors={"model": model_state(step)},
        data={"state": {"step": step}},
        metrics=metrics,
    )


def steps(store: CheckpointStore) -> list[int]:
    return [info.step for info in store.list()]


# -- round trip --------------------------------------------------------------------------------


def every_dtype() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (96,), dtype=torch.uint8, generator=gen)
    out = {
        "f32": raw[:48].view(torch.float32).reshape(3, 4),  # random bits: NaNs, -0.0, ...
        "bf16": raw[:48].view(torch.bfloat16).reshape(4, 6),
        "f16": raw[48:96].view(torch.float16),
        "f64": raw[:96].view(torch.float64),
        "i64": raw[:96].view(torch.int64).reshape(2, 6),
        "i8": raw[:5].view(torch.int8),
        "flags": raw[:10] > 127,
        "scalar": torch.tensor(-3, dtype=torch.int32),
        "empty": torch.zeros(0, 5),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "every_other": torch.arange(20, dtype=torch.int16)[::3],
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            out[name] = raw[:16].view(getattr(torch, name)).reshape(4, 4)
    return out


def test_tensors_arrays_and_json_come_back_bit_identical(ckpt_dir: Path) -> None:
    tensors = every_dtype()
    arrays = {
        "a": np.linspace(-1, 1, 9, dtype=np.float32).reshape(3, 3),
        "mask": np.array([True, False, True]),
        "count": np.array(41, dtype=np.uint64),
    }
    state = {
        "epoch": 3,
        "big": 2**62 + 1,
        "lr": 1e-3,
        "name": "résumé ✓",
        "history": [[1, 0.5], [2, 0.25]],
        "nested": {"ok": True, "none": None},
    }
    store = CheckpointStore(ckpt_dir)
    info = store.save(1500, tensors={"model": tensors, "extra": arrays}, data={"state": state})
    assert info.step == 1500
    assert info.size == sum(
        p.stat().st_size for p in (ckpt_dir / "000000001500").iterdir() if p.name != "manifest.json"
    )

    loaded = CheckpointStore(ckpt_dir).load()
    assert loaded.step == 1500
    assert loaded.skipped == []
    assert loaded.data == {"state": state}
    assert set(loaded.tensors) == {"model", "extra"}
    assert set(loaded.tensors["model"]) == set(tensors)
    for name, tensor in tensors.items():
        got = loaded.tensors["model"][name]
        assert (got.dtype, tuple(got.shape)) == (tensor.dtype, tuple(tensor.shape)), name
        assert bits(got) == bits(tensor), name
    for name, array in arrays.items():
        got_np = loaded.tensors["extra"][name].numpy()
        assert got_np.dtype == array.dtype
        np.testing.assert_array_equal(got_np, array)


def test_numpy_framework_loads_numpy_arrays(ckpt_dir: Path) -> None:
    arrays = {"x": np.arange(6, dtype=np.int32).reshape(2, 3), "y": np.float64(2.5)}
    store = CheckpointStore(ckpt_dir)
    store.save(1, tensors={"arrays": arrays})
    loaded = store.load(framework="numpy")
    for name, value in arrays.items():
        got = loaded.tensors["arrays"][name]
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, value)


def test_a_bfloat16_checkpoint_loaded_as_numpy_fails_instead_of_falling_back(
    ckpt_dir: Path,
) -> None:
    store = CheckpointStore(ckpt_dir)
    store.save(1, tensors={"model": {"w": torch.ones(2)}})
    store.save(2, tensors={"model": {"w": torch.ones(2, dtype=torch.bfloat16)}})
    with pytest.raises(CheckpointError, match="framework='torch'") as caught:
        store.load(framework="numpy")
    assert not isinstance(caught.value, CorruptCheckpointError)
    assert steps(store) == [1, 2]


def test_the_official_safetensors_library_opens_every_tensor_file(ckpt_dir: Path) -> None:
    tensors = every_dtype()
    arrays = {"a": np.arange(5, dtype=np.float32), "b": np.array([[1, 2]], dtype=np.int64)}
    store = CheckpointStore(ckpt_dir)
    store.save(3, tensors={"model": tensors, "arrays": arrays}, data={"state": {}})

    folder = ckpt_dir / step_dirname(3)
    files = sorted(folder.glob("*.safetensors"))
    assert [p.name for p in files] == ["arrays.safetensors", "model.safetensors"]
    official = safetensors.torch.load_file(str(folder / "model.safetensors"))
    assert set(official) == set(tensors)
    for name, tensor in tensors.items():
        assert official[name].dtype == tensor.dtype
        assert bits(official[name]) == bits(tensor)
    with safetensors.safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(tensors)
    official_np = safetensors.numpy.load_file(str(folder / "arrays.safetensors"))
    for name, array in arrays.items():
        np.testing.assert_array_equal(official_np[name], array)


def test_metrics_are_recorded_and_non_finite_ones_dropped(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(ckpt_dir)
    with caplog.at_level(logging.WARNING, logger="nbresume"):
        info = store.save(
            9,
            data={"state": {}},
            metrics={"val_loss": 0.125, "acc": 1, "exploded": float("nan"), "inf": float("inf")},
        )
    expected = {"val_loss": 0.125, "acc": 1.0}
    assert dict(info.metrics) == expected
    document = json.loads((ckpt_dir / step_dirname(9) / "manifest.json").read_text())
    assert document["metrics"] == expected
    assert dict(store.list()[0].metrics) == expected
    assert "exploded" in caplog.text


def test_a_value_that_is_not_json_is_refused_and_nothing_is_left(ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir)
    with pytest.raises(CheckpointError, match=r"'state'.*JSON"):
        store.save(1, data={"state": {"when": object()}})
    assert not ckpt_dir.exists() or list(ckpt_dir.iterdir()) == []


@pytest.mark.parametrize("stem", ["../evil", ".hidden", "a/b", "", "manifest"])
def test_a_file_stem_that_cannot_name_a_file_is_refused(ckpt_dir: Path, stem: str) -> None:
    with pytest.raises(CheckpointError, match="cannot name a checkpoint file"):
        CheckpointStore(ckpt_dir).save(1, data={stem: {}})
    assert not (ckpt_dir.parent / "evil.json").exists()
    assert not ckpt_dir.exists() or list(ckpt_dir.iterdir()) == []


def test_saving_nothing_is_refused(ckpt_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="nothing to save"):
        CheckpointStore(ckpt_dir).save(1)


def test_keep_must_be_positive(ckpt_dir: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(ckpt_dir, keep=0)
    with pytest.raises(ValueError, match="median"):
        CheckpointStore(ckpt_dir, keep_best=("val_loss", "median"))


def test_load_with_no_checkpoint_says_so(ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir)
    with pytest.raises(NoCheckpointError, match="no checkpoint yet"):
        store.load()
    save_step(store, 1)
    with pytest.raises(NoCheckpointError, match="step 2"):
        store.load(2)
    assert store.load(1).step == 1


# -- verification ------------------------------------------------------------------------------


def _bit_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _append(path: Path) -> None:
    with path.open("ab") as handle:
        handle.write(b"\x00")


def _delete(path: Path) -> None:
    path.unlink()


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "bit flip": _bit_flip,
    "truncated": _truncate,
    "extra bytes": _append,
    "deleted": _delete,
}


@pytest.mark.parametrize("damage", list(CORRUPTIONS), ids=list(CORRUPTIONS))
@pytest.mark.parametrize("victim", ["model.safetensors", "state.json"])
def test_any_damage_to_a_file_fails_verification_naming_it(
    ckpt_dir: Path, damage: str, victim: str
) -> None:
    store = CheckpointStore(ckpt_dir, keep=None)
    for step in (1, 2, 3):
        save_step(store, step)
    report = store.verify()
    assert report.ok
    assert report.summary == "OK 3/3, errors 0"

    CORRUPTIONS[damage](ckpt_dir / step_dirname(3) / victim)

    report = nbresume.verify(ckpt_dir)
    assert not report.ok
    assert report.summary == "OK 2/3, errors 1"
    failed = [r for r in report.results if not r.ok]
    assert [r.step for r in failed] == [3]
    assert victim in failed[0].problem
    assert victim in str(failed[0])

    with pytest.warns(RuntimeWarning, match=victim):
        loaded = store.load()
    assert loaded.step == 2
    assert [r.step for r in loaded.skipped] == [3]
    assert torch.equal(loaded.tensors["model"]["w"], model_state(2)["w"])

    with pytest.raises(NoCheckpointError, match=victim):
        store.load(3)  # an explicit step never silently becomes another one


def test_verify_one_step_and_an_empty_folder(ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir)
    empty = store.verify()
    assert not empty.ok  # nothing verified is not a success
    assert empty.results == ()
    save_step(store, 1)
    save_step(store, 2)
    report = store.verify(step=1)
    assert [r.step for r in report.results] == [1]
    assert report.ok


# -- retention ---------------------------------------------------------------------------------


def test_keep_retains_the_newest(ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir, keep=2)
    for step in range(1, 7):
        save_step(store, step)
        assert steps(store) == list(range(max(1, step - 1), step + 1))
    store.wait_removals()  # the deleted checkpoints' files are removed in the background
    assert sorted(os.listdir(ckpt_dir)) == [step_dirname(5), step_dirname(6)]


def test_keep_none_keeps_everything(ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir, keep=None)
    for step in range(1, 6):
        save_step(store, step)
    assert steps(store) == [1, 2, 3, 4, 5]
    assert store.prune() == []


def test_keep_best_also_keeps_the_best_by_a_metric(ckpt_dir: Path) -> None:
    losses = {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.7, 5: 0.6, 6: 0.8}
    store = CheckpointStore(ckpt_dir, keep=2, keep_best=("val_loss", "min", 1))
    for step, loss in losses.items():
        save_step(store, step, val_loss=loss)
    assert steps(store) == [2, 5, 6]

    accuracy = {1: 0.1, 2: 0.9, 3: 0.8, 4: 0.3, 5: 0.2}
    best = CheckpointStore(ckpt_dir / "acc", keep=1, keep_best=("acc", "max", 2))
    for step, acc in accuracy.items():
        save_step(best, step, acc=acc)
    assert steps(best) == [2, 3, 5]


def test_prune_never_trusts_a_corrupt_newer_copy(ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir, keep=None)
    for step in (1, 2, 3, 4):
        save_step(store, step)
    _bit_flip(ckpt_dir / step_dirname(3) / "model.safetensors")
    _truncate(ckpt_dir / step_dirname(4) / "state.json")

    # The two newest are corrupt: the two older good ones are what keep=2 keeps.
    assert store.prune(keep=2) == []
    assert steps(store) == [1, 2, 3, 4]
    with pytest.warns(RuntimeWarning):
        assert store.load().step == 2

    # The opposite choice (trusting the manifests without reading) would have deleted them.
    assert sorted(store.prune(keep=2, verify_kept=False)) == [1, 2]


def test_prune_keeps_the_newest_good_ones_and_never_deletes_a_corrupt_one(ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir, keep=None)
    for step in (1, 2, 3, 4, 5):
        save_step(store, step)
    _bit_flip(ckpt_dir / step_dirname(4) / "model.safetensors")
    assert store.prune(keep=2) == [1, 2]
    assert steps(store) == [3, 4, 5]
    assert [r.step for r in store.verify().results if not r.ok] == [4]


# -- re-saving a step, and recovery after a killed writer --------------------------------------


def test_saving_an_existing_step_again_replaces_it(ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir)
    store.save(5, tensors={"model": {"w": torch.zeros(3)}}, data={"state": {"v": 1}})
    store.save(5, tensors={"model": {"w": torch.ones(3)}}, data={"state": {"v": 2}})
    assert os.listdir(ckpt_dir) == [step_dirname(5)]
    loaded = store.load()
    assert loaded.data == {"state": {"v": 2}}
    assert torch.equal(loaded.tensors["model"]["w"], torch.ones(3))
    assert store.verify().ok


def _new_copy_of_step_5(tmp_path: Path) -> Path:
    """A complete, committed second copy of step 5, as the writer had it before renaming."""
    staging = CheckpointStore(tmp_path / "staging")
    staging.save(5, tensors={"model": {"w": torch.ones(3)}}, data={"state": {"v": 2}})
    return tmp_path / "staging" / step_dirname(5)


def test_a_replaced_copy_is_put_back_when_the_new_one_never_landed(
    tmp_path: Path, ckpt_dir: Path
) -> None:
    store = CheckpointStore(ckpt_dir, keep=None)
    store.save(4, data={"state": {"v": 0}})
    store.save(5, tensors={"model": {"w": torch.zeros(3)}}, data={"state": {"v": 1}})
    # The writer of a second copy of step 5 was killed between its two renames: the old copy
    # was moved aside, the new one still sits in its temporary folder.
    final = ckpt_dir / step_dirname(5)
    final.rename(ckpt_dir / f".nbresume-old-replaced-{step_dirname(5)}-4242-0badc0de")
    _new_copy_of_step_5(tmp_path).rename(ckpt_dir / f".nbresume-tmp-{step_dirname(5)}-4242-1")
    save_step(store, 6)  # the next save recovers first

    assert sorted(os.listdir(ckpt_dir)) == [step_dirname(s) for s in (4, 5, 6)]
    loaded = store.load(5)
    assert loaded.data == {"state": {"v": 1}}
    assert torch.equal(loaded.tensors["model"]["w"], torch.zeros(3))
    assert store.verify().ok


def test_a_replaced_copy_is_dropped_when_the_new_one_landed(tmp_path: Path, ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir, keep=None)
    store.save(5, tensors={"model": {"w": torch.zeros(3)}}, data={"state": {"v": 1}})
    # Killed after both renames, before the old copy was removed.
    final = ckpt_dir / step_dirname(5)
    retired = ckpt_dir / f".nbresume-old-replaced-{step_dirname(5)}-4242-0badc0de"
    final.rename(retired)
    _new_copy_of_step_5(tmp_path).rename(final)
    deleting = ckpt_dir / f".nbresume-old-deleting-{step_dirname(3)}-4242-2"
    deleting.mkdir()
    (deleting / "model.safetensors").write_bytes(b"half gone")

    cleaned = store.backend.recover(current="")

    assert sorted(cleaned) == sorted([retired.name, deleting.name])
    assert os.listdir(ckpt_dir) == [step_dirname(5)]
    assert store.load().data == {"state": {"v": 2}}


# -- space -------------------------------------------------------------------------------------

_TINY_DISK_SCRIPT = r"""
import json, os, sys
import torch
from nbresume import CheckpointStore, StorageFullError

mount = sys.argv[1]
root = os.path.join(mount, "runs", "exp")
store = CheckpointStore(root, keep=3)
store.save(1, tensors={"model": {"w": torch.ones(1000)}}, data={"state": {"step": 1}})
statvfs = os.statvfs(mount)
result = {"free_before": statvfs.f_bavail * statvfs.f_frsize}
try:
    store.save(2, tensors={"model": {"w": torch.ones(1_500_000)}})  # 6 MB on a 4 MiB disk
except StorageFullError as exc:
    result.update(error=str(exc), needed=exc.needed, free=exc.free)
result["listing"] = sorted(os.listdir(root))
result["steps"] = [i.step for i in store.list()]
result["verified"] = store.verify().summary
print(json.dumps(result))
"""


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path: Path) -> None:
    """On a real 4 MiB file system (a tmpfs in a private mount namespace)."""
    mount_point = tmp_path / "tiny"
    proc = on_a_tiny_disk(mount_point, [sys.executable, "-c", _TINY_DISK_SCRIPT])
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])

    assert "error" in result, "the oversized save was not refused"
    assert result["needed"] > 6_000_000
    assert result["free"] == result["free_before"] < 4 * 2**20
    message = result["error"]
    assert format_bytes(result["free"]) in message
    assert format_bytes(result["needed"]) in message
    assert "keep=" in message
    # Nothing of step 2 was written, not even a temporary folder; step 1 is intact.
    assert result["listing"] == [step_dirname(1)]
    assert result["steps"] == [1]
    assert result["verified"] == "OK 1/1, errors 0"
    assert not list(mount_point.iterdir())  # the mount was private to the child


def test_a_replaced_copy_of_a_folder_whose_name_holds_dashes_is_put_back_under_that_name(
    tmp_path: Path,
) -> None:
    # A Trainer's checkpoint-12 (nbresume.hf names step folders so): killed between the two
    # renames of saving step 12 again, the old copy must come back as checkpoint-12.
    from nbresume.checkpoint.backends.local import LocalStore

    root = tmp_path / "out"
    aside = root / ".nbresume-old-replaced-checkpoint-12-4242-0badc0de"
    aside.mkdir(parents=True)
    (aside / "manifest.json").write_text("{}")

    assert LocalStore(root).recover(current="") == [aside.name]
    assert os.listdir(root) == ["checkpoint-12"]


def test_verify_says_a_checkpoint_deleted_while_it_was_read_is_gone_not_damaged(
    tmp_path: Path,
) -> None:
    # `nbresume verify` on a folder whose writer is training: the writer's retention deletes
    # the oldest checkpoint between the verifier's listing and its reading.

    from nbresume.checkpoint.backends.local import LocalStore

    root = tmp_path / "run"

    class RetentionMeanwhile(LocalStore):
        def open_read(self, folder: str, name: str):  # type: ignore[no-untyped-def]
            if folder == step_dirname(1) and (root / folder).exists():
                shutil.rmtree(root / folder)  # what the writer's retention does
            return super().open_read(folder, name)

    writer = CheckpointStore(root, keep=None)
    for step in (1, 2):
        writer.save(step, tensors={"model": {"w": torch.full((3,), float(step))}})

    report = CheckpointStore(RetentionMeanwhile(root), keep=None).verify()

    assert report.removed == (step_dirname(1),)
    assert [r.step for r in report.results] == [2]
    assert report.ok
