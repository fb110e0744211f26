"""Outside a notebook: ``nbresume.init`` shows the run as one live line on a terminal, and as
plain log lines when the output goes to a file or a pipe. A real script in a real process;
the terminal is a real pseudo-terminal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from testkit.paths import with_testkit
from testkit.terminal import stderr_on_a_terminal

SCRIPT = textwrap.dedent(
    """
    import sys, time
    import nbresume
    from testkit.stateful import Weights

    run = nbresume.init("script", dir=sys.argv[1], quiet=sys.argv[2] == "quiet")
    model = Weights()
    ckpt = run.checkpointer(model=model, every=40, async_save=False)
    for step in ckpt.steps(100):
        model.w += 1
        time.sleep(0.01)  # long enough for the live line to be redrawn a few times
    print("trained", ckpt.step)
    """
)


def write_script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return script


def run_script(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    """Run the script to its end, ``mode`` "loud" or "quiet", its output captured."""
    return subprocess.run(
        [sys.executable, str(write_script(tmp_path)), str(tmp_path / "run"), mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=with_testkit(os.environ),
    )


def test_log_lines_when_the_output_is_not_a_terminal(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "loud")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "trained 100"  # stdout stays the program's
    assert "\r" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    stamped = [line for line in lines if re.match(r"\[\d\d:\d\d:\d\d\] nbresume: ", line)]
    assert stamped == lines
    saved = [line.split("nbresume: ", 1)[1] for line in lines if " saved " in line]
    assert [s.split()[1] for s in saved] == ["40", "80", "100"]
    assert all(str(tmp_path / "run") in s for s in saved)
    assert "nbresume: done: step 100 of 100 (100%)" in lines[-1]
    assert lines[-1].endswith(" · done")


def test_quiet_init_prints_nothing(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout == "trained 100\n"


def test_one_live_line_on_a_terminal(tmp_path: Path) -> None:
    script = write_script(tmp_path)
    code, output = stderr_on_a_terminal(
        [sys.executable, str(script), str(tmp_path / "run"), "loud"],
        with_testkit({**os.environ, "COLUMNS": "200"}),
    )
    assert code == 0
    text = output.decode()
    frames = [f.strip() for f in text.replace("\r\n", "\n").split("\r") if f.strip()]
    # Redrawn in place several times, the step going up, and ended by one newline.
    live = [f for f in frames if f.startswith("nbresume script: step ")]
    steps = [int(re.match(r"nbresume script: step (\d+)", f).group(1)) for f in live]  # type: ignore[union-attr]
    assert len(steps) >= 3
    assert steps == sorted(steps)
    assert steps[-1] == 100
    assert "last checkpoint step 100 saved" in live[-1]
    assert text.count("\n") == 1
    assert text.endswith("\n")
    assert "[" not in text.split("\r")[0]  # no log lines on a terminal


def test_init_prints_the_setup_text_once_in_a_terminal(tmp_path: Path) -> None:
    """Outside a notebook, the first ``init`` prints the summary and the setup panel's text
    (every check, the clocks); a second ``init`` in the same process the summary alone."""
    script = tmp_path / "twice.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import nbresume

            nbresume.init("first", dir=sys.argv[1] + "/first", accelerator="gpu")
            print("-- again")
            nbresume.init("second", dir=sys.argv[1] + "/second")
            """
        )
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("NBRESUME_STRICT", None)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    first, again = proc.stdout.split("-- again\n")
    lines = first.splitlines()
    assert lines[0].startswith("nbresume preflight on ")
    assert lines[1] == f"  run 'first': checkpoints in {tmp_path / 'first'}"
    # Every check with its state, the failed one with its fix, then the clocks.
    checks = [line for line in lines if line.startswith(("  ok   ", "  warn ", "  FAIL "))]
    assert any(line.startswith("  ok   cpu: ") for line in checks)
    [accelerator] = [line for line in checks if " accelerator: " in line]
    assert accelerator.startswith("  FAIL accelerator: ")
    assert "(fix: " in accelerator
    assert any(line.startswith("  clock ") for line in lines)
    assert "run folder:" not in first  # said once, by the summary's second line
    # The second init: the summary alone.
    assert again.splitlines()[0].startswith("nbresume preflight on ")
    assert again.splitlines()[1] == f"  run 'second': checkpoints in {tmp_path / 'second'}"
    assert not any(line.startswith(("  ok   ", "  clock ")) for line in again.splitlines())
