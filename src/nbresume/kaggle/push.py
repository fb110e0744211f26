"""``nbresume push DIR --kaggle-dataset owner/slug``: a run's checkpoint, verified, uploaded as
a new version of a private Kaggle dataset, where a Kaggle notebook's ``nbresume.init`` finds it.

The way a run moves onto Kaggle from somewhere else (Colab's Drive, an SSH box, a laptop):

1. Take the newest committed checkpoint of DIR (or ``--step N``).
2. Copy it into a staging folder laid out as ``nbresume/<name>/<step>/``, the manifest last,
   and verify the copy against the manifest (every file's size and hash): the bytes uploaded
   are the bytes checked. A checkpoint that does not verify is not uploaded; the command
   names the problem and the fix.
3. Scan what the checkpoint holds as text (the manifest, its JSON documents such as a
   Checkpointer's ``state.json``, the headers of its tensor files) for credentials, as
   ``nbresume commit`` scans every file it pushes: a finding refuses the push, naming the file
   and the kind of credential, never the credential itself.
4. Upload the ``nbresume`` folder as one archive, which Kaggle unpacks into the dataset, and
   wait until Kaggle reports the new version ready. A notebook with the dataset attached finds
   ``/kaggle/input/<slug>/nbresume/<name>/`` and ``nbresume.init("<name>")`` continues from
   the checkpoint (it verifies it again as it copies it into ``/kaggle/working``).

Never an older checkpoint in place of the newest: when the newest checkpoint does not verify
(a damaged manifest, a file changed), the push is refused, naming it, why, and the newest
checkpoint that does verify, with the ``--step`` that pushes that one. Pushing the older one
on its own would let the notebook continue from it while the steps in between are silently
lost; with ``--step`` the choice is the user's, and the checkpoint passed over is still named.

Nothing is written outside the staging folder: the run's name (``--name``, else the folder's
last part) must be one plain folder name. Each file's size is checked against its manifest
entry before it is copied, and the copy is read in bounded pieces and hashed as it goes: a
file larger than its entry (one that grew after the commit) is refused, not copied whole.
"""

from __future__ import annotations

import errno
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from nbresume.checkpoint.backends import Backend, handle_size, read_into
from nbresume.checkpoint.format import MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry
from nbresume.checkpoint.store import (
    CheckpointInfo,
    CheckpointStore,
    Digests,
    VerifyResult,
    check_hashes,
    live_holder,
    read_header,
)
from nbresume.checkpoint.units import format_bytes
from nbresume.errors import (
    CheckpointError,
    CorruptCheckpointError,
    SecretInCheckpointError,
    UsageError,
)
from nbresume.frameworks.layout import kind_of, travel_refusal
from nbresume.kaggle import secrets
from nbresume.kaggle.metadata import parse_ref
from nbresume.platforms.base import check_run_name

#: The folder a Kaggle notebook's nbresume.init searches for under /kaggle/input.
LAYOUT_ROOT = "nbresume"
#: The most bytes held at once while a file is copied into the staging folder.
CHUNK = 8 << 20
#: Text scanned for credentials at a time, and how much of the previous piece each piece
#: repeats, so that a credential across two pieces is whole in one of them.
SCAN_PIECE = 1 << 20
SCAN_OVERLAP = 64 << 10


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
    framework = kind_of(store.backend.list_folders())  # a Trainer's output_dir, a Lightning dirpath
    if framework is not None:
        raise UsageError(travel_refusal(framework, "push"), where=store.location)
    name = check_push_name(name) if name is not None else _run_name(store.location)
    out(f"nbresume push: {store.location} -> Kaggle dataset {dataset}")
    info = _chosen(store, step, folder, out)
    _caution_if_writing(store, out)
    with tempfile.TemporaryDirectory(prefix="nbresume-push-") as staging:
        root = Path(staging)
        _stage(store, info, root, name, folder, asked=step is not None)
        _refuse_credentials(root / LAYOUT_ROOT / name / info.name, info, folder)
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


def check_push_name(name: str) -> str:
    """``name`` when it is one plain folder name (the run's folder inside the staging folder
    and the dataset), else a :class:`UsageError` with the fix: no path separator, not ``.``,
    ``..`` or hidden, not empty, no control characters."""
    try:
        check_run_name(name)
        if not name.isprintable():
            raise UsageError("a control character")
    except UsageError:
        raise UsageError(
            f"--name {name!r} cannot name the run's folder in the dataset",
            fix='give the name the Kaggle notebook passes to nbresume.init("NAME"), one folder '
            "name such as resnet-cifar: no slash, not starting with a dot, no control characters",
        ) from None
    return name


def _run_name(location: str) -> str:
    """The run's name: the last part of its folder (``.../nbresume/<name>``)."""
    name = location.rstrip("/").rsplit("/", 1)[-1]
    try:
        return check_push_name(name)
    except UsageError:
        raise UsageError(
            f"cannot tell the run's name from {location}",
            where=location,
            fix='pass --name NAME, the name given to nbresume.init("NAME")',
        ) from None


def _chosen(
    store: CheckpointStore, step: int | None, folder: str, out: Callable[[str], None]
) -> CheckpointInfo:
    """The checkpoint to push: ``step``'s, else the newest; never an older one in place of a
    newest that does not verify (:func:`_refusal`)."""
    infos = store.list()
    broken = _broken(store, infos)
    if step is None:
        newest = infos[-1] if infos else None
        if broken and (newest is None or broken[-1].step > newest.step):
            raise _refusal(store, broken[-1], folder, asked=False)
        if newest is None:
            raise UsageError(
                f"no committed checkpoint in {store.location}: nothing to push",
                where=folder,
                fix="give the run's checkpoint folder (`nbresume ls DIR` lists what it holds)",
            )
        return newest
    for bad in broken:
        if bad.step == step:
            raise _refusal(store, bad, folder, asked=True)
    for info in infos:
        if info.step == step:
            for bad in broken:
                if bad.step > step:
                    out(
                        f"note: passed over the newer checkpoint {bad.step} ({bad.name}), which "
                        f"does not verify ({bad.problem}); pushing step {step} as --step asks"
                    )
            return info
    steps = ", ".join(str(i.step) for i in infos)
    raise UsageError(
        f"no committed checkpoint of step {step} in {store.location}",
        where=folder,
        fix=f"give one of the steps it holds ({steps}), or leave --step out for the newest",
    )


def _broken(store: CheckpointStore, listed: list[CheckpointInfo]) -> list[VerifyResult]:
    """Step folders with a manifest that does not parse, oldest first: checkpoints that
    :meth:`CheckpointStore.list` leaves out, each with its problem (without the fix)."""
    return [
        VerifyResult(
            name,
            step,
            store.backend.child(name),
            False,
            f"{exc.where}: {exc.message}" if exc.where else exc.message,
        )
        for step, name, exc in store.broken_manifests(listed)
    ]


def _refusal(
    store: CheckpointStore, bad: VerifyResult, folder: str, *, asked: bool
) -> CorruptCheckpointError:
    """The push refused because ``bad`` does not verify, naming the newest other checkpoint
    that does (each is verified, newest first, until one passes). ``asked``: ``bad`` is the
    step that ``--step`` named, rather than the newest."""
    good: int | None = None
    for info in reversed(store.list()):
        if info.step != bad.step and store.verify(info.step).ok:
            good = info.step
            break
    if good is not None:
        fix = (
            f"to push the newest checkpoint that verifies, step {good}: pass --step {good}; "
            f"run `nbresume verify {folder}` to see what is wrong with {bad.name}"
        )
    else:
        fix = f"run `nbresume verify {folder}` to see what is wrong: no other checkpoint verifies"
    why = "" if asked else " (an older checkpoint is never pushed in its place unless --step asks)"
    return CorruptCheckpointError(
        f"checkpoint {bad.step} ({bad.name}) does not verify: {bad.problem}; nothing was "
        f"uploaded{why}",
        where=folder,
        fix=fix,
    )


def _caution_if_writing(store: CheckpointStore, out: Callable[[str], None]) -> None:
    try:
        holder = live_holder(store.backend)
    except Exception:
        return  # an unreadable lease says nothing about the checkpoint pushed
    if holder is not None:
        out(
            f"caution: a training still writes in this folder ({holder.describe()}); a newer "
            "checkpoint may follow this one: push again after it stops"
        )


def _stage(
    store: CheckpointStore,
    info: CheckpointInfo,
    root: Path,
    name: str,
    folder: str,
    *,
    asked: bool,
) -> None:
    """Copy the checkpoint into ``root/nbresume/<name>/<step>`` (the manifest last), each file
    checked as it is copied, then verify the copy."""
    target = root / LAYOUT_ROOT / name
    final = target / info.name
    if not final.resolve().is_relative_to(root.resolve()):  # check_push_name's promise
        raise UsageError(f"--name {name!r} leads out of the staging folder", where=folder)
    final.mkdir(parents=True)
    backend = store.backend
    try:
        for file_name, entry in info.manifest.files.items():
            _copy_checked(backend, info.name, file_name, entry, final / file_name)
        manifest = backend.read_bytes(info.name, MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
        if len(manifest) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"the manifest is larger than {format_bytes(MAX_MANIFEST_BYTES)}",
                where=backend.child(info.name, MANIFEST_NAME),
            )
        (final / MANIFEST_NAME).write_bytes(manifest)
    except CorruptCheckpointError as exc:
        raise _refusal(store, _failed(info, str(exc)), folder, asked=asked) from None
    except FileNotFoundError as exc:
        missing = _failed(info, f"missing file: {exc.filename or exc}")
        raise _refusal(store, missing, folder, asked=asked) from None
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise  # the staging folder's disk, a permission: the command line says which
        # A file of the checkpoint that is not a regular file (a FIFO, a link): never opened.
        odd = _failed(info, f"cannot read: {exc}")
        raise _refusal(store, odd, folder, asked=asked) from None
    result = CheckpointStore(str(target), keep=None).verify(info.step)
    if not result.ok:
        problem = result.results[0].problem if result.results else "missing"
        # The copy's path means nothing once the staging folder is gone: name the original.
        problem = problem.replace(str(final), backend.child(info.name))
        raise _refusal(store, _failed(info, problem), folder, asked=asked)
    staged = {p.name for p in final.iterdir() if p.is_file()}
    if staged != {*info.manifest.files, MANIFEST_NAME}:  # never an upload without the files
        raise CheckpointError(
            f"the staging folder holds {sorted(staged)}, not the checkpoint's files; nothing "
            "was uploaded",
            where=str(final),
        )


def _failed(info: CheckpointInfo, problem: str) -> VerifyResult:
    return VerifyResult(info.name, info.step, info.location, ok=False, problem=problem)


def _copy_checked(store: Backend, name: str, file_name: str, entry: FileEntry, dest: Path) -> None:
    """Copy one file of the checkpoint to ``dest`` in pieces of at most :data:`CHUNK` bytes,
    hashing each piece: its size is checked against ``entry`` before the first byte is copied
    (where the store can tell it without reading), and the copy stops at the first byte
    beyond it; the hashes are checked at its end."""
    where = store.child(name, file_name)
    with store.open_read(name, file_name) as reader:
        size = handle_size(reader)
        if size is not None and size != entry.size:
            raise _size_mismatch(where, entry, size)
        digests = Digests(md5=entry.md5 is not None, threaded=False, algorithm=entry.algorithm)
        buffer = memoryview(bytearray(min(CHUNK, entry.size + 1)))
        copied = 0
        with open(dest, "xb") as writer:
            while count := read_into(reader, buffer):
                copied += count
                if copied > entry.size:
                    raise _size_mismatch(where, entry, None)
                digests.update(buffer[:count])
                writer.write(buffer[:count])
        digest, md5 = digests.result()
    check_hashes(where, entry, copied, digest, md5)


def _size_mismatch(where: str, entry: FileEntry, size: int | None) -> CorruptCheckpointError:
    if size is None or size > entry.size:
        seen = "larger" if size is None else f"{size} bytes, larger"
        return CorruptCheckpointError(
            f"the file is {seen} than the manifest records ({entry.size} bytes): it changed "
            "after the checkpoint was committed; it was not copied",
            where=where,
        )
    return CorruptCheckpointError(
        f"the file is {size} bytes, smaller than the manifest records ({entry.size} bytes)",
        where=where,
    )


def _refuse_credentials(staged: Path, info: CheckpointInfo, folder: str) -> None:
    """Refuse (:class:`SecretInCheckpointError`) a staged checkpoint whose text holds a
    credential: the manifest, every document, and the header of every tensor file."""
    found: list[tuple[str, secrets.Kind]] = []
    for file_name in sorted([*info.manifest.files, MANIFEST_NAME]):
        kinds: list[secrets.Kind] = []
        for piece in _texts(staged / file_name):
            kinds += [k for k in secrets.kinds_in(piece) if k not in kinds]
        found += [(file_name, kind) for kind in kinds]
    if not found:
        return
    shown = "; ".join(f"{file_name}: {kind.label}" for file_name, kind in found)
    revoke = "; ".join(sorted({f"{k.label}: {k.revoke}" for _, k in found}))
    raise SecretInCheckpointError(
        f"checkpoint {info.step} holds a credential; nothing was uploaded: {shown}",
        where=folder,
        fix="take it out of what the run saves (a value set with ckpt[NAME] = ..., a config "
        "object given to the Checkpointer), save a checkpoint without it and push that one; "
        f"treat the credential as leaked and revoke it ({revoke})",
    )


def _texts(path: Path) -> Iterator[str]:
    """What a staged file holds as text, in pieces of :data:`SCAN_PIECE` characters that
    overlap by :data:`SCAN_OVERLAP`: a tensor file's header, any other file whole."""
    with open(path, "rb") as handle:
        if path.name.endswith(".safetensors"):
            size = path.stat().st_size
            yield read_header(handle, size, where=str(path))[8:].decode("utf-8", "replace")
            return
        tail = ""
        while chunk := handle.read(SCAN_PIECE):
            text = tail + chunk.decode("utf-8", "replace")
            yield text
            tail = text[-SCAN_OVERLAP:]


def _title(name: str) -> str:
    """A dataset title within Kaggle's 6 to 50 characters."""
    return f"nbresume {name}"[:50]
