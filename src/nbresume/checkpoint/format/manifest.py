"""The on-disk format of a checkpoint, versions 1 and 1.1 (specified in docs/format.md).

A checkpoint is one folder named by its zero-padded step::

    000000001500/
        model.safetensors        tensors, standard safetensors files
        optimizer.safetensors
        state.json               everything that is not a tensor, as JSON
        manifest.json            written last: every file with its size and hash

The manifest is the commit marker: a folder without a valid manifest is not a checkpoint.
Version 1 hashes every file with SHA-256 (``"sha256"`` in each entry); version 1.1 names its
hash at the top (``"hash": "xxh3-128"`` or ``"sha256"``) and each entry holds its digest under
that name. nbresume writes version 1 whenever the hash is SHA-256, so that such a checkpoint is
byte for byte what earlier releases wrote.
This module parses and checks manifests strictly, because a checkpoint folder may have been
written by anyone: nothing in a manifest is trusted until it has been validated here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeGuard

from nbresume.errors import CorruptCheckpointError

FORMAT_NAME = "nbresume-checkpoint"
FORMAT_VERSION = 1
#: The version of a manifest that names its hash (written for any hash but SHA-256).
HASH_NAMED_VERSION = "1.1"
SUPPORTED_VERSIONS: frozenset[int | str] = frozenset({1, HASH_NAMED_VERSION})

MANIFEST_NAME = "manifest.json"
STEP_DIGITS = 12
# Temporary and retired folders start with a dot so that no reader mistakes them for
# checkpoints and so that `ls` hides them.
TEMP_PREFIX = ".nbresume-tmp-"
RETIRED_PREFIX = ".nbresume-old-"

MAX_MANIFEST_BYTES = 8 << 20
#: Largest JSON payload file (``state.json``, a sharded checkpoint's metadata), written or
#: read: parsing JSON can take fifty times its size in memory, so 32 MiB stays under 2 GB.
MAX_JSON_BYTES = 32 << 20
MAX_FILES = 10_000
#: The hash of a version 1 manifest.
HASH_ALGORITHM = "sha256"
#: Every hash a manifest may name, with the length of its digest in hex digits.
HASH_DIGITS = {"sha256": 64, "xxh3-128": 32}
# A payload file name: plain, no separators, no leading dot, one of the two allowed kinds.
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}\.(safetensors|json)")
_STEP_NAME = re.compile(rf"[0-9]{{{STEP_DIGITS},20}}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_VERSION = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}")
_HEX = {name: re.compile(f"[0-9a-f]{{{digits}}}") for name, digits in HASH_DIGITS.items()}


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
    """One payload file as the manifest records it: its size, its digest under the hash
    ``algorithm`` (``"sha256"`` or ``"xxh3-128"``), and optionally its MD5."""

    size: int
    digest: str
    md5: str | None = None
    algorithm: str = HASH_ALGORITHM

    @property
    def sha256(self) -> str | None:
        """The SHA-256 in hex where that is the entry's hash (``None`` otherwise)."""
        return self.digest if self.algorithm == "sha256" else None

    def to_json(self) -> dict[str, Any]:
        """The entry as the manifest holds it: the digest under the hash's name."""
        out: dict[str, Any] = {"size": self.size, self.algorithm: self.digest}
        if self.md5 is not None:
            out["md5"] = self.md5
        return out

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> FileEntry:
        """The entry :meth:`to_json` gave, passed between processes (unchecked: a manifest
        is parsed by :func:`parse_manifest`)."""
        algorithm = next((name for name in HASH_DIGITS if name in entry), HASH_ALGORITHM)
        return cls(entry["size"], entry[algorithm], entry.get("md5"), algorithm)


def manifest_hash(files: Mapping[str, FileEntry]) -> str:
    """The one hash every entry of ``files`` uses."""
    algorithms = {entry.algorithm for entry in files.values()} or {HASH_ALGORITHM}
    if len(algorithms) > 1:
        raise ValueError(f"a manifest names one hash; these entries use {sorted(algorithms)}")
    return algorithms.pop()


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint."""

    step: int
    files: Mapping[str, FileEntry]
    created: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)
    writer: str = ""
    #: Set from the files' hash when written: 1 for SHA-256, "1.1" for any other.
    format_version: int | str = FORMAT_VERSION

    @property
    def payload_bytes(self) -> int:
        """Total size of the payload files (the manifest itself excluded)."""
        return sum(entry.size for entry in self.files.values())

    @property
    def hash(self) -> str:
        """The hash of every file (``"sha256"`` in a version 1 manifest)."""
        return manifest_hash(self.files)

    def to_bytes(self) -> bytes:
        algorithm = self.hash
        document: dict[str, Any] = {
            "format": FORMAT_NAME,
            # A SHA-256 manifest is exactly version 1; another hash needs a reader of 1.1.
            "format_version": FORMAT_VERSION if algorithm == HASH_ALGORITHM else HASH_NAMED_VERSION,
        }
        if algorithm != HASH_ALGORITHM:
            document["hash"] = algorithm
        document.update(
            step=self.step,
            created=self.created,
            writer=self.writer,
            metrics=dict(self.metrics),
            files={name: self.files[name].to_json() for name in sorted(self.files)},
        )
        return (json.dumps(document, indent=1, sort_keys=False, allow_nan=False) + "\n").encode()


def check_version(
    version: object, supported: Collection[int | str], *, what: str, where: str
) -> None:
    """Refuse a document of a version this nbresume does not read (a newer writer's)."""
    if version not in supported:
        raise CorruptCheckpointError(
            f"{what} {version!r} is not supported by this nbresume "
            f"(it reads {sorted(supported, key=str)})",
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
    if not _is_int(version) and not (isinstance(version, str) and _VERSION.fullmatch(version)):
        raise bad("'format_version' is not an integer or a version such as \"1.1\"")
    check_version(version, SUPPORTED_VERSIONS, what="format version", where=where)
    algorithm = document.get("hash", HASH_ALGORITHM) if version != 1 else HASH_ALGORITHM
    if algorithm not in HASH_DIGITS:
        raise bad(f"'hash' is {algorithm!r}, not one of {sorted(HASH_DIGITS)}")
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
        size, digest, md5 = entry.get("size"), entry.get(algorithm), entry.get("md5")
        if not _is_int(size) or size < 0:
            raise bad(f"size of {name!r} is not a non-negative integer")
        if not isinstance(digest, str) or not _HEX[algorithm].fullmatch(digest):
            raise bad(
                f"{algorithm} of {name!r} is not {HASH_DIGITS[algorithm]} lowercase hex digits"
            )
        if md5 is not None and (not isinstance(md5, str) or not _HEX32.fullmatch(md5)):
            raise bad(f"md5 of {name!r} is not 32 lowercase hex digits")
        entries[name] = FileEntry(size, digest, md5, algorithm)
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


def created_time(created: str) -> float | None:
    """The Unix time of a manifest's ``created`` (ISO 8601, as :attr:`Manifest.created`
    holds it), or ``None`` where it is empty or not a time."""
    try:
        return datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    except (TypeError, ValueError, AttributeError):
        return None
