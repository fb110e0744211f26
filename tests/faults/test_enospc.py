"""The disk fills up in the middle of a save: earlier checkpoints survive, nothing half-written
stays behind, the error says how much space is needed, and the next save works.

Two ways: a LocalStore whose files stop accepting bytes after a budget drawn at random within
the checkpoint (the only stand-in is at the storage edge, the file object), and a real tiny
tmpfs mounted in a private user and mount namespace.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest

from nbresume.checkpoint.backends import FreeSpace, LocalStore
from nbresume.checkpoint.format import MANIFEST_NAME, TEMP_PREFIX, step_dirname
from nbresume.checkpoint.store.store import CheckpointStore, format_bytes
from nbresume.errors import StorageFullError

from .saver import state_for, state_mismatch

HERE = Path(__file__).parent
KEEP = 3


class FillingDisk(LocalStore):
    """A local folder on a disk that something else fills up while a checkpoint is written.

    Once armed with a byte budget, files opened for writing accept that many more bytes in
    all, then fail with ENOSPC: at ``write()`` after a short write, or (``at_flush``), as
    file systems with delayed allocation do, only when the data is flushed and fsynced.
    """

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.budget: int | None = None
        self.at_flush = False
        self.written = 0
        self.full = False

    def arm(self, budget: int, *, at_flush: bool) -> None:
        self.budget, self.at_flush, self.written, self.full = budget, at_flush, 0, False

    def disarm(self) -> None:
        """Space is back."""
        self.budget, self.full = None, False

    def open_write(self, folder: str, name: str) -> IO[bytes]:
        return _FillingFile(super().open_write(folder, name), self)  # type: ignore[return-value]

    def free_space(self) -> FreeSpace:
        real = super().free_space()
        # The up-front check saw room; by the time the write failed there was none left.
        return FreeSpace(0, real.inodes) if self.full else real


class _FillingFile:
    def __init__(self, handle: IO[bytes], disk: FillingDisk) -> None:
        self.handle, self.disk, self.pending = handle, disk, False

    def write(self, chunk: bytes | memoryview) -> int:
        data = memoryview(chunk).cast("B")
        disk = self.disk
        if disk.budget is None:
            return self.handle.write(data)
        room = disk.budget - disk.written
        if len(data) <= room:
            disk.written += len(data)
            return self.handle.write(data)
        disk.written, disk.full = disk.budget, True
        if disk.at_flush:
            self.pending = True  # accepted into the page cache; the error comes at flush
            return len(data)
        self.handle.write(data[:room])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.handle.name)

    def flush(self) -> None:
        self.handle.flush()
        if self.pending:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.handle.name)

    def fileno(self) -> int:
        return self.handle.fileno()

    def close(self) -> None:
        self.handle.close()


# A tenth of the kill tests' checkpoint (about 180 kB): a hundred failed saves stay quick.
SCALE = 1


def state(step: int) -> dict[str, Any]:
    return state_for(step, SCALE)


def measure(step: int, scratch: Path, scale: int = SCALE) -> list[tuple[str, int]]:
    """Each file of the checkpoint of ``step`` with its size, in the order save() writes them
    (manifest last), found by saving it to a scratch folder."""
    shutil.rmtree(scratch, ignore_errors=True)
    saved = state_for(step, scale)
    CheckpointStore(scratch, keep=1).save(step, **saved)
    folder = scratch / step_dirname(step)
    names = [f"{stem}.safetensors" for stem in saved["tensors"]]
    names += [f"{stem}.json" for stem in saved["data"]] + [MANIFEST_NAME]
    return [(name, (folder / name).stat().st_size) for name in names]


def full_checkpoint_bytes(scratch: Path) -> int:
    """The size of one checkpoint of ``tmpfs_child.py`` (the kill tests' full-size state)."""
    return sum(size for _, size in measure(1, scratch, scale=10))


def pick_offset(index: int, sizes: list[tuple[str, int]], rng: random.Random) -> int:
    """The byte after which the disk is full: first both sides of every file boundary and a
    few bytes inside the manifest, then uniformly random offsets."""
    total = sum(size for _, size in sizes)
    edges = [sum(size for _, size in sizes[:i]) for i in range(len(sizes))]
    special = [0, total - 1] + [e + d for e in edges[1:] for d in (-1, 0, 1)]
    special += [edges[-1] + sizes[-1][1] // k for k in (2, 3, 5)]
    if index < len(special):
        return special[index]
    return rng.randrange(total)


def check_intact(store: CheckpointStore, steps: list[int], context: str) -> None:
    """Exactly ``steps`` are there, every one verifies and loads its own state."""
    report = store.verify()
    assert [r.step for r in report.results] == steps, f"{context}: {report.results}"
    assert report.ok, f"{context}: {[str(r) for r in report.results if not r.ok]}"
    for step in steps:
        loaded = store.load(step, framework="numpy")
        assert not state_mismatch(step, loaded.tensors, loaded.data, SCALE), context


def test_enospc_at_random_byte_offsets(ram_dir: Path, fault_rng: random.Random) -> None:
    disk = FillingDisk(ram_dir / "run")
    store = CheckpointStore(disk, keep=KEEP)
    first = 100
    for step in range(first, first + KEEP):
        store.save(step, **state(step))
    for index in range(120):
        step = first + KEEP + index
        sizes = measure(step, ram_dir / "scratch")
        total = sum(size for _, size in sizes)
        offset = pick_offset(index, sizes, fault_rng)
        at_flush = fault_rng.random() < 0.3
        context = f"ENOSPC after {offset} of {total} bytes (at_flush={at_flush}), step {step}"
        disk.arm(offset, at_flush=at_flush)
        with pytest.raises(StorageFullError) as caught:
            store.save(step, **state(step))
        assert disk.full, context
        error = caught.value
        assert error.needed >= total - sizes[-1][1], context
        assert f"needs {format_bytes(error.needed)}" in str(error), context
        assert f"has {format_bytes(error.free)} free" in str(error), context
        assert error.fix, context
        left = os.listdir(disk.root)
        assert not [n for n in left if n.startswith(TEMP_PREFIX)], f"{context}: {left}"
        assert step_dirname(step) not in left, context
        earlier = list(range(step - KEEP, step))
        check_intact(store, earlier, context)
        # Space is back: the same step saves, and retention goes on as before.
        disk.disarm()
        store.save(step, **state(step))
        check_intact(store, [*earlier[1:], step], context + ", then saved")


def test_enospc_in_the_manifest_leaves_no_commit(tmp_path: Path) -> None:
    """The payload fitted, the manifest (the commit marker) did not: nothing is committed."""
    disk = FillingDisk(tmp_path / "run")
    store = CheckpointStore(disk, keep=KEEP)
    store.save(1, **state(1))
    sizes = measure(2, tmp_path / "scratch")
    payload = sum(size for _, size in sizes[:-1])
    for budget in (payload, payload + sizes[-1][1] // 2):
        for at_flush in (False, True):
            disk.arm(budget, at_flush=at_flush)
            with pytest.raises(StorageFullError, match="needs"):
                store.save(2, **state(2))
            disk.disarm()
            assert sorted(os.listdir(disk.root)) == [step_dirname(1)]
            assert store.load(framework="numpy").step == 1


# -- a real file system that is too small --------------------------------------------------


@pytest.fixture(scope="module")
def private_mounts(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip unless this machine lets an unprivileged user namespace mount a tmpfs."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        pytest.skip("needs Linux and unshare(1) to mount a private tmpfs")
    probe = tmp_path_factory.mktemp("probe")
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         'mount -t tmpfs -o size=1m tmpfs "$1" && touch "$1/x"', "sh", str(probe)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if result.returncode != 0:
        pytest.skip(
            "user namespaces with mounts are not permitted here "
            f"(unshare --user --map-root-user --mount: {result.stderr.strip()})"
        )


def fill_tmpfs(
    mount: Path, scenario: str, size: int, inodes: int = 100_000, *args: str
) -> dict[str, Any]:
    """Run ``tmpfs_child.py`` on a private tmpfs of ``size`` bytes and ``inodes`` inodes."""
    mount.mkdir()
    script = (
        f'mount -t tmpfs -o size={size},nr_inodes={inodes},mode=700 tmpfs "$1" && '
        'shift && exec "$@"'
    )
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh",
         str(mount), sys.executable, str(HERE / "tmpfs_child.py"), str(mount), scenario, *args],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


def check_full_disk_report(
    report: dict[str, Any], *, wrote_nothing: bool = False, inodes: bool = False
) -> None:
    context = json.dumps(report, indent=1)[:3000]
    error = report.get("error")
    assert error is not None, f"the disk never filled up: {context}"
    assert error["type"] == "StorageFullError", context
    assert "needs" in error["message"], context
    assert format_bytes(error["needed"]) in error["message"], context
    assert error["free"] is not None, context
    if inodes:  # (the test's folder name has "inodes" in it too)
        assert "free inodes" in error["message"], context
    else:
        assert error["free"] < error["needed"], context
    failed = step_dirname(report["failed_step"])
    assert failed not in report["leftovers"], context
    assert not [n for n in report["leftovers"] if n.startswith(".")], context
    # Every checkpoint reported saved before the failure is still there, whole and right
    # (with keep=2 the newest two of them).
    saved = report["saved"]
    kept = saved if report["scenario"] != "filler" else saved[-2:]
    assert [step for step, _, _ in report["verified"]] == kept, context
    assert all(ok for _, ok, _ in report["verified"]), context
    assert all(problem == "" for problem in report["contents"].values()), context
    assert report["retry"] == "saved", context
    assert [step for step, ok in report["verified_after_retry"] if ok][-1] == report["failed_step"]
    if wrote_nothing:
        assert "ran out of space while writing" not in error["message"], context


@pytest.mark.usefixtures("private_mounts")
def test_real_tmpfs_fills_up_mid_write(tmp_path: Path, fault_rng: random.Random) -> None:
    one = full_checkpoint_bytes(tmp_path / "scratch")
    for index in range(4):
        # Room for between 1.2 and 4.8 checkpoints: the write that fails stops at a
        # different byte each time.
        size = fault_rng.randrange(int(one * 1.2), int(one * 4.8))
        report = fill_tmpfs(tmp_path / f"mnt{index}", "no-check", size)
        check_full_disk_report(report)
        assert "ran out of space while writing" in report["error"]["message"]


@pytest.mark.usefixtures("private_mounts")
def test_real_tmpfs_refuses_up_front(tmp_path: Path, fault_rng: random.Random) -> None:
    one = full_checkpoint_bytes(tmp_path / "scratch")
    size = fault_rng.randrange(int(one * 1.2), int(one * 4.8))
    report = fill_tmpfs(tmp_path / "mnt", "up-front", size)
    check_full_disk_report(report, wrote_nothing=True)


@pytest.mark.usefixtures("private_mounts")
def test_real_tmpfs_filled_by_another_writer(tmp_path: Path, fault_rng: random.Random) -> None:
    """Another process fills the disk at a random moment while checkpoints are being saved:
    whether that lands in the middle of a write or before the up-front check, the result is
    the same."""
    if shutil.which("dd") is None:
        pytest.skip("needs dd(1) to fill the disk from another process")
    one = full_checkpoint_bytes(tmp_path / "scratch")
    seen = []
    for index in range(3):
        size = fault_rng.randrange(int(one * 4.5), int(one * 7))
        delay = fault_rng.uniform(0.0, 0.1)
        report = fill_tmpfs(tmp_path / f"mnt{index}", "filler", size, 100_000, f"{delay:.4f}")
        check_full_disk_report(report)
        mid_write = "ran out of space while writing" in report["error"]["message"]
        seen.append(
            f"after {len(report['saved'])} saves, {'mid-write' if mid_write else 'up front'}"
        )
    print("disk filled:", "; ".join(seen))


@pytest.mark.usefixtures("private_mounts")
def test_real_tmpfs_out_of_inodes(tmp_path: Path) -> None:
    # The mount point, the run folder, then five per checkpoint (a folder and 4 files): each
    # count from 4 to 13 runs out at a different one, in mkdir or in creating a file.
    for index, inodes in enumerate(range(4, 14)):
        report = fill_tmpfs(tmp_path / f"mnt{index}", "inodes", 256 << 20, inodes)
        check_full_disk_report(report, inodes=True)
