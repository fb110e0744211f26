"""Kaggle notebooks: an interactive editor session, or a batch run ("Save & Run All").

Durable folders live in ``<kaggle root>/working/nbresume/<name>``: ``/kaggle/working`` is what
Kaggle keeps as the notebook's output. A later run that attaches that output as an input
finds it somewhere under ``/kaggle/input`` (the layout has changed over time, so it is
searched, not assumed); :func:`seed_from_inputs` copies the newest checkpoint that verifies
into the new working folder, so the run continues where the previous version stopped.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from nbresume import knobs
from nbresume.checkpoint.format import MANIFEST_NAME, step_dirname
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import CorruptCheckpointError, StorageError, StorageFullError
from nbresume.platforms.base import HOUR, DangerClock, Platform, is_inside, make_folder

if TYPE_CHECKING:
    from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore

GPU_CAP_S = 9 * HOUR
CPU_CAP_S = 12 * HOUR
#: How deep under /kaggle/input an ``nbresume`` folder is looked for, and how many folders
#: are looked at, at most: inputs can be large datasets.
SEARCH_DEPTH = 6
SEARCH_FOLDERS = 5000
COPY_CHUNK = 8 << 20


class KagglePlatform(Platform):
    """An interactive Kaggle notebook session (the editor)."""

    name = "kaggle"
    title = "Kaggle (interactive)"
    mtbf_s = 4 * HOUR
    detected_by = ("KAGGLE_KERNEL_RUN_TYPE",)

    @classmethod
    def detect(cls) -> bool:
        run_type = os.environ.get("KAGGLE_KERNEL_RUN_TYPE", "")
        return bool(run_type) and run_type != "Batch"

    def durable_base(self) -> Path:
        return knobs.kaggle_root() / "working" / "nbresume"

    def prepare_root(self, name: str) -> str:
        root = Path(self.default_root(name))
        make_folder(root)
        self.seeded = seed_from_inputs(name, root, knobs.kaggle_root() / "input")
        return str(root)

    def durable_warning(self, path: str) -> tuple[str, str] | None:
        working = knobs.kaggle_root() / "working"
        if is_inside(path, working):
            return None
        return (
            f"outside {working}, which is the only folder kept as the notebook's output",
            f"leave dir= unset (the default is in {working}) or use an object store URL",
        )

    def session_cap_s(self, accelerated: bool) -> float | None:
        return GPU_CAP_S if accelerated else CPU_CAP_S

    def cap_name(self, accelerated: bool) -> str:
        return "Kaggle accelerator session (9 h)" if accelerated else "Kaggle CPU session (12 h)"

    def danger_clocks(self, accelerated: bool) -> list[DangerClock]:
        return [
            DangerClock(
                "session cap",
                self.session_cap_s(accelerated),
                "the session: 9 h with a GPU or TPU, 12 h on CPU",
                "deadline='auto' saves and stops before the cap",
            ),
            DangerClock(
                "idle timeout",
                None,
                "an interactive session left without activity is stopped, with its memory "
                "and any file not saved as a version",
                "checkpoints in /kaggle/working on a clock; Save Version (or `nbresume "
                "commit`) keeps them",
            ),
            DangerClock(
                "weekly GPU quota",
                None,
                "GPU hours for the week (about 30); a session left running spends them",
                "the run stops when training is done; the preflight warns when a GPU is "
                "attached but not asked for",
            ),
        ]

    def accelerator_fix(self, kind: str, count: int = 1) -> str:
        if kind == "tpu":
            return (
                "in the notebook editor: Settings → Accelerator → TPU VM v5e-8; for a committed "
                "version, `nbresume commit --accelerator tpu`"
            )
        return (
            "in the notebook editor: Settings → Accelerator → GPU T4 x2 (needs a "
            "phone-verified account); for a committed version, `nbresume commit "
            "--accelerator t4x2`"
        )

    def internet_fix(self) -> str:
        return (
            "in the notebook editor: Settings → Internet → on (needs a phone-verified account: "
            "kaggle.com → Settings → Phone verification); for a committed version, `nbresume "
            "commit --internet`"
        )


class KaggleBatchPlatform(KagglePlatform):
    """A Kaggle batch run ("Save & Run All", or ``nbresume commit``): no one is watching, so a
    failed preflight check stops the run at its first cell instead of hours later."""

    name = "kaggle-batch"
    title = "Kaggle (Save & Run All)"
    strict_default = True
    mtbf_s = 12 * HOUR

    @classmethod
    def detect(cls) -> bool:
        return os.environ.get("KAGGLE_KERNEL_RUN_TYPE", "") == "Batch"

    def danger_clocks(self, accelerated: bool) -> list[DangerClock]:
        return [
            DangerClock(
                "session cap",
                self.session_cap_s(accelerated),
                "the unfinished run, cut at 9 h with a GPU or TPU, 12 h on CPU (whether its "
                "output is kept then is not documented)",
                "deadline='auto' saves and stops before the cap, so the run ends cleanly and "
                "its output, with the checkpoint, is kept",
            ),
            DangerClock(
                "a failing cell",
                None,
                "the run: an uncaught exception ends it with status ERROR",
                "the preflight fails at the first cell, before hours are spent; checkpoints "
                "already in /kaggle/working are in the output",
            ),
        ]


def find_seed_folders(input_root: Path, name: str) -> list[Path]:
    """Every ``nbresume/<name>`` folder under ``input_root``, breadth first, bounded in depth
    and in the number of folders looked at."""
    found: list[Path] = []
    queue: deque[tuple[Path, int]] = deque([(input_root, 0)])
    looked = 0
    while queue and looked < SEARCH_FOLDERS:
        folder, depth = queue.popleft()
        looked += 1
        try:
            with os.scandir(folder) as entries:
                subfolders = [Path(e.path) for e in entries if _is_dir(e)]
        except OSError:
            continue
        for sub in sorted(subfolders):
            if sub.name == "nbresume":
                if (sub / name).is_dir():
                    found.append(sub / name)
            elif depth + 1 < SEARCH_DEPTH:
                queue.append((sub, depth + 1))
    return found


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def seed_from_inputs(name: str, root: Path, input_root: Path) -> CheckpointInfo | None:
    """Copy the newest checkpoint that verifies, among the ``nbresume/<name>`` folders of the
    attached inputs, into ``root``; skip when ``root`` already has one as new. Returns the
    copied checkpoint (verified in ``root``), or ``None`` when nothing was copied.
    """
    folders = find_seed_folders(input_root, name)
    if not folders:
        return None
    target = CheckpointStore(root, keep=None)
    newest_here = target.latest()
    candidates = []
    for order, folder in enumerate(folders):
        source = CheckpointStore(folder, keep=None)
        candidates += [(info.step, -order, source, info) for info in source.list()]
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    for step, _, source, info in candidates:
        if newest_here is not None and step <= newest_here.step:
            return None
        if source.verify(step).ok:
            return _copy_checkpoint(source, info, target)
    if not candidates and newest_here is None:
        # A Hugging Face Trainer's output (checkpoint-N folders), committed by nbresume.hf.
        from nbresume.hf.resume import seed_from

        return seed_from(folders, root)
    return None


def _copy_checkpoint(
    source: CheckpointStore, info: CheckpointInfo, target: CheckpointStore
) -> CheckpointInfo:
    """Copy one committed checkpoint through the stores' own commit protocol, then verify it
    where it landed."""
    src, dst = source.backend, target.backend
    final = step_dirname(info.step)
    dst.recover(current="")
    folder = dst.begin(final)
    try:
        for file_name in [*info.manifest.files, MANIFEST_NAME]:  # the manifest last
            with src.open_read(info.name, file_name) as reader:
                writer = dst.open_write(folder, file_name)
                try:
                    shutil.copyfileobj(reader, writer, COPY_CHUNK)
                finally:
                    dst.close_durably(writer)
        dst.commit(folder, final)
    except StorageError:
        raise  # a store's own error already says where and what to do
    except OSError as exc:
        dst.discard(folder)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFullError(
                f"no room to copy checkpoint {info.step} ({info.size} bytes) from the input",
                where=target.location,
                fix="free space in /kaggle/working, or pass dir= elsewhere",
                needed=info.size,
            ) from None
        raise StorageError(
            f"cannot copy checkpoint {info.step} from {info.location}: {exc}",
            where=target.location,
            fix="pass dir= to nbresume.init to start without the previous run's checkpoint",
        ) from None
    except BaseException:
        dst.discard(folder)
        raise
    result = target.verify(info.step)
    if not result.ok:
        dst.delete(final)
        problem = result.results[0].problem if result.results else "missing"
        raise CorruptCheckpointError(
            f"checkpoint {info.step} copied from {info.location} does not verify: {problem}",
            where=target.location,
            fix="check the free space and the disk of /kaggle/working, then run again",
        )
    copied = target.latest()
    assert copied is not None
    return copied
