"""A Python script kernel (``.py``) is committed, run and chained like a notebook: smoke run
with ``python``, pushed as ``kernel_type: script``, each leg continuing from the last one's
checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.fake_kaggle import FakeKaggle

from .conftest import copy_notebook, nbresume, user_env


@pytest.mark.slow
def test_a_script_kernel_commits_runs_and_chains(tmp_path: Path, kaggle_server: FakeKaggle) -> None:
    # Each session saves and stops after 4 steps, as at a session cap: 10 steps take 3 legs.
    kaggle_server.run_env = {"NBRESUME_SMOKE_STEPS": "4"}
    owner = kaggle_server.username
    script = copy_notebook("counter_script.py", tmp_path / "user")
    result = nbresume(
        [
            "commit",
            script.name,
            "--kernel",
            f"{owner}/script-counter",
            "--no-internet",
            "--no-wheel",
            "--chain",
            "--legs",
            "5",
            "--poll",
            "0.2",
            "-o",
            str(tmp_path / "legs"),
        ],
        cwd=script.parent,
        env=user_env(tmp_path, kaggle_server),
        timeout=600,
    )
    assert result.code == 0, result.text
    # The smoke run ran the script twice; the second run resumed.
    assert "second run (fresh kernel, resumed): ok" in result.out
    assert "smoke: OK" in result.out
    metadata = json.loads((script.parent / "kernel-metadata.json").read_text())
    assert (metadata["kernel_type"], metadata["code_file"]) == ("script", "counter_script.py")

    saves = [r.body for r in kaggle_server.requests if r.path.endswith("/SaveKernel")]
    assert [s["kernelType"] for s in saves] == ["script"] * 3
    assert saves[0]["text"] == script.read_text()
    assert [s["slug"] for s in saves] == [
        f"{owner}/script-counter",
        f"{owner}/script-counter-b",
        f"{owner}/script-counter",
    ]
    assert "done: the training finished in leg 3 (script-counter at step 10)" in result.out
    legs = sorted((tmp_path / "legs").iterdir())
    final = legs[-1] / "nbresume/script-counter/000000000010/state.json"
    assert json.loads(final.read_text())["values"]["total"] == sum(range(10))


def test_a_script_is_linted_and_scanned_without_a_kernelspec(tmp_path: Path, net_log: Path) -> None:
    script = copy_notebook("counter_script.py", tmp_path / "user")
    result = nbresume(
        ["commit", script.name, "--kernel", "me/script-counter", "--dry-run", "--no-smoke"],
        cwd=script.parent,
        env=user_env(tmp_path, None),
    )
    assert result.code == 0, result.text
    assert "kernelspec" not in result.err
    assert '"kernel_type": "script"' in result.out
