"""The on-disk format of a checkpoint, version 1 (specified in docs/format.md).

A checkpoint is one folder named by its zero-padded step::

    000000001500/
        model.safetensors        tensors, standard safetensors files
        optimizer.safetensors
        state.json               everything that is not a tensor, as JSON
        manifest.json            written last: every file with its size and SHA-256

The manifest is the commit marker: a folder without a valid manifest is not a checkpoint.
This module parses and checks manifests strictly, because a checkpoint folder may have been
written by anyone: nothing in a manifest is trusted until it has been validated here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from nbresume.errors import CorruptCheckpointError

FORMAT_NAME = "nbresume-checkpoint"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

MANIFEST_NAME = "manifest.json"
STEP_DIGITS = 12
# Temporary and retired folders start with a dot so that no reader mistakes them for
# checkpoints and so that `ls` hides them.
TEMP_PREFIX = ".nbresume-tmp-"
RETIRED_PREFIX = ".nbresume-old-"

MAX_MANIFEST_BYTES = 8 << 20
MAX_FILES = 10_000
HASH_ALGORITHM = "sha256"
# A payload file name: plain, no separators, no leading dot, one of the two allowed kinds.
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}\.(safetensors|json)")
_STEP_NAME = re.compile(rf"[0-9]{{{STEP_DIGITS},20}}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")


def step_dirname(step: int) -> str:
    """The folder name of the checkpoint at ``step`` (``1500`` -> ``"000000001500"``)."""
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return f"{step:0{STEP_DIGITS}d}"


def parse_step_dirname(name: str) -> int | None:
    """The step a folder name stands for, or ``None`` when the name is not a checkpoint's."""
    if _STEP_NAME.fullmatch(name):
        return int(name)
    return None


def is_valid_file_name(name: str) -> bool:
    """Whether ``name`` may appear in a manifest (a plain ``*.safetensors`` or ``*.json`` name)."""
    return bool(_FILE_NAME.fullmatch(name)) and name != MANIFEST_NAME and ".." not in name


@dataclass(frozen=True)
class FileEntry:
    """One payload file as the manifest records it."""

    size: int
    sha256: str
    md5: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "sha256": self.sha256}
        if self.md5 is not None:
            out["md5"] = self.md5
        return out


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint."""

    step: int
    files: Mapping[str, FileEntry]
    created: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)
    writer: str = ""
    format_version: int = FORMAT_VERSION

    @property
    def payload_bytes(self) -> int:
        """Total size of the payload files (the manifest itself excluded)."""
        return sum(entry.size for entry in self.files.values())

    def to_bytes(self) -> bytes:
        document = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "created": self.created,
            "writer": self.writer,
            "metrics": dict(self.metrics),
            "files": {name: self.files[name].to_json() for name in sorted(self.files)},
        }
        return (json.dumps(document, indent=1, sort_keys=False, allow_nan=False) + "\n").encode()


def check_version(version: object, supported: Collection[int], *, what: str, where: str) -> None:
    """Refuse a document of a version this nbresume does not read (a newer writer's)."""
    if version not in supported:
        raise CorruptCheckpointError(
            f"{what} {version!r} is not supported by this nbresume (it reads {sorted(supported)})",
            where=where,
            fix="upgrade nbresume: pip install -U nbresume",
        )


def parse_manifest(data: bytes, *, where: str, expected_step: int | None = None) -> Manifest:
    """Parse and validate a manifest; raise :class:`CorruptCheckpointError` naming ``where``.

    Never raises anything else, whatever ``data`` holds.
    """

    def bad(reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"invalid manifest: {reason}",
            where=where,
            fix="this checkpoint cannot be trusted; an older one will be used",
        )

    if len(data) > MAX_MANIFEST_BYTES:
        raise bad(f"{len(data)} bytes is larger than the limit of {MAX_MANIFEST_BYTES}")
    try:
        document = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"not valid JSON ({type(exc).__name__})") from None
    if not isinstance(document, dict):
        raise bad("not a JSON object")
    if document.get("format") != FORMAT_NAME:
        raise bad(f"'format' is not {FORMAT_NAME!r}")
    version = document.get("format_version")
    if not _is_int(version):
        raise bad("'format_version' is not an integer")
    check_version(version, SUPPORTED_VERSIONS, what="format version", where=where)
    step = document.get("step")
    if not _is_int(step) or step < 0:
        raise bad("'step' is not a non-negative integer")
    if expected_step is not None and step != expected_step:
        raise bad(f"'step' is {step} but the folder is named for step {expected_step}")
    files = document.get("files")
    if not isinstance(files, dict) or not files:
        raise bad("'files' is not a non-empty object")
    if len(files) > MAX_FILES:
        raise bad(f"{len(files)} files is more than the limit of {MAX_FILES}")
    entries: dict[str, FileEntry] = {}
    for name, entry in files.items():
        if not is_valid_file_name(name):
            raise bad(f"file name {name!r} is not a plain *.safetensors or *.json name")
        if not isinstance(entry, dict):
            raise bad(f"entry for {name!r} is not an object")
        size, sha256, md5 = entry.get("size"), entry.get("sha256"), entry.get("md5")
        if not _is_int(size) or size < 0:
            raise bad(f"size of {name!r} is not a non-negative integer")
        if not isinstance(sha256, str) or not _HEX64.fullmatch(sha256):
            raise bad(f"sha256 of {name!r} is not 64 lowercase hex digits")
        if md5 is not None and (not isinstance(md5, str) or not _HEX32.fullmatch(md5)):
            raise bad(f"md5 of {name!r} is not 32 lowercase hex digits")
        entries[name] = FileEntry(size=size, sha256=sha256, md5=md5)
    metrics = document.get("metrics", {})
    if not isinstance(metrics, dict) or not all(_is_finite(v) for v in metrics.values()):
        raise bad("'metrics' is not an object of finite numbers")
    created = document.get("created", "")
    writer = document.get("writer", "")
    if not isinstance(created, str) or not isinstance(writer, str):
        raise bad("'created' or 'writer' is not a string")
    return Manifest(
        step=step,
        files=entries,
        created=created,
        metrics={k: float(v) for k, v in metrics.items()},
        writer=writer,
        format_version=version,
    )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    # JSON reads 1e999 as inf, and an integer too large for a float cannot become a metric.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a manifest")
