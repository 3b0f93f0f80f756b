"""A real S3 endpoint for the tests: moto's server mode, started on loopback by the fixtures themselves
(benchmarks/local_s3.py runs it in a child process on a free port of 127.0.0.1: no network, no account).

`S3Env` is one test's view of it: a bucket of its own and the AWS environment variables that point
s3fs (through botocore) at the server. The credentials are fake but distinctive, so that a test can
grep every file a run wrote for them (tests/test_s3_training.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ACCESS_KEY = "AKIATESTQ7S3LEAKCHECK"
SECRET_KEY = "s3cr3t-TEST-9f8e7d6c5b4a3-must-never-be-written"
SESSION_TOKEN = "sessi0n-TEST-1a2b3c4d5e6f-must-never-be-written"
SECRETS = (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN)


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


def forget_filesystems() -> None:
    """s3fs caches filesystems by their arguments, not the environment: drop them after it changes."""
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()
