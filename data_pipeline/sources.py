"""Raw corpus input: expanding files/globs/fsspec URLs and reading documents from them.

Formats, chosen by the file name's extension (after an optional compression suffix):

- ``.txt``: the whole file is one document, kept as raw bytes (a book is one long document,
  which is what long-context training wants).
- ``.jsonl`` / ``.json``: one JSON object per line; the document is its ``text`` field
  (configurable). A line that is not valid JSON or lacks the field is an error naming the file
  and line.
- ``.parquet``: the document is the row's value in the text column (same name option), read one
  row group at a time with pyarrow so a file is never held in memory whole; a missing column is an
  error naming the file and listing its columns, a null value is an empty document.

``.txt``, ``.jsonl`` and ``.json`` may be compressed (``.gz``, ``.zst``, ``.bz2``, ``.xz``,
decompressed by fsspec); parquet compresses inside the file and is refused with an outer suffix.
Any other name is an error that names the file and lists these formats, so that a glob matching
the wrong files cannot turn into shards of binary garbage. Paths may be local, ``s3://``,
``gs://``, ``hf://datasets/...`` (huggingface_hub's filesystem) or any other fsspec URL.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

_GLOB_CHARS = "*?["
TEXT_FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".json": "jsonl"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2", ".xz": "xz"}
ACCEPTED = ".txt, .jsonl, .json (each optionally .gz, .zst, .bz2 or .xz) and .parquet"


@dataclass(frozen=True)
class Document:
    """One raw document: its bytes and where it came from (for error messages and stats).

    ``line`` is the JSONL line number, the parquet row number within the file, or 0 for text files.
    """

    data: bytes
    source: str
    line: int


@dataclass(frozen=True)
class Unit:
    """The smallest piece of input a build reads as a whole: a file, or a run of a parquet file's row
    groups (``row_groups = (first, stop)``), so that one large parquet file can be split over parts."""

    url: str
    size: int
    row_groups: tuple[int, int] | None = None


def _full_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """Re-attach the protocol to a path returned by an fsspec filesystem (local paths stay bare)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return path
    return fs.unstrip_protocol(path)


def input_format(url: str) -> tuple[str, str | None]:
    """``(format, compression)`` of an input from its name: format is ``"txt"``, ``"jsonl"`` or
    ``"parquet"``, compression an fsspec codec name or None. Anything else raises ``ValueError``
    naming the file and listing the accepted formats."""
    name = url.rsplit("/", 1)[-1]
    stem, dot, suffix = name.rpartition(".")
    compression = COMPRESSIONS.get("." + suffix.lower()) if dot else None
    if compression:
        name = stem
    ext = "." + name.rpartition(".")[2].lower() if "." in name else ""
    if ext in TEXT_FORMATS:
        return TEXT_FORMATS[ext], compression
    if ext == ".parquet" and compression is None:
        return "parquet", None
    raise ValueError(f"input {url!r} has an unknown format; accepted: {ACCEPTED}")


def _is_corpus_file(path: str) -> bool:
    """Whether a file found under an input directory is a corpus file (by extension)."""
    try:
        input_format(path)
    except ValueError:
        return False
    return True


def _inside(fs: fsspec.AbstractFileSystem, directory: str, found: str) -> bool:
    """Whether `found` (below local `directory`) really lies inside it once symlinks are resolved."""
    if not isinstance(fs, LocalFileSystem):
        return True  # object stores have no symlinks
    root = os.path.realpath(directory)
    return os.path.commonpath([root, os.path.realpath(found)]) == root


def expand_inputs(inputs: Sequence[str], follow_symlinks: bool = False) -> list[tuple[str, int]]:
    """Expand files, directories, globs and URLs into a sorted, de-duplicated ``[(url, size)]``.

    A directory contributes the corpus files below it (the accepted formats) and ignores others;
    a named or globbed file of another format is an error naming it. The order is deterministic
    (sorted within each input, inputs in the given order) so that the same inputs always produce
    the same document order and therefore identical shards. An input that matches nothing is an
    error naming it. A symlink that leads out of an input directory is an error naming it unless
    ``follow_symlinks``: a directory handed over as a corpus should not pull in files from elsewhere.
    """
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    for spec in inputs:
        fs, path = url_to_fs(spec)
        if any(c in path for c in _GLOB_CHARS):
            matches = sorted(fs.glob(path))
        elif fs.isdir(path):
            matches = sorted(m for m in fs.find(path) if _is_corpus_file(m))
            outside = [m for m in matches if not follow_symlinks and not _inside(fs, path, m)]
            if outside:
                raise ValueError(f"input {spec!r}: {outside[0]} is a symlink leading out of the directory "
                                 "(pass --follow-symlinks to read it)")
        elif fs.exists(path):
            matches = [path]
        else:
            raise FileNotFoundError(f"input {spec!r} does not exist")
        files = [m for m in matches if not fs.isdir(m)]
        if not files:
            raise FileNotFoundError(f"input {spec!r} matched no files")
        for m in files:
            url = _full_url(fs, m)
            input_format(url)
            if url not in seen:
                seen.add(url)
                out.append((url, int(fs.size(m) or 0)))
    return out


def split_units(paths: Sequence[tuple[str, int]], max_bytes: int) -> list[Unit]:
    """One ``Unit`` per file, except parquet files larger than ``max_bytes``, which are cut into runs
    of whole row groups of about ``max_bytes`` (compressed) each; only those files' footers are read."""
    units: list[Unit] = []
    for url, size in paths:
        if size <= max_bytes or input_format(url)[0] != "parquet":
            units.append(Unit(url, size))
            continue
        import pyarrow.parquet as pq

        with fsspec.open(url, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        first, run = 0, 0
        for rg in range(meta.num_row_groups):
            group = meta.row_group(rg)
            run += sum(group.column(c).total_compressed_size for c in range(group.num_columns))
            if run >= max_bytes or rg == meta.num_row_groups - 1:
                units.append(Unit(url, run, (first, rg + 1)))
                first, run = rg + 1, 0
    return units


def _parquet_documents(f: BinaryIO, unit: Unit, text_field: str) -> Iterator[Document]:
    """Documents of a parquet file's row groups (all, or ``unit.row_groups``), one group in memory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{unit.url}: not a readable parquet file: {exc}") from exc
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise ValueError(f"{unit.url}: no column {text_field!r}; the file's columns are {schema.names}")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ValueError(f"{unit.url}: column {text_field!r} holds {kind}, expected strings")
    first, stop = unit.row_groups or (0, pf.num_row_groups)
    row = sum(pf.metadata.row_group(rg).num_rows for rg in range(first))
    for rg in range(first, stop):
        try:
            column = pf.read_row_group(rg, columns=[text_field]).column(0).cast(pa.large_binary())
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{unit.url}: row group {rg}: cannot be read: {exc}") from exc
        for value in column.to_pylist():
            yield Document(value or b"", unit.url, row)
            row += 1


def _lines(f: BinaryIO, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Lines of a binary file read in ``chunk``-byte reads (some decompressors cannot iterate lines);
    a line longer than a chunk is joined once, so the cost stays linear in its length."""
    pieces: list[bytes] = []
    while block := f.read(chunk):
        *lines, last = block.split(b"\n")
        if lines:
            lines[0] = b"".join([*pieces, lines[0]])
            pieces = []
            yield from lines
        pieces.append(last)
    rest = b"".join(pieces)
    if rest:
        yield rest


def read_unit(unit: Unit, text_field: str = "text") -> Iterator[Document]:
    """Yield the documents of one unit in order (see the module docstring for the formats).

    Unreadable files raise ``OSError`` naming the URL; malformed JSONL and parquet without the text
    column raise ``ValueError`` naming the URL (and line).
    """
    url = unit.url
    fmt, compression = input_format(url)
    try:
        f = fsspec.open(url, "rb", compression=compression).open()
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot open input {url!r}: {exc}") from exc
    try:
        if fmt == "parquet":
            yield from _parquet_documents(f, unit, text_field)
        elif fmt == "txt":
            try:
                data = f.read()
            except (OSError, EOFError) as exc:
                raise OSError(f"cannot read input {url!r}: {exc}") from exc
            yield Document(data, url, 0)
        else:
            for lineno, raw in enumerate(_lines(f), start=1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except UnicodeDecodeError as exc:
                    raise ValueError(f"{url}:{lineno}: not valid UTF-8 at byte {exc.start} of the line") from exc
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{url}:{lineno}: invalid JSON: {exc}") from exc
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise ValueError(f"{url}:{lineno}: no string field {text_field!r}")
                yield Document(record[text_field].encode("utf-8", errors="surrogatepass"), url, lineno)
    finally:
        f.close()


def iter_documents(paths: Sequence[tuple[str, int]], text_field: str = "text") -> Iterator[Document]:
    """Yield the documents of every file in order (whole files; see ``read_unit``)."""
    for url, size in paths:
        yield from read_unit(Unit(url, size), text_field)
