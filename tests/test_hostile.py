"""Checkpoint folders written by someone else, on purpose or by accident.

Nothing in a checkpoint folder can make nbresume run code, read outside the folder, or crash
with anything but a :class:`CorruptCheckpointError` that names the file; a rejected
checkpoint is passed over for the next older one that verifies, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import string
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nbresume import CheckpointStore, CorruptCheckpointError, NoCheckpointError
from nbresume.checkpoint.format import Manifest, parse_manifest, step_dirname, tensorfile
from nbresume.errors import CheckpointError

ForgeManifest = Callable[..., Path]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class _CreatesFile:
    """Unpickling this object creates a file: the proof that a pickle was executed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def evil_pickle(sentinel: Path) -> bytes:
    return pickle.dumps(_CreatesFile(sentinel))


def evil_torch_file(sentinel: Path, tmp: Path) -> bytes:
    path = tmp / "evil.pt"
    torch.save({"model": _CreatesFile(sentinel)}, path)
    return path.read_bytes()


def test_the_planted_payloads_are_live(tmp_path: Path) -> None:
    """The control: the payloads below really do run code when loaded the unsafe way."""
    first, second = tmp_path / "ran-pickle", tmp_path / "ran-torch"
    pickle.loads(evil_pickle(first)).close()
    (tmp_path / "planted.pt").write_bytes(evil_torch_file(second, tmp_path))
    loaded = torch.load(tmp_path / "planted.pt", weights_only=False)
    loaded["model"].close()
    assert first.exists()
    assert second.exists()


@pytest.fixture
def good_store(ckpt_dir: Path) -> CheckpointStore:
    """A store whose step 1 is a good checkpoint; the tests plant step 2 by hand."""
    store = CheckpointStore(ckpt_dir, keep=None)
    store.save(1, tensors={"model": {"w": torch.arange(4.0)}}, data={"state": {"step": 1}})
    return store


def plant(ckpt_dir: Path, files: dict[str, bytes], step: int = 2) -> Path:
    """A step folder holding a normal checkpoint's files, some of them replaced by ``files``."""
    CheckpointStore(ckpt_dir, keep=None).save(
        step, tensors={"model": {"w": torch.ones(4)}}, data={"state": {"step": step}}
    )
    folder = ckpt_dir / step_dirname(step)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def assert_falls_back(store: CheckpointStore, name: str, *, warns: bool = True) -> None:
    """Loading passes over step 2 naming ``name`` and returns step 1; step 2 alone fails."""
    if warns:
        with pytest.warns(RuntimeWarning, match=re.escape(name)):
            loaded = store.load()
        assert [r.step for r in loaded.skipped] == [2]
    else:
        loaded = store.load()
    assert loaded.step == 1
    assert torch.equal(loaded.tensors["model"]["w"], torch.arange(4.0))
    with pytest.raises(NoCheckpointError, match=re.escape(name) if warns else "step 2"):
        store.load(2)


# -- pickles -----------------------------------------------------------------------------------


@pytest.mark.parametrize("victim", ["model.safetensors", "state.json"])
def test_a_pickle_in_a_listed_file_is_never_run(
    good_store: CheckpointStore,
    ckpt_dir: Path,
    tmp_path: Path,
    forge_manifest: ForgeManifest,
    victim: str,
) -> None:
    sentinel = tmp_path / "pwned"
    folder = plant(ckpt_dir, {victim: evil_pickle(sentinel)})
    forge_manifest(folder)  # the hashes match: only the contents betray it
    assert_falls_back(good_store, victim)
    assert not sentinel.exists()


@pytest.mark.parametrize("victim", ["model.pt", "data.pkl", "model.bin", "optimizer.pth"])
def test_a_manifest_naming_a_pickle_file_is_rejected(
    good_store: CheckpointStore,
    ckpt_dir: Path,
    tmp_path: Path,
    forge_manifest: ForgeManifest,
    victim: str,
) -> None:
    sentinel = tmp_path / "pwned"
    folder = plant(ckpt_dir, {victim: evil_torch_file(sentinel, tmp_path)})
    forge_manifest(folder)
    assert_falls_back(good_store, victim)
    failed = [r for r in good_store.verify().results if not r.ok]
    assert [r.step for r in failed] == [2]
    assert victim in failed[0].problem
    assert not sentinel.exists()


def test_pickles_next_to_a_valid_manifest_are_never_opened(
    good_store: CheckpointStore, ckpt_dir: Path, tmp_path: Path
) -> None:
    sentinel = tmp_path / "pwned"
    folder = ckpt_dir / step_dirname(1)
    (folder / "model.pt").write_bytes(evil_torch_file(sentinel, tmp_path))
    (folder / "data.pkl").write_bytes(evil_pickle(sentinel))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = good_store.load()
    assert loaded.step == 1
    assert set(loaded.tensors) == {"model"}
    assert set(loaded.data) == {"state"}
    assert good_store.verify().ok
    assert not sentinel.exists()


# -- manifests that lie --------------------------------------------------------------------------


def test_a_manifest_that_understates_a_size(
    good_store: CheckpointStore, ckpt_dir: Path, forge_manifest: ForgeManifest, sha256: Any
) -> None:
    folder = plant(ckpt_dir, {})
    real = folder / "model.safetensors"
    forge_manifest(folder, entries={real.name: {"size": 8, "sha256": sha256(real)}})
    assert_falls_back(good_store, "model.safetensors")


def test_a_manifest_that_claims_a_huge_size(
    good_store: CheckpointStore, ckpt_dir: Path, forge_manifest: ForgeManifest, sha256: Any
) -> None:
    folder = plant(ckpt_dir, {})
    real = folder / "state.json"
    forge_manifest(folder, entries={real.name: {"size": 10**15, "sha256": sha256(real)}})
    assert_falls_back(good_store, "state.json")


def test_a_manifest_with_another_files_hash(
    good_store: CheckpointStore, ckpt_dir: Path, forge_manifest: ForgeManifest, sha256: Any
) -> None:
    folder = plant(ckpt_dir, {})
    other = ckpt_dir / step_dirname(1) / "state.json"
    (folder / "state.json").write_bytes(b'{"step": 2, "lr": 10}')
    forge_manifest(
        folder, entries={"state.json": {"size": other.stat().st_size, "sha256": sha256(other)}}
    )
    assert_falls_back(good_store, "state.json")


def test_a_manifest_naming_a_missing_file(
    good_store: CheckpointStore, ckpt_dir: Path, forge_manifest: ForgeManifest
) -> None:
    folder = plant(ckpt_dir, {})
    forge_manifest(folder, files=["model.safetensors", "state.json", "optimizer.safetensors"])
    assert_falls_back(good_store, "optimizer.safetensors")


def test_a_manifest_of_another_step(
    good_store: CheckpointStore, ckpt_dir: Path, forge_manifest: ForgeManifest
) -> None:
    folder = plant(ckpt_dir, {})
    forge_manifest(folder, step=7)
    assert_falls_back(good_store, "manifest.json")


# -- escaping the folder -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "../x.json",
        "/etc/passwd",
        "a/b.json",
        ".hidden.json",
        "..json",
        "x.json\x00.txt",
        "a\\b.json",
    ],
)
def test_a_manifest_path_that_leaves_the_folder_is_rejected(
    good_store: CheckpointStore, ckpt_dir: Path, forge_manifest: ForgeManifest, name: str
) -> None:
    folder = plant(ckpt_dir, {})
    # Make the escape tempting: where it points, there is a file with the hash it claims.
    bait = ckpt_dir / "x.json"
    bait.write_text('{"stolen": true}')
    (folder / "a").mkdir()
    (folder / "a" / "b.json").write_text('{"stolen": true}')
    (folder / ".hidden.json").write_text('{"stolen": true}')
    target = {
        "../x.json": bait,
        "a/b.json": folder / "a" / "b.json",
        ".hidden.json": folder / ".hidden.json",
    }.get(name, bait)
    data = target.read_bytes()
    forge_manifest(
        folder,
        files=["model.safetensors"],
        entries={name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}},
    )
    assert_falls_back(good_store, "manifest.json")


def test_a_symlinked_file_is_not_followed(
    good_store: CheckpointStore, ckpt_dir: Path, tmp_path: Path, forge_manifest: ForgeManifest
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.safetensors"
    safetensors.numpy.save_file({"secret": np.arange(3.0)}, str(secret))
    folder = plant(ckpt_dir, {})
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(secret)
    forge_manifest(folder)  # hashes the link's target: as far as bytes go, it would match

    assert_falls_back(good_store, "model.safetensors")
    failed = [r for r in good_store.verify().results if not r.ok]
    assert [r.step for r in failed] == [2]


def test_a_symlinked_manifest_is_not_followed(
    good_store: CheckpointStore, ckpt_dir: Path, tmp_path: Path, forge_manifest: ForgeManifest
) -> None:
    folder = plant(ckpt_dir, {})
    real = forge_manifest(folder)
    moved = tmp_path / "manifest-elsewhere.json"
    real.rename(moved)
    real.symlink_to(moved)
    # A link is never followed: step 2 is a broken checkpoint, passed over with a warning
    # naming the manifest, and reported by verify as failed, never as verified.
    assert_falls_back(good_store, "manifest.json")
    report = good_store.verify()
    assert [(r.step, r.ok) for r in report.results] == [(1, True), (2, False)]
    assert "manifest.json" in report.results[1].problem
    assert not report.uncommitted


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_payload_that_is_not_a_regular_file_is_rejected(
    good_store: CheckpointStore, ckpt_dir: Path, kind: str
) -> None:
    """A FIFO would block a reader forever waiting for a writer; a folder cannot be read."""
    folder = plant(ckpt_dir, {})
    victim = folder / "state.json"
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    else:
        victim.mkdir()
    assert_falls_back(good_store, "state.json")
    failed = [r for r in good_store.verify().results if not r.ok]
    assert [r.step for r in failed] == [2]
    assert "state.json" in failed[0].problem


# -- malformed safetensors files ---------------------------------------------------------------


def raw_file(header: Any, data: bytes = b"", *, length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


def f32(shape: list[int], start: int, end: int) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": [start, end]}


MALFORMED: dict[str, bytes] = {
    "too short": b"\x01\x00",
    "huge header length": raw_file({}, length=2**63),
    "header length past the end": raw_file({}, length=50),
    "header over the size limit": raw_file({}, length=100_000_001) + b" " * 64,
    "header not json": raw_file(b"{not json"),
    "header not utf-8": raw_file(b'{"\xff": 1}'),
    "header not an object": raw_file([1, 2]),
    "deeply nested header": raw_file(b"[" * 100_000 + b"]" * 100_000),
    "entry not an object": raw_file({"w": [0, 4]}, b"\0" * 4),
    "unknown dtype": raw_file({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}),
    "lowercase dtype": raw_file({"w": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}}),
    "dtype not a string": raw_file({"w": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}}),
    "shape and bytes disagree": raw_file({"w": f32([3], 0, 16)}, b"\0" * 16),
    "negative dimension": raw_file({"w": f32([-1, -4], 0, 16)}, b"\0" * 16),
    "float dimension": raw_file({"w": f32([4.0], 0, 16)}, b"\0" * 16),  # type: ignore[list-item]
    "shape not a list": raw_file({"w": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}}),
    "offsets out of range": raw_file({"w": f32([250], 0, 1000)}, b"\0" * 16),
    "offsets reversed": raw_file({"w": f32([0], 8, 0)}, b"\0" * 8),
    "offsets overlap": raw_file({"a": f32([2], 0, 8), "b": f32([2], 4, 12)}, b"\0" * 12),
    "offsets leave a gap": raw_file({"a": f32([1], 0, 4), "b": f32([1], 8, 12)}, b"\0" * 12),
    "bytes after the last tensor": raw_file({"w": f32([1], 0, 4)}, b"\0" * 8),
    "three offsets": raw_file({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 4]}}),
    "metadata not strings": raw_file({"__metadata__": {"epoch": 3}}),
}


@pytest.mark.parametrize("data", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_safetensors_file_is_rejected_naming_it(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="not a valid safetensors file") as caught:
        tensorfile.decode(bytearray(data), where="/ckpt/000000000002/model.safetensors")
    assert caught.value.where == "/ckpt/000000000002/model.safetensors"


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("shape", [[0, 2**64], [0, 2**62, 16], [1] * 100])
def test_a_shape_no_framework_can_build_is_rejected(shape: list[int], framework: str) -> None:
    """Zero-sized tensors pass the byte count with any other dimension; that must not crash."""
    count = int(np.prod(shape, dtype=object))
    data = raw_file({"w": f32(shape, 0, 4 * count)}, b"\0" * 4 * count)
    try:
        loaded = tensorfile.decode(bytearray(data), where="m.safetensors", framework=framework)
    except CorruptCheckpointError as exc:
        error: CorruptCheckpointError | None = exc
    else:
        error = None
        assert list(loaded["w"].shape) == shape
    assert error is None or error.where == "m.safetensors"


@pytest.mark.parametrize(
    "case", ["offsets overlap", "unknown dtype", "huge header length", "shape and bytes disagree"]
)
def test_a_malformed_file_in_a_checkpoint_is_passed_over(
    good_store: CheckpointStore, ckpt_dir: Path, forge_manifest: ForgeManifest, case: str
) -> None:
    folder = plant(ckpt_dir, {"model.safetensors": MALFORMED[case]})
    forge_manifest(folder)
    assert_falls_back(good_store, "model.safetensors")


def test_json_that_is_not_json_is_passed_over(
    good_store: CheckpointStore, ckpt_dir: Path, forge_manifest: ForgeManifest
) -> None:
    folder = plant(ckpt_dir, {"state.json": b'{"step": 2,'})
    forge_manifest(folder)
    assert_falls_back(good_store, "state.json")


# -- fuzzing the two parsers -------------------------------------------------------------------

RAW_TOKENS = {"\x00RAW:1e999": "1e999", "\x00RAW:-1e999": "-1e999", "\x00RAW:NaN": "NaN"}


def json_text(document: Any) -> bytes:
    """JSON text, with a few tokens Python's encoder would never produce spliced in."""
    text = json.dumps(document)
    for marker, token in RAW_TOKENS.items():
        text = text.replace(json.dumps(marker), token)
    return text.encode()


json_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([0, -1, 2**63, 10**400, -(10**400)])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from([*RAW_TOKENS, "a" * 64, "f" * 64, "../x.json", "model.safetensors"])
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
file_names = st.builds(
    lambda first, rest, kind: f"{first}{rest}.{kind}",
    st.sampled_from(string.ascii_letters + string.digits + "_"),
    st.text(alphabet=string.ascii_letters + string.digits + "_-.", max_size=20),
    st.sampled_from(["json", "safetensors"]),
).filter(lambda name: name != "manifest.json" and ".." not in name)
hex_digits = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
file_entries = st.fixed_dictionaries(
    {"size": st.integers(min_value=0, max_value=2**63), "sha256": hex_digits},
    optional={"md5": st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)},
)
valid_documents = st.fixed_dictionaries(
    {
        "format": st.just("nbresume-checkpoint"),
        "format_version": st.just(1),
        "step": st.integers(min_value=0, max_value=10**15),
        "files": st.dictionaries(file_names, file_entries, min_size=1, max_size=5),
    },
    optional={
        "created": st.text(max_size=30),
        "writer": st.text(max_size=30),
        "metrics": st.dictionaries(
            st.text(max_size=10),
            st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**53), 2**53),
            max_size=4,
        ),
    },
)


def check_manifest_parser(data: bytes) -> Manifest | None:
    where = ""
    try:
        manifest = parse_manifest(data, where="fuzz/manifest.json")
    except CorruptCheckpointError as exc:
        where = exc.where
    if where:
        assert where == "fuzz/manifest.json"
        return None
    # Whatever was accepted can be written back and reads the same.
    assert parse_manifest(manifest.to_bytes(), where="again") == manifest
    return manifest


_VALID_PREFIX = (
    b'{"format": "nbresume-checkpoint", "format_version": 1, "step": 1, '
    b'"files": {"a.json": {"size": 1, "sha256": "' + b"0" * 64 + b'"}}'
)


@FUZZ
@given(st.binary(max_size=2048))
@example(b'{"format": "nbresume-checkpoint", "format_version": 1e999}')
@example(_VALID_PREFIX + b', "metrics": {"m": 1e999}}')
@example(_VALID_PREFIX + b', "metrics": {"m": 1' + b"0" * 400 + b"}}")
@example(_VALID_PREFIX + b', "step": 1' + b"0" * 5000 + b"}")
def test_fuzz_manifest_parser_on_arbitrary_bytes(data: bytes) -> None:
    check_manifest_parser(data)


@FUZZ
@given(valid_documents)
def test_fuzz_manifest_parser_accepts_every_valid_document(document: dict[str, Any]) -> None:
    manifest = check_manifest_parser(json_text(document))
    assert manifest is not None
    assert manifest.step == document["step"]
    assert {n: (e.size, e.sha256, e.md5) for n, e in manifest.files.items()} == {
        n: (e["size"], e["sha256"], e.get("md5")) for n, e in document["files"].items()
    }
    assert manifest.metrics == {k: float(v) for k, v in document.get("metrics", {}).items()}


@FUZZ
@given(valid_documents, st.data())
def test_fuzz_manifest_parser_on_mutated_documents(document: dict[str, Any], data: Any) -> None:
    keys = ["format", "format_version", "step", "files", "metrics", "created", "writer", "x"]
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["top", "delete", "entry", "rename", "metric"]))
        files = document.get("files")
        if where == "top":
            document[data.draw(st.sampled_from(keys))] = data.draw(json_values)
        elif where == "delete":
            document.pop(data.draw(st.sampled_from(keys)), None)
        elif isinstance(files, dict) and files and where in ("entry", "rename"):
            name = data.draw(st.sampled_from(sorted(files)))
            if where == "rename":
                files[data.draw(st.text(max_size=12) | json_leaves.map(str))] = files.pop(name)
            elif isinstance(files[name], dict):
                field = data.draw(st.sampled_from(["size", "sha256", "md5", "other"]))
                files[name][field] = data.draw(json_values)
            else:
                files[name] = data.draw(json_values)
        elif where == "metric":
            metrics = document.setdefault("metrics", {})
            if isinstance(metrics, dict):
                metrics[data.draw(st.text(max_size=5))] = data.draw(json_values)
    check_manifest_parser(json_text(document))


def check_safetensors_reader(data: bytes) -> None:
    where = "fuzz.safetensors"
    rejected_by = ""
    try:
        _, specs, _ = tensorfile.parse_header(data, where=where)
    except CorruptCheckpointError as exc:
        rejected_by = exc.where
    if rejected_by:
        assert rejected_by == where
        return
    for framework in ("numpy", "torch"):
        failure: CheckpointError | None = None
        try:
            tensors = tensorfile.decode(bytearray(data), where=where, framework=framework)
        except CheckpointError as exc:
            failure = exc
        if failure is not None:
            # The only failures allowed: corruption, or a dtype NumPy has no type for.
            corrupt = isinstance(failure, CorruptCheckpointError)
            assert corrupt or "NumPy cannot hold" in str(failure)
            continue
        assert set(tensors) == set(specs)
        for name, spec in specs.items():
            assert tuple(tensors[name].shape) == spec.shape


@FUZZ
@given(st.binary(max_size=1024))
def test_fuzz_safetensors_reader_on_arbitrary_bytes(data: bytes) -> None:
    check_safetensors_reader(data)


@FUZZ
@given(st.binary(max_size=300), st.binary(max_size=64))
@example(b'{"w": {"dtype": "I8", "shape": [0, 18446744073709551616], "data_offsets": [0, 0]}}', b"")
@example(b'{"w": {"dtype": "U8", "shape": [' + b"1," * 99 + b'1], "data_offsets": [0, 1]}}', b"x")
def test_fuzz_safetensors_reader_on_arbitrary_headers(header: bytes, tail: bytes) -> None:
    check_safetensors_reader(raw_file(header, tail))


NUMPY_DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int16", "int32", "int64", "bool"]
arrays = st.builds(
    lambda dtype, shape, seed: (
        np.random.default_rng(seed)
        .integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
        .view(dtype if dtype != "bool" else "uint8")
        .reshape(shape)
        .astype(dtype)
    ),
    st.sampled_from(NUMPY_DTYPES),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.integers(0, 2**32 - 1),
)
official_files = st.dictionaries(
    st.text(min_size=1, max_size=6), arrays, min_size=1, max_size=4
).map(safetensors.numpy.save)


@FUZZ
@given(official_files, st.data())
def test_fuzz_safetensors_reader_on_mutated_files(original: bytes, data: Any) -> None:
    check_safetensors_reader(original)  # unmutated: must load
    length = int.from_bytes(original[:8], "little")
    header = json.loads(original[8 : 8 + length])
    body = original[8 + length :]
    how = data.draw(st.sampled_from(["field", "entry", "metadata", "flip", "cut", "append"]))
    mutated = bytearray(original)
    if how in ("field", "entry", "metadata"):
        names = sorted(k for k in header if k != "__metadata__")
        name = data.draw(st.sampled_from(names))
        if how == "field":
            field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            header[name][field] = data.draw(
                json_values
                | st.sampled_from(["F32", "BF16", "F8_E4M3", "I64", "BOOL", "U64"])
                | st.lists(st.integers(-2, 2**65), max_size=3)
            )
        elif how == "entry":
            header[data.draw(st.text(max_size=4))] = data.draw(json_values)
        else:
            header["__metadata__"] = data.draw(json_values)
        mutated = bytearray(raw_file(json_text(header), body))
    elif how == "flip":
        position = data.draw(st.integers(0, len(mutated) - 1))
        mutated[position] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "cut":
        del mutated[data.draw(st.integers(0, len(mutated) - 1)) :]
    else:
        mutated += data.draw(st.binary(min_size=1, max_size=16))
    check_safetensors_reader(bytes(mutated))
