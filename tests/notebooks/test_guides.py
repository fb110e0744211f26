"""The user guides say what the code does: the getting-started page shows the script the suite
runs, each platform guide covers every danger clock its platform reports, and every
environment variable nbresume reads is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nbresume import knobs
from nbresume.platforms import by_name

from .conftest import ROOT

DOCS = ROOT / "docs"

#: Platform -> its guide.
GUIDES = {
    "colab": "platforms/colab.md",
    "kaggle": "platforms/kaggle.md",
    "kaggle-batch": "platforms/kaggle.md",
    "ssh": "platforms/ssh.md",
}


def table_names(page: Path) -> set[str]:
    """The first column of every table row on ``page``."""
    names = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^\|\s*([^|]+?)\s*\|", line)
        if match:
            names.add(match.group(1).strip("`"))
    return names


@pytest.mark.parametrize("platform", sorted(GUIDES))
def test_each_platform_guide_explains_every_danger_clock(platform: str) -> None:
    clocks = {c.name for a in (True, False) for c in by_name(platform).danger_clocks(a)}
    documented = table_names(DOCS / GUIDES[platform])
    assert clocks <= documented, f"{GUIDES[platform]} lacks {sorted(clocks - documented)}"


def test_every_environment_variable_is_documented() -> None:
    documented = table_names(DOCS / "preflight.md")
    assert set(knobs.KNOBS) <= documented, sorted(set(knobs.KNOBS) - documented)


def test_the_getting_started_page_shows_the_example_script() -> None:
    """The page includes docs/examples/train.py itself. That script is run where its pages
    show it: to its end, resumed after an interruption and run again on the finished run by
    the check of the page's outputs (tests/test_docs_outputs.py), and killed with SIGKILL
    (inside a save too) and resumed bit-identically by ``nbresume check``
    (tests/test_check_command.py)."""
    assert '--8<-- "docs/examples/train.py"' in (DOCS / "getting-started.md").read_text()
