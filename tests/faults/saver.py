"""A training stand-in that checkpoints in a loop, for the kill -9 tests.

Run as ``python saver.py ROOT --keep K [...]``. It resumes from the newest checkpoint that
verifies in ROOT (checking that its contents are exactly the state of its step), then saves
step after step. Its whole state is a pure function of the step (:func:`state_for`), so a
reader can tell a right checkpoint from a stale or mixed one. NumPy arrays keep start-up short.

Protocol on stdout, one line each, flushed at once:

    resumed STEP SKIPPED      the checkpoint it continues from (0: none) and how many newer
                              ones load() passed over as corrupt
    start STEP T              save(STEP) is about to be called; T is time.monotonic()
    saved STEP T              save(STEP) returned, so the checkpoint is verified
    warning TEXT              save() warned (printed before the saved line)
    error TYPE TEXT           save() raised; the saver stops
    event I NAME DETAIL       (with --list-events) the I-th file system operation of the save,
                              printed before it happens

``--die-at-event I`` sends SIGKILL to itself just before the I-th file system operation of the
first save, counted from the creation of its temporary folder (operations as Python's audit
hooks report them: open, mkdir, rename, scandir, remove, rmdir, rmtree). That puts a kill
exactly between two steps of the commit protocol. ``--fail EVENT:PREFIX`` and
``--fail-dir-fsync ERRNO`` make operations fail instead, as a full or failing disk does.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from nbresume.checkpoint.format import TEMP_PREFIX
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import NbresumeError, NoCheckpointError

# About 2.5 MB in two safetensors files plus a JSON file: large enough that writing, fsyncing
# and reading back take several milliseconds each, small enough for hundreds of kills.
_MODEL_SHAPES = {"embed.weight": (250, 400), "block.0.weight": (400, 400), "head.bias": (1000,)}
_OPTIMIZER_LEN = 90_000

_AUDITED = frozenset(
    {"open", "os.mkdir", "os.rename", "os.scandir", "os.remove", "os.rmdir", "shutil.rmtree"}
)


def state_for(step: int, scale: int = 10) -> dict[str, Any]:
    """The complete training state at ``step`` (the keyword arguments of ``save()``), with
    tensors ``scale`` tenths of the full size."""
    model = {}
    for offset, (name, (rows, *rest)) in enumerate(sorted(_MODEL_SHAPES.items())):
        shape = (rows * scale // 10, *rest)
        count = int(np.prod(shape))
        values = np.arange(count, dtype=np.float32) * np.float32(1e-3) + np.float32(step + offset)
        model[name] = values.reshape(shape)
    optimizer = {
        "exp_avg": np.arange(_OPTIMIZER_LEN * scale // 10, dtype=np.float64) * float(step),
        "count": np.full(3, step, dtype=np.int64),
    }
    state = {"step": step, "lr": 0.1 / (1 + step % 7), "seen": [step * k for k in range(32)]}
    return {"tensors": {"model": model, "optimizer": optimizer}, "data": {"state": state}}


def state_mismatch(
    step: int, tensors: dict[str, Any], data: dict[str, Any], scale: int = 10
) -> str:
    """Why a loaded checkpoint is not exactly the state of ``step`` (``""`` when it is)."""
    want = state_for(step, scale)
    if set(tensors) != set(want["tensors"]) or set(data) != set(want["data"]):
        return f"files {sorted(tensors)} + {sorted(data)} are not the expected ones"
    for stem, group in want["tensors"].items():
        if set(tensors[stem]) != set(group):
            return f"{stem} holds {sorted(tensors[stem])}, expected {sorted(group)}"
        for name, array in group.items():
            got = tensors[stem][name]
            if got.dtype != array.dtype or got.shape != array.shape:
                return (
                    f"{stem}/{name} is {got.dtype}{got.shape}, expected {array.dtype}{array.shape}"
                )
            if not np.array_equal(got, array):
                return f"{stem}/{name} does not hold the values of step {step}"
    if data != want["data"]:
        return f"the JSON state is not that of step {step}"
    return ""


def _say(*words: object) -> None:
    print(*words, flush=True)


def _install_kill_switch(die_at: int | None, listing: bool) -> dict[str, Any]:
    """While ``switch["on"]``, count file system operations from the creation of the temporary
    folder on (the cleanup of earlier leftovers comes first and varies), and die just before
    operation ``die_at``."""
    switch: dict[str, Any] = {"on": False, "count": -1}

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if not switch["on"] or event not in _AUDITED:
            return
        target = str(args[0]) if args else ""
        detail = os.path.basename(target)
        if switch["count"] < 0:
            if event != "os.mkdir" or not detail.startswith(TEMP_PREFIX):
                return
            switch["count"] = 0
        if event == "open" and (isinstance(args[0], int) or target.endswith((".py", ".pyc"))):
            return  # an fdopen() right after its os.open(), or an import: nothing new
        index = switch["count"]
        switch["count"] = index + 1
        if event == "os.rename":
            detail += " -> " + os.path.basename(str(args[1]))
        if listing:
            _say("event", index, event, detail)
        if index == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    return switch


def _install_failures(
    rules: list[str], dir_fsync_errno: int | None, only_root: Path | None
) -> dict[str, bool]:
    """While ``gate["on"]``, make file system operations fail as a full or failing disk does:
    each rule ``EVENT:PREFIX`` fails that audited operation with ENOSPC when the name it
    creates (for a rename: the new name) starts with PREFIX; ``dir_fsync_errno`` fails
    fsync on folders (on ``only_root`` alone, when given)."""
    gate = {"on": False}
    parsed = [rule.split(":", 1) for rule in rules]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if not gate["on"] or event not in _AUDITED:
            return
        target = os.path.basename(str(args[1] if event == "os.rename" else args[0]))
        for name, prefix in parsed:
            if event == name and target.startswith(prefix):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target)

    if parsed:
        sys.addaudithook(hook)
    if dir_fsync_errno is not None:
        real_fsync = os.fsync

        def fsync(fd: Any) -> None:
            info = os.fstat(fd)
            chosen = only_root is None or os.path.samestat(info, os.stat(only_root))
            if gate["on"] and stat.S_ISDIR(info.st_mode) and chosen:
                raise OSError(dir_fsync_errno, os.strerror(dir_fsync_errno))
            real_fsync(fd)

        os.fsync = fsync
    return gate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root")
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--saves", type=int, default=40, help="stop after this many saves")
    parser.add_argument(
        "--resave", action="store_true", help="first save the step resumed from again"
    )
    parser.add_argument("--die-at-event", type=int, default=None)
    parser.add_argument("--list-events", action="store_true")
    parser.add_argument("--fail", action="append", default=[], metavar="EVENT:PREFIX")
    parser.add_argument("--fail-dir-fsync", type=lambda name: getattr(errno, name), default=None)
    parser.add_argument("--only-root", action="store_true", help="fail fsync of ROOT alone")
    args = parser.parse_args(argv)
    only_root = Path(args.root) if args.only_root else None
    gate = _install_failures(args.fail, args.fail_dir_fsync, only_root)

    switch = None
    if args.die_at_event is not None or args.list_events:
        switch = _install_kill_switch(args.die_at_event, args.list_events)

    store = CheckpointStore(args.root, keep=args.keep)
    try:
        loaded = store.load(framework="numpy")
    except NoCheckpointError:
        step, skipped = 0, 0
    else:
        step, skipped = loaded.step, len(loaded.skipped)
        problem = state_mismatch(step, loaded.tensors, loaded.data)
        if problem:
            print(f"resumed from a wrong checkpoint: {problem}", file=sys.stderr)
            return 3
    _say("resumed", step, skipped)

    steps = [step] if args.resave and step > 0 else []
    steps += range(step + 1, step + 1 + args.saves)
    for index, current in enumerate(steps[: args.saves]):
        state = state_for(current)
        if switch is not None:
            switch["on"], switch["count"] = index == 0, -1
        _say("start", current, repr(time.monotonic()))
        gate["on"] = True
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                store.save(current, **state)
        except (NbresumeError, OSError) as exc:
            _say("error", type(exc).__name__, str(exc).replace("\n", " "))
            return 0
        finally:
            gate["on"] = False
        stamp = time.monotonic()
        if switch is not None:
            switch["on"] = False
        for warning in caught:
            _say("warning", str(warning.message).replace("\n", " "))
        _say("saved", current, repr(stamp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
