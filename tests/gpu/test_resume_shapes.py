"""Killed twice with SIGKILL and restarted, GPU training ends bit-identical to a run that was
never stopped: every loop shape users write, the common GPU variants of one representative
loop, the Hugging Face Trainer and Lightning.

Each scenario (``train_gpu.py`` says what each run trains) is an uninterrupted reference run,
two runs killed at random moments (each after at least one new checkpoint; the newest
checkpoint must verify and the next run must start from it), and a run to the end; the final
weights and optimizer state are compared with the reference's, tensor by tensor, bit for bit.
When they differ, a second uninterrupted run tells a resume that is not exact from a run that
is not deterministic at all, and the check's line says which.

The scenarios run in real processes forked from the suite's warm server (``testkit.warmfork``:
torch is imported once), several at once where the machine has the cores: the tests then
only wait for their own. ``NBRESUME_GPU_TESTS_DEVICE=cpu`` runs everything on the CPU. The
random moments come from a seed that is printed; ``NBRESUME_GPU_SEED=<seed>`` replays it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.gpu.conftest import DEVICE, requires_device

import nbresume
import nbresume.hf
from gpu import train_gpu
from testkit import warmfork
from testkit.paths import ROOT, with_testkit

pytestmark = [pytest.mark.gpu, pytest.mark.slow, requires_device]

SCRIPT = Path(train_gpu.__file__)
shapes = train_gpu.shapes

#: Seconds one run may take before it counts as hung (compiling on a CPU is the slowest).
RUN_LIMIT_S = 240.0 if DEVICE == "cuda" else 400.0


def compile_skip_reason() -> str | None:
    if DEVICE == "cuda" and importlib.util.find_spec("triton") is None:
        return "torch.compile on CUDA needs triton, which is not installed"
    if DEVICE == "cpu" and shutil.which(os.environ.get("CXX", "g++")) is None:
        return "torch.compile on the CPU needs a C++ compiler (g++), which is not found"
    return None


#: scenario -> why it cannot run here (None: it can).
SKIPS: dict[str, Callable[[], str | None]] = {
    "variant-compile": compile_skip_reason,
    "hf": lambda: None if importlib.util.find_spec("transformers") else "transformers missing",
    "lightning": lambda: None if importlib.util.find_spec("lightning") else "lightning missing",
}


@dataclass(frozen=True)
class Plan:
    """How a scenario trains and where its kills may land."""

    kind: str
    name: str
    total: int  # steps of the whole run
    pause: float  # seconds each step sleeps in the killed runs, so that kills land mid-run

    def kill_window(self, resume_from: int, kill: int) -> tuple[int, int]:
        """The steps the ``kill``-th kill (0 or 1) may follow, after a run that resumed from
        ``resume_from``: late enough that a new checkpoint is committed, early enough that
        steps are left (the first kill in the first half, so that the second has room)."""
        if self.kind == "lightning":  # a checkpoint at each epoch's end only: kill mid-epoch
            epoch = train_gpu.LIGHTNING_BATCHES
            return resume_from + epoch + 3, resume_from + 2 * epoch - 1
        if self.kind == "hf":
            every = train_gpu.HF_EVERY
            return resume_from + every + 2, resume_from + 3 * every + 2
        every = shapes.EVERY if self.kind == "shape" else train_gpu.VARIANT_EVERY
        last = self.total - 2 if kill else self.total // 2 + 1
        return resume_from + 2 * every + 1, last


def plans() -> dict[str, Plan]:
    """Every scenario, the longest first (they start in this order)."""
    found = {
        "hf": Plan("hf", "trainer", train_gpu.HF_STEPS, 0.01),
        "lightning": Plan(
            "lightning",
            "lightning",
            train_gpu.LIGHTNING_EPOCHS * train_gpu.LIGHTNING_BATCHES,
            0.005,
        ),
    }
    total = train_gpu.VARIANT_EPOCHS * train_gpu.VARIANT_BATCHES
    for variant in sorted(train_gpu.VARIANTS, key=lambda v: v != "compile"):
        found[f"variant-{variant}"] = Plan("variant", variant, total, 0.004)
    for shape, (_epochs, steps) in shapes.SHAPES.items():
        found[f"shape-{shape}"] = Plan("shape", shape, steps, 0.004)
    return found


PLANS = plans()


def child_env(home: Path) -> dict[str, str]:
    """The children's environment: nbresume from this checkout, one math thread, cuBLAS's
    deterministic workspace set before Python starts (as the docs ask), nothing online, and
    the caches (torch.compile's among them) in ``home``."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **with_testkit({**os.environ, "PYTHONPATH": path}),
        "OMP_NUM_THREADS": "1",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        # No process that forks may start CUDA: torch.cuda.is_available() then asks NVML.
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(home / "hf"),
        "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor"),
        "TMPDIR": str(home / "tmp"),  # what else torch.compile writes (its C++ headers)
        # Compiled in the training process itself: no pool of compile workers is started, and
        # none outlives a run killed while it compiles.
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "TRITON_CACHE_DIR": str(home / "triton"),
        "TOKENIZERS_PARALLELISM": "false",
    }


#: What a child forked after CUDA started in its parent says; the runner then execs instead.
_FORK_POISONED = ("Cannot re-initialize CUDA in forked subprocess", "CUDA initialization")


class Runner:
    """Runs training processes one at a time: forked from the warm server, or, if a forked
    child cannot start CUDA, each in a new interpreter."""

    def __init__(self, workdir: Path, caches: Path) -> None:
        self.workdir = workdir
        self.env = child_env(caches)
        (caches / "tmp").mkdir(parents=True, exist_ok=True)
        self.fork = os.environ.get("NBRESUME_GPU_TESTS_FORK", "1") != "0"
        self.note = ""
        self.runs = 0

    def _start(self, command: dict[str, Any]) -> tuple[int, Callable[[float], int]]:
        """Start one run; its pid, and a function that waits for its exit status."""
        argv = [sys.executable, str(SCRIPT), "run", json.dumps(command)]
        child: subprocess.Popen[bytes] | warmfork.WarmProcess
        if self.fork:
            child = warmfork.popen(argv, stdin=subprocess.DEVNULL, env=self.env)
        else:
            child = subprocess.Popen(argv, env=self.env)

        def wait(deadline: float) -> int:
            try:
                return child.wait(max(0.0, deadline - time.monotonic()))
            finally:
                if isinstance(child, warmfork.WarmProcess) and child.returncode is not None:
                    child.close()

        return child.pid, wait

    def run(self, folder: Path, plan: Plan, *, kill_at: int | None = None) -> tuple[int, str]:
        """Train ``plan`` in ``folder``; with ``kill_at``, SIGKILL the process once it has
        reported that step. Returns (exit status, what it printed)."""
        self.runs += 1
        log = self.workdir / f"run-{self.runs}.log"
        command = {
            "kind": plan.kind,
            "name": plan.name,
            "folder": str(folder),
            "log": str(log),
            "out": str(self.workdir / f"final-{self.runs}.pt"),
            "pause": 0.0 if kill_at is None else plan.pause,
            "device": DEVICE,
        }
        pid, wait = self._start(command)
        deadline = time.monotonic() + RUN_LIMIT_S
        try:
            if kill_at is not None:
                while time.monotonic() < deadline:
                    text = log.read_text() if log.exists() else ""
                    steps = lines(text, "step")
                    if (steps and steps[-1] >= kill_at) or "done " in text or "error " in text:
                        os.kill(pid, signal.SIGKILL)
                        break
                    time.sleep(0.002)
            status = wait(deadline)
        except (AssertionError, subprocess.TimeoutExpired):
            os.kill(pid, signal.SIGKILL)  # hung: the test fails with what it printed
            raise AssertionError(f"run {self.runs} hung:\n{log.read_text()[-3000:]}") from None
        text = log.read_text()
        if self.fork and status == 1 and any(s in text for s in _FORK_POISONED):
            self.fork = False
            self.note = "forked children could not start CUDA: one interpreter per run"
            return self.run(folder, plan, kill_at=kill_at)
        return status, text

    def final(self) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = torch.load(
            self.workdir / f"final-{self.runs}.pt", weights_only=True
        )
        return tensors

    def close(self) -> None:
        """Nothing to end: each run is waited for (or killed) by :meth:`run`."""


def lines(text: str, kind: str) -> list[int]:
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith(kind + " ")]


def committed(plan: Plan, folder: Path) -> int:
    """The step of the newest checkpoint the next run resumes from; it verifies."""
    if plan.kind == "hf":
        found = nbresume.hf.last_checkpoint(folder)  # the newest that verifies
        assert found is not None, "no Trainer checkpoint verifies"
        return int(found.rsplit("-", 1)[1])
    if plan.kind == "lightning":
        from nbresume.lightning import last_checkpoint  # imports Lightning

        last = last_checkpoint(folder / "ckpts")
        assert last is not None, "no Lightning checkpoint verifies"
        report = nbresume.verify(last)
        assert report.ok, report.summary
        return max(r.step for r in report.results)
    report = nbresume.CheckpointStore(folder, keep=None).verify()
    assert report.ok, report.summary
    return max(r.step for r in report.results)


@dataclass
class Outcome:
    """What one scenario found."""

    difference: str  # the first tensor that differs from the reference's; "" when none
    resumed_from: list[int]
    restored: list[str] = field(default_factory=list)  # the frameworks' "restored ..." lines
    control: str = ""  # when it differs: whether two uninterrupted runs agree
    deterministic: bool = True  # two uninterrupted runs agree (checked when it differs)
    seconds: float = 0.0
    note: str = ""


def scenario(runner: Runner, root: Path, plan: Plan, chance: random.Random) -> Outcome:
    started = time.monotonic()
    status, text = runner.run(root / "reference", plan)
    assert status == 0, f"the uninterrupted run failed:\n{text[-4000:]}"
    assert lines(text, "done") == [plan.total], text[-4000:]
    reference = runner.final()

    folder = root / "run"
    resume_from, resumed, restored = 0, [], []
    for kill in range(2):
        first, last = plan.kill_window(resume_from, kill)
        kill_at = chance.randint(first, last)
        status, text = runner.run(folder, plan, kill_at=kill_at)
        context = f"kill {kill + 1} at step >= {kill_at}:\n{text[-4000:]}"
        assert status == -signal.SIGKILL, context
        assert lines(text, "start") == [resume_from], context
        restored += [line for line in text.splitlines() if line.startswith("restored ")]
        newest = committed(plan, folder)
        assert newest >= max(lines(text, "verified"), default=resume_from), context
        assert newest > resume_from, f"no checkpoint after {resume_from}: {context}"
        resume_from = newest
        resumed.append(newest)

    status, text = runner.run(folder, plan)
    assert status == 0, f"the last run failed:\n{text[-4000:]}"
    assert lines(text, "start") == [resume_from], text[-4000:]
    assert lines(text, "done") == [plan.total], text[-4000:]
    restored += [line for line in text.splitlines() if line.startswith("restored ")]
    outcome = Outcome(train_gpu.first_difference(reference, runner.final()), resumed, restored)
    if outcome.difference:
        status, text = runner.run(root / "control", plan)
        assert status == 0, f"the second uninterrupted run failed:\n{text[-4000:]}"
        again = train_gpu.first_difference(reference, runner.final())
        outcome.deterministic = not again
        outcome.control = (
            f"two uninterrupted runs differ too: {again}"
            if again
            else "two uninterrupted runs agree: the resume is not exact"
        )
    outcome.seconds = time.monotonic() - started
    outcome.note = runner.note
    return outcome


class Scenarios:
    """Runs the scenarios of the selected tests, several at once where there are cores for
    them (``NBRESUME_GPU_TESTS_PARALLEL``), each thread with its own runner."""

    def __init__(self, root: Path, names: list[str], seed: int) -> None:
        self.root = root
        self.seed = seed
        default = max(1, min(8, (os.cpu_count() or 2) // 2))
        workers = int(os.environ.get("NBRESUME_GPU_TESTS_PARALLEL") or default)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="scenario")
        self.local = threading.local()
        self.runners: list[Runner] = []
        self.lock = threading.Lock()
        self.futures: dict[str, Future[Outcome]] = {}
        for name in names:
            self.futures[name] = self.pool.submit(self._run, name)

    def _runner(self) -> Runner:
        runner: Runner | None = getattr(self.local, "runner", None)
        if runner is None:
            with self.lock:
                runner = Runner(self.root / f"runner-{len(self.runners)}", self.root / "caches")
                runner.workdir.mkdir()
                self.runners.append(runner)
            self.local.runner = runner
        return runner

    def _run(self, name: str) -> Outcome:
        chance = random.Random(f"{self.seed}:{name}")
        root = self.root / name
        root.mkdir()
        return scenario(self._runner(), root, PLANS[name], chance)

    def result(self, name: str) -> Outcome:
        if name not in self.futures:  # a test run on its own, not seen at collection
            self.futures[name] = self.pool.submit(self._run, name)
        return self.futures[name].result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for runner in self.runners:
            runner.close()


@pytest.fixture(scope="module")
def scenarios(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scenarios]:
    seed = int(os.environ.get("NBRESUME_GPU_SEED") or random.SystemRandom().randrange(10**9))
    print(f"\nkill moments: seed {seed} (replay: NBRESUME_GPU_SEED={seed})")
    wanted = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("scenario") if callspec is not None else None
        if name in PLANS and name not in wanted and SKIPS.get(name, lambda: None)() is None:
            wanted.append(name)
    running = Scenarios(tmp_path_factory.mktemp("scenarios"), wanted, seed)
    yield running
    running.close()


def check(
    scenarios: Scenarios,
    gpu_check: Callable[[str, bool, str], None],
    name: str,
    *,
    framework: bool = False,
) -> None:
    reason = SKIPS.get(name, lambda: None)()
    if reason is not None:
        pytest.skip(reason)
    outcome = scenarios.result(name)
    details = [f"resumed at {outcome.resumed_from}", f"{outcome.seconds:.0f} s"]
    if outcome.note:
        details.append(outcome.note)
    not_exact = [line for line in outcome.restored if line != "restored exact"]
    if framework:
        assert len(outcome.restored) == 2, f"two resumes, each compared: {outcome.restored}"
        details.append("state restored exactly" if not not_exact else not_exact[0])
    if outcome.difference:
        details[:0] = [f"first: {outcome.difference}", outcome.control]
    if framework and outcome.difference and not outcome.deterministic:
        details.append("the framework's run is not deterministic on this device, outside nbresume")
    gpu_check(name, not outcome.difference, "; ".join(details))
    assert not not_exact, f"{name}: what the framework restored is not the checkpoint: {not_exact}"
    if framework and not outcome.deterministic:
        return  # what nbresume promises held: the state restored is exactly the checkpoint's
    assert not outcome.difference, (
        f"{name} after the kills: {outcome.difference}; {outcome.control}"
    )


@pytest.mark.parametrize("scenario", ["hf"])
@pytest.mark.filterwarnings("ignore:nbresume. passing over")  # a save the kill cut short
def test_the_trainer_with_fp16_resumes_bit_identically(
    scenarios: Scenarios, gpu_check: Callable[[str, bool, str], None], scenario: str
) -> None:
    """The Hugging Face Trainer (fp16 on CUDA, full determinism), killed mid-epoch twice,
    resumed from ``nbresume.hf.last_checkpoint``."""
    check(scenarios, gpu_check, scenario, framework=True)


@pytest.mark.parametrize("scenario", ["lightning"])
def test_lightning_resumes_bit_identically(
    scenarios: Scenarios, gpu_check: Callable[[str, bool, str], None], scenario: str
) -> None:
    """Lightning on the device with ``nbresume.lightning``, checkpoints at epoch ends, killed
    mid-epoch twice: each resume replays the epoch from its start."""
    check(scenarios, gpu_check, scenario, framework=True)


@pytest.mark.parametrize("scenario", [n for n, plan in PLANS.items() if plan.kind == "variant"])
def test_a_variant_of_the_representative_loop_resumes_bit_identically(
    scenarios: Scenarios, gpu_check: Callable[[str, bool, str], None], scenario: str
) -> None:
    """A conv net with BatchNorm and dropout, ``ck.epochs()`` over ``ck.loader()`` of a
    shuffled DataLoader that augments at random: bf16, fp16 with a GradScaler, workers with
    pinned memory, ``torch.compile``, channels_last (and plain fp32)."""
    check(scenarios, gpu_check, scenario)


@pytest.mark.parametrize("scenario", [n for n, plan in PLANS.items() if plan.kind == "shape"])
def test_every_loop_shape_resumes_bit_identically(
    scenarios: Scenarios, gpu_check: Callable[[str, bool, str], None], scenario: str
) -> None:
    """The loop shapes of ``tests/train_loop_shapes.py``, on the device."""
    check(scenarios, gpu_check, scenario)
