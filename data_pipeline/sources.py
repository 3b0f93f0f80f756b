"""Raw corpus input: expanding files/globs/fsspec URLs and reading documents from them.

Formats, chosen by extension after an optional compression suffix (``.gz``, ``.zst``, ``.bz2``,
``.xz``; decompressed through fsspec):

- ``.txt`` (and anything not ``.jsonl``/``.json``): the whole file is one document, kept as raw
  bytes (a book is one long document, which is what long-context training wants).
- ``.jsonl``: one JSON object per line; the document is its ``text`` field (configurable). A line
  that is not valid JSON or lacks the field is an error naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fsspec
from fsspec.core import url_to_fs
from fsspec.utils import infer_compression

_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Document:
    """One raw document: its bytes and where it came from (for error messages and stats)."""

    data: bytes
    source: str
    line: int


def _full_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """Re-attach the protocol to a path returned by an fsspec filesystem (local paths stay bare)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return path
    return fs.unstrip_protocol(path)


def expand_inputs(inputs: Sequence[str]) -> list[tuple[str, int]]:
    """Expand files, directories, globs and URLs into a sorted, de-duplicated ``[(url, size)]``.

    A directory contributes the ``.txt`` / ``.jsonl`` / ``.json`` files below it (optionally
    compressed); name other files explicitly or with a glob.

    The order is deterministic (sorted within each input, inputs in the given order) so that the
    same inputs always produce the same document order and therefore identical shards. An input
    that matches nothing is an error naming it.
    """
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    for spec in inputs:
        fs, path = url_to_fs(spec)
        if any(c in path for c in _GLOB_CHARS):
            matches = sorted(fs.glob(path))
        elif fs.isdir(path):
            matches = sorted(m for m in fs.find(path) if _is_corpus_file(m))
        elif fs.exists(path):
            matches = [path]
        else:
            raise FileNotFoundError(f"input {spec!r} does not exist")
        files = [m for m in matches if not fs.isdir(m)]
        if not files:
            raise FileNotFoundError(f"input {spec!r} matched no files")
        for m in files:
            url = _full_url(fs, m)
            if url not in seen:
                seen.add(url)
                out.append((url, int(fs.size(m) or 0)))
    return out


def _strip_compression(name: str) -> str:
    return name.rsplit(".", 1)[0] if infer_compression(name) else name


def _is_corpus_file(path: str) -> bool:
    """Whether a file found under an input directory is a corpus file (by extension)."""
    return _strip_compression(path.rsplit("/", 1)[-1]).endswith((".txt", ".jsonl", ".json"))


def _format_of(url: str) -> str:
    """``"jsonl"`` or ``"txt"`` from the file name, ignoring a compression suffix."""
    name = _strip_compression(url.rsplit("/", 1)[-1])
    return "jsonl" if name.endswith((".jsonl", ".json")) else "txt"


def iter_documents(paths: Sequence[tuple[str, int]], text_field: str = "text") -> Iterator[Document]:
    """Yield the documents of every file in order (see module docstring for formats).

    Unreadable files raise ``OSError`` naming the URL; malformed JSONL raises ``ValueError``
    naming the URL and line.
    """
    for url, _ in paths:
        try:
            opened = fsspec.open(url, "rb", compression="infer")
            f = opened.open()
        except (OSError, ValueError) as exc:
            raise OSError(f"cannot open input {url!r}: {exc}") from exc
        try:
            if _format_of(url) == "txt":
                try:
                    data = f.read()
                except (OSError, EOFError) as exc:
                    raise OSError(f"cannot read input {url!r}: {exc}") from exc
                yield Document(data, url, 0)
                continue
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{url}:{lineno}: invalid JSON: {exc}") from exc
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise ValueError(f"{url}:{lineno}: no string field {text_field!r}")
                yield Document(record[text_field].encode("utf-8", errors="surrogatepass"), url, lineno)
        finally:
            f.close()
