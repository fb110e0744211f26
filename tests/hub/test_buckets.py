"""Checkpoints in a Hugging Face Storage Bucket, through the real huggingface_hub and hf_xet
against the stand-in Hub on loopback (:mod:`hub.standin`)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest

from nbresume.checkpoint.backends import open_store
from nbresume.checkpoint.backends.hf_bucket import XET_RECORDS, HfBucketStore
from nbresume.checkpoint.format import step_dirname
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import StorageError
from testkit import warmfork
from testkit.stateful import QUIET

from .conftest import BUCKET, TOKEN, URL
from .standin import BUILT_FROM, HubStandIn


def weights(seed: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {"model": {"w": rng.standard_normal((64, 64)).astype(np.float32)}}


def test_bucket_save_lands_with_the_local_xet_hashes_and_loads_back(hub: HubStandIn) -> None:
    store = CheckpointStore(URL, keep=None)
    assert isinstance(store.backend, HfBucketStore)
    info = store.save(1, tensors=weights(1), data={"loop": {"step": 1}})
    files = hub.files(BUCKET)
    assert {f"{info.name}/{n}" for n in ("model.safetensors", "loop.json", "manifest.json")} | {
        f"{info.name}/{XET_RECORDS}/{n}.json" for n in ("model.safetensors", "loop.json")
    } == set(files)
    confirmed, how = store.backend.confirm(info.name, info.manifest)
    assert confirmed, how
    loaded = store.load()
    assert loaded.step == 1
    np.testing.assert_array_equal(loaded.tensors["model"]["w"], weights(1)["model"]["w"])


def test_bucket_verify_by_hashes_downloads_no_payload_file(hub: HubStandIn) -> None:
    info = CheckpointStore(URL, keep=None).save(1, tensors=weights(1))
    fresh = open_store(URL)  # another machine: nothing of this checkpoint in its memory
    hub.calls.clear()
    state = fresh.durability(info.name, info.manifest)
    assert state.saved, state
    downloaded = {unquote(p).split("/", 5)[-1] for route, p in hub.calls if route == "resolve"}
    # The manifest and the record of the one payload file: never model.safetensors itself.
    assert downloaded == {
        f"{info.name}/{XET_RECORDS}/model.safetensors.json",
        f"{info.name}/manifest.json",
    }


def test_bucket_remote_hash_differing_is_not_durable_and_says_which_file(hub: HubStandIn) -> None:
    store = CheckpointStore(URL, keep=None)
    info = store.save(1, tensors=weights(1))
    remote = f"{info.name}/model.safetensors"
    hub.wrong_hash[remote] = "0" * 64
    confirmed, how = open_store(URL).confirm(info.name, info.manifest)
    assert not confirmed
    assert "model.safetensors" in how
    assert "xet_hash differs" in how


def test_bucket_rate_limit_429_waits_as_retry_after_asks(hub: HubStandIn) -> None:
    hub.rate_limit("paths_info", times=2, retry_after=1)
    hub.rate_limit("tree", times=1, retry_after=1)
    store = CheckpointStore(URL, keep=None)
    info = store.save(1, tensors=weights(1))
    assert store.backend.confirm(info.name, info.manifest)[0]
    routes = [route for route, _ in hub.calls]
    assert routes.count("paths_info") >= 3  # two answered 429, then the one that counted
    assert all(times == 0 for _, times, _ in hub._limits)


def test_bucket_expired_token_is_one_clear_error_before_anything_is_written(
    hub: HubStandIn,
) -> None:
    hub.tokens[TOKEN].expired = True
    store = open_store(URL)
    with pytest.raises(StorageError) as caught:
        store.begin("step-00000001")
    text = str(caught.value)
    assert "401" in text
    assert "HF_TOKEN" in text
    assert TOKEN not in text
    assert hub.files(BUCKET) == {}


def test_bucket_read_only_token_is_refused_before_anything_is_written(hub: HubStandIn) -> None:
    hub.tokens[TOKEN].role = "read"
    with pytest.raises(StorageError, match="403: a read-only token"):
        CheckpointStore(URL, keep=None).save(1, tensors=weights(1))
    assert hub.files(BUCKET) == {}


def test_bucket_missing_token_names_where_to_put_one(
    hub: HubStandIn, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "none"))  # no `hf auth login`
    with pytest.raises(StorageError, match="no Hugging Face token") as caught:
        open_store(URL).begin("step-00000001")
    assert "hf auth login" in str(caught.value)


def test_bucket_on_kaggle_without_internet_says_to_turn_it_on(
    hub: HubStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    url = hub.url
    hub.stop()  # nothing answers any more: as on a Kaggle session with Internet off
    monkeypatch.setenv("HF_ENDPOINT", url)
    with pytest.raises(StorageError) as caught:
        open_store(URL).begin("step-00000001")
    assert "Internet on" in str(caught.value)
    assert "--kaggle-dataset" in str(caught.value)


def test_bucket_retention_frees_the_bucket_and_keeps_the_last_remotely_verified(
    hub: HubStandIn,
) -> None:
    store = CheckpointStore(URL, keep=None)
    first = store.save(1, tensors=weights(1))
    second = store.save(2, tensors=weights(2))
    assert store.prune(keep=1) == [1]
    paths = hub.files(BUCKET)
    assert not any(p.startswith(first.name + "/") for p in paths)  # deleted through the API
    assert any(p.startswith(second.name + "/") for p in paths)
    # The bucket now reports other bytes for step 3's weights: it verified when it was read
    # back, but the bucket does not confirm it, so step 2 is the one kept.
    third = store.save(3, tensors=weights(3))
    hub.wrong_hash[f"{third.name}/model.safetensors"] = "0" * 64
    assert store.prune(keep=1) == []
    names = {p.split("/", 1)[0] for p in hub.files(BUCKET)}
    assert {second.name, third.name} <= names


#: A process that saves step 1, then step 2 (whose upload the stand-in holds until it is killed).
SAVE_TWO = """
import sys
import numpy as np
from nbresume.checkpoint.store import CheckpointStore

store = CheckpointStore(sys.argv[1], keep=None)
for step in (1, 2):
    store.save(step, tensors={"model": {"w": np.full((256, 256), step, np.float32)}})
    print("saved", step, flush=True)
"""


@pytest.mark.parametrize("where", ["xorb", "batch"])
def test_bucket_kill_during_upload_leaves_the_earlier_checkpoint_newest_and_confirmed(
    hub: HubStandIn, tmp_path: Path, where: str
) -> None:
    """Killed while step 2's bytes go to the content store, or while the Hub records them."""
    if where == "xorb":
        hub.hang_xorb_after(f"{step_dirname(1)}/manifest.json")
    else:
        hub.hang_batch(f"{step_dirname(2)}/model.safetensors")
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # what a killed process leaves stays here
    child = warmfork.popen([sys.executable, "-c", SAVE_TWO, URL], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        while not hub.hung.wait(0.2) and child.poll() is None:
            pass  # until step 2's upload hangs, or the child ended without getting there
    finally:
        child.kill()
        output = child.communicate()[0].decode()
        hub.release.set()
    assert hub.hung.is_set(), output
    assert "saved 1" in output, output
    assert "saved 2" not in output, output
    store = CheckpointStore(URL, keep=None)
    assert [info.step for info in store.list()] == [1]  # step 2 has no manifest: not committed
    newest = store.latest()
    assert newest is not None
    assert store.backend.durability(newest.name, newest.manifest).saved
    assert store.load().step == 1


def test_bucket_checkpointer_resumes_on_a_fresh_machine_and_never_writes_the_token(
    hub: HubStandIn, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    torch = pytest.importorskip("torch")
    from nbresume import Checkpointer

    caplog.set_level(logging.DEBUG)
    model = torch.nn.Linear(4, 2)
    with Checkpointer(URL, model=model, **QUIET) as ckpt:
        ckpt.save(5, block=True)
        confirmed = ckpt.wait(durable=True, timeout=60)
    assert confirmed is not None
    assert "xet_hash" in confirmed.how
    fresh = torch.nn.Linear(4, 2)
    with Checkpointer(URL, model=fresh, **QUIET) as again:
        assert again.restore() == 5
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value)
    store = open_store(URL)
    written = b"".join(
        bytes(store.read_bytes(*path.split("/", 1)))
        if "/" in path
        else store.read_small(path) or b""
        for path in hub.files(BUCKET)  # the checkpoints' files, and the writer lease
    )
    assert written  # every file of the checkpoints, as the bucket serves it
    said = capfd.readouterr()
    for text in (written.decode("latin-1"), said.out, said.err, caplog.text):
        assert TOKEN not in text


def test_bucket_standin_knows_every_endpoint_the_installed_client_calls(hub: HubStandIn) -> None:
    """Fails when the installed huggingface_hub or hf_xet calls the Hub in a way the stand-in
    was not built for (it was built from the versions in BUILT_FROM)."""
    store = CheckpointStore(URL, keep=1)
    for step in (1, 2):
        info = store.save(step, tensors=weights(step))
    fresh = CheckpointStore(URL, keep=1)
    assert all(result.ok for result in fresh.verify().results)
    assert fresh.backend.confirm(info.name, info.manifest)[0]
    fresh.backend.replace_small("lease.json", b"{}")
    assert fresh.backend.read_small("lease.json") == b"{}"
    fresh.backend.remove_small("lease.json")
    fresh.backend.delete(info.name)
    installed = {name: importlib.metadata.version(name) for name in BUILT_FROM}
    assert hub.unknown == [], (
        f"the client ({installed}) called endpoints the stand-in (built from {BUILT_FROM}) "
        f"does not know: {hub.unknown}"
    )


def test_bucket_commands_ls_verify_and_verify_by_hashes(
    hub: HubStandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    from nbresume.cli import main

    store = CheckpointStore(URL, keep=None)
    store.save(1, tensors=weights(1))
    second = store.save(2, tensors=weights(2))
    assert main(["ls", URL]) == 0
    assert "2 checkpoint(s) in hf://buckets/me/run1" in capsys.readouterr().out
    assert main(["verify", URL]) == 0
    hub.calls.clear()
    assert main(["verify", "--hashes", URL]) == 0
    assert "2 of 2 checkpoint(s) confirmed by the Hugging Face bucket" in capsys.readouterr().out
    assert not any(p.endswith(".safetensors") for r, p in hub.calls if r == "resolve")
    hub.wrong_hash[f"{second.name}/model.safetensors"] = "0" * 64
    assert main(["verify", "--hashes", URL]) == 1
    out = capsys.readouterr().out
    assert "NOT CONFIRMED step 2" in out
    assert "model.safetensors (other bytes: the bucket's xet_hash differs)" in out
    assert main(["prune", "--keep", "1", URL]) == 0
    # Step 2 is not confirmed by the bucket: step 1, the newest that is, stays.
    assert {p.split("/", 1)[0] for p in hub.files(BUCKET)} >= {step_dirname(1), second.name}


def test_bucket_as_the_durable_folder_of_init_is_checked_writable_before_training(
    hub: HubStandIn,
) -> None:
    import nbresume
    from nbresume.errors import PreflightError

    run = nbresume.init("run1", dir=URL, quiet=True, strict=True)
    assert run.dir == URL
    assert not run.report.failures
    hub.tokens[TOKEN].role = "read"
    with pytest.raises(PreflightError) as caught:
        nbresume.init("run1", dir=URL, quiet=True, strict=True)
    assert "403: a read-only token" in str(caught.value)
    assert TOKEN not in str(caught.value)
    assert hub.files(BUCKET) == {}


def test_bucket_pull_copies_every_checkpoint_home_verified(
    hub: HubStandIn, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nbresume.cli import main

    store = CheckpointStore(URL, keep=None)
    for step in (1, 2):
        store.save(step, tensors=weights(step))
    assert main(["pull", URL, str(tmp_path / "home")]) == 0
    assert "OK 2/2 verified" in capsys.readouterr().out
    home = CheckpointStore(tmp_path / "home", keep=None)
    assert [info.step for info in home.list()] == [1, 2]
    assert all(result.ok for result in home.verify().results)
    assert not list((tmp_path / "home").rglob(".nbresume-xet*"))  # the records stay behind


def test_bucket_runs_whose_names_share_a_prefix_stay_apart(hub: HubStandIn) -> None:
    """The Hub matches a listing's prefix as a string: exp1 must not see, nor delete, exp10."""
    other = CheckpointStore(f"{URL}/exp10", keep=None)
    other.save(1, tensors=weights(10))
    store = CheckpointStore(f"{URL}/exp1", keep=1)
    store.save(1, tensors=weights(1))
    store.save(2, tensors=weights(2))  # retention deletes exp1's step 1 only
    assert [info.step for info in store.list()] == [2]
    assert [info.step for info in other.list()] == [1]
    assert other.load().step == 1


def test_bucket_token_from_kaggle_secrets(
    hub: HubStandIn, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On Kaggle, with no HF_TOKEN and no login file, the notebook's secret HF_TOKEN is used
    (Kaggle's secrets service is the one thing simulated: a module of its client's name)."""
    import types

    from huggingface_hub import constants

    asked: list[str] = []

    class UserSecretsClient:
        def get_secret(self, label: str) -> str:
            asked.append(label)
            return TOKEN

    monkeypatch.setitem(sys.modules, "kaggle_secrets", types.SimpleNamespace(
        UserSecretsClient=UserSecretsClient))  # fmt: skip
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "none"))
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    CheckpointStore(URL, keep=None).save(1, tensors=weights(1))
    assert asked
    assert set(asked) == {"HF_TOKEN"}
    assert CheckpointStore(URL, keep=None).load().step == 1
