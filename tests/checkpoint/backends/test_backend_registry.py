"""The backend registry: which backend a location gets, and what a missing one says."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbresume.checkpoint.backends import registry
from nbresume.checkpoint.backends.fsspec_store import FsspecStore
from nbresume.checkpoint.backends.local import LocalStore
from nbresume.errors import ArgumentError, UsageError


def test_a_location_gets_the_backend_of_its_kind(tmp_path: Path) -> None:
    assert registry.backend_kind(str(tmp_path)) == "local"
    assert registry.backend_kind(tmp_path.as_uri()) == "local"
    assert registry.backend_kind("memory://x") == "fsspec"
    assert type(registry.open_store(tmp_path)) is LocalStore
    assert type(registry.open_store(tmp_path.as_uri())) is LocalStore
    assert type(registry.open_store("memory://registry-test")) is FsspecStore


def test_a_folder_inside_the_mounted_drive_is_drive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NBRESUME_DRIVE_MOUNT", str(tmp_path / "drive"))
    inside = tmp_path / "drive" / "MyDrive" / "run"
    assert registry.backend_kind(str(inside)) == "local"  # not mounted: no MyDrive folder
    (tmp_path / "drive" / "MyDrive").mkdir(parents=True)
    assert registry.backend_kind(str(inside)) == "drive"
    assert registry.backend_kind(str(tmp_path / "elsewhere")) == "local"


def test_a_registered_scheme_is_accepted_and_its_import_failure_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry, "known_backends", dict(registry.known_backends))
    monkeypatch.setattr(registry, "registry", {})
    with pytest.raises(ArgumentError, match="nbrtest://"):
        registry.check_location("nbrtest://bucket/run")
    registry.register_backend("nbrtest", "nbresume_no_such_module.Backend", errtxt="pip install x")
    assert registry.backend_kind("nbrtest://bucket/run") == "nbrtest"
    with pytest.raises(UsageError, match="cannot be loaded") as raised:
        registry.open_store("nbrtest://bucket/run")
    assert raised.value.fix == "pip install x"
    with pytest.raises(ValueError, match="clobber"):
        registry.register_backend("nbrtest", LocalStore)
    registry.register_backend("nbrtest", FsspecStore, clobber=True)
    assert registry.get_backend_class("nbrtest") is FsspecStore
