"""Every command output shown in the docs is produced here and compared, so the docs cannot drift.

The convention, for each ```` ```console ```` block of ``docs/**/*.md`` and ``README.md``: the
line just before its fence is an HTML comment (invisible on the site) that says what is done
with it:

- ``<!-- output: checked -->``: its commands (the lines after ``$ ``; a line ending with ``\\``
  goes on) run in order in a sandbox folder shared by the page's checked blocks, and what they
  print (stdout and stderr together) must be what the block shows.
- ``<!-- output: checked, stdout -->``: the same, comparing stdout only (the block's text then
  says what goes to stderr).
- ``<!-- output: checked, setup=NAME -->``: first prepare the sandbox with ``SETUPS[NAME]``
  (hidden from the reader: a folder of checkpoints with metrics, a damaged copy...).
- ``<!-- output: checked by TEST_FILE (LABEL) -->``: produced by the test TEST_FILE, which
  compares what its command labelled LABEL printed with the block, normalised as here (a
  journey across services simulated on loopback, which a sandbox folder cannot hold).
- ``<!-- output: not checked: REASON -->``: shown, not produced, and the reason says why (an
  account on a service, a remote machine, this machine's own hardware).

What legitimately changes from one run to the next is normalised on both sides, and nothing
else: the sandbox folder reads ``/tmp/project`` (and its ``home`` folder, used as
``NBRESUME_HOME``, ``/home/you/nbresume``), ISO times and ``[HH:MM:SS]`` clocks, the count of
preflight checks that pass on this machine (``nbresume preflight on local machine: ...``), in
the demo the step a killed run resumes from and the ``(mid-save)`` note, which depend on how
far the killed process got before the kill landed, and the demo's final weights' hash, whose
last bits the processor's float kernels decide (the demo's own "bit-identical" line says the
two runs agree). Other hashes, sizes and every other step are compared exactly: the pinned
torch makes them deterministic. A line ``...`` in a block
stands for any number of lines.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.paths import ROOT

PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```console\s*$")
MARKER = re.compile(r"^<!-- output: (?P<how>.+?) -->$")
CHECKED_BY = re.compile(r"checked by (?P<file>tests/\S+\.py) \((?P<label>[\w-]+)\)")


@dataclass
class Block:
    """One console block: where it is, what to do with it, its commands and expected text."""

    page: Path
    line: int
    how: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def checked(self) -> bool:
        """Checked here, in the sandbox."""
        return self.how.startswith("checked") and self.checked_by is None

    @property
    def checked_by(self) -> tuple[str, str] | None:
        """The test file that checks the block elsewhere, and the block's label there."""
        match = CHECKED_BY.fullmatch(self.how)
        return (match["file"], match["label"]) if match else None

    @property
    def options(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for part in self.how.split(",")[1:]:
            key, _, value = part.strip().partition("=")
            out[key] = value
        return out

    def commands(self) -> list[str]:
        """The commands of the block, continuation lines joined."""
        out: list[str] = []
        lines = iter(self.text.splitlines())
        for line in lines:
            if not line.startswith("$ "):
                continue
            command = line[2:]
            while command.endswith("\\"):
                command = command[:-1] + next(lines).strip()
            out.append(command)
        return out


def blocks() -> list[Block]:
    """Every console block of the docs, with the marker before it (``""`` when missing)."""
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        index = 0
        while index < len(lines):
            if FENCE.match(lines[index]):
                end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
                before = lines[index - 1] if index else ""
                marker = MARKER.match(before)
                text = "\n".join(lines[index + 1 : end])
                found.append(Block(page, index + 1, marker["how"] if marker else "", text))
                index = end
            index += 1
    return found


# -- hidden setups: what the sandbox holds before a block, as the block's page describes it ----


def _exp1(sandbox: Path) -> None:
    """runs/exp1: five checkpoints with a learning rate and a validation loss recorded."""
    import torch

    import nbresume

    store = nbresume.CheckpointStore(sandbox / "runs" / "exp1", keep=None)
    model = torch.nn.Linear(256, 256)
    recorded = [(0.001, 0.91), (0.0005, 0.62), (0.0005, 0.55), (0.00025, 0.58), (0.00025, 0.6)]
    for index, (lr, val_loss) in enumerate(recorded, start=1):
        store.save(
            500 * index,
            tensors={"model": model.state_dict()},
            metrics={"lr": lr, "val_loss": val_loss},
        )


def _damaged(sandbox: Path) -> None:
    """damaged: a copy of the demo's folder with one bit of one tensor file flipped."""
    damaged = sandbox / "damaged"
    shutil.copytree(sandbox / "nbresume-demo" / "interrupted", damaged)
    target = damaged / "000000000120" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01
    target.write_bytes(bytes(data))


def _empty(sandbox: Path) -> None:
    (sandbox / "runs" / "empty").mkdir(parents=True)


def _train_py(sandbox: Path) -> None:
    shutil.copy(ROOT / "docs" / "examples" / "train.py", sandbox / "train.py")


def _killed_after_600(sandbox: Path) -> None:
    """The run as a kill between steps 600 and 800 leaves it: nothing newer than step 600."""
    folder = sandbox / "home" / "getting-started"
    for checkpoint in folder.iterdir():
        if checkpoint.name.isdigit() and int(checkpoint.name) > 600:
            shutil.rmtree(checkpoint)


SETUPS: dict[str, Callable[[Path], None]] = {
    "exp1": _exp1,
    "damaged": _damaged,
    "empty": _empty,
    "train.py": _train_py,
    "killed-after-600": _killed_after_600,
}


# -- running and comparing --------------------------------------------------------------------


def _environment(sandbox: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBRESUME_", "KAGGLE_"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        NBRESUME_HOME=str(sandbox / "home"),
        COLUMNS="80",  # argparse wraps its usage lines at the terminal's width
        NO_COLOR="1",
        PYTHONUNBUFFERED="1",  # stdout and stderr interleave as on a terminal
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    return env


def _script(block: Block) -> str:
    """A shell script that prints each command as the block shows it, then runs it; ``$?``
    stays the previous command's status, for ``echo $?``."""
    lines = ["status=0"]
    for command in block.commands():
        shown = "$ " + command
        lines.append(f"printf '%s\\n' {_quote(shown)}")
        lines.append(f"(exit $status); {command}; status=$?")
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def run_block(block: Block, sandbox: Path) -> str:
    """Run the block's commands in ``sandbox``; what they printed."""
    setup = block.options.get("setup")
    if setup:
        SETUPS[setup](sandbox)
    stdout_only = "stdout" in block.options
    proc = subprocess.run(
        ["bash", "-c", _script(block)],
        cwd=sandbox,
        env=_environment(sandbox),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if stdout_only else subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    return proc.stdout


def normalise(text: str, sandbox: Path | None = None) -> str:
    """The text with what legitimately varies between runs replaced (see the module's doc)."""
    if sandbox is not None:
        text = text.replace(str(sandbox / "home"), "/home/you/nbresume")
        text = text.replace(str(sandbox), "/tmp/project")
    text = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)?", "<time>", text)
    text = re.sub(r"^\[\d\d:\d\d:\d\d\]", "[<clock>]", text, flags=re.MULTILINE)
    # How many of the preflight's checks pass depends on the machine the test runs on.
    text = re.sub(r"^(nbresume preflight on [^:]+): .+$", r"\1: <checks>", text, flags=re.M)
    text = re.sub(r"resumed from step \d+,\s+", "resumed from step N, ", text)
    # The weights' hash differs from one processor to another (torch picks its CPU kernels by
    # the instruction set); that the two runs agree is the demo's own "bit-identical" line.
    text = re.sub(r"final weights sha256 [0-9a-f]{16}…", "final weights sha256 <hash>…", text)
    text = text.replace(" (mid-save)", "")
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def matches(expected: str, actual: str) -> bool:
    """Whether ``actual`` is ``expected``, a ``...`` line standing for any lines."""
    parts = [
        r"(?:[^\n]*\n)*?" if line == "..." else re.escape(line) + r"\n"
        for line in expected.splitlines()
    ]
    return re.fullmatch("".join(parts), actual + "\n") is not None


def _pages_with_checked_blocks() -> list[Path]:
    return sorted({b.page for b in blocks() if b.checked})


def test_every_console_block_says_whether_it_is_checked() -> None:
    for block in blocks():
        assert block.how, f"{block.name}: no <!-- output: ... --> line before the block"
        assert (
            block.checked or block.checked_by or re.fullmatch(r"not checked: .{10,}", block.how)
        ), f"{block.name}: {block.how!r}: say `checked` or `not checked: WHY`"
        if block.checked_by:
            test_file, label = block.checked_by
            assert f'"{label}"' in (ROOT / test_file).read_text(encoding="utf-8"), (
                f"{block.name}: {test_file} does not check a block labelled {label!r}"
            )
        setup = block.options.get("setup")
        assert setup is None or setup in SETUPS, f"{block.name}: unknown setup {setup!r}"
        assert not block.checked or block.commands(), f"{block.name}: no `$ ` command"


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", _pages_with_checked_blocks(), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_outputs_shown_on_the_page_are_what_the_commands_print(
    page: Path, tmp_path: Path
) -> None:
    sandbox = tmp_path / "project"
    sandbox.mkdir()
    problems = []
    for block in (b for b in blocks() if b.page == page and b.checked):
        actual = normalise(run_block(block, sandbox), sandbox)
        expected = normalise(block.text)
        if not matches(expected, actual):
            problems.append(f"{block.name}:\n--- the page shows:\n{expected}\n--- run:\n{actual}")
    assert not problems, "\n\n".join(problems)
