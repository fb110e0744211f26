"""A restore into objects on a device reads their tensor files straight onto it, through a
few host buffers, each piece hashed as it is read: the tensors are the same bytes, nothing is
returned before every hash matched, and a file the device has no room for is read into host
memory. Runs on the CPU as a stand-in device (the CUDA path adds pinned buffers and a stream:
tests/gpu)."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nbresume import Checkpointer, CheckpointStore
from nbresume.checkpoint.state import restoring
from nbresume.checkpoint.store import reading
from nbresume.checkpoint.store.hashing import Digests
from nbresume.errors import NoCheckpointError
from testkit.training import assert_restored_exactly

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reading, "DEVICE_PIECE", 4096)  # many pieces, the ring reused


def saved(tmp_path: Path) -> tuple[CheckpointStore, dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "big": torch.randn(64, 300, generator=generator),
        "half": torch.randn(7, 5, generator=generator).half(),
        "step": torch.tensor(3.0),
        "empty": torch.zeros(0, 4),
        "ints": torch.arange(11, dtype=torch.int64),
    }
    store = CheckpointStore(tmp_path, keep=None)
    store.save(1, tensors={"model": tensors})
    return store, tensors


def test_a_file_read_onto_a_device_gives_the_same_tensors(tmp_path: Path) -> None:
    store, tensors = saved(tmp_path)
    loaded = store.load(devices={"model.safetensors": CPU}).tensors["model"]
    assert loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype, name
        assert loaded[name].shape == value.shape, name
        assert torch.equal(loaded[name], value), name


def test_a_changed_byte_is_refused_before_anything_is_returned(tmp_path: Path) -> None:
    store, _ = saved(tmp_path)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5000] ^= 1  # inside the tensors, pieces after the first
    path.write_bytes(bytes(data))
    with pytest.raises(NoCheckpointError, match="mismatch"):
        store.load(devices={"model.safetensors": CPU})


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(40, 30)
        self.norm = nn.BatchNorm1d(30)
        self.head = nn.Linear(30, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))  # type: ignore[no-any-return]


def trained(seed: int) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 40)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_a_checkpointer_restore_through_the_device_path_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = trained(0)
    with Checkpointer(tmp_path, every=None, deadline=None, model=model, optimizer=optimizer) as ck:
        ck.save(2)
    asked: list[dict[str, Any]] = []

    def on_the_cpu(objects: Any) -> dict[str, Any]:
        asked.append({f"{name}.safetensors": CPU for name in ("model", "optimizer")})
        return asked[-1]

    monkeypatch.setattr(restoring, "devices", on_the_cpu)
    restored, restored_opt = trained(1)
    with Checkpointer(
        tmp_path, every=None, deadline=None, model=restored, optimizer=restored_opt
    ) as ck:
        assert ck.restore() == 2
    assert asked
    assert_restored_exactly(model, optimizer, restored, restored_opt)


class Handle(io.BytesIO):
    """A file whose reads are recorded, one of them failing where asked; a read after the
    reader returned is a read of a closed file."""

    def __init__(self, data: bytes, *, fail_at: int | None = None) -> None:
        super().__init__(data)
        self.reads = 0
        self.fail_at = fail_at

    def readinto(self, buffer: Any) -> int:
        self.reads += 1
        if self.reads == self.fail_at:
            raise OSError(5, "Input/output error")
        return super().readinto(buffer)


def digests() -> Digests:
    return Digests(md5=False, threaded=False)


def test_the_reader_reads_every_piece_in_order_through_the_ring() -> None:
    data = bytes(range(256)) * 200  # 51200 bytes: 13 pieces of 4096 through a ring of 4
    handle = Handle(data[100:])
    head = memoryview(bytearray(len(data)))
    head[:100] = data[:100]
    target, size = reading.DeviceReader().read(handle, head, 100, digests(), CPU)  # type: ignore[misc]
    assert size == len(data)
    assert bytes(target.numpy()) == data


def test_a_read_error_in_the_reader_reaches_the_caller_and_stops_the_reader() -> None:
    data = bytes(51200)
    handle = Handle(data, fail_at=3)
    head = memoryview(bytearray(len(data)))
    with pytest.raises(OSError, match="Input/output"):
        reading.DeviceReader().read(handle, head, 0, digests(), CPU)
    handle.close()  # a read after this one returned would raise in the reader's thread
    assert handle.reads == 3


def test_a_caller_that_stops_early_stops_the_reader_before_it_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = bytes(51200)
    handle = Handle(data)
    head = memoryview(bytearray(len(data)))

    class Failing(Digests):
        def update(self, data: Any) -> None:
            raise KeyboardInterrupt  # Ctrl-C while a piece is hashed

    with pytest.raises(KeyboardInterrupt):
        reading.DeviceReader().read(handle, head, 0, Failing(md5=False, threaded=False), CPU)
    reads = handle.reads
    assert reads <= reading.DEVICE_BUFFERS + 1  # never more than the ring ahead
    handle.close()
    time.sleep(0.05)
    assert handle.reads == reads  # nothing read after the caller returned


def test_without_a_reader_thread_the_pieces_are_read_in_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An interpreter far in its shutdown starts no thread: the same bytes, read in turn.
    monkeypatch.setattr(reading._READERS, "submit", lambda job: False)
    data = bytes(range(256)) * 200
    head = memoryview(bytearray(len(data)))
    target, size = reading.DeviceReader().read(Handle(data), head, 0, digests(), CPU)  # type: ignore[misc]
    assert size == len(data)
    assert bytes(target.numpy()) == data
