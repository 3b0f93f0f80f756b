"""Shards on a real S3 endpoint (moto's server on loopback, tests/s3_server.py): built there, in one
process or split over tasks and merged, byte for byte the local build; read back, whole or by byte
ranges, sample for sample the local stream."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import fsspec
import numpy as np
import pytest

from data_pipeline.build import build_shards
from data_pipeline.build import main as build_main
from data_pipeline.shards import load_manifest
from data_pipeline.stream import PackedStream
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


def test_a_missing_dataset_on_s3_is_named(s3) -> None:
    url = s3.url("no/such/shards")
    with pytest.raises(ValueError, match=f"cannot read manifest '{url}/manifest.json'"):
        load_manifest(url)
