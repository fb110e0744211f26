"""The platform contract: one set of tests, run against every platform.

Each platform brings only a fixture (environment variables and a fake tree in ``tmp_path``)
and what a user of that platform is entitled to expect: its name, where its durable folder
is, its session cap, its danger clocks, and a fix for a missing GPU in its own words.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tests.platforms.conftest import CHECK_NAMES

import nbresume
from nbresume.checkpoint.loop import resolve_deadline
from nbresume.errors import PreflightError
from nbresume.platforms import PLATFORMS, Platform, detect

HOUR = 3600.0
NAME = "resnet-cifar"
#: Modules that detection must never import (they take seconds, or pull in a UI).
HEAVY = ("torch", "IPython", "ipywidgets", "google", "kaggle", "fsspec", "numpy")


def drive_unavailable() -> str:
    """Why Drive cannot be mounted in this test process ("" when the stand-in can)."""
    if importlib.util.find_spec("nbresume.platforms.drive") is None:
        return "nbresume.platforms.drive (mount_drive) is not in this checkout"
    try:
        importlib.import_module("google.colab.drive")
    except ImportError as exc:
        return f"google.colab.drive is not importable (tests/stand-ins/google-colab): {exc}"
    return ""


@dataclass
class Case:
    """A platform and what its users may expect of it."""

    id: str
    env: Callable[[Path], dict[str, str]]
    root: Callable[[Path], Path]
    cap_accelerated: float | None
    cap_cpu: float | None
    strict: bool
    gpu_fix: str
    clocks: dict[str, float | None] = field(default_factory=dict)
    setup: Callable[[Path], None] = lambda world: None
    needs_drive: bool = False
    slurm_end: float | None = None


SLURM_END = time.time() + 3 * HOUR


def _kaggle_case(case_id: str, run_type: str, *, strict: bool) -> Case:
    """Kaggle, its session run interactively or as a committed (batch) run."""
    return Case(
        case_id,
        env=lambda w: {"KAGGLE_KERNEL_RUN_TYPE": run_type},
        root=lambda w: w / "kaggle" / "working" / "nbresume" / NAME,
        cap_accelerated=9 * HOUR,
        cap_cpu=12 * HOUR,
        strict=strict,
        gpu_fix="Settings → Accelerator",
        clocks={"session cap": 12 * HOUR},
        setup=lambda w: (w / "kaggle" / "working").mkdir(parents=True),
    )


def _colab_setup(world: Path) -> None:
    (world / "content").mkdir()
    (world / "drive-cloud").mkdir()  # what the Drive stand-in serves as "Google's servers"


def _k8s_setup(world: Path) -> None:
    (world / "vol").mkdir()
    lines = [
        "22 1 0:21 / / rw,relatime - overlay overlay rw",
        f"31 22 8:1 / {world / 'vol'} rw,relatime - ext4 /dev/sdb rw",
    ]
    (world / "mountinfo").write_text("\n".join(lines) + "\n")


CASES = [
    Case(
        "colab",
        env=lambda w: {
            "COLAB_RELEASE_TAG": "release-colab_20250101-060000",
            "COLAB_STANDIN_ROOT": str(w / "drive-cloud"),
        },
        root=lambda w: w / "content" / "drive" / "MyDrive" / "nbresume" / NAME,
        cap_accelerated=12 * HOUR,
        cap_cpu=12 * HOUR,
        strict=False,
        gpu_fix="Runtime → Change runtime type",
        clocks={"idle disconnect": 90 * 60, "VM lifetime": 12 * HOUR},
        setup=_colab_setup,
        needs_drive=True,
    ),
    _kaggle_case("kaggle", "Interactive", strict=False),
    _kaggle_case("kaggle-batch", "Batch", strict=True),
    Case(
        "slurm",
        env=lambda w: {"SLURM_JOB_ID": "4242", "SLURM_JOB_END_TIME": str(int(SLURM_END))},
        root=lambda w: w / "home" / "nbresume" / NAME,
        cap_accelerated=None,
        cap_cpu=None,
        strict=False,
        gpu_fix="--gres=gpu:1",
        slurm_end=int(SLURM_END),
    ),
    Case(
        "kubernetes",
        env=lambda w: {
            "KUBERNETES_SERVICE_HOST": "10.96.0.1",
            "NBRESUME_HOME": str(w / "vol" / "nbresume"),
            "NBRESUME_MOUNTINFO": str(w / "mountinfo"),
        },
        root=lambda w: w / "vol" / "nbresume" / NAME,
        cap_accelerated=None,
        cap_cpu=None,
        strict=False,
        gpu_fix="nvidia.com/gpu",
        clocks={"termination grace period": 30.0},
        setup=_k8s_setup,
    ),
    Case(
        "ssh",
        # Without NBRESUME_HOME: the default under the user's home folder.
        env=lambda w: {"SSH_CONNECTION": "10.0.0.2 50022 10.0.0.3 22", "HOME": str(w / "user")},
        root=lambda w: w / "user" / "nbresume" / NAME,
        cap_accelerated=None,
        cap_cpu=None,
        strict=False,
        gpu_fix="nvidia-smi",
        setup=lambda w: (w / "user").mkdir(),
    ),
    Case(
        "local",
        env=lambda w: {},
        root=lambda w: w / "home" / "nbresume" / NAME,
        cap_accelerated=None,
        cap_cpu=None,
        strict=False,
        gpu_fix="nvidia-smi",
    ),
]


@pytest.fixture(params=CASES, ids=[c.id for c in CASES])
def case(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, clean_platform: Path
) -> Iterator[Case]:
    """Become the platform: set its variables and build its fake tree."""
    case: Case = request.param
    world = clean_platform
    if case.id == "ssh":
        monkeypatch.delenv("NBRESUME_HOME")
    case.setup(world)
    for name, value in case.env(world).items():
        monkeypatch.setenv(name, value)
    before = set(sys.modules)
    yield case
    if case.needs_drive and "google.colab.drive" in sys.modules:
        sys.modules["google.colab.drive"].flush_and_unmount()
    for name in set(sys.modules) - before:  # leave no google.colab behind for other tests
        if name == "google.colab" or name.startswith("google.colab."):
            del sys.modules[name]


@pytest.fixture
def world(clean_platform: Path) -> Path:
    return clean_platform


def _platform(case: Case) -> Platform:
    platform = detect()
    assert platform.name == case.id
    return platform


def _accelerated() -> bool:
    """What the session cap depends on: a GPU or TPU attached to this machine."""
    return bool(list(Path("/dev").glob("nvidia[0-9]*")))


def _skip_without_drive(case: Case) -> None:
    reason = drive_unavailable() if case.needs_drive else ""
    if reason:
        pytest.skip(f"Drive mount part of the Colab contract skipped: {reason}")


def test_detects_itself_and_imports_nothing_heavy(case: Case) -> None:
    code = (
        "import json, sys\n"
        "from nbresume.platforms import detect\n"
        "p = detect()\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(json.dumps({'name': p.name, 'heavy': heavy}))\n"
    )
    # A new interpreter: a fork of the warm server has torch imported already.
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ)
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"name": case.id, "heavy": []}
    assert detect().name == case.id  # and in this process too


def test_default_durable_root(case: Case, world: Path) -> None:
    assert Path(_platform(case).default_root(NAME)) == case.root(world)


def test_init_prepares_a_durable_folder_that_checkpoints_survive_in(
    case: Case, world: Path
) -> None:
    _skip_without_drive(case)
    run = nbresume.init(NAME, quiet=True)
    assert run.platform.name == case.id
    assert Path(run.dir) == case.root(world)
    assert run.report["durable folder"].status == "ok", run.report["durable folder"]
    assert nbresume.current_run() is run

    ckpt = run.checkpointer(every=None, async_save=False)
    ckpt["progress"] = {"epoch": 3}
    ckpt.save(step=40)
    ckpt.close()

    again = nbresume.init(NAME, quiet=True)
    resumed = again.checkpointer(every=None, async_save=False)
    resumed["progress"] = {"epoch": 0}
    assert resumed.restore() == 40
    assert resumed["progress"] == {"epoch": 3}
    resumed.close()


def test_session_cap_and_auto_deadline(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    platform = _platform(case)
    assert platform.session_cap_s(True) == case.cap_accelerated
    assert platform.session_cap_s(False) == case.cap_cpu
    start = float(os.environ["NBRESUME_SESSION_START"])
    deadline, label = resolve_deadline("auto")
    if case.slurm_end is not None:
        assert deadline == case.slurm_end
    else:
        cap = case.cap_accelerated if _accelerated() else case.cap_cpu
        assert deadline == (None if cap is None else pytest.approx(start + cap))
    assert bool(label) == (deadline is not None)

    monkeypatch.setenv("NBRESUME_SESSION_CAP", "2h")  # overrides any platform's figure
    deadline, label = resolve_deadline("auto")
    assert deadline == pytest.approx(start + 2 * HOUR)
    assert "NBRESUME_SESSION_CAP" in label


def test_danger_clocks_say_what_is_lost_and_how_nbresume_helps(case: Case) -> None:
    platform = _platform(case)
    clocks = platform.danger_clocks(False)
    assert clocks, "every platform names at least one way the work can end"
    for clock in clocks:
        assert clock.name
        assert clock.loses
        assert clock.protection
        assert clock.seconds is None or clock.seconds > 0
    by_name = {c.name: c.seconds for c in clocks}
    for name, seconds in case.clocks.items():
        assert by_name[name] == pytest.approx(seconds)
    if case.slurm_end is not None:
        assert by_name["job time limit"] == pytest.approx(case.slurm_end - time.time(), abs=60)
    assert 0 < platform.mtbf_s < float("inf")


def test_missing_gpu_fails_with_this_platforms_fix(case: Case) -> None:
    # CUDA_VISIBLE_DEVICES is empty (clean_platform): no GPU is usable on any machine.
    if case.strict:
        with pytest.raises(PreflightError, match="accelerator") as caught:
            nbresume.preflight(accelerator="gpu")
        assert case.gpu_fix in str(caught.value)
        report = caught.value.report
    else:
        report = nbresume.preflight(accelerator="gpu")
    assert isinstance(report, nbresume.Report)
    assert {c.name for c in report.checks} == set(CHECK_NAMES)
    check = report["accelerator"]
    assert check.status == "fail"
    assert case.gpu_fix in check.fix
    assert not report.ok
    assert report.platform == case.id


def test_every_platform_is_in_the_contract() -> None:
    assert {cls.name for cls in PLATFORMS} == {c.id for c in CASES}
