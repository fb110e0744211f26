"""Suite 2, throughput in a real loop: the extra time a save adds, with its uncertainty.

**The reference loop**: an MLP of ``depth`` hidden layers of ``width`` units (ReLU) and a
10-way output, trained with Adam and cross-entropy on synthetic batches of ``batch`` samples
drawn from a generator (no data loading), on the CPU with ``threads`` torch threads (one:
the other core is left to a background save, as a GPU training loop leaves the CPU mostly
free; on a shared machine more threads also make step times erratic). With width 1024 and
depth 4 the model has 4.2 M parameters (16.8 MB) and its state with Adam's two moments is
50 MB.

For each tool, in one fresh process, ``pairs`` pairs of *segments* of ``every`` steps are
timed. A pair is one plain segment and one saving segment, next to each other, in
alternating order (plain first, then saving first: a drift of the machine's speed cancels
out). A saving segment starts with a save, so that an asynchronous write overlaps its steps,
and both kinds end with ``wait()``: a background write that has not finished is paid for.
The extra time of one save is the difference within a pair; the suite reports the median of
the pairs' differences and a distribution-free confidence interval of that median (order
statistics of the differences, the sign test's interval: at least 95 % from 6 pairs on).
From it, for a save every N steps (N at least ``every``):

- overhead at N = extra per save / (N x step time), with the interval's bounds likewise;
- the smallest N whose overhead is under 1 % even at the interval's upper bound;
- the resolution: the interval's half-width as a share of N steps. An overhead smaller than
  that cannot be told from zero on this machine in this run.

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

#: The interval the summary reports the overhead at (a save every 200 steps).
REFERENCE_EVERY = 200


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
    width, every = args["width"], args["every"]
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
    counter = 0

    def segment(saving: bool) -> float:
        nonlocal counter
        start = time.perf_counter()
        if saving:
            session.save(counter)
        for _ in range(every):
            step()
            counter += 1
        session.wait()
        return time.perf_counter() - start

    plain, saving = [], []
    for index in range(args["pairs"]):
        order = (False, True) if index % 2 == 0 else (True, False)
        times = {kind: segment(kind) for kind in order}
        plain.append(times[False])
        saving.append(times[True])
    session.close()
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "state_bytes": state_bytes(model, optimizer),
        "step_s": median(plain) / every,
        "plain_segments_s": plain,
        "saving_segments_s": saving,
        "steps_per_segment": every,
    }


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(low, high, achieved confidence) of a distribution-free interval of the median.

    The interval between the k-th smallest and the k-th largest value covers the median with
    probability 1 - 2 P(Binomial(n, 1/2) < k); k is the largest with at least ``confidence``,
    or 1 (the whole range) when even that falls short (fewer than 6 values for 95 %).
    """
    ordered = sorted(values)
    n = len(ordered)

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / float(2**n)

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def overhead(extra_s: float, step_s: float, every: int) -> float:
    """The share of training time that saving every ``every`` steps adds (may be negative:
    an interval's lower bound)."""
    return extra_s / (every * step_s)


def smallest_every(extra_s: float, step_s: float, target: float = 0.01) -> int:
    """The smallest interval whose overhead is under ``target`` for a save costing ``extra_s``."""
    return max(1, math.ceil(max(0.0, extra_s) / (target * step_s)))


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The extra time per save with its interval, and what follows for the overhead."""
    diffs = [s - p for s, p in zip(result["saving_segments_s"], result["plain_segments_s"],
                                   strict=True)]  # fmt: skip
    extra = median(diffs)
    low, high, confidence = median_interval(diffs)
    step = result["step_s"]
    at = REFERENCE_EVERY
    return {
        "extra_per_save_s": extra,
        "extra_per_save_interval_s": [low, high],
        "confidence": confidence,
        "pairs": len(diffs),
        "overhead_at_200": overhead(extra, step, at),
        "overhead_at_200_interval": [overhead(low, step, at), overhead(high, step, at)],
        # below this share (a save every 200 steps) the suite cannot tell a cost from zero
        "resolution_at_200": overhead((high - low) / 2, step, at),
        "resolved_from_zero": low > 0,
        "smallest_every_under_1pct": smallest_every(high, step),
    }


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
            result.update(summarize(result))
        results[tool.name] = result
    return {"settings": settings, "tools": results}
