"""One simulated Colab VM: a process that mounts the stand-in Drive and trains or saves.

Run by the tests as ``python child.py COMMAND --out FILE ...`` with the stand-in's environment
(see ``conftest.py``). Every observation is appended to FILE as one JSON line and flushed at
once, so that what a process said survives its ``kill -9``. The "god view" (what the cloud
really holds) is read straight from the simulated cloud, never through nbresume.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from colab.godview import landed

RUN_PARTS = ["nbresume", "x"]


class Out:
    """JSON lines to a file, each flushed at once."""

    def __init__(self, path: str) -> None:
        self.handle = open(path, "a", buffering=1)  # noqa: SIM115

    def __call__(self, **record: Any) -> None:
        record.setdefault("t", time.time())
        self.handle.write(json.dumps(record, default=str) + "\n")
        self.handle.flush()


def cloud() -> Any:
    from colab_standin.cloud import Cloud

    return Cloud(os.environ["COLAB_STANDIN_ROOT"])


def mount() -> Path:
    from nbresume import knobs
    from nbresume.platforms.drive import mount_drive

    return mount_drive(str(knobs.drive_mount()))


def event_logger(out: Out, god: Any = None) -> Callable[[Any], None]:
    """A Checkpointer callback: every event to ``out``; at ``durable``, what the cloud holds."""

    def callback(event: Any) -> None:
        if event.kind == "step":
            return  # one per step: too many to be worth a line
        record = {"kind": event.kind, "step": event.step, **event.data}
        if god is not None and event.kind == "durable":
            record["cloud_has_it"] = landed(god, RUN_PARTS).get(event.step, False)
            # Retention may have deleted it since it was confirmed (locally first, then on Drive).
            record["deleted"] = not os.path.isdir(event.data["location"])
        out(**record)

    return callback


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# -- commands ---------------------------------------------------------------------------------


class Linear:
    """A small linear model trained by SGD with momentum, in NumPy (no torch start-up cost)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.w = rng.standard_normal((16, 4)).astype(np.float32) * 0.1
        self.velocity = np.zeros_like(self.w)

    def step(self, step: int) -> None:
        rng = np.random.default_rng(step)  # the data of a step depends on the step only
        x = rng.standard_normal((8, 16)).astype(np.float32)
        grad = x.T @ (x @ self.w - x[:, :4] * 0.5) / len(x)
        self.velocity = 0.9 * self.velocity + grad
        self.w = self.w - 0.05 * self.velocity

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "velocity": self.velocity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w, self.velocity = np.array(state["w"]), np.array(state["velocity"])


def train(args: argparse.Namespace, out: Out) -> None:
    """A model trained with a Checkpointer on the mounted Drive (or in ``--local``)."""
    from nbresume import Checkpointer

    model = Linear()
    if args.local:
        folder, god = args.local, None
    else:
        folder, god = str(mount().joinpath(*RUN_PARTS)), cloud()
    ckpt = Checkpointer(folder, every=args.every, keep=3, deadline=None,
                        callbacks=[event_logger(out, god)], model=model)  # fmt: skip
    out(kind="store", store=type(ckpt.store.backend).__name__)
    out(kind="resumed", step=ckpt.restore())
    for step in ckpt.steps(args.total):
        model.step(step)
        if args.sleep:
            time.sleep(args.sleep)
    ckpt.close()
    digest = hashlib.sha256(model.w.tobytes() + model.velocity.tobytes()).hexdigest()
    out(kind="finished", step=ckpt.step, weights=digest)


class Weights:
    """A stateful object without torch: one array, changed by every step."""

    def __init__(self, size: int) -> None:
        self.w = np.zeros(size, dtype=np.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w = np.array(state["w"])


def sync(args: argparse.Namespace, out: Out) -> None:
    """One checkpoint saved on Drive: what nbresume says about it until Drive has it."""
    from nbresume import Checkpointer
    from nbresume.platforms.drive import drive_status

    god = cloud()
    weights = Weights(50_000)
    folder = mount().joinpath(*RUN_PARTS)
    ckpt = Checkpointer(str(folder), every=None, deadline=None, async_save=False,
                        callbacks=[event_logger(out, god)], weights=weights)  # fmt: skip
    weights.w += 1
    ckpt.save(7)
    out(
        kind="status_after_save",
        state=str(drive_status(folder)[7]),
        cloud_has_it=landed(god, RUN_PARTS).get(7, False),
    )
    assert ckpt.durability is not None
    wait_for(lambda: not ckpt.durability.pending)  # type: ignore[union-attr]
    out(kind="status_at_end", state=str(drive_status(folder)[7]))


def flush(args: argparse.Namespace, out: Out) -> None:
    """Checkpoints that have not uploaded, then nbresume's flush: what it reports."""
    from nbresume import CheckpointStore
    from nbresume.platforms.drive import drive_status
    from nbresume.platforms.drive import flush as drive_flush

    god = cloud()
    folder = mount().joinpath(*RUN_PARTS)
    store = CheckpointStore(str(folder), keep=None)
    for step in (1, 2):
        store.save(step, tensors={"model": {"w": np.full(args.floats, step, np.float32)}})
    out(kind="before", states={s: str(d) for s, d in drive_status(folder).items()},
        landed=landed(god, RUN_PARTS))  # fmt: skip
    report = drive_flush(str(folder), timeout_ms=args.timeout_ms)
    out(kind="report", error=report.error, saved=[r.step for r in report.saved],
        not_saved=[r.step for r in report.not_saved], text=str(report))  # fmt: skip
    out(kind="after", landed=landed(god, RUN_PARTS), mount=sorted(os.listdir(folder.parents[2])))


def retention(args: argparse.Namespace, out: Out) -> None:
    """Many saves with keep=2 on a small Drive: does retention give the quota back?"""
    from nbresume import CheckpointStore
    from nbresume.checkpoint.backends import LocalStore

    god = cloud()
    folder = mount().joinpath(*RUN_PARTS)
    # "mount": deletions go through the mount only, as a plain folder would do them.
    location: Any = LocalStore(folder) if args.mode == "mount" else str(folder)
    store = CheckpointStore(location, keep=2, md5=True)
    out(kind="store", store=type(store.backend).__name__)
    for step in range(1, args.saves + 1):
        store.save(step, tensors={"model": {"w": np.full(args.floats, step, np.float32)}})
        # Retention removes in the background; the next save waits for it before it writes.
        store.wait_removals()
        arrived = wait_for(lambda s=step: landed(god, RUN_PARTS).get(s, False), args.wait)
        used, trash = god.usage()
        out(kind="saved", step=step, landed=arrived, usage=used, trash=trash)
        if not arrived:
            break
    if args.mode == "drive":
        # Let the last deletions reach the cloud (the mount's own lag) before the final count.
        from colab_standin import MOUNTS

        for m in MOUNTS.values():
            m.flush(30)
    used, trash = god.usage()
    out(kind="end", usage=used, trash=trash, kept=sorted(i.step for i in store.list()),
        on_cloud=landed(god, RUN_PARTS))  # fmt: skip


def init(args: argparse.Namespace, out: Out) -> None:
    """``nbresume.init`` on a (simulated) Colab VM, twice, then a checkpoint."""
    import nbresume

    run = nbresume.init("x", quiet=True)
    again = nbresume.init("x", quiet=True)  # a notebook re-run: must not remount
    weights = Weights(1000)
    ckpt = run.checkpointer(every=None, async_save=False, callbacks=[event_logger(out, cloud())],
                            weights=weights)  # fmt: skip
    weights.w += 3
    ckpt.save(5)
    assert ckpt.durability is not None
    wait_for(lambda: not ckpt.durability.pending)  # type: ignore[union-attr]
    out(kind="init", platform=run.platform.name, dir=run.dir, again=again.dir,
        store=type(ckpt.store.backend).__name__, landed=landed(cloud(), RUN_PARTS))  # fmt: skip


def plain_path(args: argparse.Namespace, out: Out) -> None:
    """A script that mounts Drive itself and hands nbresume a plain path, without init."""
    import sys

    from google.colab import drive

    from nbresume import Checkpointer, knobs

    drive.mount(str(knobs.drive_mount()))
    before = "nbresume.platforms.drive" in sys.modules
    folder = knobs.drive_mount() / "MyDrive" / "plain"
    ckpt = Checkpointer(str(folder), every=None, async_save=False, weights=Weights(100))
    out(kind="plain", drive_loaded_before=before, store=type(ckpt.store.backend).__name__)


def mount_errors(args: argparse.Namespace, out: Out) -> None:
    """What mount_drive says when Colab's mount refuses."""
    from nbresume.errors import StorageError
    from nbresume.platforms.drive import mount_drive

    for mountpoint in (args.mountpoint, args.mountpoint + " with space"):
        try:
            mount_drive(mountpoint)
        except StorageError as exc:
            out(kind="error", mountpoint=mountpoint, message=exc.message, fix=exc.fix)
        else:
            out(kind="mounted", mountpoint=mountpoint)


COMMANDS = {
    "train": train,
    "sync": sync,
    "flush": flush,
    "retention": retention,
    "init": init,
    "mount-errors": mount_errors,
    "plain-path": plain_path,
}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--total", type=int, default=100)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--local", default="")
    parser.add_argument("--floats", type=int, default=10_000)
    parser.add_argument("--timeout-ms", type=int, default=60_000)
    parser.add_argument("--mode", default="drive")
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--wait", type=float, default=20.0)
    parser.add_argument("--mountpoint", default="")
    args = parser.parse_args(argv)
    out = Out(args.out)
    COMMANDS[args.command](args, out)


if __name__ == "__main__":
    main(sys.argv[1:])
