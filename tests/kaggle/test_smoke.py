"""``nbresume smoke``: real notebooks, run by papermill on real kernels, twice; the second run
must resume from the first one's checkpoint, and a failure names the cell and the error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import Result, copy_notebook, nbresume, user_env


def smoke(tmp_path: Path, notebook: Path, *args: str, env: dict[str, str] | None = None) -> Result:
    return nbresume(
        ["smoke", str(notebook), *args],
        cwd=notebook.parent,
        env=env or user_env(tmp_path, None),
        timeout=300,
    )


def write_notebook(folder: Path, name: str, cells: list[str]) -> Path:
    """``folder/name``: a notebook of code cells with the ``cells`` sources, as an editor
    saves it."""
    folder.mkdir(parents=True, exist_ok=True)
    notebook = folder / name
    notebook.write_text(
        json.dumps(
            {
                "nbformat": 4,
                "nbformat_minor": 4,
                "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
                "cells": [
                    {"cell_type": "code", "metadata": {}, "source": s, "outputs": []} for s in cells
                ],
            }
        )
    )
    return notebook


def counting_cells(run: str) -> list[str]:
    """The cells of a notebook that counts through ``nbresume.init(run)``'s checkpointer."""
    return [
        f"import nbresume\nrun = nbresume.init({run!r}, internet=False)\n"
        "ckpt = run.checkpointer(every=None, async_save=False)\nckpt['total'] = 0",
        "for step in ckpt.steps(10):\n    ckpt['total'] = ckpt['total'] + step",
    ]


@pytest.mark.slow
def test_a_resumable_notebook_passes_and_the_second_run_resumes(
    tmp_path: Path, net_log: Path
) -> None:
    notebook = copy_notebook("counter.ipynb", tmp_path / "user")
    before = notebook.read_bytes()
    result = smoke(tmp_path, notebook, "--platform", "kaggle", "--steps", "3")
    assert result.code == 0, result.text
    lines = result.out.splitlines()
    # Three steps, saved as at a deadline; the fresh kernel continues from there.
    assert any(line.startswith("  first run: ok") and "counter at step 3" in line for line in lines)
    assert any(line.startswith("  second run") and "counter at step 6" in line for line in lines), (
        result.out
    )
    assert lines[-1] == "smoke: OK"
    assert notebook.read_bytes() == before  # the user's notebook is left as it was


@pytest.mark.slow
def test_a_failing_cell_is_named_with_its_first_line_and_error(
    tmp_path: Path, net_log: Path
) -> None:
    notebook = copy_notebook("broken.ipynb", tmp_path / "user")
    result = smoke(tmp_path, notebook, "--platform", "kaggle")
    assert result.code == 1
    # Cell 3 of the notebook (a markdown cell is cell 2), as the editor counts.
    assert "first run: FAILED at cell 3 (`values = {\"a\": 1}`): KeyError: 'missing'" in result.out
    assert "second run" not in result.out
    assert result.out.splitlines()[-1] == "smoke: FAILED"


@pytest.mark.slow
def test_checkpoints_outside_nbresume_folder_do_not_survive_a_kaggle_version(
    tmp_path: Path, net_log: Path
) -> None:
    notebook = copy_notebook("own_folder.ipynb", tmp_path / "user")
    on_kaggle = smoke(tmp_path, notebook, "--platform", "kaggle")
    assert on_kaggle.code == 1
    assert "my-checkpoints: the second run did not resume from step 3" in on_kaggle.out
    assert "nbresume.init's folder" in on_kaggle.out


def test_a_colab_notebook_without_an_importable_google_colab_is_refused_clearly(
    tmp_path: Path, net_log: Path
) -> None:
    cells = [
        "from google.colab import drive\ndrive.mount('/content/drive')",
        "import nbresume\nrun = nbresume.init('colab-run')",
    ]
    notebook = write_notebook(tmp_path / "user", "colab.ipynb", cells)
    env = user_env(tmp_path, None)
    # The development environment has nbresume's Colab stand-in installed; this marker makes
    # it refuse to import, as a machine without google.colab would.
    marker = tmp_path / "colab-marker"
    marker.touch()
    env["COLAB_STANDIN_MARKER"] = str(marker)
    result = smoke(tmp_path, notebook, env=env)
    assert result.code == 1
    assert "(colab sandbox)" in result.out
    assert "google.colab cannot be imported here" in result.out
    assert "exists only on Colab" in result.out


@pytest.mark.slow
def test_an_absolute_kaggle_path_fails_with_a_hint(tmp_path: Path, net_log: Path) -> None:
    folder = tmp_path / "user"
    folder.mkdir()
    notebook = folder / "absolute.ipynb"
    source = 'with open("/kaggle/working/submission.csv", "w") as out:\n    out.write("id\\n")'
    notebook.write_text(
        json.dumps(
            {
                "nbformat": 4,
                "nbformat_minor": 5,
                "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
                "cells": [
                    {
                        "cell_type": "code",
                        "id": "a1",
                        "metadata": {},
                        "source": source,
                        "outputs": [],
                        "execution_count": None,
                    }
                ],
            }
        )
    )
    result = smoke(tmp_path, notebook)
    assert result.code == 1
    assert "(kaggle sandbox)" in result.out  # it mentions /kaggle/, so it gets Kaggle's layout
    assert 'cell 1 (`with open("/kaggle/working/submission.csv", "w") as out:`)' in result.out
    assert "FileNotFoundError" in result.out
    assert "write relative paths" in result.out


@pytest.mark.slow
def test_colab_sandbox_keeps_drive_between_runs_without_google_colab(
    tmp_path: Path, net_log: Path
) -> None:
    """``--platform colab`` needs no google.colab: Drive is a temporary folder that outlives
    the first runtime, /content is new for each run, and nbresume.init finds Drive there."""
    cells = [
        # A file in the working folder (/content) does not outlive the runtime.
        "import os\nassert not os.path.exists('scratch.txt')\n"
        "open('scratch.txt', 'w').write('lost with the runtime')",
        *counting_cells("drive-counter"),
    ]
    notebook = write_notebook(tmp_path / "user", "drive_counter.ipynb", cells)
    env = user_env(tmp_path, None)
    marker = tmp_path / "colab-marker"  # the development stand-in of google.colab refuses
    marker.touch()
    env["COLAB_STANDIN_MARKER"] = str(marker)
    result = smoke(tmp_path, notebook, "--platform", "colab", env=env)
    assert result.code == 0, result.text
    assert "(colab sandbox)" in result.out
    assert "first run: ok" in result.out
    assert "checkpoints: MyDrive/nbresume/drive-counter at step 6" in result.out
    assert "smoke: OK" in result.out


@pytest.mark.slow
def test_a_successful_smoke_run_prints_no_error_line(tmp_path: Path, net_log: Path) -> None:
    """The kernel is shut down right after its last reply; a kernel slow to finish that reply
    (a loaded machine, here made slow on purpose) must not log a KeyboardInterrupt."""
    cells = [
        "import time\n"
        "kernel = get_ipython().kernel\n"
        "reply = kernel.shell_handlers['kernel_info_request']\n"
        "async def slow_reply(*args):\n"
        "    result = reply(*args)\n"
        "    if hasattr(result, '__await__'):\n"
        "        await result\n"
        "    time.sleep(3)  # still in the handler when the shutdown comes\n"
        "kernel.shell_handlers['kernel_info_request'] = slow_reply",
        *counting_cells("slow-kernel"),
    ]
    notebook = write_notebook(tmp_path / "user", "slow_kernel.ipynb", cells)
    result = smoke(tmp_path, notebook, "--platform", "local", "--steps", "2")
    assert result.code == 0, result.text
    assert result.out.splitlines()[-1] == "smoke: OK"
    assert "KeyboardInterrupt" not in result.text
    assert not [line for line in result.text.splitlines() if "ERROR" in line], result.text
