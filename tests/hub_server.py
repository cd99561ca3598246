"""A stand-in Hugging Face Hub on 127.0.0.1: serves model repositories from a local folder to the real client.

The Hub cannot be reached from the machines this project is built on, so tests that download from it start
this server and point the real ``huggingface_hub`` client at it with ``HF_ENDPOINT`` (in a subprocess: the
client reads ``HF_ENDPOINT`` once, at import time). The server implements exactly what
``snapshot_download`` and ``hf_hub_download`` (hence ``transformers``' ``from_pretrained``) use, read from
huggingface_hub 2.4 (``hf_api.py``, ``file_download.py``, ``_snapshot_download.py``, ``utils/_http.py``):

    GET  /api/models/{repo_id}                         model_info: ``sha`` (commit) and ``siblings``
    GET  /api/models/{repo_id}/revision/{revision}     the same at a revision (what repo_info asks)
    GET  /api/models/{repo_id}/tree/{revision}[/{path}]?recursive=...   list_repo_tree, one page, no ``Link``
    HEAD /{repo_id}/resolve/{revision}/{filename}      file metadata: X-Repo-Commit, ETag, Content-Length
    GET  /{repo_id}/resolve/{revision}/{filename}      the file

Files that the Hub stores with git-LFS (``*.safetensors``, ``*.bin``, ...) are answered as the Hub answers
them: ``302`` to a second server standing in for the CDN (another port of 127.0.0.1, so another origin, as
the real CDN is another host), with ``X-Linked-Etag`` (sha256) and ``X-Linked-Size``; the client then
downloads from the ``Location``. Other files are answered directly, with their git blob sha1 as ``ETag``.

Errors carry the headers ``hf_raise_for_status`` turns into typed errors: ``X-Error-Code: RepoNotFound``
(RepositoryNotFoundError), ``RevisionNotFound`` (RevisionNotFoundError) and ``EntryNotFound``
(RemoteEntryNotFoundError, with ``X-Repo-Commit`` so the client can cache the file's absence). Revisions are
``main`` and the repository's one commit, a hash of its files: re-adding a repository makes a new commit.

Repositories are folders ``root/<owner>/<name>/<files>``; ``add_repo`` copies a folder there. The fixture
``hub_server`` (registered in conftest.py) starts a server per test and stops it at teardown.
"""
from __future__ import annotations

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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

logger = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the file types the Hub's default .gitattributes sends to git-LFS (hence through the CDN)
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".npy", ".npz",
                ".parquet", ".arrow", ".pkl", ".pickle", ".joblib", ".model", ".tflite", ".zip", ".gz", ".tar",
                ".tgz", ".zst", ".xz", ".7z", ".bz2")
CREATED_AT = "2021-12-06T00:00:00.000Z"


class RepoFile:
    """One file of a served repository, with the hashes the Hub reports for it."""

    def __init__(self, path_in_repo: str, local_path: str):
        self.path, self.local_path = path_in_repo, local_path
        with open(local_path, "rb") as f:
            content = f.read()
        self.size = len(content)
        self.sha256 = hashlib.sha256(content).hexdigest()
        self.is_lfs = path_in_repo.endswith(LFS_SUFFIXES)
        if self.is_lfs:  # git stores a pointer; the Hub reports the pointer's blob id and the content's sha256
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n"
            self.pointer_size, self.oid = len(pointer), _git_blob_id(pointer.encode())
        else:
            self.pointer_size, self.oid = None, _git_blob_id(content)

    def tree_entry(self) -> dict:
        entry = dict(type="file", oid=self.oid, size=self.size, path=self.path)
        if self.is_lfs:
            entry["lfs"] = dict(oid=self.sha256, size=self.size, pointerSize=self.pointer_size)
        return entry


def _git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class Repo:
    """A snapshot of a folder: its files and the commit hash they make."""

    def __init__(self, repo_id: str, folder: str):
        self.repo_id, self.files = repo_id, {}
        for parent, dirs, names in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != ".git")
            for name in sorted(names):
                local_path = os.path.join(parent, name)
                path_in_repo = os.path.relpath(local_path, folder).replace(os.sep, "/")
                self.files[path_in_repo] = RepoFile(path_in_repo, local_path)
        listing = "".join(f"{path}\0{file.oid}\n" for path, file in sorted(self.files.items()))
        self.commit = hashlib.sha1(f"{repo_id}\n{listing}".encode()).hexdigest()

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
        return {"_id": self.commit[:24], "id": self.repo_id, "modelId": self.repo_id, "author": owner,
                "sha": self.commit, "lastModified": CREATED_AT, "createdAt": CREATED_AT, "private": False,
                "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": [], "siblings": siblings}

    def tree(self, path: str, recursive: bool) -> Optional[List[dict]]:
        """Entries under ``path`` ("" for the root) as list_repo_tree expects them, or None if no such folder."""
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        entries, folders = [], {}
        for file in self.files.values():
            if not file.path.startswith(prefix):
                continue
            rest = file.path[len(prefix):].split("/")
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
            entries.append(dict(type="directory", oid=hashlib.sha1("".join(oids).encode()).hexdigest(),
                                size=0, path=folder))
        return entries


class StandInHub:
    """A Hub API on 127.0.0.1 (plus a CDN on another port) serving the model repositories under ``root``.

    :param root: the folder of repositories, laid out as ``root/<owner>/<name>/<files>``
    """

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.requests: List[str] = []  # "METHOD /path?query" as received; the CDN's as "METHOD cdn:/path"
        self.unserved: List[str] = []  # requests for endpoints this stand-in does not implement (answered 404)
        self._snapshots: Dict[str, Repo] = {}
        self._lock = threading.Lock()
        self._hub = self._start_server(is_cdn=False)
        self._cdn = self._start_server(is_cdn=True)
        self.endpoint = f"http://127.0.0.1:{self._hub.server_address[1]}"
        self.cdn_endpoint = f"http://127.0.0.1:{self._cdn.server_address[1]}"
        logger.info(f"stand-in Hub at {self.endpoint} serving {self.root}")

    def add_repo(self, repo_id: str, folder: str) -> str:
        """Serve a copy of ``folder`` as the model repository ``repo_id`` (replacing it); returns its commit hash.

        :param repo_id: ``owner/name``
        :param folder: a local folder; its files are copied, so later changes to it are not served
        """
        owner, name = _split_repo_id(repo_id)
        target = os.path.join(self.root, owner, name)
        with self._lock:
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(folder, target, ignore=shutil.ignore_patterns(".git"))
            self._snapshots.pop(repo_id, None)
        return self.repo(repo_id).commit

    def repo(self, repo_id: str) -> Optional[Repo]:
        """The repository ``repo_id`` as served now, or None; a folder is hashed once, when first asked for."""
        try:
            owner, name = _split_repo_id(repo_id)
        except ValueError:
            return None
        folder = os.path.join(self.root, owner, name)
        with self._lock:
            if repo_id not in self._snapshots and os.path.isdir(folder):
                self._snapshots[repo_id] = Repo(repo_id, folder)
            return self._snapshots.get(repo_id)

    def blob(self, sha256: str) -> Optional[str]:
        """The local path of an LFS file served now with this sha256 (what the CDN serves), or None."""
        with self._lock:
            for repo in self._snapshots.values():
                for file in repo.files.values():
                    if file.is_lfs and file.sha256 == sha256:
                        return file.local_path
        return None

    def run_python(self, code: str, timeout: float = 120, hf_home: Optional[str] = None,
                   env: Optional[Dict[str, str]] = None) -> str:
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
        threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.05),
                         name=f"stand-in-{'cdn' if is_cdn else 'hub'}", daemon=True).start()
        return server


def _split_repo_id(repo_id: str):
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(part in (".", "..") for part in parts):
        raise ValueError(f"the stand-in Hub serves repositories 'owner/name', not {repo_id!r}")
    return parts


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

    def handle_request(self, send_body: bool):
        raise NotImplementedError

    def answer(self, status: int, body: bytes = b"", headers: Optional[dict] = None, send_body: bool = True):
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body and body:
            self.wfile.write(body)

    def answer_json(self, status: int, data, headers: Optional[dict] = None, send_body: bool = True):
        self.answer(status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})},
                    send_body)

    def answer_error(self, status: int, code: Optional[str], message: str, send_body: bool, **headers):
        if code is not None:
            headers["X-Error-Code"] = code
        headers["X-Error-Message"] = message
        self.answer_json(status, dict(error=message), headers, send_body)

    def answer_file(self, local_path: str, headers: dict, send_body: bool):
        """The file, or the part a ``Range: bytes=N-`` asks for (the client resumes interrupted downloads so)."""
        size = os.path.getsize(local_path)
        start, status = 0, 200
        requested = self.headers.get("Range", "")
        if requested.startswith("bytes=") and requested[6:].split("-")[0].isdigit():
            start, status = min(int(requested[6:].split("-")[0]), size), 206
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        with open(local_path, "rb") as f:
            f.seek(start)
            body = f.read()
        self.answer(status, body, {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", **headers},
                    send_body)


class _HubHandler(_Handler):
    def handle_request(self, send_body: bool):
        self.hub.requests.append(f"{self.command} {self.path}")
        url = urlsplit(self.path)
        parts = [unquote(part) for part in url.path.split("/")[1:]]
        query = parse_qs(url.query)
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self.api(f"{parts[2]}/{parts[3]}", parts[4:], query, send_body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self.resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), send_body)
        self.unserved(send_body)

    def unserved(self, send_body: bool):
        logger.warning(f"the stand-in Hub does not serve {self.command} {self.path}")
        self.hub.unserved.append(f"{self.command} {self.path}")
        self.answer_error(404, None, f"the stand-in Hub does not serve {self.command} {self.path}", send_body)

    def find(self, repo_id: str, revision: str, send_body: bool) -> Optional[Repo]:
        """The repository at ``revision``, or None after answering the error the Hub gives."""
        repo = self.hub.repo(repo_id)
        if repo is None:
            self.answer_error(404, "RepoNotFound", "Repository not found", send_body)
        elif revision not in ("main", repo.commit):
            self.answer_error(404, "RevisionNotFound", f"Invalid rev id: {revision}", send_body)
            repo = None
        return repo

    def api(self, repo_id: str, rest: List[str], query: dict, send_body: bool):
        if not rest:  # model_info without a revision: the default branch
            rest = ["revision", "main"]
        repo = self.find(repo_id, rest[1] if len(rest) >= 2 else "main", send_body)
        if repo is None:
            return
        if rest[0] == "revision" and len(rest) == 2:
            with_blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
            return self.answer_json(200, repo.info(with_blobs), send_body=send_body)
        if rest[0] == "tree" and len(rest) >= 2:
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            entries = repo.tree("/".join(rest[2:]), recursive)
            if entries is None:
                return self.answer_error(404, "EntryNotFound", f"{'/'.join(rest[2:])} does not exist on {rest[1]}",
                                         send_body, **{"X-Repo-Commit": repo.commit})
            return self.answer_json(200, entries, send_body=send_body)
        self.unserved(send_body)

    def resolve(self, repo_id: str, revision: str, filename: str, send_body: bool):
        repo = self.find(repo_id, revision, send_body)
        if repo is None:
            return
        file = repo.files.get(filename)
        headers = {"X-Repo-Commit": repo.commit}
        if file is None:
            return self.answer_error(404, "EntryNotFound", "Entry not found", send_body, **headers)
        if file.is_lfs:  # as the Hub does: the metadata here, the bytes at the CDN
            headers.update({"ETag": f'"{file.oid}"', "X-Linked-Etag": f'"{file.sha256}"',
                            "X-Linked-Size": str(file.size),
                            "Location": f"{self.hub.cdn_endpoint}/lfs/{file.sha256}"})
            return self.answer(302, b"", headers, send_body)
        headers["ETag"] = f'"{file.oid}"'
        self.answer_file(file.local_path, headers, send_body)


class _CdnHandler(_Handler):
    def handle_request(self, send_body: bool):
        self.hub.requests.append(f"{self.command} cdn:{self.path}")
        parts = urlsplit(self.path).path.split("/")[1:]
        local_path = self.hub.blob(parts[1]) if len(parts) == 2 and parts[0] == "lfs" else None
        if local_path is None:
            return self.answer_error(404, None, "no such blob", send_body)
        self.answer_file(local_path, {"ETag": f'"{parts[1]}"'}, send_body)


def run_python_with_hub(code: str, endpoint: str, timeout: float = 120, hf_home: Optional[str] = None,
                        env: Optional[Dict[str, str]] = None) -> str:
    """Run a Python snippet in a subprocess whose Hugging Face clients use ``endpoint``; returns its stdout.

    The subprocess gets ``HF_ENDPOINT=endpoint``, no ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` and no token,
    and a fresh, empty ``HF_HOME`` (so every file really comes from the server) unless ``hf_home`` is given.
    It runs in the repository's root with this interpreter.

    :param code: Python source; it is dedented, so an indented triple-quoted string is fine
    :param endpoint: the Hub URL, e.g. ``StandInHub.endpoint``
    :param timeout: seconds before the subprocess is killed and this raises
    :param hf_home: the Hugging Face home to use (kept); by default a temporary one, removed afterwards
    :param env: more environment variables for the subprocess
    :raises RuntimeError: if the snippet fails or runs past ``timeout``; the message holds its stderr
    """
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
                                  "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_ENABLE_HF_TRANSFER")}
    no_proxy = ",".join(filter(None, [environment.get("NO_PROXY", ""), "127.0.0.1", "localhost"]))
    environment.update(HF_ENDPOINT=endpoint, HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1",
                       HF_HUB_DISABLE_IMPLICIT_TOKEN="1", NO_PROXY=no_proxy, no_proxy=no_proxy, **(env or {}))
    temporary_home = None if hf_home is not None else tempfile.mkdtemp(prefix="collab_kit_hub_client_")
    environment["HF_HOME"] = hf_home or temporary_home
    try:
        process = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, env=environment,
                                 capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise RuntimeError(f"the snippet ran past its {timeout} s deadline and was killed; "
                           f"its stderr ends with:\n{stderr[-4000:]}") from None
    finally:
        if temporary_home is not None:
            shutil.rmtree(temporary_home, ignore_errors=True)
    if process.returncode != 0:
        raise RuntimeError(f"the snippet failed with exit code {process.returncode}; "
                           f"its stderr ends with:\n{process.stderr[-4000:]}")
    return process.stdout


@pytest.fixture
def hub_server(tmp_path_factory):
    """A running :class:`StandInHub` with no repositories; stopped at teardown."""
    hub = StandInHub(str(tmp_path_factory.mktemp("stand_in_hub")))
    try:
        yield hub
    finally:
        hub.stop()
