"""Shared fixtures: tiny byte-level shard sets built from the repository's demo corpus.

The whole test process runs Triton kernels in the interpreter, on CPU tensors: TRITON_INTERPRET must be
set before any Triton kernel is decorated, and test modules import kernel modules at collection in an
order nothing controls (benchmarks.kernel_compile imports kernels.span, say). The compile gate compiles
real GPU kernels in a subprocess that drops the variable (tests/test_kernels_compile.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from data_pipeline.build import build_shards

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo"


@pytest.fixture
def one_thread() -> Iterator[int]:
    """Torch on one thread for a test (tiny shapes gain nothing from threads on a shared machine, and
    some results are compared with runs pinned to one core); yields the count it replaced, for a test
    with large matmuls to restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield threads
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Byte-level train shards (two plays, several shards) and validation shards (one book)."""
    root = tmp_path_factory.mktemp("shards")
    train = [str(DEMO / "train" / name) for name in ("hamlet.txt", "macbeth.txt")]
    build_shards(train, str(root / "train"), tokenizer="bytes", shard_tokens=60_000)
    build_shards([str(DEMO / "valid" / "northangerabbey.txt")], str(root / "valid"), tokenizer="bytes")
    return {"train": str(root / "train"), "valid": str(root / "valid")}


@pytest.fixture(autouse=True, scope="session")
def private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Certified SOE kernels are cached on disk; tests keep theirs out of the user's home."""
    import os

    os.environ["RECURRENT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """moto's S3 server on loopback for the whole session (benchmarks/local_s3.py), stopped at the end."""
    from benchmarks.local_s3 import LocalS3

    server = LocalS3(tmp_path_factory.mktemp("moto") / "server.log")
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A fresh bucket on the test S3 server, with this process's AWS variables pointing at it; the
    fsspec settings and retry policy a test changes are put back afterwards."""
    import copy

    import fsspec

    from data_pipeline import storage
    from tests.s3_server import S3Env, forget_filesystems

    env = S3Env(s3_server.endpoint, s3_server.new_bucket())
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in env.env.items():
        monkeypatch.setenv(key, value)
    from s3fs import S3FileSystem

    saved = copy.deepcopy(fsspec.config.conf), storage.retry_policy(), S3FileSystem.retries
    monkeypatch.setattr(storage, "_block_size", storage.block_size())  # put back by monkeypatch
    forget_filesystems()
    yield env
    fsspec.config.conf.clear()
    fsspec.config.conf.update(saved[0])
    storage.set_retry_policy(saved[1])
    S3FileSystem.retries = saved[2]
    forget_filesystems()
