"""Internet off, as most competitions require: ``nbresume commit`` uploads the installed
nbresume as the private dataset OWNER/nbresume-wheel, attaches it, and the notebook's install
cell installs it from /kaggle/input, on a machine whose image has no nbresume."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import pytest

from testkit.fake_kaggle import DATASETS_SERVICE, FakeKaggle

from .conftest import copy_notebook, nbresume, user_env


def changes(server: FakeKaggle) -> list[str]:
    """The dataset calls that create or change a dataset, in order."""
    return [c for c in server.api_calls(DATASETS_SERVICE) if c.startswith("Create")]


@pytest.mark.slow
def test_an_internet_off_commit_attaches_the_wheel_and_the_run_installs_from_it(
    tmp_path: Path, kaggle_server: FakeKaggle
) -> None:
    kaggle_server.image_has_nbresume = False
    owner = kaggle_server.username
    ref = f"{owner}/offline-run"
    notebook = copy_notebook("offline.ipynb", tmp_path / "user")
    env = user_env(tmp_path, kaggle_server)
    args = ["commit", notebook.name, "--kernel", ref, "--no-internet", "--no-smoke"]

    dry = nbresume([*args, "--dry-run"], cwd=notebook.parent, env=env)
    assert dry.code == 0, dry.text
    assert f'"dataset_sources": [\n    "{owner}/nbresume-wheel"\n  ]' in dry.out
    assert kaggle_server.requests == []  # a dry run calls nothing

    result = nbresume(args, cwd=notebook.parent, env=env)
    assert result.code == 0, result.text
    assert f"as the private dataset {owner}/nbresume-wheel" in result.out
    assert changes(kaggle_server) == ["CreateDataset"]
    dataset = kaggle_server.datasets[(owner, "nbresume-wheel")]
    assert dataset.private
    [(wheel_name, wheel)] = dataset.versions[-1].items()
    assert wheel_name.startswith("nbresume-")
    assert wheel_name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(io.BytesIO(wheel)).namelist()
    assert "nbresume/__init__.py" in names
    assert "nbresume/kaggle/wheel.py" in names

    [push] = [r.body for r in kaggle_server.requests if r.path.endswith("/SaveKernel")]
    assert push["datasetDataSources"] == [f"{owner}/nbresume-wheel"]
    assert push["enableInternet"] is False
    metadata = json.loads((notebook.parent / "kernel-metadata.json").read_text())
    assert metadata["dataset_sources"] == [f"{owner}/nbresume-wheel"]

    kaggle_server.wait_idle(300)
    version = kaggle_server.kernel(ref).versions[-1]
    assert version.status == "COMPLETE", version.log
    # nbresume came from the wheel, installed on the machine, not from this checkout.
    location = Path((version.working / "nbresume-location.txt").read_text())
    assert location == version.machine / "site-packages" / "nbresume" / "__init__.py"
    state = version.working / "nbresume/offline/000000000010/state.json"
    assert json.loads(state.read_text())["values"]["total"] == sum(range(10))

    # The dataset says which wheel it holds.
    assert hashlib.sha256(wheel).hexdigest() in dataset.description

    # The next commit with the same nbresume uploads nothing: the dataset already holds it.
    kaggle_server.execute = False
    again = nbresume(args, cwd=notebook.parent, env=env)
    assert again.code == 0, again.text
    assert f"{owner}/nbresume-wheel already holds {wheel_name}: not uploaded again" in again.out
    assert changes(kaggle_server) == ["CreateDataset"]
    assert len(dataset.versions) == 1
    metadata = json.loads((notebook.parent / "kernel-metadata.json").read_text())
    assert metadata["dataset_sources"] == [f"{owner}/nbresume-wheel"]  # listed once

    # Another nbresume on Kaggle (an older one, say): the commit uploads a new version.
    dataset.description = "an nbresume wheel uploaded by an older release\n\nsha256: " + "0" * 64
    upgraded = nbresume(args, cwd=notebook.parent, env=env)
    assert upgraded.code == 0, upgraded.text
    assert f"uploaded {wheel_name} as the private dataset" in upgraded.out
    assert changes(kaggle_server) == ["CreateDataset", "CreateDatasetVersion"]
    assert dataset.versions[-1] == {wheel_name: wheel}
    assert hashlib.sha256(wheel).hexdigest() in dataset.description


def test_without_the_wheel_an_install_cell_with_internet_off_is_refused(
    tmp_path: Path, net_log: Path
) -> None:
    """pip install with internet off fails on Kaggle; an install cell that uses the attached
    wheel with --no-index passes."""
    notebook = copy_notebook("offline.ipynb", tmp_path / "user")
    document = json.loads(notebook.read_text())
    document["cells"][0]["source"] = "%pip install -q nbresume\nimport nbresume\n" + (
        'run = nbresume.init("offline", internet=False)'
    )
    notebook.write_text(json.dumps(document))
    result = nbresume(
        ["commit", notebook.name, "--kernel", "me/offline-run", "--no-internet", "--dry-run"],
        cwd=notebook.parent,
        env=user_env(tmp_path, None),
    )
    assert result.code == 1
    assert "error [pip-offline]" in result.err
