"""``nbresume push DIR --kaggle-dataset owner/slug``: a run's checkpoint, verified, uploaded as
a new version of a private Kaggle dataset, where a Kaggle notebook's ``nbresume.init`` finds it.

The way a run moves onto Kaggle from somewhere else (Colab's Drive, an SSH box, a laptop):

1. Take the newest committed checkpoint of DIR (or ``--step N``).
2. Copy it into a staging folder laid out as ``nbresume/<name>/<step>/``, the manifest last,
   and verify the copy against the manifest (every file's size and hash): the bytes uploaded
   are the bytes checked. A checkpoint that does not verify is not uploaded; the command
   names the problem and the fix.
3. Upload the ``nbresume`` folder as one archive, which Kaggle unpacks into the dataset, and
   wait until Kaggle reports the new version ready. A notebook with the dataset attached finds
   ``/kaggle/input/<slug>/nbresume/<name>/`` and ``nbresume.init("<name>")`` continues from
   the checkpoint (it verifies it again as it copies it into ``/kaggle/working``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from nbresume.checkpoint.format import MANIFEST_NAME, step_dirname
from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore
from nbresume.checkpoint.units import format_bytes
from nbresume.errors import CorruptCheckpointError, UsageError
from nbresume.kaggle.metadata import parse_ref

#: The folder a Kaggle notebook's nbresume.init searches for under /kaggle/input.
LAYOUT_ROOT = "nbresume"
CHUNK = 8 << 20


def push(
    folder: str,
    dataset: str,
    *,
    name: str | None = None,
    step: int | None = None,
    out: Callable[[str], None] = print,
) -> int:
    """Upload the newest (or ``step``'s) checkpoint of ``folder``, verified, as a new version
    of the private Kaggle dataset ``dataset``; return the exit status (0)."""
    from nbresume.kaggle.client import Kaggle

    check_dataset_ref(dataset)
    store = CheckpointStore(folder, keep=None)
    name = name or _run_name(store.location)
    info = _chosen(store, step, folder)
    out(f"nbresume push: {store.location} -> Kaggle dataset {dataset}")
    _caution_if_writing(store, out)
    with tempfile.TemporaryDirectory(prefix="nbresume-push-") as staging:
        root = Path(staging)
        _stage(store, info, root / LAYOUT_ROOT / name, folder)
        where = f"{LAYOUT_ROOT}/{name}/{info.name}"
        out(f"  OK    {info.name}  {format_bytes(info.size):>9}  verified, staged as {where}")
        kaggle = Kaggle()  # credentials are needed from here on, and checked here
        url = kaggle.publish_dataset(
            root,
            dataset,
            _title(name),
            f"nbresume checkpoint of the run {name!r} at step {info.step}",
            dir_mode="tar",
            notes=f"nbresume push: {name} at step {info.step}",
            fix="check the dataset's slug and your Kaggle account, then push again",
        )
    out(f"uploaded as a new version of the private dataset {dataset}: {url}")
    out(
        f'OK: attach {dataset} to the Kaggle notebook; nbresume.init("{name}") there continues '
        f"from step {info.step}"
    )
    return 0


def check_dataset_ref(dataset: str) -> None:
    """Refuse (:class:`UsageError`) what does not name a Kaggle dataset (``owner/slug``)."""
    try:
        parse_ref(dataset)
    except UsageError:
        raise UsageError(
            f"{dataset!r} does not name a Kaggle dataset",
            fix="write it as owner/slug, as in kaggle.com/datasets/owner/slug",
        ) from None


def _run_name(location: str) -> str:
    """The run's name: the last part of its folder (``.../nbresume/<name>``)."""
    name = location.rstrip("/").rsplit("/", 1)[-1]
    if not name or name in (".", ".."):
        raise UsageError(
            f"cannot tell the run's name from {location}",
            where=location,
            fix='pass --name NAME, the name given to nbresume.init("NAME")',
        )
    return name


def _chosen(store: CheckpointStore, step: int | None, folder: str) -> CheckpointInfo:
    infos = store.list()
    if not infos:
        raise UsageError(
            f"no committed checkpoint in {store.location}: nothing to push",
            where=folder,
            fix="give the run's checkpoint folder (`nbresume ls DIR` lists what it holds)",
        )
    if step is None:
        return infos[-1]
    for info in infos:
        if info.step == step:
            return info
    steps = ", ".join(str(i.step) for i in infos)
    raise UsageError(
        f"no committed checkpoint of step {step} in {store.location}",
        where=folder,
        fix=f"give one of the steps it holds ({steps}), or leave --step out for the newest",
    )


def _caution_if_writing(store: CheckpointStore, out: Callable[[str], None]) -> None:
    from nbresume.checkpoint.store import live_holder

    try:
        holder = live_holder(store.backend)
    except Exception:
        return  # an unreadable lease says nothing about the checkpoint pushed
    if holder is not None:
        out(
            f"caution: a training still writes in this folder ({holder.describe()}); a newer "
            "checkpoint may follow this one: push again after it stops"
        )


def _stage(store: CheckpointStore, info: CheckpointInfo, target: Path, folder: str) -> None:
    """Copy the checkpoint into ``target/<step>`` (the manifest last) and verify the copy."""
    final = target / info.name
    final.mkdir(parents=True)
    backend = store.backend
    for file_name in [*info.manifest.files, MANIFEST_NAME]:
        with backend.open_read(info.name, file_name) as reader, open(final / file_name, "wb") as w:
            shutil.copyfileobj(reader, w, CHUNK)
    result = CheckpointStore(str(target), keep=None).verify(info.step)
    if not result.ok:
        problem = result.results[0].problem if result.results else "missing"
        older = [i.step for i in store.list() if i.step < info.step]
        hint = (
            f"; to push the older checkpoint {older[-1]} instead (if `nbresume verify` says "
            f"it is good), pass --step {older[-1]}"
            if older
            else ""
        )
        raise CorruptCheckpointError(
            f"checkpoint {info.step} ({step_dirname(info.step)}) does not verify: {problem}; "
            "nothing was uploaded",
            where=folder,
            fix=f"run `nbresume verify {folder}` to see what is wrong{hint}",
        )


def _title(name: str) -> str:
    """A dataset title within Kaggle's 6 to 50 characters."""
    return f"nbresume {name}"[:50]
