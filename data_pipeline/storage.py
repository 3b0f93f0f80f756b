"""Object storage (s3://, gs://, any fsspec URL): one retry layer, the store's settings, no secrets in text.

Every call this project makes to a remote store (shard and manifest reads and writes, checkpoint
uploads, downloads and listings) goes through ``retrying``: a failed call is retried after an
exponential backoff with full jitter (a wait drawn uniformly from ``[0, min(backoff_max_s,
backoff_s * 2**attempt)]``), at most ``retries`` times, and each retry is counted where the caller
says (``data/read_retries``, ``ckpt/retries`` in metrics.jsonl). s3fs and botocore retry on their own
as well; ``configure`` turns theirs down to one attempt, so that this layer is the only one: its
retries are counted, bounded and documented (docs/data.md, "Object storage"). A missing object or a
refused permission is not retried. When the budget is spent the error names the URL and the
attempts made.

Credentials are never configured here: they come from the store's usual places (for S3: the
``AWS_*`` environment variables, ``~/.aws``, an instance role), so that they never enter a config
file, a run directory, a checkpoint or an export. ``redact`` removes any that reach a message.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import fsspec

T = TypeVar("T")

SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID",
              "GOOGLE_APPLICATION_CREDENTIALS_JSON")
"""Environment variables whose values must never appear in text this project writes."""
class StorageError(OSError):
    """A remote call still failing after the retry budget; the message names the URL and the attempts."""


@dataclass(frozen=True)
class RetryPolicy:
    """How failed remote calls are retried: at most ``retries`` more attempts, the n-th after a wait
    drawn uniformly from ``[0, min(backoff_max_s, backoff_s * 2**n)]`` (full jitter: ranks that fail
    together do not retry together)."""

    retries: int = 5
    backoff_s: float = 0.5
    backoff_max_s: float = 20.0

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(f"retry policy needs retries >= 0 and 0 <= backoff_s <= backoff_max_s, got {self}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        return random.uniform(0.0, min(self.backoff_max_s, self.backoff_s * 2.0**attempt))

    def worst_case_s(self) -> float:
        """The longest the waits of one call can add up to (the documented limit)."""
        return sum(min(self.backoff_max_s, self.backoff_s * 2.0**n) for n in range(self.retries))


_policy = RetryPolicy()


def retry_policy() -> RetryPolicy:
    """The policy of this process (``configure`` sets it; forked workers inherit it)."""
    return _policy


def set_retry_policy(policy: RetryPolicy) -> None:
    global _policy
    _policy = policy


def _transient_types() -> tuple[type[BaseException], ...]:
    """What a flaky store raises: OS and timeout errors (s3fs maps HTTP errors onto OSError), and
    the HTTP clients' own errors that s3fs passes through (read timeouts, dropped connections)."""
    types: list[type[BaseException]] = [OSError, TimeoutError, ValueError]
    try:
        from botocore.exceptions import BotoCoreError

        types.append(BotoCoreError)
    except ImportError:
        pass
    try:
        from aiohttp import ClientError

        types.append(ClientError)
    except ImportError:
        pass
    return tuple(types)


_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def retrying(
    url: str, call: Callable[[], T], count: Callable[[int], None] | None = None,
    on_error: Callable[[], None] | None = None, retries: int | None = None, what: str = "access",
) -> T:
    """``call()`` under the process's retry policy (``retries`` overrides its count). ``count(1)``
    runs for each retry made, ``on_error()`` after each failure (e.g. to drop a cached handle).
    A missing object or a refused permission raises at once; a failure outlasting the budget raises
    ``StorageError`` naming ``url``, the attempts and the last error (with secrets removed)."""
    policy = retry_policy()
    budget = policy.retries if retries is None else retries
    transient = _transient_types()
    for attempt in range(budget + 1):
        try:
            return call()
        except _PERMANENT:
            raise
        except transient as err:
            if on_error is not None:
                on_error()
            if attempt == budget:
                raise StorageError(
                    f"cannot {what} {url!r}: failed {budget + 1} times ({budget} retries, backoff "
                    f"{policy.backoff_s}-{policy.backoff_max_s} s with jitter): {redact(str(err))}"
                ) from None
            if count is not None:
                count(1)
            time.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")


def redact(text: str) -> str:
    """``text`` with the value of every credential variable of SECRET_ENV replaced by ``<redacted>``."""
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "<redacted>")
    return text


def configure(
    policy: RetryPolicy, endpoint_url: str | None = None, region: str | None = None,
    read_timeout_s: float = 60.0, connect_timeout_s: float = 10.0, block_size: int | None = None,
) -> None:
    """Set this process's retry policy and the defaults fsspec gives every new ``s3://``
    filesystem: one attempt per call inside s3fs and botocore (this module retries), the
    timeouts, and the endpoint, region and read block size when given (else the AWS environment's:
    ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``). Credentials are left to the environment."""
    set_retry_policy(policy)
    try:
        from s3fs import S3FileSystem

        S3FileSystem.retries = 1  # s3fs's own loop (a class setting, not an option)
    except ImportError:
        pass
    s3 = fsspec.config.conf.setdefault("s3", {})
    config_kwargs = dict(s3.get("config_kwargs", {}))
    config_kwargs.update(retries={"total_max_attempts": 1, "mode": "standard"}, read_timeout=read_timeout_s,
                         connect_timeout=connect_timeout_s)
    s3["config_kwargs"] = config_kwargs
    if endpoint_url:
        s3["endpoint_url"] = endpoint_url
    if region:
        s3["client_kwargs"] = {**s3.get("client_kwargs", {}), "region_name": region}
    if block_size:
        s3["default_block_size"] = int(block_size)
    _forget_filesystems()


def _forget_filesystems() -> None:
    """Drop fsspec's cached filesystem instances, so the next one is made with the new settings."""
    try:
        from s3fs import S3FileSystem

        S3FileSystem.clear_instance_cache()
    except ImportError:
        pass


def is_remote(url: str) -> bool:
    """Whether ``url`` names something other than a local file (a protocol other than file://)."""
    text = str(url)
    return "://" in text and not text.startswith("file://")
