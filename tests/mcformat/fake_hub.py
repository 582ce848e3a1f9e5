"""A local HTTP server speaking the Hugging Face hub endpoints that huggingface_hub's download
client uses: the repository tree listing and `resolve` (HEAD for metadata, GET with Range).
It can cut the first download short to exercise resuming."""

from __future__ import annotations

import hashlib
import threading

from flask import Flask, Response, jsonify, request
from werkzeug.serving import make_server

COMMIT = "1234567890abcdef1234567890abcdef12345678"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]], cut_first_get_at: int | None = None):
        self.repos = repos
        self.cut_first_get_at = cut_first_get_at
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Range header
        self.app = self._make_app()
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()

    def _missing_repo(self) -> Response:
        resp = jsonify({"error": "Repository not found"})
        resp.status_code, resp.headers["X-Error-Code"] = 404, "RepoNotFound"
        return resp

    def _make_app(self) -> Flask:
        app = Flask("fake-hub")

        @app.get("/api/models/<owner>/<name>/tree/<revision>")
        def tree(owner, name, revision):
            files = self.repos.get(f"{owner}/{name}")
            if files is None:
                return self._missing_repo()
            return jsonify([
                {"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest(),
                 "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
                for path, data in files.items()
            ])  # fmt: skip

        @app.route("/<owner>/<name>/resolve/<revision>/<path:filename>", methods=["GET", "HEAD"])
        def resolve(owner, name, revision, filename):
            self.requests.append((request.method, filename, request.headers.get("Range")))
            files = self.repos.get(f"{owner}/{name}")
            if files is None:
                return self._missing_repo()
            if filename not in files:
                resp = jsonify({"error": "Entry not found"})
                resp.status_code, resp.headers["X-Error-Code"] = 404, "EntryNotFound"
                return resp
            data = files[filename]
            etag = f'"{hashlib.sha256(data).hexdigest()}"'
            headers = {"X-Repo-Commit": COMMIT, "ETag": etag, "X-Linked-Etag": etag, "Accept-Ranges": "bytes",
                       "X-Linked-Size": str(len(data))}  # fmt: skip
            if request.method == "HEAD":
                return Response(b"", headers={**headers, "Content-Length": str(len(data))})
            start = int(request.headers.get("Range", "bytes=0-").split("=")[1].split("-")[0] or 0)
            body, status = data[start:], 206 if start else 200
            if self.cut_first_get_at is not None:  # promise the whole body, send part, hang up
                cut, self.cut_first_get_at = self.cut_first_get_at, None
                return Response(
                    _cut(body, cut), status, headers={**headers, "Content-Length": str(len(body))}
                )
            return Response(body, status, headers={**headers, "Content-Length": str(len(body))})

        return app


def _cut(body: bytes, n: int):
    yield body[:n]
    raise ConnectionResetError("fake hub hung up")
