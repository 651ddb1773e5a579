"""Test helpers for Hugging Face ids: a real HF cache layout, and a local stand-in for the hub.

``write_hf_cache`` lays out a checkpoint directory the way huggingface_hub's cache does
(``models--org--name/{blobs,refs,snapshots}``, snapshot files symlinked to content-named
blobs). ``FakeHub`` is a tiny HTTP server speaking the part of the hub's API that
``snapshot_download`` uses (repo info, tree listing, HEAD/GET of ``resolve`` URLs), so a
process given ``HF_ENDPOINT=fake.url`` downloads from it; it counts every request, can
serve a repo as gated (open with one token only) and can slow file bodies down.
Runs in the pytest process (the server on a thread). ``TINY_REPO`` is the id the session's
``hub_cache`` fixture (tests/conftest.py) caches: the tiny Llama at ``MAIN`` (ref main) and its
tied-embedding sibling at ``V2`` (ref v2).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def commit_of(name: str) -> str:
    """A stable 40-hex commit hash for a test revision name."""
    return hashlib.sha1(name.encode()).hexdigest()


TINY_REPO = "tiny-org/tiny-llama"
MAIN, V2 = commit_of("main"), commit_of("v2")


def write_hf_cache(cache: Path, repo_id: str, checkpoint: Path, commit: str,
                   refs: tuple[str, ...] = ("main",)) -> Path:
    """Put ``checkpoint``'s top-level files into ``cache`` as ``repo_id`` at ``commit`` (each
    of ``refs`` pointing at it); returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(checkpoint.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / file.name
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)     # no newline, as huggingface_hub writes it
    return snapshot


@dataclass
class HubRepo:
    files: dict[str, dict[str, bytes]]          # commit -> file name -> content
    refs: dict[str, str]                         # branch / tag -> commit
    token: str | None = None                     # set: gated, only this bearer token may read


@dataclass
class FakeHub:
    """``FakeHub().start()``; ``url`` goes into HF_ENDPOINT; ``requests`` counts
    ``"METHOD path"``; ``file_delay_s`` slows every file body (to make downloads overlap)."""

    repos: dict[str, HubRepo] = field(default_factory=dict)
    file_delay_s: float = 0.0
    requests: Counter = field(default_factory=Counter)

    def add(self, repo_id: str, commit: str, checkpoint: Path, refs: tuple[str, ...] = ("main",),
            token: str | None = None) -> None:
        repo = self.repos.setdefault(repo_id, HubRepo({}, {}, token))
        repo.files[commit] = {f.name: f.read_bytes() for f in sorted(checkpoint.iterdir())}
        repo.refs.update({ref: commit for ref in refs})

    def start(self) -> FakeHub:
        hub = self
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def do_GET(self) -> None:
                self._answer(head=False)

            def _answer(self, head: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                with lock:
                    hub.requests[f"{self.command} {path}"] += 1
                api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path)
                resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                match = api or resolve
                if match is None:
                    return self._error(404, "EntryNotFound")
                repo = hub.repos.get(match.group(1))
                if repo is None:
                    return self._error(401, "RepoNotFound")
                if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                    return self._error(403, "GatedRepo")
                rev = match.group(3) if api else match.group(2)
                commit = repo.refs.get(rev, rev)
                if commit not in repo.files:
                    return self._error(404, "RevisionNotFound")
                files = repo.files[commit]
                if api and api.group(2) == "revision":
                    return self._json({"id": match.group(1), "sha": commit, "private": False,
                                       "siblings": [{"rfilename": name} for name in files]})
                if api:
                    return self._json([{"type": "file", "path": name, "size": len(data),
                                        "oid": hashlib.sha1(data).hexdigest()} for name, data in files.items()])
                data = files.get(resolve.group(3))
                if data is None:
                    return self._error(404, "EntryNotFound")
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    time.sleep(hub.file_delay_s)
                    self.wfile.write(data)

            def _json(self, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(data)

            def _error(self, status: int, code: str) -> None:
                data = json.dumps({"error": code}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def file_gets(self) -> dict[str, int]:
        """GETs of files (``resolve`` URLs), by file name."""
        return {key.rsplit("/", 1)[1]: n for key, n in self.requests.items()
                if key.startswith("GET ") and "/resolve/" in key}

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
