"""A wrapped loader leaves every CUDA device's random stream as the user left it.

Before, each pass of a wrapped loader (every epoch start, and the resume mid-epoch) reseeded
the CUDA generators with nbresume's epoch seed: dropout and ``torch.randn(device="cuda")``
after a resume no longer continued the restored stream. A CPU-only machine cannot see it;
``tests/test_rng_guest.py`` guards the calls there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tests.gpu.conftest import requires_cuda
from torch.utils.data import DataLoader, TensorDataset

from nbresume.checkpoint.state import ResumableLoader

pytestmark = [pytest.mark.gpu, requires_cuda]


def cuda_streams() -> list[Any]:
    return [state.clone() for state in torch.cuda.get_rng_state_all()]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_of_a_wrapped_loader_leaves_the_cuda_streams(workers: int) -> None:
    torch.cuda.manual_seed_all(123)
    torch.randn(4, device="cuda")  # the stream is in use, not at its seed
    before = cuda_streams()
    data = TensorDataset(torch.randn(40, 3), torch.arange(40))
    loader = ResumableLoader(
        DataLoader(data, batch_size=4, shuffle=True, num_workers=workers, pin_memory=True),
        seed=7,
    )
    loader.load_state_dict({"seed": 7, "epoch": 1, "position": 3})  # a resume mid-epoch
    seen = sum(len(y) for _x, y in loader)
    assert seen == 40 - 3 * 4
    for _x, _y in loader:  # and the next epoch from its start
        pass
    after = cuda_streams()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    print(f"GPU-CHECK wrapped loader (workers={workers}) leaves every CUDA RNG stream: yes")
