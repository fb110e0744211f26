"""One training run hopping platforms, as docs/platforms/hopping.md tells it: a first leg on
Colab (one process, checkpoints on Drive), a second as a Kaggle batch run on two processes
(torchrun, gloo on CPU), a third on an SSH box (one process), and every move of the checkpoint
verified: ``nbresume push`` from Colab to a Kaggle dataset, ``nbresume pull owner/slug`` from
Kaggle onto the box, ``nbresume pull ssh://...`` from the box home.

Each place is the real part a user meets, with Google's and Kaggle's servers simulated on
loopback; the box is this machine behind a real sshd, its commands sent through ``ssh``. The
journey ends with the bits of the same legs run on a local folder, and what the guide shows
each command print is what the journey printed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from colab.conftest import Colab
from conftest import HopLegs
from kaggle.conftest import NETGUARD
from kaggle.fake_kaggle import FakeKaggle
from remote.conftest import SshServer

from .conftest import KAGGLE_USER

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "examples" / "hop_train.py"
GUIDE = ROOT / "docs" / "platforms" / "hopping.md"
sys.path.insert(0, str(ROOT / "tests"))
from test_docs_outputs import blocks, matches, normalise  # noqa: E402

HANG_S = 300
#: Where each leg's session ends (NBRESUME_STOP_AT_STEP: a save, then the loop stops, as at a
#: session deadline); the third leg trains to the end (3 epochs of 8 steps).
COLAB_STOP, KAGGLE_STOP, TOTAL = 8, 16, 24
FINAL = re.compile(r"stopped at step (\d+) \((.+?)\); weights ([0-9a-f]{16})")


@dataclass
class Journey:
    """What the commands of one journey printed, by the guide's label, and where it ended."""

    name: str
    said: dict[str, tuple[str, str]] = field(default_factory=dict)  # label -> (command, output)
    finals: list[tuple[int, str, str]] = field(default_factory=list)  # (step, state, weights)
    home_copy: Path | None = None


@dataclass
class World:
    tmp: Path
    colab: Colab
    kaggle: FakeKaggle
    box: SshServer
    child_env: dict[str, str]

    def kaggle_env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with the user's Kaggle credentials, the network guard and temporary files
        kept in the test's folder."""
        config = self.tmp / "kaggle-config"
        config.mkdir(exist_ok=True)
        temp = self.tmp / "tmp"
        temp.mkdir(exist_ok=True)
        out = {k: v for k, v in env.items() if not k.startswith("KAGGLE_")}
        out.update(self.kaggle.client_env(config))
        out.update(
            PYTHONPATH=os.pathsep.join([str(NETGUARD), str(ROOT / "src")]),
            NBRESUME_TEST_NET_LOG=os.environ["NBRESUME_TEST_NET_LOG"],
            NBRESUME_PROBE_HOST="127.0.0.1",
            NBRESUME_PROBE_PORT=str(self.kaggle.refusing_port),
            TMPDIR=str(temp),
            CUDA_VISIBLE_DEVICES="",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        return out


def run(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    done = subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=HANG_S, check=False
    )
    return done.returncode, done.stdout + done.stderr


def finals(text: str) -> list[tuple[int, str, str]]:
    return [(int(s), state, w) for s, state, w in FINAL.findall(text)]


# -- the legs ----------------------------------------------------------------------------------


def colab_leg(world: World, journey: Journey) -> Path:
    """Leg 1 on a Colab VM: ``nbresume.init`` mounts Drive, ``%run hop_train.py {run.dir}``
    trains until the session ends; then ``!nbresume push`` moves the checkpoint to Kaggle."""
    vm = f"colab-{journey.name}"
    temp = world.tmp / "tmp"
    temp.mkdir(exist_ok=True)
    env = world.colab.env(vm, 0.2, {"COLAB_RELEASE_TAG": "release-colab-test", "TMPDIR": str(temp)})
    cell = (
        "import runpy, sys\n"
        "import nbresume\n"
        f"run = nbresume.init({journey.name!r}, accelerator='cpu', quiet=True)\n"
        f"sys.argv = ['hop_train.py', run.dir]\n"  # what %run hop_train.py {run.dir} does
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "print('run.dir', run.dir)\n"
    )
    code, text = run(
        [sys.executable, "-c", cell],
        {**env, "NBRESUME_STOP_AT_STEP": str(COLAB_STOP)},
        world.colab.tmp / vm,
    )
    assert code == 0, text
    assert "continuing from step 0 on 1 process(es)" in text, text
    journey.finals += finals(text)
    run_dir = Path(text.split("run.dir ", 1)[1].split()[0])
    assert run_dir.parent.parent == world.colab.tmp / vm / "drive" / "MyDrive"

    # The move: one line in the notebook, on the same VM.
    command = ["push", str(run_dir), "--kaggle-dataset", f"{KAGGLE_USER}/{journey.name}-ckpt"]
    code, text = run(
        [sys.executable, "-m", "nbresume.cli", *command],
        world.kaggle_env(env),
        world.colab.tmp / vm,
    )
    assert code == 0, text
    journey.said["push"] = ("nbresume " + shlex.join(command), text)
    return run_dir


def kaggle_notebook(folder: Path, name: str) -> Path:
    """The Kaggle notebook of the guide: the first cell, the script, torchrun."""

    def cell(source: str) -> dict[str, object]:
        return {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                "source": source}  # fmt: skip

    notebook = {
        "cells": [
            cell(f"import nbresume\nrun = nbresume.init({name!r}, accelerator='cpu')"),
            cell("%%writefile hop_train.py\n" + SCRIPT.read_text()),
            cell("!torchrun --standalone --nproc_per_node 2 hop_train.py {run.dir}"),
        ],
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "hop_kaggle.ipynb"
    path.write_text(json.dumps(notebook, indent=1))
    return path


def kaggle_leg(world: World, journey: Journey) -> str:
    """Leg 2: the notebook pushed as a batch run with the checkpoint's dataset attached;
    torchrun's two processes continue the run until the session ends."""
    laptop = world.tmp / f"laptop-{journey.name}"
    notebook = kaggle_notebook(laptop, journey.name)
    kernel = f"{KAGGLE_USER}/{journey.name}-kaggle"
    dataset = f"{KAGGLE_USER}/{journey.name}-ckpt"
    command = ["commit", notebook.name, "--kernel", kernel, "--dataset", dataset,
               "--no-internet", "--no-wheel", "--no-smoke"]  # fmt: skip
    code, text = run(
        [sys.executable, "-m", "nbresume.cli", *command], world.kaggle_env(world.child_env), laptop
    )
    assert code == 0, text
    world.kaggle.wait_idle(HANG_S)
    version = world.kaggle.kernel(kernel).latest()
    assert version is not None
    assert version.status == "COMPLETE", version.log[-3000:]
    executed = json.loads((version.machine / "__notebook__.ipynb").read_text())
    torchrun = "".join(
        output.get("text", "") if isinstance(output.get("text"), str) else "".join(output["text"])
        for output in executed["cells"][2]["outputs"]
        if output.get("output_type") == "stream"
    )
    assert "continuing from step 8 on 2 process(es)" in torchrun, torchrun
    assert "the world size changed from 1 to 2 process(es) at step 8" in torchrun, torchrun
    journey.said["torchrun"] = ("torchrun --standalone --nproc_per_node 2 hop_train.py "
                                f"/kaggle/working/nbresume/{journey.name}", torchrun)  # fmt: skip
    journey.finals += finals(torchrun)
    return kernel


def box_command(world: World, folder: Path, env: dict[str, str], *argv: str) -> tuple[int, str]:
    """``argv`` run on the box, through ssh, in ``folder`` with ``env``."""
    setting = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    remote = f"cd {shlex.quote(str(folder))} && env -i {setting} {shlex.join(argv)}"
    ssh = [
        "ssh", "-F", str(world.box.home / ".ssh" / "config"),
        "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
        "-o", f"UserKnownHostsFile={world.tmp / 'known_hosts'}", "-o", "LogLevel=ERROR",
        "sshbox", remote,
    ]  # fmt: skip
    return run(ssh, {**world.child_env, "HOME": str(world.box.home)}, world.tmp)


def ssh_leg(world: World, journey: Journey, kernel: str) -> Path:
    """Leg 3 on the box: ``nbresume pull owner/slug`` brings the Kaggle leg's output,
    verified; ``nbresume run`` trains to the end in one process."""
    box = world.tmp / f"box-{journey.name}"
    box.mkdir()
    (box / "hop_train.py").write_text(SCRIPT.read_text())
    bin_dir = Path(sys.executable).parent
    env = world.kaggle_env(world.child_env)
    env.update(HOME=str(box), PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    pull = ["nbresume", "pull", kernel, "hop"]
    code, text = box_command(world, box, env, *pull)
    assert code == 0, text
    journey.said["pull-kaggle"] = (shlex.join(pull), text)
    run_dir = f"hop/nbresume/{journey.name}"
    train = ["nbresume", "run", "--dir", run_dir, "--", "python", "hop_train.py", run_dir]
    code, text = box_command(world, box, env, *train)
    assert code == 0, text
    assert "continuing from step 16 on 1 process(es)" in text, text
    assert "the world size changed from 2 to 1 process(es) at step 16" in text, text
    journey.said["box-run"] = (shlex.join(train), text)
    journey.finals += finals(text)
    return box / run_dir


def home_pull(world: World, journey: Journey, box_run: Path) -> None:
    """The last move: the finished run off the box, onto the user's own machine, verified."""
    laptop = world.tmp / f"laptop-{journey.name}"
    laptop.mkdir(exist_ok=True)
    command = ["pull", world.box.url(box_run), journey.name]
    code, text = run(
        [sys.executable, "-m", "nbresume.cli", *command],
        {**world.child_env, "HOME": str(world.box.home)},
        laptop,
    )
    assert code == 0, text
    journey.said["pull-home"] = ("nbresume " + shlex.join(command), text)
    journey.home_copy = laptop / journey.name


def hop(world: World, name: str) -> Journey:
    journey = Journey(name)
    temp = world.tmp / "tmp"
    temp.mkdir(exist_ok=True)
    world.kaggle.run_env.update(
        NBRESUME_STOP_AT_STEP=str(KAGGLE_STOP),
        TMPDIR=str(temp),  # torchrun's own folders too
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    colab_leg(world, journey)
    kernel = kaggle_leg(world, journey)
    box_run = ssh_leg(world, journey, kernel)
    home_pull(world, journey, box_run)
    return journey


# -- the test ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_run_hops_from_colab_to_kaggle_s_two_processes_to_an_ssh_box(
    tmp_path: Path,
    colab: Colab,
    kaggle_site: FakeKaggle,
    sshd: SshServer,
    child_env: dict[str, str],
    *,
    hop_legs: HopLegs,
) -> None:
    world = World(tmp_path, colab, kaggle_site, sshd, child_env)
    first = hop(world, "hop-demo")

    # Each leg resumed from the previous leg's last checkpoint and stopped where its session
    # ended; the last one finished the training.
    steps = [(step, state) for step, state, _ in first.finals]
    assert steps == [
        (COLAB_STOP, "to be continued"),
        (KAGGLE_STOP, "to be continued"),
        (TOTAL, "the training is done"),
    ]
    # Every move verified: the push copied and checked the checkpoint before uploading it,
    # Kaggle's nbresume.init verified it again as it seeded /kaggle/working, the pulls checked
    # every file against its manifest.
    push = first.said["push"][1]
    assert f"OK    {COLAB_STOP:012d}" in push, push
    assert "verified" in push, push
    assert "OK 3/3" in first.said["pull-kaggle"][1], first.said["pull-kaggle"][1]
    assert "the remote copy is safe to tear down" in first.said["pull-home"][1]
    assert first.home_copy is not None
    assert sorted(p.name for p in first.home_copy.iterdir() if p.name.isdigit()) == [
        f"{s:012d}" for s in (KAGGLE_STOP, 20, TOTAL)
    ]

    # The same legs on a local folder end with the same bits, leg after leg.
    assert first.finals == hop_legs.on_a_folder
    model = f"{TOTAL:012d}/model.safetensors"
    assert (first.home_copy / model).read_bytes() == (hop_legs.folder / model).read_bytes()

    # What the guide shows each command print is what these commands printed.
    check_guide(world, first)


def check_guide(world: World, journey: Journey) -> None:
    box = world.tmp / f"box-{journey.name}"
    replace = [
        (str(world.colab.tmp / f"colab-{journey.name}" / "drive"), "/content/drive"),
        (str(box), "/root"),
        (str(world.tmp / f"laptop-{journey.name}"), "/home/you"),
        ("ssh://sshbox/", "ssh://box/"),
        ("http://localhost/", "https://www.kaggle.com/"),
    ]
    varies = [  # on both sides: what differs from one run (and one processor) to the next
        (r"weights [0-9a-f]{16}", "weights <hash>"),
        (r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "<time>"),
        (r"exit (\d+) after \d+(s|m\d\ds)", r"exit \1 after <duration>"),
    ]
    shown = {
        b.how.rsplit("(", 1)[1].rstrip(")"): b
        for b in blocks()
        if b.page == GUIDE and b.how.startswith("checked by ")
    }
    problems = [
        f"{label}: shown in the guide, run by no leg"
        for label in shown.keys() - journey.said.keys()
    ]
    for label, (command, output) in journey.said.items():
        text = f"$ {command}\n{output}"
        for old, new in replace:
            text = text.replace(old, new)
        expected = shown[label].text if label in shown else "(no block)"
        for pattern, replacement in varies:
            text = re.sub(pattern, replacement, text)
            expected = re.sub(pattern, replacement, expected)
        actual, expected = normalise(text), normalise(expected)
        if not matches(expected, actual):
            problems.append(f"{label}:\n--- the guide shows:\n{expected}\n--- run:\n{actual}")
    assert not problems, "\n\n".join(problems)
