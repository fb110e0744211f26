"""The Kaggle commands of the command line: ``smoke``, ``commit``, ``chain``, and the Kaggle
side of ``status`` and ``pull`` (an ``owner/slug`` argument). Each returns an exit status and
raises :class:`~nbresume.errors.NbresumeError` for a failure the command line reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from nbresume.checkpoint.units import format_bytes
from nbresume.errors import UsageError
from nbresume.kaggle import metadata as meta
from nbresume.kaggle import notebook as nbfile
from nbresume.kaggle import secrets
from nbresume.kaggle.lint import Target, expectations, lint
from nbresume.kaggle.wheel import DATASET_SLUG as WHEEL_DATASET

if TYPE_CHECKING:
    from nbresume.kaggle.client import Kaggle


def _say(line: str) -> None:
    # Whatever a line holds (a smoke run's output, a file's content), no credential is shown.
    print(secrets.redact(line), flush=True)


def _warn(line: str) -> None:
    print(secrets.redact(line), file=sys.stderr, flush=True)


def smoke(
    notebook: str,
    *,
    target: str = "auto",
    steps: int = 3,
    cell_timeout_s: int = 600,
    keep: bool = False,
) -> int:
    """``nbresume smoke NOTEBOOK``."""
    from nbresume.kaggle.smoke import smoke as run_smoke

    report = run_smoke(
        notebook, target=target, steps=steps, cell_timeout_s=cell_timeout_s, keep=keep
    )
    for line in report.lines():
        _say(line)
    return 0 if report.ok else 1


def commit(
    notebook: str,
    *,
    kernel: str | None = None,
    accelerator: str | None = None,
    internet: bool | None = None,
    private: bool = True,
    title: str | None = None,
    smoke_first: bool = True,
    allow: frozenset[str] = frozenset(),
    chain: bool = False,
    legs: int = 3,
    poll_s: float = 60.0,
    timeout_s: int | None = None,
    output: str | None = None,
    dry_run: bool = False,
    wheel: bool | None = None,
    datasets: tuple[str, ...] = (),
) -> int:
    """``nbresume commit NOTEBOOK --kernel owner/slug``: scan, lint, smoke, write
    kernel-metadata.json, push, and with ``chain`` follow the legs. With ``dry_run`` print the
    kernel-metadata.json instead of writing and pushing it (no credentials needed). With
    internet off (or ``wheel``), nbresume's wheel is uploaded as a dataset and attached;
    ``datasets`` are attached too."""
    path = Path(notebook)
    nb = nbfile.load(path)
    kernel = kernel or _default_kernel(path, dry_run)
    owner, slug = meta.parse_ref(kernel)
    # Unset on the command line: what nbresume.init asks for (followed through the
    # notebook's variables; a GPU is T4 x2, Kaggle's default), else CPU; internet on, as the
    # kaggle client's default.
    wanted, wanted_internet = expectations(nb)
    accel = meta.parse_accelerator(accelerator or wanted or "cpu")
    if internet is None:
        internet = True if wanted_internet is None else wanted_internet
    bundle = (not internet) if wheel is None else wheel
    title = title or meta.default_title(slug)
    caution = meta.check_title(title, slug)
    kinds = secrets.kinds_in(f"{kernel}\n{title}")
    if kinds:
        return _refuse_given(kinds)
    found = secrets.scan(nb, path.parent)
    if found:
        _warn(secrets.report(found))
        return 1
    findings = lint(nb, Target(accel.kind, internet), allow)
    for finding in findings:
        _warn(str(finding))
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        _warn(
            f"{len(errors)} problem(s) would break the batch run; nothing was pushed "
            "(fix them, or pass --allow RULE for a rule that does not apply)"
        )
        return 1
    if smoke_first:
        from nbresume.kaggle.smoke import smoke as run_smoke

        report = run_smoke(path, target="kaggle", slug=slug)
        for line in report.lines():
            _say(line)
        if not report.ok:
            _warn("the smoke run failed; nothing was pushed (or pass --no-smoke)")
            return 1
    existing = meta.read_existing(path.parent, path.name)
    dataset = f"{owner}/{WHEEL_DATASET}"
    sources = {key: list(existing.get(key) or []) for key in meta.SOURCE_KEYS}
    for wanted_set in (*datasets, *([dataset] if bundle else [])):
        if wanted_set not in sources["dataset_sources"]:
            sources["dataset_sources"].append(wanted_set)
    document = meta.build(
        kernel,
        path.name,
        title=title,
        accelerator=accel,
        internet=internet,
        private=private,
        sources=sources,
        extra=existing,
    )
    # The file as it is pushed (the existing one and the command line were scanned above).
    kinds = secrets.kinds_in(json.dumps(document, ensure_ascii=False))
    if kinds:
        return _refuse_given(kinds)
    for note in (caution, accel.note):
        if note:
            _warn(f"caution: {note}")
    if dry_run:
        _say(f"the {meta.METADATA_FILE} that would be pushed:")
        _say(json.dumps(document, indent=2))
        if bundle:
            _say(f"nbresume's wheel would be uploaded as the private dataset {dataset}")
        _say("dry run: nothing was written or pushed")
        return 0
    from nbresume.kaggle.client import Kaggle

    kaggle = Kaggle()  # credentials are needed from here on, and checked here
    if bundle:
        _publish_wheel(kaggle, dataset)
    written = meta.write(path.parent, document)
    _say(f"wrote {written}")
    result = kaggle.push(path.parent, timeout_s)
    for key, refs in result.invalid_sources.items():
        _warn(f"caution: Kaggle did not attach these {key}: {', '.join(refs)}")
    version = f"version {result.version}" if result.version else "a new version"
    _say(f"pushed {owner}/{slug} {version}: {result.url}")
    if not chain:
        _say(f"follow it with `nbresume status {kernel}`; fetch it with `nbresume pull {kernel}`")
        return 0
    return _follow(kaggle, kernel, legs=legs, poll_s=poll_s, timeout_s=timeout_s, output=output)


def _refuse_given(kinds: list[secrets.Kind]) -> int:
    _warn(
        f"the {meta.METADATA_FILE} to be pushed would hold "
        f"{', '.join(k.label for k in kinds)}, from a value given on the command line "
        "(--kernel, --title); it was not pushed. Fix: give that value without the credential, "
        "and treat the credential as leaked: revoke it"
    )
    return 1


#: The owner a dry run shows when no Kaggle user name is configured.
PLACEHOLDER_OWNER = "YOUR-KAGGLE-USERNAME"


def _default_kernel(path: Path, dry_run: bool) -> str:
    """``owner/slug`` when ``--kernel`` is not given: the configured Kaggle user name (read
    locally, no credentials checked) and a slug made from the file name."""
    owner = meta.configured_username()
    if not owner:
        if not dry_run:
            raise UsageError(
                "no Kaggle user name is configured, so the notebook has no owner",
                fix="pass --kernel OWNER/SLUG, or set KAGGLE_USERNAME (or save kaggle.json)",
            )
        owner = PLACEHOLDER_OWNER
    slug = meta.slugify(path.stem)
    if len(slug) < meta.MIN_TITLE:
        slug = f"{slug}-notebook".lstrip("-")
    return f"{owner}/{slug}"


def _publish_wheel(kaggle: Kaggle, dataset: str) -> None:
    """Upload the running nbresume's wheel as a new version of the private ``dataset``, unless
    the dataset already holds this very wheel (its hash is in the dataset's description)."""
    import tempfile

    from nbresume.kaggle import wheel

    with tempfile.TemporaryDirectory(prefix="nbresume-wheel-") as folder:
        built = wheel.build_wheel(Path(folder))
        digest = wheel.wheel_digest(built)
        if wheel.described_digest(kaggle.dataset_description(dataset)) == digest:
            _say(f"the private dataset {dataset} already holds {built.name}: not uploaded again")
            return
        description = wheel.describe(built.name, digest)
        url = kaggle.publish_dataset(Path(folder), dataset, wheel.DATASET_TITLE, description)
    _say(f"uploaded {built.name} as the private dataset {dataset}: {url}")


def chain(
    ref: str,
    *,
    legs: int = 3,
    poll_s: float = 60.0,
    timeout_s: int | None = None,
    output: str | None = None,
) -> int:
    """``nbresume chain owner/slug --legs N``."""
    from nbresume.kaggle.client import Kaggle

    meta.parse_ref(ref)
    return _follow(Kaggle(), ref, legs=legs, poll_s=poll_s, timeout_s=timeout_s, output=output)


def _follow(
    kaggle: Kaggle,
    ref: str,
    *,
    legs: int,
    poll_s: float,
    timeout_s: int | None,
    output: str | None,
) -> int:
    from nbresume.kaggle.chain import run_chain

    slug = meta.parse_ref(ref)[1]
    folder = Path(output) if output else Path(f"{slug}-chain")
    run_chain(
        kaggle,
        ref,
        legs=legs,
        output=folder,
        poll_s=poll_s,
        session_timeout_s=timeout_s,
        say=_say,
    )
    return 0


def status(ref: str) -> int:
    """``nbresume status owner/slug``: the latest version's state. Exit 1 when it failed."""
    from nbresume.kaggle.client import Kaggle

    meta.parse_ref(ref)
    answer = Kaggle().status(ref)
    _say(f"{ref}: {answer.status}")
    if answer.failure:
        _say(f"  failure: {answer.failure}")
    return 1 if answer.status in ("ERROR", "CANCEL_REQUESTED", "CANCEL_ACKNOWLEDGED") else 0


def pull(ref: str, dst: str | None = None) -> int:
    """``nbresume pull owner/slug [DIR]``: download the latest version's output and verify
    every checkpoint in it. Exit 1 when any does not match its manifest."""
    from nbresume.kaggle.client import Kaggle
    from nbresume.kaggle.output import pull as pull_output

    slug = meta.parse_ref(ref)[1]
    dest = Path(dst) if dst else Path(f"{slug}-output")
    if dest.exists() and not dest.is_dir():
        raise UsageError(
            f"{dest} exists and is not a folder", where=str(dest), fix="choose another -o DIR"
        )
    pulled = pull_output(Kaggle(), ref, dest)
    _say(f"pulled {pulled.files} file(s), {format_bytes(pulled.size)}, into {dest}")
    for run in pulled.runs:
        for result in run.report.results:
            _say(f"{run.folder.relative_to(dest)}: {result}")
        state = "done" if run.done else "not done"
        _say(f"{run.folder.relative_to(dest)}: newest good step {run.step} ({state})")
    if not pulled.runs:
        _say("no nbresume checkpoints in the output; nothing to verify")
        return 0
    _say(f"OK {pulled.good}/{pulled.checked}")
    return 0 if pulled.ok else 1
