"""Run what a user runs on a checkpoint folder in a process of bounded memory; report.

``python hostile_child.py BUDGET OP ARG [OP ARG ...]``: once torch and nbresume are imported,
the address space is limited to what they took plus BUDGET bytes (``RLIMIT_AS``), then each
operation runs in turn:

- ``verify DIR``: ``nbresume verify DIR``;
- ``hf DIR``: ``nbresume.hf.last_checkpoint(DIR)``;
- ``lightning DIR``: ``nbresume.lightning.last_checkpoint(DIR)``;
- ``restore DIR``: ``Checkpointer(DIR, model=..., optimizer=...).restore()`` of :func:`build`;
- ``restore-plain DIR``: the same with :func:`build_plain_fsdp2` (a run two FSDP2 ranks saved);
- ``verify-objects DIR``, ``verify-objects-plain DIR``: ``Checkpointer.verify()`` of the same
  Checkpointers, its report printed as ``nbresume verify`` prints one;
- ``load DIR``: ``CheckpointStore(DIR).load()`` (what Lightning's ``CheckpointIO`` loads);
- ``pull SRC:DST``: ``nbresume pull SRC DST``;
- ``push DIR``: ``nbresume push DIR --kaggle-dataset $KAGGLE_USERNAME/nbresume-verdict``, to
  the Kaggle the environment points the kaggle client at (the tests' fake one, on loopback).

Prints one JSON line: for each operation its exit status or result, what it printed and the
warnings it gave; then the peak resident memory, and the resident memory right after the
imports. Anything raised escapes (a traceback, and a
status that is not 0): the test makes the assertions, the parent kills a run that hangs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import sys
import warnings
from typing import Any


def build(seed: int = 0) -> tuple[Any, Any]:
    """The model and optimizer of the runs the tests save and this child restores."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def build_plain_fsdp2(seed: int = 0) -> tuple[Any, Any]:
    """The model and optimizer of ``tests/distributed/sharded_worker.py``, not sharded: what
    restores a run that two FSDP2 ranks saved, in one process."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))


def restore(op: str, folder: str) -> int | str:
    """The step restored, or the error that said no checkpoint is usable."""
    from nbresume import Checkpointer, CheckpointStore
    from nbresume.errors import NoCheckpointError

    try:
        if op == "load":
            return CheckpointStore(folder, keep=None).load().step
        model, optimizer = build_plain_fsdp2(seed=1) if op == "restore-plain" else build(seed=1)
        ckpt = Checkpointer(
            folder, model=model, optimizer=optimizer, every=None, deadline=None,
            async_save=False, keep=None,
        )  # fmt: skip
        try:
            return ckpt.restore()
        finally:
            ckpt.close()
    except NoCheckpointError as exc:
        return f"error: {exc}"


def verify_objects(op: str, folder: str) -> int:
    """The exit status ``nbresume verify`` would give the report of ``Checkpointer.verify()``
    (which also checks that each checkpoint fits the objects), the report printed as it
    prints one."""
    from nbresume import Checkpointer

    model, optimizer = build_plain_fsdp2(seed=1) if op.endswith("-plain") else build(seed=1)
    ckpt = Checkpointer(
        folder, model=model, optimizer=optimizer, every=None, deadline=None,
        async_save=False, keep=None,
    )  # fmt: skip
    try:
        report = ckpt.verify()
    finally:
        ckpt.close()
    for result in report.results:
        print(result)
    print(report.summary)
    return 0 if report.ok else 1


def run(op: str, arg: str) -> dict[str, Any]:
    from nbresume.cli import main

    out = io.StringIO()
    result: Any = None
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
        warnings.simplefilter("always")
        with contextlib.redirect_stderr(out):
            if op == "verify":
                result = main(["verify", arg])
            elif op == "pull":
                src, dst = arg.split(":")
                result = main(["pull", src, dst])
            elif op == "push":
                dataset = f"{os.environ['KAGGLE_USERNAME']}/nbresume-verdict"
                result = main(["push", arg, "--kaggle-dataset", dataset])
            elif op == "hf":
                import nbresume.hf

                result = nbresume.hf.last_checkpoint(arg)
            elif op == "lightning":
                from pathlib import Path

                # What nbresume.lightning.last_checkpoint returns, without importing Lightning.
                from nbresume.frameworks.layout import newest_ckpt

                found = newest_ckpt([Path(arg)]).path
                result = None if found is None else str(found)
            elif op in ("restore", "restore-plain", "load"):
                result = restore(op, arg)
            elif op in ("verify-objects", "verify-objects-plain"):
                result = verify_objects(op, arg)
            else:
                raise SystemExit(f"unknown operation {op!r}")
    return {
        "op": op,
        "result": result,
        "out": out.getvalue(),
        "warnings": [str(w.message) for w in caught],
    }


def status(field: str) -> int:
    """A size from ``/proc/self/status`` (``VmSize``: address space; ``VmRSS``: resident;
    ``VmHWM``: the most resident), in bytes."""
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    # This file's folder is no place to import from: its kaggle/ (the tests' own) would hide
    # the kaggle client that push imports.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    # torch's own share comes first: a CUDA build maps gigabytes of libraries (3.2 GB against
    # 0.6 GB for a CPU build), which says nothing of what a folder makes a reader allocate.
    import torch  # noqa: F401

    import nbresume.cli  # noqa: F401

    imports = status("VmRSS")
    limit = status("VmSize") + int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    args = sys.argv[2:]
    reports = [run(op, arg) for op, arg in zip(args[::2], args[1::2], strict=True)]
    # The high-water mark of this process's own memory: ru_maxrss would start at the peak of
    # the process that started it (exec keeps it, and a vfork'ed child's is its parent's).
    peak = status("VmHWM")
    print(json.dumps({"reports": reports, "peak": peak, "imports": imports}))


if __name__ == "__main__":
    main()
