"""Faults from outside: a TCP proxy (tests/fault_proxy.py) between this process and the S3 server resets
connections before requests and in the middle of answers, stalls past the read timeout and answers 503
SlowDown. Reading shards and saving and restoring checkpoints through it gives what a clean connection
gives, with the retries counted; a fault that outlasts the retry budget is an error naming the URL
and the attempts, and leaves no step committed."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from data_pipeline import storage
from data_pipeline.build import build_shards
from data_pipeline.shards import ShardError
from data_pipeline.stream import PackedStream
from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.checkpoint.layout import CheckpointError
from pretrain.checkpoint.manifest import committed_steps
from tests.fault_proxy import FaultProxy
from tests.launchers import REPO
from tests.s3_server import forget_filesystems
from tests.test_crash_points import FakeEngine, payload_of, save

BOOKS = REPO / "data" / "demo" / "train"
FAST = storage.RetryPolicy(retries=4, backoff_s=0.01, backoff_max_s=0.05)


@pytest.fixture
def proxy(s3, s3_server) -> FaultProxy:
    proxy = FaultProxy(("127.0.0.1", s3_server.port), stall_s=2.5)
    yield proxy
    proxy.close()


@pytest.fixture
def paragraphs(tmp_path: Path) -> list[str]:
    """Two books as JSONL, a paragraph a document, so that small shards hold several documents each."""
    path = tmp_path / "paragraphs.jsonl"
    texts = [t for book in ("sonnets.txt", "tempest.txt") for t in (BOOKS / book).read_text().split("\n\n") if t]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return [str(path)]


def through(endpoint: str) -> None:
    """New s3:// filesystems of this process reach the store at `endpoint` (read timeout 1 s)."""
    storage.configure(FAST, endpoint_url=endpoint, read_timeout_s=1.0, connect_timeout_s=2.0)
    forget_filesystems()


def _samples(url: str, read: str, block_size: int | None = None,
             proxy: FaultProxy | None = None) -> tuple[list[list[int]], int]:
    """The first samples of a stream and the retries its reads made, counted once every read it
    started (ahead of the samples too) has ended. `proxy` starts faulting every 3rd request once the
    manifest is read, so that every fault falls on a shard read."""
    stream = PackedStream([(url, 1.0)], seq_len=128, seed=5, shuffle_buffer=8, read=read, verify=read == "shard",
                          read_retries=FAST.retries, block_size=block_size)
    if proxy is not None:
        proxy.every = 3
    samples = [s["input_ids"].tolist() for _, s in zip(range(150 if read == "shard" else 40), stream)]
    stream.close(wait=True)
    return samples, stream.stats()["read_retries"]


@pytest.mark.parametrize(("read", "block_size"), [("shard", None), ("range", None), ("range", 200)])
def test_shards_read_through_faults_are_the_clean_samples(s3, proxy: FaultProxy, paragraphs: list[str],
                                                          read: str, block_size: int | None) -> None:
    """Whole shards, and byte ranges in blocks (a block a shard's tokens, and blocks of 200 bytes read by
    the block threads ahead of the samples): the faults are retried, counted, and change no sample.
    Every fault is a failed attempt that the project's retry loop sees and counts: none is retried
    unseen beneath it (aiohttp resent reset and cut requests by itself before ``storage.configure``
    turned that off; the range row counted 2 retries of 11 faults once)."""
    url = s3.url("shards")
    build_shards(paragraphs, url, shard_tokens=1000)
    clean, retries = _samples(url, read, block_size)
    assert retries == 0
    through(proxy.endpoint)
    faulted, retries = _samples(url, read, block_size, proxy)
    assert faulted == clean  # nothing lost, repeated or reordered
    assert set(proxy.done) == {"reset", "midread", "stall", "slowdown"}, proxy.done
    # each injected fault counted (a loaded machine may add read timeouts of its own, counted too)
    assert retries >= proxy.done.total(), (retries, proxy.requests, proxy.done)


def test_checkpoints_through_faults_save_and_restore_exactly(s3, proxy: FaultProxy, tmp_path: Path) -> None:
    through(proxy.endpoint)
    proxy.every = 4
    root = s3.url("run/checkpoints")
    saver = Checkpointer(root, tmp_path / "stage", 2, 0, False)
    for step in (1, 2, 3):
        save(saver, step)
    loader = Checkpointer(root, tmp_path / "stage", 2, 0, False)
    engine = FakeEngine()
    state = loader.resume("auto", engine)
    assert (state["trainer"]["step"], engine.value) == (3, payload_of(3))
    assert committed_steps(root) == ["step_00000003", "step_00000002"]
    # every fault fell on a checkpoint call and was counted by it (none retried unseen beneath ours)
    assert proxy.done.total() >= 3 and saver.retries + loader.retries >= proxy.done.total(), (
        saver.retries, loader.retries, proxy.done)


def test_a_fault_outlasting_the_budget_names_the_url_and_the_attempts(s3, proxy: FaultProxy, paragraphs: list[str],
                                                                       tmp_path: Path) -> None:
    url = s3.url("shards")
    build_shards(paragraphs, url, shard_tokens=1000)
    through(proxy.endpoint)
    proxy.failing(b"shard-000001.tar")
    stream = PackedStream([(url, 1.0)], seq_len=128, shuffle=False, read_retries=FAST.retries)
    with pytest.raises(ShardError, match=rf"cannot read shard '{url}/shard-000001.tar': failed 5 times \(4 retries"):
        list(zip(range(10_000), stream))
    stream.close(wait=True)
    # the budget is the real one: the shard was asked for 5 times, not more (aiohttp resent each reset
    # request once by itself before storage.configure turned that off: 10)
    assert proxy.done == {"reset": FAST.retries + 1}, proxy.done

    root = s3.url("run/checkpoints")
    save(Checkpointer(root, tmp_path / "stage", 2, 0, False), 1)
    proxy.done.clear()
    proxy.plan = lambda n, line: "reset" if line.startswith(b"PUT") and b"step_00000002/manifest.json" in line else None
    with pytest.raises(CheckpointError,
                       match=rf"of step 2: cannot upload '{root}/step_00000002/manifest.json': failed 5"):
        save(Checkpointer(root, tmp_path / "stage", 2, 0, False), 2)
    assert proxy.done == {"reset": FAST.retries + 1}, proxy.done  # 5 PUTs of the manifest, no more
    proxy.plan = lambda n, line: None
    assert committed_steps(root) == ["step_00000001"]  # step 2's files are there, uncommitted
    fs, _ = fsspec.core.url_to_fs(root)
    assert fs.exists(f"{root}/step_00000002/trainer_state.json")
