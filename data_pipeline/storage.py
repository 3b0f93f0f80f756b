"""Object storage (s3://, gs://, any fsspec URL): one retry layer, the store's settings, no secrets in text.

Every call this project makes to a remote store (shard and manifest reads and writes, checkpoint
uploads, downloads and listings) goes through ``retrying``: a failed call is retried after an
exponential backoff with full jitter (a wait drawn uniformly from ``[0, min(backoff_max_s,
backoff_s * 2**attempt)]``), at most ``retries`` times, and each retry is counted where the caller
says (``data/read_retries``, ``ckpt/retries`` in metrics.jsonl). s3fs, botocore and aiohttp retry on
their own as well; ``configure`` turns theirs down to one attempt, so that this layer is the only one:
its retries are counted, bounded and documented (docs/data.md, "Object storage"). A missing object or a
refused permission is not retried. When the budget is spent the error names the URL and the
attempts made.

Credentials are never configured here: they come from the store's usual places (for S3: the
``AWS_*`` environment variables, ``~/.aws``, an instance role, a named ``profile``), so that they never
enter a config file, a run directory, a checkpoint or an export. ``redact`` removes any that reach a
message.

``StorageSettings`` is the one home of these settings: a run config's ``storage`` section is one, and
the command-line tools (``data_pipeline.build``, ``pretrain.export``) build one from ``--config FILE``
(that file's ``storage`` section) and ``--storage KEY=VALUE`` (``add_arguments``,
``configure_from_args``); ``apply`` gives it to this process.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

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


@functools.cache
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


DEFAULT_BLOCK_SIZE = 8 << 20
"""Bytes of one read request of range reads on an object store, unless ``storage.block_size`` says
otherwise (docs/data.md, "Reading"): 8 MiB, a few tens of ms of one connection's bandwidth, so that a
request's fixed cost (a round trip, the server's per-request work) is small beside its transfer."""

_block_size = DEFAULT_BLOCK_SIZE


def block_size() -> int:
    """This process's read block size for object stores (``configure`` sets it; forked workers inherit it)."""
    return _block_size


def configure(
    policy: RetryPolicy, endpoint_url: str | None = None, region: str | None = None,
    read_timeout_s: float = 60.0, connect_timeout_s: float = 10.0, block_size: int | None = None,
    options: dict[str, Any] | None = None, single_attempt: bool = True,
) -> None:
    """Set this process's retry policy and the defaults fsspec gives every new ``s3://``
    filesystem: one attempt per call inside s3fs, botocore and aiohttp (this module retries; with
    ``single_attempt=False`` their own retries stay, for a tool that also streams inputs outside this
    module's loop), the timeouts, the endpoint, region and block size when given (else the AWS
    environment's: ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``), and any other s3fs ``options``
    (``StorageSettings.options``). Credentials are left to the environment."""
    global _block_size
    set_retry_policy(policy)
    _block_size = int(block_size) if block_size else DEFAULT_BLOCK_SIZE
    if single_attempt:
        try:
            from s3fs import S3FileSystem

            S3FileSystem.retries = 1  # s3fs's own loop (a class setting, not an option)
        except ImportError:
            pass
    s3 = fsspec.config.conf.setdefault("s3", {})
    config_kwargs = dict(s3.get("config_kwargs", {}))
    if single_attempt:
        config_kwargs.update(retries={"total_max_attempts": 1, "mode": "standard"})
        session = _one_attempt_http_session()
        if session is not None:
            config_kwargs["http_session_cls"] = session
    else:
        config_kwargs.pop("http_session_cls", None)
    config_kwargs.update(read_timeout=read_timeout_s, connect_timeout=connect_timeout_s)
    s3["config_kwargs"] = config_kwargs
    if endpoint_url:
        s3["endpoint_url"] = endpoint_url
    if region:
        s3["client_kwargs"] = {**s3.get("client_kwargs", {}), "region_name": region}
    s3["default_block_size"] = _block_size
    for key, value in (options or {}).items():
        s3[key] = value
    _forget_filesystems()


def _one_attempt_http_session() -> type | None:
    """aiobotocore's HTTP session without aiohttp's silent second try (``data_pipeline.s3_session``),
    or None where aiobotocore is not installed."""
    try:
        from data_pipeline.s3_session import OneAttemptAIOHTTPSession
    except ImportError:
        return None
    return OneAttemptAIOHTTPSession


CREDENTIAL_OPTIONS = ("key", "secret", "token", "password", "access_key", "secret_key", "session_token",
                      "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "credentials")
"""fsspec/s3fs storage options that carry a secret: refused in settings, which are saved with a run."""


def _check_range(key: str, value: float, low: float, low_open: bool = False) -> None:
    if value < low or (low_open and value == low):
        raise ValueError(f"{key}: must be {'>' if low_open else '>='} {low}, got {value!r}")


@dataclass
class StorageSettings:
    """Object storage (s3:// and other fsspec URLs in data.train, checkpoint.dir, init.from, a build's
    --output, an export's --checkpoint and --out): the retry policy of every remote call and the
    settings of new s3:// filesystems. Null: the AWS environment's (AWS_ENDPOINT_URL,
    AWS_DEFAULT_REGION). Credentials never go here, where they would be saved with the run: they
    come from the AWS variables or files (``options: {profile: name}`` picks a profile of ~/.aws)."""

    retries: int = 5
    backoff_s: float = 0.5
    backoff_max_s: float = 20.0
    read_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    endpoint_url: str | None = None
    region: str | None = None
    # bytes of one range-read request on a store (null: DEFAULT_BLOCK_SIZE), and of an opened remote file's reads
    block_size: int | None = None
    # any other s3fs option (profile, requester_pays, ...), as fsspec storage options; never a credential
    options: dict[str, int | float | bool | str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_range("retries", self.retries, 0)
        _check_range("backoff_s", self.backoff_s, 0)
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff_max_s: must be >= backoff_s ({self.backoff_s}), got {self.backoff_max_s!r}")
        _check_range("read_timeout_s", self.read_timeout_s, 0, low_open=True)
        _check_range("connect_timeout_s", self.connect_timeout_s, 0, low_open=True)
        if self.block_size is not None:
            _check_range("block_size", self.block_size, 1)
        if self.endpoint_url is not None and "@" in self.endpoint_url.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError("endpoint_url: must not hold credentials (user:secret@host); set them in the AWS "
                             "environment variables, which are never saved")
        secret = sorted(k for k in self.options if k.lower() in CREDENTIAL_OPTIONS)
        if secret:
            raise ValueError(f"options: {', '.join(secret)} would save a credential with the run; set it in the AWS "
                             "environment variables or ~/.aws (options.profile names a profile there)")

    def policy(self) -> RetryPolicy:
        return RetryPolicy(self.retries, self.backoff_s, self.backoff_max_s)


def apply(settings: StorageSettings, single_attempt: bool = True) -> None:
    """Give ``settings`` to this process (``configure``): every tool's one way in."""
    configure(settings.policy(), settings.endpoint_url, settings.region, settings.read_timeout_s,
              settings.connect_timeout_s, settings.block_size, settings.options, single_attempt)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The storage flags of a command-line tool: ``--config FILE`` (the ``storage`` section of a run
    config, ``extends`` followed) and ``--storage KEY=VALUE`` (repeatable; a key of that section,
    ``options.NAME`` for an s3fs option), applied after the file's."""
    group = parser.add_argument_group("object storage (docs/data.md, 'Object storage')")
    group.add_argument("--config", default=None, metavar="FILE",
                       help="a run config whose `storage` section applies (endpoint, region, retries, block size)")
    group.add_argument("--storage", action="append", default=[], metavar="KEY=VALUE",
                       help="a `storage` setting, e.g. endpoint_url=http://127.0.0.1:9000 or options.profile=lab "
                       "(repeatable; after --config's)")


def settings_from_args(args: argparse.Namespace) -> StorageSettings:
    """The ``StorageSettings`` of ``add_arguments``' flags, validated as a run config's section is
    (a bad value raises ``model.config_loader.ConfigError`` naming the flag or the file)."""
    from model.config_loader import apply_overrides, build_config, read_tree

    overrides = [f"storage.{item}" for item in args.storage]
    if args.config:
        tree, sources = read_tree(args.config, overrides)
    else:
        tree, sources = {}, {}
        apply_overrides(tree, overrides, sources)
    section = tree.get("storage") or {}
    return build_config(StorageSettings, section, sources, prefix="storage")


def configure_from_args(args: argparse.Namespace, single_attempt: bool = True) -> StorageSettings:
    """``apply`` the settings of ``add_arguments``' flags; returns them."""
    settings = settings_from_args(args)
    apply(settings, single_attempt)
    return settings


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
