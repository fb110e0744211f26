"""Google's side, on loopback: the Drive v3 REST endpoints.

Only what a client of the real ``google-api-python-client`` needs to ask Drive whether a file
is there: ``files.list`` (with the ``q`` query language for names, parents, trash and MIME
type, ``fields`` partial responses and paging), ``files.get``, ``files.delete`` (permanent),
``files.emptyTrash``, ``about.get`` (the storage quota). Responses follow Drive's JSON: int64
values such as ``size`` are strings, only the fields asked for are returned (by default
``kind, id, name, mimeType``), trashed files are listed unless the query excludes them, and
errors carry Drive's error document. Anything else is refused with 400 rather than guessed.

Run it standalone: ``python -m colab_standin.server CLOUD_DIR [PORT]``.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from colab_standin.cloud import FOLDER_MIME, Cloud, Item

SERVICE = "/drive/v3/"


class DriveApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, location: str = "") -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.location = code, reason, message, location

    def document(self) -> dict[str, Any]:
        error: dict[str, Any] = {"domain": "global", "reason": self.reason, "message": self.message}
        if self.location:
            error.update(locationType="parameter", location=self.location)
        return {"error": {"code": self.code, "message": self.message, "errors": [error]}}


# -- the query language (the subset Drive documents and clients use to find by name) -----------

_TOKEN = re.compile(r"\s*(?:('(?:[^'\\]|\\.)*')|(!=|=)|([A-Za-z]+))")


def _tokens(q: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    q = q.strip()
    while pos < len(q):
        match = _TOKEN.match(q, pos)
        if match is None:
            raise _invalid_q(q)
        string, op, word = match.groups()
        if string is not None:
            out.append(("str", re.sub(r"\\(.)", r"\1", string[1:-1])))
        elif op is not None:
            out.append(("op", op))
        else:
            out.append(("word", word))
        pos = match.end()
    return out


def _invalid_q(q: str) -> DriveApiError:
    return DriveApiError(400, "invalid", f"Invalid Value: {q}", "q")


def parse_query(q: str, cloud: Cloud) -> Callable[[Item], bool]:
    """A predicate for ``q``: terms joined by ``and`` (the stand-in supports no ``or``/``not``)."""
    tokens = _tokens(q)
    terms: list[Callable[[Item], bool]] = []
    i = 0
    while i < len(tokens):
        kind, value = tokens[i]
        if kind == "str" and tokens[i + 1 : i + 3] == [("word", "in"), ("word", "parents")]:
            parent = cloud.resolve(value)
            terms.append(lambda item, parent=parent: item.parent == parent)
            i += 3
        elif kind == "word" and value in ("name", "mimeType") and i + 2 < len(tokens):
            (op_kind, op), (arg_kind, arg) = tokens[i + 1], tokens[i + 2]
            if op_kind != "op" or arg_kind != "str":
                raise _invalid_q(q)
            attr = "name" if value == "name" else "mime"
            if op == "=":
                terms.append(lambda item, a=attr, v=arg: getattr(item, a) == v)
            else:
                terms.append(lambda item, a=attr, v=arg: getattr(item, a) != v)
            i += 3
        elif kind == "word" and value == "trashed" and i + 2 < len(tokens):
            (op_kind, op), (arg_kind, arg) = tokens[i + 1], tokens[i + 2]
            if op_kind != "op" or arg_kind != "word" or arg not in ("true", "false"):
                raise _invalid_q(q)
            wanted = (arg == "true") == (op == "=")
            terms.append(lambda item, w=wanted: item.trashed == w)
            i += 3
        else:
            raise _invalid_q(q)
        if i < len(tokens):
            if tokens[i] != ("word", "and") or i + 1 == len(tokens):
                raise _invalid_q(q)
            i += 1
    return lambda item: all(term(item) for term in terms)


# -- partial responses ------------------------------------------------------------------------


_FIELD = re.compile(r"\s*([A-Za-z0-9_*]+(?:/[A-Za-z0-9_*]+)*)\s*")


def parse_fields(text: str) -> dict[str, Any]:
    """``"nextPageToken, files(id)"`` -> ``{"nextPageToken": {}, "files": {"id": {}}}``."""
    pos = 0

    def invalid() -> DriveApiError:
        return DriveApiError(400, "invalidParameter", f"Invalid field selection {text}", "fields")

    def selection() -> dict[str, Any]:
        nonlocal pos
        tree: dict[str, Any] = {}
        while True:
            match = _FIELD.match(text, pos)
            if match is None:
                raise invalid()
            pos = match.end()
            node = tree
            for part in match.group(1).split("/"):
                node = node.setdefault(part, {})
            if text[pos : pos + 1] == "(":
                pos += 1
                node.update(selection())
                if text[pos : pos + 1] != ")":
                    raise invalid()
                pos += 1
                pos = len(text) - len(text[pos:].lstrip())
            if text[pos : pos + 1] != ",":
                return tree
            pos += 1

    tree = selection()
    if pos != len(text):
        raise invalid()
    return tree


def select(value: Any, tree: dict[str, Any]) -> Any:
    if not tree or "*" in tree:
        return value
    if isinstance(value, list):
        return [select(v, tree) for v in value]
    if isinstance(value, dict):
        return {k: select(value[k], sub) for k, sub in tree.items() if k in value}
    return value


def file_resource(item: Item, cloud: Cloud) -> dict[str, Any]:
    resource: dict[str, Any] = {
        "kind": "drive#file",
        "id": item.id,
        "name": item.name,
        "mimeType": item.mime,
        "trashed": item.trashed,
        "explicitlyTrashed": item.explicitly_trashed,
        "modifiedTime": item.modified,
        "quotaBytesUsed": str(item.size),
    }
    if item.parent is not None:
        resource["parents"] = [item.parent]
    if item.mime != FOLDER_MIME:
        resource["size"] = str(item.size)
        resource["md5Checksum"] = item.md5
    return resource


DEFAULT_FILE_FIELDS = {"kind": {}, "id": {}, "name": {}, "mimeType": {}}


# -- the server ------------------------------------------------------------------------------


class DriveServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, cloud_root: str, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.cloud = Cloud(cloud_root)
        self.requests: list[tuple[str, str]] = []  # (method, path) of every Drive call
        self._thread: threading.Thread | None = None
        # Requests being answered, and whether the server is going away: stop() lets the
        # first finish before it closes the cloud, and later ones are told the service is
        # unavailable (as Drive would), rather than reaching a closed database.
        self._busy = 0
        self._stopping = False
        self._idle = threading.Condition()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client killed mid-request (a VM that went away) is no error of the server's.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> DriveServer:
        # stop() waits for the loop's next poll: the default half second, at every stop.
        self._thread = threading.Thread(
            target=self.serve_forever, args=(0.05,), name="drive-api", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        with self._idle:
            self._stopping = True
            self._idle.wait_for(lambda: self._busy == 0, timeout=10.0)
        self.cloud.close()

    def answering(self) -> bool:
        """Whether a request may be answered now (then :meth:`answered` must follow)."""
        with self._idle:
            if self._stopping:
                return False
            self._busy += 1
            return True

    def answered(self) -> None:
        with self._idle:
            self._busy -= 1
            self._idle.notify_all()


class _Handler(BaseHTTPRequestHandler):
    server: DriveServer
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes, and with Nagle's algorithm the body waits for the
    # client's delayed ACK of the headers (some 40 ms a request on Linux). Left so: with that
    # wait gone, tests/frameworks/test_lightning_drive.py ends with folders on Drive that an
    # uninterrupted run does not leave (empty files of a killed VM's uploads beside a resumed
    # run's; the resumed run's last save still uploading when it ends), a difference to be
    # understood before the stand-in answers faster.

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, document: Any = None) -> None:
        body = b"" if document is None else json.dumps(document).encode()
        self.send_response(code)
        if document is not None:
            self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _dispatch(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        params = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if not self.server.answering():
            self._send(503, DriveApiError(503, "backendError", "Service unavailable").document())
            return
        try:
            if not url.path.startswith(SERVICE):
                raise DriveApiError(404, "notFound", f"Not Found: {url.path}")
            self._authorize()
            self.server.requests.append((method, url.path))
            code, document = self._drive(method, url.path[len(SERVICE) :], params)
            self._send(code, document)
        except DriveApiError as exc:
            self._send(exc.code, exc.document())
        finally:
            self.server.answered()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _authorize(self) -> None:
        header = self.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or header[7:] != self.server.cloud.access_token:
            raise DriveApiError(
                401,
                "authError",
                "Request had invalid authentication credentials. Expected OAuth 2 access token",
                "Authorization",
            )

    def _drive(self, method: str, path: str, params: dict[str, str]) -> tuple[int, Any]:
        cloud = self.server.cloud
        fields = parse_fields(params["fields"]) if "fields" in params else None
        if path == "about" and method == "GET":
            if fields is None:
                raise DriveApiError(
                    400, "required", "The 'fields' parameter is required for this method.",
                    "fields",
                )  # fmt: skip
            used, trash = cloud.usage()
            about = {
                "kind": "drive#about",
                "storageQuota": {
                    "limit": str(cloud.quota_bytes),
                    "usage": str(used),
                    "usageInDrive": str(used),
                    "usageInDriveTrash": str(trash),
                },
            }
            return 200, select(about, fields)
        if path == "files" and method == "GET":
            return 200, self._list(params, fields)
        if path == "files/trash" and method == "DELETE":
            cloud.empty_trash()
            return 204, None
        match = re.fullmatch(r"files/([^/]+)", path)
        if match is None:
            raise DriveApiError(400, "badRequest", f"the stand-in does not serve {method} {path}")
        file_id = urllib.parse.unquote(match.group(1))
        item = cloud.get(file_id)
        if item is None:
            raise DriveApiError(404, "notFound", f"File not found: {file_id}.", "fileId")
        if method == "GET":
            if params.get("alt", "json") != "json":
                raise DriveApiError(400, "badRequest", "the stand-in serves no file contents")
            return 200, select(file_resource(item, cloud), fields or DEFAULT_FILE_FIELDS)
        if method == "DELETE":
            if item.parent is None:
                raise DriveApiError(403, "insufficientFilePermissions", "The root folder")
            cloud.delete(item.id)
            return 204, None
        raise DriveApiError(400, "badRequest", f"the stand-in does not serve {method} {path}")

    def _list(self, params: dict[str, str], fields: dict[str, Any] | None) -> dict[str, Any]:
        cloud = self.server.cloud
        for unsupported in ("orderBy", "corpora", "driveId"):
            if unsupported in params:
                raise DriveApiError(
                    400, "badRequest", f"the stand-in does not support {unsupported}"
                )
        keep = parse_query(params["q"], cloud) if params.get("q") else (lambda item: True)
        items = [i for i in cloud.items() if keep(i)]
        size = int(params.get("pageSize") or 100)
        if not 1 <= size <= 1000:
            raise DriveApiError(400, "invalid", f"Invalid Value: {size}", "pageSize")
        start = int(params.get("pageToken") or 0)
        page = items[start : start + size]
        document: dict[str, Any] = {
            "kind": "drive#fileList",
            "incompleteSearch": False,
            "files": [file_resource(i, cloud) for i in page],
        }
        if start + size < len(items):
            document["nextPageToken"] = str(start + size)
        if fields is None:
            fields = {"kind": {}, "incompleteSearch": {}, "nextPageToken": {}, "files": {}}
            fields["files"] = DEFAULT_FILE_FIELDS
        return dict(select(document, fields))


def main(argv: list[str]) -> None:
    server = DriveServer(argv[0], int(argv[1]) if len(argv) > 1 else 0)
    print(server.url, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
