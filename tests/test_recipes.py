"""The recipes the docs show (docs/recipes/*.py, included in docs/checkpointing.md) resume
exactly: each one is run by ``nbresume check``, uninterrupted and killed at random moments
(one inside a save), and its final checkpoints must be bit-identical."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from testkit import warmfork
from testkit.cli import nbresume_argv
from testkit.paths import ROOT

RECIPES = sorted((ROOT / "docs" / "recipes").glob("*.py"))


def test_every_recipe_is_shown_in_the_docs() -> None:
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    for recipe in RECIPES:
        assert f'--8<-- "docs/recipes/{recipe.name}"' in docs, f"{recipe.name} is not shown"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_a_recipe_resumes_exactly(tmp_path: Path, recipe: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    done = warmfork.run(
        nbresume_argv("check", "--steps", "24", "--", sys.executable, str(recipe)),
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path, env=env,
    )  # fmt: skip
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "exact: the final checkpoints (step 24) are bit-identical" in report, report
