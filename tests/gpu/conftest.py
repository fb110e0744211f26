"""CUDA tests: run with ``pytest -m gpu`` on a machine with an NVIDIA GPU (DEVELOPERS.md).

Every test here is marked ``gpu`` and skipped, with the reason, where torch sees no CUDA
device (or fewer devices than a test needs).

The resume tests (``test_resume_*.py``) train on :data:`DEVICE`: ``cuda``, or the CPU with
``NBRESUME_GPU_TESTS_DEVICE=cpu``, which runs the same tests on a machine without a GPU
(skipping only what needs CUDA itself) so that their logic is debugged before a GPU is at
hand. Each check prints one ``GPU-CHECK name: verdict detail`` line; the lines are repeated
at the end of the run and, with ``NBRESUME_GPU_REPORT=FILE``, written to that file.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

#: Where the resume tests train: "cuda" (the default) or "cpu" (a dry run of their logic).
DEVICE = os.environ.get("NBRESUME_GPU_TESTS_DEVICE", "cuda")
if DEVICE not in {"cuda", "cpu"}:
    raise pytest.UsageError(f"NBRESUME_GPU_TESTS_DEVICE={DEVICE!r}: use 'cuda' or 'cpu'")

requires_device = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False); "
    "NBRESUME_GPU_TESTS_DEVICE=cpu runs these tests' logic on the CPU",
)

_LINES = pytest.StashKey[list[str]]()


def _report_file() -> Path | None:
    name = os.environ.get("NBRESUME_GPU_REPORT")
    return Path(name) if name else None


def machine() -> str:
    """The device, driver and versions the checks ran with, in one line."""
    parts = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    if DEVICE == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        parts[:0] = [f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"]
        parts.append(f"CUDA {torch.version.cuda}")
        parts.append(f"cuDNN {torch.backends.cudnn.version()}")  # type: ignore[no-untyped-call]
    else:
        parts[:0] = [f"CPU ({platform.machine()}, {os.cpu_count()} cores)"]
    return ", ".join(parts)


@pytest.fixture
def gpu_check(request: pytest.FixtureRequest) -> Callable[[str, bool, str], None]:
    """``gpu_check(name, ok, detail)``: prints the check's line (``bit-identical`` or
    ``DIFFERS``, then the detail) and keeps it for the summary and the report file."""

    def check(name: str, ok: bool, detail: str = "") -> None:
        verdict = "bit-identical" if ok else "DIFFERS"
        line = f"GPU-CHECK {name} [{DEVICE}]: {verdict}" + (f" ({detail})" if detail else "")
        print(line, flush=True)
        lines = request.config.stash.setdefault(_LINES, [])
        report = _report_file()
        if report is not None:
            # Written at once: a run cut short still leaves the lines it reached.
            with report.open("a" if lines else "w") as handle:
                if not lines:
                    stamp = time.strftime("%Y-%m-%d %H:%M")
                    handle.write(f"# nbresume GPU checks, {stamp}: {machine()}\n")
                handle.write(line + "\n")
        lines.append(line)

    return check


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = terminalreporter.config.stash.get(_LINES, [])
    if not lines:
        return
    terminalreporter.section("GPU checks")
    terminalreporter.write_line(machine())
    for line in lines:
        terminalreporter.write_line(line)
    report = _report_file()
    if report is not None:
        terminalreporter.write_line(f"(also in {report})")
