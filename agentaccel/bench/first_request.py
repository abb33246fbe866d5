"""The first request an agent client sends for a task, caught by a server on 127.0.0.1 that keeps
each path's first body and answers 400 (the client then gives up): what the client wraps around a
task (Claude Code's system reminders, Codex's environment context), so that recorded sessions can
be replayed to it (bench agent --client) and tests can author sessions it will send."""

from __future__ import annotations

import http.server
import json
import threading


class FirstRequest:
    def __init__(self) -> None:
        self.bodies: dict[str, dict] = {}  # path (without its query) -> the first JSON body sent there
        bodies = self.bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the standard library's name
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                except json.JSONDecodeError:
                    body = {}
                bodies.setdefault(self.path.split("?")[0], body)
                reply = json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                               "message": "captured"}}).encode()
                self.send_response(400)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FirstRequest:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
