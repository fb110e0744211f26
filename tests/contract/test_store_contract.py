"""The storage contract: what a user relies on, whichever backend holds the checkpoints.

Every test runs on every backend of ``conftest.BACKENDS``. A test may look at how a backend
reached the promised state (atomic rename on a POSIX folder, manifest-last on an object store),
but the promise checked is the same everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from nbresume.checkpoint.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    TEMP_PREFIX,
    parse_manifest,
    step_dirname,
)
from nbresume.checkpoint.store.store import CheckpointInfo, CheckpointStore
from nbresume.cli import main
from nbresume.errors import NoCheckpointError, UsageError
from testkit.backends import Backend, payload, settle
from testkit.paths import with_testkit

OTHER_PROCESS = Path(__file__).with_name("other_process.py")


def torch_state(step: int) -> dict[str, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(step)
    return {
        "model": {
            "layer.weight": torch.randn(5, 3, generator=generator),
            "layer.bias": torch.randn(3, generator=generator).to(torch.bfloat16),
            "embedding": torch.randint(0, 1000, (4, 2), generator=generator),
            "mask": torch.rand(6, generator=generator) > 0.5,
            "scale": torch.tensor(step / 7, dtype=torch.float64),
            "empty": torch.zeros(0, 3),
        },
        "optimizer": {"exp_avg": torch.randn(5, 3, generator=generator).half()},
    }


def save_state(store: CheckpointStore, step: int, **kwargs: Any) -> CheckpointInfo:
    return store.save(
        step,
        tensors=torch_state(step),
        data={"state": {"step": step, "epoch": step // 3}},
        **kwargs,
    )


def assert_same_tensors(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name], tensor), name


def steps(infos: list[CheckpointInfo]) -> list[int]:
    return [info.step for info in infos]


def quietly(store: CheckpointStore, step: int | None = None) -> Any:
    """``load`` that fails the test on any warning (a fallback that should not happen)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return store.load(step)


def test_round_trip_of_tensors_and_json(backend: Backend) -> None:
    state = {"step": 7, "rng": [1, 2, 3], "name": "résumé", "nested": {"none": None, "f": 0.5}}
    info = backend.open().save(
        7, tensors=torch_state(7), data={"state": state}, metrics={"val_loss": 0.25}
    )

    loaded = quietly(backend.open())
    assert loaded.step == info.step == 7
    assert loaded.tensors.keys() == {"model", "optimizer"}
    for stem, tensors in torch_state(7).items():
        assert_same_tensors(loaded.tensors[stem], tensors)
    assert loaded.data == {"state": state}
    assert dict(loaded.manifest.metrics) == {"val_loss": 0.25}
    assert loaded.skipped == []
    # The folder holds exactly the files its manifest names, next to the manifest.
    assert backend.files(info.name) == {
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
        MANIFEST_NAME,
    }


def test_list_and_latest_are_ordered_by_step(backend: Backend) -> None:
    empty = backend.open(keep=None)
    assert empty.list() == []
    assert empty.latest() is None
    assert not empty.verify().ok
    with pytest.raises(NoCheckpointError):
        empty.load()

    store = backend.open(keep=None)
    for step in (10, 2, 1_000_000, 30):
        store.save(step, data={"state": {"step": step}})

    for reader in (store, backend.open(keep=None)):
        assert steps(reader.list()) == [2, 10, 30, 1_000_000]
        latest = reader.latest()
        assert latest is not None
        assert latest.step == 1_000_000
        assert quietly(reader).data == {"state": {"step": 1_000_000}}
        assert quietly(reader, 10).data == {"state": {"step": 10}}


def test_verify_reads_back_every_checkpoint(backend: Backend) -> None:
    store = backend.open(keep=None)
    infos = [save_state(store, step) for step in (1, 2, 3)]

    report = backend.open().verify()
    assert report.ok
    assert report.summary == "OK 3/3, errors 0"
    assert [(r.step, r.ok, r.size) for r in report.results] == [
        (i.step, True, i.size) for i in infos
    ]
    assert [r.step for r in backend.open().verify(step=2).results] == [2]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_file_fails_verify_and_load_falls_back(backend: Backend, damage: str) -> None:
    store = backend.open(keep=None)
    for step in (1, 2, 3):
        save_state(store, step)
    newest = step_dirname(3)
    original = backend.read(newest, "model.safetensors")
    if damage == "flip":
        middle = len(original) // 2
        spoiled = original[:middle] + bytes([original[middle] ^ 0xFF]) + original[middle + 1 :]
    else:
        spoiled = original[: len(original) - 10]
    backend.write(spoiled, newest, "model.safetensors")

    # The store that wrote it (listings possibly cached) and a fresh one agree.
    for reader in (store, backend.open(keep=None)):
        report = reader.verify()
        assert not report.ok
        assert report.summary == "OK 2/3, errors 1"
        bad = [r for r in report.results if not r.ok]
        assert [r.step for r in bad] == [3]
        assert "model.safetensors" in bad[0].problem

        with pytest.warns(RuntimeWarning, match=r"skipped 1 newer checkpoint.*model\.safetensors"):
            loaded = reader.load()
        assert loaded.step == 2
        assert [r.step for r in loaded.skipped] == [3]
        assert_same_tensors(loaded.tensors["model"], torch_state(2)["model"])


@pytest.mark.parametrize("damage", ["empty", "oversized"])
def test_a_damaged_manifest_is_reported_and_load_falls_back(backend: Backend, damage: str) -> None:
    store = backend.open(keep=None)
    for step in (1, 2):
        save_state(store, step)
    newest = step_dirname(2)
    # An empty object (S3 refuses a ranged read of one), or one past the manifest size limit.
    spoiled = b"" if damage == "empty" else b" " * (MAX_MANIFEST_BYTES + 1)
    backend.write(spoiled, newest, MANIFEST_NAME)

    for reader in (store, backend.open(keep=None)):
        assert steps(reader.list()) == [1]
        [broken] = reader.broken()
        assert broken.step == 2
        assert "invalid manifest" in broken.problem
        assert reader.verify().summary == "OK 1/2, errors 1"
        with pytest.warns(RuntimeWarning, match="skipped 1 newer checkpoint"):
            assert reader.load().step == 1


def test_a_step_saved_again_over_a_killed_write_of_it_holds_only_the_new_files(
    backend: Backend,
) -> None:
    """A killed write of a step leaves a stray file; saving that step again must leave only the
    new save's files, which verify and load."""
    store = backend.open(keep=None)
    layer = store.backend
    folder = layer.begin(step_dirname(2))
    handle = layer.open_write(folder, "stray.bin")
    handle.write(b"left by a writer killed before its commit")
    layer.close_durably(handle)

    fresh = backend.open(keep=None)
    save_state(fresh, 2)
    assert "stray.bin" not in backend.files(step_dirname(2))
    assert fresh.verify().summary == "OK 1/1, errors 0"
    assert quietly(fresh).step == 2


def test_an_uncommitted_write_is_not_a_checkpoint_and_the_next_save_cleans_it(
    backend: Backend,
) -> None:
    store = backend.open(keep=None)
    save_state(store, 1)
    # What a writer killed before its commit leaves behind: payload bytes, no manifest
    # (in a hidden temporary folder on a POSIX folder, in place on an object store).
    layer = store.backend
    folder = layer.begin(step_dirname(2))
    handle = layer.open_write(folder, "model.safetensors")
    handle.write(b"the first bytes of a checkpoint that never committed")
    layer.close_durably(handle)
    assert len(backend.folders()) == 2

    fresh = backend.open(keep=None)
    assert steps(fresh.list()) == [1]
    latest = fresh.latest()
    assert latest is not None
    assert latest.step == 1
    loaded = quietly(fresh)
    assert loaded.step == 1
    assert loaded.skipped == []

    save_state(fresh, 3)
    assert backend.folders() == {step_dirname(1), step_dirname(3)}
    assert fresh.verify().summary == "OK 2/2, errors 0"


def test_a_folder_without_manifest_is_ignored(backend: Backend) -> None:
    store = backend.open(keep=None)
    save_state(store, 1)
    stray = step_dirname(5)
    backend.write(b"not a checkpoint", stray, "model.safetensors")
    backend.write(b"{}", stray, "state.json")

    fresh = backend.open(keep=None)
    assert steps(fresh.list()) == [1]
    assert quietly(fresh).step == 1
    with pytest.raises(NoCheckpointError):
        fresh.load(5)

    save_state(fresh, 2)
    assert steps(fresh.list()) == [1, 2]
    if backend.object_store:
        # There it is what an interrupted write or deletion leaves, and the next save removes it.
        assert backend.folders() == {step_dirname(1), step_dirname(2)}
    else:
        # A POSIX store never leaves such a folder (it renames whole folders into place), so
        # this one is not nbresume's to delete.
        assert backend.folders() == {step_dirname(1), step_dirname(2), stray}


def test_retention_keeps_the_newest(backend: Backend) -> None:
    store = backend.open(keep=2)
    for step in range(1, 6):
        save_state(store, step)
        settle(store)
        assert steps(backend.open(keep=None).list()) == list(range(max(1, step - 1), step + 1))
    # Nothing half-deleted or temporary is left behind, and what is kept verifies.
    assert backend.folders() == {step_dirname(4), step_dirname(5)}
    assert backend.open().verify().summary == "OK 2/2, errors 0"

    assert store.prune(keep=1) == [4]
    assert steps(backend.open(keep=None).list()) == [5]
    assert backend.folders() == {step_dirname(5)}


def test_keep_best_keeps_the_best_by_metric(backend: Backend) -> None:
    store = backend.open(keep=2, keep_best=("val_loss", "min", 1))
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.7, 5: 0.6, 6: 0.8}
    for step, loss in losses.items():
        store.save(step, data={"state": {"step": step}}, metrics={"val_loss": loss})
        settle(store)
    # The two newest, and step 2, the lowest loss.
    assert steps(store.list()) == [2, 5, 6]
    assert backend.folders() == {step_dirname(s) for s in (2, 5, 6)}
    assert store.verify().ok

    # Keeping the newest and the highest loss among what is left.
    assert store.prune(keep=1, keep_best=("val_loss", "max", 1)) == [2, 5]
    assert steps(store.list()) == [6]


def test_saving_a_step_again_replaces_it(backend: Backend) -> None:
    store = backend.open(keep=None)
    save_state(store, 4)
    save_state(store, 5)
    replacement = {"model": {"w": torch.arange(12.0).reshape(3, 4)}}
    info = store.save(5, tensors=replacement, data={"notes": {"again": True}})

    assert steps(store.list()) == [4, 5]
    for reader in (store, backend.open(keep=None)):
        loaded = quietly(reader)
        assert loaded.step == 5
        assert loaded.tensors.keys() == {"model"}
        assert_same_tensors(loaded.tensors["model"], replacement["model"])
        assert loaded.data == {"notes": {"again": True}}
        assert reader.verify().summary == "OK 2/2, errors 0"
    # Only the new copy's files: nothing of the old copy lingers next to the new manifest.
    assert backend.files(info.name) == {"model.safetensors", "notes.json", MANIFEST_NAME}
    assert set(info.manifest.files) == {"model.safetensors", "notes.json"}


def test_the_manifest_is_written_last(backend: Backend) -> None:
    name = step_dirname(1)
    with backend.recorded(keep=None) as (store, events):
        save_state(store, 1)
    payload_files = {"model.safetensors", "optimizer.safetensors", "state.json"}

    if backend.object_store:
        # Written in place: the manifest appears only after every payload file is complete.
        written = [e[1] for e in events if e[0] == "written"]
        assert written[-1] == f"{name}/{MANIFEST_NAME}"
        assert set(written[:-1]) == {f"{name}/{f}" for f in payload_files}
    else:
        # Written in a hidden sibling, manifest last, then renamed into place in one step.
        opened = [e[1] for e in events if e[0] == "opened"]
        temp = opened[0].split("/")[0]
        assert temp.startswith(TEMP_PREFIX)
        assert opened[-1] == f"{temp}/{MANIFEST_NAME}"
        assert set(opened[:-1]) == {f"{temp}/{f}" for f in payload_files}
        renames = [e for e in events if e[0] == "renamed"]
        assert renames == [("renamed", temp, name)]
        assert events.index(renames[0]) > events.index(("opened", f"{temp}/{MANIFEST_NAME}"))
    assert store.verify().ok


def test_retention_withdraws_a_checkpoint_from_view_in_one_step(backend: Backend) -> None:
    old, new = step_dirname(1), step_dirname(2)
    with backend.recorded(keep=1) as (store, events):
        save_state(store, 1)
        save_state(store, 2)
        settle(store)

    if backend.object_store:
        old_committed = events.index(("written", f"{old}/{MANIFEST_NAME}"))
        committed = events.index(("written", f"{new}/{MANIFEST_NAME}"))
        removals = [
            i
            for i, e in enumerate(events)
            if i > old_committed and e[0] == "removed" and e[1].startswith(old)
        ]
        # The manifest goes first, and only once the newer checkpoint is committed: from then
        # on the old folder is not a checkpoint, whatever is left of it if we are interrupted.
        assert events[removals[0]] == ("removed", f"{old}/{MANIFEST_NAME}")
        assert removals[0] > committed
        assert events[removals[-1]] == ("removed", old)
    else:
        committed = events.index(next(e for e in events if e[0] == "renamed" and e[2] == new))
        moved = [e for e in events if e[0] == "renamed" and e[1] == old]
        assert len(moved) == 1
        assert moved[0][2].startswith(".")
        assert events.index(moved[0]) > committed
        assert ("removed", old) not in events
    assert backend.folders() == {new}
    assert steps(store.list()) == [2]
    assert store.verify().ok


def test_md5_is_recorded_and_matches_the_stored_bytes(backend: Backend) -> None:
    info = save_state(backend.open(md5=True), 1)
    stored = parse_manifest(backend.read(info.name, MANIFEST_NAME), where=info.location)
    assert stored.files == info.manifest.files
    for name, entry in stored.files.items():
        raw = backend.read(info.name, name)
        assert entry.size == len(raw)
        assert (entry.algorithm, entry.digest) == ("xxh3-128", xxhash.xxh3_128(raw).hexdigest())
        assert entry.md5 == hashlib.md5(raw).hexdigest()
        # Where the store reports an MD5 of its own, it is the one the manifest recorded.
        server = backend.server_md5(info.name, name)
        assert (server is not None) == backend.reports_md5
        if server is not None:
            assert server == entry.md5
    assert backend.open().verify().ok

    plain = save_state(backend.open(keep=None), 2)
    assert all((e.md5 is not None) == backend.records_md5 for e in plain.manifest.files.values())


def test_command_line_verify(backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    store = backend.open(keep=None)
    save_state(store, 1)
    save_state(store, 2)

    # The command line takes no storage options: for s3:// it finds the endpoint and the
    # credentials the standard way, in AWS_ENDPOINT_URL and AWS_ACCESS_KEY_ID (set by conftest).
    assert main(["verify", backend.location]) == 0
    out = capsys.readouterr().out
    assert "OK 2/2, errors 0" in out
    if backend.endpoint is not None:
        import fsspec

        cli_fs = fsspec.core.url_to_fs(backend.location)[0]
        assert backend.endpoint_of(cli_fs) == backend.endpoint

    backend.write(b'{"damaged": true}', step_dirname(2), "state.json")
    assert main(["verify", backend.location]) == 1
    out = capsys.readouterr().out
    assert "OK 1/2, errors 1" in out
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1
    assert step_dirname(2) in failed[0]
    assert "state.json" in failed[0]


class OtherWriter:
    """Another writer of the same store: a second store object on its own file system
    instance, or a second process that stays alive between commands."""

    def __init__(self, backend: Backend, kind: str, log: Path) -> None:
        self.backend = backend
        self.store = backend.open_elsewhere(keep=None) if kind == "instance" else None
        self.log = log
        self.child: subprocess.Popen[str] | None = None

    def __enter__(self) -> OtherWriter:
        if self.store is None:
            options = json.dumps(self.backend.storage_options or None)
            with self.log.open("w") as sink:
                self.child = subprocess.Popen(
                    [sys.executable, str(OTHER_PROCESS), self.backend.location, options],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=sink,
                    text=True,
                    env=with_testkit(os.environ),
                )
        return self

    def run(self, saves: list[tuple[int, int]], prune_keep: int | None = None) -> None:
        if self.store is not None:
            for step, value in saves:
                self.store.save(step, **payload(value))
            if prune_keep:
                settle(self.store)
                self.store.prune(keep=prune_keep)
            return
        assert self.child is not None
        assert self.child.stdin is not None
        assert self.child.stdout is not None
        self.child.stdin.write(json.dumps({"saves": saves, "prune_keep": prune_keep}) + "\n")
        self.child.stdin.flush()
        if self.child.stdout.readline().strip() != "done":
            self.child.wait(timeout=60)
            pytest.fail(f"the other process failed:\n{self.log.read_text()}")

    def __exit__(self, *exc: object) -> None:
        if self.child is not None:
            assert self.child.stdin is not None
            self.child.stdin.close()
            if self.child.wait(timeout=60) != 0 and exc[0] is None:
                pytest.fail(f"the other process failed:\n{self.log.read_text()}")


@pytest.mark.parametrize("other", ["instance", "process"])
def test_what_another_writer_did_is_seen(backend: Backend, other: str, tmp_path: Path) -> None:
    """A second store object, or a second process, writes and deletes; a long-lived store sees
    exactly the new state (no stale listing or file information from a cache)."""
    if other == "process" and not backend.shared_across_processes:
        pytest.skip(f"{backend.name}:// lives inside one process")

    def value_of(loaded: Any) -> int:
        value: int = loaded.data["state"]["value"]
        expected = payload(value)["tensors"]["model"]["w"]
        assert np.array_equal(loaded.tensors["model"]["w"].numpy(), expected)
        return value

    with OtherWriter(backend, other, tmp_path / "other.log") as writer:
        reader = backend.open(keep=None)
        reader.save(1, **payload(1))
        reader.save(2, **payload(2))  # lists folder 1 first: an s3fs listing is now cached
        assert steps(reader.list()) == [1, 2]
        assert value_of(quietly(reader, 1)) == 1

        writer.run([(3, 3), (1, 100)])  # a new checkpoint, and step 1 rewritten, other bytes
        assert steps(reader.list()) == [1, 2, 3]
        latest = reader.latest()
        assert latest is not None
        assert latest.step == 3
        assert value_of(quietly(reader)) == 3
        assert value_of(quietly(reader, 1)) == 100
        assert reader.verify().summary == "OK 3/3, errors 0"

        writer.run([], prune_keep=1)
        assert steps(reader.list()) == [3]
        assert value_of(quietly(reader)) == 3
        assert reader.verify().summary == "OK 1/1, errors 0"


def test_storage_options_are_refused_for_a_local_folder(tmp_path: Path) -> None:
    for location in (str(tmp_path), tmp_path.as_uri()):
        with pytest.raises(UsageError, match="storage_options"):
            CheckpointStore(location, storage_options={"endpoint_url": "http://127.0.0.1:1"})
    # An empty mapping asks for nothing and is accepted everywhere.
    assert CheckpointStore(tmp_path, storage_options={}).list() == []


def test_nothing_leaves_loopback(network_refusals: list[str]) -> None:
    """The guard every contract test runs under refuses real endpoints (such as AWS's) before
    a single packet is sent; 192.0.2.1 is a documentation address that routes nowhere."""
    with socket.socket() as sock, pytest.raises(PermissionError, match="loopback"):
        sock.connect(("192.0.2.1", 443))
    with pytest.raises(PermissionError, match="loopback"):
        socket.getaddrinfo("s3.amazonaws.com", 443)
    assert network_refusals == [
        "socket.connect '192.0.2.1'",
        "socket.getaddrinfo 's3.amazonaws.com'",
    ]
    network_refusals.clear()


def test_a_training_run_resumes_exactly_from_this_backend(backend: Backend, tmp_path: Path) -> None:
    """The Checkpointer on top of the backend: an interrupted run continues bit for bit."""
    import torch

    from nbresume import Checkpointer

    def train(location: str, options: dict[str, Any], stop_at: int | None) -> dict[str, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2),
                                    torch.nn.Linear(16, 1))  # fmt: skip
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ckpt = Checkpointer(location, every=3, keep=2, deadline=None, async_save=False,
                            storage_options=options or None,
                            model=model, optimizer=optimizer)  # fmt: skip
        for step in ckpt.steps(10):
            loss = model(torch.randn(4, 8)).pow(2).mean()  # dropout and data draw from the RNG
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step + 1 == stop_at:
                return {}  # the process "dies" after step 7; the checkpoint of step 6 is there
        assert ckpt.done
        return {k: v.clone() for k, v in model.state_dict().items()}

    uninterrupted = train(str(tmp_path / "reference"), {}, stop_at=None)
    train(backend.location, backend.storage_options, stop_at=7)
    resumed = train(backend.location, backend.storage_options, stop_at=None)
    latest = backend.open(keep=None).latest()
    assert latest is not None
    assert latest.step == 10
    assert resumed.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key
