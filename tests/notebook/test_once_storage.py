"""``%%nbresume once`` on an object store reached only through the Checkpointer's options.

``nbresume.init`` takes no ``storage_options``: the run folder's credentials and endpoint are
given to the Checkpointer. The markers go through that Checkpointer's file system, also when
it saves in a folder of its own inside the run folder. moto's S3 server on loopback stands in
for the store; fsspec's own configuration points nowhere, so only those options reach it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# At module level, so that the tiers' reading of the fixture sees the server it starts in any
# collection (imported inside the fixture, it was found only when another file had imported
# the module: run alone, the test ran unmarked and its process was caught).
from testkit.backends import FAKE_AWS_ENV, free_port, loopback_only, start_moto_server

pytest.importorskip("IPython", reason="needs IPython (the notebook extra)")
pytest.importorskip("moto")
pytest.importorskip("s3fs")


@pytest.fixture
def s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """moto's S3 server on loopback, a fresh bucket, and the options that reach it; the
    environment's own S3 endpoint is a closed loopback port."""
    import s3fs

    server, endpoint = start_moto_server(tmp_path / "moto.log")
    for name, value in FAKE_AWS_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    options = {
        "endpoint_url": endpoint,
        "key": FAKE_AWS_ENV["AWS_ACCESS_KEY_ID"],
        "secret": FAKE_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        "skip_instance_cache": True,
    }
    try:
        with loopback_only() as refused:
            raw = s3fs.S3FileSystem(**options)
            bucket = f"nbresume-{uuid.uuid4().hex[:20]}"
            raw.mkdir(bucket)
            yield {"url": f"s3://{bucket}/run", "options": options, "raw": raw}
        assert not refused, f"a test tried to leave loopback: {refused}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def run_cell(shell: Any, code: str) -> Any:
    return shell.run_cell(code, store_history=False)


def test_once_marks_a_cell_through_the_options_of_a_checkpointer_inside_the_run_folder(
    ipshell: Any, s3: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    ipshell.run_line_magic("load_ext", "nbresume")
    ipshell.user_ns.update(url=s3["url"], options=s3["options"], calls=0)
    setup = run_cell(
        ipshell,
        "import nbresume\n"
        "run = nbresume.init('s3-run', dir=url, quiet=True)\n"
        "ckpt = nbresume.Checkpointer(url + '/model', storage_options=options, every=None)",
    )
    assert setup.success, setup.error_in_exec
    cell = "%%nbresume once tokenize\ncalls += 1"

    assert run_cell(ipshell, cell).success
    marker = f"{s3['url']}/once/tokenize.json".removeprefix("s3://")
    assert json.loads(s3["raw"].cat_file(marker))["name"] == "tokenize"
    capsys.readouterr()

    assert run_cell(ipshell, cell).success
    assert ipshell.user_ns["calls"] == 1  # skipped: its marker was read back from the store
    assert "nbresume: skipped 'tokenize'" in capsys.readouterr().out
    assert run_cell(ipshell, "ckpt.close()").success
