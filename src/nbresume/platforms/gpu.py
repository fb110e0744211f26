"""What accelerators this machine has, and whether the installed torch can use them.

GPUs are listed by ``nvidia-smi`` (started early, read late, one second at most: the query
Colab's own monitor runs). torch is consulted without importing it where possible: its
``version.py`` says which CUDA it was built for. It is imported only when a GPU is present,
torch is a CUDA build and it was not imported yet, because only torch knows which GPU
architectures its kernels were compiled for (a P100, sm_60, fails with "no kernel image is
available" on a build without sm_60).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from nbresume.platforms.nvidia_smi import (
    GpuQuery,
    GpuStatus,
    Verdict,
    communicate,
    health_verdict,
    memory_verdict,
)

NVIDIA_SMI_TIMEOUT_S = 1.0
_QUERY = ("name", "driver_version", "compute_cap")

#: Oldest Linux driver that runs each CUDA major version (CUDA minor version compatibility).
DRIVER_FOR_CUDA: tuple[tuple[int, tuple[int, ...]], ...] = (
    (13, (580, 65, 6)),
    (12, (525, 60, 13)),
    (11, (450, 80, 2)),
)

_TPU_VARIABLES = ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "COLAB_TPU_ADDR", "XRT_TPU_CONFIG")


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi lists it."""

    index: int
    name: str
    driver: str
    capability: tuple[int, int] | None

    @property
    def sm(self) -> str:
        """``"sm_75"`` for compute capability 7.5; ``"sm_?"`` when unknown."""
        return "sm_?" if self.capability is None else f"sm_{self.capability[0]}{self.capability[1]}"


@dataclass(frozen=True)
class TorchInfo:
    """The installed torch, as far as it could be learnt cheaply."""

    installed: bool
    version: str | None = None
    #: The CUDA version torch was built for; ``None`` for a CPU-only build.
    cuda: str | None = None
    #: The GPU architectures the build has kernels for (``None``: unknown, torch not imported).
    arch_list: tuple[str, ...] | None = None
    #: GPUs torch can use (``None``: unknown, torch not imported).
    device_count: int | None = None


class NvidiaSmi:
    """``nvidia-smi`` started at construction and read by :meth:`result`, so it runs while
    other checks do. It never takes more than :data:`NVIDIA_SMI_TIMEOUT_S` seconds."""

    def __init__(self, timeout: float = NVIDIA_SMI_TIMEOUT_S) -> None:
        self.timeout = timeout
        self.started = time.monotonic()
        self.binary = shutil.which("nvidia-smi")
        self._proc: subprocess.Popen[str] | None = None
        self._error = ""
        if self.binary is None:
            return
        try:
            self._proc = self._start(_QUERY)
        except OSError as exc:
            self._error = f"nvidia-smi could not start: {exc}"

    def _start(self, fields: tuple[str, ...]) -> subprocess.Popen[str]:
        assert self.binary is not None
        return subprocess.Popen(
            [self.binary, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def result(self) -> tuple[list[Gpu], str]:
        """The GPUs listed (all of them, before CUDA_VISIBLE_DEVICES) and how it went:
        ``"ok"``, ``"not found"``, or what went wrong."""
        if self.binary is None:
            return [], "not found"
        if self._proc is None:
            return [], self._error
        out, err, status = self._wait(self._proc)
        if status is None:
            return [], f"nvidia-smi gave no answer within {self.timeout:g} s"
        if status != 0 and "compute_cap" in (out + err):
            # Drivers older than about 510 do not know the field: ask again without it.
            out, err, status = self._wait(self._start(_QUERY[:2]))
        if status != 0:
            detail = (err or out).strip().splitlines()
            return [], f"nvidia-smi failed: {detail[0] if detail else f'exit status {status}'}"
        return parse_nvidia_smi(out), "ok"

    def _wait(self, proc: subprocess.Popen[str]) -> tuple[str, str, int | None]:
        answer = communicate(proc, max(0.05, self.timeout - (time.monotonic() - self.started)))
        if answer is None:
            return "", "", None
        out, err = answer
        return out, err, proc.returncode


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """GPUs from ``nvidia-smi --query-gpu=name,driver_version[,compute_cap]
    --format=csv,noheader`` output."""
    gpus: list[Gpu] = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2 or not parts[0]:
            continue
        capability = None
        if len(parts) >= 3:
            match = re.fullmatch(r"(\d+)\.(\d+)", parts[2])
            if match:
                capability = (int(match.group(1)), int(match.group(2)))
            parts = [", ".join(parts[:-2]), parts[-2], parts[-1]]
        gpus.append(Gpu(len(gpus), parts[0], parts[1], capability))
    return gpus


def visible(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs a CUDA program may use under ``CUDA_VISIBLE_DEVICES`` (``None``: unset).

    As CUDA does: an empty value hides every GPU, and the list ends at the first entry that
    names no device. Entries that are UUIDs are taken in order.
    """
    if cuda_visible_devices is None:
        return list(gpus)
    chosen: list[Gpu] = []
    for item in (x.strip() for x in cuda_visible_devices.split(",")):
        if not item:
            break
        if item.lstrip("-").isdigit():
            index = int(item)
            if index < 0 or index >= len(gpus) or gpus[index] in chosen:
                break
            chosen.append(gpus[index])
        elif len(chosen) < len(gpus):
            chosen.append(gpus[len(chosen)])
    return chosen


def device_nodes() -> bool:
    """Whether NVIDIA device files exist: a GPU is attached, visible to CUDA or not."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def tpu_seen() -> str:
    """A short description of the TPU this machine has, ``""`` when none is seen."""
    for variable in _TPU_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value:
            return f"TPU ({variable}={value})"
    if os.environ.get("ISTPUVM") == "1":
        return "TPU VM (ISTPUVM=1)"
    accel = sorted(glob.glob("/dev/accel[0-9]*"))
    if accel:
        return f"TPU ({len(accel)} device(s) at /dev/accel*)"
    return ""


def accelerator_attached() -> bool:
    """Whether this session has a GPU or TPU (platform caps depend on it). Looks only."""
    return device_nodes() or bool(tpu_seen())


def torch_info(*, import_for_gpu: bool) -> TorchInfo:
    """What the installed torch is built for.

    Imports torch only when ``import_for_gpu`` is true and the build is a CUDA build; otherwise
    reads ``torch/version.py`` (or uses torch as already imported).
    """
    module = sys.modules.get("torch")
    if module is None:
        try:
            spec = importlib.util.find_spec("torch")
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None:
            return TorchInfo(installed=False)
        version, cuda = read_version_file(Path(spec.origin).parent / "version.py")
        if not (import_for_gpu and cuda):
            return TorchInfo(installed=True, version=version, cuda=cuda)
        try:
            module = importlib.import_module("torch")
        except Exception as exc:  # a broken install must not break the report
            return TorchInfo(installed=True, version=f"{version} (import failed: {exc})", cuda=cuda)
    return _from_module(module)


def _from_module(module: ModuleType) -> TorchInfo:
    version = str(getattr(module, "__version__", "?"))
    cuda = getattr(getattr(module, "version", None), "cuda", None)
    if not cuda:
        return TorchInfo(installed=True, version=version, cuda=None, arch_list=(), device_count=0)
    try:
        count = int(module.cuda.device_count())
        arch = tuple(module.cuda.get_arch_list()) if count else None
    except Exception:  # a driver problem: torch's own error surfaces at first use
        count, arch = 0, None
    return TorchInfo(
        installed=True, version=version, cuda=str(cuda), arch_list=arch, device_count=count
    )


def read_version_file(path: Path) -> tuple[str | None, str | None]:
    """``(__version__, cuda)`` from torch's ``version.py`` without running it."""
    try:
        text = path.read_text()
    except OSError:
        return None, None
    version = re.search(r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    cuda = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return (version.group(1) if version else None), (cuda.group(1) if cuda else None)


def arch_supported(capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """Whether a build with kernels for ``arch_list`` runs on a GPU of ``capability``.

    A cubin for sm_XY runs on devices of the same major version and minor >= Y; PTX for
    compute_XY is compiled on the fly for any device of capability >= X.Y.
    """
    major, minor = capability
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        digits = re.match(r"\d+", number)
        if digits is None:
            continue
        arch_major, arch_minor = divmod(int(digits.group()), 10)
        if kind == "sm" and arch_major == major and arch_minor <= minor:
            return True
        if kind == "compute" and (arch_major, arch_minor) <= (major, minor):
            return True
    return False


def driver_cuda_major(driver: str) -> int | None:
    """The newest CUDA major version a driver runs (``"535.104.05"`` -> 12); ``None`` when the
    driver version cannot be read or is older than CUDA 11's."""
    numbers = tuple(int(x) for x in re.findall(r"\d+", driver))
    if not numbers:
        return None
    for major, oldest in DRIVER_FOR_CUDA:
        if numbers >= oldest:
            return major
    return None


def oldest_driver(cuda_major: int) -> str | None:
    """The oldest driver version that runs CUDA ``cuda_major`` (``12`` -> ``"525.60.13"``)."""
    for major, oldest in DRIVER_FOR_CUDA:
        if major == cuda_major:
            return ".".join(str(x) for x in oldest)
    return None


def own_gpu_memory(statuses: list[GpuStatus]) -> dict[int, int]:
    """MiB this process's torch holds on each GPU (by nvidia-smi's index), where torch is
    imported and CUDA started; nvidia-smi in a container does not list this process."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    by_uuid = {s.uuid.lower().removeprefix("gpu-"): s.index for s in statuses if s.uuid}
    held: dict[int, int] = {}
    for device in range(torch.cuda.device_count()):
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid).lower()
            reserved = int(torch.cuda.memory_reserved(device)) // 2**20
        except Exception:  # noqa: S112 - an old torch without uuid, a device in a bad state
            continue
        index = by_uuid.get(uuid.removeprefix("gpu-"))
        if index is not None:
            held[index] = reserved
    return held


def gpu_verdicts(result: GpuQuery, visible_gpus: list[Gpu]) -> list[tuple[str, Verdict]]:
    """The preflight's ``gpu memory`` and ``gpu health`` lines for the GPUs this process may
    use (all of them when the query could not match them up)."""
    if not result.gpus:
        seen = f"nvidia-smi -q -x: {result.status}" if result.status != "ok" else "no GPU listed"
        return [("gpu memory", Verdict("ok", f"not read ({seen})"))]
    indices = {g.index for g in visible_gpus}
    statuses = [s for s in result.gpus if s.index in indices] or result.gpus
    memory = memory_verdict(statuses, own_pid=os.getpid(), own_mib=own_gpu_memory(statuses))
    health = health_verdict(statuses, result.xids, result.xid_status)
    return [("gpu memory", memory), ("gpu health", health)]
