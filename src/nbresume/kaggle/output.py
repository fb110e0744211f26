"""A notebook version's output, downloaded and every checkpoint in it verified.

Every file of the output listing is downloaded (manifests last, so a folder is complete before
its commit marker arrives); then every checkpoint folder found in the download is read back
and compared with its manifest (:meth:`~nbresume.checkpoint.store.CheckpointStore.verify`).
Nothing counts as pulled that did not match.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbresume.checkpoint.format import MANIFEST_NAME, STATE_FILE, parse_step_dirname
from nbresume.checkpoint.store import LEASE_NAME, CheckpointStore, VerifyReport
from nbresume.kaggle.client import Kaggle, safe_output_path
from nbresume.kaggle.metadata import parse_ref

#: How deep under the download a checkpoint folder is looked for.
MAX_DEPTH = 8


@dataclass
class RunState:
    """One run's folder in the output: its verification and its newest checkpoint's state."""

    folder: Path
    report: VerifyReport
    step: int | None = None
    done: bool = False

    @property
    def name(self) -> str:
        return self.folder.name


@dataclass
class Pulled:
    """What a pull brought: where, how many files and bytes, and every run folder checked."""

    dest: Path
    files: int
    size: int
    runs: list[RunState] = field(default_factory=list)
    log: str = ""

    @property
    def checked(self) -> int:
        return sum(len(r.report.results) for r in self.runs)

    @property
    def good(self) -> int:
        return sum(sum(x.ok for x in r.report.results) for r in self.runs)

    @property
    def ok(self) -> bool:
        """Every checkpoint found verified (vacuously true when there is none)."""
        return self.good == self.checked

    @property
    def done(self) -> bool:
        """Every run in the output says its training is done (false without runs)."""
        return bool(self.runs) and all(r.done for r in self.runs)


def pull(kaggle: Kaggle, ref: str, dest: Path) -> Pulled:
    """Download the latest version's output of ``ref`` into ``dest`` and verify it."""
    parse_ref(ref)
    files, log = kaggle.output_files(ref)
    # A writer lease left by a run cut at the session cap names a Kaggle machine: it is no
    # part of the checkpoints, and a local run would only have to take it over.
    files = [f for f in files if f.name.rsplit("/", 1)[-1] != LEASE_NAME]
    dest.mkdir(parents=True, exist_ok=True)
    # Manifests last: a folder is whole before its commit marker lands.
    ordered = sorted(files, key=lambda f: (f.name.rsplit("/", 1)[-1] == MANIFEST_NAME, f.name))
    size = 0
    for item in ordered:
        target = safe_output_path(dest, item.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        size += kaggle.download(item.url, target)
    if log:
        slug = ref.partition("/")[2]
        (dest / f"{slug}.log").write_text(log, encoding="utf-8")
    return Pulled(dest=dest, files=len(files), size=size, runs=check_runs(dest), log=log)


def find_run_folders(root: Path) -> list[Path]:
    """Folders under ``root`` that hold committed checkpoints (step folders with a
    manifest), sorted."""
    found = []
    root_depth = len(root.parts)
    for folder, subfolders, _ in os.walk(root):
        here = Path(folder)
        if len(here.parts) - root_depth >= MAX_DEPTH:
            subfolders[:] = []
            continue
        steps = [s for s in subfolders if parse_step_dirname(s) is not None]
        if any((here / s / MANIFEST_NAME).is_file() for s in steps):
            found.append(here)
            subfolders[:] = [s for s in subfolders if s not in steps]
    return sorted(found)


def check_runs(root: Path) -> list[RunState]:
    """Verify every run folder under ``root`` and read its newest good checkpoint's state."""
    runs = []
    for folder in find_run_folders(root):
        store = CheckpointStore(folder, keep=None, check_space=False)
        report = store.verify()
        run = RunState(folder=folder, report=report)
        for result in sorted(report.results, key=lambda r: r.step, reverse=True):
            if result.ok:
                state = _read_state(folder / result.name / f"{STATE_FILE}.json")
                run.step = result.step
                # As Checkpointer.restore reads it: done, and not given a larger total since.
                total = state.get("total")
                run.done = bool(state.get("done")) and (
                    not isinstance(total, int) or result.step >= total
                )
                break
        runs.append(run)
    return runs


def _read_state(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}
