"""The secrets scan: every kind of credential is found in a cell's source and in its saved
outputs, the refusal names the cell and the kind, and no part of any secret is ever printed.

The corpus is synthetic and built at run time from random characters, so the repository holds
nothing that looks like a real credential to a secret scanner.
"""

from __future__ import annotations

import base64
import json
import os
import random
import string
import zlib
from pathlib import Path

from nbresume.kaggle import notebook as nbfile
from nbresume.kaggle.secrets import kinds_in, scan

from .conftest import nbresume, user_env

ALNUM = string.ascii_letters + string.digits
HEX = "0123456789abcdef"
B64 = string.ascii_letters + string.digits + "+/"


def _draw(rng: random.Random, alphabet: str, n: int) -> str:
    # At least one digit and one letter, as real tokens have.
    while True:
        text = "".join(rng.choice(alphabet) for _ in range(n))
        if any(c.isdigit() for c in text) and any(c.isalpha() for c in text):
            return text


def corpus(seed: int = 7) -> dict[str, list[tuple[str, str]]]:
    """For each kind of credential, (line of code, the secret in it): fake and random."""
    rng = random.Random(seed)
    upper = string.ascii_uppercase + string.digits
    pem = "-----" + "BEGIN " + "RSA " + "PRIVATE " + "KEY" + "-----"
    kaggle_token = "KGAT" + "_" + _draw(rng, HEX, 32)
    kaggle_json_key = _draw(rng, HEX, 32)
    kaggle_key = _draw(rng, HEX, 32)
    hf = "hf" + "_" + _draw(rng, ALNUM, 34)
    wandb = _draw(rng, HEX, 40)
    openai = "sk-" + "proj-" + _draw(rng, ALNUM, 48)
    aws_id = "AK" + "IA" + _draw(rng, upper, 16)
    aws_secret = _draw(rng, B64, 40)
    ghp = "gh" + "p_" + _draw(rng, ALNUM, 36)
    pat = "github" + "_pat_" + _draw(rng, ALNUM + "_", 60)
    google = "AI" + "za" + _draw(rng, ALNUM + "-_", 35)
    key_body = _draw(rng, B64, 64)
    return {
        "kaggle": [
            (f'os.environ["KAGGLE_API_TOKEN"] = "{kaggle_token}"', kaggle_token),
            (f'creds = {{"username": "someone", "key": "{kaggle_json_key}"}}', kaggle_json_key),
            (f'os.environ["KAGGLE_KEY"] = "{kaggle_key}"', kaggle_key),
        ],
        "huggingface": [(f'login(token="{hf}")', hf)],
        "wandb": [(f'wandb.login(key="{wandb}")', wandb)],
        "openai": [(f'client = OpenAI(api_key="{openai}")', openai)],
        "aws-access-key": [(f'key_id = "{aws_id}"', aws_id)],
        "aws-secret-key": [(f'aws_secret_access_key = "{aws_secret}"', aws_secret)],
        "github": [(f'token = "{ghp}"', ghp), (f'token = "{pat}"', pat)],
        "google-api-key": [(f'maps_key = "{google}"', google)],
        "private-key": [(f'KEY = """{pem}\n{key_body}\n"""', key_body)],
    }


def write_notebook(path: Path, cells: list[dict[str, object]]) -> Path:
    document = {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
        "cells": cells,
    }
    path.write_text(json.dumps(document))
    return path


def code(source: str, outputs: list[dict[str, object]] | None = None) -> dict[str, object]:
    return {
        "cell_type": "code",
        "metadata": {},
        "source": source,
        "outputs": outputs or [],
        "execution_count": None,
    }


def test_every_kind_is_found_in_a_cell_source(tmp_path: Path) -> None:
    for kind, lines in corpus().items():
        for line, _ in lines:
            path = write_notebook(
                tmp_path / "nb.ipynb",
                [code("import nbresume"), {"cell_type": "markdown", "source": "x"}, code(line)],
            )
            found = scan(nbfile.load(path))
            assert [(f.kind.id, f.where, f.cell and f.cell.number) for f in found] == [
                (kind, "source", 3)
            ], line


def test_every_kind_is_found_in_saved_outputs(tmp_path: Path) -> None:
    for kind, lines in corpus(seed=11).items():
        for line, _ in lines:
            outputs: list[dict[str, object]] = [
                {"output_type": "stream", "name": "stdout", "text": ["loading...\n", line]},
            ]
            path = write_notebook(tmp_path / "nb.ipynb", [code("print(config)", outputs)])
            found = scan(nbfile.load(path))
            assert [(f.kind.id, f.where) for f in found] == [(kind, "output")], line
    # Results and tracebacks are outputs too.
    token = corpus(seed=3)["huggingface"][0][0]
    outputs = [
        {"output_type": "execute_result", "data": {"text/plain": [token]}, "metadata": {}},
        {"output_type": "error", "ename": "E", "evalue": "x", "traceback": [token]},
    ]
    path = write_notebook(tmp_path / "nb.ipynb", [code("f()", outputs)])
    assert [(f.kind.id, f.where) for f in scan(nbfile.load(path))] == [("huggingface", "output")]


def test_ordinary_notebook_text_and_images_are_not_secrets(tmp_path: Path) -> None:
    rng = random.Random(5)
    # A large base64 image can hold any short pattern by chance: image data is not scanned.
    image = "AI" + "za" + _draw(rng, ALNUM, 35) + _draw(rng, B64, 4000)
    outputs: list[dict[str, object]] = [
        {"output_type": "display_data", "data": {"image/png": image}, "metadata": {}}
    ]
    path = write_notebook(
        tmp_path / "nb.ipynb",
        [
            code("!pip install -q scikit-learn\nimport sklearn  # sk-learn, not a key"),
            code("plt.plot(losses)", outputs),
            code('run = nbresume.init("hf_tokenizer-run")\nsha = "0123abcd" * 5'),
        ],
    )
    assert scan(nbfile.load(path)) == []


def test_commit_refuses_naming_cell_and_kind_and_prints_no_secret(
    tmp_path: Path, kaggle_server: object
) -> None:
    kinds = corpus(seed=23)
    cells = [code("import nbresume\nrun = nbresume.init('leaky')")]
    # One kind per cell: half in sources, half in outputs.
    expected = {}
    for n, (kind, lines) in enumerate(kinds.items()):
        text = "\n".join(line for line, _ in lines)
        if n % 2:
            cells.append(code("print(settings)", [{"output_type": "stream", "text": text}]))
            expected[kind] = (len(cells), "output")
        else:
            cells.append(code(text))
            expected[kind] = (len(cells), "source")
    folder = tmp_path / "user"
    folder.mkdir()
    path = write_notebook(folder / "leaky.ipynb", cells)

    from testkit.fake_kaggle import FakeKaggle

    assert isinstance(kaggle_server, FakeKaggle)
    result = nbresume(
        ["commit", str(path), "--kernel", f"{kaggle_server.username}/leaky", "--no-smoke"],
        cwd=folder,
        env=user_env(tmp_path, kaggle_server),
    )
    assert result.code == 1
    assert "it was not pushed" in result.err
    for kind, (cell, where) in expected.items():
        label = {
            "kaggle": "Kaggle API key",
            "huggingface": "Hugging Face token",
            "wandb": "Weights & Biases",
            "openai": "OpenAI API key",
            "aws-access-key": "AWS access key id",
            "aws-secret-key": "AWS secret access key",
            "github": "GitHub token",
            "google-api-key": "Google API key",
            "private-key": "private key block",
        }[kind]
        assert any(
            line.strip().startswith(f"cell {cell} ") and where in line and label in line
            for line in result.err.splitlines()
        ), (kind, result.err)
    for lines in kinds.values():
        for _, secret in lines:
            # Not the secret, nor any 8 characters of it.
            for start in range(len(secret) - 8):
                assert secret[start : start + 8] not in result.text, "a secret was printed"
    assert kaggle_server.api_calls() == []  # nothing reached Kaggle
    assert not (folder / "kernel-metadata.json").exists()


def strings_in(value: object) -> list[str]:
    """Every string of a corpus notebook's JSON (sources, outputs, metadata, attachments)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [text for item in value for text in strings_in(item)]
    return []


def test_redact_takes_out_every_credential_however_it_is_written() -> None:
    from nbresume.kaggle.secrets import redact

    from .secrets_corpus import clean_cases, secret_cases

    checked = 0
    for case in secret_cases():
        texts = strings_in([case.cells, case.metadata]) + list(case.side_files.values())
        for text in texts:
            shown = redact(text)
            for secret in case.secrets:
                if secret not in text:
                    continue  # split into pieces the text does not run together
                checked += 1
                # Not the secret, nor any 8 characters of it.
                for start in range(len(secret) - 8):
                    assert secret[start : start + 8] not in shown, (case.name, shown)
    assert checked >= 35
    line = "loading config: " + corpus(seed=13)["openai"][0][1] + " (from settings)"
    assert redact(line) == "loading config: [redacted] (from settings)"
    for case in clean_cases():
        for text in strings_in([case.cells, case.metadata]) + list(case.side_files.values()):
            assert redact(text) == text, case.name


def test_a_credential_given_on_the_command_line_is_neither_pushed_nor_printed(
    tmp_path: Path, net_log: Path
) -> None:
    folder = tmp_path / "user"
    folder.mkdir()
    path = write_notebook(folder / "clean.ipynb", [code("import nbresume")])
    hf = corpus(seed=31)["huggingface"][0][1]
    result = nbresume(
        ["commit", path.name, "--kernel", "someone/clean-run", "--title", hf, "--dry-run"],
        cwd=folder,
        env=user_env(tmp_path, None),
    )
    assert result.code == 1, result.text
    assert "a Hugging Face token (hf_...), from a value given on the command line" in result.err
    assert "caution" not in result.err  # the slug made from the title is not shown either
    for start in range(len(hf) - 8):
        assert hf[start : start + 8] not in result.text, "a secret was printed"
    assert os.listdir(folder) == ["clean.ipynb"]


def test_what_the_scan_passes_over_unread_holds_no_credential() -> None:
    # The scan runs a pattern only over text holding one of its words, case-folded, and
    # decodes short base64 runs only when they start as compressed data does: neither may
    # lose a finding. A key-like name whose letters only a case-insensitive match takes for
    # ASCII ("ſ" for s, the Kelvin sign for K, "ı" for i); a token of 20 characters
    # compressed to a base64 run shorter than any that is decoded as plain text.
    rng = random.Random(3)
    value = _draw(rng, HEX, 32)
    for name in ("pa\u017fsword", "api_\u212aey", "credent\u0131al"):
        assert [k.id for k in kinds_in(f'"{name}": "{value}"')] == ["kaggle"], name
        assert [k.id for k in kinds_in(f'"{name}_x": "{value[:-1]}"')] == [], name
    token = "AK" + "IA" + "A" * 16
    packed = base64.b64encode(zlib.compress(token.encode(), 9)).decode()
    assert len(packed) < 22
    assert [k.id for k in kinds_in(f"blob = {packed!r}")] == ["aws-access-key"]
    assert [k.id for k in kinds_in(f"blob = {base64.b64encode(b'AK' + b'IA').decode()!r}")] == []
