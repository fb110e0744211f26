"""``python -m benchmarks --gpu``: the training state on a GPU, side by side, in one call.

The state is a stack of ``Linear(4096, 4096)`` layers with AdamW after one step (weights,
``exp_avg``, ``exp_avg_sq``: about 2 GB), on ``cuda:0``. The tools: nbresume (blocking and
``async_save=True``), torch DCP (``save`` / ``async_save``, ``load``), safetensors
(``save_file`` / ``load_file(device="cuda")``), ``torch.save`` / ``torch.load`` and the raw
limit for the same bytes. Every figure is the median of ``reps`` repetitions, tools interleaved
within each repetition:

- **save until durable**: from the call until the checkpoint is on the disk (fsynced); raw
  limit: every tensor copied into one pinned host buffer (allocated before the clock), one
  write of it, fsync of the file and the folder. nbresume keeps two checkpoints: the older
  ones' removal runs in the background, outside the save's time;
- **async save**: the time training is blocked (the call) and until durable (``wait()`` /
  the future's ``result()``);
- **restore cold into a model on the GPU**: in a fresh process per restore, the checkpoint's
  pages dropped from the page cache first (``posix_fadvise(DONTNEED)``; a virtual machine's
  host may still cache the disk), from the call until the model and the optimizer hold the
  state on the GPU (``torch.cuda.synchronize()``); raw limit: the raw file read into a pinned
  buffer (allocated before the clock) and copied to the GPU;
- **loop overhead**: a GPU training loop of about 35 ms steps on a 1 GB state, with an
  asynchronous nbresume save every 40 steps, against the same loop without nbresume, in
  alternating segments of the same run; each segment ends with the GPU synchronized and the
  last save durable.

All of it runs within :data:`BUDGET_S` seconds: each part in a child process with a timeout,
and a part that no longer fits is reported as skipped. Without CUDA it is a dry run: it says
it found no GPU, measures nothing and exits 0. Results: ``benchmarks/results/gpu.md`` and
``gpu.json`` (or ``--out DIR``) and the GPU section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import (
    ROOT,
    evict,
    file_system,
    flat_optimizer,
    fsync_path,
    load_average,
    machine,
    unflat_optimizer,
)

#: The whole suite's wall-clock budget (the call must end within 8 minutes);
#: ``NBRESUME_GPU_BENCH_BUDGET_S`` sets a shorter one where the GPU is lent for less.
BUDGET_S = float(os.environ.get("NBRESUME_GPU_BENCH_BUDGET_S", "450"))
SETTINGS: dict[str, Any] = {
    "width": 4096,
    "layers": 10,  # 10 x 201 MB: about 2 GB of weights and AdamW state
    "loop_layers": 5,  # about 1 GB
    "reps": int(os.environ.get("NBRESUME_GPU_BENCH_REPS", "3")),
    "step_ms": 35.0,
    "every": 40,
    "segment_steps": 160,
    "pairs": 3,
}
SAVES = ("raw limit", "nbresume", "DCP", "safetensors", "torch.save")
ASYNC = ("nbresume async", "DCP async")
#: "nbresume" reads the tensor files straight onto the GPU through pinned buffers (the
#: default); "nbresume, via host": NBRESUME_GPU_DIRECT_READ=0, through host memory.
RESTORES = ("raw limit", "nbresume", "nbresume, via host", "DCP", "safetensors", "torch.load")
#: Tools left out (``NBRESUME_GPU_BENCH_SKIP=DCP,torch.save``: a shorter run where the GPU is
#: lent for less); a restore is left out with the save it reads.
SKIP = {t.strip() for t in os.environ.get("NBRESUME_GPU_BENCH_SKIP", "").split(",") if t.strip()}
#: ``NBRESUME_GPU_BENCH_PROFILE=1``: the first restore of each nbresume variant also runs under
#: cProfile, and its top functions are kept in the results (where the time goes).
PROFILE = os.environ.get("NBRESUME_GPU_BENCH_PROFILE", "") == "1"
BEGIN = "<!-- gpu:begin (written by python -m benchmarks --gpu; edit around it) -->"
END = "<!-- gpu:end -->"
PAGES = ("gpu.md", "gpu.json")
#: Where the state lives: ``cuda``, or ``cpu`` (``NBRESUME_GPU_BENCH_DEVICE=cpu``) to run every
#: part's logic on a machine without a GPU before a GPU is at hand (its figures mean nothing).
DEVICE = os.environ.get("NBRESUME_GPU_BENCH_DEVICE", "cuda")


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for on the CPU stand-in)."""
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


# -- the state on the GPU --------------------------------------------------------------------


def build(layers: int, width: int, seed: int = 0, *, stepped: bool = True) -> tuple[Any, Any]:
    """The model on ``cuda:0`` and its AdamW, after one step when ``stepped``."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    model = model.to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if stepped:
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    return model, optimizer


def state_bytes(model: Any, optimizer: Any) -> int:
    total = sum(t.nbytes for t in model.state_dict().values())
    for state in optimizer.state.values():
        total += sum(v.nbytes for v in state.values() if hasattr(v, "nbytes"))
    return int(total)


def durable(folder: Path) -> None:
    """fsync every file below ``folder`` and the folder itself."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fsync_path(path)
    fsync_path(folder)


# -- the tools -------------------------------------------------------------------------------


class Saves:
    """Every tool's save of one state, each into a folder of its own below ``root``."""

    def __init__(self, root: Path, model: Any, optimizer: Any) -> None:
        import torch

        import nbresume

        self.root, self.model, self.optimizer = root, model, optimizer
        tensors = list(model.state_dict().values()) + [
            v for s in optimizer.state.values() for v in s.values() if v.dim()
        ]
        self.tensors = [t.reshape(-1).view(torch.uint8) for t in tensors]
        self.pinned = torch.empty(sum(t.numel() for t in self.tensors), dtype=torch.uint8,
                                  pin_memory=DEVICE == "cuda")  # fmt: skip
        self.checkpointers = {
            name: nbresume.Checkpointer(
                root / name.replace(" ", "-"),
                every=None,
                deadline=None,
                keep=2,
                async_save=name.endswith("async"),
                model=model,
                optimizer=optimizer,
            )
            for name in ("nbresume", "nbresume async")
        }
        self.future: Any = None

    def folder(self, tool: str, step: int) -> Path:
        path = self.root / tool.replace(" ", "-") / f"step-{step}"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def save(self, tool: str, step: int) -> None:
        """Until the checkpoint is durable (an asynchronous tool: until the call returns)."""
        import torch

        if tool in self.checkpointers:
            self.checkpointers[tool].save(step)
        elif tool == "raw limit":
            start = 0
            for tensor in self.tensors:
                self.pinned[start : start + tensor.numel()].copy_(tensor, non_blocking=True)
                start += tensor.numel()
            sync()
            folder = self.folder(tool, step)
            folder.mkdir()
            with open(folder / "state.bin", "wb") as handle:
                handle.write(memoryview(self.pinned.numpy()))
                handle.flush()
                os.fsync(handle.fileno())
            fsync_path(folder)
        elif tool in ("DCP", "DCP async"):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            folder = self.folder(tool, step)
            if tool == "DCP":
                dcp.save(state, checkpoint_id=str(folder), no_dist=True)
            else:
                self.wait(tool)
                self.future = dcp.async_save(state, checkpoint_id=str(folder), no_dist=True)
        elif tool == "safetensors":
            import safetensors.torch

            folder = self.folder(tool, step)
            folder.mkdir()
            tensors, groups = flat_optimizer(self.optimizer)
            safetensors.torch.save_file(self.model.state_dict(), folder / "model.safetensors")
            safetensors.torch.save_file(tensors, folder / "optimizer.safetensors",
                                        metadata={"param_groups": groups})  # fmt: skip
            durable(folder)
        elif tool == "torch.save":
            folder = self.folder(tool, step)
            folder.mkdir()
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save(state, folder / "checkpoint.pt")
            durable(folder)
        else:
            raise ValueError(f"unknown tool {tool!r}")

    def wait(self, tool: str) -> None:
        """Until an asynchronous tool's last save is durable."""
        if tool == "nbresume async":
            self.checkpointers[tool].wait()
        elif tool == "DCP async" and self.future is not None:
            self.future.result()
            self.future = None

    def clear(self, tool: str, step: int) -> None:
        """Remove an earlier save of a tool without a retention of its own (outside the
        clock), so that the disk holds what a run keeps."""
        if tool not in self.checkpointers:
            shutil.rmtree(self.folder(tool, step), ignore_errors=True)

    def close(self) -> None:
        for checkpointer in self.checkpointers.values():
            checkpointer.close()


def restore(tool: str, folder: Path, model: Any, optimizer: Any) -> None:
    """``tool``'s restore of ``folder`` into the model and optimizer on the GPU."""
    import torch

    if tool in ("nbresume", "nbresume, via host"):
        import nbresume

        os.environ["NBRESUME_GPU_DIRECT_READ"] = "0" if tool == "nbresume, via host" else "1"
        with nbresume.Checkpointer(folder, every=None, deadline=None, model=model,
                                   optimizer=optimizer) as checkpointer:  # fmt: skip
            if checkpointer.restore() == 0:
                raise RuntimeError(f"nbresume found no checkpoint in {folder}")
    elif tool == "raw limit":
        path = next(folder.rglob("state.bin"))
        size = path.stat().st_size
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
        target = torch.empty(size, dtype=torch.uint8, device=DEVICE)
        started = time.perf_counter()
        with open(path, "rb", buffering=0) as handle:
            view = memoryview(pinned.numpy())
            done = 0
            while count := handle.readinto(view[done:]):
                done += count
        target.copy_(pinned, non_blocking=True)
        sync()
        raise _Timed(time.perf_counter() - started)  # the buffers are not the limit's cost
    elif tool == "DCP":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(newest(folder)), no_dist=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])  # fmt: skip
    elif tool == "safetensors":
        import safetensors
        import safetensors.torch

        where = newest(folder)
        model.load_state_dict(safetensors.torch.load_file(where / "model.safetensors",
                                                          device=DEVICE))  # fmt: skip
        with safetensors.safe_open(where / "optimizer.safetensors", framework="pt") as handle:
            groups = (handle.metadata() or {})["param_groups"]
        tensors = safetensors.torch.load_file(where / "optimizer.safetensors", device=DEVICE)
        # AdamW keeps its step count on the host unless capturable: put it back there.
        tensors = {k: v.cpu() if k.endswith(".step") else v for k, v in tensors.items()}
        optimizer.load_state_dict(unflat_optimizer(tensors, groups))
    elif tool == "torch.load":
        saved = torch.load(newest(folder) / "checkpoint.pt", map_location=DEVICE,
                           weights_only=True)  # fmt: skip
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    else:
        raise ValueError(f"unknown tool {tool!r}")
    sync()


class _Timed(Exception):
    """A restore that timed itself (the raw limit: its buffers are allocated off the clock)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds


def newest(folder: Path) -> Path:
    return max(folder.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


# -- the parts, each in a child process --------------------------------------------------------


def active(tools: tuple[str, ...]) -> tuple[str, ...]:
    """``tools`` less those left out (:data:`SKIP`), with the saves they read."""
    reads = {"torch.load": "torch.save", "nbresume, via host": "nbresume"}
    return tuple(t for t in tools if t not in SKIP and reads.get(t) not in SKIP)


def child_saves(args: dict[str, Any]) -> dict[str, Any]:
    """Every tool's save (and the asynchronous ones' blocked and durable times), tools
    interleaved in each repetition; the last save of each tool is left for the restores."""
    model, optimizer = build(args["layers"], args["width"])
    root = Path(args["folder"])
    saves = Saves(root, model, optimizer)
    times: dict[str, list[float]] = {tool: [] for tool in active(SAVES)}
    blocked: dict[str, list[float]] = {tool: [] for tool in active(ASYNC)}
    done: dict[str, list[float]] = {tool: [] for tool in active(ASYNC)}
    try:
        for rep in range(args["reps"]):
            step = rep + 1
            for tool in active(SAVES):
                saves.clear(tool, step - 1)
                started = time.perf_counter()
                saves.save(tool, step)
                times[tool].append(time.perf_counter() - started)
            for tool in active(ASYNC):
                started = time.perf_counter()
                saves.save(tool, step)
                blocked[tool].append(time.perf_counter() - started)
                saves.wait(tool)
                done[tool].append(time.perf_counter() - started)
                saves.clear(tool, step - 1)
    finally:
        saves.close()
    return {"state_bytes": state_bytes(model, optimizer), "save": times, "async_blocked": blocked,
            "async_durable": done}  # fmt: skip


def preload(tool: str) -> None:
    """Import what ``tool``'s restore uses before the clock starts: a run resumes in a process
    that has imported its checkpoint library already (its first cell, its script's top)."""
    if tool.startswith("nbresume"):
        import nbresume  # noqa: F401
    elif tool == "DCP":
        import torch.distributed.checkpoint
        import torch.distributed.checkpoint.state_dict  # noqa: F401
    elif tool == "safetensors":
        import safetensors.torch  # noqa: F401


def child_restore(args: dict[str, Any]) -> dict[str, Any]:
    """One restore, cold, in this fresh process; checked against the saved weights."""
    import torch

    model, optimizer = build(args["layers"], args["width"], seed=1, stepped=False)
    folder = Path(args["folder"])
    preload(args["tool"])
    evict(folder)
    profiler = None
    if args.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    started = time.perf_counter()
    try:
        restore(args["tool"], folder, model, optimizer)
        seconds = time.perf_counter() - started
    except _Timed as timed:
        return {"seconds": timed.seconds}
    profile = ""
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
        profile = text.getvalue()
    expected, _ = build(args["layers"], args["width"])
    for key, value in expected.state_dict().items():
        if not torch.equal(model.state_dict()[key], value):
            return {"error": f"{args['tool']}: {key} differs after the restore"}
    if not optimizer.state:
        return {"error": f"{args['tool']}: the optimizer has no state after the restore"}
    return {"seconds": seconds, "profile": profile} if profile else {"seconds": seconds}


def child_loop(args: dict[str, Any]) -> dict[str, Any]:
    """The loop overhead: segments of ``segment_steps`` steps without and with nbresume's
    asynchronous save every ``every`` steps, alternating, ``pairs`` of each."""
    import torch

    import nbresume

    model, optimizer = build(args["loop_layers"], args["width"])
    batch = 512

    def step(inputs: Any) -> None:
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def steps_time(count: int, inputs: Any) -> float:
        sync()
        started = time.perf_counter()
        for _ in range(count):
            step(inputs)
        sync()
        return (time.perf_counter() - started) / count

    inputs = torch.randn(batch, args["width"], device=DEVICE)
    steps_time(3, inputs)  # warm-up: kernels chosen, memory allocated
    for _ in range(3):  # a batch that makes a step of about step_ms
        seconds = steps_time(5, inputs)
        batch = max(8, min(65536, round(batch * args["step_ms"] / 1000 / seconds)))
        inputs = torch.randn(batch, args["width"], device=DEVICE)
    step_s = steps_time(5, inputs)
    checkpointer = nbresume.Checkpointer(Path(args["folder"]), every=None, deadline=None,
                                         keep=2, async_save=True, model=model,
                                         optimizer=optimizer)  # fmt: skip
    plain: list[float] = []
    saving: list[float] = []
    spill: list[float] = []
    count = 0
    every = args["every"]
    try:
        for pair in range(args["pairs"]):
            for with_saves in (pair % 2 == 0, pair % 2 == 1):
                sync()
                started = time.perf_counter()
                for index in range(args["segment_steps"]):
                    step(inputs)
                    count += 1
                    # Saves in the middle of each interval of ``every`` steps: the segment
                    # holds as many as a long run does, and its last one has half an
                    # interval to finish before the segment ends.
                    if with_saves and index % every == every // 2 - 1:
                        checkpointer.save(count)
                sync()
                (saving if with_saves else plain).append(time.perf_counter() - started)
                if with_saves:  # outside the clock: what the last save had left to do
                    waited = time.perf_counter()
                    checkpointer.wait()
                    spill.append(time.perf_counter() - waited)
    finally:
        checkpointer.close()
    overhead = statistics.median(saving) / statistics.median(plain) - 1
    return {"batch": batch, "step_s": step_s, "state_bytes": state_bytes(model, optimizer),
            "plain_s": plain, "with_s": saving, "spill_s": spill,
            "overhead": overhead}  # fmt: skip


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "saves": child_saves,
    "restore": child_restore,
    "loop": child_loop,
}


def call(kind: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``kind`` in a fresh Python process, its answer the last line of its output."""
    command = [sys.executable, "-m", "benchmarks.gpu", "--child", kind, json.dumps(args)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, check=False,
                              timeout=max(1, timeout), cwd=ROOT)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"{kind}: no answer within {timeout:.0f} s (stopped)"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"{kind}: exit status {proc.returncode}: {tail[:300]}"}
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer


# -- the run ---------------------------------------------------------------------------------


def gpu_name() -> str:
    import torch

    if DEVICE != "cuda":
        return f"none: the CPU stands in (NBRESUME_GPU_BENCH_DEVICE={DEVICE})"
    props = torch.cuda.get_device_properties(0)
    return (f"{props.name}, {props.total_memory / 1024**3:.0f} GiB, CUDA {torch.version.cuda}, "
            f"torch {torch.__version__}")  # fmt: skip


def with_settings(command: str) -> str:
    """The command as run: the ``NBRESUME_GPU_BENCH_*`` settings it ran under go first."""
    given = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("NBRESUME_GPU_BENCH_"))
    return " ".join([*given, command])


def run(scratch: Path, command: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Every part within :data:`BUDGET_S`; the raw numbers."""
    started = time.monotonic()

    def left() -> float:
        return BUDGET_S - (time.monotonic() - started)

    meta = {"command": with_settings(command), "machine": machine(), "gpu": gpu_name(),
            "file_system": file_system(scratch), "load_before": load_average(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}  # fmt: skip
    results: dict[str, Any] = {"meta": meta, "settings": SETTINGS, "parts": {}}
    folder = scratch / "saves"
    log(f"gpu: saves of a {SETTINGS['layers']}-layer state, {SETTINGS['reps']} repetitions")
    results["parts"]["saves"] = call("saves", {**SETTINGS, "folder": str(folder)},
                                     timeout=min(200, left() - 120))  # fmt: skip
    restores: dict[str, list[float]] = {tool: [] for tool in active(RESTORES)}
    errors: dict[str, str] = {}
    profiles: dict[str, str] = {}
    if "error" not in results["parts"]["saves"]:
        for rep in range(SETTINGS["reps"]):
            for tool in active(RESTORES):
                if tool in errors or left() < 90:
                    continue
                log(f"gpu: restore {rep + 1} of {SETTINGS['reps']}: {tool}")
                saved_by = {"torch.load": "torch.save", "nbresume, via host": "nbresume"}
                where = folder / saved_by.get(tool, tool).replace(" ", "-")
                profile = PROFILE and rep == 0 and tool.startswith("nbresume")
                answer = call("restore", {**SETTINGS, "tool": tool, "folder": str(where),
                                          "profile": profile},
                              timeout=min(90, left() - 70))  # fmt: skip
                if "error" in answer:
                    errors[tool] = answer["error"]
                elif "profile" in answer:
                    profiles[tool] = answer["profile"]  # its time is the profiler's too
                else:
                    restores[tool].append(answer["seconds"])
    results["parts"]["restore"] = {"seconds": restores, "errors": errors, "profiles": profiles}
    shutil.rmtree(folder, ignore_errors=True)
    if left() > 40:
        log("gpu: loop overhead, asynchronous saves every 40 steps")
        results["parts"]["loop"] = call("loop", {**SETTINGS, "folder": str(scratch / "loop")},
                                        timeout=left() - 5)  # fmt: skip
    else:
        results["parts"]["loop"] = {"error": "skipped: out of time"}
    meta["load_after"] = load_average()
    meta["duration_s"] = time.monotonic() - started
    return results


def _profiled_seconds(text: str) -> float | None:
    """The total time of a cProfile report (``... function calls in 1.258 seconds``)."""
    import re

    found = re.search(r"in ([0-9.]+) seconds", text)
    return float(found.group(1)) if found else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} s"


def _x(value: float | None, limit: float | None) -> str:
    return "—" if value is None or not limit else f"{value / limit:.2f}x"


def render(results: dict[str, Any]) -> list[str]:
    """The GPU page's lines (also the docs' GPU section)."""
    meta, parts = results["meta"], results["parts"]
    saves = parts["saves"]
    lines = [
        f"Run: `{meta['command']}`, {meta['date']}, {meta['duration_s']:.0f} s; GPU: "
        f"{meta['gpu']}; machine: {meta['machine']}; scratch on {meta['file_system']}; load "
        f"average before: {meta['load_before']}, after: {meta['load_after']}.",
        "",
    ]
    if "error" in saves:
        lines += [f"Saves: {saves['error']}", ""]
    else:
        size = saves["state_bytes"] / 1e9
        save = {tool: _median(v) for tool, v in saves["save"].items()}
        limit = save["raw limit"]
        lines += [
            f"### Save until durable, state of {size:.2f} GB on the GPU",
            "",
            "| tool | until durable | / raw limit |",
            "|---|---:|---:|",
            *(f"| {tool} | {_s(save[tool])} | {_x(save[tool], limit)} |" for tool in save),
            "",
            "| asynchronous | blocked | / raw limit | until durable | / raw limit |",
            "|---|---:|---:|---:|---:|",
        ]
        for tool in saves["async_blocked"]:
            block, done = (
                _median(saves["async_blocked"][tool]),
                _median(saves["async_durable"][tool]),
            )
            each = ", ".join(f"{v:.3f}" for v in saves["async_blocked"][tool])
            lines.append(f"| {tool} | {_s(block)} (each: {each}) | {_x(block, limit)} | "
                         f"{_s(done)} | {_x(done, limit)} |")  # fmt: skip
        lines.append("")
        lines.append(
            "Medians of the repetitions. The first asynchronous save of a run also allocates "
            "its pinned host buffers (each repetition's blocked time is listed)."
        )
        lines.append("")
    restore = parts.get("restore", {})
    seconds = {tool: _median(v) for tool, v in restore.get("seconds", {}).items()}
    profiled = {t: _profiled_seconds(text) for t, text in restore.get("profiles", {}).items()}
    for tool, value in profiled.items():
        if seconds.get(tool) is None and value is not None:
            seconds[tool] = value  # its only run was profiled: said under the table
    if seconds:
        limit = seconds.get("raw limit")
        loaders = [seconds[t] for t in ("safetensors", "torch.load", "DCP") if seconds.get(t)]
        fastest = min(loaders) if loaders else None
        lines += [
            "### Restore cold into a model on the GPU (a fresh process each)",
            "",
            "| tool | restore | / raw limit | / fastest other loader |",
            "|---|---:|---:|---:|",
        ]
        for tool in restore["seconds"]:
            value = seconds.get(tool)
            cell = restore["errors"].get(tool, "")[:120] if value is None else ""
            mark = " †" if value is not None and not restore["seconds"].get(tool) else ""
            cell = cell or ("not run: no save to restore" if "error" in saves
                            else "not run: the time budget was spent")  # fmt: skip
            lines.append(f"| {tool} | {_s(value) + mark if value else cell} | "
                         f"{_x(value, limit)} | {_x(value, fastest)} |")  # fmt: skip
        runs = {len(v) for v in restore.get("seconds", {}).values() if v}
        lines.append("")
        lines.append(f"Runs per tool: {'/'.join(map(str, sorted(runs))) or 0} (medians). " + (
            "† Its only run was under cProfile (`NBRESUME_GPU_BENCH_PROFILE=1`): the "
            "profiler's own cost is included." if "†" in "".join(lines[-12:]) else ""))  # fmt: skip
        lines.append("")
    loop = parts.get("loop", {})
    if "error" in loop:
        lines += [f"Loop overhead: {loop['error']}", ""]
    elif loop:
        lines += [
            "### Loop overhead",
            "",
            f"A {loop['state_bytes'] / 1e9:.2f} GB state, batch {loop['batch']}, steps of "
            f"{loop['step_s'] * 1000:.0f} ms; an asynchronous save every "
            f"{SETTINGS['every']} steps: segments of {SETTINGS['segment_steps']} steps "
            f"without nbresume took {_s(_median(loop['plain_s']))}, with it "
            f"{_s(_median(loop['with_s']))} (medians of {len(loop['plain_s'])}): "
            f"**{loop['overhead'] * 100:.1f} %** overhead. The saves fall in the middle of "
            f"each interval; after a segment, the last save still had "
            f"{_s(_median(loop.get('spill_s') or [0.0]))} of work left (not timed).",
            "",
        ]
    return lines


def publish(results: dict[str, Any], out: Path, docs: Path | None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    page = out / "gpu.md"
    body = render(results)
    page.write_text("\n".join(["# The training state on a GPU", "", *body]) + "\n")
    raw = out / "gpu.json"
    raw.write_text(json.dumps(results, indent=1, default=str) + "\n")
    written = [page, raw]
    if docs is not None:
        text = docs.read_text()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            docs.write_text(head + "\n".join([BEGIN, "", *body, END]) + rest.split(END, 1)[1])
            written.append(docs)
    return written


def main(out: Path | None, scratch_dir: Path | None, command: str) -> int:
    """The GPU suite; a dry run (nothing measured, exit 0) where torch sees no CUDA GPU."""
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(f"{command}: no CUDA GPU found (torch {torch.__version__}: "
              "torch.cuda.is_available() is False). Dry run: nothing measured, nothing written. "
              "On a machine with a GPU this measures: " + ", ".join(
                  ["save until durable (" + ", ".join(SAVES) + ")",
                   "async save blocked and until durable (" + ", ".join(ASYNC) + ")",
                   "restore cold into a model on the GPU (" + ", ".join(RESTORES) + ")",
                   "the loop overhead of async saves every 40 steps"]) + ".")  # fmt: skip
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="nbresume-gpu-", dir=scratch_dir))
    try:
        results = run(scratch, command, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if out is None:
        written = publish(results, ROOT / "benchmarks" / "results", ROOT / "docs" / "benchmarks.md")
    else:
        written = publish(results, out, None)
    print("\n".join(render(results)))
    print(f"{command}: {time.monotonic() - started:.0f} s; " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))), flush=True)
        sys.exit(0)
    sys.exit(main(None, None, "python benchmarks/gpu.py"))
