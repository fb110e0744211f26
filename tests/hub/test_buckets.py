"""Checkpoints in a Hugging Face Storage Bucket, through the real huggingface_hub and hf_xet
against the stand-in Hub on loopback (:mod:`hub.standin`)."""

from __future__ import annotations

from urllib.parse import unquote

import numpy as np
import pytest

from nbresume.checkpoint.backends import open_store
from nbresume.checkpoint.backends.hf_bucket import XET_HASHES, HfBucketStore, xet_hash
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import StorageError

from .conftest import BUCKET, TOKEN, URL
from .standin import HubStandIn


def weights(seed: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {"model": {"w": rng.standard_normal((64, 64)).astype(np.float32)}}


def test_bucket_save_lands_with_the_local_xet_hashes_and_loads_back(hub: HubStandIn) -> None:
    store = CheckpointStore(URL, keep=None)
    assert isinstance(store.backend, HfBucketStore)
    info = store.save(1, tensors=weights(1), data={"loop": {"step": 1}})
    files = hub.files(BUCKET)
    names = {p.rsplit("/", 1)[-1] for p in files}
    assert {"model.safetensors", "loop.json", "manifest.json", XET_HASHES} <= names
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
    downloaded = {unquote(p).rsplit("/", 1)[-1] for route, p in hub.calls if route == "resolve"}
    assert downloaded == {XET_HASHES, "manifest.json"}  # never model.safetensors


def test_bucket_remote_hash_differing_is_not_durable_and_says_which_file(hub: HubStandIn) -> None:
    store = CheckpointStore(URL, keep=None)
    info = store.save(1, tensors=weights(1))
    remote = f"{info.name}/model.safetensors"
    hub.wrong_hash[remote] = "0" * 64
    confirmed, how = open_store(URL).confirm(info.name, info.manifest)
    assert not confirmed
    assert "model.safetensors" in how and "xet_hash differs" in how


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
    assert "401" in text and "HF_TOKEN" in text and TOKEN not in text
    assert hub.files(BUCKET) == {}


def test_bucket_read_only_token_is_refused_before_anything_is_written(hub: HubStandIn) -> None:
    hub.tokens[TOKEN].role = "read"
    with pytest.raises(StorageError, match="403: a read-only token"):
        CheckpointStore(URL, keep=None).save(1, tensors=weights(1))
    assert hub.files(BUCKET) == {}


def test_bucket_missing_token_names_where_to_put_one(
    hub: HubStandIn, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no `hf auth login` file
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
    assert "Internet on" in str(caught.value) and "--kaggle-dataset" in str(caught.value)


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
