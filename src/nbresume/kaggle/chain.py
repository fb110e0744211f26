"""``nbresume chain owner/slug``: leg after leg of Kaggle batch runs until the training is done.

A leg is one version of a notebook, cut short by Kaggle's session cap: its Checkpointer
(``deadline="auto"``) saves and stops before the cap, so the version ends COMPLETE with its
checkpoint in its output. When a leg has finished, its output is downloaded and every
checkpoint verified; the newest checkpoint's ``state.json`` says whether the training is
done. If it is not, the next leg is pushed with this leg's output attached as an input
(``kernel_sources``); ``nbresume.init`` in the next leg finds the checkpoint under
``/kaggle/input`` and continues from it.

Legs alternate between two notebooks, ``owner/slug`` and ``owner/slug-b`` (the partner is
made by the first push to it). Attaching notebook A's output to notebook B is the documented
way to hand files from one notebook to another; attaching a notebook's output to a new version
of itself is not, so nbresume does not rely on it.

The chain stops at the first leg that does not end COMPLETE, at an output that does not
verify, when the training is done, or after ``legs`` legs.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nbresume.errors import ChainError, KaggleError
from nbresume.kaggle import metadata as meta
from nbresume.kaggle.client import Kaggle, SessionStatus
from nbresume.kaggle.output import Pulled, pull

PARTNER_SUFFIX = "-b"
DEFAULT_LEGS = 3
DEFAULT_POLL_S = 60.0
#: A leg waits at most this long for Kaggle to finish a version (queue time included).
DEFAULT_LEG_TIMEOUT_S = 14 * 3600.0


@dataclass
class Leg:
    """One leg: the notebook it ran in, how it ended, and what its output held."""

    number: int
    ref: str
    status: SessionStatus
    pulled: Pulled | None = None


def partner(ref: str) -> str:
    """The notebook the next leg runs in: ``owner/slug`` <-> ``owner/slug-b``."""
    owner, slug = meta.parse_ref(ref)
    if slug.endswith(PARTNER_SUFFIX) and len(slug) > len(PARTNER_SUFFIX):
        return f"{owner}/{slug[: -len(PARTNER_SUFFIX)]}"
    return f"{owner}/{slug}{PARTNER_SUFFIX}"


def wait_finished(
    kaggle: Kaggle,
    ref: str,
    *,
    poll_s: float,
    timeout_s: float,
    say: Callable[[str], None],
) -> SessionStatus:
    """Poll until the latest version of ``ref`` runs no more; say each new status."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        status = kaggle.status(ref)
        if status.status != last:
            say(f"  {ref}: {status.status}")
            last = status.status
        if status.finished:
            return status
        if time.monotonic() >= deadline:
            raise ChainError(
                f"{ref} is still {status.status} after {timeout_s / 3600:.1f} h",
                fix=f"check it on kaggle.com, then run `nbresume chain {ref}` again",
            )
        time.sleep(poll_s)


def push_next(kaggle: Kaggle, previous: str, target: str, timeout_s: int | None) -> int | None:
    """Push ``previous``'s notebook, with its settings, as a new version of ``target`` with
    ``previous``'s output attached. Returns the version number."""
    info = kaggle.kernel(previous)
    settings = dict(info.settings)
    sources = {key: list(settings.pop(key, [])) for key in meta.SOURCE_KEYS}
    sources["kernel_sources"] = [
        s for s in sources["kernel_sources"] if s not in (previous, target)
    ] + [previous]
    shape = settings.pop("machine_shape", None)
    kind = "tpu" if settings.get("enable_tpu") else "gpu" if settings.get("enable_gpu") else "cpu"
    accelerator = meta.Accelerator(shape or kind, kind, shape if kind != "cpu" else None)
    slug = meta.parse_ref(target)[1]
    with tempfile.TemporaryDirectory(prefix="nbresume-leg-") as folder:
        code_file = f"{slug}.py" if info.kernel_type == "script" else f"{slug}.ipynb"
        (Path(folder) / code_file).write_text(info.source, encoding="utf-8")
        document = meta.build(
            target,
            code_file,
            title=meta.default_title(slug),
            accelerator=accelerator,
            internet=bool(settings.get("enable_internet", True)),
            private=bool(settings.get("is_private", True)),
            sources=sources,
        )
        meta.write(Path(folder), document)
        result = kaggle.push(Path(folder), timeout_s)
    if previous in result.invalid_sources.get("kernel_sources", []):
        raise ChainError(
            f"Kaggle did not attach {previous}'s output to {target}: the leg would start over",
            fix=f"check that {previous} is yours and its last version is COMPLETE; then run "
            f"`nbresume chain {previous}` again",
        )
    return result.version


def run_chain(
    kaggle: Kaggle,
    ref: str,
    *,
    legs: int = DEFAULT_LEGS,
    output: Path,
    poll_s: float = DEFAULT_POLL_S,
    leg_timeout_s: float = DEFAULT_LEG_TIMEOUT_S,
    session_timeout_s: int | None = None,
    say: Callable[[str], None] = print,
) -> list[Leg]:
    """Follow the chain from ``ref``'s latest version (leg 1) for at most ``legs`` legs.
    Returns the legs; raises :class:`ChainError` (or :class:`KaggleError`) on a failure."""
    done: list[Leg] = []
    current = ref
    for number in range(1, legs + 1):
        say(f"leg {number}/{legs}: {current}")
        status = wait_finished(kaggle, current, poll_s=poll_s, timeout_s=leg_timeout_s, say=say)
        leg = Leg(number, current, status)
        done.append(leg)
        if status.status != "COMPLETE":
            raise ChainError(
                f"leg {number} ({current}) ended {status.status}"
                + (f": {status.failure}" if status.failure else ""),
                fix=f"read its log (`nbresume pull {current}` downloads it); its output keeps "
                "the checkpoints saved before the failure; fix the notebook, then "
                f"`nbresume commit` it to {current} and chain again",
            )
        slug = meta.parse_ref(current)[1]
        leg.pulled = pull(kaggle, current, output / f"leg-{number:02d}-{slug}")
        pulled = leg.pulled
        say(
            f"  pulled {pulled.files} file(s) into {pulled.dest}; checkpoints OK "
            f"{pulled.good}/{pulled.checked}"
        )
        if not pulled.ok:
            raise ChainError(
                f"leg {number} ({current}): {pulled.checked - pulled.good} checkpoint(s) in "
                "its output do not match their manifest",
                where=str(pulled.dest),
                fix="pull it again (`nbresume pull`); if it still fails the output is damaged",
            )
        if not pulled.runs:
            raise ChainError(
                f"leg {number} ({current}) saved no nbresume checkpoint in its output",
                fix="checkpoint with run = nbresume.init(...) and run.checkpointer(...), so "
                "that the next leg can continue",
            )
        steps = ", ".join(f"{r.name} at step {r.step}" for r in pulled.runs)
        if pulled.done:
            say(f"done: the training finished in leg {number} ({steps})")
            return done
        if number == legs:
            say(
                f"stopped after {legs} leg(s), not done yet ({steps}); continue with "
                f"`nbresume chain {current}`"
            )
            return done
        target = partner(current)
        try:
            version = push_next(kaggle, current, target, session_timeout_s)
        except KaggleError as exc:
            raise ChainError(
                f"pushing leg {number + 1} to {target} failed: {exc.message}", fix=exc.fix
            ) from None
        say(f"  {steps}: not done; pushed leg {number + 1} to {target} (version {version})")
        current = target
    return done
