"""Assertions and a webhook receiver shared by the integration tests (importable by name:
pytest puts this directory on sys.path)."""

from __future__ import annotations

import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ERROR_KEYS = {"status_code", "detail", "errors"}
ERROR_ITEM_KEYS = {"path", "keyword", "message", "source"}


def assert_error(response, status: int) -> dict:
    """The response is `status` with exactly the API's error shape; returns the body."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == ERROR_KEYS, body
    assert body["status_code"] == status
    assert isinstance(body["detail"], str) and body["detail"]
    assert isinstance(body["errors"], list)
    for item in body["errors"]:
        assert set(item) == ERROR_ITEM_KEYS, item
        assert isinstance(item["message"], str) and item["message"]
    assert "Traceback" not in response.text and 'File "' not in response.text
    return body


def id_param(session, value: str):
    """A UUID string as a raw SQL parameter for `session`'s database: sa.Uuid stores hex on SQLite."""
    return uuid.UUID(value).hex if session.get_bind().dialect.name == "sqlite" else uuid.UUID(value)


class Receiver:
    """An HTTP server on 127.0.0.1 that records each POST and answers with the next status."""

    def __init__(self, statuses: list[int] | None = None, location: str | None = None, stall_s: float = 0,
                 tls=None):
        """`location`: sent as the Location header (with a 3xx status, a redirect); `stall_s`:
        seconds to wait before answering (a receiver that does not answer in time); `tls`: a
        server-side ssl.SSLContext (https; `url` still names 127.0.0.1)."""
        self.posts: list[tuple[dict[str, str], bytes]] = []
        self.statuses = statuses or []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.posts.append(({k.lower(): v for k, v in self.headers.items()}, body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                time.sleep(stall_s)
                self.send_response(status)
                if location is not None:
                    self.send_header("location", location)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
