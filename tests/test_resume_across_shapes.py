"""Resuming in another shape, in one process: what is refused loudly and what is never lost.

A leg whose data reading cannot continue its epoch exactly is refused with the fix before
anything changes, and a run that resumed from an older checkpoint than the newest (the newer
one does not fit) never has retention delete that newer one. The legs of 2, 1 and 2 ranks
are in tests/distributed/test_world_size_change.py.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nbresume
from nbresume.checkpoint.state.restoring import derived_rng
from nbresume.errors import UsageError


def steps_in(folder: Path) -> list[int]:
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def train(folder: Path, outputs: int, total: int) -> None:
    model = nn.Linear(4, outputs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = nbresume.Checkpointer(
        folder, every=2, keep=2, deadline=None, quiet=True, async_save=False,
        model=model, optimizer=optimizer,
    )  # fmt: skip
    for _ in ck.steps(total):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    ck.close()


def test_retention_never_deletes_a_newer_checkpoint_the_run_passed_over(tmp_path: Path) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    train(run, 2, 4)
    assert steps_in(run) == [2, 4]
    train(other, 3, 7)  # another model's checkpoint of step 7, newer than the run's
    shutil.copytree(other / "000000000007", run / "000000000007")
    with pytest.warns(RuntimeWarning, match="skipped 1 newer checkpoint"):
        train(run, 2, 10)  # resumes from 4, saves 6, 8 and 10 with keep=2
    assert steps_in(run) == [7, 8, 10]


class OwnSplit(DistributedSampler[int]):
    """A sampler of one's own that splits the data by rank (nbresume cannot know its order)."""


def numbered_run(
    folder: Path, sampler: str, *, stop_after: int | None = None, replicas: int = 1
) -> list[int]:
    """One epoch over 24 numbered samples, 4 a batch, read through a DistributedSampler (as
    rank 0 of ``replicas``), a sampler of one's own that splits the same way, or a plain
    shuffled DataLoader; the samples trained, in order."""
    data = TensorDataset(torch.arange(24))
    if sampler in ("distributed", "own"):
        kind = DistributedSampler if sampler == "distributed" else OwnSplit
        split = kind(data, num_replicas=replicas, rank=0, shuffle=True, seed=5)
        loader = DataLoader(data, batch_size=4, sampler=split)
    else:
        loader = DataLoader(data, batch_size=4, shuffle=True)
    ck = nbresume.Checkpointer(folder, every=None, deadline=None, quiet=True, async_save=False)
    wrapped = ck.loader(loader, seed=3)
    seen: list[int] = []
    try:
        for _epoch in ck.epochs(1):
            for (batch,) in wrapped:
                seen += batch.tolist()
                if ck.step + 1 == stop_after:
                    ck.request_stop()
    finally:
        ck.close()
    return seen


def test_a_sampler_that_splits_otherwise_mid_epoch_is_refused_with_the_fix(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "run"
    head = numbered_run(folder, "distributed", stop_after=2)
    saved = (folder / "000000000002" / "manifest.json").read_bytes()
    with pytest.raises(UsageError, match="split across 1 process") as refused:
        numbered_run(folder, "shuffled")
    assert "feed the DataLoader from the same DistributedSampler" in refused.value.fix
    assert steps_in(folder) == [2]
    assert (folder / "000000000002" / "manifest.json").read_bytes() == saved
    # With the same sampler again, the epoch ends exactly.
    tail = numbered_run(folder, "distributed")
    assert sorted(head + tail) == list(range(24))


def test_a_split_of_one_s_own_is_followed_only_in_the_same_number_of_processes(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "run"
    numbered_run(folder, "own", stop_after=1, replicas=2)
    with pytest.raises(UsageError, match="a sampler whose order nbresume cannot follow") as refused:
        numbered_run(folder, "own", replicas=1)
    assert refused.value.fix.startswith("finish this epoch with 2 process(es)")
    assert len(numbered_run(folder, "own", replicas=2)) == 8  # the rest of rank 0's share


def test_a_new_ranks_torch_stream_depends_only_on_rank_0s_torch_state() -> None:
    """A user who seeds torch but not Python's ``random`` (left to the system's entropy) gets
    the same derived torch stream on a new rank every time the same legs run."""
    torch_state = torch.Generator().manual_seed(1234).get_state()
    unseeded = [random.Random(entropy).getstate() for entropy in (1, 2)]
    derived = [
        derived_rng({"python": python, "torch": torch_state}, rank=1, step=16)
        for python in unseeded
    ]
    assert torch.equal(derived[0]["torch"], derived[1]["torch"])
    assert derived[0]["python"] != derived[1]["python"]
    other_rank = derived_rng({"python": unseeded[0], "torch": torch_state}, rank=2, step=16)
    assert not torch.equal(other_rank["torch"], derived[0]["torch"])
