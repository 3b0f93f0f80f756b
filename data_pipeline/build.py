"""Corpus -> shards: tokenize documents and write webdataset tar shards plus ``manifest.json``.

``python -m data_pipeline.build --input <files/globs/URLs> --output <dir or URL> --tokenizer bytes|<sp model>``

Documents are read in a deterministic order (see ``sources.expand_inputs``), tokenized (in parallel
with ``--workers``; results are consumed in order), and appended to the current shard until it holds
at least ``shard_tokens`` tokens; documents are never split across shards. The output is the same
bytes for the same inputs and flags, whatever the number of workers (the worker count is not
recorded in the manifest).

Skip-and-count policy at build time: empty documents (zero bytes or zero tokens) are skipped and
counted in ``manifest.stats.empty_documents``; with a sentencepiece tokenizer, documents that are
not valid UTF-8 are decoded with replacement characters and counted in
``manifest.stats.invalid_utf8_documents`` (the byte-level tokenizer keeps bytes exactly).
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor

import fsspec
import numpy as np
from fsspec.core import url_to_fs
from tqdm import tqdm

from data_pipeline.shards import MANIFEST_NAME, Manifest, encode_shard, join_url, save_manifest, sha256_hex
from data_pipeline.sources import Document, expand_inputs, iter_documents
from data_pipeline.tokenizer import Tokenizer, load_tokenizer

DEFAULT_SHARD_TOKENS = 1 << 22
_BATCH_BYTES = 4 << 20


def _encode_batch(tokenizer: Tokenizer, datas: list[bytes]) -> list[tuple[np.ndarray, bool]]:
    """Tokenize a batch of documents (runs in a worker process when workers > 1)."""
    return [tokenizer.encode(d) for d in datas]


def _batches(docs: Iterator[Document]) -> Iterator[list[Document]]:
    """Group documents into batches of about ``_BATCH_BYTES`` for the worker pool."""
    batch: list[Document] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.data)
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded(
    tokenizer: Tokenizer, docs: Iterator[Document], workers: int
) -> Iterator[tuple[Document, np.ndarray, bool]]:
    """Yield ``(document, ids, invalid_utf8)`` in input order, tokenizing with ``workers`` processes.

    At most ``2 * workers`` batches are in flight, so memory stays bounded for any corpus size.
    """
    if workers <= 1:
        for doc in docs:
            ids, invalid = tokenizer.encode(doc.data)
            yield doc, ids, invalid
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        pending: deque[tuple[list[Document], Future]] = deque()
        for batch in _batches(docs):
            pending.append((batch, pool.submit(_encode_batch, tokenizer, [d.data for d in batch])))
            while len(pending) >= 2 * workers:
                done_batch, fut = pending.popleft()
                for doc, (ids, invalid) in zip(done_batch, fut.result()):
                    yield doc, ids, invalid
        while pending:
            done_batch, fut = pending.popleft()
            for doc, (ids, invalid) in zip(done_batch, fut.result()):
                yield doc, ids, invalid


class _ShardWriter:
    """Accumulates documents and writes a shard whenever ``shard_tokens`` is reached."""

    def __init__(self, output: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.output = output
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.entries: list[dict] = []

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids.astype(self.dtype, copy=False))
        self.pending_tokens += ids.size
        if self.pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        index = len(self.entries)
        key = f"shard-{index:06d}"
        tokens = np.concatenate(self.pending)
        lengths = np.fromiter((a.size for a in self.pending), dtype=np.int64, count=len(self.pending))
        lengths = lengths.astype(np.uint32 if lengths.max() <= np.iinfo(np.uint32).max else np.uint64)
        payload = encode_shard(key, tokens, lengths)
        name = f"{key}.tar"
        with fsspec.open(join_url(self.output, name), "wb") as f:
            f.write(payload)
        self.entries.append(
            {
                "path": name,
                "tokens": int(tokens.size),
                "documents": len(self.pending),
                "bytes": len(payload),
                "sha256": sha256_hex(payload),
            }
        )
        self.pending, self.pending_tokens = [], 0


def build_shards(
    inputs: list[str],
    output: str,
    tokenizer: str = "bytes",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int = 1,
    text_field: str = "text",
    progress: bool = False,
) -> Manifest:
    """Tokenize ``inputs`` into shards under ``output`` and write ``output/manifest.json``.

    ``inputs``: files, directories, globs or fsspec URLs of .txt / .jsonl (optionally compressed).
    ``tokenizer``: ``"bytes"`` or a sentencepiece model path/URL. Returns the written manifest.
    Raises ``ValueError`` when no non-empty document was found.
    """
    if shard_tokens < 1:
        raise ValueError("shard_tokens must be >= 1")
    tok = load_tokenizer(tokenizer)
    paths = expand_inputs(inputs)
    fs, out_path = url_to_fs(output)
    fs.makedirs(out_path, exist_ok=True)
    stale = join_url(out_path, MANIFEST_NAME)
    if fs.exists(stale):
        fs.rm(stale)  # a crash mid-build must not leave an old manifest over new shards
    writer = _ShardWriter(output, tok.storage_dtype, shard_tokens)
    stats = {"input_files": len(paths), "empty_documents": 0, "invalid_utf8_documents": 0}
    bar = tqdm(
        total=sum(size for _, size in paths),
        unit="B",
        unit_scale=True,
        desc="build shards",
        disable=not progress,
        file=sys.stderr,
    )
    docs = iter_documents(paths, text_field)
    for doc, ids, invalid in _encoded(tok, docs, workers):
        bar.update(len(doc.data))
        stats["invalid_utf8_documents"] += int(invalid)
        if ids.size == 0:
            stats["empty_documents"] += 1
            continue
        writer.add(ids)
    writer.flush()
    bar.close()
    if not writer.entries:
        raise ValueError(f"no non-empty documents in inputs {inputs!r}")
    manifest = Manifest(
        tokenizer=tok.identity(),
        dtype=tok.storage_dtype.name,
        shards=writer.entries,
        build={"inputs": list(inputs), "shard_tokens": shard_tokens, "text_field": text_field},
        stats=stats,
        url=join_url(output, MANIFEST_NAME),
    )
    save_manifest(manifest, output)
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: build shards and print a one-line summary."""
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.build", description=__doc__)
    parser.add_argument("--input", nargs="+", required=True, help="files, globs, directories or fsspec URLs")
    parser.add_argument("--output", required=True, help="output directory or fsspec URL")
    parser.add_argument("--tokenizer", default="bytes", help="'bytes' or a sentencepiece model path/URL")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--text-field", default="text", help="JSONL field holding the document text")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    m = build_shards(
        args.input,
        args.output,
        args.tokenizer,
        args.shard_tokens,
        args.workers,
        args.text_field,
        progress=not args.no_progress,
    )
    print(
        f"wrote {len(m.shards)} shards, {m.total_tokens} tokens, {m.total_documents} documents "
        f"({m.stats['empty_documents']} empty skipped, {m.stats['invalid_utf8_documents']} invalid UTF-8) "
        f"to {m.url}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
