"""Suite 1, stall and durability: per tool and state size, in a fresh process each.

- **blocked**: how long ``save(step)`` keeps the training thread;
- **done**: until the tool says the checkpoint is complete (``wait()``); it is *durable* (on
  disk, fsynced, committed) only for the tools that fsync;
- **bytes written** per checkpoint, and the **extra peak memory** of the process over the run
  (VmHWM after a reset, minus the resident size with the state built and the library loaded).

Each save is timed ``reps`` times, the medians are reported; between two saves an fsync
of the tool's files runs outside the clock, so that a tool that does not fsync does not
leave its write-back to the next measurement. The first save of an asynchronous tool also
allocates its copy buffers.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

from benchmarks._common import (
    PeakMemory,
    build_state,
    files_below,
    folder_bytes,
    fsync_path,
    median,
    state_layout,
)
from benchmarks.calibrate import calibrate
from benchmarks.tools import BY_NAME, Tool
from benchmarks.zygote import Zygote


def child(args: dict[str, Any]) -> dict[str, Any]:
    tool = BY_NAME[args["tool"]]
    tool.import_library()
    folder = Path(args["folder"])
    shutil.rmtree(folder, ignore_errors=True)
    model, optimizer, nbytes = build_state(args["mb"])
    peak = PeakMemory()
    peak.start()
    session = tool.open(folder, model, optimizer)
    blocked, done = [], []
    written = 0
    for rep in range(args["reps"]):
        start = time.perf_counter()
        session.save(rep + 1)
        returned = time.perf_counter()
        session.wait()
        finished = time.perf_counter()
        blocked.append(returned - start)
        done.append(finished - start)
        if rep == 0:
            written = folder_bytes(folder)
        for path in files_below(folder):  # write-back left by a tool that does not fsync
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile (old checkpoints)
                fsync_path(path)
    extra = peak.extra()
    session.close()
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "state_bytes": nbytes,
        "blocked_s": median(blocked),
        "done_s": median(done),
        "blocked_all": blocked,
        "done_all": done,
        "written_bytes": written,
        "extra_peak_bytes": extra,
        "peak_reset": peak.reset,
    }


def run(zygote: Zygote, tools: list[Tool], *, sizes: list[float], reps: int,
        scratch: Path, log: Any) -> dict[str, Any]:  # fmt: skip
    """{"sizes": [{"mb", "calibration", "tools": {name: result}}]}"""
    out: list[dict[str, Any]] = []
    for mb in sizes:
        nbytes = state_layout(mb)[2]
        log(f"stall: calibrating {nbytes / 1e6:.0f} MB on {scratch}")
        cal = calibrate(scratch, nbytes)
        results: dict[str, Any] = {}
        for tool in tools:
            missing = tool.missing()
            if missing:
                results[tool.name] = {"error": missing}
                continue
            log(f"stall: {tool.name}, {nbytes / 1e6:.0f} MB")
            folder = scratch / "stall"
            results[tool.name] = zygote.call(
                "stall", {"tool": tool.name, "mb": mb, "reps": reps, "folder": str(folder)}
            )
            shutil.rmtree(folder, ignore_errors=True)
        out.append({"mb": mb, "state_bytes": nbytes, "calibration": cal.as_dict(),
                    "tools": results})  # fmt: skip
    return {"sizes": out}
