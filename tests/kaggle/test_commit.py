"""``nbresume commit``, ``status`` and ``pull`` with the real kaggle client against the fake
Kaggle: what is pushed, what a refusal from Kaggle does, and what a pull checks. Plus the
guards that keep every test away from the real Kaggle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.fake_kaggle import FakeKaggle
from testkit.paths import ROOT

from .conftest import commit, copy_notebook, nbresume, user_env


@pytest.mark.slow
def test_commit_smokes_pushes_runs_and_pull_verifies_every_checkpoint(
    tmp_path: Path, kaggle_server: FakeKaggle
) -> None:
    user = tmp_path / "user"
    notebook = copy_notebook("counter.ipynb", user)
    ref = f"{kaggle_server.username}/counter-run"
    env = user_env(tmp_path, kaggle_server)
    result = commit(
        tmp_path,
        kaggle_server,
        notebook,
        "counter-run",
        "--no-internet",
        "--no-wheel",  # the machines have nbresume (tests/kaggle/test_offline.py: the wheel)
        "--chain",
        "--poll",
        "0.2",
    )
    assert result.code == 0, result.text
    out = result.out
    assert "smoke: OK" in out
    assert f"pushed {ref} version 1: http://localhost/code/{ref}" in out
    # One leg was enough: the chain read "done" from the pulled checkpoint and stopped.
    assert "done: the training finished in leg 1 (counter at step 10)" in out
    assert kaggle_server.api_calls().count("SaveKernel") == 1

    metadata = json.loads((user / "kernel-metadata.json").read_text())
    assert metadata == {
        "id": ref,
        "title": "Counter Run",
        "code_file": "counter.ipynb",
        "language": "python",
        "kernel_type": "notebook",
        "is_private": True,
        "enable_gpu": False,
        "enable_tpu": False,
        "enable_internet": False,
        "dataset_sources": [],
        "competition_sources": [],
        "kernel_sources": [],
        "model_sources": [],
    }
    [push] = [r for r in kaggle_server.requests if r.path.endswith("/SaveKernel")]
    assert push.target.startswith("http://localhost/api/v1/kernels.KernelsApiService/")
    sent = json.loads(push.body["text"])
    assert [c["source"] for c in sent["cells"]] == [
        "".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]
    ]

    status = nbresume(["status", ref], cwd=user, env=env)
    assert (status.code, status.out) == (0, f"{ref}: COMPLETE\n")

    pulled = nbresume(["pull", ref, str(user / "out")], cwd=user, env=env)
    assert pulled.code == 0, pulled.text
    assert "nbresume/counter: OK    000000000010  step 10" in pulled.out
    assert pulled.out.splitlines()[-1] == "OK 1/1"
    state = json.loads((user / "out/nbresume/counter/000000000010/state.json").read_text())
    assert state["values"]["total"] == sum(range(10))

    # A byte of the checkpoint changes on Kaggle's side: the pull says so and fails.
    stored = kaggle_server.kernel(ref).versions[-1].working
    state_file = stored / "nbresume/counter/000000000010/state.json"
    data = bytearray(state_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    state_file.write_bytes(bytes(data))
    damaged = nbresume(["pull", ref, "-o", str(user / "damaged")], cwd=user, env=env)
    assert damaged.code == 1
    assert "FAIL  000000000010" in damaged.out
    assert damaged.out.splitlines()[-1] == "OK 0/1"

    # A listed name that climbs out of the destination is refused, and nothing lands there.
    kaggle_server.extra_listing = [
        {"fileName": "../escaped.txt", "url": f"{kaggle_server.url}/files/x/y/1/z"}
    ]
    hostile = nbresume(["pull", ref, str(user / "hostile")], cwd=user, env=env)
    assert hostile.code == 1
    assert "would land outside the folder" in hostile.err
    assert not (user / "escaped.txt").exists()


@pytest.mark.parametrize(
    ("accelerator", "expected"),
    [
        ("t4x2", (True, False, "NvidiaTeslaT4")),
        ("gpu", (True, False, "NvidiaTeslaT4")),
        ("NvidiaTeslaT4", (True, False, "NvidiaTeslaT4")),
        ("p100", (True, False, "NvidiaTeslaP100")),
        ("tpu", (False, True, "TpuV5E8")),
        ("cpu", (False, False, None)),
    ],
)
def test_accelerator_names_become_kaggle_settings(
    tmp_path: Path,
    kaggle_server: FakeKaggle,
    accelerator: str,
    expected: tuple[bool, bool, str | None],
) -> None:
    kaggle_server.execute = False
    notebook = copy_notebook("counter.ipynb", tmp_path / "user")
    result = commit(
        tmp_path,
        kaggle_server,
        notebook,
        "accel-run",
        "--no-smoke",
        "--accelerator",
        accelerator,
        "--internet",
        "--public",
        "--allow",
        "internet",
    )
    assert result.code == 0, result.text
    [push] = [r.body for r in kaggle_server.requests if r.path.endswith("/SaveKernel")]
    assert (push.get("enableGpu"), push.get("enableTpu"), push.get("machineShape")) == expected
    assert (push["enableInternet"], push["isPrivate"]) == (True, False)
    assert ("retired" in result.err) == (accelerator == "p100")


def test_an_unknown_accelerator_is_a_usage_error(tmp_path: Path, net_log: Path) -> None:
    notebook = copy_notebook("counter.ipynb", tmp_path / "user")
    result = nbresume(
        ["commit", str(notebook), "--kernel", "me/counter-run", "--accelerator", "a100x8"],
        cwd=notebook.parent,
        env=user_env(tmp_path, None),
    )
    assert result.code == 2
    assert "t4x2" in result.err
    assert "NvidiaTeslaT4" in result.err


@pytest.mark.parametrize(
    ("situation", "expected"),
    [
        ("quota", ["weekly GPU quota", "--accelerator cpu"]),
        ("sessions", ["Maximum batch GPU session count of 2 reached", "wait for one to finish"]),
        ("not-found", ["Notebook not found", "user name of these credentials"]),
    ],
)
def test_kaggle_refusals_end_commit_with_an_error_that_says_what_to_do(
    tmp_path: Path, kaggle_server: FakeKaggle, situation: str, expected: list[str]
) -> None:
    owner = kaggle_server.username
    if situation == "quota":
        kaggle_server.gpu_quota_used_up = True
    elif situation == "sessions":
        kaggle_server.busy_gpu_sessions = 2
    else:
        owner = "someone-else"
    notebook = copy_notebook("counter.ipynb", tmp_path / "user")
    result = commit(
        tmp_path,
        kaggle_server,
        notebook,
        "refused-run",
        *("--no-smoke", "--no-wheel", "--accelerator", "t4x2"),
        owner=owner,
    )
    assert result.code == 1
    [message] = [line for line in result.err.splitlines() if "nbresume commit: error" in line]
    for text in expected:
        assert text in message
    assert "pushed" not in result.out
    assert kaggle_server.api_calls() == ["SaveKernel"]
    assert kaggle_server.kernels == {}  # nothing runs


def test_missing_credentials_are_an_error_with_the_fix(tmp_path: Path, net_log: Path) -> None:
    notebook = copy_notebook("counter.ipynb", tmp_path / "user")
    env = user_env(tmp_path, None)
    env["KAGGLE_CONFIG_DIR"] = str(tmp_path / "empty-config")
    result = nbresume(
        ["commit", str(notebook), "--kernel", "me/counter-run", "--no-smoke"],
        cwd=notebook.parent,
        env=env,
    )
    assert result.code == 1
    assert "no Kaggle credentials found" in result.err
    assert "KAGGLE_USERNAME and KAGGLE_KEY" in result.err
    assert "Authentication required" not in result.text  # the client's own page is kept out


def test_status_of_a_notebook_kaggle_does_not_have(
    tmp_path: Path, kaggle_server: FakeKaggle
) -> None:
    result = nbresume(
        ["status", f"{kaggle_server.username}/never-pushed"],
        cwd=tmp_path,
        env=user_env(tmp_path, kaggle_server),
    )
    assert result.code == 1
    assert "no such notebook" in result.err


def test_a_call_meant_for_the_real_kaggle_never_leaves_the_machine(
    tmp_path: Path, kaggle_server: FakeKaggle, net_log: Path
) -> None:
    """Without KAGGLE_API_ENVIRONMENT the client calls https://api.kaggle.com: the proxy turns
    that into a CONNECT that the fake refuses and records; without the proxy, the network
    guard refuses the name lookup. Either way nothing leaves loopback, and it is noticed."""
    probe = (
        "from kaggle.api.kaggle_api_extended import KaggleApi\n"
        "api = KaggleApi(); api.authenticate(); api.kernels_status('someone/something')\n"
    )
    env = user_env(tmp_path, kaggle_server)
    del env["KAGGLE_API_ENVIRONMENT"]
    proxied = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert proxied.returncode != 0
    assert kaggle_server.violations == ["CONNECT api.kaggle.com:443"]
    kaggle_server.violations.clear()

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        del env[name]
    direct = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert direct.returncode != 0
    assert "name lookup of 'api.kaggle.com'" in net_log.read_text()
    net_log.write_text("")


QUICKSTARTS = sorted((ROOT / "notebooks").glob("*_quickstart.ipynb"), key=lambda p: p.name)


def parameter(notebook: Path, name: str) -> object:
    """The value the notebook's papermill parameters cell gives ``name`` (``None``: none)."""
    import ast

    for cell in json.loads(notebook.read_text())["cells"]:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            for node in ast.parse("".join(cell["source"])).body:
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name:
                    return ast.literal_eval(node.value)
    return None


@pytest.mark.slow
def test_dry_run_of_the_kaggle_quickstart_smokes_and_asks_for_its_gpu_without_credentials(
    tmp_path: Path, net_log: Path
) -> None:
    [source] = [p for p in QUICKSTARTS if p.name == "kaggle_quickstart.ipynb"]
    assert parameter(source, "accelerator") == "gpu"
    folder = tmp_path / "user"
    folder.mkdir()
    notebook = folder / source.name
    notebook.write_bytes(source.read_bytes())
    env = user_env(tmp_path, None)
    env["KAGGLE_CONFIG_DIR"] = str(tmp_path / "no-credentials")
    result = nbresume(["commit", "--dry-run", notebook.name], cwd=folder, env=env, timeout=600)
    assert result.code == 0, result.text
    assert "smoke: OK" in result.out
    assert '"enable_gpu": true' in result.out
    assert '"machine_shape": "NvidiaTeslaT4"' in result.out
    assert '"id": "YOUR-KAGGLE-USERNAME/kaggle-quickstart"' in result.out
    assert "credentials" not in result.text
    assert sorted(p.name for p in folder.iterdir()) == [source.name]  # nothing written


@pytest.mark.parametrize("source", QUICKSTARTS, ids=lambda p: p.stem)
def test_each_quickstart_notebook_commits_with_the_machine_it_asks_for(
    tmp_path: Path, kaggle_server: FakeKaggle, source: Path
) -> None:
    """No --accelerator: the commit asks Kaggle for what the notebook's parameters cell gives
    nbresume.init (accelerator = "gpu" there, init(accelerator=accelerator) later)."""
    kaggle_server.execute = False
    folder = tmp_path / "user"
    folder.mkdir()
    notebook = folder / source.name
    notebook.write_bytes(source.read_bytes())
    result = nbresume(
        ["commit", notebook.name, "--no-smoke"], cwd=folder, env=user_env(tmp_path, kaggle_server)
    )
    assert result.code == 0, result.text
    wanted = parameter(source, "accelerator")
    expected = {"gpu": (True, False), "tpu": (False, True)}.get(str(wanted), (False, False))
    metadata = json.loads((folder / "kernel-metadata.json").read_text())
    slug = source.stem.replace("_", "-")
    assert metadata["id"] == f"{kaggle_server.username}/{slug}"
    assert (metadata["enable_gpu"], metadata["enable_tpu"]) == expected
    [push] = [r.body for r in kaggle_server.requests if r.path.endswith("/SaveKernel")]
    assert (push["enableGpu"], push["enableTpu"]) == expected
    assert push["slug"] == metadata["id"]
