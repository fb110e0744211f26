"""The checks of the first cell: is this machine what the training expects?

:func:`preflight` returns a :class:`Report`: pure data, nothing printed. Each :class:`Check` has
a name, a status (``ok``, ``warn``, ``fail``), what was seen, and the fix in the user's words.
In a Kaggle batch run (or with ``strict=True``) a failed check raises
:class:`~nbresume.errors.PreflightError` at once, so a commit stops at its first cell instead
of hours later.

Slow probes start first and are read last: the internet probe (a name lookup and a TCP
connection in a daemon thread, so a hanging DNS cannot hold the report) and ``nvidia-smi``
(one second at most) run while the local checks are made. The whole report takes about as
long as the probe's timeout, one second by default, however the network behaves.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from nbresume import knobs
from nbresume.checkpoint.backends import open_store
from nbresume.checkpoint.state import describe_determinism
from nbresume.checkpoint.units import format_bytes, format_duration
from nbresume.errors import NbresumeError, PreflightError, UsageError
from nbresume.platforms import Platform, detect
from nbresume.platforms.base import DangerClock
from nbresume.platforms.cgroup import CpuFacts, MemoryFacts, read_cpu, read_memory
from nbresume.platforms.gpu import (
    Gpu,
    NvidiaSmi,
    TorchInfo,
    arch_supported,
    device_nodes,
    driver_cuda_major,
    gpu_verdicts,
    oldest_driver,
    torch_info,
    tpu_seen,
    visible,
)
from nbresume.platforms.network import InternetProbe, ProbeResult
from nbresume.platforms.nvidia_smi import GpuQueryRun

Status = Literal["ok", "warn", "fail"]

#: Seconds before a platform cap at which a Checkpointer with deadline="auto" saves and stops
#: (at least; more when saves or steps are slow).
STOP_MARGIN_S = 120.0
#: Inodes one checkpoint may need: its folder, a manifest, a few tensor and JSON files.
INODES_PER_CHECKPOINT = 16

_CUDA_BUILD_FIX = (
    "install a CUDA build of torch, e.g. `pip install torch --index-url "
    "https://download.pytorch.org/whl/cu126` (choose a CUDA version the driver supports)"
)


@dataclass(frozen=True)
class Check:
    """One preflight check: its name, status, what was seen, and the fix."""

    name: str
    #: ``"fail"`` stops a strict run (a Kaggle batch run by default); ``"warn"`` never does.
    status: Status
    #: What was found, in the words the report prints.
    seen: str
    #: What to do about a ``"warn"`` or ``"fail"``.
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "seen": self.seen, "fix": self.fix}


@dataclass(frozen=True)
class Report:
    """Every check of a preflight, with the platform and its danger clocks."""

    platform: str
    platform_title: str
    checks: tuple[Check, ...]
    danger_clocks: tuple[DangerClock, ...] = ()
    elapsed_s: float = 0.0
    strict: bool = False

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed)."""
        return not self.failures

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    def __getitem__(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def with_check(self, check: Check) -> Report:
        """This report with the check of the same name replaced (or added)."""
        names = [c.name for c in self.checks]
        if check.name in names:
            checks = tuple(check if c.name == check.name else c for c in self.checks)
        else:
            checks = (*self.checks, check)
        return replace(self, checks=checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "platform": {"name": self.platform, "title": self.platform_title},
            "checks": [c.to_dict() for c in self.checks],
            "danger_clocks": [d.to_dict() for d in self.danger_clocks],
            "elapsed_s": round(self.elapsed_s, 3),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def verdict(self) -> str:
        """``"2 checks failed, 1 warning"`` or ``"all checks passed"``."""
        fails, warns = len(self.failures), len(self.warnings)
        if not fails and not warns:
            return f"all {len(self.checks)} checks passed"
        parts = []
        if fails:
            parts.append(f"{fails} check{'s' if fails > 1 else ''} failed")
        if warns:
            parts.append(f"{warns} warning{'s' if warns > 1 else ''}")
        return ", ".join(parts)

    def format_table(self, *, color: bool = False, width: int = 100) -> str:
        """A readable table; ``color`` adds ANSI red and yellow (only for a terminal)."""
        name_width = max(len(c.name) for c in self.checks) if self.checks else 5
        indent = 2 + 6 + 2 + name_width + 2
        lines = [f"nbresume preflight: {self.platform_title}"]
        for check in self.checks:
            label = _paint(f"{_LABEL[check.status]:<6}", check.status, color)
            head = f"  {label}  {check.name:<{name_width}}  "
            lines += _wrap(check.seen, width, indent, first=head)
            if check.fix and check.status != "ok":
                lines += _wrap(f"fix: {check.fix}", width, indent)
        if self.danger_clocks:
            lines.append("danger clocks:")
            for clock in self.danger_clocks:
                when = f" ({format_duration(clock.seconds)})" if clock.seconds else ""
                lines += _wrap(f"- {clock.name}{when}: loses {clock.loses}", width, 4, first="  ")
                lines += _wrap(f"nbresume: {clock.protection}", width, 6)
        lines.append(f"{self.verdict()} ({self.elapsed_s:.2f} s)")
        return "\n".join(lines)

    def summary_lines(self) -> list[str]:
        """A few lines for the first cell: the verdict, and each check that is not ok."""
        lines = [f"nbresume preflight on {self.platform_title}: {self.verdict()}"]
        for check in self.checks:
            if check.status != "ok":
                lines.append(f"  {_LABEL[check.status]} {check.name}: {check.seen}")
                if check.fix:
                    lines.append(f"       fix: {check.fix}")
        return lines

    def __str__(self) -> str:
        return self.format_table()


_LABEL = {"ok": "ok", "warn": "warn", "fail": "FAIL"}
_COLOR = {"ok": "\033[32m", "warn": "\033[33m", "fail": "\033[1;31m"}


def _paint(text: str, status: Status, color: bool) -> str:
    return f"{_COLOR[status]}{text}\033[0m" if color else text


def _wrap(text: str, width: int, indent: int, *, first: str | None = None) -> list[str]:
    prefix = " " * indent
    return textwrap.wrap(
        text,
        width=max(width, indent + 20),
        initial_indent=prefix if first is None else first,
        subsequent_indent=prefix,
        break_on_hyphens=False,
    ) or [prefix if first is None else first]


# -- the accelerator -----------------------------------------------------------------------


@dataclass(frozen=True)
class Expectation:
    """What the training needs: ``kind`` is ``"gpu"``, ``"tpu"``, ``"cpu"`` or ``None``."""

    kind: str | None = None
    count: int = 1


def parse_accelerator(spec: str | None) -> Expectation:
    """``None``, ``"gpu"``, ``"gpu:2"``, ``"cuda"``, ``"cpu"`` or ``"tpu"``."""
    if spec is None:
        return Expectation()
    text = str(spec).strip().lower()
    kind, _, count_text = text.partition(":")
    if kind == "cuda":
        kind = "gpu"
    count = 1
    if count_text:
        count = int(count_text) if count_text.isdigit() else 0
    if kind not in ("gpu", "tpu", "cpu") or count < 1 or (count_text and kind != "gpu"):
        raise UsageError(
            f"accelerator={spec!r} is not understood",
            fix="use 'gpu', 'gpu:2' (at least two GPUs), 'tpu', 'cpu', or None",
        )
    return Expectation(kind, count)


def _describe_gpus(gpus: list[Gpu]) -> str:
    counts = Counter(f"{g.name} ({g.sm})" if g.capability else g.name for g in gpus)
    return ", ".join(f"{n} x {label}" for label, n in counts.items())


def check_accelerator(
    expect: Expectation,
    *,
    gpus: list[Gpu],
    smi_status: str,
    torch: TorchInfo,
    tpu: str,
    platform: Platform,
) -> Check:
    """Whether the accelerator the training expects is here and usable by this torch."""
    count = len(gpus) or (torch.device_count or 0)
    if gpus:
        seen = _describe_gpus(gpus)
    elif count:
        seen = f"{count} GPU(s) seen by torch"
    else:
        seen = tpu or "no GPU or TPU"
        if smi_status not in ("ok", "not found"):
            seen += f" ({smi_status})"

    problems: list[tuple[str, str]] = []
    if count and torch.installed and torch.cuda is None:
        problems.append((f"torch {torch.version} is a CPU-only build", _CUDA_BUILD_FIX))
    elif count and torch.cuda and torch.device_count == 0:
        problems.append(
            (
                f"torch {torch.version} (CUDA {torch.cuda}) sees no GPU",
                "check the driver (`nvidia-smi`) and CUDA_VISIBLE_DEVICES, then restart",
            )
        )
    for gpu in gpus:
        if (
            gpu.capability
            and torch.arch_list
            and not arch_supported(gpu.capability, torch.arch_list)
        ):
            problems.append(
                (
                    f"this torch build ({torch.version}) has no kernels for {gpu.name} "
                    f"({gpu.sm}); it has {' '.join(torch.arch_list)}",
                    f"install a torch build whose torch.cuda.get_arch_list() includes {gpu.sm}, "
                    f"or choose another GPU: {platform.accelerator_fix('gpu')}",
                )
            )
            break

    if expect.kind == "gpu":
        if count < expect.count:
            wanted = "a GPU" if expect.count == 1 else f"{expect.count} GPUs"
            return Check(
                "accelerator",
                "fail",
                f"{seen}; {wanted} expected",
                platform.accelerator_fix("gpu", expect.count),
            )
        if problems:
            return Check("accelerator", "fail", f"{seen}; {problems[0][0]}", problems[0][1])
        return Check("accelerator", "ok", seen)
    if expect.kind == "tpu":
        if not tpu:
            return Check(
                "accelerator", "fail", f"{seen}; a TPU expected", platform.accelerator_fix("tpu")
            )
        return Check("accelerator", "ok", tpu)
    if expect.kind == "cpu":
        if count and platform.name.startswith("kaggle"):
            return Check(
                "accelerator",
                "warn",
                f"{seen}; accelerator='cpu' was asked for",
                "Settings → Accelerator → None, so the session does not spend GPU quota",
            )
        return Check("accelerator", "ok", seen)
    if problems:
        return Check("accelerator", "warn", f"{seen}; {problems[0][0]}", problems[0][1])
    return Check("accelerator", "ok", seen)


def check_cuda_build(gpus: list[Gpu], torch: TorchInfo) -> Check:
    """Whether torch's CUDA version, the driver and the GPU agree."""
    if not torch.installed:
        return Check(
            "cuda build",
            "warn",
            "torch is not installed",
            "pip install torch (on Colab and Kaggle, use the torch they ship)",
        )
    build = f"torch {torch.version}" + (f" built for CUDA {torch.cuda}" if torch.cuda else "")
    if not gpus:
        return Check("cuda build", "ok", f"{build}; no GPU to match")
    if torch.cuda is None:
        return Check("cuda build", "warn", f"{build} (CPU only) on a GPU machine", _CUDA_BUILD_FIX)
    driver = gpus[0].driver
    runs = driver_cuda_major(driver)
    try:
        needed = int(torch.cuda.split(".")[0])
    except ValueError:
        return Check("cuda build", "ok", f"{build}; driver {driver}")
    if runs is None or runs < needed:
        oldest = oldest_driver(needed) or "a newer one"
        return Check(
            "cuda build",
            "warn",
            f"{build} needs driver {oldest} or newer; this driver is {driver}",
            "install a torch build for an older CUDA (e.g. --index-url "
            "https://download.pytorch.org/whl/cu118), or update the driver where you can",
        )
    return Check("cuda build", "ok", f"{build}; driver {driver} runs CUDA {runs}.x")


# -- internet ------------------------------------------------------------------------------


def check_gpu_state(query: GpuQueryRun | None, all_gpus: list[Gpu], gpus: list[Gpu]) -> list[Check]:
    """On a GPU machine: free memory and who holds it, the GPU's health, and whether a resume
    continues bit-exactly (see :mod:`nbresume.platforms.nvidia_smi`)."""
    if query is not None and not all_gpus:
        query.cancel()  # not read: its tools must not run on after the report
    if not all_gpus or query is None:
        return []
    checks = [
        Check(name, verdict.status, verdict.seen, verdict.fix)
        for name, verdict in gpu_verdicts(query.result(), gpus)
    ]
    status, seen, fix = describe_determinism(gpu=True)
    return [*checks, Check("determinism", status, seen, fix)]


def check_internet(expect: bool | None, result: ProbeResult, platform: Platform) -> Check:
    """Whether internet access is what the training expects."""
    online = bool(result.online)
    state = "on" if online else "off"
    seen = f"{state}: {result.seen}"
    if expect is True and not online:
        return Check("internet", "fail", f"{seen}; internet expected", platform.internet_fix())
    if expect is False and online:
        return Check(
            "internet",
            "warn",
            f"{seen}; internet=False expected",
            "turn internet off where the run requires it (Kaggle: Settings → Internet → off; "
            "competitions that require it reject notebooks with internet on)",
        )
    return Check("internet", "ok", seen)


# -- the durable folder --------------------------------------------------------------------


def _is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def _write_probe(folder: Path) -> str:
    """Write, fsync, read back and remove a small file in ``folder``; the problem, or ``""``."""
    path = folder / f".nbresume-preflight-{os.getpid()}-{secrets.token_hex(4)}"
    data = secrets.token_bytes(4096)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if path.read_bytes() != data:
            return "a test file read back differently than it was written"
        return ""
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def _check_bucket(location: str) -> Check:
    """A Hugging Face bucket: the token may write there (the Hub is asked; nothing written)."""
    try:
        open_store(location).check_writable()
    except NbresumeError as exc:
        return Check("durable folder", "fail", exc.message, exc.fix or "see docs/storage.md")
    return Check("durable folder", "ok", f"{location}: the token may write to this bucket")


def check_durable(
    location: str, platform: Platform, expected_bytes: int | None = None, keep: int | None = 3
) -> Check:
    """Whether ``location`` can hold the checkpoints: writable, enough bytes and inodes, and
    on storage that outlives the session."""
    if _is_url(location):
        if location.startswith("memory://"):
            return Check(
                "durable folder",
                "warn",
                f"{location} lives in this process's memory only",
                "use a folder or an object store URL (s3://, gs://, ...) for checkpoints",
            )
        if location.startswith("hf://buckets/"):
            return _check_bucket(location)
        return Check("durable folder", "ok", f"{location}: object store, checked at the first save")
    path = Path(location.removeprefix("file://")).expanduser()
    try:
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        is_dir = existing.is_dir()
    except OSError as exc:  # e.g. a FUSE mount whose daemon died: "Transport endpoint ..."
        return Check(
            "durable folder",
            "fail",
            f"{path}: cannot be examined: {exc.strerror or exc}",
            "remount the storage (on Colab: Runtime → Restart session, then mount Drive "
            "again) or choose another folder (dir=)",
        )
    if not is_dir:
        return Check(
            "durable folder",
            "fail",
            f"{existing} is a file, not a folder",
            "choose another folder for the checkpoints (dir=)",
        )
    problem = _write_probe(existing)
    if problem:
        return Check(
            "durable folder",
            "fail",
            f"{path}: cannot write in {existing}: {problem}",
            f"choose a writable folder (dir=, or {knobs.HOME.name}) or fix the permissions",
        )
    try:
        st = os.statvfs(existing)
        free: int | None = st.f_bavail * st.f_frsize
        inodes = st.f_favail if st.f_files else None
    except OSError:
        free, inodes = None, None
    seen = f"{path}: writable" + ("" if existing == path else " (will be created)")
    seen += f"; {format_bytes(free)} free"
    if inodes is not None:
        seen += f", {inodes:,} inodes free"
    copies = (keep or 1) + 1  # the kept ones, and the next one being written
    if expected_bytes and free is not None and free < expected_bytes * copies:
        return Check(
            "durable folder",
            "fail",
            f"{seen}; {copies} checkpoints of {format_bytes(expected_bytes)} need "
            f"{format_bytes(expected_bytes * copies)}",
            f"free space there, lower keep= (now {keep}), or choose a larger folder (dir=)",
        )
    if inodes is not None and inodes < INODES_PER_CHECKPOINT * copies:
        return Check(
            "durable folder",
            "fail",
            f"{seen}: out of inodes (a file system fills up on file count before bytes)",
            "delete many small files there (find what holds them with `df -i` and `du "
            "--inodes`), or choose another folder",
        )
    warning = platform.durable_warning(str(path))
    if warning is not None:
        return Check("durable folder", "warn", f"{seen}; {warning[0]}", warning[1])
    return Check("durable folder", "ok", seen)


# -- memory and CPU ------------------------------------------------------------------------


def check_memory(facts: MemoryFacts) -> Check:
    """The container's memory limit, and whether the kernel already killed for memory."""
    if facts.limit is not None:
        seen = f"limit {format_bytes(facts.limit)}"
        if facts.host_total:
            seen += f" (host {format_bytes(facts.host_total)})"
    else:
        seen = f"no container limit; host {format_bytes(facts.host_total)}"
    if facts.current is not None:
        seen += f", {format_bytes(facts.current)} in use"
    if facts.oom_kills:
        return Check(
            "memory",
            "warn",
            f"{seen}; the kernel killed {facts.oom_kills} process(es) here for memory (oom_kill)",
            "a bare 'Killed' or exit status 137 is this: lower the DataLoader's num_workers "
            "(each worker may copy in-memory data) or the batch size",
        )
    if facts.limit and facts.current and facts.current > 0.9 * facts.limit:
        return Check(
            "memory",
            "warn",
            f"{seen}: over 90% of the limit",
            "free memory (del large objects, restart the kernel) before training",
        )
    return Check("memory", "ok", seen + ("; no OOM kills" if facts.oom_kills == 0 else ""))


def check_cpu(facts: CpuFacts, torch_threads: int | None) -> Check:
    """Whether torch's thread pool fits the container's CPU quota."""
    usable = facts.usable
    quota = f"quota {facts.quota:g} CPUs" if facts.quota is not None else "no CPU quota"
    seen = f"{usable} usable CPU(s) ({quota}, {facts.host} host cores)"
    if torch_threads is not None:
        threads, how = torch_threads, "torch uses"
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads, how = int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS sets"
    else:
        threads, how = facts.affinity, "torch will start"
    if threads > usable:
        return Check(
            "cpu",
            "warn",
            f"{seen}; {how} {threads} threads, which fight over {usable} CPU(s)",
            f"call nbresume.cap_threads() before training: it sets torch and OpenMP/MKL to "
            f"{usable} thread(s)",
        )
    return Check("cpu", "ok", f"{seen}; {how} {threads} thread(s)")


# -- the session clock ---------------------------------------------------------------------


def check_session(platform: Platform, accelerated: bool, now: float | None = None) -> Check:
    """Time left before the platform ends the session, and when nbresume will stop."""
    now = time.time() if now is None else now
    deadline, label = platform.session_deadline(accelerated)
    if deadline is None:
        seen = f"no session cap on {platform.title}"
        if platform.name == "slurm":
            seen = "no job end time known (SLURM_JOB_END_TIME is not set)"
        return Check("session clock", "ok", seen)
    left = deadline - now
    seen = f"{label}: {format_duration(left)} left"
    if left <= STOP_MARGIN_S:
        return Check(
            "session clock",
            "fail",
            f"{seen}; too little to train and save",
            "start a new session; the run resumes from its newest verified checkpoint",
        )
    seen += (
        f"; a Checkpointer with deadline='auto' saves and stops in about "
        f"{format_duration(left - STOP_MARGIN_S)} (earlier when saves are slow)"
    )
    if left < 3600:
        return Check(
            "session clock",
            "warn",
            seen,
            "for a long run, start a fresh session; the run resumes where it stopped",
        )
    return Check("session clock", "ok", seen)


# -- the whole preflight -------------------------------------------------------------------


@dataclass
class _Timer:
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def resolve_strict(strict: bool | None, platform: Platform) -> bool:
    """The argument, else NBRESUME_STRICT, else the platform's default (a Kaggle batch run)."""
    if strict is not None:
        return strict
    from_env = knobs.strict()
    return platform.strict_default if from_env is None else from_env


def preflight(
    accelerator: str | None = None,
    internet: bool | None = None,
    dir: str | os.PathLike[str] | None = None,
    expected_bytes: int | None = None,
    keep: int | None = 3,
    *,
    strict: bool | None = None,
    platform: Platform | None = None,
) -> Report:
    """Check this machine against what the training expects; return the report.

    Args:
        accelerator: ``"gpu"``, ``"gpu:N"``, ``"tpu"``, ``"cpu"`` or ``None`` (no expectation).
        internet: ``True`` or ``False`` when the run needs it on or off; ``None``: report only.
        dir: the durable folder (path or URL); default: the platform's durable base folder.
        expected_bytes: the size of one checkpoint, when known: space for ``keep + 1`` of them
            is checked.
        keep: how many checkpoints will be kept.
        strict: raise :class:`~nbresume.errors.PreflightError` when a check fails. ``None``:
            NBRESUME_STRICT, else only in a Kaggle batch run, where no one is watching.
        platform: the platform (default: detected).
    """
    timer = _Timer()
    expect = parse_accelerator(accelerator)
    here = platform if platform is not None else detect()
    host, port = knobs.probe_target()
    probe = InternetProbe(host, port, knobs.probe_timeout())
    smi = NvidiaSmi()
    # Memory, clocks, throttling and errors: a longer query, started now, read only on a GPU.
    gpu_query = GpuQueryRun() if smi.binary is not None else None

    location = str(dir) if dir is not None else str(here.durable_base())
    durable = check_durable(location, here, expected_bytes, keep)
    memory = check_memory(read_memory())
    all_gpus, smi_status = smi.result()
    gpus = visible(all_gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    torch = torch_info(import_for_gpu=bool(gpus))
    tpu = tpu_seen()
    accelerated = bool(all_gpus) or device_nodes() or bool(tpu)
    torch_module = sys.modules.get("torch")
    threads = torch_module.get_num_threads() if torch_module is not None else None

    checks = (
        Check("platform", "ok", f"{here.title}: {here.why()}" if here.why() else here.title),
        check_accelerator(
            expect, gpus=gpus, smi_status=smi_status, torch=torch, tpu=tpu, platform=here
        ),
        check_cuda_build(gpus, torch),
        *check_gpu_state(gpu_query, all_gpus, gpus),
        check_internet(internet, probe.result(), here),
        durable,
        memory,
        check_cpu(read_cpu(), threads),
        check_session(here, accelerated),
    )
    strict_now = resolve_strict(strict, here)
    report = Report(
        platform=here.name,
        platform_title=here.title,
        checks=checks,
        danger_clocks=tuple(here.danger_clocks(accelerated)),
        elapsed_s=timer.elapsed(),
        strict=strict_now,
    )
    if strict_now:
        raise_if_failed(report)
    return report


def raise_if_failed(report: Report) -> None:
    """Raise :class:`~nbresume.errors.PreflightError` naming every failed check and its fix."""
    failures = report.failures
    if not failures:
        return
    message = "preflight failed: " + "; ".join(f"{c.name}: {c.seen}" for c in failures)
    if len(failures) == 1:
        fix = failures[0].fix
    else:
        fix = " ".join(f"({c.name}) {c.fix}" for c in failures if c.fix)
    raise PreflightError(message, where=report.platform_title, fix=fix, report=report)


def terminal_width() -> int:
    return min(120, shutil.get_terminal_size((100, 24)).columns)
