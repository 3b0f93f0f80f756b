"""A real S3 endpoint for the tests: moto's server mode, started on loopback by the fixtures themselves.

`S3Server` runs `python -m moto.server` in a child process on a free port of 127.0.0.1 (no network,
no account); `S3Env` is one test's view of it: a bucket of its own and the AWS environment variables
that point s3fs (through botocore) at the server. The credentials are fake but distinctive, so that
a test can grep every file a run wrote for them (tests/test_s3_secrets.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.launchers import free_port

ACCESS_KEY = "AKIATESTQ7S3LEAKCHECK"
SECRET_KEY = "s3cr3t-TEST-9f8e7d6c5b4a3-must-never-be-written"
SESSION_TOKEN = "sessi0n-TEST-1a2b3c4d5e6f-must-never-be-written"
SECRETS = (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN)


class S3Server:
    """moto's S3 server in a child process on 127.0.0.1:<free port>; `stop()` ends it."""

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

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@dataclass
class S3Env:
    """One test's bucket on the server and the environment that reaches it (through `endpoint`,
    which may be a fault proxy in front of the server)."""

    endpoint: str
    bucket: str

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_SESSION_TOKEN": SESSION_TOKEN,
            "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def url(self, path: str = "") -> str:
        return f"s3://{self.bucket}/{path}".rstrip("/")

    def child_env(self) -> dict[str, str]:
        """os.environ with this bucket's AWS variables, for a child process."""
        return {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **self.env}


def new_bucket(endpoint: str) -> str:
    """Create a bucket with a fresh name on the server at `endpoint` (a plain PUT: moto needs no auth)."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    request = urllib.request.Request(f"{endpoint}/{name}", method="PUT")
    with urllib.request.urlopen(request, timeout=10):
        pass
    return name


def forget_filesystems() -> None:
    """s3fs caches filesystems by their arguments, not the environment: drop them after it changes."""
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()
