"""A stand-in of the Hugging Face Hub's Storage Buckets on loopback, for the real client.

Built from what ``huggingface_hub`` and ``hf_xet`` send (read from their source, versions in
:data:`BUILT_FROM`): the Hub's JSON endpoints for buckets (whoami, bucket info, tree, paths-info,
the ndjson batch of adds and deletes, the resolve HEAD a download starts with) and the xet token
endpoints, which hand the client its content-addressed store (CAS).

The CAS (content-addressed store) is stood in for over HTTP too, at ``/cas``: the xet token
endpoints hand hf_xet that URL and a token for it. It takes the calls hf_xet makes to upload
(a global-dedup query, answered "none"; a xorb grant, answered 404, on which hf_xet uploads the
xorb directly; the xorb; the shard, on v2 then v1) and to download (a reconstruction, on v2
then v1: the file's terms and, for each, a byte range of its xorb to fetch; the range itself).
It keeps xorbs and shards as hf_xet sent them, in ``cas_dir``, and reads from the shards which
xorb chunks make a file, and from the xorbs' chunk headers where each chunk's bytes are;
hf_xet itself decompresses them. Not stood in for: the xorb-grant upload route and the v2
shard and reconstruction APIs (hf_xet falls back from each), global deduplication.

A file the client adds is recorded with the ``xetHash`` the client declares, as the Hub does;
an add whose hash is not in the CAS (its upload did not finish) is reported failed, as the Hub
does. Unknown endpoints answer 404 and are recorded in :attr:`HubStandIn.unknown`.

Faults: :meth:`~HubStandIn.rate_limit` (429 with ``Retry-After``), :meth:`~HubStandIn.hang_batch`
(an upload that never finishes: the client's process can be killed in it), a listing that
reports another ``xet_hash`` (:attr:`~HubStandIn.wrong_hash`), an expired token
(:attr:`~HubStandIn.tokens`).
"""

from __future__ import annotations

import json
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

#: The client versions this stand-in was built from (their endpoints and payloads).
BUILT_FROM = {"huggingface_hub": "2.4.0", "hf_xet": "1.8.0"}

_BUCKET = r"/api/buckets/(?P<owner>[^/]+)/(?P<name>[^/?]+)"
ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    # Asked once a day by huggingface_hub (which AI agent, if any, runs the client); no token.
    ("GET", re.compile(r"/api/agent-harnesses$"), "agent_harnesses"),
    ("GET", re.compile(r"/api/whoami-v2$"), "whoami"),
    ("GET", re.compile(_BUCKET + r"$"), "info"),
    ("GET", re.compile(_BUCKET + r"/tree(?P<path>/.*)?$"), "tree"),
    ("POST", re.compile(_BUCKET + r"/paths-info$"), "paths_info"),
    ("POST", re.compile(_BUCKET + r"/batch$"), "batch"),
    ("GET", re.compile(_BUCKET + r"/xet-(?P<kind>read|write)-token$"), "xet_token"),
    ("HEAD", re.compile(r"/buckets/(?P<owner>[^/]+)/(?P<name>[^/]+)/resolve/(?P<path>.+)$"),
     "resolve"),
    # The content-addressed store (CAS) that the xet token endpoints point hf_xet to.
    ("GET", re.compile(r"/cas/v1/chunks/default/(?P<hash>[0-9a-f]{64})$"), "cas_dedup"),
    ("POST", re.compile(r"/cas/v1/xorb-grants/default/(?P<hash>[0-9a-f]{64})$"), "cas_grant"),
    ("POST", re.compile(r"/cas/v1/xorbs/default/(?P<hash>[0-9a-f]{64})$"), "cas_xorb"),
    ("POST", re.compile(r"/cas/v2/shards$"), "cas_shard_v2"),
    ("POST", re.compile(r"/cas/v1/shards$"), "cas_shard"),
    ("GET", re.compile(r"/cas/v2/reconstructions/(?P<hash>[0-9a-f]{64})$"), "cas_rebuild_v2"),
    ("GET", re.compile(r"/cas/v1/reconstructions/(?P<hash>[0-9a-f]{64})$"), "cas_rebuild"),
    ("GET", re.compile(r"/cas/xorb-bytes/(?P<hash>[0-9a-f]{64})$"), "cas_bytes"),
    ("POST", re.compile(r"/v1/telemetry$"), "cas_telemetry"),
]  # fmt: skip
#: Routes of the CAS, which takes the xet access tokens the token endpoints hand out.
CAS_ROUTES = {route for _, _, route in ROUTES if route.startswith("cas_")}


@dataclass
class Token:
    user: str
    role: str = "write"  # "read" or "write"
    expired: bool = False


@dataclass
class Entry:
    size: int
    xet_hash: str
    mtime: int


#: The ports this process's stand-ins have listened on (:meth:`HubStandIn.start`).
_PORTS: set[int] = set()


@dataclass
class HubStandIn:
    """The Hub on loopback. ``buckets``: bucket id -> {path: Entry}."""

    #: Where the CAS keeps the xorbs and shards hf_xet uploads.
    cas_dir: Path
    tokens: dict[str, Token] = field(default_factory=dict)
    buckets: dict[str, dict[str, Entry]] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)
    #: path -> the xet_hash the listing reports instead of the recorded one.
    wrong_hash: dict[str, str] = field(default_factory=dict)
    _limits: list[tuple[str, int, int]] = field(default_factory=list)
    _hang: str | None = None
    _hang_xorb_after: str | None = None
    _hang_xorb: bool = False
    hung: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_port}"

    def start(self) -> HubStandIn:
        hub = self

        class Handler(_Handler):
            standin = hub

        # Never the port of an earlier stand-in of this process: hf_xet's session (one per
        # process) remembers what it uploaded by the Hub's address, and would send a new
        # stand-in on an old port references to chunks it never received ("xet hash not
        # found" at the batch, in whichever test drew the port again). A port taken before
        # is held open while another is drawn.
        taken_before = []
        while (server := ThreadingHTTPServer(("127.0.0.1", 0), Handler)).server_port in _PORTS:
            taken_before.append(server)
        for old in taken_before:
            old.server_close()
        _PORTS.add(server.server_port)
        self.server = server
        self.server.daemon_threads = True
        # stop() waits for the loop's next poll: the default half second, at every stop.
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def create_bucket(self, bucket_id: str) -> None:
        self.buckets.setdefault(bucket_id, {})

    def rate_limit(self, route: str, *, times: int = 1, retry_after: int = 1) -> None:
        """Answer the next ``times`` calls of ``route`` (e.g. ``"paths_info"``) with 429."""
        self._limits.append((route, times, retry_after))

    def hang_batch(self, path_suffix: str) -> None:
        """Hold the first batch that adds a path ending with ``path_suffix`` until
        :attr:`release` is set (or the client is killed); :attr:`hung` is set meanwhile."""
        self._hang = path_suffix

    def hang_xorb_after(self, path_suffix: str) -> None:
        """Once a batch that adds a path ending with ``path_suffix`` is answered, hold the next
        xorb upload (the bytes themselves, midway through a file's upload) as :meth:`hang_batch`
        holds a batch."""
        self._hang_xorb_after = path_suffix

    def _hold(self) -> None:
        self.hung.set()
        self.release.wait()

    def files(self, bucket_id: str) -> dict[str, Entry]:
        with self.lock:
            return dict(self.buckets.get(bucket_id, {}))


class _Handler(BaseHTTPRequestHandler):
    standin: HubStandIn
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes: with Nagle's algorithm the body waits for the
    # client's delayed ACK of the headers (some 40 ms a request on Linux).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # -- plumbing ----------------------------------------------------------------------------

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _dispatch(self) -> None:
        hub = self.standin
        parts = urlsplit(self.path)
        body = self._body()
        found = [(route, match) for method, pattern, route in ROUTES
                 if method == self.command and (match := pattern.match(parts.path))]  # fmt: skip
        if not found:
            hub.unknown.append(f"{self.command} {parts.path}")
            self._send(404, {"error": f"unknown endpoint {self.command} {parts.path}"})
            return
        route, match = found[0]
        hub.calls.append((route, parts.path))
        with hub.lock:
            for i, (name, times, wait) in enumerate(hub._limits):
                if name == route and times > 0:
                    hub._limits[i] = (name, times - 1, wait)
                    self._send(429, {"error": "rate limited"}, {"Retry-After": str(wait)})
                    return
        if route == "agent_harnesses":
            self._send(200, {"standardEnvVars": [], "harnesses": {}})
            return
        args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
        if route in CAS_ROUTES:
            self._cas(route, args, body)
            return
        token = self._token()
        if token is None:
            return
        getattr(self, "do_" + route)(token, args, parse_qs(parts.query), body)

    do_GET = do_POST = do_HEAD = _dispatch

    def _token(self) -> Token | None:
        header = self.headers.get("Authorization", "")
        token = self.standin.tokens.get(header.removeprefix("Bearer ").strip())
        if token is None or token.expired:
            self._send(401, {"error": "Invalid credentials in Authorization header"},
                       {"X-Error-Code": "InvalidCredentials"})  # fmt: skip
            return None
        return token

    def _bucket(self, args: dict[str, str]) -> dict[str, Entry] | None:
        bucket_id = f"{args['owner']}/{args['name']}"
        bucket = self.standin.buckets.get(bucket_id)
        if bucket is None:
            self._send(404, {"error": f"Bucket {bucket_id} not found"},
                       {"X-Error-Code": "RepoNotFound"})  # fmt: skip
        return bucket

    def _listed(self, path: str, entry: Entry) -> dict[str, Any]:
        digest = self.standin.wrong_hash.get(path, entry.xet_hash)
        return {"type": "file", "path": path, "size": entry.size, "xetHash": digest,
                "mtime": _iso(entry.mtime), "uploadedAt": _iso(entry.mtime)}  # fmt: skip

    # -- the CAS (hf_xet's side) -------------------------------------------------------------

    def _cas(self, route: str, args: dict[str, str], body: bytes) -> None:
        hub = self.standin
        if route == "cas_telemetry":
            self._send(200, {})
            return
        if route in ("cas_dedup", "cas_grant", "cas_shard_v2", "cas_rebuild_v2"):
            # No global deduplication; xorb grants and the v2 shard and reconstruction APIs
            # are not stood in for: 404, on which hf_xet falls back to the v1 calls below.
            self._send(404, {"error": "not found"})
            return
        auth = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        writes = route in ("cas_xorb", "cas_shard")
        # A xorb's bytes are fetched from the URL a reconstruction names, without a token (the
        # real CAS names presigned URLs); every other call carries the xet token.
        allowed = ("xet-write",) if writes else ("xet-write", "xet-read")
        if route != "cas_bytes" and auth not in allowed:
            self._send(401, {"error": "invalid xet token"})
            return
        xorbs, shards = hub.cas_dir / "xorbs", hub.cas_dir / "shards"
        if route == "cas_xorb":
            if hub._hang_xorb:
                hub._hang_xorb = False
                hub._hold()
                return
            xorbs.mkdir(exist_ok=True)
            (xorbs / args["hash"]).write_bytes(body)
            self._send(200, {"was_inserted": True})
        elif route == "cas_shard":
            shards.mkdir(exist_ok=True)
            (shards / f"{len(list(shards.iterdir())):06d}.mdb").write_bytes(body)
            self._send(200, {"result": 1})
        elif route == "cas_rebuild":
            found = _file_terms(hub.cas_dir, args["hash"])
            if found is None:
                self._send(404, {"error": "file not found"})
                return
            self._send(200, _reconstruction(hub.url, hub.cas_dir, found))
        else:  # cas_bytes: a range of a xorb
            data = (xorbs / args["hash"]).read_bytes()
            first, last = (int(n) for n in self.headers["Range"].removeprefix("bytes=").split("-"))
            part = data[first : last + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{first + len(part) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            self.wfile.write(part)

    # -- endpoints ---------------------------------------------------------------------------

    def do_whoami(self, token: Token, args: Any, query: Any, body: bytes) -> None:
        access = {"displayName": "t", "role": token.role}
        auth = {"type": "access_token", "accessToken": access}
        self._send(200, {"type": "user", "name": token.user, "auth": auth})

    def do_info(self, token: Token, args: dict[str, str], query: Any, body: bytes) -> None:
        bucket = self._bucket(args)
        if bucket is not None:
            self._send(200, {"id": f"{args['owner']}/{args['name']}", "private": True,
                             "createdAt": _iso(0), "size": sum(e.size for e in bucket.values()),
                             "totalFiles": len(bucket)})  # fmt: skip

    def do_tree(self, token: Token, args: dict[str, str], query: Any, body: bytes) -> None:
        """As the Hub: the prefix is matched as a string ("run1" finds "run10/..." too, as
        huggingface_hub's own listings note); without ``recursive``, files and folders one
        level below the prefix's last slash; a prefix that matches nothing lists as empty."""
        bucket = self._bucket(args)
        if bucket is None:
            return
        prefix = args.get("path", "").lstrip("/")
        base = prefix[: prefix.rfind("/") + 1]  # the folder the prefix names entries of
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        out: list[dict[str, Any]] = []
        folders: set[str] = set()
        with self.standin.lock:
            for path, entry in sorted(bucket.items()):
                if not path.startswith(prefix):
                    continue
                rest = path[len(base) :]
                if recursive or "/" not in rest:
                    out.append(self._listed(path, entry))
                else:
                    folders.add(base + rest.split("/", 1)[0])
        out += [{"type": "directory", "path": f, "uploadedAt": _iso(0)} for f in sorted(folders)]
        self._send(200, out)

    def do_paths_info(self, token: Token, args: dict[str, str], query: Any, body: bytes) -> None:
        bucket = self._bucket(args)
        if bucket is None:
            return
        paths = json.loads(body)["paths"]
        with self.standin.lock:
            found = [self._listed(p, bucket[p]) for p in paths if p in bucket]
        self._send(200, found)

    def do_batch(self, token: Token, args: dict[str, str], query: Any, body: bytes) -> None:
        hub = self.standin
        bucket = self._bucket(args)
        if bucket is None:
            return
        if token.role != "write":
            self._send(403, {"error": "You don't have write access to this bucket"})
            return
        ops = [json.loads(line) for line in body.splitlines() if line.strip()]
        if hub._hang and any(o["path"].endswith(hub._hang) for o in ops if o["type"] == "addFile"):
            hub._hang = None
            hub._hold()
            return  # the connection is dropped: the client never hears back
        failed = []
        with hub.lock:
            for op in ops:
                if op["type"] == "addFile":
                    size = _cas_size(hub.cas_dir, op["xetHash"])
                    if size is None:
                        failed.append({"path": op["path"], "error": "xet hash not found"})
                        continue
                    bucket[op["path"]] = Entry(size, op["xetHash"], int(op.get("mtime") or 0))
                elif op["type"] == "deleteFile":
                    bucket.pop(op["path"], None)
                else:
                    failed.append({"path": op.get("path"), "error": "not supported here"})
        after = hub._hang_xorb_after
        if after and not failed and any(o["path"].endswith(after) for o in ops):
            hub._hang_xorb_after, hub._hang_xorb = None, True
        self._send(422 if failed and len(failed) == len(ops) else 200, {"failed": failed})

    def do_xet_token(self, token: Token, args: dict[str, str], query: Any, body: bytes) -> None:
        if self._bucket(args) is None:
            return
        if args["kind"] == "write" and token.role != "write":
            self._send(403, {"error": "You don't have write access to this bucket"})
            return
        cas = f"{self.standin.url}/cas"
        expires = int(time.time()) + 3600
        self._send(200, {"accessToken": "xet-" + args["kind"], "exp": expires, "casUrl": cas},
                   {"X-Xet-Cas-Url": cas, "X-Xet-Access-Token": "xet-" + args["kind"],
                    "X-Xet-Token-Expiration": str(expires)})  # fmt: skip

    def do_resolve(self, token: Token, args: dict[str, str], query: Any, body: bytes) -> None:
        bucket = self._bucket(args)
        if bucket is None:
            return
        path = args["path"]
        with self.standin.lock:
            entry = bucket.get(path)
        if entry is None:
            self._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            return
        refresh = f"{self.standin.url}/api/buckets/{args['owner']}/{args['name']}/xet-read-token"
        self._send(200, None, {"X-Xet-Hash": entry.xet_hash, "X-Xet-Refresh-Route": refresh,
                               "X-Linked-Size": str(entry.size)})  # fmt: skip


def _iso(stamp: int) -> str:
    """A time as the Hub writes it (``2026-02-06T17:37:57.000Z``); ``stamp`` in s or ms."""
    seconds = stamp / 1000 if stamp > 1e11 else stamp
    return (
        datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    )


def _file_terms(cas_dir: Path, xet_hash: str) -> list[tuple[str, int, int, int]] | None:
    """The file ``xet_hash`` as the CAS's shards register it: its terms (xorb hash, unpacked
    bytes, first chunk, end chunk); ``None`` when no shard registers it.

    A shard starts with a 48-byte header (tag, version, footer size); its file-info section
    has, per file, a 48-byte header (hash as four little-endian 64-bit words, flags, entry
    count, padding), the entries (48 bytes: xorb hash, flags, unpacked bytes, chunk range),
    as many verification entries when flag bit 31 is set, one metadata entry when bit 30 is;
    an all-0xff hash ends the section.
    """
    for shard in sorted((cas_dir / "shards").glob("*.mdb")):
        data = shard.read_bytes()
        at = 48
        while at + 48 <= len(data):
            file_hash, (flags, count) = data[at : at + 32], struct.unpack_from("<II", data, at + 32)
            if file_hash == b"\xff" * 32:
                break
            entries = [data[at + 48 * (1 + i) : at + 48 * (2 + i)] for i in range(count)]
            at += 48 * (1 + count + (count if flags & 0x80000000 else 0) + (flags >> 30 & 1))
            if _hex(file_hash) == xet_hash:
                return [(_hex(e[:32]), *struct.unpack_from("<III", e, 36)) for e in entries]
    return None


def _chunk_offsets(xorb: bytes, count: int) -> list[int]:
    """Where each of the first ``count`` chunks of a xorb starts, and where the last ends: each
    chunk is an 8-byte header (version, compressed size in 3 bytes, scheme, size in 3 bytes)
    and its compressed bytes, which hf_xet itself decompresses."""
    offsets, at = [0], 0
    for _ in range(count):
        at += 8 + int.from_bytes(xorb[at + 1 : at + 4], "little")
        offsets.append(at)
    return offsets


def _reconstruction(
    url: str, cas_dir: Path, terms: list[tuple[str, int, int, int]]
) -> dict[str, Any]:
    """The v1 reconstruction of a whole file: its terms, and where to fetch each term's
    chunks (a byte range of its xorb; the range's end inclusive, as HTTP's)."""
    fetch: dict[str, list[dict[str, Any]]] = {}
    out = []
    for xorb, unpacked, start, end in terms:
        offsets = _chunk_offsets((cas_dir / "xorbs" / xorb).read_bytes(), end)
        out.append({"hash": xorb, "unpacked_length": unpacked,
                    "range": {"start": start, "end": end}})  # fmt: skip
        fetch.setdefault(xorb, []).append({
            "range": {"start": start, "end": end},
            "url": f"{url}/cas/xorb-bytes/{xorb}",
            "url_range": {"start": offsets[start], "end": offsets[end] - 1},
        })  # fmt: skip
    return {"offset_into_first_range": 0, "terms": out, "fetch_info": fetch}


def _cas_size(cas_dir: Path, xet_hash: str) -> int | None:
    """The size of the file ``xet_hash`` as the CAS's shards register it, when every xorb it
    is made of is there too; ``None`` when the CAS does not hold it (an unfinished upload)."""
    terms = _file_terms(cas_dir, xet_hash)
    if terms is None or not all((cas_dir / "xorbs" / t[0]).is_file() for t in terms):
        return None
    return sum(unpacked for _, unpacked, _, _ in terms)


def _hex(raw: bytes) -> str:
    """A xet hash as its hex string: four little-endian 64-bit words."""
    return "".join(raw[i : i + 8][::-1].hex() for i in range(0, 32, 8))
