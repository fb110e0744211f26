"""Lightning's checkpoint file as a verified nbresume checkpoint: safetensors plus JSON.

Lightning hands a checkpoint dictionary and a path such as ``.../epoch=0-step=10.ckpt``.
That path becomes a *folder* holding an nbresume checkpoint store: the tensors of the
dictionary in ``tensors.safetensors``, everything else in ``checkpoint.json`` (the same tagged
JSON the Checkpointer writes, :mod:`nbresume.checkpoint.format.state_document`), committed and
read back through :meth:`CheckpointStore.begin`. Saving ``last.ckpt`` again adds the new step
to that folder and retention drops the older one once the new one verified.

On a local file system a new ``.ckpt`` folder is built under a hidden name beside it and
renamed into place when its first checkpoint verified, so that a ``.ckpt`` that exists always
holds a verified checkpoint (``ModelCheckpoint`` asks whether a name exists to pick the next
one). Removing a ``.ckpt`` renames it to a hidden name first, then deletes: a kill at any
moment leaves either the whole checkpoint or nothing a reader takes.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.plugins.io import CheckpointIO as _LightningCheckpointIO

from nbresume.checkpoint.backends import fsync_folder
from nbresume.checkpoint.format import LIGHTNING_DOCUMENT as DOCUMENT
from nbresume.checkpoint.format import LIGHTNING_FORMAT as FORMAT
from nbresume.checkpoint.format import LIGHTNING_FORMAT_VERSION as FORMAT_VERSION
from nbresume.checkpoint.format import LIGHTNING_TENSORS as TENSORS
from nbresume.checkpoint.format import decode_lightning, flatten
from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore, parse_json
from nbresume.errors import CheckpointError, NoCheckpointError, UsageError
from nbresume.frameworks.layout import committed

if TYPE_CHECKING:
    from nbresume.frameworks.watch import Watch

log = logging.getLogger("nbresume")

#: Hidden names beside the ``.ckpt`` folders: one being built, one being removed.
NEW_MARK = ".nbresume-new-"
GONE_MARK = ".nbresume-gone-"


class CheckpointIO(_LightningCheckpointIO):
    """Lightning's ``CheckpointIO`` storing verified safetensors + JSON, never pickle.

    ``Trainer(plugins=[nbresume.lightning.CheckpointIO()])``. Every path Lightning saves to
    (``epoch=0-step=10.ckpt``, ``last.ckpt``) becomes a folder of verified checkpoints.

    Args:
        keep: verified checkpoints kept in each ``.ckpt`` folder (``last.ckpt`` is saved again
            and again: the older ones go once a newer one verified).
        md5: also record MD5 hashes (stores that compare MD5s, such as Google Drive).
    """

    def __init__(self, *, keep: int = 1, md5: bool = False) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise UsageError(
                f"keep={keep!r} is not a positive integer",
                where="nbresume.lightning.CheckpointIO",
                fix="keep=1 keeps the newest verified checkpoint of each .ckpt",
            )
        self.keep = keep
        self.md5 = md5
        #: Set by :class:`nbresume.lightning.Callback` while training runs: each save of a
        #: ``.ckpt`` is then reported to the panel and the status line (on Drive until Drive
        #: confirms it), and its cost sizes the deadline margin.
        self.watch: Watch | None = None
        #: The newest save: its ``.ckpt`` path and its checkpoint.
        self._saved: tuple[str, CheckpointInfo] | None = None
        #: Removals waiting for Google Drive to confirm their replacement:
        #: ``(the .ckpt to remove, the replacement's .ckpt, its checkpoint)``.
        self._deferred: list[tuple[str, str, CheckpointInfo]] = []

    # -- save ----------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` as a verified nbresume checkpoint in the folder ``path``."""
        if storage_options is not None:
            raise UsageError(
                "nbresume.lightning.CheckpointIO takes no storage_options",
                where=str(path),
                fix="pass trainer.save_checkpoint(path) without storage_options",
            )
        document, tensors = encode_checkpoint(checkpoint)
        step = _step_of(checkpoint)
        target = _plain(path)
        # Saved again: no longer to remove. Removals whose replacement Drive confirmed go now.
        self._deferred = [d for d in self._deferred if d[0] != target]
        self._remove_confirmed()
        if not _is_local(target):
            self._save_into(target, step, document, tensors)
            return
        final = Path(target)
        if final.is_symlink():
            final.unlink()  # ModelCheckpoint(save_last="link")'s link, replaced by a checkpoint
        if final.is_file():
            raise UsageError(
                f"{final} is a file, not an nbresume checkpoint folder",
                where=str(final),
                fix="it was written without nbresume (a pickled .ckpt): move it away, or "
                f"convert it with `nbresume convert-lightning {final} DIR`",
            )
        _clean_leftovers(final.parent)
        if final.is_dir():
            self._save_into(target, step, document, tensors)
            return
        # A new .ckpt: build it hidden, rename it into place once its checkpoint verified.
        hidden = final.parent / f"{NEW_MARK}{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            self._save_into(str(hidden), step, document, tensors, final=final)
        finally:
            if hidden.exists():
                shutil.rmtree(hidden, ignore_errors=True)

    def _save_into(
        self,
        location: str,
        step: int,
        document: Any,
        tensors: dict[str, Any],
        *,
        final: Path | None = None,
    ) -> None:
        """Save into the ``.ckpt`` folder ``location``; with ``final``, ``location`` is the
        hidden folder that becomes ``final`` once its checkpoint verified."""
        store = CheckpointStore(location, keep=self.keep, md5=self.md5)
        with store.begin(step) as pending:
            if tensors:
                pending.write_tensors(TENSORS, tensors)
            pending.write_json(DOCUMENT, document)

            def save(on_committed: Callable[[CheckpointInfo], None]) -> CheckpointInfo:
                if final is None:
                    return pending.commit(on_committed=on_committed)
                moved = CheckpointStore(str(final), keep=None).backend
                # Reported under the name the checkpoint has once it is in place.
                info = pending.commit(
                    on_committed=lambda i: on_committed(replace(i, location=moved.child(i.name)))
                )
                os.rename(location, final)
                fsync_folder(final.parent)
                return replace(info, location=moved.child(info.name))

            watch = self.watch
            if watch is None:
                info = save(lambda _: None)
            else:
                # Every save reaches the panel and the status line; on Drive each .ckpt is
                # followed until Drive confirms it.
                landed = CheckpointStore(str(final) if final else location, keep=None)
                info = watch.commit(step, save, store=landed)
            self._saved = (_plain(str(final) if final else location), info)

    # -- load ----------------------------------------------------------------------------

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dictionary of ``path``: the newest checkpoint there that verifies.

        Nothing is parsed before its hash matched, and nothing is unpickled (``weights_only``
        changes nothing: there is no pickle to restrict). When nothing in ``path`` verifies,
        the newest ``.ckpt`` beside it that does is loaded, with a warning naming ``path``.
        """
        target = _plain(path)
        try:
            return load_folder(target, map_location)
        except CheckpointError as exc:
            if not _is_local(target) or not os.path.lexists(target):
                raise  # a path that names nothing is a mistake to report, not to work around
            problem = exc
        for other in ckpt_folders(Path(target).parent):
            if other == Path(target):
                continue
            try:
                loaded = load_folder(str(other), map_location)
            except CheckpointError:
                continue
            warnings.warn(
                f"nbresume: {target} could not be loaded ({problem}); "
                f"loading {other} instead, the newest checkpoint beside it that verifies",
                RuntimeWarning,
                stacklevel=2,
            )
            return loaded
        raise problem

    # -- remove ---------------------------------------------------------------------------

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the ``.ckpt`` folder ``path``: withdrawn from view in one step, then deleted.

        ``ModelCheckpoint`` removes a checkpoint only after the one replacing it was saved,
        and a save returns only once that checkpoint verified. On Google Drive's mount the
        removal waits until Drive confirmed that replacement (the newest save): it is done at
        a later save or removal once Drive did, or by :meth:`finish_removals`; training never
        waits for it.
        """
        target = _plain(path)
        self._remove_confirmed()
        saved = self._saved
        if saved is not None and saved[0] != target and not self._confirmed(*saved):
            # A VM that dies before Drive has the newer checkpoint still has this one there.
            log.info("nbresume: %s is removed once Drive confirms %s", target, saved[0])
            self._deferred.append((target, *saved))
            return
        self._remove(target)

    def finish_removals(self, timeout: float | None = None) -> list[str]:
        """Do the removals that wait for Google Drive to confirm their replacement, waiting
        up to ``timeout`` seconds (``None``: as long as it takes) for Drive; return the
        ``.ckpt`` folders still kept (a later run resumed from this folder removes them)."""
        import time

        started = time.monotonic()
        while True:
            self._remove_confirmed()
            if not self._deferred:
                return []
            left = None if timeout is None else timeout - (time.monotonic() - started)
            if left is not None and left <= 0:
                kept = [d[0] for d in self._deferred]
                log.warning(
                    "nbresume: Drive has not confirmed the newer checkpoints yet; kept %s",
                    ", ".join(kept),
                )
                return kept
            poll = CheckpointStore(self._deferred[0][1], keep=None).backend.durability_poll_s
            time.sleep(poll if left is None else min(poll, left))

    def _remove_confirmed(self) -> None:
        """Do the deferred removals whose replacement Drive has confirmed."""
        waiting = []
        for item in self._deferred:
            if self._confirmed(item[1], item[2]):
                self._remove(item[0])
            else:
                waiting.append(item)
        self._deferred = waiting

    @staticmethod
    def _confirmed(location: str, info: CheckpointInfo) -> bool:
        """Whether the checkpoint ``info`` of the ``.ckpt`` ``location`` is safe to rely on:
        always off Drive; on Drive once Drive reports every file (or once it was itself
        replaced, which retention does only after Drive confirmed the newer one)."""
        try:
            backend = CheckpointStore(location, keep=None).backend
            if not backend.write_back:
                return True
            if info.name not in backend.list_folders():
                return True
            return backend.durability(info.name, info.manifest).saved
        except (OSError, CheckpointError):
            return False

    def _remove(self, target: str) -> None:
        if not _is_local(target):
            store = CheckpointStore(target, keep=None)
            for _, name in store.checkpoint_folders():
                store.backend.delete(name)
            _remove_url(target)
            return
        final = Path(target)
        if final.is_symlink() or final.is_file():
            final.unlink()  # a save_last="link" link, or a file written without nbresume
            return
        if not final.is_dir():
            return
        try:
            store = CheckpointStore(target, keep=None)
            if store.backend.write_back:
                # Google Drive's mount: its delete() also frees the quota (no trash). What a
                # killed save left in the folder goes the same way (recover), not through the
                # mount into Drive's trash.
                store.backend.recover("")
                for _, name in store.checkpoint_folders():
                    store.backend.delete(name)
            gone = final.parent / f"{GONE_MARK}{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, gone)
            fsync_folder(final.parent)
        except (OSError, CheckpointError) as exc:
            # The newer checkpoint is saved and verified; failing now would end the run.
            warnings.warn(
                f"nbresume: could not remove {final} ({exc}); it is kept",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        shutil.rmtree(gone, ignore_errors=True)


# -- the format ----------------------------------------------------------------------------


def encode_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON document and the flat tensors of a Lightning checkpoint dictionary.

    A value that is neither a tensor nor a plain value is refused with its key path.
    """
    try:
        tree, tensors = flatten(checkpoint, name="checkpoint")
    except CheckpointError as exc:
        raise CheckpointError(
            f"{exc.message}; nbresume never pickles, so that loading a checkpoint can never "
            "run code",
            fix="keep what you add in on_save_checkpoint() and save_hyperparameters() to "
            "tensors, numbers, strings, lists and dicts (e.g. str() a path or a class, "
            "vars() a Namespace)",
        ) from None
    return {"format": FORMAT, "version": FORMAT_VERSION, DOCUMENT: tree}, tensors


def decode_checkpoint(
    document: Any, tensors: dict[str, Any], *, where: str, map_location: Any | None = None
) -> dict[str, Any]:
    """Rebuild the dictionary :func:`encode_checkpoint` split (CorruptCheckpointError if
    the document is not one: the check ``verify`` makes too)."""
    moved = {key: _mapped(t, map_location) for key, t in tensors.items()}
    return decode_lightning(document, moved, where=where)


def load_folder(location: str, map_location: Any | None = None) -> dict[str, Any]:
    """The newest checkpoint of the ``.ckpt`` folder ``location`` that verifies and decodes;
    an older one is taken with a warning. Raises a CheckpointError when none does."""
    local = Path(location)
    if _is_local(location):
        if local.is_file():
            raise CheckpointError(
                "this .ckpt is a file written without nbresume (a pickled checkpoint); "
                "nbresume never unpickles",
                where=location,
                fix=f"convert it once with `nbresume convert-lightning {location} DIR`",
            )
        if not local.is_dir():
            raise NoCheckpointError("there is no such checkpoint", where=location)
    store = CheckpointStore(location, keep=None)

    def check(loaded: Any) -> None:
        found["value"] = decode_checkpoint(
            loaded.data.get(DOCUMENT),
            loaded.tensors.get(TENSORS, {}),
            where=loaded.location,
            map_location=map_location,
        )

    found: dict[str, dict[str, Any]] = {}
    store.load(check=check)
    return found["value"]


def _mapped(tensor: Any, map_location: Any) -> Any:
    """``tensor`` (loaded on the CPU) moved as ``map_location`` asks: a device, or a
    ``{"from": "to"}`` dict; a function leaves it on the CPU."""
    if map_location is None or callable(map_location):
        return tensor
    if isinstance(map_location, dict):
        target = map_location.get(str(tensor.device))
        return tensor if target is None else tensor.to(target)
    return tensor.to(map_location)


def _step_of(checkpoint: dict[str, Any]) -> int:
    step = checkpoint.get("global_step", 0)
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0


# -- finding checkpoints -------------------------------------------------------------------


def ckpt_folders(directory: Path) -> list[Path]:
    """The ``*.ckpt`` folders directly in ``directory`` holding a committed checkpoint, the
    newest first (by step, then commit time; ``last*`` first among equals). Nothing is hashed."""
    seen: list[Path] = []
    for _, path, _ in committed(directory):
        if path not in seen:
            seen.append(path)
    return seen


def read_document(path: Path) -> Any:
    """The ``checkpoint.json`` document (its hash checked) of the newest checkpoint in the
    ``.ckpt`` folder ``path``, or ``None``."""
    name = f"{DOCUMENT}.json"
    try:
        store = CheckpointStore(str(path), keep=None)
        info = store.latest()
        if info is None or name not in info.manifest.files:
            return None
        raw = store.read_files(info.name, {name: info.manifest.files[name]})[name]
        # Bounded nesting: a document nested too deep is one that verify fails, never a
        # RecursionError at every resume.
        return parse_json(raw, where=f"{info.location}/{name}")
    except (CheckpointError, OSError):
        return None


def _clean_leftovers(directory: Path) -> None:
    """Remove what a killed save or removal left beside the ``.ckpt`` folders."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith((NEW_MARK, GONE_MARK)) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _plain(path: Any) -> str:
    """``path`` as a string; a ``file://`` URL as the local path it names."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return text[len("file://") :] if text.startswith("file://") else text


def _is_local(location: str) -> bool:
    return "://" not in location


def _remove_url(location: str) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(location)
    if fs.exists(root):
        fs.rm(root, recursive=True)
