"""The stand-in Hub (:mod:`hub.standin`) on loopback, and the environment the real client needs
to talk to it: ``HF_ENDPOINT``, a token, and hf_xet's cache in the test's own folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub", reason="needs huggingface_hub (the buckets extra)")
pytest.importorskip("hf_xet", reason="needs hf_xet (the buckets extra)")

from .standin import HubStandIn, Token

#: The bucket the tests write to, and the token of its owner.
BUCKET = "me/run1"
URL = f"hf://buckets/{BUCKET}"
TOKEN = "hf_standin_write_token"


@pytest.fixture(scope="session", autouse=True)
def xet_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # hf_xet's session is one per process and reads its cache folder once.
    saved = {k: os.environ.get(k) for k in ("HF_XET_CACHE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    os.environ["HF_XET_CACHE"] = str(tmp_path_factory.mktemp("xet-cache"))
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStandIn]:
    cas = tmp_path / "cas"
    cas.mkdir()
    standin = HubStandIn(cas_dir=cas, tokens={TOKEN: Token("me")}).start()
    standin.create_bucket(BUCKET)
    monkeypatch.setenv("HF_ENDPOINT", standin.url)
    # Read when huggingface_hub was imported: its own calls (the agent registry) go to the
    # stand-in too, and what it caches lands in the test's folder.
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", standin.url)
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agent-harnesses.json"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    try:
        yield standin
    finally:
        standin.stop()
