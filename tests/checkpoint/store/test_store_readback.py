"""Verification with files large enough to be hashed in threads and read in many pieces.

A save proves its checkpoint by reading every file back after the commit and comparing it,
byte for byte, with the memory that was hashed into the manifest; a load and ``verify()``
re-hash every byte while the next piece is read. These tests use files of several read pieces
(8 MiB each) so that every piece boundary, the hashing threads and the reuse of read buffers
are exercised, and a storage that returns different bytes after the commit must be caught.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import IO

import pytest
import torch
import xxhash

from nbresume import CheckpointStore, CorruptCheckpointError, NoCheckpointError
from nbresume.checkpoint.backends import LocalStore
from nbresume.checkpoint.format import MANIFEST_NAME, parse_step_dirname, step_dirname

MIB = 1 << 20


def big_state(seed: int, mib: int = 27) -> dict[str, torch.Tensor]:
    """A tensor of ``mib`` MiB (the default: more than three read pieces) and tensors that end
    inside a piece, next to small ones."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(mib * MIB // 4 + 3, generator=gen),
        "mid": torch.randn(3 * MIB // 4, generator=gen),
        "bias": torch.randn(5, generator=gen),
        "empty": torch.zeros(0),
    }


class ReadBackStore(LocalStore):
    """A folder whose committed files read back other than written (a lying disk or mount):
    ``damage`` changes the bytes of one payload file as they are read. Like a FUSE mount, it
    is read back after each save."""

    readback_after_save = True

    def __init__(self, root: Path, victim: str, damage: str) -> None:
        super().__init__(root)
        self.victim = victim
        self.damage = damage

    def open_read(self, folder: str, name: str) -> IO[bytes]:
        handle = super().open_read(folder, name)
        if name != self.victim or parse_step_dirname(folder) is None:
            return handle
        with handle:
            data = bytearray(handle.read())
        if self.damage == "flip":
            data[max(0, len(data) - 3 * MIB)] ^= 0x01  # in a large file: in its last full piece
        elif self.damage == "flip last":
            data[-1] ^= 0x80
        elif self.damage == "short":
            del data[-1]
        elif self.damage == "long":
            data += b"\0"
        return io.BytesIO(bytes(data))


def test_large_files_round_trip_and_verify(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, md5=True)
    state = big_state(1)
    info = store.save(7, tensors={"model": state}, data={"state": {"step": 7}})
    folder = tmp_path / step_dirname(7)
    manifest = json.loads((folder / MANIFEST_NAME).read_bytes())
    model = (folder / "model.safetensors").read_bytes()
    assert manifest["files"]["model.safetensors"]["xxh3-128"] == xxhash.xxh3_128(model).hexdigest()
    assert manifest["files"]["model.safetensors"]["md5"] == hashlib.md5(model).hexdigest()
    assert info.size > 30 * MIB

    assert store.verify().ok
    loaded = store.load()
    assert loaded.data == {"state": {"step": 7}}
    for name, tensor in state.items():
        assert torch.equal(loaded.tensors["model"][name], tensor), name


@pytest.mark.parametrize(
    ("victim", "damage"),
    [
        ("model.safetensors", "flip"),
        ("model.safetensors", "flip last"),
        ("model.safetensors", "short"),
        ("model.safetensors", "long"),
        ("state.json", "flip"),
        ("state.json", "short"),
    ],
)
def test_a_save_that_reads_back_different_bytes_fails_and_leaves_no_checkpoint(
    tmp_path: Path, victim: str, damage: str
) -> None:
    good = CheckpointStore(tmp_path)
    good.save(1, tensors={"model": big_state(1, mib=1)}, data={"state": {"step": 1}})
    lying = CheckpointStore(ReadBackStore(tmp_path, victim, damage))
    state = {"step": 2, "pad": "y" * MIB}  # large enough to be hashed in a thread
    with pytest.raises(CorruptCheckpointError, match="did not verify after writing") as caught:
        lying.save(2, tensors={"model": big_state(2, mib=17)}, data={"state": state})
    assert victim in str(caught.value)
    expected = {"flip": "differ", "flip last": "differ", "short": "smaller", "long": "larger"}
    assert expected[damage] in str(caught.value)
    assert not (tmp_path / step_dirname(2)).exists()
    assert [info.step for info in good.list()] == [1]
    assert good.verify().ok
    assert good.load().step == 1


def test_one_changed_byte_anywhere_in_a_large_file_is_caught_by_verify_and_load(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path, keep=None, md5=True)
    store.save(1, tensors={"model": big_state(1, mib=1)})
    store.save(2, tensors={"model": big_state(2)})
    path = tmp_path / step_dirname(2) / "model.safetensors"
    intact = path.read_bytes()
    for offset in (0, 9 * MIB + 1, len(intact) - 1):
        data = bytearray(intact)
        data[offset] ^= 0x04
        path.write_bytes(bytes(data))

        report = store.verify()
        assert [r.ok for r in report.results] == [True, False], offset
        assert "xxh3-128 mismatch" in report.results[1].problem
        with pytest.warns(RuntimeWarning, match="model.safetensors"):
            loaded = store.load()
        assert loaded.step == 1
        assert torch.equal(loaded.tensors["model"]["big"], big_state(1, mib=1)["big"])
        # A damaged header is refused before the tensor bytes are read (memory stays bounded
        # by what is valid); any other byte by its hash.
        with pytest.raises(NoCheckpointError, match=r"xxh3-128 mismatch|not a valid safetensors"):
            store.load(2)
