"""A Hugging Face Hub double: a real HTTP server on 127.0.0.1 serving just enough of the Hub's API for
huggingface_hub's `HfApi.model_info`, `snapshot_download` and `hf_hub_download`.

The routes and headers are the ones huggingface_hub 2.4.0 reads (its sources in the venv):
- GET /api/models/{repo}/revision/{revision} -> {"id", "sha", "siblings"} (hf_api.py `model_info`, `ModelInfo`);
  an unknown repo or revision is a 404 with X-Error-Code RepoNotFound or RevisionNotFound (utils/_http.py
  `hf_raise_for_status`).
- GET /api/models/{repo}/tree/{revision}?recursive=..&expand=.. -> [{"type": "file", "path", "size", "oid",
  "lfs": {"oid", "size", "pointerSize"}}] in one page, no Link header (hf_api.py `_iter_repo_tree_pages`,
  `RepoFile`; utils/_pagination.py).
- HEAD / GET /{repo}/resolve/{revision}/{file}: X-Repo-Commit, ETag (the git blob sha1 of a small file, the sha256
  of an LFS file, as the real Hub sends them), X-Linked-Etag and X-Linked-Size for LFS files, Content-Length; the
  cache names each blob by that etag (file_download.py `get_hf_file_metadata`, `_hf_hub_download_to_cache_dir`).
  No X-Xet-* headers, so the plain HTTP download is used. A missing file is a 404 with X-Error-Code EntryNotFound.

A repo holds commits (file name -> bytes) and branches that move. `stale_mirror` makes the server behave like a
mirror that serves only each branch's head: every revision, commits included, answers main's commit and files.
Two more faults of a server between a build and the Hub: `flipped` names files served with one byte flipped under
the ETag (and tree oid) of their true bytes, as a proxy or a disk that corrupts a file in flight would serve them;
`lies` gives, per commit, other bytes for some of its files, served under their own honest ETags and tree entries,
as a mirror that holds other content for a commit would. Every request is recorded in `requests` as (method, path).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors",)   # what the real Hub stores through LFS among a checkpoint's files


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)   # commit -> file name -> bytes
    branches: dict[str, str] = field(default_factory=dict)                # branch -> commit


class HubDouble:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.stale_mirror = False
        self.flipped: set[str] = set()                      # file names served corrupt under their true ETag
        self.lies: dict[str, dict[str, bytes]] = {}         # commit -> file name -> other bytes served for it
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "HubDouble":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- the repos ---------------------------------------------------------------------------------------------
    def add_commit(self, repo: str, files: dict[str, bytes] | Path, branch: str | None = "main") -> str:
        """Add a commit holding `files` (or a directory's files) and, unless `branch` is None, move the branch to
        it. The commit id is derived from the content and the parent, as git's would be."""
        if isinstance(files, Path):
            files = {p.name: p.read_bytes() for p in sorted(files.iterdir()) if p.is_file()}
        r = self.repos.setdefault(repo, Repo())
        parent = r.branches.get(branch or "main", "")
        tree = "".join(f"{name}\0{git_blob_sha1(data)}\n" for name, data in sorted(files.items()))
        commit = hashlib.sha1(f"{repo}\n{parent}\n{len(r.commits)}\n{tree}".encode()).hexdigest()
        r.commits[commit] = dict(files)
        if branch is not None:
            r.branches[branch] = commit
        return commit

    def move(self, repo: str, branch: str, commit: str) -> None:
        self.repos[repo].branches[branch] = commit

    def resolution_requests(self, repo: str, revision: str = "main") -> int:
        """How many times the Hub was asked to resolve `revision` of `repo` (model_info at that revision)."""
        return self.requests.count(("GET", f"/api/models/{repo}/revision/{revision}"))

    def served(self, repo: str, commit: str) -> dict[str, bytes]:
        """The files this server answers for `commit`: the commit's own, or the other bytes `lies` gives."""
        return {**self.repos[repo].commits[commit], **self.lies.get(commit, {})}

    def _resolve(self, repo: str, revision: str) -> str | None:
        r = self.repos[repo]
        if self.stale_mirror:
            return r.branches.get("main")
        if revision in r.commits:
            return revision
        return r.branches.get(revision)


def _etag(name: str, data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else git_blob_sha1(data)


def _handler(hub: HubDouble) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:   # the test's output stays the test's
            pass

        def do_GET(self) -> None:
            self._route(body=True)

        def do_HEAD(self) -> None:
            self._route(body=False)

        def _send(self, status: int, data: bytes = b"", headers: dict | None = None, body: bool = True) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str, body: bool, headers: dict | None = None) -> None:
            self._send(status, json.dumps({"error": code}).encode(),
                       {"X-Error-Code": code, "Content-Type": "application/json", **(headers or {})}, body)

        def _json(self, doc, body: bool) -> None:
            self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json"}, body)

        def _route(self, body: bool) -> None:
            path = urlsplit(self.path).path
            with hub._lock:
                hub.requests.append((self.command, unquote(path)))
            parts = [unquote(p) for p in path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo = "/".join(parts[2:4])
                if repo not in hub.repos:
                    return self._error(404, "RepoNotFound", body)
                kind, revision = (parts[4], "/".join(parts[5:])) if len(parts) > 5 else ("revision", "main")
                commit = hub._resolve(repo, revision)
                if commit is None:
                    return self._error(404, "RevisionNotFound", body)
                files = hub.served(repo, commit)
                if kind == "revision":
                    return self._json({"id": repo, "sha": commit, "private": False,
                                       "siblings": [{"rfilename": n} for n in sorted(files)]}, body)
                if kind == "tree":
                    return self._json([_tree_entry(n, d) for n, d in sorted(files.items())], body)
                return self._error(404, "EntryNotFound", body)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                if repo not in hub.repos:
                    return self._error(404, "RepoNotFound", body)
                commit = hub._resolve(repo, revision)
                if commit is None:
                    return self._error(404, "RevisionNotFound", body)
                files = hub.served(repo, commit)
                if name not in files:
                    return self._error(404, "EntryNotFound", body, {"X-Repo-Commit": commit})
                data = files[name]
                etag = _etag(name, data)
                if name in hub.flipped:
                    data = flip_byte(data)
                headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"',
                           "Content-Type": "application/octet-stream"}
                if name.endswith(LFS_SUFFIXES):
                    headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
                return self._send(200, data, headers, body)
            self._error(404, "EntryNotFound", body)

    return Handler


def flip_byte(data: bytes) -> bytes:
    """`data` with the bits of its last byte inverted (in a safetensors file, tensor data: its header still parses)."""
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def _tree_entry(name: str, data: bytes) -> dict:
    entry = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha1(data)}
    if name.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry
