"""An asynchronous save copies GPU tensors on the GPU first only where the training's peak
memory leaves room for that copy: the copy lives while the next step runs, and must never be
the reason that step runs out of memory. The arithmetic is checked here with the allocator's
figures played (the copy itself runs in tests/gpu/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from nbresume import knobs
from nbresume.checkpoint.state import snapshot

GIB = 1 << 30


def device_with(
    monkeypatch: pytest.MonkeyPatch, *, free: int, total: int, reserved: int, peak: int, now: int
) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: now)


def test_a_copy_fits_where_the_peak_leaves_room(monkeypatch: pytest.MonkeyPatch) -> None:
    # A T4: 15 GiB; the process holds 6 GiB, its steps peak at 5 GiB, 9 GiB free.
    device_with(monkeypatch, free=9 * GIB, total=15 * GIB, reserved=6 * GIB, peak=5 * GIB,
                now=2 * GIB)  # fmt: skip
    assert snapshot.stash_fits("cuda:0", 2 * GIB)
    # 15 GiB in all, less the peak and the margin (5 % of 15 GiB, 768 MiB): 9.25 GiB.
    assert snapshot.stash_fits("cuda:0", 9 * GIB)
    assert not snapshot.stash_fits("cuda:0", 9 * GIB + (512 << 20))


def test_the_peak_counts_not_what_is_allocated_between_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Between steps only the state is allocated (3 GiB); the backward pass peaked at 14 GiB.
    device_with(monkeypatch, free=1 * GIB, total=15 * GIB, reserved=14 * GIB, peak=14 * GIB,
                now=3 * GIB)  # fmt: skip
    assert not snapshot.stash_fits("cuda:0", 3 * GIB)


def test_memory_another_process_holds_is_not_counted_as_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 80 GiB card: this process reserved 10 GiB (peak 8), another process holds 65 GiB.
    device_with(monkeypatch, free=5 * GIB, total=80 * GIB, reserved=10 * GIB, peak=8 * GIB,
                now=4 * GIB)  # fmt: skip
    assert not snapshot.stash_fits("cuda:0", 4 * GIB)  # 8 + 4 + 4 (5 %) > 15
    assert snapshot.stash_fits("cuda:0", 2 * GIB)


def test_the_knob_turns_the_copy_on_the_gpu_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert knobs.gpu_snapshot()  # on by default
    monkeypatch.setenv("NBRESUME_GPU_SNAPSHOT", "0")
    assert not knobs.gpu_snapshot()
    monkeypatch.setenv("NBRESUME_GPU_SNAPSHOT", "maybe")
    with pytest.raises(Exception, match="NBRESUME_GPU_SNAPSHOT"):
        knobs.gpu_snapshot()


def test_a_snapshot_of_host_tensors_needs_no_wait() -> None:
    tensors = {"model": {"w": torch.arange(10.0)}}
    copied, landed = snapshot.HostBuffers().copy(tensors)
    assert landed is snapshot._nothing
    assert torch.equal(copied["model"]["w"], tensors["model"]["w"])
    assert copied["model"]["w"].data_ptr() != tensors["model"]["w"].data_ptr()
