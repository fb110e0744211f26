"""Credentials in a notebook, found before it is published.

What is scanned, for the shapes of well-known credentials:

- every cell's source, and what its Python builds from string literals: a token split into
  two literals, joined with ``+``, ``"".join`` or an f-string, or assigned piece by piece to
  names and joined later;
- every saved output (stream text, results, errors, HTML, SVG), each cell's ``metadata``,
  the attachments of markdown cells, and the notebook's metadata;
- what a line of Python undoes, in all of those: base64 (compressed with gzip, zlib, bz2 or xz
  or not), hex, percent-encoding (a token in a URL), rot13 and reversed text, decoded; and in
  a cell's Python, lists of character codes (``"".join(map(chr, [...]))``, ``bytes([...])``)
  and ``chr(...)`` joined;
- the ``kernel-metadata.json`` that is pushed with the notebook, and credential files next to
  the notebook (``kaggle.json``, ``.env``, ...).

A finding names the cell (or the file), where in it, and the kind of secret; it never holds or
prints the secret itself, nor a part of it, so that the report can be shown, logged and pasted
anywhere. :func:`redact` takes out of any other text what the scan would find there.

Binary outputs (PNG, JPEG, PDF, ...) are not scanned as text: base64 image data matches short
patterns by chance. SVG is text and is scanned.
"""

from __future__ import annotations

import ast
import base64
import binascii
import bz2
import codecs
import contextlib
import json
import lzma
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from nbresume.kaggle.metadata import METADATA_FILE
from nbresume.kaggle.notebook import Cell, Notebook


@dataclass(frozen=True)
class Shape:
    """One way a credential is written: its pattern, the words (case-folded) of which every
    match of the pattern holds one, and a simpler pattern that every match holds (the value's
    own shape), if any. Text without one of the words, or without a match of the simpler
    pattern, is not searched with the pattern: a substring test, and a scan for a run of one
    set of characters, cost a fraction of the pattern's scan."""

    pattern: re.Pattern[str]
    needles: tuple[str, ...]
    value: re.Pattern[str] | None = None

    def may_match(self, text: str, folded: str) -> bool:
        """False when :attr:`pattern` cannot match ``text`` (``folded``: it case-folded)."""
        if not any(needle in folded for needle in self.needles):
            return False
        return self.value is None or self.value.search(text) is not None


def _shape(pattern: str, *needles: str, value: str | None = None) -> Shape:
    return Shape(re.compile(pattern), needles, None if value is None else re.compile(value))


@dataclass(frozen=True)
class Kind:
    """A kind of credential: its id, how a message names it, and where to revoke it."""

    #: A short name that tells the kinds apart (``"huggingface"``).
    id: str
    label: str
    #: Where the owner revokes a leaked one.
    revoke: str
    shapes: tuple[Shape, ...]
    #: A last test of a match's value: False for what only looks like a credential.
    accept: Callable[[str], bool] = lambda value: True


def _mixed_case(value: str) -> bool:
    """Random tokens of 30 characters and more mix upper and lower case (one without either
    is about one in a hundred million); words joined by hyphens or underscores
    (``sk-learn-baseline-rf-500-trees``) do not."""
    body = value.rsplit("-", maxsplit=1)[-1] if value.count("-") <= 2 else value
    return any(c.islower() for c in body) and any(c.isupper() for c in body)


#: The words that make a name key-like.
_KEYWORD = r"(?:key|token|secret|passw(?:or)?d|credential|auth)"
_KEYWORDS = ("key", "token", "secret", "passw", "credential", "auth")
#: A name that holds a credential: ``api_key``, ``KAGGLE_KEY``, ``token``, ``"key"``. A name
#: is a run of ``[\w.-]``, matched from its start only, up to its first key-like word and on
#: to its end: each character is looked at a bounded number of times (a pattern that may start
#: anywhere in a name tries every start, and rescans the name from each).
_KEYLIKE = r"[\"']?(?<![\w.-])(?:(?!" + _KEYWORD + r")[\w.-])*" + _KEYWORD + r"[\w.-]*[\"']?"
#: ``= "value"``, ``: "value"``, ``"] = value``, ``=value`` (a .env line).
_ASSIGNED = r"\s*\]?\s*[:=]\s*[\"']?"

KINDS: tuple[Kind, ...] = (
    Kind(
        "kaggle",
        "a Kaggle API key or token",
        "kaggle.com → Settings → API → Expire Token",
        (
            _shape(r"\bKGAT_[0-9A-Za-z]{24,}", "kgat_"),
            # kaggle.json: {"username": "...", "key": "<32 hex>"}
            _shape(
                r"(?s)username[\"']?\s*:.{0,100}?[\"']key[\"']\s*:\s*[\"'][0-9a-f]{32}[\"']",
                "username",
            ),
            _shape(r"KAGGLE_KEY[\"']?" + _ASSIGNED + r"[0-9a-f]{32}\b", "kaggle_key"),
            # A Kaggle key's shape (32 hex) under a key-like name; a checksum under another
            # name (md5 = "...") is not a secret.
            _shape(
                r"(?i)" + _KEYLIKE + _ASSIGNED + r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-z])",
                *_KEYWORDS,
                value=r"(?i)(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-z])",
            ),
        ),
    ),
    Kind(
        "huggingface",
        "a Hugging Face token (hf_...)",
        "huggingface.co → Settings → Access Tokens",
        (_shape(r"\bhf_[A-Za-z0-9]{30,}\b", "hf_"),),
        _mixed_case,
    ),
    Kind(
        "wandb",
        "a Weights & Biases API key",
        "wandb.ai → User settings → API keys",
        (
            # 40 hex is also a git commit id: only with a W&B key's context.
            _shape(r"(?i)wandb\.login\s*\(\s*(?:key\s*=\s*)?[\"'][0-9a-f]{40}[\"']", "wandb"),
            _shape(r"(?i)wandb\w*key\w*[\"']?" + _ASSIGNED + r"[0-9a-f]{40}(?![0-9a-f])", "wandb"),
            _shape(r"(?is)api\.wandb\.ai.{0,80}?password\s+[0-9a-f]{40}(?![0-9a-f])", "wandb"),
            _shape(r"\bwandb_v1_[A-Za-z0-9_]{20,}", "wandb_v1_"),
        ),
    ),
    Kind(
        "openai",
        "an OpenAI API key (sk-...)",
        "platform.openai.com → API keys",
        (_shape(r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{32,}", "sk-"),),
        _mixed_case,
    ),
    Kind(
        "aws-access-key",
        "an AWS access key id (AKIA...)",
        "the AWS console → IAM → Security credentials",
        (_shape(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", "akia", "asia"),),
    ),
    Kind(
        "aws-secret-key",
        "an AWS secret access key",
        "the AWS console → IAM → Security credentials",
        (
            _shape(
                r"(?i)aws\w*secret\w*[\"']?" + _ASSIGNED + r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])",
                "aws",
            ),
        ),
    ),
    Kind(
        "github",
        "a GitHub token",
        "github.com → Settings → Developer settings → Personal access tokens",
        (
            _shape(r"\bgh[pousr]_[A-Za-z0-9]{36,}\b", "ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
            _shape(r"\bgithub_pat_[A-Za-z0-9_]{22,}", "github_pat_"),
        ),
    ),
    Kind(
        "google-api-key",
        "a Google API key (AIza...)",
        "console.cloud.google.com → APIs & Services → Credentials",
        (_shape(r"\bAIza[0-9A-Za-z_-]{35}", "aiza"),),
    ),
    Kind(
        "private-key",
        "a private key block",
        "wherever the key pair was issued; make a new pair",
        # The whole block, to its END line (or the text's end): what redact() takes out.
        (
            _shape(
                r"(?s)-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
                r"(?:.*?-----END [A-Z0-9 ]*-----|.*)",
                "private key",
            ),
        ),
    ),
)

#: Output and attachment data that is binary (base64) and not scanned as text. SVG is text.
_BINARY_PREFIXES = (
    "image/png",
    "image/jpeg",
    "image/gif",
    "image/webp",
    "image/bmp",
    "audio/",
    "video/",
    "application/pdf",
    "application/octet-stream",
)
#: Files next to the notebook that hold credentials by convention.
SIDE_FILES = ("kaggle.json", ".env", "*.env", ".env.*", "credentials*", "secrets*", ".netrc")
_SIDE_FILE_MAX_BYTES = 1 << 20
#: Files that ``nbresume commit`` pushes with the notebook, scanned whatever they hold.
PUSHED_FILES = (METADATA_FILE,)
#: Text that may be base64: decoded and scanned too.
_BASE64 = re.compile(r"[A-Za-z0-9+/_-]{16,}={0,2}")
#: A shorter run of base64 decodes to fewer than 16 bytes: text too short to hold anything the
#: scan finds (a credential has 20 characters at the least, an encoded run 16). It is not
#: decoded (a float's digits are such runs), unless it starts as base64 of gzip, zlib, bz2 or
#: xz data does (:data:`_PACKED_BASE64`): that may unpack to more.
_BASE64_TEXT_MIN = 22
_PACKED_BASE64 = ("H4", "e", "Qlpo", "/Td6", "_Td6")
#: Hex that may be text: at least 16 bytes, two digits each (a space or a colon between).
_HEX = re.compile(r"(?<![0-9A-Za-z])(?:[0-9A-Fa-f]{2}[ :]?){16,}")
#: A run of URL text with percent-escapes in it (``ghp%5F...``, ``%67%68...``).
_PERCENT = re.compile(
    r"(?<![\w.~+%-])(?:[\w.~+-]|%[0-9A-Fa-f]{2})*%[0-9A-Fa-f]{2}(?:[\w.~+-]|%[0-9A-Fa-f]{2})*"
)
#: What each credential that rot13 or reversing can hide starts with: text turned around
#: without one of these holds none, and is not matched against every pattern.
_PREFIXES = re.compile(r"KGAT_|hf_|sk-|gh[pousr]_|github_pat_|AKIA|ASIA|AIza|wandb_v1_|PRIVATE")
#: How many encodings deep the scan looks (base64 of base64, hex of gzip, ...).
_DEPTH = 2
#: The most bytes a compressed run is unpacked to (a small token needs far fewer).
_UNPACKED_MAX = 1 << 20


@dataclass(frozen=True)
class SecretFinding:
    """A credential found: where (``"source"``, ``"output"``, ``"cell metadata"``,
    ``"attachment"``, ``"metadata"`` of the notebook or ``"file"``), the cell or the file, and
    its kind. Holds no part of the secret."""

    kind: Kind
    where: str
    cell: Cell | None = None
    file: str = ""

    def __str__(self) -> str:
        # The cell by number only: its first line may be the secret itself.
        if self.file in PUSHED_FILES:
            place = f"file {self.file}, pushed with the notebook"
        elif self.file:
            place = f"file {self.file} next to the notebook"
        elif self.cell is not None:
            place = f"cell {self.cell.number} {self.where}"
        else:
            place = "notebook metadata"
        return f"{place}: {self.kind.label}"


def _unpacked(raw: bytes) -> bytes:
    """``raw`` decompressed when it starts as gzip, zlib, bz2 or xz data does (at most
    :data:`_UNPACKED_MAX` bytes); ``raw`` itself otherwise."""
    unpack: Any
    zlib_header = len(raw) > 1 and raw[0] == 0x78 and int.from_bytes(raw[:2], "big") % 31 == 0
    if raw[:2] == b"\x1f\x8b" or zlib_header:
        unpack = zlib.decompressobj(wbits=47)  # gzip or zlib, told apart by the header
    elif raw[:3] == b"BZh":
        unpack = bz2.BZ2Decompressor()
    elif raw[:6] == b"\xfd7zXZ\x00":
        unpack = lzma.LZMADecompressor()
    else:
        return raw
    try:
        out: bytes = unpack.decompress(raw, _UNPACKED_MAX)
    except (zlib.error, OSError, EOFError, ValueError, lzma.LZMAError):
        return raw
    return out


def _as_text(raw: bytes) -> str | None:
    """Decoded bytes as text (unpacked first), or ``None`` when they are not text."""
    try:
        text = _unpacked(raw).decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if all(c.isprintable() or c in "\r\n\t" for c in text) else None


def _from_base64(run: str) -> str | None:
    bare = run.rstrip("=")
    padded = bare + "=" * (-len(bare) % 4)
    for alphabet in (None, b"-_"):
        try:
            text = _as_text(base64.b64decode(padded, altchars=alphabet, validate=True))
        except (binascii.Error, ValueError):
            continue
        if text is not None:
            return text
    return None


def _from_hex(run: str) -> str | None:
    digits = re.sub("[ :]", "", run)
    return _as_text(bytes.fromhex(digits[: len(digits) // 2 * 2]))


_ENCODINGS: tuple[tuple[re.Pattern[str], Callable[[str], str | None]], ...] = (
    (_BASE64, _from_base64),
    (_HEX, _from_hex),
    (_PERCENT, unquote),
)


def _encoded(text: str) -> Iterator[tuple[tuple[int, int], str]]:
    """Every run of ``text`` that decodes to other text (base64, hex, percent-escapes): its
    span and what it decodes to."""
    for pattern, decode in _ENCODINGS:
        if pattern is _PERCENT and "%" not in text:
            continue
        for match in pattern.finditer(text):
            start, stop = match.span()
            short = pattern is _BASE64 and stop - start < _BASE64_TEXT_MIN
            if short and not text.startswith(_PACKED_BASE64, start):
                continue
            decoded = decode(match.group(0))
            if decoded and decoded != match.group(0):
                yield match.span(), decoded


def _rot13(text: str) -> str:
    return codecs.encode(text, "rot13")


def _turned(text: str) -> Iterator[str]:
    """``text`` rot13 and reversed, where that shows the start of a credential."""
    for turned in (_rot13(text), text[::-1]):
        if _PREFIXES.search(turned):
            yield turned


def _variants(text: str, depth: int) -> Iterator[str]:
    """``text``, and what a line of Python makes of it: rot13, reversed, and each encoded
    run decoded (and those in it, ``depth`` deep)."""
    yield text
    yield from _turned(text)
    if depth > 0:
        for _, decoded in _encoded(text):
            yield from _variants(decoded, depth - 1)


def _spans(text: str) -> Iterator[tuple[Kind, tuple[int, int]]]:
    """Each credential written plainly in ``text``: its kind and span."""
    # Folded as a case-insensitive pattern matches: "ſ" is an "s", "K" (Kelvin) a "k", "ı" an "i".
    folded = text.casefold().replace("ı", "i")
    for kind in KINDS:
        for shape in kind.shapes:
            if not shape.may_match(text, folded):
                continue
            for match in shape.pattern.finditer(text):
                if kind.accept(match.group(0)):
                    yield kind, match.span()


def kinds_in(text: str) -> list[Kind]:
    """The kinds of credential that ``text`` contains, as written or encoded."""
    seen = {kind.id for variant in _variants(text, _DEPTH) for kind, _ in _spans(variant)}
    return [kind for kind in KINDS if kind.id in seen]


def redact(text: str) -> str:
    """``text`` with every credential the scan finds in it replaced by ``[redacted]``: as
    written, reversed or rot13, and each encoded run that hides one, whole."""
    end = len(text)
    spans = [span for _, span in _spans(text)]
    rot13, reversed_ = _rot13(text), text[::-1]
    if _PREFIXES.search(rot13):  # rot13 keeps every character in its place
        spans += [span for _, span in _spans(rot13)]
    if _PREFIXES.search(reversed_):
        spans += [(end - stop, end - start) for _, (start, stop) in _spans(reversed_)]
    spans += [span for span, decoded in _encoded(text) if kinds_in(decoded)]
    out, done = [], 0
    for start, stop in sorted(spans):
        if stop <= done:
            continue
        if start >= done:
            out += [text[done:start], "[redacted]"]
        done = stop
    return "".join([*out, text[done:]])


def _texts(value: Any) -> Iterator[str]:
    """Every piece of text in saved JSON (an output, metadata), binary payloads left out."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                if key.startswith(_BINARY_PREFIXES):
                    continue
                yield key
            yield from _texts(item)


#: The fewest character codes in a list that may spell a credential.
_CODES_MIN = 16


def _codes(node: ast.AST) -> str | None:
    """The text a list of character codes spells (``[104, 102, ...]``, as
    ``"".join(map(chr, ...))`` or ``bytes(...).decode()`` turn it into text)."""
    if not isinstance(node, (ast.List, ast.Tuple, ast.Set)) or len(node.elts) < _CODES_MIN:
        return None
    codes = [
        e.value
        for e in node.elts
        if isinstance(e, ast.Constant) and type(e.value) is int and 0 < e.value < 0x110000
    ]
    return "".join(map(chr, codes)) if len(codes) == len(node.elts) else None


class _Strings:
    """The strings a notebook's Python builds from literals: concatenations, joins, f-strings,
    ``chr()`` and lists of character codes, and names assigned at the top level, followed
    from cell to cell."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def built(self, tree: ast.Module) -> list[str]:
        out: list[str] = []
        for statement in tree.body:
            for node in ast.walk(statement):
                if isinstance(node, (ast.BinOp, ast.JoinedStr, ast.Call)):
                    value = self.fold(node)
                    if value:
                        out.append(value)
                spelled = _codes(node)
                if spelled:
                    out.append(spelled)
            if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value:
                value = self.fold(statement.value)
                targets = (
                    statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                )
                for target in targets:
                    if isinstance(target, ast.Name) and value is not None:
                        self.names[target.id] = value
        # Every string of the cell run together: pieces kept in separate names or list items.
        pieces = [
            n.value
            for n in sorted(
                (n for n in ast.walk(tree) if isinstance(n, ast.Constant)),
                key=lambda n: (n.lineno, n.col_offset),
            )
            if isinstance(n.value, str)
        ]
        out += ["\n".join(pieces), "".join(pieces)]
        return out

    def fold(self, node: ast.AST) -> str | None:
        """The string ``node`` evaluates to, when it is built from literals only."""
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else None
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.fold(node.left), self.fold(node.right)
            return left + right if left is not None and right is not None else None
        if isinstance(node, ast.JoinedStr):
            parts = []
            for value in node.values:
                inner = value.value if isinstance(value, ast.FormattedValue) else value
                text = self.fold(inner)
                if text is None:
                    return None
                parts.append(text)
            return "".join(parts)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "join"
            and len(node.args) == 1
            and isinstance(node.args[0], (ast.List, ast.Tuple))
        ):
            glue = self.fold(node.func.value)
            items = [self.fold(e) for e in node.args[0].elts]
            if glue is None or any(i is None for i in items):
                return None
            return glue.join(i for i in items if i is not None)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "chr"
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Constant)
            and type(node.args[0].value) is int
            and 0 < node.args[0].value < 0x110000
        ):
            return chr(node.args[0].value)
        return None


def _attachment_texts(cell_raw: dict[str, Any]) -> Iterator[str]:
    """The text of a cell's attachments: names, and text payloads decoded from base64."""
    attachments = cell_raw.get("attachments")
    if not isinstance(attachments, dict):
        return
    for name, bundle in attachments.items():
        yield str(name)
        if not isinstance(bundle, dict):
            continue
        for mime, data in bundle.items():
            if str(mime).startswith(_BINARY_PREFIXES):
                continue
            text = "".join(data) if isinstance(data, list) else str(data)
            yield text
            with contextlib.suppress(binascii.Error, ValueError):
                yield base64.b64decode(text, validate=False).decode("utf-8")


def scan(notebook: Notebook, folder: Path | None = None) -> list[SecretFinding]:
    """Every place that holds a credential, in notebook order, then the credential files in
    ``folder`` (the notebook's folder)."""
    found: list[SecretFinding] = []
    strings = _Strings()
    raw_cells = notebook.document.get("cells", [])
    for cell in notebook.cells:
        source = [cell.source]
        tree = cell.python()
        if tree is not None:
            source += strings.built(tree)
        places = {
            "source": source,
            "output": [t for o in cell.outputs for t in _texts(o)],
        }
        raw = raw_cells[cell.number - 1] if cell.number - 1 < len(raw_cells) else {}
        raw = raw if isinstance(raw, dict) else {}
        places["cell metadata"] = [_json(raw.get("metadata"))]
        places["attachment"] = list(_attachment_texts(raw))
        for where, texts in places.items():
            for kind in kinds_in("\n".join(texts)):
                found.append(SecretFinding(kind, where, cell))
    for kind in kinds_in(_json(notebook.metadata)):
        found.append(SecretFinding(kind, "metadata"))
    if folder is not None:
        found += scan_files(folder)
    return found


def scan_files(folder: Path) -> list[SecretFinding]:
    """The files pushed with the notebook (:data:`PUSHED_FILES`) and credential files
    (:data:`SIDE_FILES`) in ``folder`` that hold a credential."""
    found: list[SecretFinding] = []
    seen: set[Path] = set()
    for pattern in (*PUSHED_FILES, *SIDE_FILES):
        for path in sorted(folder.glob(pattern)):
            if path in seen or not path.is_file():
                continue
            seen.add(path)
            try:
                if path.stat().st_size > _SIDE_FILE_MAX_BYTES:
                    continue
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            if path.name == "kaggle.json":
                text = _kaggle_json(text)
            for kind in kinds_in(text):
                found.append(SecretFinding(kind, "file", file=path.name))
    return found


def _json(value: Any) -> str:
    """Metadata as JSON text: names and values side by side, as the patterns read them."""
    return json.dumps(value, ensure_ascii=False) if value else ""


def _kaggle_json(text: str) -> str:
    """kaggle.json as the patterns read it, whatever its spacing."""
    try:
        document = json.loads(text)
    except ValueError:
        return text
    return json.dumps(document) if isinstance(document, dict) else text


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
    files = {f.file for f in findings if f.file}
    if files & set(PUSHED_FILES):
        lines.append(
            f"  Delete them from {METADATA_FILE}: it is pushed with the notebook, and nbresume "
            "keeps what it holds beyond the command line's settings."
        )
    if files - set(PUSHED_FILES):
        lines.append(
            "  Move credential files out of the notebook's folder (kaggle.json belongs in "
            "~/.kaggle/): whatever is in that folder is one command away from being uploaded."
        )
    lines += [f"  revoke {r}" for r in revoke]
    return "\n".join(lines)
