"""Suite 4, resume: how fast, and is it exact.

A model of linear layers with dropout (so that training draws from torch's global RNG, as
real training does) is trained ``steps`` steps, saved, then trained ``more`` steps; the
SHA-256 of its weights is recorded. A fresh process then builds the same model and optimizer,
restores through the tool's resume path (timed: the ``restore()`` call only, after the
checkpoint's pages were dropped from the page cache), trains the same ``more`` steps on the
same batches and hashes its weights. **Bit-exact** means the two hashes are equal: the tool
saved everything the continuation depends on (weights, optimizer, RNG), used as documented.
The restore time (the median of ``reps`` rounds, tools interleaved in each round) is divided
by the raw cold read of the same number of bytes.

A restore is not all a resume costs: a loader that maps its files (safetensors) returns
tensors whose pages are copied only when the optimizer first writes them, in the first step.
So the time until training runs at full speed again is measured too: the restore plus what the
first step after it takes beyond the second. Besides the checkpointers, this suite restores
with safetensors' ``load_file`` (model and optimizer state in two files, nothing checked, no
RNG state: it is not bit-exact where training draws random numbers), the plain loader to beat.

Tools whose restore is the same code as another's (the asynchronous variants, torch.save +
fsync) are not run twice.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._common import (
    build_state,
    evict,
    folder_bytes,
    state_layout,
    state_sha256,
    train_step,
)
from benchmarks.calibrate import calibrate
from benchmarks.tools import LOADERS, SAME_RESTORE, Tool
from benchmarks.zygote import Zygote

DROPOUT = 0.1


def save_child(args: dict[str, Any]) -> dict[str, Any]:
    tool = LOADERS[args["tool"]]
    tool.import_library()
    folder = Path(args["folder"])
    shutil.rmtree(folder, ignore_errors=True)
    model, optimizer, nbytes = build_state(args["mb"], dropout=DROPOUT)
    for step in range(args["steps"]):
        train_step(model, optimizer, step)
    session = tool.open(folder, model, optimizer)
    session.save(args["steps"])
    session.wait()
    session.close()
    for step in range(args["steps"], args["steps"] + args["more"]):
        train_step(model, optimizer, step)
    return {
        "sha": state_sha256(model),
        "state_bytes": nbytes,
        "written_bytes": folder_bytes(folder),
    }


def load_child(args: dict[str, Any]) -> dict[str, Any]:
    tool = LOADERS[args["tool"]]
    tool.import_library()
    model, optimizer, _ = build_state(args["mb"], seed=1, dropout=DROPOUT)
    session = tool.open(Path(args["folder"]), model, optimizer)
    start = time.perf_counter()
    step = session.restore()
    seconds = time.perf_counter() - start
    if step != args["steps"]:
        return {"error": f"restored step {step}, expected {args['steps']}"}
    steps_s = []
    for index in range(step, step + args["more"]):
        started = time.perf_counter()
        train_step(model, optimizer, index)
        steps_s.append(time.perf_counter() - started)
    session.close()
    return {"sha": state_sha256(model), "restore_s": seconds, "steps_s": steps_s}


def run(zygote: Zygote, tools: list[Tool], settings: dict[str, Any], scratch: Path,
        log: Any) -> dict[str, Any]:  # fmt: skip
    """Each tool saves once; then ``settings["reps"]`` rounds restore every tool's checkpoint
    in a fresh process, tools interleaved within a round; the median restore is reported, and
    a resume is bit-exact only if every round was."""
    tools = [*tools, LOADERS["safetensors"]]  # the plain loader to beat, in this suite only
    nbytes = state_layout(settings["mb"])[2]
    reps = settings.get("reps", 1)
    log(f"resume: calibrating {nbytes / 1e6:.0f} MB")
    cal = calibrate(scratch, nbytes)
    results: dict[str, Any] = {}
    saved: dict[str, dict[str, Any]] = {}
    folders: dict[str, Path] = {}
    for index, tool in enumerate(tools):
        if tool.name in SAME_RESTORE:
            results[tool.name] = {"same_as": SAME_RESTORE[tool.name]}
            continue
        missing = tool.missing()
        if missing:
            results[tool.name] = {"error": missing}
            continue
        log(f"resume: {tool.name} saves")
        folders[tool.name] = scratch / "resume" / f"tool-{index}"
        args = {**settings, "tool": tool.name, "folder": str(folders[tool.name])}
        saved[tool.name] = zygote.call("resume-save", args)
        if "error" in saved[tool.name]:
            results[tool.name] = saved.pop(tool.name)
    times: dict[str, list[float]] = {name: [] for name in saved}
    # What a resume costs before training runs at full speed again: the restore, plus what
    # the first step after it takes beyond a later one (a mapped file's pages are copied
    # when the optimizer first writes them).
    catch_up: dict[str, list[float]] = {name: [] for name in saved}
    exact: dict[str, bool] = dict.fromkeys(saved, True)
    for rep in range(reps):
        log(f"resume: restores in fresh processes, round {rep + 1} of {reps}")
        for name in list(saved):
            evict(folders[name])
            args = {**settings, "tool": name, "folder": str(folders[name])}
            loaded = zygote.call("resume-load", args)
            if "error" in loaded:
                results[name] = loaded
                del saved[name]
                continue
            times[name].append(loaded["restore_s"])
            first, *later = loaded["steps_s"]
            catch_up[name].append(loaded["restore_s"] + first - min(later, default=first))
            exact[name] = exact[name] and loaded["sha"] == saved[name]["sha"]
    shutil.rmtree(scratch / "resume", ignore_errors=True)
    for name, item in saved.items():
        results[name] = {
            "restore_s": statistics.median(times[name]),
            "restore_all": times[name],
            "resumed_s": statistics.median(catch_up[name]),
            "resumed_all": catch_up[name],
            "bit_exact": exact[name],
            "state_bytes": item["state_bytes"],
            "written_bytes": item["written_bytes"],
        }
    ordered = {tool.name: results[tool.name] for tool in tools if tool.name in results}
    for name, same in list(ordered.items()):
        if "same_as" in same and same["same_as"] in ordered:
            ordered[name] = {**ordered[same["same_as"]], "same_as": same["same_as"]}
    return {"settings": settings, "calibration": cal.as_dict(), "tools": ordered}
