"""What a save checks after its commit, per file system.

On a local device's file system a file read back right after its write comes from the page
cache, the very bytes that were hashed as they were written: the save then checks the manifest
read back and each file's size, and a later load checks every hash. On a mount of any other
kind (FUSE, NFS, or one whose type is unknown) the save reads every file back and compares it
with the memory it was written from.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import IO

import pytest
import torch

from nbresume import CheckpointStore, CorruptCheckpointError, NoCheckpointError
from nbresume.checkpoint.backends.local import LOCAL_FILE_SYSTEMS, LocalStore, mount_type
from nbresume.checkpoint.format import parse_step_dirname


class ChangingMount(LocalStore):
    """A folder on a mount of type ``kind`` whose committed model file reads back with one
    byte changed (the size stays)."""

    def __init__(self, root: Path, kind: str) -> None:
        super().__init__(root)
        self.kind = kind

    @property
    def file_system(self) -> str:
        return self.kind

    def open_read(self, folder: str, name: str) -> IO[bytes]:
        handle = super().open_read(folder, name)
        if name != "model.safetensors" or parse_step_dirname(folder) is None:
            return handle
        with handle:
            data = bytearray(handle.read())
        data[-1] ^= 0x01
        return io.BytesIO(bytes(data))


def model() -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {"w": torch.arange(1000, dtype=torch.float32)}}


def test_the_store_knows_the_file_system_it_is_on(tmp_path: Path) -> None:
    kind = mount_type(tmp_path)
    if not kind:
        pytest.skip("no mount table on this system")
    assert LocalStore(tmp_path).file_system == kind
    assert LocalStore(tmp_path).readback_after_save == (kind not in LOCAL_FILE_SYSTEMS)


@pytest.mark.parametrize("kind", ["fuse.gcsfuse", "nfs4", ""])
def test_a_save_on_a_mount_reads_back_and_refuses_changed_bytes(tmp_path: Path, kind: str) -> None:
    store = CheckpointStore(ChangingMount(tmp_path, kind))
    with pytest.raises(CorruptCheckpointError, match="did not verify after writing"):
        store.save(1, tensors=model())
    assert store.list() == []


def test_a_save_on_a_local_disk_checks_sizes_and_a_load_checks_the_bytes(tmp_path: Path) -> None:
    store = CheckpointStore(ChangingMount(tmp_path, "ext4"))
    info = store.save(1, tensors=model())  # the page cache is not read back
    assert info.step == 1
    assert not store.verify().ok
    with pytest.raises(NoCheckpointError, match="xxh3-128 mismatch"):
        store.load(step=1)
