"""Suite 2, throughput in a real loop.

**The reference loop**: an MLP of ``depth`` hidden layers of ``width`` units (ReLU) and a
10-way output, trained with Adam and cross-entropy on synthetic batches of ``batch`` samples
drawn from a generator (no data loading), on the CPU with ``threads`` torch threads (one:
the other core is left to a background save, as a GPU training loop leaves the CPU mostly
free; on a shared machine more threads also make step times erratic). With width 1024 and
depth 4 the model has 4.2 M parameters (16.8 MB) and its state with Adam's two moments is
50 MB.

For each tool, in one fresh process, runs of ``segments x every`` steps are timed, alternately
without checkpointing and with a save after every ``every`` steps but the last segment; each
run ends with ``wait()``, so that a background write that has not finished is paid for. The
extra time per save is (checkpointing run - plain run) / saves, median over the repetitions.
From it:

- overhead at a save every N steps = extra per save / (N x step time);
- the smallest N that keeps the overhead under 1 % = extra per save / (1 % x step time).

An asynchronous save pays for its copy and for the background write competing with training
for the same cores (two on the machine of the committed results).
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any

from benchmarks._common import median, state_bytes
from benchmarks.tools import BY_NAME, Tool
from benchmarks.zygote import Zygote


def build_reference(width: int, depth: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def child(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args["threads"])
    tool = BY_NAME[args["tool"]]
    tool.import_library()
    folder = Path(args["folder"])
    shutil.rmtree(folder, ignore_errors=True)
    width, every, segments = args["width"], args["every"], args["segments"]
    model, optimizer = build_reference(width, args["depth"])
    loss_fn = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(1)

    def step() -> None:
        inputs = torch.randn(args["batch"], width, generator=generator)
        labels = torch.randint(0, 10, (args["batch"],), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), labels).backward()
        optimizer.step()

    for _ in range(args["warmup"]):
        step()
    session = tool.open(folder, model, optimizer)
    session.save(0)  # a first save outside the clock: buffers, folders, lazy imports
    session.wait()
    steps = every * segments
    plain, checkpointing = [], []
    counter = 0
    for _ in range(args["reps"]):
        for saving in (False, True):
            start = time.perf_counter()
            for index in range(1, steps + 1):
                step()
                counter += 1
                if saving and index % every == 0 and index < steps:
                    session.save(counter)
            session.wait()
            (checkpointing if saving else plain).append(time.perf_counter() - start)
    session.close()
    shutil.rmtree(folder, ignore_errors=True)
    saves = segments - 1
    extra = median((c - p) / saves for c, p in zip(checkpointing, plain, strict=True))
    return {
        "state_bytes": state_bytes(model, optimizer),
        "step_s": median(plain) / steps,
        "extra_per_save_s": extra,
        "plain_runs_s": plain,
        # the resolution: how much two runs without any save differ, per save
        "noise_per_save_s": (max(plain) - min(plain)) / saves,
        "checkpointing_runs_s": checkpointing,
        "steps_per_run": steps,
        "saves_per_run": saves,
    }


def overhead(extra_s: float, step_s: float, every: int) -> float:
    """The share of training time that saving every ``every`` steps adds."""
    return max(0.0, extra_s) / (every * step_s)


def smallest_every(extra_s: float, step_s: float, target: float = 0.01) -> int:
    return max(1, math.ceil(max(0.0, extra_s) / (target * step_s)))


def run(zygote: Zygote, tools: list[Tool], settings: dict[str, Any], scratch: Path,
        log: Any) -> dict[str, Any]:  # fmt: skip
    results: dict[str, Any] = {}
    for tool in tools:
        missing = tool.missing()
        if missing:
            results[tool.name] = {"error": missing}
            continue
        log(f"loop: {tool.name}")
        folder = scratch / "loop"
        result = zygote.call("loop", {**settings, "tool": tool.name, "folder": str(folder)})
        shutil.rmtree(folder, ignore_errors=True)
        if "error" not in result:
            result["overhead_at_200"] = overhead(result["extra_per_save_s"], result["step_s"], 200)
            result["smallest_every_under_1pct"] = smallest_every(
                result["extra_per_save_s"], result["step_s"]
            )
        results[tool.name] = result
    return {"settings": settings, "tools": results}
