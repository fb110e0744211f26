"""A rerun with another batch size: the epoch in progress continues exactly by samples where
the samples trained make whole batches of the new size; elsewhere the restore is refused with
the fix (before, 30 % of the epoch was trained twice without a word)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nbresume
from nbresume.errors import UsageError


def run(folder: Path, batch_size: int, *, stop_after: int | None = None) -> list[int]:
    """One epoch over 24 numbered samples; the sample indices trained, in order."""
    data = TensorDataset(torch.arange(24))
    ck = nbresume.Checkpointer(folder, every=None, deadline=None, quiet=True, async_save=False)
    loader = ck.loader(DataLoader(data, batch_size=batch_size, shuffle=True), seed=3)
    seen: list[int] = []
    for _epoch in ck.epochs(1):
        for (batch,) in loader:
            seen += batch.tolist()
            if ck.step + 1 == stop_after:
                ck.request_stop()
    ck.close()
    return seen


@pytest.mark.parametrize(("before", "after", "stop_after"), [(4, 8, 2), (8, 4, 1), (6, 3, 3)])
def test_another_batch_size_continues_the_epoch_by_samples(
    tmp_path: Path, before: int, after: int, stop_after: int, caplog: Any
) -> None:
    reference = run(tmp_path / "reference", before)
    head = run(tmp_path / "run", before, stop_after=stop_after)
    tail = run(tmp_path / "run", after)
    assert head + tail == reference, "every sample once, in the epoch's order"
    assert f"the batch size changed from {before} to {after}" in caplog.text


def test_another_batch_size_that_splits_a_batch_is_refused_with_the_fix(tmp_path: Path) -> None:
    run(tmp_path / "run", 4, stop_after=3)  # 12 samples trained
    with pytest.raises(UsageError, match="changed from 4 to 5") as refused:
        run(tmp_path / "run", 5)
    assert "keep batch_size=4" in refused.value.fix
