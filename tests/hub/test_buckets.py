"""Checkpoints in a Hugging Face Storage Bucket, through the real huggingface_hub and hf_xet
against the stand-in Hub on loopback (:mod:`hub.standin`)."""

from __future__ import annotations

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
