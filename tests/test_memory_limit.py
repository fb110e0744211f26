"""A save never makes a host copy of the state that the memory cannot hold.

An async save copies the state into host memory and writes the copy in a thread. Where that
copy would take more than half the memory this process can still allocate (its cgroup's limit
counts, not the host's size), the save is written from the live tensors instead, the same
bytes, and a warning says so once. The real test runs a child in a cgroup whose limit holds
the state but not a second copy of it (and shows that such a copy is indeed killed there);
the cheap ones point the cgroup reader at a fake tree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nbresume import Checkpointer, CheckpointStore
from nbresume.checkpoint.format import tensorfile
from nbresume.checkpoint.state import STAGE_BUFFERS, Stager, snapshot
from nbresume.platforms.cgroup import read_memory

CHILD = Path(__file__).with_name("memory_limit_child.py")
CGROUP_FS = Path("/sys/fs/cgroup")
MB = 1 << 20
#: The child's state: large next to torch's own memory, small enough to write in seconds.
STATE_MB = 512
PIECE_MB = 64  # as in the child
#: What the warning says, in every case.
STAGED = "copying it into host memory would take"
QUIET = {"every": None, "deadline": None, "quiet": True}


# -- a real cgroup -----------------------------------------------------------------------------


def cgroup_parent() -> tuple[Path, str]:
    """The folder a test may make a memory cgroup in, and the cgroup version (``"1"`` or
    ``"2"``); skips, saying why, where there is none."""
    if os.geteuid() != 0:
        pytest.skip(f"making a memory cgroup needs root; this test runs as uid {os.geteuid()}")
    controllers = CGROUP_FS / "cgroup.controllers"
    if controllers.is_file():  # cgroup v2, one tree
        if "memory" not in controllers.read_text().split():
            pytest.skip(f"cgroup v2 without the memory controller ({controllers})")
        enabled = (CGROUP_FS / "cgroup.subtree_control").read_text().split()
        if "memory" not in enabled:
            pytest.skip(
                f"the memory controller is not enabled for the cgroups under {CGROUP_FS} "
                "(cgroup.subtree_control)"
            )
        return CGROUP_FS, "2"
    v1 = CGROUP_FS / "memory"
    if (v1 / "memory.limit_in_bytes").is_file():
        return v1, "1"
    pytest.skip(f"no memory cgroup: neither v2 at {CGROUP_FS} nor v1 at {v1}")


@contextlib.contextmanager
def fresh_cgroup() -> Iterator[tuple[Path, str]]:
    """A fresh memory cgroup (its folder, its version), removed afterwards whatever happens;
    the test skips where none can be made."""
    parent, version = cgroup_parent()
    folder = parent / f"nbresume-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup in {parent}: {exc}")
    try:
        yield folder, version
    finally:
        remove_cgroup(folder)


@pytest.fixture
def cgroup() -> Iterator[tuple[Path, str]]:
    """A fresh memory cgroup (its folder, its version), removed afterwards whatever happens."""
    with fresh_cgroup() as made:
        yield made


def remove_cgroup(folder: Path) -> None:
    """rmdir the cgroup once the kernel has let its last process go (a killed process leaves
    it a moment after its parent saw it exit)."""
    for _ in range(100):
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    folder.rmdir()  # still busy: fail loudly rather than leave it behind


def oom_kills(folder: Path, version: str) -> int:
    name = "memory.oom_control" if version == "1" else "memory.events"
    for line in (folder / name).read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def run_child(
    folder: Path, version: str, run_dir: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBRESUME_")}
    return subprocess.run(
        [sys.executable, str(CHILD), str(folder), version, str(run_dir), str(STATE_MB), *extra],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


class Big(nn.Module):
    """The child's model, to restore into."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(PIECE_MB * MB // 4)) for _ in range(STATE_MB // PIECE_MB)
        )


def test_under_the_limit_a_full_host_copy_is_killed(
    cgroup: tuple[Path, str], tmp_path: Path
) -> None:
    # The control of the next test: with nbresume told to copy whatever the memory, the same
    # run in the same limit is killed by the kernel. The limit really is too small for a copy.
    folder, version = cgroup
    result = run_child(folder, version, tmp_path / "run", "--copy-anyway")
    assert result.returncode == -9, result.stdout[-2000:] + result.stderr[-2000:]
    assert oom_kills(folder, version) >= 1


def test_async_saves_of_a_state_too_large_to_copy_are_written_in_bounded_memory(
    cgroup: tuple[Path, str], tmp_path: Path
) -> None:
    folder, version = cgroup
    run_dir = tmp_path / "run"
    result = run_child(folder, version, run_dir)
    output = result.stdout[-2000:] + result.stderr[-3000:]
    assert result.returncode == 0, output
    assert oom_kills(folder, version) == 0, output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["limit"] < report["anon"] + STATE_MB * MB  # no room for a second state
    assert report["step"] == 3
    staged = [w for w in report["warnings"] if STAGED in w]
    assert len(staged) == 1, report["warnings"]  # said once, for three saves
    assert "limit" in staged[0]
    assert "every=" in staged[0]
    assert CheckpointStore(run_dir).verify().ok
    restored = Big()
    assert Checkpointer(run_dir, model=restored, **QUIET).restore() == 3
    for name, value in restored.state_dict().items():
        assert hashlib.sha256(value.numpy()).hexdigest() == report["digests"][name], name


# -- the limit is the cgroup's, not the host's -------------------------------------------------


def fake_cgroup(root: Path, *, limit: str, current: int, inactive_file: int = 0) -> None:
    """A cgroup v2 tree as the kernel lays it out: the limit, the use, the reclaimable pages."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    (root / "memory.stat").write_text(f"anon {current}\ninactive_file {inactive_file}\n")
    (root / "memory.events").write_text("oom 0\noom_kill 0\n")


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(4 * MB, dtype=torch.float32))  # 16 MiB


def save_two_steps(folder: Path) -> tuple[Checkpointer, Wide]:
    """A Checkpointer of a :class:`Wide` model that saved steps 1 and 2 in the background
    (the model changing in between), still open, and the model."""
    model = Wide()
    ckpt = Checkpointer(folder, async_save=True, model=model, **QUIET)
    for step in (1, 2):
        assert ckpt.save(step=step) is None
        with torch.no_grad():
            model.weight.add_(1.0)
    return ckpt, model


def test_the_copy_is_decided_by_the_cgroup_limit_not_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cgroup"
    monkeypatch.setenv("NBRESUME_CGROUP_ROOT", str(root))
    caplog.set_level(logging.WARNING, logger="nbresume")
    state = 16 * MB
    # 8 MiB left under a 4 GiB limit; the host has far more than the state to spare.
    fake_cgroup(root, limit=str(4 << 30), current=(4 << 30) - 8 * MB)
    facts = read_memory()
    assert facts.available == 8 * MB
    assert facts.host_available is not None
    assert facts.host_available > 4 * state

    ckpt, model = save_two_steps(tmp_path / "run")
    ckpt.close()
    staged = [r.getMessage() for r in caplog.records if STAGED in r.getMessage()]
    assert len(staged) == 1
    assert "the container's limit of 4.3 GB" in staged[0]
    assert "16.8 MB" in staged[0]
    assert "8.4 MB" in staged[0]
    restored = Wide()
    assert Checkpointer(tmp_path / "run", model=restored, **QUIET).restore() == 2
    assert torch.equal(restored.weight, torch.arange(4 * MB, dtype=torch.float32) + 1)

    # The same state with room under the limit (its file pages count as free): copied, quietly.
    caplog.clear()
    fake_cgroup(root, limit=str(4 << 30), current=(4 << 30) - 8 * MB, inactive_file=1 << 30)
    fresh = Checkpointer(tmp_path / "again", async_save=True, model=model, **QUIET)
    assert fresh.save(step=1) is None
    fresh.close()
    assert not [r for r in caplog.records if STAGED in r.getMessage()]


def test_without_a_limit_the_host_available_memory_bounds_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cgroup"
    monkeypatch.setenv("NBRESUME_CGROUP_ROOT", str(root))
    fake_cgroup(root, limit="max", current=1 << 40)
    facts = read_memory()
    assert facts.limit is None
    assert facts.available == facts.host_available
    assert facts.bound == "the host's MemAvailable"


# -- GPU tensors go through a few small buffers --------------------------------------------------


@pytest.mark.parametrize("hashes", [{}, {"hash": "sha256", "md5": True}], ids=["xxh3", "sha-md5"])
def test_tensors_staged_through_the_small_buffers_are_written_as_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashes: dict[str, Any]
) -> None:
    # Where a host copy of GPU tensors does not fit, each goes to its file piece by piece
    # through the Stager's ring of buffers. No GPU here: host tensors are staged instead, in
    # pieces small enough that each buffer of the ring is used several times.
    monkeypatch.setattr(tensorfile, "_outside_host", lambda value: isinstance(value, torch.Tensor))
    monkeypatch.setattr(snapshot, "STAGE_PIECE", 1 << 20)
    generator = torch.Generator().manual_seed(3)
    tensors = {
        "model": {
            "big": torch.randn((3 * STAGE_BUFFERS << 20) // 4 + 5, generator=generator),
            "strided": torch.randn(64, 48, generator=generator).t(),
            "half": torch.randn(1000, generator=generator).half(),
            "empty": torch.empty(0, 3),
        },
        "rng": {"state": torch.arange(7, dtype=torch.int64)},
    }
    whole = CheckpointStore(tmp_path / "whole", **hashes).save(1, tensors=tensors)
    staged = CheckpointStore(tmp_path / "staged", **hashes).save(1, tensors=tensors, stage=Stager())
    assert staged.manifest.files == whole.manifest.files  # sizes and hashes
    for name in whole.manifest.files:
        assert (Path(staged.location) / name).read_bytes() == (
            Path(whole.location) / name
        ).read_bytes(), name
    assert CheckpointStore(tmp_path / "staged").verify().ok


# -- an allocation refused where no limit said so ------------------------------------------------


def test_an_async_save_whose_copy_cannot_be_allocated_is_written_from_the_live_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # No limit is known (a container that reports none, overcommit refused), and torch's
    # allocator refuses the copy's buffers as it does on Linux: the save goes on from the live
    # tensors instead of failing with the allocator's error.
    monkeypatch.setenv("NBRESUME_CGROUP_ROOT", str(tmp_path / "no-cgroup"))
    monkeypatch.setattr("nbresume.checkpoint.hooks._available_memory", None)

    def refuse(source: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            f"memory: you tried to allocate {source.nbytes} bytes. Error code 12 (Cannot "
            "allocate memory)"
        )

    monkeypatch.setattr(snapshot, "host_buffer", refuse)
    caplog.set_level(logging.WARNING, logger="nbresume")
    ckpt, _ = save_two_steps(tmp_path / "run")
    ckpt.wait()
    ckpt.close()
    staged = [r.getMessage() for r in caplog.records if STAGED in r.getMessage()]
    assert len(staged) == 1
    assert "the allocation failed" in staged[0]
    restored = Wide()
    assert Checkpointer(tmp_path / "run", model=restored, **QUIET).restore() == 2
    assert torch.equal(restored.weight, torch.arange(4 * MB, dtype=torch.float32) + 1)
