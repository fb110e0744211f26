"""GPU memory and health in the preflight and ``nbresume doctor``.

Every case starts from an output a real card printed (``data/nvidia-smi/``, sources in its
README): a Tesla T4, an A100 (MIG on) and an L4 as ``nvidia-smi -q -x``, a Kaggle P100 as
``--query-gpu`` CSV, and the driver's Xid lines from ``dmesg``. A sick or throttled card is the
recorded one with the named fields changed here, in the test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tests.platforms.conftest import write_executable

from nbresume.cli import main
from nbresume.platforms.nvidia_smi import (
    GpuQuery,
    health_verdict,
    memory_verdict,
    parse_compute_apps,
    parse_query_gpu,
    parse_xid,
    parse_xml,
)
from tiers import starts_processes

DATA = Path(__file__).parent / "data" / "nvidia-smi"
T4 = (DATA / "tesla-t4.xml").read_text()
A100 = (DATA / "a100-sxm4-80gb.xml").read_text()
L4 = (DATA / "l4.xml").read_text()
NO_LOG = "the kernel log cannot be read (Operation not permitted)"


def changed(xml: str, *pairs: tuple[str, str]) -> str:
    """The recorded output with fields changed; each change must hit exactly once."""
    for old, new in pairs:
        assert xml.count(old) == 1, old
        xml = xml.replace(old, new)
    return xml


def test_the_recorded_cards_are_read() -> None:
    (t4,) = parse_xml(T4)
    assert (t4.name, t4.total_mib, t4.used_mib, t4.free_mib) == ("Tesla T4", 15360, 1032, 13939)
    assert (t4.temperature_c, t4.slowdown_temperature_c) == (40, 93)
    assert (t4.sm_clock_mhz, t4.max_sm_clock_mhz, t4.power_w, t4.power_limit_w) == (
        585, 1590, 26.78, 70.0,
    )  # fmt: skip
    assert t4.throttle == ()
    assert t4.ecc_uncorrectable == 0
    assert [(p.pid, p.name, p.used_mib, p.kind) for p in t4.processes or ()] == [
        (675, "/usr/lib/xorg/Xorg", 22, "G"),
        (5762, "python", 1005, "C"),
    ]
    (a100,) = parse_xml(A100)  # a driver-535 report: clocks_event_reasons, gpu_power_readings
    assert a100.mig
    assert a100.processes == ()
    assert a100.power_limit_w == 500.0
    (l4,) = parse_xml(L4)  # sram_uncorrectable_parity/secded, remapped rows
    assert l4.throttle == ("gpu_idle",)
    assert l4.ecc_uncorrectable == 0
    assert not l4.remap_failed
    (p100,) = parse_query_gpu(
        (DATA / "p100-query-gpu.csv").read_text(), ["name", "memory.total", "memory.free"]
    )
    assert (p100.name, p100.total_mib, p100.free_mib) == ("Tesla P100-PCIE-16GB", 16280, 16280)


def test_not_an_nvidia_smi_report_is_refused() -> None:
    with pytest.raises(ValueError, match="not an nvidia-smi XML report"):
        parse_xml("NVIDIA-SMI has failed because it couldn't communicate with the driver")


def test_query_gpu_with_its_header_and_units() -> None:
    fields = ["name", "memory.total", "memory.used", "memory.free", "temperature.gpu"]
    text = (
        "name, memory.total [MiB], memory.used [MiB], memory.free [MiB], temperature.gpu\n"
        "Tesla P100-PCIE-16GB, 16280 MiB, 0 MiB, 16280 MiB, 36\n"
    )
    (p100,) = parse_query_gpu(text, fields)
    assert (p100.used_mib, p100.free_mib, p100.temperature_c) == (0, 16280, 36)
    verdict = memory_verdict([p100], own_pid=1)
    assert verdict.status == "ok"
    assert "GPU 0 Tesla P100-PCIE-16GB: 15.9 GiB free of 15.9 GiB" in verdict.seen


def test_compute_apps_are_read() -> None:
    text = (
        "gpu_uuid, pid, process_name, used_gpu_memory [MiB]\n"
        "GPU-d37e67a5-91dd-3774-a5cb-99096249601a, 5762, python, 1005 MiB\n"
    )
    ((uuid, process),) = parse_compute_apps(text)
    assert uuid.startswith("GPU-d37e67a5")
    assert (process.pid, process.used_mib) == (5762, 1005)
    assert parse_compute_apps("No running processes found\n") == []


# -- VRAM: free memory, a second run, a holder nvidia-smi cannot see ------------------------


def test_a_second_run_on_the_gpu_is_named_with_the_fix() -> None:
    verdict = memory_verdict(parse_xml(T4), own_pid=1)
    assert verdict.status == "warn"
    assert "GPU 0 Tesla T4: 13.6 GiB free of 15.0 GiB" in verdict.seen
    assert "python (pid 5762, 1005 MiB)" in verdict.seen
    assert "Xorg" not in verdict.seen  # a display server is not a training run
    assert "CUDA_VISIBLE_DEVICES" in verdict.fix
    assert "kill" in verdict.fix


def test_this_process_is_not_another_run() -> None:
    assert memory_verdict(parse_xml(T4), own_pid=5762).status == "ok"


def test_memory_held_by_processes_nvidia_smi_cannot_see() -> None:
    # The L4 with 9 GiB in use and an empty process table: a crashed kernel in another
    # container, or a zombie.
    zombie = changed(
        L4,
        ("<used>1 MiB</used>\n            <free>22601 MiB</free>",
         "<used>9217 MiB</used>\n            <free>13385 MiB</free>"),
    )  # fmt: skip
    start = zombie.index("<processes>")
    zombie = (
        zombie[:start]
        + "<processes>\n        </processes>"
        + zombie[zombie.index("</processes>") + len("</processes>") :]
    )
    verdict = memory_verdict(parse_xml(zombie), own_pid=1)
    assert verdict.status == "warn"
    assert "9.0 GiB held by processes nvidia-smi does not list" in verdict.seen
    assert "fuser -v /dev/nvidia*" in verdict.fix
    assert "torch.cuda.empty_cache()" in verdict.fix
    # The same memory held by this very process (torch's reserved memory) is no mystery.
    assert memory_verdict(parse_xml(zombie), own_pid=1, own_mib={0: 8700}).status == "ok"


def test_an_idle_a100_with_mig_is_fine() -> None:
    verdict = memory_verdict(parse_xml(A100), own_pid=1)
    assert verdict.status == "ok"
    assert verdict.seen == "GPU 0 NVIDIA A100-SXM4-80GB (MIG on): 79.1 GiB free of 80.0 GiB"


# -- health: clocks, temperature, power, throttling, ECC, Xid -------------------------------


@pytest.mark.parametrize("xml", [T4, A100, L4], ids=["T4", "A100", "L4"])
def test_healthy_cards_read_ok_with_their_readings(xml: str) -> None:
    verdict = health_verdict(parse_xml(xml), None, NO_LOG)
    assert verdict.status == "ok", verdict.seen
    assert "°C" in verdict.seen
    assert "SM clock" in verdict.seen
    assert " W" in verdict.seen
    assert f"Xid errors not checked: {NO_LOG}" in verdict.seen


def test_the_t4_readings() -> None:
    verdict = health_verdict(parse_xml(T4), [], "ok")
    assert verdict.seen == (
        "GPU 0 Tesla T4: 40 °C, SM clock 585 of 1590 MHz, 26.78 of 70 W; "
        "no Xid errors in the kernel log"
    )


def test_a_thermally_throttled_gpu_is_a_warning_with_what_to_do() -> None:
    hot = changed(
        T4,
        ("<clocks_throttle_reason_hw_thermal_slowdown>Not Active",
         "<clocks_throttle_reason_hw_thermal_slowdown>Active"),
        ("<gpu_temp>40 C</gpu_temp>", "<gpu_temp>91 C</gpu_temp>"),
    )  # fmt: skip
    verdict = health_verdict(parse_xml(hot), [], "ok")
    assert verdict.status == "warn"
    assert "throttled: hardware thermal slowdown (the GPU is too hot)" in verdict.seen
    assert "another machine" in verdict.fix
    assert "resumes there" in verdict.fix


def test_a_hot_gpu_near_its_slowdown_temperature() -> None:
    hot = changed(T4, ("<gpu_temp>40 C</gpu_temp>", "<gpu_temp>89 C</gpu_temp>"))
    verdict = health_verdict(parse_xml(hot), [], "ok")
    assert verdict.status == "warn"
    assert "hot: 89 °C, it slows down at 93 °C" in verdict.seen


def test_the_power_cap_of_a_busy_gpu_is_normal_but_a_lowered_limit_is_not() -> None:
    capped = changed(
        A100,
        ("<clocks_event_reason_sw_power_cap>Not Active",
         "<clocks_event_reason_sw_power_cap>Active"),
    )  # fmt: skip
    verdict = health_verdict(parse_xml(capped), [], "ok")
    assert verdict.status == "ok"
    assert "at its power limit" in verdict.seen
    lowered = changed(A100, ("<current_power_limit>500.00 W", "<current_power_limit>250.00 W"))
    verdict = health_verdict(parse_xml(lowered), [], "ok")
    assert verdict.status == "warn"
    assert "power limit lowered to 250 W (default 500 W)" in verdict.seen


def test_uncorrectable_ecc_errors_fail() -> None:
    sick = changed(
        L4,
        ("<volatile>\n                <sram_correctable>0</sram_correctable>\n"
         "                <sram_uncorrectable_parity>0</sram_uncorrectable_parity>",
         "<volatile>\n                <sram_correctable>0</sram_correctable>\n"
         "                <sram_uncorrectable_parity>2</sram_uncorrectable_parity>"),
    )  # fmt: skip
    verdict = health_verdict(parse_xml(sick), [], "ok")
    assert verdict.status == "fail"
    assert "2 uncorrectable ECC error(s) since boot" in verdict.seen
    assert "hardware fault" in verdict.fix


def test_rows_waiting_for_remapping_are_a_warning() -> None:
    pending = changed(
        L4, ("<remapped_row_pending>No</remapped_row_pending>",
             "<remapped_row_pending>Yes</remapped_row_pending>"),
    )  # fmt: skip
    verdict = health_verdict(parse_xml(pending), [], "ok")
    assert verdict.status == "warn"
    assert "waits for a GPU reset" in verdict.seen


def test_xid_79_in_the_kernel_log_fails() -> None:
    xids = parse_xid((DATA / "dmesg-xid79.txt").read_text())
    assert [(x.xid, x.where) for x in xids] == [(79, "PCI:0000:00:04")]
    verdict = health_verdict(parse_xml(T4), xids, "ok")
    assert verdict.status == "fail"
    assert "Xid 79 (the GPU has fallen off the bus) on PCI:0000:00:04" in verdict.seen
    assert "not your code" in verdict.fix


def test_a_program_xid_is_a_warning_not_a_dead_card() -> None:
    xids = parse_xid((DATA / "dmesg-xid32.txt").read_text())
    assert [x.xid for x in xids] == [32, 32]
    verdict = health_verdict(parse_xml(T4), xids, "ok")
    assert verdict.status == "warn"
    assert verdict.seen.count("Xid 32") == 1  # repeated lines are said once


# -- the whole doctor, with stand-ins on PATH -----------------------------------------------


@pytest.fixture
@starts_processes  # nbresume runs the nvidia-smi and dmesg it installs
def gpu_box(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A machine whose ``nvidia-smi`` prints a recorded report and whose ``dmesg`` prints a
    recorded log (or is refused, as in a container)."""

    def install(xml: str, dmesg: str | None) -> None:
        bin_dir = tmp_path / "gpubin"
        (tmp_path / "report.xml").write_text(xml)
        name, driver, cap = parse_xml(xml)[0].name, "535.54.03", "7.5"
        write_executable(
            bin_dir / "nvidia-smi",
            "#!/bin/sh\n"
            f'if [ "$1" = "-q" ]; then cat "{tmp_path / "report.xml"}"; exit 0; fi\n'
            f"echo '{name}, {driver}, {cap}'\n",
        )
        if dmesg is None:
            body = "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2\nexit 1\n"
        else:
            (tmp_path / "kern.log").write_text(dmesg)
            body = f'cat "{tmp_path / "kern.log"}"\n'
        write_executable(bin_dir / "dmesg", "#!/bin/sh\n" + body)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    return install


def test_doctor_shows_vram_holders_health_and_determinism(
    gpu_box, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    gpu_box(T4, (DATA / "dmesg-xid79.txt").read_text())
    assert main(["doctor", "--json", "--dir", str(tmp_path / "ckpt")]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    memory, health, determinism = checks["gpu memory"], checks["gpu health"], checks["determinism"]
    assert memory["status"] == "warn"
    assert "python (pid 5762, 1005 MiB)" in memory["seen"]
    assert health["status"] == "fail"
    assert "Xid 79" in health["seen"]
    assert "SM clock 585 of 1590 MHz" in health["seen"]
    assert "may differ from an uninterrupted run in the last bits" in determinism["seen"]
    assert "deterministic=True" in determinism["fix"]


def test_doctor_in_a_container_says_the_kernel_log_was_not_read(
    gpu_box, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    gpu_box(A100, None)
    assert main(["doctor", "--dir", str(tmp_path / "ckpt")]) == 0
    # The report wraps its lines to the terminal's width: compare words, not line breaks.
    out = " ".join(capsys.readouterr().out.split())
    assert "gpu memory" in out
    assert "79.1 GiB free of 80.0 GiB" in out
    assert "Xid errors not checked: the kernel log cannot be read" in out
    assert "Operation not permitted" in out


@pytest.mark.proc  # nbresume runs the nvidia-smi and dmesg it installs
def test_a_gpu_query_not_needed_leaves_nothing_running(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # nvidia-smi lists no GPU; its full report would hang. Nothing of the query may run on
    # after doctor returned: neither the hung report nor a dmesg started later.
    bin_dir, ran = tmp_path / "gpubin", tmp_path / "ran"
    write_executable(
        bin_dir / "nvidia-smi",
        "#!/bin/sh\n"
        f'if [ "$1" = "-q" ]; then echo $$ > "{ran / "report"}"; exec sleep 600; fi\n'
        "echo 'No devices were found' >&2\nexit 6\n",
    )
    write_executable(bin_dir / "dmesg", f'#!/bin/sh\ntouch "{ran / "dmesg"}"\n')
    ran.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert main(["doctor", "--dir", str(tmp_path / "ckpt")]) == 0
    assert "No devices were found" in " ".join(capsys.readouterr().out.split())
    if (ran / "report").exists():  # it had started: it was ended, and waited for
        with pytest.raises(ProcessLookupError):
            os.kill(int((ran / "report").read_text()), 0)
    assert not (ran / "dmesg").exists()


def test_no_gpu_no_gpu_lines(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["doctor", "--json", "--dir", str(tmp_path / "ckpt")]) == 0
    names = [c["name"] for c in json.loads(capsys.readouterr().out)["checks"]]
    assert "gpu memory" not in names
    assert "determinism" not in names


def test_a_query_that_failed_is_reported_not_raised() -> None:
    from nbresume.platforms.gpu import gpu_verdicts

    ((name, verdict),) = gpu_verdicts(GpuQuery([], "nvidia-smi failed: No devices", None, ""), [])
    assert name == "gpu memory"
    assert verdict.status == "ok"
    assert "No devices" in verdict.seen
