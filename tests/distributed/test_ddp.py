"""The Checkpointer under torch.distributed: two real ranks on gloo over loopback, training a
DistributedDataParallel model from a shuffled DistributedSampler, each rank with its own
random streams (``train_ddp.py``).

One uninterrupted run (module fixture) is the reference: its checkpoints are restored by a
fresh pair of processes, inspected on disk, and its final weights are what a run whose rank
is killed and restarted by ``torchrun`` must end with, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors import safe_open

from nbresume.checkpoint.store import CheckpointStore

from .job import Job, forked, torchrun

TOTAL = 20  # 8 batches per rank and epoch: two and a half epochs
EVERY = 4


@dataclass
class Finished:
    folder: Path
    job: Job
    dumps: dict[int, dict[str, str]]
    final: str


def dumps_of(prefix: Path) -> dict[int, dict[str, str]]:
    return {rank: json.loads(Path(f"{prefix}.{rank}.json").read_text()) for rank in (0, 1)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    base = tmp_path_factory.mktemp("ddp")
    job = forked(base / "run", TOTAL, "--every", str(EVERY), "--dump", str(base / "end"))
    job.finish_well()
    finals = {job.of(0, "final")[0], job.of(1, "final")[0]}
    assert len(finals) == 1, f"the replicas differ\n{job.describe()}"
    return Finished(base / "run", job, dumps_of(base / "end"), finals.pop())


def test_a_fresh_pair_of_processes_restores_every_rank_exactly(
    uninterrupted: Finished, tmp_path: Path
) -> None:
    job = forked(uninterrupted.folder, TOTAL, "--restore-only", "--dump", str(tmp_path / "r"))
    job.finish_well()
    restored = dumps_of(tmp_path / "r")
    assert restored == uninterrupted.dumps  # weights, optimizer and every RNG, per rank
    assert restored[0]["rng"] != restored[1]["rng"]  # each rank got its own streams back
    assert job.of(0, "start") == job.of(1, "start") == [str(TOTAL)]


def test_only_rank_0_writes_and_the_checkpoint_holds_every_rank_s_rng(
    uninterrupted: Finished,
) -> None:
    folder = uninterrupted.folder
    job = uninterrupted.job
    saves = list(range(EVERY, TOTAL + 1, EVERY))
    assert job.of(0, "event verified") == [str(s) for s in saves]
    assert job.of(1, "event save_started") == []  # rank 1 writes nothing
    assert sorted(p.name for p in folder.iterdir()) == ["000000000016", "000000000020"]
    report = CheckpointStore(folder).verify()
    assert report.ok, report.summary()
    for checkpoint in folder.iterdir():
        assert sorted(p.name for p in checkpoint.iterdir()) == [
            "manifest.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors",
            "state.json",
        ]  # fmt: skip
        state = json.loads((checkpoint / "state.json").read_text())
        assert state["world_size"] == 2
        assert len(state["rank_rng"]) == 1
        with safe_open(str(checkpoint / "rng.safetensors"), framework="pt") as rng:
            keys = set(rng.keys())
            assert {"torch", "numpy/1", "rank1/torch", "rank1/numpy/1"} <= keys
            assert not rng.get_tensor("torch").equal(rng.get_tensor("rank1/torch"))
        assert state["rng"]["python"] != state["rank_rng"][0]["python"]


def test_a_killed_rank_and_a_new_torchrun_end_bit_identical(
    uninterrupted: Finished, tmp_path: Path
) -> None:
    """One rank dies as a preempted or OOM-killed worker does; torchrun ends the job, and
    the identical command, run again, resumes from the last verified checkpoint."""
    command = (tmp_path / "run", TOTAL, "--every", str(EVERY), "--sleep", "0.15")
    first = torchrun(*command)
    first.wait_for("rank 0 event verified 12")  # mid-epoch: 8 batches per epoch
    os.kill(first.pid(1), signal.SIGKILL)
    assert first.finish() != 0, first.describe()
    assert first.of(0, "final") == [], first.describe()  # it did not get to the end
    again = torchrun(*command)
    again.finish_well()
    assert again.of(0, "start") == again.of(1, "start"), again.describe()
    assert 12 <= int(again.of(0, "start")[0]) < TOTAL, again.describe()
    assert again.of(0, "final") == again.of(1, "final") == [uninterrupted.final]


def test_a_signal_to_one_rank_stops_both_at_the_same_step_after_a_save(tmp_path: Path) -> None:
    total = 400  # far more than the signal gives it time for
    job = forked(tmp_path / "run", total, "--every", "1000", "--sync", "--sleep", "0.02")
    job.wait_for("rank 1 step 5")
    os.kill(job.pid(1), signal.SIGTERM)
    assert job.finish() == 1, job.describe()  # the launcher reports the ranks' exit status
    stopped = job.of(0, "event stopping")
    assert stopped == job.of(1, "event stopping"), job.describe()
    assert len(stopped) == 1, job.describe()
    assert int(stopped[0]) < total, job.describe()
    assert job.of(0, "exit") == job.of(1, "exit") == [str(128 + signal.SIGTERM)]
    latest = CheckpointStore(tmp_path / "run").latest()
    assert latest is not None
    assert latest.step == int(stopped[0])
    assert CheckpointStore(tmp_path / "run").verify().ok


def test_a_failed_save_on_rank_0_raises_on_every_rank(tmp_path: Path) -> None:
    job = forked(tmp_path / "run", TOTAL, "--every", str(EVERY), "--sync", "--fail-at", "8")
    assert job.finish() == 1, job.describe()
    (mine,) = job.of(0, "error")
    (theirs,) = job.of(1, "error")
    assert mine.startswith("CheckpointError: cannot store 'probe/broken'"), job.describe()
    assert theirs.startswith("CheckpointError: on rank 0: cannot store 'probe/broken'")
    assert job.of(0, "exit") == job.of(1, "exit") == ["1"]
    latest = CheckpointStore(tmp_path / "run").latest()
    assert latest is not None
    assert latest.step == 4


@pytest.mark.torture
def test_a_failed_background_save_raises_on_every_rank_at_the_next_boundary(
    tmp_path: Path,
) -> None:
    job = forked(tmp_path / "run", TOTAL, "--every", str(EVERY), "--fail-at", "8")
    assert job.finish() == 1, job.describe()
    for rank in (0, 1):
        (error,) = job.of(rank, "error")
        assert "a background save failed" in error, job.describe()
        assert job.of(rank, "step")[-1] == "9", job.describe()  # raised at the next boundary
