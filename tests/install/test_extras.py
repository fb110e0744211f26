"""Installing an extra never replaces a package Colab or Kaggle ships.

The extras meant for users are resolved by pip itself, all of them at once, as ``pip install
"nbresume[notebook,kaggle,...]"`` would resolve them on the platform, for the platform's
Python, with the platform's packages held at their versions (``platforms.toml``) as
constraints: the resolution must succeed (then each extra alone does too), and no package of
the platform may come out at another version. A failure gives pip's own explanation, which
names the requirement that does not admit the platform's version.

pip resolves over the package index (``--dry-run --report``: metadata only, nothing is
installed); where the index cannot be reached the tests skip and say so. An index that serves
no separate metadata makes pip fetch each wheel whole to read it: torch is therefore stood in
for by a wheel of its metadata alone (its version, and its requirements but the CUDA libraries
and triton, ``torch_requires``), which pip prefers to the index's for its tag and build number;
what an extra requires of torch, and of what torch requires, is resolved as before, without
fetching 2 GB of torch and CUDA wheels.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from testkit.paths import ROOT

tomllib = pytest.importorskip("tomllib", reason="reads platforms.toml with Python 3.11's tomllib")

PLATFORMS: dict[str, Any] = tomllib.loads(Path(__file__).with_name("platforms.toml").read_text())
#: The extras meant for users (test, docs and bench are the project's own).
EXTRAS = ("notebook", "kaggle", "hf", "lightning", "drive", "s3", "ssh")

pytestmark = pytest.mark.slow


def pip(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@cache
def index_unreachable() -> str:
    """Why the package index cannot be used here ("" when it can)."""
    try:
        done = pip("index", "versions", "pip", timeout=60)
    except subprocess.TimeoutExpired:
        return "the package index did not answer within 60 s"
    if done.returncode != 0:
        return f"the package index cannot be reached: {done.stderr.strip()[-300:]}"
    return ""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nbresume's wheel, built once from this checkout (pip needs a built project to resolve
    for another Python)."""
    if reason := index_unreachable():
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("wheel")
    done = pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(folder), str(ROOT))
    assert done.returncode == 0, done.stderr
    [built] = folder.glob("nbresume-*.whl")
    return built


def torch_stand_in(platform: str, folder: Path) -> Path:
    """A wheel of the platform's torch holding its metadata alone, in ``folder`` (for
    ``--find-links``): with the tag pip ranks first for the platform's Python on this
    machine, and a build number above any torch release's, so that pip takes it over the
    index's torch of the same version."""
    version = PLATFORMS[platform]["packages"]["torch"]
    # pip's own most preferred tag for that Python here (its ranking, not packaging's).
    debug = pip("debug", "--verbose", "--python-version", PLATFORMS[platform]["python"])
    tag = debug.stdout.split("Compatible tags:", 1)[1].splitlines()[1].strip()
    build = "9999"
    info = f"torch-{version}.dist-info"
    metadata = "".join(
        [
            f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
            *(f"Requires-Dist: {r}\n" for r in PLATFORMS[platform]["torch_requires"]),
        ]
    )
    wheel = folder / f"torch-{version}-{build}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{info}/METADATA", metadata)
        archive.writestr(
            f"{info}/WHEEL",
            f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nBuild: {build}\nTag: {tag}\n",
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_the_extras_leave_the_platforms_packages_as_they_are(
    platform: str, wheel: Path, tmp_path: Path
) -> None:
    extras = ",".join(EXTRAS)
    shipped = {canonicalize_name(k): v for k, v in PLATFORMS[platform]["packages"].items()}
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in shipped.items()))
    report = tmp_path / "report.json"
    links = tmp_path / "links"
    links.mkdir()
    stand_in = torch_stand_in(platform, links)
    done = pip(
        "install",
        "--dry-run",
        "--ignore-installed",
        "--target",  # pip asks for one with --python-version; a dry run writes nothing there
        str(tmp_path / "target"),
        "--progress-bar=off",
        "--report",
        str(report),
        "--python-version",
        PLATFORMS[platform]["python"],
        "--only-binary=:all:",
        "--constraint",
        str(constraints),
        "--find-links",
        str(links),
        f"nbresume[{extras}] @ {wheel.as_uri()}",
    )
    said = "\n".join(
        line
        for line in (done.stdout + done.stderr).splitlines()
        if line.startswith(("The conflict is caused by", "    ", "ERROR"))
    )
    assert done.returncode == 0, (
        f"pip install 'nbresume[{extras}]' cannot keep {platform}'s packages "
        f"({PLATFORMS[platform]['source']}):\n{said[-3000:]}"
    )
    installs = json.loads(report.read_text())["install"]
    resolved = {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in installs
    }
    assert "nbresume" in resolved
    torch_from = {
        item["download_info"]["url"] for item in installs if item["metadata"]["name"] == "torch"
    }
    assert torch_from <= {stand_in.as_uri()}, f"pip fetched torch from {torch_from}"
    changed = {
        name: f"{shipped[name]} -> {version}"
        for name, version in resolved.items()
        if name in shipped
        and not SpecifierSet(f"=={shipped[name]}").contains(version, prereleases=True)
    }
    assert not changed, f"nbresume[{extras}] would change {platform}'s {changed}"
