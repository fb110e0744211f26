"""The on-disk format v1: folder names, the manifest as the commit marker, no pickle anywhere."""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash

from nbresume import CheckpointStore, CorruptCheckpointError, NoCheckpointError
from nbresume.checkpoint.format import Manifest, parse_manifest, parse_step_dirname, step_dirname

ForgeManifest = Callable[..., Path]


def save_sample(store: CheckpointStore, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    store.save(
        step,
        tensors={
            "model": {"w": torch.randn(4, 3, generator=gen), "b": torch.zeros(3)},
            "optimizer": {"exp_avg": torch.randn(4, 3, generator=gen)},
        },
        data={"state": {"step": step, "epoch": step // 10}},
        metrics={"val_loss": 1.0 / (step + 1)},
    )


# -- folder names ----------------------------------------------------------------------------


def test_step_folder_names_are_twelve_digits_and_sort_like_steps() -> None:
    steps = [0, 7, 99, 1500, 20_000, 999_999_999_999]
    names = [step_dirname(s) for s in steps]
    assert names[3] == "000000001500"
    assert all(len(n) == 12 and n.isdigit() for n in names)
    assert sorted(names) == names  # a plain `ls` lists checkpoints in step order
    assert [parse_step_dirname(n) for n in names] == steps


@pytest.mark.parametrize(
    "name", ["1500", "00000000150a", ".nbresume-tmp-000000001500-1-ab", "step_000000001500", ""]
)
def test_names_that_are_not_checkpoint_folders(name: str) -> None:
    assert parse_step_dirname(name) is None


def test_a_negative_step_is_refused() -> None:
    with pytest.raises(ValueError, match="-1"):
        step_dirname(-1)


# -- what a saved checkpoint holds -----------------------------------------------------------


def test_a_checkpoint_is_one_folder_with_its_files_and_a_manifest_of_them(ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir)
    save_sample(store, 1500)

    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["000000001500"]
    folder = ckpt_dir / "000000001500"
    on_disk = {p.name for p in folder.iterdir()}
    assert on_disk == {"model.safetensors", "optimizer.safetensors", "state.json", "manifest.json"}
    assert all(p.is_file() for p in folder.iterdir())

    document = json.loads((folder / "manifest.json").read_text())
    assert document["format"] == "nbresume-checkpoint"
    assert document["format_version"] == "1.1"
    assert document["hash"] == "xxh3-128"
    assert document["step"] == 1500
    assert document["metrics"] == {"val_loss": pytest.approx(1 / 1501)}
    assert set(document["files"]) == on_disk - {"manifest.json"}
    for name, entry in document["files"].items():
        data = (folder / name).read_bytes()
        assert entry["size"] == len(data)
        assert entry["xxh3-128"] == xxhash.xxh3_128(data).hexdigest()
        assert "md5" not in entry


def test_md5_is_recorded_when_asked(ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir, md5=True)
    save_sample(store, 3)
    folder = ckpt_dir / step_dirname(3)
    document = json.loads((folder / "manifest.json").read_text())
    for name, entry in document["files"].items():
        assert entry["md5"] == hashlib.md5((folder / name).read_bytes()).hexdigest()
    assert store.verify().ok


def test_no_file_of_a_checkpoint_is_a_pickle(ckpt_dir: Path) -> None:
    from safetensors import safe_open

    store = CheckpointStore(ckpt_dir)
    save_sample(store, 10)
    folder = ckpt_dir / step_dirname(10)
    for path in folder.iterdir():
        head = path.read_bytes()[:4]
        # Pickle protocols 2+ start with 0x80; torch.save writes a zip archive of pickles.
        assert not head.startswith(b"\x80"), path.name
        assert not head.startswith(b"PK\x03\x04"), path.name
        assert path.suffix in (".json", ".safetensors"), path.name
        if path.suffix == ".json":
            json.loads(path.read_text(), parse_constant=pytest.fail)
        else:
            with safe_open(str(path), framework="pt") as handle:
                assert list(handle.keys())


# -- the manifest is the commit marker -------------------------------------------------------


def test_a_step_folder_without_manifest_is_not_a_checkpoint(ckpt_dir: Path) -> None:
    store = CheckpointStore(ckpt_dir, keep=1)
    save_sample(store, 1)
    # Everything of step 2 is there except the manifest: it was never committed.
    save_sample(CheckpointStore(ckpt_dir, keep=None), 2)
    (ckpt_dir / step_dirname(2) / "manifest.json").unlink()

    assert [i.step for i in store.list()] == [1]
    assert store.latest() is not None
    assert store.latest().step == 1  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert store.load().step == 1
    # Retention does not touch what it does not understand.
    assert store.prune(keep=1) == []
    assert (ckpt_dir / step_dirname(2)).is_dir()


def test_only_an_uncommitted_folder_means_no_checkpoint(ckpt_dir: Path) -> None:
    save_sample(CheckpointStore(ckpt_dir), 5)
    (ckpt_dir / step_dirname(5) / "manifest.json").unlink()
    store = CheckpointStore(ckpt_dir)
    assert store.list() == []
    assert store.latest() is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(NoCheckpointError):
            store.load()


def test_leftover_temporary_folders_are_ignored_then_cleaned_by_the_next_save(
    ckpt_dir: Path,
) -> None:
    store = CheckpointStore(ckpt_dir, keep=None)
    save_sample(store, 1)
    save_sample(store, 2)
    # What a writer killed after writing the manifest but before the rename leaves behind:
    # a complete copy, manifest included, in a hidden temporary folder.
    leftover = ckpt_dir / ".nbresume-tmp-000000000002-4242-deadbeef"
    (ckpt_dir / step_dirname(2)).rename(leftover)
    half = ckpt_dir / ".nbresume-tmp-000000000003-4243-cafef00d"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\x00" * 100)

    assert [i.step for i in store.list()] == [1]
    assert [r.name for r in store.verify().results] == [step_dirname(1)]
    assert store.load().step == 1

    save_sample(store, 4)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [step_dirname(1), step_dirname(4)]


def test_a_hand_written_checkpoint_from_the_specification_loads(
    ckpt_dir: Path, forge_manifest: ForgeManifest
) -> None:
    """Another tool that follows docs/format.md (official safetensors + a JSON manifest)
    writes checkpoints nbresume loads."""
    from safetensors.torch import save_file

    folder = ckpt_dir / step_dirname(77)
    folder.mkdir(parents=True)
    weights = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.tensor(5)}
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "state.json").write_text(json.dumps({"lr": 0.1, "tags": ["a", "b"]}))
    forge_manifest(folder, metrics={"val_loss": 0.5})

    store = CheckpointStore(ckpt_dir)
    assert store.verify().summary == "OK 1/1, errors 0"
    loaded = store.load()
    assert loaded.step == 77
    assert loaded.data == {"state": {"lr": 0.1, "tags": ["a", "b"]}}
    assert set(loaded.tensors["model"]) == {"w", "n"}
    for name, tensor in weights.items():
        assert loaded.tensors["model"][name].dtype == tensor.dtype
        assert torch.equal(loaded.tensors["model"][name], tensor)
    assert store.list()[0].metrics == {"val_loss": 0.5}


# -- parsing a manifest ----------------------------------------------------------------------


def _good_document() -> dict[str, object]:
    return {
        "format": "nbresume-checkpoint",
        "format_version": 1,
        "step": 12,
        "created": "2024-01-01T00:00:00+00:00",
        "writer": "somebody",
        "metrics": {"val_loss": 0.25, "acc": 1},
        "files": {
            "model.safetensors": {"size": 1024, "sha256": "ab" * 32},
            "state.json": {"size": 0, "sha256": "0" * 64, "md5": "f" * 32},
        },
    }


def test_a_valid_manifest_parses_and_writes_back_the_same() -> None:
    manifest = parse_manifest(json.dumps(_good_document()).encode(), where="m", expected_step=12)
    assert manifest.step == 12
    assert manifest.payload_bytes == 1024
    assert manifest.files["state.json"].md5 == "f" * 32
    assert manifest.metrics == {"val_loss": 0.25, "acc": 1.0}
    assert parse_manifest(manifest.to_bytes(), where="m") == manifest
    assert isinstance(manifest, Manifest)


Mutation = Callable[[dict[str, object]], None]


def _set(key: str, value: object) -> Mutation:
    return lambda doc: doc.__setitem__(key, value)


def _file(name: str, entry: object) -> Mutation:
    return lambda doc: doc.__setitem__("files", {name: entry})


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (_set("format", "safetensors"), "'format'"),
        (_set("format_version", "1"), "format_version"),
        (_set("step", -1), "'step'"),
        (_set("step", True), "'step'"),
        (_set("step", 13), "folder is named for step 12"),
        (_set("files", {}), "'files'"),
        (_set("files", []), "'files'"),
        (_set("metrics", {"loss": "low"}), "'metrics'"),
        (_set("metrics", {"loss": True}), "'metrics'"),
        (_set("created", 5), "'created'"),
        (_file("model.pt", {"size": 1, "sha256": "0" * 64}), "model.pt"),
        (_file("data.pkl", {"size": 1, "sha256": "0" * 64}), "data.pkl"),
        (_file("manifest.json", {"size": 1, "sha256": "0" * 64}), "manifest.json"),
        (_file("a.json", {"size": -1, "sha256": "0" * 64}), "size"),
        (_file("a.json", {"size": 1.0, "sha256": "0" * 64}), "size"),
        (_file("a.json", {"size": 1, "sha256": "AB" * 32}), "sha256"),
        (_file("a.json", {"size": 1, "sha256": "0" * 63}), "sha256"),
        (_file("a.json", {"size": 1, "sha256": "0" * 64, "md5": "x"}), "md5"),
        (_file("a.json", [1, "0" * 64]), "not an object"),
    ],
)
def test_an_invalid_manifest_is_rejected_with_the_reason(mutate: Mutation, reason: str) -> None:
    document = _good_document()
    mutate(document)
    with pytest.raises(CorruptCheckpointError, match="invalid manifest") as caught:
        parse_manifest(json.dumps(document).encode(), where="/x/manifest.json", expected_step=12)
    assert reason in str(caught.value)
    assert caught.value.where == "/x/manifest.json"


@pytest.mark.parametrize(
    "text", [b"", b"\xff\xfe", b"[]", b'"manifest"', b"{", b'{"metrics": {"a": NaN}}']
)
def test_a_manifest_that_is_not_a_json_object_is_rejected(text: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="invalid manifest"):
        parse_manifest(text, where="m")


@pytest.mark.parametrize("number", ["NaN", "Infinity", "1e999", "1" + "0" * 400])
def test_a_metric_that_is_not_a_finite_number_is_rejected(number: str) -> None:
    text = json.dumps(_good_document()).replace("0.25", number).encode()
    with pytest.raises(CorruptCheckpointError, match="invalid manifest"):
        parse_manifest(text, where="m")


def test_a_newer_format_version_asks_for_an_upgrade() -> None:
    document = _good_document()
    document["format_version"] = 2
    with pytest.raises(CorruptCheckpointError, match="version 2") as caught:
        parse_manifest(json.dumps(document).encode(), where="m")
    assert "pip install -U nbresume" in caught.value.fix


def test_an_oversized_manifest_is_refused_before_parsing() -> None:
    text = json.dumps(_good_document()).encode()
    padded = text[:-1] + b" " * (9 << 20) + b"}"
    with pytest.raises(CorruptCheckpointError, match="larger than the limit"):
        parse_manifest(padded, where="m")


def test_verify_reports_an_uncommitted_folder_as_such_not_as_a_failure(
    ckpt_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nbresume.cli import main

    save_sample(CheckpointStore(ckpt_dir), 5)
    save_sample(CheckpointStore(ckpt_dir), 6)
    (ckpt_dir / step_dirname(6) / "manifest.json").unlink()
    report = CheckpointStore(ckpt_dir).verify()
    assert [r.step for r in report.results] == [5]
    assert report.uncommitted == (step_dirname(6),)
    assert report.ok
    assert main(["verify", str(ckpt_dir)]) == 0
    out = capsys.readouterr().out
    assert "OK 1/1, errors 0" in out
    assert f"not checkpoints: {step_dirname(6)}" in out
