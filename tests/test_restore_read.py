"""Restoring files large enough that their memory is prepared before the rest is read (the
header checked, then the file asked for and every page of its buffer faulted in at once):
the tensors come back bit for bit, every hash still guards them, and stores whose file
objects have no descriptor take the same path."""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from nbresume import Checkpointer, CheckpointStore, NoCheckpointError
from nbresume.checkpoint.format import step_dirname
from nbresume.checkpoint.store import hashing, reading

#: Above the size from which a read prepares the rest of its file (two 8 MiB pieces).
MB = 1 << 20


def big_state(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """About 24 MB of float32 in one file, and a small tensor behind it."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": torch.randn(6 * MB, generator=generator),
            "tail": torch.randn(17, generator=generator),
        }
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bytes(a.numpy()) == bytes(b.numpy())


def record_prefaults(monkeypatch: pytest.MonkeyPatch) -> list[hashing.Prefault]:
    """Every prefaulting thread the store's reads start from now on, in order."""
    started: list[hashing.Prefault] = []

    class Recorded(hashing.Prefault):
        def __init__(self, buffer: memoryview) -> None:
            super().__init__(buffer)
            started.append(self)

    monkeypatch.setattr(reading, "Prefault", Recorded)
    return started


@pytest.mark.parametrize("hash_name", ["xxh3-128", "sha256"])
def test_a_large_file_is_restored_bit_for_bit(tmp_path: Path, hash_name: str) -> None:
    state = big_state(0)
    store = CheckpointStore(tmp_path / "run", keep=None, hash=hash_name)
    store.save(1, tensors=state)
    loaded = store.load()
    assert loaded.step == 1
    for name, tensor in state["model"].items():
        assert same_bits(loaded.tensors["model"][name], tensor)


@pytest.mark.parametrize("hash_name", ["xxh3-128", "sha256"])
def test_a_byte_changed_far_into_a_large_file_falls_back_to_the_older_checkpoint(
    tmp_path: Path, hash_name: str
) -> None:
    store = CheckpointStore(tmp_path / "run", keep=None, hash=hash_name)
    store.save(1, tensors=big_state(1))
    store.save(2, tensors=big_state(2))
    path = tmp_path / "run" / step_dirname(2) / "model.safetensors"
    with open(path, "r+b") as handle:  # a byte past the first pieces: read after the header
        handle.seek(os.path.getsize(path) - 1000)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.warns(RuntimeWarning, match="mismatch"):
        loaded = store.load()
    assert loaded.step == 1
    assert same_bits(loaded.tensors["model"]["big"], big_state(1)["model"]["big"])


def test_a_large_file_cut_short_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "run", keep=None)
    store.save(1, tensors=big_state(3))
    path = tmp_path / "run" / step_dirname(1) / "model.safetensors"
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(NoCheckpointError, match="size mismatch"):
        store.load()


def test_a_store_without_file_descriptors_restores_a_large_file() -> None:
    # memory:// files have no descriptor to ask the kernel about: the read goes on without.
    store = CheckpointStore(f"memory://nbresume-restore-read-{uuid.uuid4().hex}", keep=None)
    state = big_state(4)
    store.save(1, tensors=state)
    loaded = store.load()
    assert same_bits(loaded.tensors["model"]["big"], state["model"]["big"])


def test_a_failed_hash_leaves_the_model_as_the_older_checkpoint_left_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4096, 2048)  # 32 MiB of weights: its file is read the prepared way
    ckpt = Checkpointer(tmp_path / "run", model=model, every=None, deadline=None, async_save=False)
    ckpt.save(10)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1)
    ckpt.save(20)
    ckpt.close()
    path = tmp_path / "run" / step_dirname(20) / "model.safetensors"
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) // 2)
        handle.write(b"\0" * 8)

    restored = nn.Linear(4096, 2048)
    ckpt = Checkpointer(
        tmp_path / "run", model=restored, every=None, deadline=None, async_save=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step is named
        assert ckpt.restore() == 10
    ckpt.close()
    for key, value in restored.state_dict().items():
        assert same_bits(value, saved[key])


@pytest.mark.parametrize("prefault", ["thread", "missing", "at once"])
def test_memory_faulted_in_ahead_or_not_gives_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefault: str
) -> None:
    # "thread": a thread faults the pages in ahead of the read, in many small pieces;
    # "missing": the call is refused (a kernel before 5.14), the read faults pages itself;
    # "at once": no prefaulting here at all, every page is faulted in before the read.
    monkeypatch.setattr(hashing, "PREFAULT_PIECE", 1 << 20)
    if prefault == "missing":
        monkeypatch.setattr(hashing, "_populate", lambda address, count: False)
    if prefault == "at once":
        monkeypatch.setattr(reading, "can_prefault", lambda: False)
    started = record_prefaults(monkeypatch)
    state = big_state(3)
    store = CheckpointStore(tmp_path / "run", keep=None)
    store.save(1, tensors=state)
    loaded = store.load()
    for name, tensor in state["model"].items():
        assert same_bits(loaded.tensors["model"][name], tensor)
    assert len(started) == (0 if prefault == "at once" else 1)
    for ahead in started:
        assert ahead._finished  # closed: no thread touches the memory any more
    if prefault == "thread" and hashing.can_prefault():
        assert started[0]._done == started[0]._size


def test_a_read_that_fails_stops_the_thread_faulting_its_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path / "run", keep=None)
    store.save(1, tensors=big_state(4))
    started = record_prefaults(monkeypatch)
    real_read = hashing.read_into

    def failing_read(handle: object, buffer: memoryview) -> int:
        if started:  # past the header, once its memory is being faulted in: the disk fails
            raise OSError(5, "Input/output error")
        return real_read(handle, buffer)  # type: ignore[arg-type]

    monkeypatch.setattr(hashing, "read_into", failing_read)
    with pytest.raises(NoCheckpointError):
        store.load()
    assert len(started) == 1
    assert started[0]._finished  # stopped: no thread touches the memory any more

    memory = hashing.new_buffer(64 * MB)
    ahead = hashing.Prefault(memory)
    ahead.close()  # asked to stop at once: it stops within a piece
    assert ahead._finished
    assert ahead._done <= hashing.PREFAULT_PIECE


def test_only_a_kernel_without_the_call_turns_prefaulting_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ctypes
    import errno

    failing: list[int] = [errno.ENOMEM]

    def madvise(address: int, count: int, advice: int) -> int:
        ctypes.set_errno(failing[0])
        return -1

    monkeypatch.setattr(hashing, "_madvise", lambda: madvise)
    monkeypatch.setattr(hashing, "_POPULATE_WRITE", [23])
    assert not hashing._populate(0, 4096)
    assert hashing._POPULATE_WRITE == [23]  # out of memory once: asked again next time
    failing[0] = errno.EINVAL
    assert not hashing._populate(0, 4096)
    assert hashing._POPULATE_WRITE == []  # not supported here: never asked again


# -- a restore that reads into the model's own memory ------------------------------------------


class Tied(nn.Module):
    """24 MB of weights (three pieces of a read), a small bias, and a weight tied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(2048, 3 * MB // 2048 * 2)
        self.small = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4, bias=False)
        self.other.weight = self.small.weight


def trained(seed: int) -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tied()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model.big(torch.randn(2, 2048)).sum().backward()
    (model.small.weight.sum() + model.other.weight.sum()).backward()
    optimizer.step()
    return model, optimizer


def states(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for state in optimizer.state_dict()["state"].values():
        out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("hash_name", ["xxh3-128", "sha256"])
def test_a_restore_into_the_live_tensors_gives_the_saved_bits_and_keeps_their_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hash_name: str
) -> None:
    # SHA-256 runs in a thread: the pieces read only to be hashed go through a ring of buffers.
    monkeypatch.setenv("NBRESUME_HASH", hash_name)
    model, optimizer = trained(0)
    ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=optimizer, quiet=True)
    ckpt.save(1)
    ckpt.close()
    expected = states(model, optimizer)
    # A live optimizer with state of its own (read into) and one without (allocated once).
    for stepped in (True, False):
        live, live_optimizer = trained(1) if stepped else (Tied(), None)
        live_optimizer = live_optimizer or torch.optim.Adam(live.parameters(), lr=0.1)
        pointers = [t.data_ptr() for t in live.state_dict().values()]
        again = Checkpointer(tmp_path / "run", model=live, optimizer=live_optimizer, quiet=True)
        assert again.restore() == 1
        again.close()
        assert [t.data_ptr() for t in live.state_dict().values()] == pointers
        assert live.other.weight is live.small.weight
        got = states(live, live_optimizer)
        assert len(got) == len(expected)
        assert all(same_bits(a, b) for a, b in zip(got, expected, strict=True))


def test_a_file_changed_after_its_check_passes_the_checkpoint_over_for_the_older_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The second read, straight into the live tensors, finds the file changed since the first
    # one checked it: the checkpoint is passed over, and the older one writes every tensor.
    model, optimizer = trained(0)
    ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=optimizer, quiet=True)
    ckpt.save(1)
    expected = states(model, optimizer)
    model2, optimizer2 = trained(2)
    model.load_state_dict(model2.state_dict())
    optimizer.load_state_dict(optimizer2.state_dict())
    ckpt.save(2)
    ckpt.close()
    from nbresume.checkpoint.store import streaming

    fill = streaming.Streamed.fill

    def changed_then_fill(self: streaming.Streamed) -> None:
        if f"{step_dirname(2)}/" in self.where:
            with open(self.where, "r+b") as handle:
                handle.seek(-1000, os.SEEK_END)
                byte = handle.read(1)
                handle.seek(-1, os.SEEK_CUR)
                handle.write(bytes([byte[0] ^ 0xFF]))
        fill(self)

    monkeypatch.setattr(streaming.Streamed, "fill", changed_then_fill)
    live, live_optimizer = trained(3)
    again = Checkpointer(tmp_path / "run", model=live, optimizer=live_optimizer, quiet=True)
    with pytest.warns(RuntimeWarning, match="changed while it was being restored"):
        assert again.restore() == 1
    again.close()
    got = states(live, live_optimizer)
    assert all(same_bits(a, b) for a, b in zip(got, expected, strict=True))
