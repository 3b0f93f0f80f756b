"""Shard building: determinism, manifest contents, input formats, webdataset compatibility, tokenizers."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard

from data_pipeline import build as build_cli
from data_pipeline import encode
from data_pipeline import tokenizer as tokenizer_cli
from data_pipeline.build import build_shards
from data_pipeline.shards import decode_shard, load_manifest
from data_pipeline.stream import PackedStream
from data_pipeline.tokenizer import BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, load_tokenizer, train_sentencepiece

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo"


def _tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (shards, manifest, part records) by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _write_docs(root: Path, docs: list[bytes]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (root / f"{i:03d}.txt").write_bytes(d)


def test_byte_vocab_constants() -> None:
    assert EOS_ID == 256 and PAD_ID == 257 and BYTE_VOCAB_SIZE == 258
    tok = load_tokenizer("bytes")
    assert tok.vocab_size == BYTE_VOCAB_SIZE and tok.eos_id == EOS_ID and tok.storage_dtype == np.uint8


def test_build_is_deterministic_and_worker_independent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = [str(DEMO / "train" / "sonnets.txt"), str(DEMO / "train" / "tempest.txt")]
    build_shards(inputs, str(tmp_path / "one"), shard_tokens=50_000)
    build_shards(inputs, str(tmp_path / "two"), shard_tokens=50_000)
    monkeypatch.setattr(encode, "_BATCH_BYTES", 1)  # one document per batch, several in flight
    build_shards(inputs, str(tmp_path / "par"), shard_tokens=50_000, workers=2)
    one = _tree_bytes(tmp_path / "one")
    assert one == _tree_bytes(tmp_path / "two") == _tree_bytes(tmp_path / "par")
    assert len(one) == 2 + 1 + 1  # two shards, the manifest, one part record


def test_manifest_contents(tmp_path: Path) -> None:
    docs = [b"alpha" * 30, b"", b"\xff\xfe raw \x00 bytes", b"beta" * 50]
    _write_docs(tmp_path / "in", docs)
    m = build_shards([str(tmp_path / "in")], str(tmp_path / "out"), shard_tokens=160)
    doc = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert doc["format"] == "recurrent-pretrain-shards" and doc["version"] == 1
    assert doc["dtype"] == "uint8" and doc["num_shards"] == len(doc["shards"]) == 2
    assert doc["total_tokens"] == sum(len(d) for d in docs) and doc["total_documents"] == 3
    assert doc["stats"]["empty_documents"] == 1 and doc["stats"]["input_files"] == 4
    assert doc["tokenizer"]["kind"] == "bytes" and doc["tokenizer"]["vocab_size"] == BYTE_VOCAB_SIZE
    assert doc["build"]["shard_tokens"] == 160 and doc["fingerprint"] == m.fingerprint
    kept = [d for d in docs if d]
    got: list[bytes] = []
    for entry in doc["shards"]:
        raw = (tmp_path / "out" / entry["path"]).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == entry["sha256"] and len(raw) == entry["bytes"]
        tokens, lengths = decode_shard(raw, entry["path"])
        assert tokens.size == entry["tokens"] and lengths.size == entry["documents"]
        for piece in np.split(tokens, np.cumsum(lengths)[:-1]):
            got.append(piece.tobytes())
    assert got == kept


def test_jsonl_and_compressed_inputs(tmp_path: Path) -> None:
    texts = ["first document", "second — non-ASCII ✓", "third"]
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "c.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(b"zstd book"))
    (tmp_path / "notes.bin").write_bytes(b"not a corpus file")
    m = build_shards([str(tmp_path)], str(tmp_path / "out"), shard_tokens=1 << 20)
    assert m.total_documents == 7
    tokens, _ = decode_shard((tmp_path / "out" / m.shards[0]["path"]).read_bytes(), "s")
    joined = "".join(texts).encode()
    assert tokens.tobytes() == joined + joined + b"zstd book"


def test_webdataset_reads_shards(tmp_path: Path) -> None:
    import webdataset as wds

    m = build_shards([str(DEMO / "train" / "sonnets.txt")], str(tmp_path), shard_tokens=1 << 20)
    (sample,) = list(wds.WebDataset(str(tmp_path / m.shards[0]["path"]), shardshuffle=False).decode())
    assert sample["__key__"] == "shard-000000"
    assert sample["tokens.npy"].tobytes() == (DEMO / "train" / "sonnets.txt").read_bytes()
    assert sample["lengths.npy"].tolist() == [m.total_tokens]


def test_cli_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    srcs = [str(DEMO / "train" / "macbeth.txt"), str(DEMO / "train" / "sonnets.txt")]
    args = ["--input", *srcs, "--output", str(tmp_path), "--shard-tokens", "40000", "--no-progress"]
    assert build_cli.main(args) == 0
    assert "wrote 2 shards" in capsys.readouterr().out
    assert load_manifest(str(tmp_path)).total_tokens == sum(Path(p).stat().st_size for p in srcs)


def test_sentencepiece_train_build_stream(tmp_path: Path) -> None:
    """Train a small BPE model, build tokenized shards, stream them; training is deterministic."""
    inputs = [str(DEMO / "train" / "sonnets.txt")]
    prefix = str(tmp_path / "sp")
    assert tokenizer_cli.main(["train", "--input", *inputs, "--vocab-size", "400", "--out", prefix]) == 0
    again = train_sentencepiece(inputs, 400, str(tmp_path / "sp2"))
    tok = load_tokenizer(prefix + ".model")
    assert tok.sha256 == again.sha256 and tok.vocab_size == 400 and tok.eos_id == 2
    docs = ["Shall I compare thee", "bad \xff utf8"]
    _write_docs(tmp_path / "in", [docs[0].encode(), b"bad \xff utf8"])
    m = build_shards([str(tmp_path / "in")], str(tmp_path / "out"), tokenizer=prefix + ".model")
    assert m.dtype == "uint16" and m.tokenizer["sha256"] == tok.sha256
    assert m.stats["invalid_utf8_documents"] == 1
    out = [(str(tmp_path / "out"), 1.0)]
    s = PackedStream(out, seq_len=4, shuffle=False, expected_tokenizer=prefix + ".model")
    ids = [t for g in range(s.samples_per_epoch()[0]) for t in s.get(g)["input_ids"].tolist()]
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    first = sp.encode(docs[0])
    assert ids[: len(first) + 1] == [*first, tok.eos_id]
    tokens, lengths = decode_shard((tmp_path / "out" / m.shards[0]["path"]).read_bytes(), "s")
    # invalid bytes became U+FFFD, which sentencepiece's default nmt_nfkc normalization removes
    assert sp.decode(tokens[int(lengths[0]) :].tolist()) == "bad utf8"


def test_sentencepiece_linewise_encoding_equals_whole_text(tmp_path: Path) -> None:
    import sentencepiece as spm

    book = DEMO / "valid" / "northangerabbey.txt"
    tok = train_sentencepiece([str(book)], 600, str(tmp_path / "sp"), sample_bytes=200_000)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    text = book.read_bytes()[:60_000]
    ids, invalid = tok.encode(text)
    assert not invalid and ids.tolist() == sp.encode(text.decode())


def _build_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m data_pipeline.build ARGS` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "data_pipeline.build", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_built_output_is_replaced_only_with_overwrite_and_nothing_stale_is_left(tmp_path: Path) -> None:
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    plays = [str(DEMO / "train" / name) for name in ("macbeth.txt", "sonnets.txt", "tempest.txt", "hamlet.txt")]
    flags = ["--shard-tokens", "20000", "--no-progress"]  # a shard per play: documents are never split
    assert _build_cli("--input", *plays, "--output", str(out), *flags).returncode == 0
    built = _tree_bytes(out)
    assert sum(name.endswith(".tar") for name in built) == 4

    again = _build_cli("--input", *plays, "--output", str(out), *flags)  # the same build: nothing to do
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr
    assert _tree_bytes(out) == built

    other = ["--input", plays[1], "--output", str(out), *flags]
    refused = _build_cli(*other)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert lines[0].startswith(f"error: {out}: already holds the shards of another build") and "--overwrite" in lines[0]
    assert _tree_bytes(out) == built  # byte for byte

    assert _build_cli(*other, "--overwrite").returncode == 0
    assert _build_cli("--input", plays[1], "--output", str(fresh), *flags).returncode == 0
    assert _tree_bytes(out) == _tree_bytes(fresh)  # no shard or part record of the first build is left


def test_the_progress_bar_counts_input_bytes_against_their_total(tmp_path: Path) -> None:
    proc = _build_cli("--input", str(DEMO / "train" / "sonnets.txt"), "--output", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    size = (DEMO / "train" / "sonnets.txt").stat().st_size
    assert "100%|" in proc.stderr and f"{size / 1000:.1f}k/{size / 1000:.1f}k" in proc.stderr, proc.stderr
