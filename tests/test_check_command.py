"""``nbresume check -- python train.py``: a user's own script, killed, resumed and compared.

End to end with real processes: the getting-started script of the docs resumes exactly; a
script with a NumPy generator the Checkpointer is not given, and one whose early-stopping
counter is a local variable, are caught, with the cause named; a sampler that shuffles with
Python's ``random`` resumes exactly. The knobs the command sets are tested on their own too.

The four checks start together (each runs its script five times or so, every start importing
torch): the tests then wait for their own.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import nbresume
from nbresume import knobs
from nbresume.checkpoint.loop import Cadence
from nbresume.resumecheck import causes, observe
from nbresume.resumecheck.compare import MODEL, Comparison, Difference
from testkit import warmfork
from testkit.paths import ROOT, with_testkit
from testkit.stateful import Weights

SCRIPTS = ROOT / "tests" / "check_scripts"
STEPS = 12
SEED = 7


def environment(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBRESUME_")}
    env.update(
        TMPDIR=str(tmp),  # the check's own folders, and anything torch writes, stay in here
        NBRESUME_HOME=str(tmp / "home"),
        NBRESUME_PROBE_HOST="127.0.0.1",  # no test reaches a real service
        NBRESUME_PROBE_PORT="9",
        OMP_NUM_THREADS="1",
    )
    return with_testkit(env)  # the scripts' stateful objects come from testkit.stateful


@dataclass
class Check:
    """A ``nbresume check`` running in a folder of its own."""

    process: warmfork.WarmProcess
    tmp: Path

    def result(self) -> tuple[int, str]:
        out, _ = self.process.communicate(timeout=900)
        return self.process.returncode, out


def start_check(folder: Path, script: Path, *options: str, steps: int | None = STEPS) -> Check:
    """``nbresume check`` of a copy of ``script`` (``steps``: the budget; ``None``: the
    default, the script's whole run where it is short)."""
    folder.mkdir(parents=True)
    shutil.copy(script, folder / script.name)
    tmp = folder / "tmp"
    tmp.mkdir()
    command = [sys.executable, "-m", "nbresume", "check", "--seed", str(SEED)]
    budget = ["--steps", str(steps)] if steps is not None else []
    command += [*budget, *options, "--", sys.executable, script.name]
    process = warmfork.popen(
        command,
        cwd=folder,
        env=environment(tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Check(process, tmp)


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Check]]:
    base = tmp_path_factory.mktemp("checks")
    scripts = {
        "quickstart": ROOT / "docs" / "examples" / "train.py",
        "unsaved_generator": SCRIPTS / "unsaved_generator.py",
        "early_stopping": SCRIPTS / "early_stopping.py",
        "random_sampler": SCRIPTS / "random_sampler.py",
    }
    started = {name: start_check(base / name, path) for name, path in scripts.items()}
    # With the default options: the whole run of a short script, the first steps of a long one.
    started["local_counter"] = start_check(
        base / "local_counter", SCRIPTS / "local_counter.py", steps=None
    )
    started["long_run"] = start_check(
        base / "long_run", SCRIPTS / "long_run.py", "--cover", "2", steps=None
    )
    started["unregistered_env"] = start_check(
        base / "unregistered_env", SCRIPTS / "unregistered_env.py", steps=None
    )
    started["accelerate"] = start_check(
        base / "accelerate", SCRIPTS / "accelerate_project_dir.py", steps=6
    )
    yield started
    for check in started.values():
        if check.process.poll() is None:
            check.process.kill()
            check.process.communicate()


def finished(check: Check) -> tuple[int, str]:
    code, out = check.result()
    left = [p.name for p in check.tmp.iterdir() if p.name.startswith("nbresume-check-")]
    assert not left, f"the check left its folders behind: {left}"
    return code, out


@pytest.mark.slow
def test_the_getting_started_script_resumes_exactly(checks: dict[str, Check]) -> None:
    code, out = finished(checks["quickstart"])
    assert code == 0, out
    assert f"seed {SEED}" in out
    assert f"run 1 (uninterrupted, twice side by side): done at step {STEPS}" in out
    assert "(inside a save)" in out  # at least one of the kills landed inside a save
    assert "run 2: resumed at step" in out
    assert f"done at step {STEPS}" in out.splitlines()[-3]
    assert out.splitlines()[-2].startswith(f"exact: the final checkpoints (step {STEPS})")
    assert "model, optimizer, RNG (torch), loader position" in out
    assert "first differ" not in out  # an exact script: no step where a difference begins
    # The budget ended the run before its end, and the verdict says so.
    assert out.splitlines()[-1] == (
        f"covered: the first {STEPS} of 1,000 steps; differences that begin later are not "
        "seen: --steps N checks the first N"
    )


@pytest.mark.slow
def test_a_generator_not_given_to_the_checkpointer_is_caught_and_named(
    checks: dict[str, Check],
) -> None:
    code, out = finished(checks["unsaved_generator"])
    assert code == 1, out
    assert "DIFFERENT: the resumed run did not end as the uninterrupted one" in out
    assert "  model 'model': 4 of 4 differ: 0.weight (by up to" in out
    # From the first resume on, the generator starts over: the very next save differs.
    resumed = int(out.split("run 2: resumed at step ", 1)[1].split(",")[0])
    # (A kill between a save's commit and its note leaves that step unnoted: "up to" the
    # step before it, then.)
    assert re.search(
        rf"^  the runs first differ at step {resumed + 1} \(1 step after run 2 resumed at "
        rf"step {resumed}, every save up to step \d+ is identical\): model 'model': "
        r"0\.weight, 0\.bias, 2\.weight, 2\.bias; optimizer 'optimizer': state/0/exp_avg, ",
        out,
        re.MULTILINE,
    ), out
    assert "likely cause: an unsaved random generator" in out
    # Observed: the generator, a global of the script, ended in another state.
    assert "  the script's global 'rng' (numpy Generator): its state differs at the end" in out
    assert "the generator `rng` (numpy Generator) of unsaved_generator.py ended in another " in out
    assert "fix: give it to the Checkpointer" in out
    assert f"repeat this check: nbresume check --seed {SEED} --steps {STEPS} --kills 2 --" in out


@pytest.mark.slow
def test_an_early_stopping_counter_in_a_local_variable_is_caught_and_named(
    checks: dict[str, Check],
) -> None:
    code, out = finished(checks["early_stopping"])
    assert code == 1, out
    # The uninterrupted run stops early at step 7; a resumed one counts its patience again.
    assert "run 1 (uninterrupted, twice side by side): done at step 7" in out
    assert "  steps trained: run 1 finished at step 7, run 2 finished at step " in out
    assert "likely cause: a counter in a local variable" in out
    assert "early_stopping.py has an early-stopping patience count" in out
    assert "ckpt['patience']" in out


@pytest.mark.slow
def test_a_sampler_shuffling_with_random_resumes_exactly(checks: dict[str, Check]) -> None:
    code, out = finished(checks["random_sampler"])
    assert code == 0, out
    assert "exact: the final checkpoints (step 12) are bit-identical" in out
    assert "RNG (python, torch)" in out  # seeded by the script: compared, and equal


@pytest.mark.slow
def test_by_default_a_short_script_is_checked_to_its_end_and_a_late_difference_is_caught(
    checks: dict[str, Check],
) -> None:
    # Its own counter lowers the learning rate after 30 steps: past a budget of 20 steps.
    code, out = finished(checks["local_counter"])
    assert code == 1, out
    assert "the whole run (if it ends in 120 s)" in out.splitlines()[0]
    assert "run 1 (uninterrupted, twice side by side): done at step 40" in out
    assert "DIFFERENT: the resumed run did not end as the uninterrupted one" in out
    assert "param_groups/0/lr (0.001 in run 1, 0.01 in run 2)" in out
    # Where it begins: at step 30, after a resume, when only the learning rate differs.
    begins = [line for line in out.splitlines() if "the runs first differ at step" in line]
    assert len(begins) == 1, out
    step = int(begins[0].split("first differ at step ")[1].split()[0])
    resumed = [
        int(line.split()[5].rstrip(","))
        for line in out.splitlines()
        if line.startswith("run 2: resumed at step ")
    ]
    assert resumed, out
    assert step >= min(resumed), out
    # Step 30, where only the learning rate differs (31 where a kill left 30 unnoted).
    assert step in (30, 31), out
    assert re.search(
        r"\(\d+ steps? after run 2 resumed at step \d+, every save up to step \d+ is "
        r"identical\): (model 'model': weight, bias; )?optimizer 'optimizer': param_groups/0/lr$",
        begins[0],
    ), out
    # The cause, from what the runs showed: the learning rate, and the global that set it.
    assert "likely cause: a counter in a local variable" in out
    assert "local_counter.py's global `trained` (40 in run 1, " in out
    assert "cause: not determined" not in out
    assert "covered: the script's whole run, 40 steps, to its end" in out
    assert f"repeat this check: nbresume check --seed {SEED} --kills 2 --" in out


@pytest.mark.slow
def test_an_environment_with_its_own_generator_not_given_to_the_checkpointer_is_named(
    checks: dict[str, Check],
) -> None:
    code, out = finished(checks["unregistered_env"])
    assert code == 1, out
    assert "  the script's global 'env.rng' (random.Random): its state differs at the end" in out
    assert "likely cause: an object of the script with a random generator of its own" in out
    assert "held by `env`: no Checkpointer restores it" in out
    assert "fix: give its generator to the Checkpointer by name" in out
    assert "likely cause: an unsaved random generator" not in out  # one cause, not a guess


@pytest.mark.slow
def test_a_long_script_is_checked_on_a_budget_and_the_verdict_says_what_it_covered(
    checks: dict[str, Check],
) -> None:
    code, out = finished(checks["long_run"])
    assert "run 1 did not end within 2 s" in out, out
    assert "checking the first 20 steps" in out
    assert "run 1 (uninterrupted, twice side by side): done at step 20" in out
    assert (
        "covered: the first 20 of 60,000 steps; differences that begin later are not seen: "
        "--steps N checks the first N"
    ) in out
    assert code == 0, out
    assert "exact: the final checkpoints (step 20) are bit-identical" in out
    assert "first differ" not in out


@pytest.mark.slow
def test_a_framework_writing_into_a_fixed_relative_folder_runs_side_by_side(
    checks: dict[str, Check],
) -> None:
    # Accelerate's save_state() refuses a project_dir checkpoint folder that exists: two runs
    # sharing accelerate_out/ would fail. Each run has a working folder of its own.
    code, out = finished(checks["accelerate"])
    assert code == 0, out
    assert "exact: the final checkpoints (step 6) are bit-identical" in out
    assert not (checks["accelerate"].tmp.parent / "accelerate_out").exists()


# -- usage, and a script that fails ----------------------------------------------------------


def nbresume_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nbresume", *args],
        cwd=cwd,
        env=environment(cwd),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_a_command_or_with_too_few_steps_it_is_a_usage_error(tmp_path: Path) -> None:
    for args in (["check"], ["check", "--"], ["check", "--steps", "8", "--"]):
        done = nbresume_cli(tmp_path, *args)
        assert done.returncode == 2, done
        assert "the command to check is missing" in done.stderr
        assert "nbresume check -- python train.py" in done.stderr
    done = nbresume_cli(tmp_path, "check", "--steps", "1", "--", "python", "train.py")
    assert done.returncode == 2
    assert "--steps: must be at least 2, got 1" in done.stderr


def test_a_script_that_fails_is_reported_with_its_output_and_nothing_is_left(
    tmp_path: Path,
) -> None:
    (tmp_path / "broken.py").write_text("print('loading data')\nraise SystemExit(3)\n")
    done = nbresume_cli(tmp_path, "check", "--", sys.executable, "broken.py")
    assert done.returncode == 1, done
    assert "FAILED: run 1: the script exited with status 3; its last lines:" in done.stdout
    assert "    loading data" in done.stdout  # the end of its output, to see why
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("nbresume-check-")]


# -- nothing outlives the check: the script's processes, its folders, its log in memory --------

#: A script that starts a process of its own (which, with "stubborn", ignores SIGTERM) and
#: notes both pids, in the run named by "hang-in=run1|run2"; there it then fails ("fail") or
#: waits to be ended. Elsewhere it trains four steps and saves, as a script under check does.
LINGERING = """
import os, subprocess, sys, time
import nbresume
from testkit.stateful import Weights

run = os.environ["NBRESUME_CHECK_DIR"].rsplit("/", 1)[-1]
if f"hang-in={run}" in sys.argv or (run == "run1b" and "hang-in=run1" in sys.argv):
    ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    ignore = ignore if "stubborn" in sys.argv else ""
    child = subprocess.Popen([sys.executable, "-c", ignore + "import time; time.sleep(600)"])
    # Beside the script itself: each run works in a folder of its own (links to this one).
    with open(os.path.join(os.path.dirname(os.path.realpath(__file__)), "pids"), "a") as note:
        note.write(f"{os.getpid()} {child.pid}\\n")
    if "fail" in sys.argv:
        raise SystemExit(3)
    time.sleep(600)


weights = Weights()
ckpt = nbresume.Checkpointer("runs/x", every=None, async_save=False, quiet=True, w=weights)
for step in ckpt.steps(4):
    weights.w += step
ckpt.close()
"""


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: it only waits to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def noted_pids(folder: Path) -> list[int]:
    note = folder / "pids"
    text = note.read_text() if note.exists() else ""
    return [int(pid) for line in text.splitlines() for pid in line.split()]


@contextlib.contextmanager
def lingering_check(tmp_path: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``nbresume check`` of :data:`LINGERING`, started; whatever the test leaves running
    is killed at its end (each script's group, and the processes they noted)."""
    (tmp_path / "lingering.py").write_text(LINGERING)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    command = [sys.executable, "-m", "nbresume", "check", "--steps", "4", "--timeout", "120"]
    # Started as from a terminal, where Ctrl-C reaches it: a test run started in the background
    # of a shell without job control has SIGINT ignored, and an ignored signal passes on to
    # every process started (a handler does not: exec puts it back to the default).
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        check = subprocess.Popen(
            [*command, "--", sys.executable, "lingering.py", *args],
            cwd=tmp_path,
            env=environment(tmp),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, found)
    try:
        yield check
    finally:
        if check.poll() is None:
            check.kill()
            check.communicate()
        for pid in noted_pids(tmp_path):
            if running(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def wait_for_scripts(check: subprocess.Popen[str], folder: Path, count: int) -> list[int]:
    """The pids of the ``count`` scripts (and the process each started), once all noted."""
    deadline = time.monotonic() + 120  # a hang guard, not a timing
    while len(noted_pids(folder)) < 2 * count:
        assert check.poll() is None, check.communicate()[0]
        assert time.monotonic() < deadline, "the scripts never started"
        time.sleep(0.05)
    return noted_pids(folder)


def assert_nothing_left(folder: Path, pids: list[int]) -> None:
    left = [pid for pid in pids if running(pid)]
    assert not left, f"still running after the check ended: {left}"
    folders = [p.name for p in (folder / "tmp").iterdir() if p.name.startswith("nbresume-check-")]
    assert not folders, f"the check left its folders behind: {folders}"


@pytest.mark.proc  # nbresume check runs the script in processes of its own
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_in_the_killed_run_ends_the_script_and_what_it_started_and_removes_the_folders(
    tmp_path: Path,
) -> None:
    with lingering_check(tmp_path, "hang-in=run2") as check:
        pids = wait_for_scripts(check, tmp_path, count=1)
        check.send_signal(signal.SIGINT)
        out, _ = check.communicate(timeout=120)
        assert check.returncode == 130, out
        assert "run 1 (uninterrupted, twice side by side): done at step 4" in out
        assert "nbresume check: interrupted" in out
        assert_nothing_left(tmp_path, pids)


@pytest.mark.proc  # nbresume check runs the script in processes of its own
@pytest.mark.slow  # the processes that ignore SIGTERM are given the whole grace
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigterm_ends_both_scripts_side_by_side_and_what_they_started_and_removes_the_folders(
    tmp_path: Path,
) -> None:
    with lingering_check(tmp_path, "hang-in=run1", "stubborn") as check:
        pids = wait_for_scripts(check, tmp_path, count=2)  # run 1 and 1b, side by side
        check.send_signal(signal.SIGTERM)
        out, _ = check.communicate(timeout=120)
        assert check.returncode == 128 + signal.SIGTERM, out
        assert "STOPPED by SIGTERM: the script's processes were ended" in out
        # The processes the scripts started ignore SIGTERM: killed after the grace.
        assert_nothing_left(tmp_path, pids)


@pytest.mark.proc  # nbresume check runs the script in processes of its own
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_what_a_script_leaves_running_when_it_exits_is_ended_with_it(tmp_path: Path) -> None:
    with lingering_check(tmp_path, "hang-in=run1", "fail") as check:
        out, _ = check.communicate(timeout=120)
        assert check.returncode == 1, out
        assert "the script exited with status 3" in out
        pids = noted_pids(tmp_path)
        assert len(pids) >= 2, out  # run 1b may have been ended before it noted its own
        assert_nothing_left(tmp_path, pids)


#: A failing script whose log grows by 1.5 GiB without a byte written (sparse), then ends
#: with the line that says why.
HUGE_LOG = """
import os

print("loading data", flush=True)
os.ftruncate(1, os.fstat(1).st_size + (3 << 29))
print("\\nthe last words: out of patience", flush=True)
raise SystemExit(3)
"""

#: Runs a command and prints the peak memory of its largest process (KiB), its descendants
#: that ended included.
PEAK = (
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
    "print('PEAK-KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"
)


def test_a_huge_log_is_read_for_its_last_lines_only(tmp_path: Path) -> None:
    (tmp_path / "huge_log.py").write_text(HUGE_LOG)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    command = [sys.executable, "-m", "nbresume", "check", "--", sys.executable, "huge_log.py"]
    done = subprocess.run(
        [sys.executable, "-c", PEAK, *command],
        cwd=tmp_path,
        env=environment(tmp),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the script exited with status 3; its last lines:" in done.stdout
    assert "    the last words: out of patience" in done.stdout
    peak_mib = int(done.stdout.split("PEAK-KIB")[1].split()[0]) / 1024
    assert peak_mib < 256, f"the check took {peak_mib:.0f} MiB for a 1.5 GiB log"
    assert not [p for p in tmp.iterdir() if p.name.startswith("nbresume-check-")]


# -- the knobs the command sets --------------------------------------------------------------


def test_check_dir_gives_each_checkpoint_folder_a_sub_folder_named_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sandbox = tmp_path / "sandbox"
    monkeypatch.setattr(knobs, "_CHECK_FOLDERS", {})
    monkeypatch.setenv(knobs.CHECK_DIR.name, str(sandbox))
    assert knobs.check_dir("runs/exp1") == str(sandbox / "exp1")
    assert knobs.check_dir("runs/exp1/") == str(sandbox / "exp1")  # the same folder, again
    assert knobs.check_dir("s3://bucket/exp1") == str(sandbox / "exp1-2")  # another exp1
    assert knobs.check_dir(sandbox / "exp1") == str(sandbox / "exp1")  # already inside
    ckpt = nbresume.Checkpointer(
        "memory://bucket/run", every=None, async_save=False, quiet=True, weights=Weights()
    )
    for _ in ckpt.steps(2):
        pass
    ckpt.close()
    assert [i.step for i in nbresume.CheckpointStore(sandbox / "run", keep=None).list()] == [2]
    run = nbresume.init("my-run", quiet=True)
    assert run.dir == str(sandbox / "my-run")
    monkeypatch.delenv(knobs.CHECK_DIR.name)
    assert knobs.check_dir("runs/exp1") is None


def test_stop_at_step_stops_a_fresh_and_a_resumed_loop_at_the_same_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def train(stop_at: int) -> tuple[int, bool, list[int]]:
        monkeypatch.setenv(knobs.STOP_AT_STEP.name, str(stop_at))
        weights = Weights()
        ckpt = nbresume.Checkpointer(
            tmp_path / "run", every=None, async_save=False, quiet=True, weights=weights
        )
        trained = []
        for step in ckpt.steps(100):
            weights.w += step
            trained.append(step)
        ckpt.close()
        return ckpt.step, ckpt.done, trained

    assert train(3) == (3, False, [0, 1, 2])  # saved at step 3 and stopped, not done
    assert train(5) == (5, False, [3, 4])  # resumed at 3: stops at 5, not 3 + 5
    assert [i.step for i in nbresume.CheckpointStore(tmp_path / "run", keep=None).list()] == [
        3,
        5,
    ]


def test_save_every_overrides_the_cadence_given(monkeypatch: pytest.MonkeyPatch) -> None:
    never, hourly = Cadence(None), Cadence("1h")
    assert not never.due(1, 0.0)
    assert not hourly.due(1, 0.0)
    monkeypatch.setenv(knobs.SAVE_EVERY.name, "2")
    assert not never.due(1, 0.0)
    assert never.due(2, 0.0)
    assert hourly.due(2, 0.0)
    monkeypatch.setenv(knobs.SAVE_EVERY.name, "0")
    with pytest.raises(nbresume.errors.UsageError, match="NBRESUME_SAVE_EVERY='0'"):
        never.due(1, 0.0)


# -- what the check observes of the script's globals, and the causes it names from them -------


class Environment:
    """An RL-style environment with a generator of its own (callable, as some are)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.noise = np.random.default_rng(seed)

    def __call__(self) -> float:
        return self.rng.random()


def test_the_globals_noted_are_generators_their_holders_attributes_and_counters() -> None:
    env = Environment(1)
    before = (env.rng.getstate(), env.noise.bit_generator.state)
    noted = observe.observe(
        {
            "env": env,
            "trained": 30,
            "flag": True,
            "_hidden": 3,
            "gen": torch.Generator(),
            "np": np,
            "observe": observe.observe,
        }
    )
    assert set(noted) == {"env.rng", "env.noise", "trained", "gen"}
    assert noted["trained"] == {"kind": "counter", "value": 30}
    assert noted["env.rng"]["kind"] == "random.Random"
    assert noted["env.noise"]["kind"] == "numpy Generator"
    assert (env.rng.getstate(), env.noise.bit_generator.state) == before  # read, not drawn
    env.rng.random()
    later = observe.observe({"env": env, "trained": 12})
    assert observe.differing(noted, later, leave_out=set()) == [
        ("env.rng", "random.Random", "its state differs at the end"),
        ("trained", "counter", "30 in run 1, 12 in run 2"),
    ]
    assert observe.differing(noted, later, leave_out={"trained"})[0][0] == "env.rng"


def weights_differ() -> Comparison:
    model = Difference(MODEL, "model", [("weight", "by up to 0.1")], total=2)
    return Comparison([model], {"": (12, 12)}, {"": {MODEL}})


def test_an_environment_whose_generator_a_resume_did_not_carry_is_the_cause_named() -> None:
    env = [("env.rng", "random.Random", "its state differs at the end")]
    found = causes.likely_causes(weights_differ(), "self.rng = random.Random(seed)\n", "rl.py", env)
    assert [v.cause for v in found] == [causes.ENVIRONMENT]
    assert "`env.rng` (random.Random) of rl.py ended in another state" in found[0].evidence
    assert "held by `env`" in found[0].evidence


def test_weights_that_differ_with_nothing_pointing_at_a_cause_name_none() -> None:
    assert causes.likely_causes(weights_differ(), "x = 1\n", "train.py") == []
