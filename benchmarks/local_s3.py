"""A local S3 endpoint: moto's server mode in a child process on 127.0.0.1 (no network, no account).

The tests start one from their fixtures (tests/s3_server.py) and ``python -m benchmarks.object_store``
measures against one; moto comes with the project's ``[s3]`` extra.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalS3:
    """moto's S3 server on 127.0.0.1:<free port>, its output in `log`; `stop()` ends it."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")  # noqa: SIM115 - open for the server's life
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2):
                    break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"moto server did not start (see {log})") from None
                time.sleep(0.2)

    def new_bucket(self) -> str:
        """Create a bucket with a fresh name (a plain PUT: moto needs no signature for it)."""
        name = f"bucket-{uuid.uuid4().hex[:12]}"
        with urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{name}", method="PUT"), timeout=10):
            pass
        return name

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
