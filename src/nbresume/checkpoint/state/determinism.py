"""Bit-exact continuation on a GPU: what PyTorch needs, what it costs, and what is promised.

A resume restores the state exactly (weights, optimizer, RNG streams, data position) on any
device. Whether the steps after it repeat the uninterrupted run bit for bit is another
matter on CUDA: cuDNN picks convolution kernels by timing them (``cudnn.benchmark``), and
several kernels (cuBLAS with a split workspace, atomic adds in scatter/index backward) add
in an order that changes from run to run, so the last bits of a sum differ. On a CPU the same
operations give the same bits. :func:`enable` makes the GPU side repeatable; the tests in
``tests/gpu/`` check it on a CUDA machine.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Literal

from nbresume.checkpoint.arguments import check_bool

log = logging.getLogger("nbresume")

#: cuBLAS needs a fixed workspace layout to be deterministic (":4096:8" or ":16:8", CUDA >= 10.2).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
_DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")

#: What ``deterministic=True`` costs, in the user's words.
COST = (
    "cuDNN no longer benchmarks for the fastest convolution kernel and some operations use "
    "slower deterministic kernels (often 5-30% slower on convolutions); operations with no "
    "deterministic CUDA kernel raise RuntimeError instead of running; cuBLAS keeps a fixed "
    "workspace of about 24 MiB per stream"
)

#: What a resume promises on CUDA without it.
NOT_EXACT = (
    "a resume restores the exact state, but on CUDA the steps after it may differ from an "
    "uninterrupted run in the last bits (cuDNN and cuBLAS kernels add in an order that "
    "changes from run to run)"
)


def enable(*, warn_only: bool = False) -> list[str]:
    """Make PyTorch's CUDA (and CPU) kernels deterministic; return what was set.

    Sets ``CUBLAS_WORKSPACE_CONFIG`` (if a CUDA matmul already ran, cuBLAS's workspaces are
    released so that the next one allocates deterministic ones),
    ``torch.use_deterministic_algorithms(True)``, ``torch.backends.cudnn.deterministic =
    True`` and ``torch.backends.cudnn.benchmark = False``. With ``warn_only``, an operation
    without a deterministic kernel warns instead of raising (and the run is then not
    guaranteed bit-exact). See :data:`COST`.
    """
    import torch

    done = []
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _DETERMINISTIC_WORKSPACES:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
        done.append(f"CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE_CONFIG}")
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            _renew_cublas_workspaces(torch)
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    done.append("torch.use_deterministic_algorithms(True)")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    done.append("cudnn.deterministic=True, cudnn.benchmark=False")
    return done


def _renew_cublas_workspaces(torch: Any) -> None:
    """CUDA has started: a cuBLAS workspace exists only if a matmul already ran. PyTorch
    reads ``CUBLAS_WORKSPACE_CONFIG`` whenever it hands a workspace to cuBLAS, but sizes the
    workspace once, when it allocates it: one allocated before the variable was set keeps
    its old size. Releasing the workspaces makes the next matmul allocate them at the
    deterministic size. The usual order (``model.cuda()``, then ``deterministic=True``)
    allocates none, so it needs nothing and says nothing."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        log.warning(
            "nbresume: deterministic=True was asked for after CUDA started, and this PyTorch "
            "cannot release cuBLAS's workspaces: if a matmul already ran on the GPU, cuBLAS "
            "may not be deterministic; set it in the first cell (or CUBLAS_WORKSPACE_CONFIG=%s "
            "before Python starts)",
            CUBLAS_WORKSPACE_CONFIG,
        )
        return
    devices = range(torch.cuda.device_count())
    before = sum(torch.cuda.memory_allocated(d) for d in devices)
    torch.cuda.synchronize()  # a kernel still running may be using a workspace
    clear()
    released = before - sum(torch.cuda.memory_allocated(d) for d in devices)
    if released > 0:
        log.info(
            "nbresume: deterministic=True came after a CUDA matmul had run: cuBLAS's "
            "workspaces (%d bytes) were released, so that the next matmul uses the "
            "deterministic ones",
            released,
        )


def enabled() -> bool:
    """Whether this process runs PyTorch deterministically (torch not imported: no)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return bool(
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
        and torch.backends.cudnn.deterministic
        and not torch.backends.cudnn.benchmark
        and os.environ.get("CUBLAS_WORKSPACE_CONFIG") in _DETERMINISTIC_WORKSPACES
    )


def apply(deterministic: object, call: str) -> None:
    """The ``deterministic=`` keyword of ``init()`` and ``Checkpointer()``: ``True`` enables,
    ``False`` leaves PyTorch as it is."""
    if check_bool(call, "deterministic", deterministic) and not enabled():
        settings = enable()
        log.info("nbresume: deterministic: %s; cost: %s", "; ".join(settings), COST)


def describe(gpu: bool) -> tuple[Literal["ok", "warn", "fail"], str, str]:
    """``(status, seen, fix)`` for the preflight's determinism line."""
    if enabled():
        return (
            "ok",
            "deterministic: a resumed run repeats the uninterrupted one bit for bit on the same "
            "GPU model, driver and library versions",
            "",
        )
    if not gpu:
        return "ok", "CPU: a resumed run repeats the uninterrupted one bit for bit", ""
    return (
        "ok",
        f"not deterministic: {NOT_EXACT}",
        "for bit-exact continuation on the GPU: nbresume.init(..., deterministic=True) or "
        f"Checkpointer(..., deterministic=True) in the first cell; cost: {COST}",
    )
