"""What a checkpoint's JSON costs a reader is a small multiple of its size.

A ``state.json`` under the 32 MiB a JSON file may have can still hold an object or a list
every few bytes: each is some 64 bytes once parsed, and a reader that parsed it, checked its
depth with a stack as wide as the document and rebuilt it (twice on a restore) took gigabytes.
Such a document is refused before it is parsed; one a program really saves (numbers, strings,
tensor references) is read in a few times its size. The peaks are Python's allocations
(``tracemalloc``) while ``verify`` and ``restore()`` run.
"""

from __future__ import annotations

import json
import random
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.test_loadable import reseal
from torch import nn

from nbresume import Checkpointer, CheckpointStore
from nbresume.errors import NoCheckpointError
from testkit.stateful import QUIET

#: The most a document may cost a reader, in multiples of its size.
FACTOR = 8
DOCUMENT_BYTES = 4 << 20


def peak(action: Callable[[], Any]) -> tuple[int, Any]:
    """The peak of Python's allocations while ``action`` runs, and what it returned or raised."""
    tracemalloc.start()
    try:
        try:
            result: Any = action()
        except Exception as exc:
            result = exc
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def saved_with_value(folder: Path, value: Any) -> int:
    """A checkpoint of a tiny model whose ``state.json`` then holds ``value`` as a saved value
    (written in, and the manifest resealed: a folder that verifies); its size in bytes."""
    torch.manual_seed(0)
    ckpt = Checkpointer(folder, model=nn.Linear(2, 2), **QUIET)
    ckpt.save(1)
    ckpt.close()
    checkpoint = next(p for p in folder.iterdir() if p.name.isdigit())
    path = checkpoint / "state.json"
    document = json.loads(path.read_text())
    document["values"]["x"] = value
    path.write_text(json.dumps(document))
    reseal(checkpoint)
    return path.stat().st_size


@pytest.mark.parametrize("item", [{}, []], ids=["objects", "lists"])
def test_a_document_dense_with_objects_costs_a_small_multiple_of_its_size(
    tmp_path: Path, item: Any
) -> None:
    size = saved_with_value(tmp_path / "run", [item] * (DOCUMENT_BYTES // 4))
    taken, report = peak(lambda: CheckpointStore(tmp_path / "run").verify())
    assert taken <= FACTOR * size, f"verify took {taken >> 20} MiB for {size >> 20} MiB"
    assert not report.ok
    assert "objects and lists" in report.results[0].problem
    restored = Checkpointer(tmp_path / "run", model=nn.Linear(2, 2), **QUIET)
    taken, error = peak(restored.restore)
    assert taken <= FACTOR * size, f"restore took {taken >> 20} MiB for {size >> 20} MiB"
    assert isinstance(error, NoCheckpointError), error
    assert "objects and lists" in str(error)


def test_a_large_document_of_plain_values_is_read_in_a_small_multiple_of_its_size(
    tmp_path: Path,
) -> None:
    generator = random.Random(0)
    losses = [generator.random() for _ in range(DOCUMENT_BYTES // 20)]
    size = saved_with_value(tmp_path / "run", {"losses": losses, "steps": list(range(50_000))})
    taken, report = peak(lambda: CheckpointStore(tmp_path / "run").verify())
    assert report.ok, report
    assert taken <= FACTOR * size, f"verify took {taken >> 20} MiB for {size >> 20} MiB"
    restored = Checkpointer(tmp_path / "run", model=nn.Linear(2, 2), **QUIET)
    taken, step = peak(restored.restore)
    assert step == 1
    assert restored["x"]["losses"] == losses
    assert taken <= FACTOR * size, f"restore took {taken >> 20} MiB for {size >> 20} MiB"
