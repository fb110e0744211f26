"""The lint before a commit: each thing that breaks a Kaggle batch run is found in the cell
where it is, with the fix; what is fine is left alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nbresume.kaggle import notebook as nbfile
from nbresume.kaggle.lint import Finding, Target, expectations, lint

from .conftest import nbresume, user_env

FIRST = 'import nbresume\nrun = nbresume.init("demo")'
WRITES = "ckpt = run.checkpointer(every=100)\nfor step in ckpt.steps(10):\n    pass"


def notebook(tmp_path: Path, *sources: str, kernelspec: bool = True) -> nbfile.Notebook:
    metadata: dict[str, object] = {}
    if kernelspec:
        metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": s[3:]}
        if s.startswith("md:")
        else {"cell_type": "code", "metadata": {}, "source": s, "outputs": []}
        for s in sources
    ]
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"nbformat": 4, "metadata": metadata, "cells": cells}))
    return nbfile.load(path)


def found(
    nb: nbfile.Notebook, target: Target | None = None, allow: frozenset[str] = frozenset()
) -> list[tuple[str, str, int | None]]:
    findings: list[Finding] = lint(nb, target or Target(), allow)
    return [(f.rule, f.severity, f.cell.number if f.cell else None) for f in findings]


def test_a_notebook_that_suits_a_batch_run_has_no_finding(tmp_path: Path) -> None:
    nb = notebook(
        tmp_path,
        "!pip install -q nbresume",
        "md:# Training",
        FIRST,
        WRITES,
        'with open("/kaggle/working/submission.csv", "w") as f:\n    f.write("id,label\\n")',
    )
    assert found(nb) == []


def test_no_kernelspec_is_an_error(tmp_path: Path) -> None:
    nb = notebook(tmp_path, FIRST, WRITES, kernelspec=False)
    [finding] = lint(nb, Target())
    assert (finding.rule, finding.severity, finding.cell) == ("kernelspec", "error", None)
    assert "kernelspec" in finding.fix
    assert "python3" in finding.fix


@pytest.mark.parametrize(
    "source",
    ['name = input("Your name? ")', "import getpass\npw = getpass.getpass()"],
)
def test_input_is_an_error_in_its_cell(tmp_path: Path, source: str) -> None:
    nb = notebook(tmp_path, FIRST, WRITES, source)
    assert found(nb) == [("input", "error", 3)]


def test_input_in_a_string_or_a_method_is_not_flagged(tmp_path: Path) -> None:
    nb = notebook(tmp_path, FIRST, WRITES, 'print("input() is not called")\nform.input("x")')
    assert found(nb) == []


def test_colab_drive_and_content_paths_are_errors_on_kaggle(tmp_path: Path) -> None:
    nb = notebook(
        tmp_path,
        FIRST,
        "from google.colab import drive\ndrive.mount('/content/drive')",
        WRITES,
        'data = load("/content/data/train.csv")',
        "!ls /content/sample_data",
        'path = "/kaggle/content/x"  # not Colab\'s folder',
    )
    assert found(nb) == [
        ("colab", "error", 2),
        ("content-path", "error", 2),
        ("content-path", "error", 4),
        ("content-path", "error", 5),
    ]


def test_pip_install_is_an_error_only_with_internet_off(tmp_path: Path) -> None:
    nb = notebook(
        tmp_path,
        "!pip install -q timm",
        FIRST,
        WRITES,
        "%pip install einops",
        'subprocess.run(["pip", "install", "x"])',
        "!pip install --no-index --find-links /kaggle/input/wheels timm",
    )
    assert found(nb, Target(internet=True)) == []
    offline = lint(nb, Target(internet=False))
    assert [(f.rule, f.cell.number if f.cell else None) for f in offline] == [
        ("pip-offline", 1),
        ("pip-offline", 4),
        ("pip-offline", 5),
    ]
    assert "--internet" in offline[0].fix
    assert "--no-index" in offline[0].fix


def test_first_code_cell_must_call_init_after_installs(tmp_path: Path) -> None:
    late = notebook(tmp_path, "!pip install -q nbresume", "import torch", FIRST, WRITES)
    assert found(late) == [("first-cell", "warn", 2)]
    aliased = notebook(
        tmp_path,
        "# setup\n%pip install nbresume",
        "from nbresume import init as start\nrun = start('x')",
        WRITES,
    )
    assert found(aliased) == []
    extension = notebook(tmp_path, "%load_ext nbresume", WRITES)
    assert found(extension) == []


def test_a_notebook_that_writes_nothing_is_warned_about(tmp_path: Path) -> None:
    nb = notebook(tmp_path, "import nbresume\nnbresume.preflight(internet=True)", "train()")
    assert found(nb) == [("no-output", "warn", None)]
    own = notebook(
        tmp_path, "import nbresume\nnbresume.preflight()", "ck = nbresume.Checkpointer('x')"
    )
    assert found(own) == []


def test_init_asking_for_another_machine_than_the_commit_is_an_error(tmp_path: Path) -> None:
    nb = notebook(
        tmp_path,
        'import nbresume\nrun = nbresume.init("x", accelerator="gpu", internet=False)',
        WRITES,
    )
    assert found(nb, Target("gpu", internet=False)) == []
    assert found(nb, Target("cpu", internet=False)) == [("accelerator", "error", 1)]
    assert found(nb, Target("gpu", internet=True)) == [("internet", "error", 1)]
    assert expectations(nb) == ("gpu", False)


def test_allow_turns_an_error_into_a_warning(tmp_path: Path) -> None:
    nb = notebook(tmp_path, FIRST, WRITES, 'x = input("?")')
    assert found(nb, allow=frozenset({"input"})) == [("input", "warn", 3)]


def test_a_cell_that_does_not_parse_is_checked_as_text(tmp_path: Path) -> None:
    nb = notebook(tmp_path, FIRST, WRITES, "files = !ls /content/x\nfor f in files print(f)")
    assert found(nb) == [("syntax", "warn", 3), ("content-path", "error", 3)]


def test_commit_stops_on_lint_errors_and_pushes_nothing(
    tmp_path: Path, kaggle_server: object
) -> None:
    from testkit.fake_kaggle import FakeKaggle

    assert isinstance(kaggle_server, FakeKaggle)
    folder = tmp_path / "user"
    folder.mkdir()
    nb = notebook(folder, FIRST, WRITES, 'answer = input("continue? ")')
    result = nbresume(
        ["commit", str(nb.path), "--kernel", f"{kaggle_server.username}/asks-input"],
        cwd=folder,
        env=user_env(tmp_path, kaggle_server),
    )
    assert result.code == 1
    assert 'error [input] cell 3 (`answer = input("continue? ")`)' in result.err
    assert "nothing was pushed" in result.err
    assert kaggle_server.api_calls() == []


def test_a_papermill_parameters_cell_may_come_before_init(tmp_path: Path) -> None:
    path = tmp_path / "params.ipynb"
    cells = [
        {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "outputs": [],
         "source": "name = 'run'\nsteps = 100"},
        {"cell_type": "code", "metadata": {}, "outputs": [], "source": FIRST},
        {"cell_type": "code", "metadata": {}, "outputs": [], "source": WRITES},
    ]  # fmt: skip
    kernelspec = {"kernelspec": {"name": "python3", "display_name": "Python 3"}}
    path.write_text(json.dumps({"nbformat": 4, "metadata": kernelspec, "cells": cells}))
    assert found(nbfile.load(path)) == []
    untagged = notebook(tmp_path, "name = 'run'\nsteps = 100", FIRST, WRITES)
    assert found(untagged) == [("first-cell", "warn", 1)]


def test_init_arguments_are_followed_through_the_notebooks_variables(tmp_path: Path) -> None:
    """``accelerator = "gpu"`` in the parameters cell and ``init(accelerator=accelerator)``
    later asks for a GPU, as much as ``init(accelerator="gpu")`` does."""
    nb = notebook(
        tmp_path,
        'accelerator = "gpu"\nonline: bool = False',
        "import nbresume\nrun = nbresume.init('demo', accelerator=accelerator, internet=online)",
        WRITES,
    )
    assert expectations(nb) == ("gpu", False)
    assert ("accelerator", "error", 2) in found(nb, Target("cpu", False))
    assert ("internet", "error", 2) in found(nb, Target("gpu", True))
    assert [f for f in found(nb, Target("gpu", False)) if f[1] == "error"] == []
    # The value the name holds where init is called: a later assignment does not count, and
    # a name bound to something that is not a constant is not guessed at.
    later = notebook(
        tmp_path,
        'accelerator = "cpu"',
        "import nbresume\nrun = nbresume.init('demo', accelerator=accelerator)",
        'accelerator = "gpu"',
    )
    assert expectations(later) == ("cpu", None)
    unknown = notebook(
        tmp_path,
        'accelerator = os.environ.get("ACCEL", "gpu")',
        "import nbresume\nrun = nbresume.init('demo', accelerator=accelerator)",
    )
    assert expectations(unknown) == (None, None)


def test_an_install_that_falls_back_to_an_attached_wheel_passes_with_internet_off(
    tmp_path: Path,
) -> None:
    cell = (
        "import glob\nwheels = glob.glob('../input/**/nbresume-*.whl', recursive=True)\n"
        "if wheels:\n    %pip install -q --no-index --no-deps {wheels[-1]}\n"
        "else:\n    %pip install -q nbresume"
    )
    nb = notebook(tmp_path, cell, FIRST, WRITES)
    assert [f for f in found(nb, Target("cpu", False)) if f[0] == "pip-offline"] == []
    plain = notebook(tmp_path, "%pip install -q nbresume", FIRST, WRITES)
    assert ("pip-offline", "error", 1) in found(plain, Target("cpu", False))
