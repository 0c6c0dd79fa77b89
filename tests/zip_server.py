"""A real HTTP server on 127.0.0.1 that serves zips and plays scripted failures (download tests)."""

from __future__ import annotations

import io
import threading
import time
import zipfile
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tasks.download.url import ARCHIVE_DIRNAME


class ZipServer:
    """Serves `routes` (path -> bytes); `faults[path]` is a queue of failures to play before serving."""

    def __init__(self) -> None:
        self.routes: dict[str, bytes] = {}
        self.faults: dict[str, list[str | int]] = {}
        self.hits: Counter[str] = Counter()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:
                with server._lock:
                    server.hits[self.path] += 1
                    queue = server.faults.get(self.path, [])
                    fault = queue.pop(0) if queue else None
                body = server.routes.get(self.path)
                if isinstance(fault, int):
                    self.send_error(fault)
                elif body is None:
                    self.send_error(404)
                elif fault == "slow":  # longer than the client's read timeout
                    time.sleep(4.0)
                    self.send_error(500)
                elif fault == "short":  # promise the whole body, send half, hang up
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[: len(body) // 2])
                    self.close_connection = True
                else:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/zip")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def start(self) -> ZipServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def zip_of(dataset: Path) -> bytes:
    """A dataset folder zipped like the tutorial: members under `petfinder_for_tutorial/`."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(dataset.rglob("*")):
            zf.write(path, f"{ARCHIVE_DIRNAME}/{path.relative_to(dataset).as_posix()}")
    return buf.getvalue()
