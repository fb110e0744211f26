"""The documentation site builds offline with warnings as errors, and documents the whole API."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import nbresume
from testkit.paths import ROOT

pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed")
pytest.importorskip("material", reason="mkdocs-material is not installed")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module with `mkdocs build --strict`."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def test_every_public_name_has_its_own_entry_in_the_api_reference(site: Path) -> None:
    page = (site / "api" / "index.html").read_text(encoding="utf-8")

    def anchors(name: str) -> set[str]:
        # mkdocstrings gives each documented object an anchor named by its path: the public
        # one, or where it is defined when it is listed from there (nbresume.preflight, from
        # nbresume.preflight_checks).
        obj = getattr(nbresume, name)
        paths = {f"nbresume.{name}"}
        if hasattr(obj, "__qualname__") and hasattr(obj, "__module__"):
            paths.add(f"{obj.__module__}.{obj.__qualname__}")
        return {f'id="{path}"' for path in paths}

    missing = [n for n in nbresume.__all__ if not any(a in page for a in anchors(n))]
    assert not missing, f"public names without an entry in docs/api.md: {missing}"


def test_the_site_loads_nothing_from_the_network(site: Path) -> None:
    # Web fonts would be fetched by every reader's browser (and break offline reading).
    for page in site.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        assert "fonts.googleapis.com" not in text, page
        assert "fonts.gstatic.com" not in text, page


def test_the_format_page_shows_the_commit_diagram_and_the_changelog_is_included(
    site: Path,
) -> None:
    assert (site / "img" / "commit-protocol.svg").is_file()
    assert "img/commit-protocol.svg" in (site / "format" / "index.html").read_text("utf-8")
    changelog = (site / "changelog" / "index.html").read_text(encoding="utf-8")
    headings = [
        line.lstrip("#").strip()
        for line in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("## ")
    ]
    assert headings
    for heading in headings:
        assert heading in changelog, f"CHANGELOG.md section {heading!r} missing from the site"
