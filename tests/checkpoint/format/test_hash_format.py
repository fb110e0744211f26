"""The checkpoint's hash: XXH3-128 in format v1.1 by default, SHA-256 (format v1) on request.

A v1.1 manifest names its hash at the top and holds each file's digest under that name; a
SHA-256 checkpoint is written exactly as format v1. Both golden checkpoints load with today's
code, and a Python without ``xxhash`` still imports nbresume, saves with SHA-256, and says
what to install when it meets an XXH3-128 checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from tests.test_golden import expected_tensors

from nbresume import CheckpointStore, CorruptCheckpointError, UsageError
from nbresume.checkpoint.format import MANIFEST_NAME, FileEntry, parse_manifest, step_dirname
from testkit.paths import TESTS

GOLDEN_V1_1 = TESTS / "golden" / "v1.1"


def manifest_of(root: Path, step: int) -> dict:
    return json.loads((root / step_dirname(step) / MANIFEST_NAME).read_text())


def save_one(store: CheckpointStore, step: int = 1) -> None:
    gen = torch.Generator().manual_seed(step)
    store.save(step, tensors={"model": {"w": torch.randn(3000, generator=gen)}}, data={"n": step})


def test_the_v1_1_golden_checkpoint_verifies_and_loads_exactly(tmp_path: Path) -> None:
    copy = Path(shutil.copytree(GOLDEN_V1_1, tmp_path / "v1.1"))
    store = CheckpointStore(copy)
    assert store.verify().summary == "OK 1/1, errors 0"
    [info] = store.list()
    assert info.manifest.format_version == "1.1"
    assert info.manifest.hash == "xxh3-128"
    loaded = store.load()
    assert loaded.step == 1500
    for stem, group in expected_tensors().items():
        assert set(loaded.tensors[stem]) == set(group)
        for name, want in group.items():
            got = loaded.tensors[stem][name]
            assert got.dtype == want.dtype, name
            assert torch.equal(got, want), name


def test_a_new_checkpoint_names_xxh3_128_and_records_each_file_digest(tmp_path: Path) -> None:
    save_one(CheckpointStore(tmp_path))
    document = manifest_of(tmp_path, 1)
    assert (document["format_version"], document["hash"]) == ("1.1", "xxh3-128")
    for name, entry in document["files"].items():
        data = (tmp_path / step_dirname(1) / name).read_bytes()
        assert entry == {"size": len(data), "xxh3-128": xxhash.xxh3_128(data).hexdigest()}


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_sha256_on_request_writes_format_v1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "environment":
        monkeypatch.setenv("NBRESUME_HASH", "sha256")
        store = CheckpointStore(tmp_path, md5=True)
    else:
        store = CheckpointStore(tmp_path, md5=True, hash="sha256")
    save_one(store)
    document = manifest_of(tmp_path, 1)
    assert document["format_version"] == 1
    assert "hash" not in document
    for name, entry in document["files"].items():
        data = (tmp_path / step_dirname(1) / name).read_bytes()
        assert entry == {
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "md5": hashlib.md5(data).hexdigest(),
        }
    assert CheckpointStore(tmp_path).load().data == {"n": 1}


def test_checkpoints_of_both_hashes_load_side_by_side(tmp_path: Path) -> None:
    save_one(CheckpointStore(tmp_path, keep=None, hash="sha256"), 1)
    save_one(CheckpointStore(tmp_path, keep=None), 2)
    store = CheckpointStore(tmp_path, keep=None, hash="sha256")
    assert [r.ok for r in store.verify().results] == [True, True]
    assert store.load(step=1).data == {"n": 1}
    assert store.load().data == {"n": 2}


def test_an_unknown_hash_is_refused_where_it_is_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(UsageError, match="md4"):
        CheckpointStore(tmp_path, hash="md4")
    monkeypatch.setenv("NBRESUME_HASH", "crc32")
    with pytest.raises(UsageError, match="NBRESUME_HASH"):
        save_one(CheckpointStore(tmp_path))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda d: d.update(hash="md5"), "'hash' is 'md5'"),
        (lambda d: d.update(format_version="1.2"), "format version '1.2' is not supported"),
        (lambda d: d.update(format_version="one"), "format_version"),
        (lambda d: d["files"]["n.json"].update({"xxh3-128": "ab" * 8}), "32 lowercase hex"),
        (lambda d: d["files"]["n.json"].pop("xxh3-128"), "32 lowercase hex"),
        (lambda d: d.pop("hash"), "sha256 of"),  # v1.1 without a hash means SHA-256
    ],
)
def test_a_malformed_v1_1_manifest_is_refused(tmp_path: Path, change, reason: str) -> None:
    save_one(CheckpointStore(tmp_path))
    document = manifest_of(tmp_path, 1)
    change(document)
    with pytest.raises(CorruptCheckpointError, match=reason):
        parse_manifest(json.dumps(document).encode(), where="manifest.json")


def test_one_checkpoint_holds_one_hash(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with store.begin(1) as pending:
        pending.write_json("a", {"x": 1})
        with pytest.raises(UsageError, match="same hash"):
            pending.add_entries({"b.json": FileEntry(2, "0" * 64, None, "sha256")})


_WITHOUT_XXHASH = """
import sys, json
sys.modules["xxhash"] = None  # as if it were not installed
import torch
from nbresume import CheckpointStore, CheckpointError
root, step = sys.argv[1], int(sys.argv[2])
store = CheckpointStore(root, keep=None)
store.save(step, tensors={"model": {"w": torch.ones(4)}})
print(json.dumps([i.manifest.hash for i in store.list() if i.step == step][0]))
try:
    store.load(step=int(sys.argv[3]))
except CheckpointError as exc:
    print(json.dumps([type(exc).__name__, exc.message, exc.fix]))
"""


def test_without_xxhash_nbresume_saves_sha256_and_names_the_fix(tmp_path: Path) -> None:
    save_one(CheckpointStore(tmp_path, keep=None), 1)  # XXH3-128
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent / "src")}
    env.pop("NBRESUME_HASH", None)
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_XXHASH, str(tmp_path), "2", "1"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    newest, error = map(json.loads, done.stdout.splitlines())
    assert newest == "sha256"
    assert error[0] == "CheckpointError"
    assert "xxhash" in error[1]
    assert "pip install xxhash" in error[2]
    assert manifest_of(tmp_path, 2)["format_version"] == 1
