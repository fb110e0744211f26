"""What ``nvidia-smi`` and the kernel log say about a GPU's memory and health.

Three ``nvidia-smi`` outputs are read: ``nvidia-smi -q -x`` (XML: memory, clocks, temperature,
power, throttle reasons, ECC counters, retired pages, the processes it can see), and the CSV
of ``--query-gpu`` and ``--query-compute-apps``. Xid errors are not in ``nvidia-smi``'s output:
they are the driver's lines in the kernel log (``dmesg``), read when this user may read it.

The parsers are pure functions of the text, tested with outputs recorded on real cards
(``tests/platforms/data/nvidia-smi/``). :func:`query` runs the tools with a time limit.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from nbresume.checkpoint import forksafe

Status = Literal["ok", "warn", "fail"]

#: Seconds ``nvidia-smi -q -x`` (and ``dmesg``) may take before the report goes on without it.
QUERY_TIMEOUT_S = 2.0

#: Throttle reasons (the names of nvidia-smi's XML, without their prefix) that slow a GPU
#: down against the program's will: the hardware protecting itself, or a thermal limit.
SLOWDOWN_REASONS = {
    "hw_slowdown": "hardware slowdown (power supply or temperature)",
    "hw_thermal_slowdown": "hardware thermal slowdown (the GPU is too hot)",
    "hw_power_brake_slowdown": "hardware power brake (the power supply asked for less)",
    "sw_thermal_slowdown": "software thermal slowdown (the GPU is too hot)",
}
#: At the power limit: normal for a busy card; it matters when the limit was lowered.
POWER_CAP_REASON = "sw_power_cap"

#: Xid numbers that mean the card (or its memory) failed, not the program (NVIDIA's Xid
#: catalog): on a hosted or rented GPU the fix is another machine.
HARDWARE_XIDS = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "the GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP firmware timeout",
    120: "GSP firmware error",
}
#: Xid numbers a faulty program causes (a bad memory access, a killed kernel): not the card.
PROGRAM_XIDS = {13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped"}

_XID_LINE = re.compile(r"NVRM: Xid \((?P<where>[^)]*)\): (?P<xid>\d+)(?P<rest>.*)")


@dataclass(frozen=True)
class GpuProcess:
    """A process ``nvidia-smi`` lists on a GPU."""

    pid: int
    name: str
    used_mib: int | None
    #: ``"C"`` compute, ``"G"`` graphics, ``"C+G"``; ``""`` when not said.
    kind: str = "C"

    @property
    def compute(self) -> bool:
        return "C" in self.kind or not self.kind


@dataclass(frozen=True)
class GpuStatus:
    """One GPU's memory and health, as far as ``nvidia-smi`` reports it (``None``: not said)."""

    index: int
    name: str
    uuid: str = ""
    total_mib: int | None = None
    used_mib: int | None = None
    free_mib: int | None = None
    reserved_mib: int | None = None
    temperature_c: int | None = None
    slowdown_temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    default_power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    #: Active throttle reasons, by XML name without the prefix (``"hw_thermal_slowdown"``).
    throttle: tuple[str, ...] = ()
    ecc_enabled: bool | None = None
    #: Uncorrectable ECC errors since the driver loaded (``volatile``), all kinds summed.
    ecc_uncorrectable: int | None = None
    #: Memory the card took out of use, or failed to: retired pages, remapped rows.
    retirement_pending: bool = False
    remap_failed: bool = False
    mig: bool = False
    processes: tuple[GpuProcess, ...] | None = field(default=None)

    @property
    def listed_mib(self) -> int:
        """Memory held by the processes listed (graphics ones included)."""
        return sum(p.used_mib or 0 for p in self.processes or ())


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    match = re.search(r"-?\d+(?:\.\d+)?", text)
    return float(match.group()) if match else None


def _int(text: str | None) -> int | None:
    value = _number(text)
    return None if value is None else int(value)


def _text(node: ET.Element, path: str) -> str | None:
    found = node.find(path)
    if found is None or found.text is None:
        return None
    text = found.text.strip()
    return None if text in ("", "N/A", "[N/A]", "[Not Supported]", "Not Supported") else text


def _first(node: ET.Element, *paths: str) -> str | None:
    for path in paths:
        value = _text(node, path)
        if value is not None:
            return value
    return None


def _throttle_reasons(gpu: ET.Element) -> tuple[str, ...]:
    # Drivers before 535 say clocks_throttle_reasons; later ones clocks_event_reasons.
    for tag, prefix in (
        ("clocks_event_reasons", "clocks_event_reason_"),
        ("clocks_throttle_reasons", "clocks_throttle_reason_"),
    ):
        node = gpu.find(tag)
        if node is None:
            continue
        return tuple(
            child.tag.removeprefix(prefix)
            for child in node
            if (child.text or "").strip() == "Active"
        )
    return ()


def _ecc_uncorrectable(gpu: ET.Element) -> int | None:
    volatile = gpu.find("ecc_errors/volatile")
    if volatile is None:
        return None
    counts: list[int] = []
    for child in volatile.iter():
        # Names vary by driver: dram_uncorrectable, sram_uncorrectable_parity, or a nested
        # double_bit/total on old ones.
        if child is volatile:
            continue
        tag = child.tag
        if "uncorrectable" in tag or (tag == "total" and _parent_is(volatile, child, "double_bit")):
            value = _int((child.text or "").strip() or None)
            if value is not None:
                counts.append(value)
    return sum(counts) if counts else None


def _parent_is(root: ET.Element, child: ET.Element, tag: str) -> bool:
    return any(child in list(parent) for parent in root.iter(tag))


def _processes(gpu: ET.Element) -> tuple[GpuProcess, ...] | None:
    node = gpu.find("processes")
    if node is None:
        return None
    found = []
    for info in node.findall("process_info"):
        pid = _int(_text(info, "pid"))
        if pid is None:
            continue
        found.append(
            GpuProcess(
                pid=pid,
                name=_text(info, "process_name") or "?",
                used_mib=_int(_text(info, "used_memory")),
                kind=_text(info, "type") or "",
            )
        )
    return tuple(found)


def parse_xml(text: str) -> list[GpuStatus]:
    """Every GPU of an ``nvidia-smi -q -x`` report. Raises ``ValueError`` on text that is not
    such a report."""
    try:
        # The text comes from the local nvidia-smi (or a file recorded from it), not a network.
        root = ET.fromstring(text.encode())  # noqa: S314
    except ET.ParseError as exc:
        raise ValueError(f"not an nvidia-smi XML report: {exc}") from None
    if root.tag != "nvidia_smi_log":
        raise ValueError(f"not an nvidia-smi XML report: the root is <{root.tag}>")
    statuses = []
    for index, gpu in enumerate(root.findall("gpu")):
        power = gpu.find("gpu_power_readings")
        if power is None:
            power = gpu.find("power_readings")  # drivers before 535
        if power is None:
            power = ET.Element("none")
        limit = _first(power, "current_power_limit", "enforced_power_limit", "power_limit")
        ecc_mode = _text(gpu, "ecc_mode/current_ecc")
        statuses.append(
            GpuStatus(
                index=index,
                name=_text(gpu, "product_name") or "?",
                uuid=_text(gpu, "uuid") or "",
                total_mib=_int(_text(gpu, "fb_memory_usage/total")),
                used_mib=_int(_text(gpu, "fb_memory_usage/used")),
                free_mib=_int(_text(gpu, "fb_memory_usage/free")),
                reserved_mib=_int(_text(gpu, "fb_memory_usage/reserved")),
                temperature_c=_int(_text(gpu, "temperature/gpu_temp")),
                slowdown_temperature_c=_int(_text(gpu, "temperature/gpu_temp_slow_threshold")),
                power_w=_number(_text(power, "power_draw")),
                power_limit_w=_number(limit),
                default_power_limit_w=_number(_text(power, "default_power_limit")),
                sm_clock_mhz=_int(_text(gpu, "clocks/sm_clock")),
                max_sm_clock_mhz=_int(_text(gpu, "max_clocks/sm_clock")),
                throttle=_throttle_reasons(gpu),
                ecc_enabled=None if ecc_mode is None else ecc_mode == "Enabled",
                ecc_uncorrectable=_ecc_uncorrectable(gpu),
                retirement_pending=_text(gpu, "retired_pages/pending_retirement") == "Yes",
                remap_failed=_text(gpu, "remapped_rows/remapped_row_failure") == "Yes"
                or _text(gpu, "remapped_rows/remapped_row_pending") == "Yes",
                mig=_text(gpu, "mig_mode/current_mig") == "Enabled",
                processes=_processes(gpu),
            )
        )
    return statuses


def _csv_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.strip():
            rows.append([cell.strip() for cell in line.split(",")])
    return rows


def parse_query_gpu(text: str, fields: Sequence[str]) -> list[GpuStatus]:
    """GPUs from ``nvidia-smi --query-gpu=<fields> --format=csv[,noheader][,nounits]``.

    Known fields: ``name``, ``uuid``, ``memory.total``, ``memory.used``, ``memory.free``,
    ``temperature.gpu``, ``power.draw``, ``power.limit``, ``clocks.sm``, ``clocks.max.sm``;
    others are ignored. A header line, when present, is skipped.
    """
    rows = _csv_rows(text)
    if rows and [c.split(" [")[0] for c in rows[0]] == list(fields):
        rows = rows[1:]  # the header (with units in brackets)
    statuses = []
    for index, cells in enumerate(rows):
        row = cells
        if len(row) != len(fields):
            # A name with a comma in it: join the extra cells back into the name.
            extra = len(row) - len(fields)
            if extra < 0 or "name" not in fields:
                continue
            at = list(fields).index("name")
            row = [*row[:at], ", ".join(row[at : at + extra + 1]), *row[at + extra + 1 :]]
        values = dict(zip(fields, row, strict=True))
        statuses.append(
            GpuStatus(
                index=index,
                name=values.get("name", "?"),
                uuid=values.get("uuid", ""),
                total_mib=_int(values.get("memory.total")),
                used_mib=_int(values.get("memory.used")),
                free_mib=_int(values.get("memory.free")),
                temperature_c=_int(values.get("temperature.gpu")),
                power_w=_number(values.get("power.draw")),
                power_limit_w=_number(values.get("power.limit")),
                sm_clock_mhz=_int(values.get("clocks.sm")),
                max_sm_clock_mhz=_int(values.get("clocks.max.sm")),
            )
        )
    return statuses


def parse_compute_apps(text: str) -> list[tuple[str, GpuProcess]]:
    """``(gpu_uuid, process)`` pairs from ``nvidia-smi
    --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv[,noheader]``."""
    found = []
    for row in _csv_rows(text):
        if len(row) < 4 or not row[1].isdigit():
            continue  # the header, or "No running processes found"
        name = ", ".join(row[2:-1])
        found.append((row[0], GpuProcess(pid=int(row[1]), name=name, used_mib=_int(row[-1]))))
    return found


@dataclass(frozen=True)
class XidEvent:
    """One Xid error the driver logged: where, which, and the rest of its line."""

    where: str
    xid: int
    detail: str

    @property
    def hardware(self) -> bool:
        return self.xid in HARDWARE_XIDS

    def describe(self) -> str:
        meaning = HARDWARE_XIDS.get(self.xid) or PROGRAM_XIDS.get(self.xid) or "see NVIDIA's list"
        return f"Xid {self.xid} ({meaning}) on {self.where}"


def parse_xid(kernel_log: str) -> list[XidEvent]:
    """The Xid errors in kernel log text (``dmesg`` output)."""
    events = []
    for line in kernel_log.splitlines():
        match = _XID_LINE.search(line)
        if match:
            events.append(
                XidEvent(match["where"], int(match["xid"]), match["rest"].lstrip(", ").strip())
            )
    return events


@dataclass(frozen=True)
class GpuQuery:
    """What the tools said: the GPUs' status, the Xid errors, and how each read went."""

    gpus: list[GpuStatus]
    status: str
    xids: list[XidEvent] | None
    xid_status: str


Start = Callable[[list[str]], "subprocess.Popen[str] | None"]


def _start(command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def communicate(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str] | None:
    """``proc``'s stdout and stderr once it exits, or ``None`` (it is killed) when it has not
    within ``timeout`` seconds."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        # Not communicate(): a child of a hung tool could hold the pipes open.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        return None


def _run(command: list[str], timeout: float, start: Start = _start) -> tuple[str, str]:
    """``(stdout, "ok")`` or ``("", what went wrong)``; ``start`` starts the process (``None``:
    not started)."""
    try:
        proc = start(command)
    except OSError as exc:
        return "", f"{command[0]} could not start: {exc}"
    if proc is None:
        return "", f"{command[0]} was not run"
    answer = communicate(proc, timeout)
    if answer is None:
        return "", f"{command[0]} gave no answer within {timeout:g} s"
    out, err = answer
    if proc.returncode != 0:
        detail = (err or out).strip().splitlines()
        return "", detail[0] if detail else f"exit status {proc.returncode}"
    return out, "ok"


class GpuQueryRun:
    """``nvidia-smi -q -x`` and ``dmesg`` started at construction, read by :meth:`result`,
    so that they run while other checks do; :meth:`cancel` when the answer is not needed."""

    def __init__(self, timeout: float = QUERY_TIMEOUT_S) -> None:
        import threading

        self.timeout = timeout
        self._result: GpuQuery | None = None
        self._lock = forksafe.lock()
        self._cancelled = False
        self._procs: list[subprocess.Popen[str]] = []
        self._thread = threading.Thread(target=self._query, daemon=True)
        self._thread.start()

    def _query(self) -> None:
        self._result = query(self.timeout, self._start)

    def _start(self, command: list[str]) -> subprocess.Popen[str] | None:
        with self._lock:
            if self._cancelled:
                return None
            proc = _start(command)
            self._procs.append(proc)
            return proc

    def cancel(self) -> None:
        """End the tool running now and start no other: nothing of the query outlives the
        caller (a thread starting ``dmesg`` later, or a hung ``nvidia-smi`` left running)."""
        with self._lock:
            self._cancelled = True
            for proc in self._procs:
                if proc.poll() is None:
                    with contextlib.suppress(OSError):
                        proc.kill()
        self._thread.join(self.timeout + 1.0)

    def result(self) -> GpuQuery:
        self._thread.join(self.timeout * 2 + 1.0)
        if self._result is None:
            return GpuQuery([], f"nvidia-smi gave no answer within {self.timeout:g} s", None, "")
        return self._result


def query(timeout: float = QUERY_TIMEOUT_S, start: Start = _start) -> GpuQuery:
    """Run ``nvidia-smi -q -x`` and ``dmesg`` (each at most ``timeout`` seconds) and parse."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return GpuQuery([], "not found", None, "")
    out, status = _run([binary, "-q", "-x"], timeout, start)
    gpus: list[GpuStatus] = []
    if status == "ok":
        try:
            gpus = parse_xml(out)
        except ValueError as exc:
            status = str(exc)
    dmesg = shutil.which("dmesg")
    if dmesg is None:
        return GpuQuery(gpus, status, None, "dmesg not found")
    log, xid_status = _run([dmesg], timeout, start)
    if xid_status != "ok":
        # Containers (Colab, Kaggle) usually may not read the kernel log.
        return GpuQuery(gpus, status, None, f"the kernel log cannot be read ({xid_status})")
    return GpuQuery(gpus, status, parse_xid(log), "ok")


# -- what the report says ------------------------------------------------------------------

#: Memory a process's CUDA context takes beyond its tensors (a few hundred MiB): allowed for
#: this process, which nvidia-smi inside a container usually does not list.
CONTEXT_MIB = 512
#: Memory in use beyond what the listed processes (and this one) explain before it is called
#: held by processes nvidia-smi cannot see.
UNEXPLAINED_MIB = 1024
#: Degrees under the card's own slowdown temperature at which it is called hot.
HOT_MARGIN_C = 5
#: Without a slowdown threshold from the card: hot from this temperature on.
HOT_C = 85

_OTHER_RUN_FIX = (
    "another program on this GPU shares its memory and its time: both run slower and either "
    "can run out of memory. Stop it (`kill PID`; in a notebook, restart the kernel that holds "
    "it), or give each run a GPU of its own with CUDA_VISIBLE_DEVICES"
)
_HIDDEN_FIX = (
    "find the holders with `fuser -v /dev/nvidia*` and stop them; in a notebook whose cell "
    "crashed, `del` the tensors and call `torch.cuda.empty_cache()`, or restart the runtime "
    "(memory held by another process is freed only when that process ends)"
)
_SLOW_FIX = (
    "a throttled GPU runs slower with no error. A hosted or rented GPU cannot be cooled by you: "
    "if it stays throttled, get another machine (a new runtime or session); the run resumes "
    "there from its last verified checkpoint"
)
_DEAD_FIX = (
    "a hardware fault, not your code: stop and get another machine (a new runtime, session or "
    "instance); the run resumes there from its last verified checkpoint"
)


@dataclass(frozen=True)
class Verdict:
    """A check's status (``ok``, ``warn``, ``fail``), what was seen, and the fix."""

    status: Status
    seen: str
    fix: str = ""


def _worst(statuses: Sequence[Status]) -> Status:
    for status in ("fail", "warn"):
        if status in statuses:
            return status
    return "ok"


def _gib(mib: int) -> str:
    return f"{mib / 1024:.1f} GiB"


def memory_verdict(
    gpus: Sequence[GpuStatus], *, own_pid: int, own_mib: dict[int, int] | None = None
) -> Verdict:
    """Free memory on each GPU and who else holds some.

    ``own_mib`` is what this process holds on each GPU (by index; torch's reserved memory),
    which nvidia-smi in a container does not list.
    """
    parts: list[str] = []
    statuses: list[Status] = []
    fixes: list[str] = []
    for gpu in gpus:
        label = f"GPU {gpu.index} {gpu.name}{' (MIG on)' if gpu.mig else ''}"
        if gpu.free_mib is None or gpu.total_mib is None:
            parts.append(f"{label}: free memory not reported")
            continue
        text = f"{label}: {_gib(gpu.free_mib)} free of {_gib(gpu.total_mib)}"
        others = [p for p in gpu.processes or () if p.pid != own_pid and p.compute]
        if others:
            held = ", ".join(
                f"{p.name} (pid {p.pid}, {p.used_mib if p.used_mib is not None else '?'} MiB)"
                for p in others
            )
            text += f"; also used by {held}"
            statuses.append("warn")
            fixes.append(_OTHER_RUN_FIX)
        if gpu.processes is not None and gpu.used_mib is not None:
            mine = (own_mib or {}).get(gpu.index)
            allowance = 0 if mine is None else mine + CONTEXT_MIB
            if any(p.pid == own_pid for p in gpu.processes):
                allowance = 0  # listed: counted already
            hidden = gpu.used_mib - gpu.listed_mib - allowance
            if hidden > UNEXPLAINED_MIB:
                text += f"; {_gib(hidden)} held by processes nvidia-smi does not list"
                statuses.append("warn")
                fixes.append(_HIDDEN_FIX)
        parts.append(text)
    if not parts:
        return Verdict("ok", "no GPU reported")
    return Verdict(_worst(statuses), "; ".join(parts), " ".join(dict.fromkeys(fixes)))


def health_verdict(
    gpus: Sequence[GpuStatus], xids: Sequence[XidEvent] | None, xid_status: str
) -> Verdict:
    """Clocks, temperature, power, throttling, ECC errors and Xid errors, with what to do."""
    parts: list[str] = []
    statuses: list[Status] = []
    fixes: list[str] = []
    for gpu in gpus:
        facts = []
        problems = []
        if gpu.temperature_c is not None:
            facts.append(f"{gpu.temperature_c} °C")
        if gpu.sm_clock_mhz is not None:
            top = f" of {gpu.max_sm_clock_mhz}" if gpu.max_sm_clock_mhz else ""
            facts.append(f"SM clock {gpu.sm_clock_mhz}{top} MHz")
        if gpu.power_w is not None:
            limit = f" of {gpu.power_limit_w:g}" if gpu.power_limit_w else ""
            facts.append(f"{gpu.power_w:g}{limit} W")
        slow = [SLOWDOWN_REASONS[r] for r in gpu.throttle if r in SLOWDOWN_REASONS]
        if slow:
            problems.append("throttled: " + ", ".join(slow))
            statuses.append("warn")
            fixes.append(_SLOW_FIX)
        elif POWER_CAP_REASON in gpu.throttle:
            facts.append("at its power limit")
        slows_at = gpu.slowdown_temperature_c or 0
        hot_at = slows_at - HOT_MARGIN_C if slows_at > HOT_MARGIN_C else HOT_C
        if gpu.temperature_c is not None and gpu.temperature_c >= hot_at and not slow:
            where = f", it slows down at {slows_at} °C" if slows_at else ""
            problems.append(f"hot: {gpu.temperature_c} °C{where}")
            statuses.append("warn")
            fixes.append(_SLOW_FIX)
        if (
            gpu.power_limit_w is not None
            and gpu.default_power_limit_w is not None
            and gpu.power_limit_w < gpu.default_power_limit_w
        ):
            problems.append(
                f"power limit lowered to {gpu.power_limit_w:g} W "
                f"(default {gpu.default_power_limit_w:g} W)"
            )
            statuses.append("warn")
            fixes.append(_SLOW_FIX)
        if gpu.ecc_uncorrectable:
            problems.append(f"{gpu.ecc_uncorrectable} uncorrectable ECC error(s) since boot")
            statuses.append("fail")
            fixes.append(_DEAD_FIX)
        if gpu.remap_failed or gpu.retirement_pending:
            problems.append("damaged memory waits for a GPU reset to be taken out of use")
            statuses.append("warn")
            fixes.append(_DEAD_FIX)
        text = f"GPU {gpu.index} {gpu.name}: " + ", ".join(facts or ["no readings"])
        if problems:
            text += "; " + "; ".join(problems)
        parts.append(text)
    if xids:
        hardware = [x for x in xids if x.hardware]
        shown = hardware or list(xids)
        described = "; ".join(dict.fromkeys(x.describe() for x in shown[-3:]))
        parts.append(f"kernel log: {described}")
        if hardware:
            statuses.append("fail")
            fixes.append(_DEAD_FIX)
        else:
            statuses.append("warn")
            fixes.append(
                "a program's fault on the GPU (a bad memory access, often after running out "
                "of memory), not the card's: see the training's own error"
            )
    elif xids is not None:
        parts.append("no Xid errors in the kernel log")
    elif xid_status:
        parts.append(f"Xid errors not checked: {xid_status}")
    if not parts:
        return Verdict("ok", "no GPU reported")
    return Verdict(_worst(statuses), "; ".join(parts), " ".join(dict.fromkeys(fixes)))
