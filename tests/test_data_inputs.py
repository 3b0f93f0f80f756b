"""Input formats: parquet by row groups, JSONL with every compression, hf:// paths, refusal of others."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import _registry as fsspec_registry

from data_pipeline.build import build_shards
from data_pipeline.shards import decode_shard
from data_pipeline.sources import expand_inputs
from data_pipeline.stream import PackedStream

TEXTS = [
    "The first document, plain ASCII.",
    "second — non-ASCII ✓ and a\nnewline",
    "",
    "third " * 40,
    "ünïcödé fourth",
    "fifth: the last one",
    "sixth",
]


def _write_parquet(path: str, texts: list[str | None], rows_per_group: int = 2, fs=None) -> None:
    table = pa.table({"id": list(range(len(texts))), "text": texts})
    if fs is None:
        pq.write_table(table, path, row_group_size=rows_per_group)
    else:
        with fs.open(path, "wb") as f:
            pq.write_table(table, f, row_group_size=rows_per_group)


def _jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def _tokens(out: Path) -> bytes:
    manifest = json.loads((out / "manifest.json").read_text())
    return b"".join(decode_shard((out / e["path"]).read_bytes(), e["path"])[0].tobytes() for e in manifest["shards"])


def _samples(out: Path) -> list[list[int]]:
    s = PackedStream([(str(out), 1.0)], seq_len=16, seed=3)
    return [s.get(g)["input_ids"].tolist() for g in range(s.samples_per_epoch()[0])]


def test_parquet_and_every_jsonl_compression_give_the_same_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = _jsonl(TEXTS)
    files = {
        "docs.jsonl": raw,
        "docs.json": raw,
        "docs.jsonl.gz": gzip.compress(raw),
        "docs.jsonl.zst": zstandard.ZstdCompressor().compress(raw),
        "docs.jsonl.bz2": bz2.compress(raw),
        "docs.jsonl.xz": lzma.compress(raw),
    }
    _write_parquet(str(tmp_path / "docs.parquet"), TEXTS)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    groups_read: list[int] = []
    real = pq.ParquetFile.read_row_group

    def spy(self, i, *args, **kwargs):
        groups_read.append(i)
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("a whole parquet file was read"))
    expected = "".join(TEXTS).encode()
    reference = None
    for i, name in enumerate(["docs.parquet", *files]):
        out = tmp_path / f"out-{i}"
        m = build_shards([str(tmp_path / name)], str(out), shard_tokens=64)
        assert m.total_documents == len(TEXTS) - 1 and m.stats["empty_documents"] == 1
        assert _tokens(out) == expected, name
        samples = _samples(out)
        reference = reference or samples
        assert samples == reference, name
    assert groups_read == [0, 1, 2, 3]  # 7 rows, 2 per group: each group once, in order


def test_parquet_without_the_text_column_names_file_and_columns(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [1], "content": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"c\.parquet: no column 'text'; the file's columns are \['id', 'content'\]"):
        build_shards([str(tmp_path / "c.parquet")], str(tmp_path / "out"))
    m = build_shards([str(tmp_path / "c.parquet")], str(tmp_path / "out"), text_field="content")
    assert m.total_tokens == 1
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n\.parquet: column 'text' holds int64, expected strings"):
        build_shards([str(tmp_path / "n.parquet")], str(tmp_path / "out_n"))  # "out" holds c.parquet's build


def test_null_parquet_values_are_counted_as_empty(tmp_path: Path) -> None:
    _write_parquet(str(tmp_path / "n.parquet"), ["a", None, "b"])
    m = build_shards([str(tmp_path / "n.parquet")], str(tmp_path / "out"))
    assert m.total_documents == 2 and m.stats["empty_documents"] == 1


@pytest.mark.parametrize("name", ["notes.csv", "shards.tar", "README", "docs.parquet.gz", "docs.jsonl.lz4"])
def test_unknown_format_is_refused_naming_the_file(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(b"\x00\x01 not a corpus file")
    pattern = rf"{name.replace('.', '[.]')}' has an unknown format; accepted: \.txt, \.jsonl, \.json .*\.parquet"
    with pytest.raises(ValueError, match=pattern):
        build_shards([str(tmp_path / name)], str(tmp_path / "out"))
    with pytest.raises(ValueError, match=pattern):
        expand_inputs([str(tmp_path / "*")])  # a glob that catches it is refused too


def test_directory_inputs_take_only_corpus_files(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes(b"a")
    (tmp_path / "in" / "b.bin").write_bytes(b"b")
    _write_parquet(str(tmp_path / "in" / "c.parquet"), ["c"])
    assert [Path(u).name for u, _ in expand_inputs([str(tmp_path / "in")])] == ["a.txt", "c.parquet"]


class _HubStandIn(MemoryFileSystem):
    """A local, in-memory stand-in for huggingface_hub's ``hf://`` filesystem: same protocol and
    paths (``datasets/<org>/<name>/...``), nothing downloaded."""

    protocol = ("hf",)
    store: dict = {}  # noqa: RUF012 - the class-level store is how MemoryFileSystem shares files
    pseudo_dirs: list = [""]  # noqa: RUF012

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return str(path).removeprefix("hf://").strip("/")


def test_the_hub_protocol_is_huggingface_hubs_filesystem() -> None:
    from huggingface_hub import HfFileSystem

    assert fsspec.get_filesystem_class("hf") is HfFileSystem


def test_hf_paths_read_through_fsspec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(fsspec_registry, "hf", _HubStandIn)
    monkeypatch.setattr(_HubStandIn, "store", {})
    monkeypatch.setattr(_HubStandIn, "pseudo_dirs", [""])
    hub = fsspec.filesystem("hf", skip_instance_cache=True)
    halves = (TEXTS[:4], TEXTS[4:])
    for i, texts in enumerate(halves):
        _write_parquet(f"hf://datasets/org/corpus/data/train-{i:05d}.parquet", texts, fs=hub)
        _write_parquet(str(tmp_path / f"train-{i:05d}.parquet"), texts)
    urls = expand_inputs(["hf://datasets/org/corpus/data/*.parquet"])
    assert [u for u, _ in urls] == [f"hf://datasets/org/corpus/data/train-{i:05d}.parquet" for i in range(2)]
    remote = build_shards(["hf://datasets/org/corpus/data/*.parquet"], str(tmp_path / "remote"), shard_tokens=64)
    local = build_shards([str(tmp_path / "train-*.parquet")], str(tmp_path / "local"), shard_tokens=64)
    assert remote.fingerprint == local.fingerprint
    assert _samples(tmp_path / "remote") == _samples(tmp_path / "local")
    assert np.frombuffer(_tokens(tmp_path / "remote"), np.uint8).tobytes() == "".join(TEXTS).encode()


def test_jsonl_lines_longer_than_a_read(tmp_path: Path) -> None:
    """Lines are cut from 1 MiB reads: a document spanning several reads comes out whole."""
    long = "".join(chr(0x41 + i % 26) for i in range(2_500_000))
    texts = ["short", long, "after the long one"]
    (tmp_path / "long.jsonl.xz").write_bytes(lzma.compress(_jsonl(texts), preset=0))
    m = build_shards([str(tmp_path / "long.jsonl.xz")], str(tmp_path / "out"))
    assert m.total_documents == 3 and _tokens(tmp_path / "out") == "".join(texts).encode()


def test_symlink_out_of_an_input_directory_is_refused_unless_asked(tmp_path: Path) -> None:
    corpus, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    corpus.mkdir()
    elsewhere.mkdir()
    (corpus / "a.txt").write_text("inside")
    (elsewhere / "secret.txt").write_text("outside")
    (corpus / "link.txt").symlink_to(elsewhere / "secret.txt")
    (corpus / "inner.txt").symlink_to(corpus / "a.txt")  # a link that stays inside is fine
    with pytest.raises(ValueError, match=r"link\.txt is a symlink leading out of the directory"):
        expand_inputs([str(corpus)])
    names = sorted(Path(url).name for url, _ in expand_inputs([str(corpus)], follow_symlinks=True))
    assert names == ["a.txt", "inner.txt", "link.txt"]
