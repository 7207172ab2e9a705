"""TEST DOUBLE: a hostile or broken OpenAI-compatible server, in the test's own process. Not SGLang.

SGLang cannot run on a CPU machine, and a real server misbehaves only by accident; this one does it on purpose,
to test that the generate stage contains it. It listens on 127.0.0.1 (a free port), answers GET /v1/models
with an empty model list (or with `models`), and answers each POST /v1/chat/completions with the next of the
`answers` it was given (then with `then`, a good answer by default). An answer is a function of the request
handler; the ones below trickle, flood, redirect, echo the request's headers, or send any body at all. Every
request is recorded (method, path, headers) in `requests`, and the bytes of every body sent in `sent_bytes`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Answer = Callable[[BaseHTTPRequestHandler], None]
GOOD = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "A fine answer."}, "finish_reason": "stop"}],
    "usage": {"completion_tokens": 4},
}


def body(content: bytes | dict | list, status: int = 200, headers: dict | None = None) -> Answer:
    """`content` (bytes as they are, anything else as JSON) with its length."""
    data = content if isinstance(content, bytes) else json.dumps(content).encode()

    def answer(handler) -> None:
        handler.send_response(status)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.send(data)

    return answer


def trickle(every_s: float, for_at_most_s: float = 30.0) -> Answer:
    """Headers at once, promising a megabyte, then one byte every `every_s`: each read comes in well within any
    read timeout, so only a deadline on the whole request ends it."""

    def answer(handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(1 << 20))
        handler.end_headers()
        handler.send(b"{")
        stop_at = time.monotonic() + for_at_most_s
        while time.monotonic() < stop_at and handler.send(b" "):
            time.sleep(every_s)
        handler.close_connection = True

    return answer


def flood(total_bytes: int) -> Answer:
    """The start of a good answer, then `total_bytes` of content made as it is sent (never held whole here),
    with no Content-Length: the client learns the size only by reading."""
    chunk = b"x" * (64 << 10)

    def answer(handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.close_connection = True
        if not handler.send(b'{"choices": [{"message": {"role": "assistant", "content": "'):
            return
        for _ in range(total_bytes // len(chunk)):
            if not handler.send(chunk):
                return
        handler.send(b'"}}]}')

    return answer


def redirect(location: str) -> Answer:
    def answer(handler) -> None:
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return answer


def echo_headers(status: int = 400) -> Answer:
    """An error whose body repeats the request's headers, as some proxies' error pages do (the credentials
    first, where even a short excerpt of the page would show them)."""

    def answer(handler) -> None:
        body(
            {
                "error": f"rejected Authorization: {handler.headers.get('Authorization')}; all you sent: "
                f"{dict(handler.headers)}"
            },
            status=status,
        )(handler)

    return answer


class HostileServer:
    def __init__(self, answers: list[Answer] = (), then: Answer | None = None, models: Answer | None = None):
        self.answers, self.then = list(answers), then or body(GOOD)
        self.models = models or body({"object": "list", "data": []})
        self.requests: list[tuple[str, str, dict]] = []
        self.sent_bytes = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet: the tests read the stage's logs
                pass

            def send(self, data: bytes) -> bool:
                """Write and count; False once the client has gone."""
                try:
                    self.wfile.write(data)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                    return False
                with server.lock:
                    server.sent_bytes += len(data)
                return True

            def record(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with server.lock:
                    server.requests.append((self.command, self.path, dict(self.headers)))

            def do_GET(self) -> None:
                self.record()
                if self.path == "/v1/models":
                    server.models(self)
                else:
                    body({"error": f"no route {self.path}"}, status=404)(self)

            def do_POST(self) -> None:
                self.record()
                if self.path != "/v1/chat/completions":
                    body({"error": f"no route {self.path}"}, status=404)(self)
                    return
                with server.lock:
                    answer = server.answers.pop(0) if server.answers else server.then
                answer(self)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.requests]

    def __enter__(self) -> HostileServer:
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()
