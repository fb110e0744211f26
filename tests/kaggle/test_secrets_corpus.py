"""The secrets corpus (tests/kaggle/secrets_corpus): every notebook that holds a credential is
refused, wherever and however the credential is hidden; no clean look-alike is refused; and
nothing ``nbresume commit`` prints or writes contains a secret or 8 characters of one."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbresume.kaggle import notebook as nbfile
from nbresume.kaggle.secrets import scan
from testkit.fake_kaggle import FakeKaggle

from .conftest import nbresume, user_env
from .secrets_corpus import Case, clean_cases, secret_cases

SECRET_CASES = secret_cases()
CLEAN_CASES = clean_cases()
FRAGMENT = 8


def fragments(secret: str) -> set[str]:
    """Every run of 8 characters of ``secret``: any longer part contains one of them."""
    return {secret[i : i + FRAGMENT] for i in range(len(secret) - FRAGMENT + 1)}


def leaked(case: Case, text: str) -> list[str]:
    return sorted(f for secret in case.secrets for f in fragments(secret) if f in text)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def test_the_corpus_covers_at_least_30_secrets_and_10_look_alikes() -> None:
    assert len(SECRET_CASES) >= 30
    assert len(CLEAN_CASES) >= 10
    assert len({c.name for c in SECRET_CASES}) == len(SECRET_CASES)
    assert {c.where for c in SECRET_CASES} == {
        "source",
        "output",
        "cell metadata",
        "attachment",
        "metadata",
        "file",
    }


@pytest.mark.parametrize("case", SECRET_CASES, ids=lambda c: c.name)
def test_every_secret_is_found_where_it_is(tmp_path: Path, case: Case) -> None:
    path = case.write(tmp_path / case.name)
    found = scan(nbfile.load(path), path.parent)
    assert case.where in {f.where for f in found}, (case.name, [str(f) for f in found])
    for finding in found:
        assert leaked(case, str(finding)) == []


@pytest.mark.parametrize("case", CLEAN_CASES, ids=lambda c: c.name)
def test_no_look_alike_is_taken_for_a_secret(tmp_path: Path, case: Case) -> None:
    path = case.write(tmp_path / case.name)
    assert [str(f) for f in scan(nbfile.load(path), path.parent)] == []


@pytest.mark.parametrize("case", SECRET_CASES, ids=lambda c: c.name)
def test_commit_refuses_and_neither_prints_nor_writes_any_part_of_a_secret(
    tmp_path: Path, net_log: Path, case: Case
) -> None:
    folder = tmp_path / "user"
    path = case.write(folder)
    before = snapshot(folder)
    result = nbresume(
        ["commit", path.name, "--kernel", "someone/corpus-run", "--dry-run", "--no-smoke"],
        cwd=folder,
        env=user_env(tmp_path, None),
    )
    assert result.code == 1, result.text
    assert "it was not pushed" in result.err
    assert leaked(case, result.text) == []
    after = snapshot(folder)
    assert after == before  # nothing written, nothing changed
    for written in snapshot(tmp_path / "tmp").values():  # temporary files, if any
        assert leaked(case, written.decode(errors="replace")) == []


@pytest.mark.parametrize("case", CLEAN_CASES, ids=lambda c: c.name)
def test_commit_dry_run_passes_every_look_alike(tmp_path: Path, net_log: Path, case: Case) -> None:
    folder = tmp_path / "user"
    path = case.write(folder)
    result = nbresume(
        ["commit", path.name, "--kernel", "someone/corpus-run", "--dry-run", "--no-smoke"],
        cwd=folder,
        env=user_env(tmp_path, None),
    )
    assert result.code == 0, result.text
    assert "credential" not in result.err
    assert '"id": "someone/corpus-run"' in result.out


def test_a_real_commit_refuses_before_any_call_to_kaggle(
    tmp_path: Path, kaggle_server: FakeKaggle
) -> None:
    [case] = [c for c in SECRET_CASES if c.name == "side-dotenv"]
    folder = tmp_path / "user"
    path = case.write(folder)
    result = nbresume(
        ["commit", path.name, "--kernel", f"{kaggle_server.username}/corpus-run", "--no-smoke"],
        cwd=folder,
        env=user_env(tmp_path, kaggle_server),
    )
    assert result.code == 1
    assert "file .env next to the notebook" in result.err
    assert leaked(case, result.text) == []
    assert kaggle_server.requests == []
    assert not (folder / "kernel-metadata.json").exists()
