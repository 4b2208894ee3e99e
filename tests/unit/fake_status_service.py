"""A real HTTP server in a thread that guards /status with a bearer key, the way
the service's AccessGuard does, for testing the clients that must send it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.status_sample import sample_status

STATUS = sample_status()
STATUS["service"]["model"] = "fake-model"


class KeyCheckingService:
    def __init__(self, api_key: str) -> None:
        self.api_key = api_key
        self.authorizations: list[str | None] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server name
                authorization = self.headers.get("Authorization")
                service.authorizations.append(authorization)
                if authorization == f"Bearer {service.api_key}":
                    self._reply(200, STATUS)
                else:
                    self._reply(401, {"error": {"message": "missing or wrong API key", "code": "invalid_api_key"}})

            def _reply(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 - the http.server signature
                pass  # one stderr line per request would clutter the test output

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
