"""CUDA tests: run with ``pytest -m gpu`` on a machine with an NVIDIA GPU (DEVELOPERS.md).

Every test here is marked ``gpu`` and skipped, with the reason, where torch sees no CUDA
device (or fewer devices than a test needs).
"""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
