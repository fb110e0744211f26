"""The accelerator and CUDA build checks.

GPUs come from an ``nvidia-smi`` stand-in on PATH that answers as the real one does; the
torch side of the P100 / driver cases is described with the architecture lists that real
torch wheels report (``torch.cuda.get_arch_list()``), since this machine has no CUDA build.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import nbresume
from nbresume.errors import UsageError
from nbresume.platforms import by_name
from nbresume.platforms.gpu import Gpu, TorchInfo, parse_nvidia_smi, read_version_file
from nbresume.preflight_checks import Check, Expectation, check_accelerator, check_cuda_build

# What `torch.cuda.get_arch_list()` reports for two published Linux wheels.
ARCH_CU121 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
ARCH_CU128 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")

P100 = Gpu(0, "Tesla P100-PCIE-16GB", "550.90.07", (6, 0))
T4 = Gpu(0, "Tesla T4", "550.90.07", (7, 5))
RTX4090 = Gpu(0, "NVIDIA GeForce RTX 4090", "550.90.07", (8, 9))


def torch_build(arch: tuple[str, ...], cuda: str = "12.8") -> TorchInfo:
    return TorchInfo(
        installed=True, version=f"2.8.0+cu{cuda.replace('.', '')}", cuda=cuda,
        arch_list=arch, device_count=1,
    )  # fmt: skip


def installed_torch_is_cpu_only() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec is not None
    assert spec.origin is not None
    return read_version_file(Path(spec.origin).parent / "version.py")[1] is None


def _accelerator(expect: str | None, gpu: Gpu, torch: TorchInfo, platform: str = "kaggle") -> Check:
    return check_accelerator(
        Expectation(expect),
        gpus=[gpu],
        smi_status="ok",
        torch=torch,
        tpu="",
        platform=by_name(platform),
    )


def test_p100_on_a_build_without_sm_60_fails_with_the_fix() -> None:
    check = _accelerator("gpu", P100, torch_build(ARCH_CU128))
    assert check.status == "fail"
    assert "no kernels for Tesla P100-PCIE-16GB (sm_60)" in check.seen
    assert "sm_60" in check.fix
    assert "Settings → Accelerator → GPU T4 x2" in check.fix
    # Without an expectation it is a warning: the run may not need the GPU.
    assert _accelerator(None, P100, torch_build(ARCH_CU128)).status == "warn"


def test_p100_on_a_build_with_sm_60_is_fine() -> None:
    assert _accelerator("gpu", P100, torch_build(ARCH_CU121, "12.1")).status == "ok"


def test_a_newer_minor_architecture_runs_the_older_kernels() -> None:
    assert _accelerator("gpu", RTX4090, torch_build(("sm_80", "sm_86"))).status == "ok"
    assert _accelerator("gpu", T4, torch_build(ARCH_CU128)).status == "ok"


def test_ptx_runs_on_any_later_architecture() -> None:
    hopper = Gpu(0, "NVIDIA H100", "550.90.07", (9, 0))
    assert _accelerator("gpu", hopper, torch_build(("sm_80", "sm_86"))).status == "fail"
    assert _accelerator("gpu", hopper, torch_build(("sm_80", "compute_86"))).status == "ok"


def test_a_cpu_only_torch_on_a_gpu_machine() -> None:
    cpu_build = TorchInfo(installed=True, version="2.13.0+cpu", cuda=None, arch_list=())
    check = _accelerator("gpu", T4, cpu_build)
    assert check.status == "fail"
    assert "CPU-only build" in check.seen
    assert "download.pytorch.org/whl/cu" in check.fix
    assert check_cuda_build([T4], cpu_build).status == "warn"


def test_a_driver_too_old_for_the_torch_build_is_a_warning() -> None:
    old = Gpu(0, "Tesla T4", "470.82.01", (7, 5))
    check = check_cuda_build([old], torch_build(ARCH_CU121, "12.1"))
    assert check.status == "warn"
    assert "needs driver 525.60.13 or newer" in check.seen
    assert "470.82.01" in check.seen
    assert check_cuda_build([T4], torch_build(ARCH_CU121, "12.1")).status == "ok"
    new = Gpu(0, "NVIDIA B200", "580.65.06", (10, 0))
    assert check_cuda_build([new], torch_build(ARCH_CU128, "13.0")).status == "ok"
    assert check_cuda_build([T4], torch_build(ARCH_CU128, "13.0")).status == "warn"


def test_nvidia_smi_output_is_parsed() -> None:
    gpus = parse_nvidia_smi("Tesla T4, 535.104.05, 7.5\nTesla T4, 535.104.05, 7.5\n")
    assert [(g.index, g.name, g.driver, g.capability) for g in gpus] == [
        (0, "Tesla T4", "535.104.05", (7, 5)),
        (1, "Tesla T4", "535.104.05", (7, 5)),
    ]
    (unknown,) = parse_nvidia_smi("Tesla K80, 470.82.01, [N/A]\n")
    assert unknown.capability is None


# -- through the preflight, with an nvidia-smi on PATH ---------------------------------------


def test_gpus_are_listed_and_cuda_visible_devices_is_honoured(
    fake_nvidia_smi: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(["Tesla T4, 535.104.05, 7.5", "Tesla T4, 535.104.05, 7.5"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nbresume.preflight()["accelerator"].seen.startswith("2 x Tesla T4 (sm_75)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert nbresume.preflight()["accelerator"].seen.startswith("1 x Tesla T4 (sm_75)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    check = nbresume.preflight(accelerator="gpu")["accelerator"]
    assert check.status == "fail"
    assert check.seen.startswith("no GPU")


def test_two_gpus_expected_one_present(
    fake_nvidia_smi: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not installed_torch_is_cpu_only():
        pytest.skip("a CUDA torch would be asked about the real GPUs of this machine")
    fake_nvidia_smi(["Tesla T4, 535.104.05, 7.5"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    check = nbresume.preflight(accelerator="gpu:2")["accelerator"]
    assert check.status == "fail"
    assert "2 GPUs expected" in check.seen


def test_this_machines_cpu_only_torch_cannot_use_a_listed_gpu(
    fake_nvidia_smi: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not installed_torch_is_cpu_only():
        pytest.skip("the installed torch is a CUDA build")
    fake_nvidia_smi(["Tesla T4, 535.104.05, 7.5"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    report = nbresume.preflight(accelerator="gpu")
    assert report["accelerator"].status == "fail"
    assert "CPU-only build" in report["accelerator"].seen
    assert report["cuda build"].status == "warn"


def test_a_gpu_attached_to_a_cpu_kaggle_session_spends_quota(
    fake_nvidia_smi: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(["Tesla T4, 535.104.05, 7.5"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    check = nbresume.preflight(accelerator="cpu")["accelerator"]
    assert check.status == "warn"
    assert "GPU quota" in check.fix


@pytest.mark.timeout(30)
def test_a_hanging_nvidia_smi_does_not_hold_the_preflight(
    fake_nvidia_smi: Callable[..., Path],
) -> None:
    script = fake_nvidia_smi([], sleep=0)
    pid_file = script.with_name("nvidia-smi.pid")
    script.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    report = nbresume.preflight()
    assert "nvidia-smi gave no answer within 1 s" in report["accelerator"].seen
    # The hung process was killed, not left behind holding the GPU's driver.
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_failing_nvidia_smi_is_reported(fake_nvidia_smi: Callable[..., Path]) -> None:
    script = fake_nvidia_smi([])
    script.write_text(
        "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the "
        "NVIDIA driver.'\nexit 9\n"
    )
    seen = nbresume.preflight()["accelerator"].seen
    assert "nvidia-smi failed: NVIDIA-SMI has failed" in seen


# -- TPUs and the accelerator argument -------------------------------------------------------


def test_tpu_expectation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    check = nbresume.preflight(accelerator="tpu")["accelerator"]
    assert check.status == "fail"
    assert "TPU VM v5e-8" in check.fix
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    check = nbresume.preflight(accelerator="tpu")["accelerator"]
    assert check.status == "ok"
    assert "v5litepod-8" in check.seen


@pytest.mark.parametrize("spec", ["gpu:0", "tpu:2", "gpus", "cuda:x", "npu"])
def test_unknown_accelerator_is_a_usage_error(spec: str) -> None:
    with pytest.raises(UsageError, match="accelerator="):
        nbresume.preflight(accelerator=spec)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("GPU", ("gpu", 1)), ("gpu:2", ("gpu", 2)), ("cuda", ("gpu", 1)), ("cpu", ("cpu", 1))],
)
def test_accelerator_spellings(spec: str, expected: tuple[str, int]) -> None:
    from nbresume.preflight_checks import parse_accelerator

    parsed = parse_accelerator(spec)
    assert (parsed.kind, parsed.count) == expected
