"""The project as a whole: a light import, and a README whose commands are what CI runs (the
code-quality checks, ruff, mypy and import-linter, run before the tests: scripts/lint)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from testkit.paths import ROOT

BIN = Path(sys.executable).parent

# What `import nbresume` must not drag in: each costs seconds or is absent on some platforms.
HEAVY = ["torch", "IPython", "ipywidgets", "fsspec", "s3fs", "kaggle", "papermill", "safetensors"]


def test_import_nbresume_is_light() -> None:
    code = (
        f"import json, sys, nbresume\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    # A new interpreter: a fork of the warm server has torch imported already.
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


def test_the_test_command_runs_the_code_quality_checks_before_the_tests() -> None:
    """ruff, mypy and import-linter are a step of their own, before pytest: a lint failure
    stops the command before the suite's minutes are spent."""
    command = ci_command()
    assert "./scripts/lint" in command
    assert command.index("./scripts/lint") < command.index("pytest")
    lint = (ROOT / "scripts" / "lint").read_text()
    for tool in ('"$bin/ruff" check', '"$bin/ruff" format --check', "lint-imports", "mypy"):
        assert tool in lint, f"scripts/lint does not run {tool}"
    assert os.access(ROOT / "scripts" / "lint", os.X_OK)
