"""A corpus of notebooks that hold credentials, and of clean notebooks that look as if they did.

Every token is fake, drawn at run time from a seeded generator in the shape of the real thing,
so that the repository holds nothing a secret scanner (or a thief) would take for a credential,
and every run sees the same corpus. Each secret case lists the secrets it holds (and their
encoded forms), so that a test can check that no output contains any of them, nor any 8
characters of one.
"""

from __future__ import annotations

import base64
import codecs
import gzip
import json
import random
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ALNUM = string.ascii_letters + string.digits
HEX = "0123456789abcdef"
B64 = string.ascii_letters + string.digits + "+/"
UPPER = string.ascii_uppercase + string.digits
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


@dataclass
class Case:
    """One notebook (or script) of the corpus and what it hides."""

    name: str
    cells: list[dict[str, Any]]
    secrets: list[str] = field(default_factory=list)
    #: Where the scan must report it: "source", "output", "cell metadata", "attachment",
    #: "metadata" or "file".
    where: str = "source"
    metadata: dict[str, Any] = field(default_factory=dict)
    side_files: dict[str, str] = field(default_factory=dict)
    script: bool = False

    @property
    def file_name(self) -> str:
        return f"{self.name}.py" if self.script else f"{self.name}.ipynb"

    def write(self, folder: Path) -> Path:
        """The notebook, and its side files, in ``folder``; returns the notebook's path."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / self.file_name
        if self.script:
            path.write_text(self.cells[0]["source"])
        else:
            document = {
                "nbformat": 4,
                "nbformat_minor": 5,
                "metadata": {"kernelspec": KERNELSPEC, **self.metadata},
                "cells": self.cells,
            }
            path.write_text(json.dumps(document, indent=1))
        for name, text in self.side_files.items():
            (folder / name).write_text(text)
        return path


def code(
    source: str, outputs: list[dict[str, Any]] | None = None, **metadata: Any
) -> dict[str, Any]:
    return {
        "cell_type": "code",
        "metadata": metadata,
        "source": source,
        "outputs": outputs or [],
        "execution_count": None,
    }


def markdown(source: str, **extra: Any) -> dict[str, Any]:
    return {"cell_type": "markdown", "metadata": {}, "source": source, **extra}


def stream(text: str) -> dict[str, Any]:
    return {"output_type": "stream", "name": "stdout", "text": text}


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


#: The first cell of every corpus notebook: what a batch run wants to see first.
INIT = "import nbresume\n\nrun = nbresume.init('corpus-run')"


class Tokens:
    """Fake tokens in the shapes of real ones (prefixes are assembled from pieces, so that
    this file itself holds no credential-shaped text)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def draw(self, alphabet: str, n: int) -> str:
        # Real tokens mix digits, lower and upper case (where the alphabet has them).
        while True:
            text = "".join(self.rng.choice(alphabet) for _ in range(n))
            kinds = [
                any(c.isdigit() for c in text),
                any(c.islower() for c in text) or not any(c.islower() for c in alphabet),
                any(c.isupper() for c in text) or not any(c.isupper() for c in alphabet),
            ]
            if all(kinds):
                return text

    def kaggle_key(self) -> str:
        return self.draw(HEX, 32)

    def kaggle_token(self) -> str:
        return "KG" + "AT_" + self.draw(HEX, 32)

    def hf(self) -> str:
        return "h" + "f_" + self.draw(ALNUM, 34)

    def openai(self) -> str:
        return "s" + "k-" + "proj-" + self.draw(ALNUM, 48)

    def wandb(self) -> str:
        return self.draw(HEX, 40)

    def aws_id(self) -> str:
        return "AK" + "IA" + self.draw(UPPER, 16)

    def aws_secret(self) -> str:
        return self.draw(B64, 40)

    def github(self) -> str:
        return "gh" + "p_" + self.draw(ALNUM, 36)

    def github_pat(self) -> str:
        return "github" + "_pat_" + self.draw(ALNUM + "_", 60)

    def google(self) -> str:
        return "AI" + "za" + self.draw(ALNUM + "-_", 35)


def secret_cases(seed: int = 2026) -> list[Case]:
    """Notebooks that must be refused: every kind of credential, and every place and disguise
    the scan must see through."""
    t = Tokens(seed)
    cases: list[Case] = []

    def add(name: str, cells: list[dict[str, Any]], secrets: list[str], **kw: Any) -> None:
        cases.append(Case(name, [code(INIT), *cells], secrets, **kw))

    # Each kind, plainly in a cell's source.
    hf = t.hf()
    add("hf-login", [code(f'from huggingface_hub import login\nlogin(token="{hf}")')], [hf])
    key = t.openai()
    add("openai-client", [code(f'client = OpenAI(api_key="{key}")')], [key])
    key = t.kaggle_token()
    add("kaggle-token-env", [code(f'os.environ["KAGGLE_API_TOKEN"] = "{key}"')], [key])
    key = t.kaggle_key()
    add("kaggle-key-env", [code(f'os.environ["KAGGLE_KEY"] = "{key}"')], [key])
    key = t.wandb()
    add("wandb-login", [code(f'import wandb\nwandb.login(key="{key}")')], [key])
    key = t.wandb()
    add("wandb-env", [code(f'os.environ["WANDB_API_KEY"] = "{key}"')], [key])
    ident, secret = t.aws_id(), t.aws_secret()
    add(
        "aws-pair",
        [
            code(
                f's3 = boto3.client("s3", aws_access_key_id="{ident}",\n'
                f'    aws_secret_access_key="{secret}")'
            )
        ],
        [ident, secret],
    )
    key = t.github()
    add("github-clone", [code(f"!git clone https://{key}@github.com/me/private-repo")], [key])
    key = t.github_pat()
    add("github-pat", [code(f'headers = {{"Authorization": "token {key}"}}')], [key])
    key = t.google()
    add("google-maps", [code(f'gmaps = googlemaps.Client(key="{key}")')], [key])
    body = t.draw(B64, 64)
    pem = "-----" + "BEGIN " + "OPENSSH " + "PRIVATE " + "KEY" + "-----"
    add("ssh-key", [code(f'KEY = """{pem}\n{body}\n"""')], [body])

    # A token split across two string literals, or joined with +, join(), an f-string, or
    # kept in pieces in names (in another cell).
    hf = t.hf()
    add("split-literals", [code(f'token = ("{hf[:18]}"\n         "{hf[18:]}")')], [hf])
    key = t.openai()
    add("joined-plus", [code(f'api_key = "{key[:20]}" + "{key[20:]}"')], [key])
    key = t.github()
    add(
        "joined-join",
        [code(f'token = "".join(["{key[:14]}", "{key[14:28]}", "{key[28:]}"])')],
        [key],
    )
    hf = t.hf()
    add(
        "pieces-across-cells",
        [code(f'head = "{hf[:15]}"'), code(f'tail = "{hf[15:]}"'), code("login(head + tail)")],
        [hf],
    )
    key = t.google()
    add("f-string", [code(f'part = "{key[12:]}"\nurl_key = f"{key[:12]}{{part}}"')], [key])

    # Base64: a token, and kaggle.json contents, encoded to hide them.
    hf = t.hf()
    encoded = b64(hf)
    add("base64-token", [code(f'token = base64.b64decode("{encoded}").decode()')], [hf, encoded])
    key = t.kaggle_key()
    kaggle_json = json.dumps({"username": "someone", "key": key})
    encoded = b64(kaggle_json)
    add(
        "base64-kaggle-json",
        [code(f'Path("~/.kaggle/kaggle.json").write_bytes(base64.b64decode("{encoded}"))')],
        [key, encoded],
    )
    key = t.openai()
    encoded = base64.urlsafe_b64encode(key.encode()).decode()
    add("urlsafe-base64", [code(f'KEY = base64.urlsafe_b64decode("{encoded}")')], [key, encoded])
    key = t.kaggle_key()
    add(
        "kaggle-json-literal",
        [code(f'creds = {{"username": "someone", "key": "{key}"}}\njson.dump(creds, f)')],
        [key],
    )

    # Disguises a line of Python undoes: hex, rot13, character codes, reversed, gzip and
    # base64, percent-escapes in a URL.
    hf = t.hf()
    encoded = hf.encode().hex()
    add("hex-encoded", [code(f'token = bytes.fromhex("{encoded}").decode()')], [hf, encoded])
    key = t.openai()
    encoded = codecs.encode(key, "rot13")
    add("rot13", [code(f'api_key = codecs.decode("{encoded}", "rot13")')], [key, encoded])
    key = t.github()
    codes = ", ".join(str(ord(c)) for c in key)
    add("chr-codes", [code(f"token = ''.join(map(chr, [{codes}]))")], [key])
    hf = t.hf()
    add("chr-calls", [code("token = " + " + ".join(f"chr({ord(c)})" for c in hf))], [hf])
    key = t.google()
    add("reversed", [code(f'maps_key = "{key[::-1]}"[::-1]')], [key, key[::-1]])
    hf = t.hf()
    encoded = base64.b64encode(gzip.compress(hf.encode(), mtime=0)).decode()
    add(
        "gzip-base64",
        [code(f'token = gzip.decompress(base64.b64decode("{encoded}")).decode()')],
        [hf, encoded],
    )
    key = t.github()
    escaped = "".join(f"%{b:02X}" for b in key.encode())
    add(
        "percent-clone-url",
        [code(f"!git clone https://{escaped}@github.com/me/private-repo")],
        [key, escaped],
    )
    key = t.github()
    escaped = key.replace("_", "%5F")
    add(
        "percent-clone-url-user",
        [code(f'url = "https://me:{escaped}@github.com/me/private-repo.git"')],
        [key, escaped],
    )

    # A Kaggle key's shape (32 hex) under a key-like name.
    key = t.kaggle_key()
    add("hex-api-key", [code(f'api_key = "{key}"')], [key])
    key = t.kaggle_key()
    add("hex-secret-dict", [code(f'config = {{"secret": "{key}", "epochs": 3}}')], [key])

    # Shell lines and magics.
    hf = t.hf()
    add("env-magic", [code(f"%env HF_TOKEN={hf}")], [hf])
    hf = t.hf()
    add("cli-login", [code(f"!huggingface-cli login --token {hf}")], [hf])

    # Outputs: stream, HTML, SVG, traceback, netrc printed.
    key = t.openai()
    add("printed", [code("print(config)", [stream(f"api_key: {key}\n")])], [key], where="output")
    key = t.aws_id()
    html = {
        "output_type": "display_data",
        "metadata": {},
        "data": {"text/html": f"<td>{key}</td>", "text/plain": "<table>"},
    }
    add("html-output", [code("df", [html])], [key], where="output")
    hf = t.hf()
    svg = f'<svg xmlns="http://www.w3.org/2000/svg"><text x="1" y="9">{hf}</text></svg>'
    svg_output = {"output_type": "display_data", "metadata": {}, "data": {"image/svg+xml": svg}}
    add("svg-output", [code("plot()", [svg_output])], [hf], where="output")
    key = t.github()
    error = {
        "output_type": "error",
        "ename": "HTTPError",
        "evalue": "401",
        "traceback": [f"HTTPError: 401 for https://{key}@github.com/x"],
    }
    add("traceback", [code("clone()", [error])], [key], where="output")
    key = t.wandb()
    netrc = f"machine api.wandb.ai\n  login user\n  password {key}\n"
    add("netrc-printed", [code("!cat ~/.netrc", [stream(netrc)])], [key], where="output")

    # Cell metadata, markdown attachments, notebook metadata, a raw cell.
    hf = t.hf()
    add(
        "cell-metadata",
        [code("train()", None, colab={"hf_token": hf})],
        [hf],
        where="cell metadata",
    )
    key = t.kaggle_key()
    attachment = {
        "kaggle.json": {"application/json": b64(json.dumps({"username": "someone", "key": key}))}
    }
    cases.append(
        Case(
            "attachment",
            [code(INIT), markdown("![creds](attachment:kaggle.json)", attachments=attachment)],
            [key],
            where="attachment",
        )
    )
    key = t.openai()
    attachment = {"notes.txt": {"text/plain": b64(f"OPENAI_API_KEY={key}\n")}}
    cases.append(
        Case(
            "attachment-text",
            [code(INIT), markdown("see ![notes](attachment:notes.txt)", attachments=attachment)],
            [key],
            where="attachment",
        )
    )
    key = t.github_pat()
    cases.append(
        Case(
            "notebook-metadata",
            [code(INIT)],
            [key],
            where="metadata",
            metadata={"widgets": {"state": {"auth": f"Bearer {key}"}}},
        )
    )
    key = t.google()
    cases.append(Case("markdown-cell", [code(INIT), markdown(f"My key: `{key}`")], [key]))

    # Files next to the notebook.
    key = t.kaggle_key()
    cases.append(
        Case(
            "side-kaggle-json",
            [code(INIT)],
            [key],
            where="file",
            side_files={"kaggle.json": json.dumps({"username": "someone", "key": key})},
        )
    )
    hf, key = t.hf(), t.openai()
    cases.append(
        Case(
            "side-dotenv",
            [code(INIT)],
            [hf, key],
            where="file",
            side_files={".env": f"HF_TOKEN={hf}\nOPENAI_API_KEY={key}\n"},
        )
    )

    # The kernel-metadata.json that is pushed with the notebook.
    hf = t.hf()
    cases.append(
        Case(
            "kernel-metadata",
            [code(INIT)],
            [hf],
            where="file",
            side_files={
                "kernel-metadata.json": json.dumps(
                    {
                        "id": "someone/corpus-run",
                        "code_file": "kernel-metadata.ipynb",
                        "title": "Corpus Run",
                        "dataset_sources": [],
                        "notes": f"HF_TOKEN={hf}",
                    }
                )
            },
        )
    )

    # A Python script kernel.
    hf = t.hf()
    cases.append(
        Case("script", [code(f'{INIT}\nHF = "{hf[:10]}" "{hf[10:]}"\n')], [hf], script=True)
    )
    return cases


def clean_cases(seed: int = 77) -> list[Case]:
    """Notebooks that look as if they held credentials, and do not."""
    t = Tokens(seed)
    commit = t.draw(HEX, 40)
    md5 = t.draw(HEX, 32)
    sha = t.draw(HEX, 64)
    run_id = t.draw(HEX, 32)
    png = t.draw(B64, 3000)
    plain = b64("epochs=3 lr=0.001 batch=32")
    packed = base64.b64encode(gzip.compress(b"epochs=3 lr=0.001 batch=32", mtime=0)).decode()
    input_ids = ", ".join(str(t.rng.randrange(100, 30000)) for _ in range(40))
    cases = [
        Case(
            "sklearn-baseline",
            [code(INIT), code('run_name = "sk-learn-baseline-rf-500-trees"\nprint(run_name)')],
        ),
        Case(
            "git-commit",
            [code(INIT), code(f'wandb.init(project="x", config={{"git_commit": "{commit}"}})')],
        ),
        Case(
            "git-commit-printed", [code(INIT), code("!git rev-parse HEAD", [stream(f"{commit}\n")])]
        ),
        Case(
            "md5-checksum",
            [code(INIT), code(f'expected_md5 = "{md5}"\nassert md5(p) == expected_md5')],
        ),
        Case("run-id", [code(INIT), code(f'run_id = "{run_id}"')]),
        Case("weights-sha256", [code(INIT), code("print(digest)", [stream(f"weights {sha}\n")])]),
        Case(
            "hf-names",
            [
                code(INIT),
                code('from huggingface_hub import hf_hub_download\nname = "hf_tokenizer-run"'),
            ],
        ),
        Case(
            "secret-from-kaggle",
            [
                code(INIT),
                code(
                    "from kaggle_secrets import UserSecretsClient\n"
                    'token = UserSecretsClient().get_secret("HF_TOKEN")\n'
                    'api_key = os.environ["KAGGLE_KEY"]'
                ),
            ],
        ),
        Case(
            "png-output",
            [
                code(INIT),
                code(
                    "plt.plot(losses)",
                    [
                        {
                            "output_type": "display_data",
                            "metadata": {},
                            "data": {"image/png": png, "text/plain": "<Figure>"},
                        }
                    ],
                ),
            ],
        ),
        Case("plain-base64", [code(INIT), code(f'settings = base64.b64decode("{plain}")')]),
        Case(
            "uuid-token-name",
            [code(INIT), code('token_id = "123e4567-e89b-12d3-a456-426614174000"')],
        ),
        Case(
            "side-files-without-secrets",
            [code(INIT)],
            side_files={
                ".env": "WANDB_MODE=offline\nDATA_DIR=/kaggle/input\n",
                "kaggle.json": json.dumps({"username": "someone", "key": ""}),
            },
        ),
        Case(
            "script",
            [code(f'{INIT}\nprint("sk-learn-baseline-rf-500-trees", "{commit}")\n')],
            script=True,
        ),
        Case(
            "encoded-settings",
            [
                code(INIT),
                code(
                    f'png_magic = bytes.fromhex("89504e470d0a1a0a0000000d49484452{sha[:32]}")\n'
                    f'settings = gzip.decompress(base64.b64decode("{packed}"))\n'
                    'greeting = codecs.decode("uryyb sebz gur zbqry", "rot13")\n'
                    'title = "gninrael peed"[::-1]'
                ),
            ],
        ),
        Case(
            "token-ids-and-urls",
            [
                code(INIT),
                code(
                    f"input_ids = [{input_ids}]\n"
                    'search = "https://example.com/q?text=deep%20learning%2Bpytorch&page=2"\n'
                    "!wget -q https://example.com/data/train%20set%202024.zip"
                ),
            ],
        ),
        Case(
            "kernel-metadata-clean",
            [code(INIT)],
            side_files={
                "kernel-metadata.json": json.dumps(
                    {
                        "id": "someone/corpus-run",
                        "code_file": "kernel-metadata-clean.ipynb",
                        "title": "Corpus Run",
                        "dataset_sources": ["someone/cifar-10"],
                        "kernel_sources": [f"someone/run-{commit[:8]}"],
                    }
                )
            },
        ),
    ]
    return cases
