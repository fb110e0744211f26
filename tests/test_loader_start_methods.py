"""A wrapped loader whose workers start as new interpreters resumes exactly.

Python 3.14 starts processes with forkserver by default on Linux, Windows and macOS with
spawn. Their workers get the wrapper's dataset and ``worker_init_fn`` pickled, and import the
user's dataset class again. ``train_loader_workers.py`` trains through ``ck.loader(dl)`` with
``num_workers=2`` under each start method, augmenting every sample from the global RNGs; a
run is killed with SIGKILL mid-epoch and restarted until done, and its final weights and
optimizer state must be bit-identical to an uninterrupted run. The uninterrupted run forks its
workers: what a sample's randomness is does not depend on how its worker started. The same
holds for randomness drawn per batch in the workers, by a ``collate_fn`` or ``__getitems__``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import train_loader_workers as script
from nbresume.checkpoint.store import CheckpointStore
from testkit.runs import reported
from zygote import Zygote, reached

SCRIPT = Path(script.__file__)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="the runs are forked from a zygote and cleaned up through /proc",
)

START_METHODS = [
    pytest.param("spawn"),
    pytest.param(
        "forkserver",
        marks=pytest.mark.skipif(
            "forkserver" not in multiprocessing.get_all_start_methods(),
            reason="this platform has no forkserver start method",
        ),
    ),
]

TOTAL = script.EPOCHS * script.BATCHES
#: Killed once it reported this step: after the checkpoints of steps 3 and 6, mid-epoch.
KILL_AT = 2 * script.EVERY + 1


def process_group(pgid: int) -> dict[int, str]:
    """The live processes of process group ``pgid``: {pid: command line}."""
    members: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            members[int(entry.name)] = command
    return members


def end_group(pgid: int) -> None:
    """End what a trainer leaves behind. Under forkserver, workers whose trainer was killed
    never end: PyTorch's workers watch their parent, the fork server, and the fork server
    waits for its children. The resource tracker is left to remove the semaphores they
    leave; it ends once they are gone."""
    for pid, command in process_group(pgid).items():
        if "resource_tracker" not in command:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while process_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in process_group(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def leftovers(pgid: int) -> dict[int, str]:
    """What a trainer left in its process group, but for multiprocessing's resource tracker
    (it ends by itself once the workers are gone)."""
    return {p: c for p, c in process_group(pgid).items() if "resource_tracker" not in c}


class WorkerRuns(Zygote):
    """``train_loader_workers.py``: one training process per run, torch imported once;
    a kill is a real SIGKILL of the trainer."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, SCRIPT)
        self.linger = 0.0
        self.survivors: dict[int, str] = {}

    def train(
        self,
        folder: Path,
        start_method: str,
        *,
        kill_at: int | None = None,
        linger: float = 0,
        kind: str = "sample",
    ) -> tuple[int, str]:
        """Train in ``folder``; with ``kill_at``, SIGKILL the trainer once it has reported
        that step. Returns (exit status, what the trainer and its workers printed). With
        ``linger``, what the trainer left is given that long to end by itself first; what
        was still there is kept in :attr:`survivors`."""
        self.linger = linger
        command = {"folder": str(folder), "start_method": start_method, "kind": kind}
        kill_when = None if kill_at is None else reached(kill_at)
        return self.run(command, kill_when=kill_when, pause=0.05)

    def resumes_to(
        self, reference: dict[str, torch.Tensor], folder: Path, start_method: str, **options: Any
    ) -> None:
        """Train again in ``folder``, killed before at its last checkpoint: the run resumes
        from that step and ends with exactly the tensors of the uninterrupted ``reference``."""
        committed = max(r.step for r in CheckpointStore(folder, keep=None).verify().results)
        status, text = self.train(folder, start_method, **options)
        assert status == 0, text
        assert reported(text, "start") == [committed], text
        assert reported(text, "done") == [TOTAL], text
        final = self.final()
        assert final.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(final[key], value), f"{start_method} {options}: {key} differs"

    def ended(self, pid: int) -> None:
        deadline = time.monotonic() + self.linger
        while leftovers(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.survivors = leftovers(pid)
        end_group(pid)  # the trainer's group: its pid (train_loader_workers._train)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerRuns]:
    server = WorkerRuns(tmp_path_factory.mktemp("zygote"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(
    zygote: WorkerRuns, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, torch.Tensor]:
    """The uninterrupted run, its workers forked."""
    status, text = zygote.train(tmp_path_factory.mktemp("reference") / "run", "fork")
    assert status == 0, text
    assert reported(text, "done") == [TOTAL], text
    # One pass per epoch, two workers per pass, each forked from the trainer.
    assert text.count("worker fresh=False parent=trainer") == 2 * script.EPOCHS, text
    return zygote.final()


@pytest.mark.slow
@pytest.mark.parametrize("start_method", START_METHODS)
def test_a_run_killed_mid_epoch_resumes_bit_identically(
    tmp_path: Path, start_method: str, zygote: WorkerRuns, reference: dict[str, torch.Tensor]
) -> None:
    folder = tmp_path / "run"
    status, text = zygote.train(folder, start_method, kill_at=KILL_AT)
    assert status == -signal.SIGKILL, text
    assert reported(text, "start") == [0], text
    assert "error " not in text, text
    # The workers are new interpreters that imported the dataset's module again; a forkserver
    # worker's parent is the fork server. Its worker_init_fn ran there, after nbresume's own.
    parent = "trainer" if start_method == "spawn" else "other"
    workers = [line for line in text.splitlines() if line.startswith("worker ")]
    assert workers == [f"worker fresh=True parent={parent}"] * len(workers), text
    assert workers, text
    report = CheckpointStore(folder, keep=None).verify()
    assert report.ok, f"{text}\n{report.summary}"
    committed = max(r.step for r in report.results)
    assert 0 < committed < script.BATCHES, f"not killed mid-epoch: {committed}\n{text}"
    zygote.resumes_to(reference, folder, start_method)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["collate", "getitems"])
def test_randomness_per_batch_in_workers_resumes_bit_identically(
    tmp_path: Path, kind: str, zygote: WorkerRuns
) -> None:
    """A ``collate_fn`` or a batched ``__getitems__`` that draws from the global RNGs in a
    worker: a resumed epoch's batches go to other workers than in the uninterrupted run, so
    only a seed per batch (from the epoch's seed and the batch's position) keeps them."""
    status, text = zygote.train(tmp_path / "reference", "fork", kind=kind)
    assert status == 0, text
    reference = zygote.final()

    folder = tmp_path / "run"
    status, text = zygote.train(folder, "fork", kill_at=KILL_AT, kind=kind)
    assert status == -signal.SIGKILL, text
    committed = max(r.step for r in CheckpointStore(folder, keep=None).verify().results)
    assert 0 < committed < script.BATCHES, f"not killed mid-epoch: {committed}\n{text}"
    zygote.resumes_to(reference, folder, "fork", kind=kind)


@pytest.mark.slow
def test_forkserver_workers_end_when_their_trainer_is_killed(
    tmp_path: Path, zygote: WorkerRuns
) -> None:
    """A forkserver worker's parent is the fork server: PyTorch's own watchdog, which watches
    the parent, never ends it. nbresume's worker thread watches the trainer itself."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("this platform has no forkserver start method")
    status, text = zygote.train(tmp_path / "run", "forkserver", kill_at=KILL_AT, linger=30)
    assert status == -signal.SIGKILL, text
    assert "worker fresh=True parent=other" in text, text
    assert not zygote.survivors, f"left running after the trainer was killed: {zygote.survivors}"
