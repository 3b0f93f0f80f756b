"""Shards on a real S3 endpoint (moto's server on loopback, tests/s3_server.py): built there, in one
process or split over tasks and merged, byte for byte the local build; read back, whole or by byte
ranges, sample for sample the local stream."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fsspec
import numpy as np
import pytest

from data_pipeline.build import build_shards
from data_pipeline.build import main as build_main
from data_pipeline.shards import load_manifest
from data_pipeline.stream import PackedStream, StreamLoader
from tests.launchers import REPO

BOOKS = REPO / "data" / "demo" / "train"
INPUTS = [str(BOOKS / name) for name in ("macbeth.txt", "sonnets.txt", "tempest.txt")]
FLAGS = ["--tokenizer", "bytes", "--shard-tokens", "20000", "--part-bytes", "40000", "--no-progress"]


def _objects(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    return {p[len(root) + 1 :]: fs.cat_file(p) for p in sorted(fs.find(root))}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _samples(source: str, read: str) -> list[list[int]]:
    stream = PackedStream([(source, 1.0)], seq_len=128, seed=3, shuffle_buffer=16, read=read,
                          verify=read == "shard", rank=1, world_size=2)
    return [sample["input_ids"].tolist() for _, sample in zip(range(60), stream)]


@pytest.fixture(scope="module")
def local_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local") / "shards"
    assert build_main(["--input", *INPUTS, "--output", str(out), *FLAGS]) == 0
    return out


def test_build_to_s3_equals_the_local_build(s3, local_build: Path) -> None:
    url = s3.url("shards/train")
    assert build_main(["--input", *INPUTS, "--output", url, *FLAGS]) == 0
    assert _objects(url) == _files(local_build)
    assert load_manifest(url).fingerprint == load_manifest(str(local_build)).fingerprint
    again = build_shards(INPUTS, url, shard_tokens=20000, part_bytes=40000)  # already there: nothing rebuilt
    assert again.fingerprint == load_manifest(url).fingerprint


def test_split_build_on_s3_in_separate_processes_then_merge(s3, local_build: Path) -> None:
    """Two task processes (as a SLURM array would start), each reaching the bucket through the AWS
    variables alone, then the merge: the same objects as one local process."""
    url = s3.url("shards/split")
    for task in range(2):
        command = [sys.executable, "-m", "data_pipeline.build", "--input", *INPUTS, "--output", url, *FLAGS,
                   "--num-tasks", "2", "--task-index", str(task)]
        done = subprocess.run(command, cwd=REPO, env=s3.child_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    fs, _ = fsspec.core.url_to_fs(url)
    assert not fs.exists(f"{url}/manifest.json")  # nothing is readable as a dataset before the merge
    assert build_main(["--input", *INPUTS, "--output", url, *FLAGS, "--num-tasks", "2", "--merge"]) == 0
    assert _objects(url) == _files(local_build)


@pytest.mark.parametrize("read", ["shard", "range"])
def test_streaming_from_s3_gives_the_local_samples(s3, local_build: Path, read: str) -> None:
    fs, _ = fsspec.core.url_to_fs(s3.url())
    fs.put(str(local_build) + "/", s3.url("copied") + "/", recursive=True)
    remote, local = _samples(s3.url("copied"), read), _samples(str(local_build), read)
    assert len(remote) == 60 and remote == local
    assert np.unique(np.array(remote)).size > 20  # real text, not a constant


def test_build_and_verify_reach_the_store_through_their_storage_flags(s3, local_build: Path, tmp_path: Path) -> None:
    """No AWS_ENDPOINT_URL in the environment: the endpoint comes from --config (a run config's
    `storage` section) or --storage, the settings a run's config gives the trainer."""
    env = {k: v for k, v in s3.child_env().items() if k != "AWS_ENDPOINT_URL"}
    config = tmp_path / "run.yaml"
    config.write_text(f"storage:\n  endpoint_url: {s3.endpoint}\n  retries: 2\n")
    url = s3.url("flagged")
    commands = [
        ["data_pipeline.build", "--input", *INPUTS, "--output", url, *FLAGS, "--config", str(config)],
        ["data_pipeline.verify", url, "--no-progress", "--storage", f"endpoint_url={s3.endpoint}"],
    ]
    for command in commands:
        done = subprocess.run([sys.executable, "-m", *command], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (command[0], done.stdout[-2000:], done.stderr[-2000:])
    assert "0 problem(s)" in done.stdout
    assert _objects(url) == _files(local_build)
    bad = subprocess.run([sys.executable, "-m", "data_pipeline.build", "--input", *INPUTS, "--output", url, *FLAGS,
                          "--storage", "retries=-1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "<command line>: storage.retries: must be >= 0" in bad.stderr, bad.stderr[-2000:]


def _paragraph_shards(tmp_path: Path, out: str) -> None:
    """Two plays as JSONL, a paragraph a document: shards of many documents (EOS inside samples)."""
    path = tmp_path / "paragraphs.jsonl"
    texts = [t for book in ("macbeth.txt", "tempest.txt") for t in (BOOKS / book).read_text().split("\n\n") if t]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    build_shards([str(path)], out, shard_tokens=30_000)


@pytest.mark.parametrize("prefetch", [True, False])
def test_block_reads_from_s3_give_the_local_samples_within_their_memory_bound(s3, tmp_path: Path,
                                                                             prefetch: bool) -> None:
    """Range reads on the store come in blocks: blocks far smaller than a sample (so a sample spans
    several, and a block several documents) and a cache far smaller than a shard give the samples of
    local range reads, in the same order, on every rank; the cache never holds more than its budget,
    and no block is read twice while a sample still needs it."""
    local = str(tmp_path / "shards")
    _paragraph_shards(tmp_path, local)
    fs, _ = fsspec.core.url_to_fs(s3.url())
    fs.put(local + "/", s3.url("blocks") + "/", recursive=True)
    for rank in (0, 1, 2):
        args = dict(seq_len=100, seed=4, shuffle_buffer=4, read="range", verify=False, rank=rank, world_size=3,
                    prefetch=prefetch)
        remote = PackedStream([(s3.url("blocks"), 1.0)], block_size=96, **args)
        reader = remote._sources[0].reader
        most, got = 0, []
        for _, sample in zip(range(250), remote):
            got.append(sample["input_ids"].tolist())
            most = max(most, reader._block_bytes)
        want = [s["input_ids"].tolist() for _, s in zip(range(250), PackedStream([(local, 1.0)], **args))]
        assert got == want and len(got) == 250
        stats = remote.stats()
        assert 0 < most <= reader.block_budget and stats["cache_evictions"] > 0, (most, stats)
        # a rank's samples are a third of the stream: blocks of 96 bytes read little more than them
        assert stats["shard_bytes_read"] < 0.8 * 250 * 101 * 3, stats
        if prefetch:
            assert remote._read_ahead >= 16 and stats["prefetched"] > 0


def test_interleaved_windows_let_a_rank_fetch_blocks_of_its_own_samples(s3, tmp_path: Path) -> None:
    """At 4 ranks a rank's samples lie every 4th in the stream, so each block of the store holds all
    ranks' samples and a rank fetches about 4 times the bytes it uses. With interleave 16 a rank reads
    4 consecutive windows of each span of 16: its blocks hold mostly its own samples. The samples are
    those of local range reads with the same interleave, on every rank, and the block cache stays
    within its bound (sized to the 4 windows a rank reads side by side)."""
    local = str(tmp_path / "shards")
    _paragraph_shards(tmp_path, local)
    fs, _ = fsspec.core.url_to_fs(s3.url())
    fs.put(local + "/", s3.url("laid") + "/", recursive=True)
    samples, seq_len = 120, 100
    for rank in (0, 3):
        fetched = {}
        for interleave in (1, 16):
            args = dict(seq_len=seq_len, seed=4, shuffle_buffer=8, read="range", verify=False, rank=rank, world_size=4,
                        interleave=interleave)
            remote = PackedStream([(s3.url("laid"), 1.0)], block_size=800, **args)
            reader, most, got = remote._sources[0].reader, 0, []
            for _, x in zip(range(samples), remote):
                got.append(x["input_ids"].tolist())
                most = max(most, reader._block_bytes)
            assert most <= reader.block_budget
            want = [x["input_ids"].tolist() for _, x in zip(range(samples), PackedStream([(local, 1.0)], **args))]
            assert got == want
            fetched[interleave] = remote.stats()["shard_bytes_read"]
            remote.close()
        used = samples * (seq_len + 1)  # at most (byte-level: a byte a token, EOS not stored)
        assert fetched[1] > 2.5 * used and fetched[16] < 1.6 * used, fetched


def test_block_reads_from_s3_in_data_loader_workers_and_a_mixture_give_the_local_batches(s3, tmp_path: Path) -> None:
    """Two sources read in blocks by two data-loader workers (each plans its own read-ahead, its threads
    made after the fork): the batches of local range reads, in order."""
    local = [str(tmp_path / "a"), str(tmp_path / "b")]
    _paragraph_shards(tmp_path, local[0])
    build_shards(INPUTS[:2], local[1], shard_tokens=20_000)
    fs, _ = fsspec.core.url_to_fs(s3.url())
    for name, path in zip("ab", local):
        fs.put(path + "/", s3.url(name) + "/", recursive=True)
    args = dict(seq_len=64, seed=2, shuffle_buffer=8, read="range", verify=False, rank=1, world_size=2,
                batch_size=4)

    def batches(sources: list[str], **extra: int) -> list[list[list[int]]]:
        stream = PackedStream([(sources[0], 0.7), (sources[1], 0.3)], **args, **extra)
        loader = StreamLoader(stream, num_workers=2)
        return [b["input_ids"].tolist() for _, b in zip(range(40), loader)]

    assert batches([s3.url("a"), s3.url("b")], block_size=512) == batches(local)


def test_a_missing_dataset_on_s3_is_named(s3) -> None:
    url = s3.url("no/such/shards")
    with pytest.raises(ValueError, match=f"cannot read manifest '{url}/manifest.json'"):
        load_manifest(url)
