"""A fault-injecting TCP proxy for the S3 tests, on loopback between the client and moto's server.

Each HTTP request the client sends (a chunk starting with a method name opens one) gets a number;
`FaultProxy.plan(n, request_line)` says what happens to it:

- None: forwarded untouched;
- "reset": the connection is reset (RST) before the request reaches the server;
- "midread": the request is forwarded and the connection reset after the first bytes of the answer
  (a response cut mid-body);
- "stall": nothing is forwarded and nothing answered for `stall_s` seconds (past the client's read
  timeout), then the connection is closed;
- "slowdown": the proxy answers 503 SlowDown itself, as S3 does under load.

The default plan faults every `every`-th request, cycling through the four kinds; `failing(pattern)`
makes every request whose request line holds `pattern` fail (a fault outlasting any retry budget).
Counts of what was done are in `done`. `delay_s` holds every request back that long (a store's latency).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

METHODS = (b"GET ", b"PUT ", b"POST ", b"HEAD ", b"DELETE ")
KINDS = ("reset", "midread", "stall", "slowdown")
SLOWDOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b"<Message>Please reduce your request rate.</Message></Error>")


def _reset(sock: socket.socket) -> None:
    """Close with an RST rather than a FIN (SO_LINGER 0): the peer sees 'connection reset'."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """Listens on 127.0.0.1:<free port> and forwards to `upstream` (host, port), faulting per plan."""

    def __init__(self, upstream: tuple[str, int], every: int = 0, stall_s: float = 3.0, delay_s: float = 0.0) -> None:
        self.upstream, self.every, self.stall_s, self.delay_s = upstream, every, stall_s, delay_s
        self.plan: Callable[[int, bytes], str | None] = self._cycle
        self.requests = 0
        self.done: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _cycle(self, n: int, line: bytes) -> str | None:
        if self.every and n % self.every == 0:
            return KINDS[(n // self.every) % len(KINDS)]
        return None

    def failing(self, pattern: bytes) -> None:
        """From now on, every request whose request line holds `pattern` is reset."""
        self.plan = lambda n, line: "reset" if pattern in line else None

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._server.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            _reset(client)
            return
        cut = threading.Event()  # set when the answer to the current request is to be cut short
        threading.Thread(target=self._answers, args=(server, client, cut), daemon=True).start()
        try:
            while True:
                chunk = client.recv(1 << 16)
                if not chunk:
                    break
                if chunk.startswith(METHODS):
                    with self._lock:
                        self.requests += 1
                        n = self.requests
                    fault = self.plan(n, chunk.split(b"\r\n", 1)[0])
                    if fault is not None:
                        self.done[fault] += 1
                    if fault == "reset":
                        break
                    if fault == "stall":
                        self._stop.wait(self.stall_s)
                        break
                    if fault == "slowdown":
                        with contextlib.suppress(OSError):
                            client.sendall(SLOWDOWN % (len(SLOWDOWN_BODY), SLOWDOWN_BODY))
                        time.sleep(0.05)
                        break
                    if fault == "midread":
                        cut.set()
                    if self.delay_s:  # a remote store's round trip, for benchmarks.object_store --latency-ms
                        time.sleep(self.delay_s)
                server.sendall(chunk)
        except OSError:
            pass
        _reset(client)
        _reset(server)

    def _answers(self, server: socket.socket, client: socket.socket, cut: threading.Event) -> None:
        try:
            while True:
                data = server.recv(1 << 16)
                if not data:
                    break
                if cut.is_set():  # a few bytes of the answer, then the connection dies
                    client.sendall(data[:64])
                    break
                client.sendall(data)
        except OSError:
            pass
        _reset(client)
        _reset(server)
