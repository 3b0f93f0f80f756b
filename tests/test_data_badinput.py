"""Bad input: every case is a clear error naming the file, or a counted skip (never silent)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem

from data_pipeline.build import build_shards
from data_pipeline.shards import ManifestError, ShardError
from data_pipeline.sources import expand_inputs
from data_pipeline.stream import PackedStream, StreamLoader, TokenizerMismatchError
from data_pipeline.verify import verify_shards


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    src = tmp_path / "in"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_bytes(rng.integers(0, 256, size=100, dtype=np.uint8).tobytes())
    out = tmp_path / "shards"
    build_shards([str(src)], str(out), shard_tokens=200)
    return out


def _read_all(path: Path, **kw) -> None:
    s = PackedStream([(str(path), 1.0)], seq_len=16, shuffle=False, **kw)
    for g in range(s.samples_per_epoch()[0]):
        s.get(g)


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_truncated_shard(shards: Path) -> None:
    victim = shards / "shard-000001.tar"
    victim.write_bytes(victim.read_bytes()[:300])
    with pytest.raises(ShardError, match=r"shard-000001\.tar.*sha256 mismatch"):
        _read_all(shards)
    with pytest.raises(ShardError, match=r"shard-000001\.tar.*(truncated|not a readable tar)"):
        _read_all(shards, verify=False)


def test_corrupt_tar_header(shards: Path) -> None:
    victim = shards / "shard-000002.tar"
    raw = bytearray(victim.read_bytes())
    raw[100:160] = b"\x07" * 60
    victim.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"shard-000002\.tar.*not a readable tar"):
        _read_all(shards, verify=False)


def test_flipped_token_bytes_caught_by_sha256(shards: Path) -> None:
    victim = shards / "shard-000000.tar"
    raw = bytearray(victim.read_bytes())
    raw[1024 + 200] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"shard-000000\.tar.*sha256 mismatch"):
        _read_all(shards)


def test_swapped_shard_sha_mismatch(shards: Path) -> None:
    shutil.copy(shards / "shard-000000.tar", shards / "shard-000003.tar")
    with pytest.raises(ShardError, match=r"shard-000003\.tar.*sha256 mismatch"):
        _read_all(shards)


def test_manifest_counts_disagree_with_shard(shards: Path) -> None:
    doc = _manifest(shards)
    doc["shards"][0]["tokens"] += 1
    doc["total_tokens"] += 1  # the totals agree, so the shard itself is what disagrees
    (shards / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ShardError, match=r"shard-000000\.tar.*manifest says"):
        _read_all(shards)


def test_missing_shard(shards: Path) -> None:
    (shards / "shard-000002.tar").unlink()
    with pytest.raises(ShardError, match=r"shard-000002\.tar.* is missing"):
        _read_all(shards)


def test_missing_shard_in_dataloader_worker(shards: Path) -> None:
    (shards / "shard-000000.tar").unlink()
    s = PackedStream([(str(shards), 1.0)], seq_len=16, shuffle=False, batch_size=2)
    with pytest.raises(ShardError, match=r"shard-000000\.tar"):
        next(iter(StreamLoader(s, num_workers=1)))


def test_other_tokenizer_manifest(shards: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(shards, other)
    doc = _manifest(other)
    doc["tokenizer"] = {**doc["tokenizer"], "kind": "sentencepiece", "vocab_size": 32000, "sha256": "ab" * 32}
    (other / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(TokenizerMismatchError, match="vocab_size=32000"):
        PackedStream([(str(other), 1.0)], seq_len=16, expected_tokenizer="bytes")
    with pytest.raises(TokenizerMismatchError, match="sources disagree"):
        PackedStream([(str(shards), 1.0), (str(other), 1.0)], seq_len=16)


def test_unreadable_manifest_urls(tmp_path: Path) -> None:
    for url in ("memory://no/such/dir", str(tmp_path / "absent"), "nosuchprotocol://bucket/x"):
        with pytest.raises(ManifestError, match="cannot read manifest"):
            PackedStream([(url, 1.0)], seq_len=8)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        PackedStream([(str(tmp_path), 1.0)], seq_len=8)


def test_unreadable_inputs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="absent"):
        expand_inputs([str(tmp_path / "absent.txt")])
    with pytest.raises(FileNotFoundError, match="matched no files"):
        expand_inputs([str(tmp_path / "*.jsonl")])
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        build_shards([str(tmp_path / "bad.jsonl")], str(tmp_path / "out"))
    (tmp_path / "bad.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: no string field 'text'"):
        build_shards([str(tmp_path / "bad.jsonl")], str(tmp_path / "out"))


def test_only_empty_documents(tmp_path: Path) -> None:
    (tmp_path / "e1.txt").write_bytes(b"")
    (tmp_path / "e2.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="no non-empty documents"):
        build_shards([str(tmp_path / "e*")], str(tmp_path / "out"))


def test_transient_read_errors_are_retried_and_counted(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = LocalFileSystem.cat_file
    failures = {"left": 2}

    def flaky(self, path, *args, **kwargs):
        if path.endswith(".tar") and failures["left"]:
            failures["left"] -= 1
            raise OSError("connection reset")
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "cat_file", flaky)
    s = PackedStream([(str(shards), 1.0)], seq_len=16, shuffle=False)
    s.get(0)
    assert s.stats()["read_retries"] == 2
    failures["left"] = 10
    with pytest.raises(ShardError, match=r"cannot read shard .*shard-0000\d\d\.tar.*: failed 3 times \(2 retries"):
        s.get(s.samples_per_epoch()[0] - 1)


def test_seq_len_longer_than_source(shards: Path) -> None:
    with pytest.raises(ValueError, match="fewer than seq_len"):
        PackedStream([(str(shards), 1.0)], seq_len=10_000)


def test_verify_cli_reports_each_bad_shard(shards: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from data_pipeline.verify import main as verify_main

    assert verify_main([str(shards), "--no-progress"]) == 0
    (shards / "shard-000001.tar").unlink()
    victim = shards / "shard-000003.tar"
    victim.write_bytes(victim.read_bytes()[:-600])
    assert verify_main([str(shards), "--no-progress"]) == 2
    out = capsys.readouterr().out
    assert "shard-000001.tar' is missing" in out and "shard-000003.tar': sha256 mismatch" in out
    assert "2 problem(s)" in out


def test_range_reads_detect_truncation_and_bad_counts(shards: Path) -> None:
    victim = shards / "shard-000001.tar"
    victim.write_bytes(victim.read_bytes()[:700])
    with pytest.raises(ShardError, match=r"shard-000001\.tar.*truncated"):
        _read_all(shards, read="range", verify=False)
    doc = _manifest(shards)
    doc["shards"][0]["documents"] += 1
    doc["total_documents"] += 1  # the totals agree, so the shard itself is what disagrees
    (shards / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ShardError, match=r"shard-000000\.tar.*manifest says"):
        _read_all(shards, read="range", verify=False)


@pytest.mark.parametrize(("key", "delta"), [("total_tokens", 1), ("total_documents", -1), ("num_shards", 1)])
def test_edited_manifest_total_is_refused(shards: Path, key: str, delta: int) -> None:
    doc = _manifest(shards)
    doc[key] += delta
    (shards / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=f"{key} is .* but its shards give"):
        _read_all(shards)
    with pytest.raises(ManifestError, match=key):
        verify_shards(str(shards))


@pytest.mark.parametrize("path", ["../outside.tar", "/etc/passwd", "sub/../../x.tar", "file:///tmp/x.tar"])
def test_manifest_shard_path_must_stay_inside_the_dataset(shards: Path, path: str) -> None:
    doc = _manifest(shards)
    doc["shards"][0]["path"] = path
    (shards / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="must be relative and stay inside"):
        _read_all(shards)


def test_jsonl_with_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid UTF-8"):
        build_shards([str(tmp_path / "bad.jsonl")], str(tmp_path / "out"))


def test_corrupt_parquet_names_the_file(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["a" * 50] * 20}), path, row_group_size=10)
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    with pytest.raises(ValueError, match=r"junk\.parquet: not a readable parquet file"):
        build_shards([str(tmp_path / "junk.parquet")], str(tmp_path / "out1"))
    data = bytearray(path.read_bytes())
    data[8:200] = b"\x00" * 192  # the first row group's pages, the footer intact
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"docs\.parquet: row group 0: cannot be read"):
        build_shards([str(path)], str(tmp_path / "out2"))


def test_data_clis_exit_2_with_one_line_naming_the_file(
    tmp_path: Path, shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from data_pipeline.build import main as build_main
    from data_pipeline.verify import main as verify_main

    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": oops}\n')
    assert build_main(["--input", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.jsonl:2: invalid JSON" in err and "Traceback" not in err
    doc = _manifest(shards)
    doc["total_tokens"] += 5
    (shards / "manifest.json").write_text(json.dumps(doc))
    assert verify_main([str(shards), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "manifest.json" in err and "total_tokens" in err
