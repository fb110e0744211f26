"""What every suite shares: the machine's description, fsync and page-cache eviction, peak
memory of a process, the training state being saved, and fresh child processes."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

MB = 1_000_000
CHUNK = 8 << 20
ROOT = Path(__file__).resolve().parent.parent


# -- the machine ----------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = ""
    with contextlib.suppress(OSError), open("/proc/meminfo") as handle:
        kb = int(handle.readline().split()[1])
        memory = f", {kb / 1024**2:.0f} GiB RAM"
    return f"{cpu}, {os.cpu_count()} cores{memory}, {platform.system()} {platform.release()}"


def file_system(path: Path) -> str:
    best, kind = "", "unknown"
    resolved = str(path.resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as handle:
        for line in handle:
            device, mount, fs_type = line.split()[:3]
            if resolved.startswith(mount) and len(mount) > len(best):
                best, kind = mount, f"{fs_type} on {device}"
    return kind


def load_average() -> str:
    with contextlib.suppress(OSError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    return "unknown"


# -- durability and the page cache ----------------------------------------------------------


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list: what makes a new name durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_below(folder: Path) -> list[Path]:
    """The files below ``folder`` (``folder`` itself if it is a file). os.walk passes over a
    folder that vanishes while it is listed (an old checkpoint being removed meanwhile)."""
    if not folder.is_dir():
        return [folder]
    return [
        Path(root, name)
        for root, _, names in os.walk(folder)
        for name in names
        if Path(root, name).is_file()
    ]


def evict(folder: Path) -> None:
    """Drop the cached pages of every file below ``folder`` (clean pages: flushed first)."""
    for path in files_below(folder):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # removed since it was listed
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def folder_bytes(folder: Path) -> int:
    total = 0
    for path in files_below(folder) if folder.exists() else []:
        with contextlib.suppress(FileNotFoundError):  # removed since it was listed
            total += path.stat().st_size
    return total


# -- peak memory ----------------------------------------------------------------------------


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


class PeakMemory:
    """How far this process's resident memory rose above where it was at ``start()``.

    The kernel's high-water mark (``VmHWM``) is reset to the current resident size through
    ``/proc/self/clear_refs``; ``tracemalloc`` and ``ru_maxrss`` cannot see what torch
    allocates after a baseline.
    """

    def start(self) -> None:
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.reset = True
        except OSError:
            self.reset = False
        self.baseline = _status_bytes("VmRSS") if self.reset else _status_bytes("VmHWM")

    def extra(self) -> int:
        return max(0, _status_bytes("VmHWM") - self.baseline)


# -- the state being saved ------------------------------------------------------------------


def state_layout(total_mb: float) -> tuple[int, int, int]:
    """(width, layers, tensor bytes) of the state :func:`build_state` makes."""
    width = 1024 if total_mb >= 30 else 256
    layer_bytes = (width * width + width) * 4 * 3  # weights + exp_avg + exp_avg_sq
    layers = max(1, round(total_mb * MB / layer_bytes))
    return width, layers, layers * layer_bytes


def build_state(total_mb: float, seed: int = 0, dropout: float = 0.0) -> tuple[Any, Any, int]:
    """A model of linear layers whose weights plus Adam state (``exp_avg``, ``exp_avg_sq``)
    come to about ``total_mb`` MB, after one optimizer step; returns (model, optimizer,
    the state's tensor bytes). With ``dropout``, training draws from torch's global RNG."""
    import torch

    torch.manual_seed(seed)
    width, layers, _ = state_layout(total_mb)
    parts: list[Any] = []
    for _ in range(layers):
        parts.append(torch.nn.Linear(width, width))
        if dropout:
            parts.append(torch.nn.Dropout(dropout))
    model = torch.nn.Sequential(*parts)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, state_bytes(model, optimizer)


def train_step(model: Any, optimizer: Any, step: int, batch: int = 8) -> None:
    """One step on synthetic data that depends only on ``step`` (a resumed run sees the
    same batches); dropout, if any, draws from the global RNG."""
    import torch

    width = next(model.parameters()).shape[1]
    generator = torch.Generator().manual_seed(10_000 + step)
    inputs = torch.randn(batch, width, generator=generator)
    optimizer.zero_grad(set_to_none=True)
    model(inputs).pow(2).mean().backward()
    optimizer.step()


def state_bytes(model: Any, optimizer: Any) -> int:
    import torch

    total = sum(t.nbytes for t in model.state_dict().values())
    for per_param in optimizer.state_dict()["state"].values():
        total += sum(v.nbytes for v in per_param.values() if isinstance(v, torch.Tensor))
    return total


def state_sha256(model: Any, optimizer: Any | None = None) -> str:
    """SHA-256 over the model's tensors (and the optimizer's), in a fixed order."""
    import torch

    digest = hashlib.sha256()

    def feed(tree: Any) -> None:
        if isinstance(tree, torch.Tensor):
            flat = tree.detach().cpu().contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        elif isinstance(tree, dict):
            for key in sorted(tree, key=str):
                digest.update(str(key).encode())
                feed(tree[key])
        elif isinstance(tree, list | tuple):
            for item in tree:
                feed(item)
        else:
            digest.update(repr(tree).encode())

    feed(model.state_dict())
    if optimizer is not None:
        feed(optimizer.state_dict()["state"])
    return digest.hexdigest()


# -- timing and children --------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    items = list(values)
    return statistics.median(items) if items else float("nan")


def timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


@contextlib.contextmanager
def timing(into: list[float]) -> Iterator[None]:
    """Append the seconds the ``with`` block took to ``into`` (nothing when it raised)."""
    start = time.perf_counter()
    yield
    into.append(time.perf_counter() - start)


def measured(measure: Callable[[], dict[str, Any]], scratch: Path, command: str) -> dict[str, Any]:
    """``measure()``'s result, run with its files below ``scratch``, and under ``"meta"`` the
    conditions it ran in: the command, the machine, the file system, the load before and
    after, the date (:func:`conditions` writes them as a line)."""
    meta = {
        "command": command,
        "machine": machine(),
        "file_system": file_system(scratch.parent if scratch.parent.exists() else Path(".")),
        "load_before": load_average(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    scratch.mkdir(parents=True, exist_ok=True)
    result = measure()
    meta["load_after"] = load_average()
    return {"meta": meta, **result}


def conditions(meta: dict[str, Any]) -> str:
    """The line of a results page that says how and where :func:`measured` ran."""
    return (
        f"Machine: {meta['machine']}; file system: {meta['file_system']}; load "
        f"{meta['load_before']} before, {meta['load_after']} after; {meta['date']}."
    )


def publish(page: str, results: Path) -> None:
    """Print a results page and write it to ``results``."""
    print(page)
    results.parent.mkdir(exist_ok=True)
    results.write_text(page)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def flat_optimizer(optimizer: Any) -> tuple[dict[str, Any], str]:
    """AdamW's state as flat tensors (``state.<i>.<key>``) and its param groups as JSON: what
    safetensors can hold."""
    saved = optimizer.state_dict()
    tensors = {f"state.{i}.{k}": v for i, s in saved["state"].items() for k, v in s.items()}
    return tensors, json.dumps(saved["param_groups"])


def unflat_optimizer(tensors: dict[str, Any], groups: str) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": json.loads(groups)}
