"""A package index on 127.0.0.1 (PEP 503 simple pages) serving one wheel, slowly if asked, for
tests of ``pip download`` without the network: ``with serve_wheel(wheel, seconds) as url``,
then point pip at ``url`` (``PIP_INDEX_URL``)."""

from __future__ import annotations

import base64
import hashlib
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHUNK = 64 * 1024


def build_wheel(directory: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid pure-Python wheel of ``name`` holding ``files`` (archive path -> bytes)."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    members = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{path},sha256={_digest(data)},{len(data)}" for path, data in members.items()] + [f"{info}/RECORD,,"]
    wheel = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for path, data in {**members, f"{info}/RECORD": "\n".join(record).encode()}.items():
            archive.writestr(path, data)
    return wheel


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@contextmanager
def serve_wheel(wheel: Path, project: str, seconds: float = 0.0) -> Iterator[str]:
    """The index URL of a server listing ``wheel`` for ``project``; the wheel's bytes are sent in
    chunks spread over about ``seconds``."""
    data = wheel.read_bytes()
    pause = seconds / max(len(data) // CHUNK, 1)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.rstrip("/") == f"/simple/{project}":
                sha = hashlib.sha256(data).hexdigest()
                self._send(f'<a href="/files/{wheel.name}#sha256={sha}">{wheel.name}</a>'.encode(), "text/html")
            elif self.path == f"/files/{wheel.name}":
                self._send(data, "application/octet-stream", pause)
            else:
                self.send_error(404)

        def _send(self, body: bytes, kind: str, pause: float = 0.0) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for start in range(0, len(body), CHUNK):
                self.wfile.write(body[start : start + CHUNK])
                time.sleep(pause)

        def log_message(self, *args: object) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()
