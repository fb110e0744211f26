"""The project as a whole: a light import, a README whose commands are what CI runs, and
(marked `lint`) the code-quality checks that keep the codebase clean."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# What `import nbresume` must not drag in: each costs seconds or is absent on some platforms.
HEAVY = ["torch", "IPython", "ipywidgets", "fsspec", "s3fs", "kaggle", "papermill", "safetensors"]


def test_import_nbresume_is_light() -> None:
    code = (
        f"import json, sys, nbresume\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def quickstart_commands() -> list[str]:
    """The commands of the fenced bash blocks in the README's Quickstart section."""
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"^## Quickstart\n(.*?)(?=^## )", readme, re.S | re.M)
    assert match, "README.md has no '## Quickstart' section"
    blocks = re.findall(r"^```bash\n(.*?)^```", match.group(1), re.S | re.M)
    commands = []
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        assert len(lines) == 1, f"a Quickstart block should hold one command: {block!r}"
        commands.append(lines[0].strip())
    return commands


def ci_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return commands[-1]


def test_the_quickstart_is_two_commands_and_the_second_is_what_ci_runs() -> None:
    commands = quickstart_commands()
    assert len(commands) == 2
    tests = [c for c in commands if "pytest" in c]
    assert len(tests) == 1, f"exactly one Quickstart command should run the tests: {commands}"
    assert tests[0] == ci_command()


def test_ci_script_is_an_executable_bash_script() -> None:
    script = ROOT / ".ci" / "run"
    assert os.access(script, os.X_OK)
    first = script.read_text().splitlines()[0]
    assert first in ("#!/usr/bin/env bash", "#!/bin/bash")


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {sys.executable} (pip install -e '.[test]')")
    return str(path)


@pytest.mark.lint
@pytest.mark.parametrize(
    "args",
    [["check", "src", "tests"], ["format", "--check", "src", "tests"]],
    ids=["ruff check", "ruff format"],
)
def test_ruff_is_clean(args: list[str]) -> None:
    proc = subprocess.run(
        [tool("ruff"), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.lint
def test_mypy_is_clean() -> None:
    proc = subprocess.run([tool("mypy")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
