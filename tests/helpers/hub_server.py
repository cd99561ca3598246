"""A stand-in Hugging Face Hub on 127.0.0.1: serves model and dataset repositories to the real client, takes uploads.

The Hub cannot be reached from the machines this project is built on, so tests that talk to it start this server
and point the real ``huggingface_hub`` client at it with ``HF_ENDPOINT`` (in a subprocess: the client reads
``HF_ENDPOINT`` once, at import time). The server implements exactly what ``snapshot_download`` and
``hf_hub_download`` (hence ``transformers``' ``from_pretrained``), ``HfFileSystem`` (hence ``datasets``'
``load_dataset(repo_id, streaming=True)``), ``create_repo``, ``upload_file``, ``upload_folder`` and
``create_commit`` use, read from huggingface_hub 2.4 (``hf_api.py``, ``file_download.py``, ``_commit_api.py``,
``_upload_pipeline.py``, ``hf_file_system.py``, ``_snapshot_download.py``, ``utils/_http.py``) and datasets 5.2
(``load.py``). ``{type}`` is ``models`` or ``datasets``; a dataset's files live under ``/datasets/``:

    GET  /api/{type}/{repo_id}                         model_info / dataset_info: ``sha`` (commit) and ``siblings``
    GET  /api/{type}/{repo_id}/revision/{revision}     the same at a revision (what repo_info asks)
    GET  /api/{type}/{repo_id}/tree/{revision}[/{path}]?recursive=...   list_repo_tree, one page, no ``Link``
    POST /api/{type}/{repo_id}/paths-info/{revision}   get_paths_info (form ``paths=...``): the entries that exist
    HEAD /[datasets/]{repo_id}/resolve/{revision}/{filename}      file metadata: X-Repo-Commit, ETag, Content-Length
    GET  /[datasets/]{repo_id}/resolve/{revision}/{filename}      the file, or the bytes a ``Range`` asks for
    POST /api/repos/create                             create_repo (``409`` if it exists, which exist_ok accepts)
    POST /api/{type}/{repo_id}/preupload/{revision}    the upload mode of each file: always ``regular``
    POST /api/{type}/{repo_id}/commit/{revision}       create_commit: NDJSON, files inline in base64
    GET  /api/whoami-v2                                whoami: who the bearer token belongs to (``StandInHub.tokens``)

Files that the Hub stores with git-LFS (``*.safetensors``, ``*.parquet``, ...) are answered as the Hub answers
them: ``302`` to a second server standing in for the CDN (another port of 127.0.0.1, so another origin, as
the real CDN is another host), with ``X-Linked-Etag`` (sha256) and ``X-Linked-Size``; the client then
downloads from the ``Location``. Other files are answered directly, with their git blob sha1 as ``ETag``.
Both answer ``Range: bytes=A-B``, ``bytes=A-`` and ``bytes=-N`` (HfFileSystem reads parquet footers and row
groups so).

Uploads: the preupload answer says ``regular`` for every file, so the client sends each file's bytes inline in
the commit (as it does for small text files) and never starts an LFS or Xet transfer, which would need
storage servers this stand-in does not have. The preupload answer also gives the ``oid`` (git blob sha1) of a
file already in the repository, so the client leaves unchanged files out of the commit, as with the Hub. A
commit is applied to the repository's folder at once; it is recorded in ``StandInHub.commits``. No token is
checked but for a private repository (``add_repo(..., private=True)``): without a token of ``tokens`` it is a
``401`` with ``X-Error-Code: RepoNotFound``, as the Hub answers.

Errors carry the headers ``hf_raise_for_status`` turns into typed errors: ``X-Error-Code: RepoNotFound``
(RepositoryNotFoundError), ``RevisionNotFound`` (RevisionNotFoundError) and ``EntryNotFound``
(RemoteEntryNotFoundError, with ``X-Repo-Commit`` so the client can cache the file's absence). Revisions are
``main`` and the repository's one commit, a hash of its files: re-adding a repository makes a new commit.

Model repositories are folders ``root/<owner>/<name>/<files>``, dataset repositories
``root/datasets/<owner>/<name>/<files>`` (the Hub reserves the name ``datasets``: no owner has it); ``add_repo``
copies a folder there. The fixture ``hub_server`` (registered in conftest.py) starts a server per test and stops
it at teardown.

Tokens: ``whoami-v2`` answers from ``StandInHub.tokens`` (token -> the JSON the Hub answers), filled by
``add_user_token``, ``add_org_token`` and ``add_app_token`` with the fields the Hub sends (``type`` ``user`` / ``org``
/ ``app``, ``name``, ``orgs[].name``, ``auth.type`` ``access_token`` / ``app_token`` / ``app_token_as_user``,
``auth.accessToken.displayName`` and ``role``), after huggingface.js's ``whoAmI`` types (hub/src/lib/who-am-i.ts).
An unknown token, or none, is a ``401`` as the Hub gives it. The other endpoints still check no token.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

logger = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the file types the Hub's default .gitattributes sends to git-LFS (hence through the CDN)
LFS_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".npy",
    ".npz",
    ".parquet",
    ".arrow",
    ".pkl",
    ".pickle",
    ".joblib",
    ".model",
    ".tflite",
    ".zip",
    ".gz",
    ".tar",
    ".tgz",
    ".zst",
    ".xz",
    ".7z",
    ".bz2",
)
CREATED_AT = "2021-12-06T00:00:00.000Z"
REPO_TYPES = ("model", "dataset")


class RepoFile:
    """One file of a served repository, with the hashes the Hub reports for it."""

    def __init__(self, path_in_repo: str, local_path: str):
        self.path, self.local_path = path_in_repo, local_path
        with open(local_path, "rb") as f:
            content = f.read()
        self.size = len(content)
        self.sha256 = hashlib.sha256(content).hexdigest()
        self.content_oid = _git_blob_id(content)  # what the client compares with before uploading it again
        self.is_lfs = path_in_repo.endswith(LFS_SUFFIXES)
        if self.is_lfs:  # git stores a pointer; the Hub reports the pointer's blob id and the content's sha256
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n"
            self.pointer_size, self.oid = len(pointer), _git_blob_id(pointer.encode())
        else:
            self.pointer_size, self.oid = None, self.content_oid

    def tree_entry(self) -> dict:
        entry = dict(type="file", oid=self.oid, size=self.size, path=self.path)
        if self.is_lfs:
            entry["lfs"] = dict(oid=self.sha256, size=self.size, pointerSize=self.pointer_size)
        return entry


def _git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class Repo:
    """A snapshot of a folder: its files and the commit hash they make."""

    def __init__(self, repo_id: str, folder: str, repo_type: str = "model"):
        self.repo_id, self.repo_type, self.files = repo_id, repo_type, {}
        for parent, dirs, names in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != ".git")
            for name in sorted(names):
                local_path = os.path.join(parent, name)
                path_in_repo = os.path.relpath(local_path, folder).replace(os.sep, "/")
                self.files[path_in_repo] = RepoFile(path_in_repo, local_path)
        listing = "".join(f"{path}\0{file.oid}\n" for path, file in sorted(self.files.items()))
        name = repo_id if repo_type == "model" else f"{repo_type}s/{repo_id}"  # the same files in a model repo
        self.commit = hashlib.sha1(f"{name}\n{listing}".encode()).hexdigest()

    def info(self, with_blobs: bool) -> dict:
        siblings = []
        for file in self.files.values():
            sibling = dict(rfilename=file.path)
            if with_blobs:
                sibling.update(size=file.size, blobId=file.oid)
                if file.is_lfs:
                    sibling["lfs"] = dict(sha256=file.sha256, size=file.size, pointerSize=file.pointer_size)
            siblings.append(sibling)
        owner = self.repo_id.split("/")[0]
        info = {
            "_id": self.commit[:24],
            "id": self.repo_id,
            "author": owner,
            "sha": self.commit,
            "lastModified": CREATED_AT,
            "createdAt": CREATED_AT,
            "private": False,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        if self.repo_type == "model":
            info["modelId"] = self.repo_id
        return info

    def tree(self, path: str, recursive: bool) -> list[dict] | None:
        """Entries under ``path`` ("" for the root) as list_repo_tree expects them, or None if no such folder."""
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        entries, folders = [], {}
        for file in self.files.values():
            if not file.path.startswith(prefix):
                continue
            rest = file.path[len(prefix) :].split("/")
            for depth in range(1, len(rest)):  # the folders on the way, once each
                if depth > 1 and not recursive:
                    break
                folder = prefix + "/".join(rest[:depth])
                folders.setdefault(folder, []).append(file.oid)
            if recursive or len(rest) == 1:
                entries.append(file.tree_entry())
        if prefix and not entries and not folders:
            return None
        for folder, oids in sorted(folders.items()):
            entries.append(_folder_entry(folder, oids))
        return entries

    def path_info(self, path: str) -> dict | None:
        """The tree entry of the file or folder ``path``, as get_paths_info expects it, or None if there is none."""
        path = path.strip("/")
        if path in self.files:
            return self.files[path].tree_entry()
        oids = [file.oid for file in self.files.values() if file.path.startswith(path + "/")]
        return _folder_entry(path, oids) if path and oids else None


def _folder_entry(path: str, oids: list[str]) -> dict:
    return dict(type="directory", oid=hashlib.sha1("".join(oids).encode()).hexdigest(), size=0, path=path)


class StandInHub:
    """A Hub API on 127.0.0.1 (plus a CDN on another port) serving the repositories under ``root``.

    :param root: the folder of repositories, laid out as ``root/<owner>/<name>/<files>`` (models) and
      ``root/datasets/<owner>/<name>/<files>`` (datasets)
    """

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.requests: list[str] = []  # "METHOD /path?query" as received; the CDN's as "METHOD cdn:/path"
        self.ranges: list[str] = []  # "METHOD /path bytes=A-B" (or cdn:/path) for each request with a Range header
        self.unserved: list[str] = []  # requests for endpoints this stand-in does not implement (answered 404)
        # every commit received: dict(repo_type, repo_id, summary, added=[paths], deleted=[paths], commit=oid)
        self.commits: list[dict] = []
        self._snapshots: dict[tuple, Repo] = {}  # (repo_type, repo_id) -> the repository as served now
        self.tokens: dict[str, dict] = {}  # bearer token -> the whoami-v2 answer (add_user_token, ...)
        self.private: set = set()  # (repo_type, repo_id) of private repositories: answered only with a known token
        self._lock = threading.Lock()
        self._hub = self._start_server(is_cdn=False)
        self._cdn = self._start_server(is_cdn=True)
        self.endpoint = f"http://127.0.0.1:{self._hub.server_address[1]}"
        self.cdn_endpoint = f"http://127.0.0.1:{self._cdn.server_address[1]}"
        logger.info(f"stand-in Hub at {self.endpoint} serving {self.root}")

    def add_repo(self, repo_id: str, folder: str, repo_type: str = "model", private: bool = False) -> str:
        """Serve a copy of ``folder`` as the repository ``repo_id`` (replacing it); returns its commit hash.

        :param repo_id: ``owner/name``
        :param folder: a local folder; its files are copied, so later changes to it are not served
        :param repo_type: ``"model"`` or ``"dataset"``
        :param private: answer it only to a request with a token of ``tokens``; to others, the Hub's ``401`` with
          ``X-Error-Code: RepoNotFound`` (it does not tell a private repository from a missing one)
        """
        target = self.folder(repo_id, repo_type)
        with self._lock:
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(folder, target, ignore=shutil.ignore_patterns(".git"))
            self._snapshots.pop((repo_type, repo_id), None)
            (self.private.add if private else self.private.discard)((repo_type, repo_id))
        return self.repo(repo_id, repo_type).commit

    def folder(self, repo_id: str, repo_type: str = "model") -> str:
        """The local folder that holds (or would hold) the files of the repository ``repo_id``."""
        if repo_type not in REPO_TYPES:
            raise ValueError(
                f"the stand-in Hub serves repositories of type {' or '.join(REPO_TYPES)}, not {repo_type!r}"
            )
        owner, name = _split_repo_id(repo_id)
        return os.path.join(self.root, *(["datasets"] if repo_type == "dataset" else []), owner, name)

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo | None:
        """The repository ``repo_id`` as served now, or None; a folder is hashed once, when first asked for."""
        try:
            folder = self.folder(repo_id, repo_type)
        except ValueError:
            return None
        with self._lock:
            key = (repo_type, repo_id)
            if key not in self._snapshots and os.path.isdir(folder):
                self._snapshots[key] = Repo(repo_id, folder, repo_type)
            return self._snapshots.get(key)

    def create_repo(self, repo_id: str, repo_type: str = "model") -> bool:
        """Create an empty repository; returns False (and changes nothing) if it exists already."""
        folder = self.folder(repo_id, repo_type)
        with self._lock:
            if os.path.isdir(folder):
                return False
            os.makedirs(folder)
            self._snapshots.pop((repo_type, repo_id), None)
        return True

    def apply_commit(
        self, repo_id: str, repo_type: str, summary: str, added: dict[str, bytes], deleted: list[str]
    ) -> str:
        """Write ``added`` ({path: content}) into the repository and remove ``deleted`` paths; returns the new commit.

        The commit is validated whole before anything is written, so a bad one changes nothing.
        """
        folder = self.folder(repo_id, repo_type)
        for path in list(added) + list(deleted):
            _check_path_in_repo(path)
        with self._lock:
            for path in deleted:
                target = os.path.join(folder, *path.strip("/").split("/"))
                if os.path.isdir(target):
                    shutil.rmtree(target)
                elif os.path.exists(target):
                    os.remove(target)
            for path, content in added.items():
                target = os.path.join(folder, *path.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target + ".uploading", "wb") as f:
                    f.write(content)
                os.replace(target + ".uploading", target)
            self._snapshots.pop((repo_type, repo_id), None)
        commit = self.repo(repo_id, repo_type).commit
        self.commits.append(
            dict(
                repo_type=repo_type,
                repo_id=repo_id,
                summary=summary,
                added=sorted(added),
                deleted=sorted(deleted),
                commit=commit,
            )
        )
        return commit

    def add_user_token(
        self, username: str, orgs: Sequence[str] = (), role: str = "read", token: str | None = None
    ) -> str:
        """A user access token of ``username`` (as made at huggingface.co/settings/tokens), a member of ``orgs``.

        :param role: the token's permission: ``read``, ``write`` or ``fineGrained``
        :param token: the token's text (by default a new ``hf_...`` one)
        :returns: the token, to send as ``Authorization: Bearer <token>``
        """
        answer = dict(
            _entity("user", username),
            email=f"{username}@example.com",
            emailVerified=True,
            isPro=False,
            orgs=[dict(_entity("org", org), roleInOrg="read") for org in orgs],
            auth=dict(
                type="access_token", accessToken=dict(displayName=f"{username}-token", role=role, createdAt=CREATED_AT)
            ),
        )
        return self._add_token(answer, token, "hf_")

    def add_org_token(self, organization: str, token: str | None = None) -> str:
        """An organization's own token (the Hub's older ``api_org_...`` tokens): whoami says ``type: org``."""
        answer = dict(
            _entity("org", organization),
            auth=dict(
                type="access_token", accessToken=dict(displayName="org-token", role="read", createdAt=CREATED_AT)
            ),
        )
        return self._add_token(answer, token, "api_org_")

    def add_app_token(
        self, app: str, as_user: str | None = None, orgs: Sequence[str] = (), token: str | None = None
    ) -> str:
        """An OAuth app's token: its own (``type: app``, ``auth.type: app_token``), or, with ``as_user``, acting for
        that user (the user's identity and ``orgs``, ``auth.type: app_token_as_user``)."""
        if as_user is None:
            answer = dict(
                id=_entity_id(app),
                type="app",
                name=app,
                scope=dict(entities=[], role="read"),
                auth=dict(type="app_token"),
            )
        else:
            answer = dict(
                _entity("user", as_user),
                email=f"{as_user}@example.com",
                emailVerified=True,
                isPro=False,
                orgs=[dict(_entity("org", org), roleInOrg="read") for org in orgs],
                auth=dict(type="app_token_as_user"),
            )
        return self._add_token(answer, token, "hf_oauth_")

    def _add_token(self, answer: dict, token: str | None, prefix: str) -> str:
        with self._lock:
            token = token or f"{prefix}{hashlib.sha1(f'{len(self.tokens)}:{answer}'.encode()).hexdigest()[:30]}"
            self.tokens[token] = answer
        return token

    def blob(self, sha256: str) -> str | None:
        """The local path of an LFS file served now with this sha256 (what the CDN serves), or None."""
        with self._lock:
            for repo in self._snapshots.values():
                for file in repo.files.values():
                    if file.is_lfs and file.sha256 == sha256:
                        return file.local_path
        return None

    def run_python(
        self, code: str, timeout: float = 120, hf_home: str | None = None, env: dict[str, str] | None = None
    ) -> str:
        """Run ``code`` in a fresh Python process whose huggingface_hub talks to this server; returns its stdout.

        See :func:`run_python_with_hub`.
        """
        return run_python_with_hub(code, self.endpoint, timeout=timeout, hf_home=hf_home, env=env)

    def stop(self):
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.stop()

    def _start_server(self, is_cdn: bool) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _CdnHandler if is_cdn else _HubHandler)
        server.daemon_threads = True  # a client that hangs up mid-download never blocks shutdown
        server.hub = self
        # a short poll interval: shutdown() waits for the loop to notice, up to one interval
        threading.Thread(
            target=server.serve_forever,
            kwargs=dict(poll_interval=0.05),
            name=f"stand-in-{'cdn' if is_cdn else 'hub'}",
            daemon=True,
        ).start()
        return server


def _entity_id(name: str) -> str:
    # the Hub's ids are 24 hex digits; a name with a lone surrogate (a hostile answer) still gets one
    return hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _entity(kind: str, name: str) -> dict:
    """The fields whoami-v2 gives a user or an organization."""
    return dict(
        id=_entity_id(name),
        type=kind,
        name=name,
        fullname=name.title(),
        email=None,
        canPay=False,
        avatarUrl=f"/avatars/{_entity_id(name)}.svg",
        periodEnd=None,
    )


def _split_repo_id(repo_id: str):
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(part in (".", "..") for part in parts) or parts[0] == "datasets":
        raise ValueError(f"the stand-in Hub serves repositories 'owner/name', not {repo_id!r}")
    return parts


def _check_path_in_repo(path: str):
    parts = path.strip("/").split("/")
    if not path or path.startswith("/") or any(part in ("", ".", "..", ".git") for part in parts):
        raise ValueError(f"{path!r} is not a path the stand-in Hub stores in a repository")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects from the Hub; every answer has a Content-Length
    server_version = "StandInHub/1.0"

    @property
    def hub(self) -> StandInHub:
        return self.server.hub

    def log_message(self, format, *args):  # the default writes every request to stderr
        logger.debug(f"{self.address_string()} {format % args}")

    def do_HEAD(self):
        self.handle_request(send_body=False)

    def do_GET(self):
        self.handle_request(send_body=True)

    def do_POST(self):
        self.handle_request(send_body=True)

    def handle_request(self, send_body: bool):
        raise NotImplementedError

    def read_body(self) -> bytes:
        """The request's body: by Content-Length, or chunk by chunk."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # the CRLF after each chunk
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def answer(self, status: int, body: bytes = b"", headers: dict | None = None, send_body: bool = True):
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body and body:
            self.wfile.write(body)

    def answer_json(self, status: int, data, headers: dict | None = None, send_body: bool = True):
        self.answer(
            status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})}, send_body
        )

    def answer_error(self, status: int, code: str | None, message: str, send_body: bool, **headers):
        if code is not None:
            headers["X-Error-Code"] = code
        headers["X-Error-Message"] = message
        self.answer_json(status, dict(error=message), headers, send_body)

    def answer_file(self, local_path: str, headers: dict, send_body: bool):
        """The file, or the part a ``Range`` asks for.

        ``bytes=A-`` is how the client resumes an interrupted download; ``bytes=A-B`` and ``bytes=-N`` how
        HfFileSystem reads a part of a file (a parquet footer, a row group). A range that starts past the end is
        ``416``, which HfFileSystem takes for the end of the file.
        """
        size = os.path.getsize(local_path)
        start, end, status = 0, size, 200
        if self.headers.get("Range"):
            where = "cdn:" if isinstance(self, _CdnHandler) else ""
            self.hub.ranges.append(f"{self.command} {where}{self.path} {self.headers['Range']}")
        first, _, last = self.headers.get("Range", "").partition("-")
        if first.startswith("bytes=") and "," not in last:
            first = first[len("bytes=") :].strip()
            if first.isdigit() and (last.strip().isdigit() or not last.strip()):
                start = int(first)
                end = min(int(last) + 1, size) if last.strip() else size
                status = 206
            elif not first and last.strip().isdigit():  # the last N bytes
                start, end, status = max(size - int(last), 0), size, 206
            if status == 206 and (start >= size or end <= start):
                return self.answer(416, b"", {"Content-Range": f"bytes */{size}", **headers}, send_body)
            if status == 206:
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        with open(local_path, "rb") as f:
            f.seek(start)
            body = f.read(max(end - start, 0))
        self.answer(
            status, body, {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", **headers}, send_body
        )


class _HubHandler(_Handler):
    def handle_request(self, send_body: bool):
        self.hub.requests.append(f"{self.command} {self.path}")
        url = urlsplit(self.path)
        parts = [unquote(part) for part in url.path.split("/")[1:]]
        query = parse_qs(url.query)
        if self.command == "POST":
            return self.post(parts, query)
        if parts == ["api", "whoami-v2"]:
            return self.whoami(send_body)
        if parts[:1] == ["api"] and len(parts) >= 4 and parts[1] in ("models", "datasets"):
            return self.api(parts[1][:-1], f"{parts[2]}/{parts[3]}", parts[4:], query, send_body)
        repo_type = "model"
        if parts[:1] == ["datasets"]:  # a dataset's files: /datasets/{repo_id}/resolve/...
            repo_type, parts = "dataset", parts[1:]
        if len(parts) >= 5 and parts[2] == "resolve":
            return self.resolve(repo_type, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), send_body)
        self.unserved(send_body)

    def unserved(self, send_body: bool = True):
        logger.warning(f"the stand-in Hub does not serve {self.command} {self.path}")
        self.hub.unserved.append(f"{self.command} {self.path}")
        self.answer_error(404, None, f"the stand-in Hub does not serve {self.command} {self.path}", send_body)

    def whoami(self, send_body: bool):
        """Who the bearer token belongs to, or ``401`` as the Hub answers an unknown token or none."""
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        answer = self.hub.tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if answer is None:
            return self.answer_error(401, None, "Invalid credentials in Authorization header", send_body)
        self.answer_json(200, answer, send_body=send_body)

    def find(self, repo_type: str, repo_id: str, revision: str, send_body: bool) -> Repo | None:
        """The repository at ``revision``, or None after answering the error the Hub gives."""
        repo = self.hub.repo(repo_id, repo_type)
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if (repo_type, repo_id) in self.hub.private and not (scheme.lower() == "bearer" and token in self.hub.tokens):
            self.answer_error(401, "RepoNotFound", "Repository not found", send_body)
            repo = None
        elif repo is None:
            self.answer_error(404, "RepoNotFound", "Repository not found", send_body)
        elif revision not in ("main", repo.commit):
            self.answer_error(404, "RevisionNotFound", f"Invalid rev id: {revision}", send_body)
            repo = None
        return repo

    def api(self, repo_type: str, repo_id: str, rest: list[str], query: dict, send_body: bool):
        if not rest:  # model_info / dataset_info without a revision: the default branch
            rest = ["revision", "main"]
        repo = self.find(repo_type, repo_id, rest[1] if len(rest) >= 2 else "main", send_body)
        if repo is None:
            return
        if rest[0] == "revision" and len(rest) == 2:
            with_blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
            return self.answer_json(200, repo.info(with_blobs), send_body=send_body)
        if rest[0] == "tree" and len(rest) >= 2:
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            entries = repo.tree("/".join(rest[2:]), recursive)
            if entries is None:
                return self.answer_error(
                    404,
                    "EntryNotFound",
                    f"{'/'.join(rest[2:])} does not exist on {rest[1]}",
                    send_body,
                    **{"X-Repo-Commit": repo.commit},
                )
            return self.answer_json(200, entries, send_body=send_body)
        self.unserved(send_body)

    def resolve(self, repo_type: str, repo_id: str, revision: str, filename: str, send_body: bool):
        repo = self.find(repo_type, repo_id, revision, send_body)
        if repo is None:
            return
        file = repo.files.get(filename)
        headers = {"X-Repo-Commit": repo.commit}
        if file is None:
            return self.answer_error(404, "EntryNotFound", "Entry not found", send_body, **headers)
        if file.is_lfs:  # as the Hub does: the metadata here, the bytes at the CDN
            headers.update(
                {
                    "ETag": f'"{file.oid}"',
                    "X-Linked-Etag": f'"{file.sha256}"',
                    "X-Linked-Size": str(file.size),
                    "Location": f"{self.hub.cdn_endpoint}/lfs/{file.sha256}",
                }
            )
            return self.answer(302, b"", headers, send_body)
        headers["ETag"] = f'"{file.oid}"'
        self.answer_file(file.local_path, headers, send_body)

    # ------------------------------------------------------------------------------------------
    # POST: repository creation, paths-info and uploads

    def post(self, parts: list[str], query: dict):
        body = self.read_body()  # read whatever comes next, so that the connection stays usable
        if parts == ["api", "repos", "create"]:
            return self.create_repo(body)
        if len(parts) >= 6 and parts[0] == "api" and parts[1] in ("models", "datasets"):
            repo_type, repo_id = parts[1][:-1], f"{parts[2]}/{parts[3]}"
            action, revision = parts[4], "/".join(parts[5:])
            if "create_pr" in query:  # pull requests are not implemented: say so rather than commit to main
                return self.unserved()
            repo = self.find(repo_type, repo_id, revision, send_body=True)
            if repo is None:
                return
            if action == "paths-info":
                return self.paths_info(repo, body)
            if action == "preupload":
                return self.preupload(repo, body)
            if action == "commit":
                return self.commit(repo, revision, body)
        self.unserved()

    def create_repo(self, body: bytes):
        request = json.loads(body or b"{}")
        repo_type = request.get("type") or "model"
        if not request.get("organization"):  # the Hub would take the token's user; the stand-in knows no users
            return self.answer_error(400, None, "the stand-in Hub creates 'owner/name' repositories only", True)
        repo_id = f"{request['organization']}/{request.get('name')}"
        try:
            created = self.hub.create_repo(repo_id, repo_type)
        except ValueError as e:
            return self.answer_error(400, None, str(e), True)
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        url = f"{self.hub.endpoint}/{prefix}{repo_id}"
        if not created:  # create_repo(exist_ok=True) accepts the 409 and reads the url from its body
            message = f"You already created this {repo_type} repo"
            return self.answer_json(409, dict(error=message, url=url), {"X-Error-Message": message})
        self.answer_json(200, {"url": url, "name": repo_id, "id": self.hub.repo(repo_id, repo_type).commit[:24]})

    def paths_info(self, repo: Repo, body: bytes):
        form = parse_qs(body.decode())
        entries = [repo.path_info(path) for path in form.get("paths", [])]
        self.answer_json(200, [entry for entry in entries if entry is not None])

    def preupload(self, repo: Repo, body: bytes):
        files = []
        for file in json.loads(body)["files"]:
            existing = repo.files.get(file["path"])
            # "regular": the bytes come inline in the commit (no LFS / Xet transfer to stand in for); the oid of
            # the file already there lets the client leave an unchanged file out of the commit
            files.append(
                dict(
                    path=file["path"],
                    uploadMode="regular",
                    shouldIgnore=False,
                    oid=existing.content_oid if existing is not None else None,
                )
            )
        self.answer_json(200, dict(files=files, commitOid=repo.commit))

    def commit(self, repo: Repo, revision: str, body: bytes):
        if revision != "main":  # the Hub commits to a branch; this stand-in has one
            return self.answer_error(400, None, f"the stand-in Hub commits to main only, not {revision}", True)
        summary, added, deleted = "", {}, []
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item.get("key"), item.get("value", {})
            if key == "header":
                summary = value.get("summary", "")
                if value.get("parentCommit") not in (None, repo.commit):
                    return self.answer_error(412, None, "A commit has happened since the parent commit", True)
            elif key == "file" and value.get("encoding") == "base64":
                added[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
            else:  # lfsFile (the preupload answer never asks for LFS), copies, or something newer
                return self.answer_error(400, None, f"the stand-in Hub does not take {key!r} operations", True)
        try:
            commit = self.hub.apply_commit(repo.repo_id, repo.repo_type, summary, added, deleted)
        except ValueError as e:
            return self.answer_error(400, None, str(e), True)
        prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        self.answer_json(
            200,
            {
                "success": True,
                "commitOid": commit,
                "hookOutput": "",
                "commitUrl": f"{self.hub.endpoint}/{prefix}{repo.repo_id}/commit/{commit}",
            },
        )


class _CdnHandler(_Handler):
    def handle_request(self, send_body: bool):
        self.hub.requests.append(f"{self.command} cdn:{self.path}")
        parts = urlsplit(self.path).path.split("/")[1:]
        local_path = self.hub.blob(parts[1]) if len(parts) == 2 and parts[0] == "lfs" else None
        if local_path is None:
            return self.answer_error(404, None, "no such blob", send_body)
        self.answer_file(local_path, {"ETag": f'"{parts[1]}"'}, send_body)


def run_python_with_hub(
    code: str, endpoint: str, timeout: float = 120, hf_home: str | None = None, env: dict[str, str] | None = None
) -> str:
    """Run a Python snippet in a subprocess whose Hugging Face clients use ``endpoint``; returns its stdout.

    The subprocess gets ``HF_ENDPOINT=endpoint``, no ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` /
    ``HF_DATASETS_OFFLINE`` and no token,
    and a fresh, empty ``HF_HOME`` (so every file really comes from the server) unless ``hf_home`` is given.
    It runs in the repository's root with this interpreter.

    :param code: Python source; it is dedented, so an indented triple-quoted string is fine
    :param endpoint: the Hub URL, e.g. ``StandInHub.endpoint``
    :param timeout: seconds before the subprocess is killed and this raises
    :param hf_home: the Hugging Face home to use (kept); by default a temporary one, removed afterwards
    :param env: more environment variables for the subprocess
    :raises RuntimeError: if the snippet fails or runs past ``timeout``; the message holds its stderr
    """
    environment = {
        key: value
        for key, value in os.environ.items()
        if key
        not in (
            "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "HF_DATASETS_OFFLINE",
            "HF_HUB_CACHE",
            "HUGGINGFACE_HUB_CACHE",
            "HF_DATASETS_CACHE",
            "HF_TOKEN",
            "HUGGING_FACE_HUB_TOKEN",
            "HF_HUB_ENABLE_HF_TRANSFER",
        )
    }
    no_proxy = ",".join(filter(None, [environment.get("NO_PROXY", ""), "127.0.0.1", "localhost"]))
    environment.update(
        HF_ENDPOINT=endpoint,
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
        NO_PROXY=no_proxy,
        no_proxy=no_proxy,
        **(env or {}),
    )
    temporary_home = None if hf_home is not None else tempfile.mkdtemp(prefix="collab_kit_hub_client_")
    environment["HF_HOME"] = hf_home or temporary_home
    try:
        process = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=REPO_ROOT,
            env=environment,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise RuntimeError(
            f"the snippet ran past its {timeout} s deadline and was killed; its stderr ends with:\n{stderr[-4000:]}"
        ) from None
    finally:
        if temporary_home is not None:
            shutil.rmtree(temporary_home, ignore_errors=True)
    if process.returncode != 0:
        raise RuntimeError(
            f"the snippet failed with exit code {process.returncode}; its stderr ends with:\n{process.stderr[-4000:]}"
        )
    return process.stdout


@pytest.fixture
def hub_server(tmp_path_factory):
    """A running :class:`StandInHub` with no repositories; stopped at teardown."""
    hub = StandInHub(str(tmp_path_factory.mktemp("stand_in_hub")))
    try:
        yield hub
    finally:
        hub.stop()
