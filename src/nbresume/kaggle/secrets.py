"""Credentials in a notebook, found before it is published.

Every cell's source and every saved output (stream text, results, errors, HTML) is scanned for
the shapes of well-known credentials. A finding names the cell, whether the secret is in the
source or an output, and the kind of secret; it never holds or prints the secret itself, nor a
part of it, so that the report can be shown, logged and pasted anywhere.

Binary outputs (images, PDFs) are skipped: base64 data matches short patterns by chance.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nbresume.kaggle.notebook import Cell, Notebook


@dataclass(frozen=True)
class Kind:
    """A kind of credential: its id, how a message names it, and where to revoke it."""

    id: str
    label: str
    revoke: str
    patterns: tuple[re.Pattern[str], ...]
    accept: Callable[[str], bool] = lambda value: True


def _has_digit_and_letter(value: str) -> bool:
    return any(c.isdigit() for c in value) and any(c.isalpha() for c in value)


KINDS: tuple[Kind, ...] = (
    Kind(
        "kaggle",
        "a Kaggle API key or token",
        "kaggle.com → Settings → API → Expire Token",
        (
            re.compile(r"\bKGAT_[0-9A-Za-z]{24,}"),
            # kaggle.json: {"username": "...", "key": "<32 hex>"}
            re.compile(
                r"(?s)username[\"']?\s*:.{0,100}?[\"']key[\"']\s*:\s*[\"'][0-9a-f]{32}[\"']"
            ),
            re.compile(r"KAGGLE_KEY[\"']?\s*\]?\s*[:=]\s*[\"']?[0-9a-f]{32}\b"),
        ),
    ),
    Kind(
        "huggingface",
        "a Hugging Face token (hf_...)",
        "huggingface.co → Settings → Access Tokens",
        (re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"),),
    ),
    Kind(
        "wandb",
        "a Weights & Biases API key",
        "wandb.ai → User settings → API keys",
        (
            re.compile(r"(?i)wandb[^\n]{0,80}?(?<![0-9a-f])[0-9a-f]{40}(?![0-9a-f])"),
            re.compile(r"\bwandb_v1_[A-Za-z0-9_]{20,}"),
        ),
    ),
    Kind(
        "openai",
        "an OpenAI API key (sk-...)",
        "platform.openai.com → API keys",
        (re.compile(r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}"),),
        _has_digit_and_letter,
    ),
    Kind(
        "aws-access-key",
        "an AWS access key id (AKIA...)",
        "the AWS console → IAM → Security credentials",
        (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),),
    ),
    Kind(
        "aws-secret-key",
        "an AWS secret access key",
        "the AWS console → IAM → Security credentials",
        (
            re.compile(
                r"(?i)aws\w*secret\w*[\"']?\s*\]?\s*[:=]\s*[\"']?[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])"
            ),
        ),
    ),
    Kind(
        "github",
        "a GitHub token",
        "github.com → Settings → Developer settings → Personal access tokens",
        (
            re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36,}\b"),
            re.compile(r"\bgithub_pat_[A-Za-z0-9_]{22,}"),
        ),
    ),
    Kind(
        "google-api-key",
        "a Google API key (AIza...)",
        "console.cloud.google.com → APIs & Services → Credentials",
        (re.compile(r"\bAIza[0-9A-Za-z_-]{35}"),),
    ),
    Kind(
        "private-key",
        "a private key block",
        "wherever the key pair was issued; make a new pair",
        (re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"),),
    ),
)

#: Output data that is binary (base64) and not scanned.
_BINARY_PREFIXES = ("image/", "audio/", "video/", "application/pdf", "application/octet-stream")


@dataclass(frozen=True)
class SecretFinding:
    """A credential found: the cell (``None``: the notebook's metadata), source or output, and
    its kind. Holds no part of the secret."""

    kind: Kind
    where: str  # "source", "output" or "metadata"
    cell: Cell | None = None

    def __str__(self) -> str:
        # The cell by number only: its first line may be the secret itself.
        place = f"cell {self.cell.number} {self.where}" if self.cell else "notebook metadata"
        return f"{place}: {self.kind.label}"


def kinds_in(text: str) -> list[Kind]:
    """The kinds of credential that ``text`` contains."""
    found = []
    for kind in KINDS:
        for pattern in kind.patterns:
            if any(kind.accept(m.group(0)) for m in pattern.finditer(text)):
                found.append(kind)
                break
    return found


def _output_texts(output: Any) -> Iterator[str]:
    """Every piece of text in one saved output, binary payloads left out."""
    if isinstance(output, str):
        yield output
    elif isinstance(output, list):
        for item in output:
            yield from _output_texts(item)
    elif isinstance(output, dict):
        for key, value in output.items():
            if isinstance(key, str) and key.startswith(_BINARY_PREFIXES):
                continue
            yield from _output_texts(value)


def scan(notebook: Notebook) -> list[SecretFinding]:
    """Every (cell, source or output, kind) that holds a credential, in notebook order."""
    found: list[SecretFinding] = []
    for cell in notebook.cells:
        for kind in kinds_in(cell.source):
            found.append(SecretFinding(kind, "source", cell))
        output_text = "\n".join(t for o in cell.outputs for t in _output_texts(o))
        for kind in kinds_in(output_text):
            found.append(SecretFinding(kind, "output", cell))
    metadata_text = "\n".join(_output_texts(notebook.metadata))
    for kind in kinds_in(metadata_text):
        found.append(SecretFinding(kind, "metadata"))
    return found


def report(findings: list[SecretFinding]) -> str:
    """The refusal message: each finding, and what to do. Never contains a secret."""
    lines = [f"found {len(findings)} credential(s) in the notebook; it was not pushed:"]
    lines += [f"  {f}" for f in findings]
    revoke = sorted({f"{f.kind.label}: {f.kind.revoke}" for f in findings})
    lines.append(
        "Fix: delete them from the cells and clear the outputs (Edit → Clear All Outputs); "
        "treat them as leaked and revoke them; on Kaggle read secrets with "
        "kaggle_secrets.UserSecretsClient().get_secret(NAME) (Add-ons → Secrets)."
    )
    lines += [f"  revoke {r}" for r in revoke]
    return "\n".join(lines)
