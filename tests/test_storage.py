"""The retry layer of data_pipeline/storage.py without a server: backoff bounds, what is retried, the
error after the budget, credentials kept out of messages and configs."""

from __future__ import annotations

import random

import pytest

from data_pipeline import storage
from pretrain.config import ConfigError, config_from_dict


def test_backoff_is_exponential_with_full_jitter_and_capped() -> None:
    policy = storage.RetryPolicy(retries=6, backoff_s=0.5, backoff_max_s=4.0)
    random.seed(0)
    for attempt in range(8):
        waits = [policy.delay(attempt) for _ in range(2000)]
        cap = min(4.0, 0.5 * 2**attempt)
        assert min(waits) >= 0 and max(waits) <= cap
        assert max(waits) > 0.9 * cap and min(waits) < 0.1 * cap  # drawn over the whole range
    assert policy.worst_case_s() == 0.5 + 1 + 2 + 4 + 4 + 4


def test_retries_then_a_clear_error_and_permanent_errors_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage, "_policy", storage.RetryPolicy(retries=3, backoff_s=0.001, backoff_max_s=0.002))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value-123")
    calls, counted = [], []

    def flaky() -> bytes:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return b"ok"

    assert storage.retrying("s3://b/k", flaky, counted.append) == b"ok"
    assert len(calls) == 3 and counted == [1, 1]

    def down() -> bytes:
        raise TimeoutError("signature for very-secret-value-123 timed out")

    with pytest.raises(storage.StorageError) as err:
        storage.retrying("s3://b/k", down, what="read")
    message = str(err.value)
    assert message.startswith("cannot read 's3://b/k': failed 4 times (3 retries")
    assert "very-secret-value-123" not in message and "<redacted>" in message

    calls.clear()

    def missing() -> bytes:
        calls.append(1)
        raise FileNotFoundError("s3://b/k")

    with pytest.raises(FileNotFoundError):
        storage.retrying("s3://b/k", missing)
    assert len(calls) == 1


def test_credentials_in_the_storage_section_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"storage.endpoint_url.*must not hold credentials"):
        config_from_dict({"storage": {"endpoint_url": "https://AKIA:secret@minio.local:9000"}})
    cfg = config_from_dict({"storage": {"endpoint_url": "http://minio.local:9000", "retries": 2}})
    assert cfg.storage.retries == 2
    with pytest.raises(ConfigError, match=r"storage.backoff_max_s"):
        config_from_dict({"storage": {"backoff_s": 2.0, "backoff_max_s": 1.0}})
    with pytest.raises(ConfigError, match=r"storage.options: secret would save a credential"):
        config_from_dict({"storage": {"options": {"profile": "lab", "secret": "x"}}})


def test_the_tools_take_the_storage_section_of_a_config_and_flags_after_it(tmp_path, monkeypatch) -> None:
    """data_pipeline.build, data_pipeline.verify and pretrain.export read the same settings a run's
    `storage` section holds: --config FILE's section (extends followed), then --storage KEY=VALUE."""
    import argparse

    import fsspec

    (tmp_path / "base.yaml").write_text("storage:\n  endpoint_url: http://127.0.0.1:9\n  retries: 3\n")
    (tmp_path / "run.yaml").write_text("extends: base.yaml\nstorage:\n  region: eu-west-1\n")
    parser = argparse.ArgumentParser()
    storage.add_arguments(parser)
    args = parser.parse_args(["--config", str(tmp_path / "run.yaml"), "--storage", "retries=4",
                              "--storage", "options.requester_pays=true", "--storage", "block_size=1048576"])
    monkeypatch.setattr(fsspec.config, "conf", {})
    monkeypatch.setattr(storage, "_policy", storage.retry_policy())
    monkeypatch.setattr(storage, "_block_size", storage.block_size())
    from s3fs import S3FileSystem

    monkeypatch.setattr(S3FileSystem, "retries", S3FileSystem.retries)
    settings = storage.configure_from_args(args)
    assert (settings.endpoint_url, settings.region, settings.retries) == ("http://127.0.0.1:9", "eu-west-1", 4)
    s3 = fsspec.config.conf["s3"]
    assert s3["endpoint_url"] == "http://127.0.0.1:9" and s3["client_kwargs"] == {"region_name": "eu-west-1"}
    assert s3["requester_pays"] is True and s3["default_block_size"] == 1 << 20 == storage.block_size()
    assert storage.retry_policy().retries == 4
    with pytest.raises(ConfigError, match=r"<command line>: storage.options: key would save a credential"):
        storage.settings_from_args(parser.parse_args(["--storage", "options.key=AKIA123"]))
    with pytest.raises(ConfigError, match=r"storage.retrys: unknown key"):
        storage.settings_from_args(parser.parse_args(["--storage", "retrys=3"]))
