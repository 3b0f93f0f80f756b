"""Shard files and the manifest: format, deterministic writing, verified reading.

A shard is a tar holding one webdataset sample (the documents' tokens and their lengths as plain
npy arrays), written so the same content always gives the same bytes; the manifest beside the
shards records every shard's counts and sha256 and a fingerprint that names the dataset by content
rather than location. docs/data.md, "Shards and manifest", gives the format and why it is built so.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fsspec.core import url_to_fs

from data_pipeline.storage import StorageError, is_remote, retrying

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "recurrent-pretrain-shards"
MANIFEST_VERSION = 1


class ShardError(RuntimeError):
    """A shard could not be read or failed verification; the message names the file."""


class ManifestError(ValueError):
    """A manifest is missing, unreadable or malformed; the message names the file."""


@dataclass
class Manifest:
    """In-memory manifest. ``shards`` entries: ``path`` (relative), ``tokens``, ``documents``,
    ``bytes``, ``sha256``. ``url`` is where the manifest was loaded from (not serialized)."""

    tokenizer: dict[str, Any]
    dtype: str
    shards: list[dict[str, Any]]
    build: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    url: str = ""

    @property
    def total_tokens(self) -> int:
        """Content tokens over all shards (EOS separators not counted)."""
        return sum(int(s["tokens"]) for s in self.shards)

    @property
    def total_documents(self) -> int:
        """Documents over all shards."""
        return sum(int(s["documents"]) for s in self.shards)

    @property
    def fingerprint(self) -> str:
        """sha256 over tokenizer identity and shard hashes: the dataset's location-free identity."""
        h = hashlib.sha256(json.dumps(self.tokenizer, sort_keys=True).encode())
        h.update(self.dtype.encode())
        for s in self.shards:
            h.update(bytes.fromhex(s["sha256"]))
        return h.hexdigest()

    def to_json(self) -> str:
        """Deterministic JSON text (sorted keys, fixed indentation, trailing newline)."""
        doc = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "total_tokens": self.total_tokens,
            "total_documents": self.total_documents,
            "num_shards": len(self.shards),
            "fingerprint": self.fingerprint,
            "build": self.build,
            "stats": self.stats,
            "shards": self.shards,
        }
        return json.dumps(doc, sort_keys=True, indent=1) + "\n"

    def shard_url(self, i: int) -> str:
        """Absolute URL of shard ``i`` (shard paths are relative to the manifest's directory)."""
        return join_url(manifest_dir(self.url), self.shards[i]["path"])


def manifest_dir(url: str) -> str:
    """Directory URL of a manifest URL (or the URL itself when it names a directory)."""
    return url.rsplit("/", 1)[0] if url.endswith(".json") else url.rstrip("/")


def join_url(base: str, rel: str) -> str:
    """``base/rel`` for local paths and URLs alike."""
    return f"{base.rstrip('/')}/{rel}"


def manifest_url(source: str) -> str:
    """Accept a manifest file URL or the directory holding ``manifest.json``."""
    return source if source.endswith(".json") else join_url(source, MANIFEST_NAME)


def load_manifest(source: str) -> Manifest:
    """Read and validate a manifest from a directory or ``.json`` URL (any fsspec protocol)."""
    url = manifest_url(source)
    try:
        raw = retrying(url, lambda: cat(url), what="read manifest")
    except (OSError, ValueError) as exc:
        raise ManifestError(f"cannot read manifest {url!r}: {exc}") from exc
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest {url!r} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{url!r} is not a {MANIFEST_FORMAT} manifest")
    if doc.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"manifest {url!r} has version {doc.get('version')}, expected {MANIFEST_VERSION}")
    try:
        shards = doc["shards"]
        for s in shards:
            for key in ("path", "tokens", "documents", "sha256"):
                if key not in s:
                    raise KeyError(key)
        manifest = Manifest(
            tokenizer=doc["tokenizer"],
            dtype=doc["dtype"],
            shards=shards,
            build=doc.get("build", {}),
            stats=doc.get("stats", {}),
            url=url,
        )
        np.dtype(manifest.dtype)
    except (KeyError, TypeError) as exc:
        raise ManifestError(f"manifest {url!r} is malformed: missing {exc}") from exc
    if not shards:
        raise ManifestError(f"manifest {url!r} lists no shards")
    _check_paths_and_totals(manifest, doc)
    return manifest


def _check_paths_and_totals(manifest: Manifest, doc: dict[str, Any]) -> None:
    """Refuse shard paths that leave the manifest's directory (absolute, a URL, or with `..`) and
    recorded totals that disagree with the shard entries: either means the file was edited."""
    for entry in manifest.shards:
        path = str(entry["path"])
        parts = path.replace("\\", "/").split("/")
        if path.startswith("/") or "://" in path or ".." in parts or not path:
            raise ManifestError(
                f"manifest {manifest.url!r}: shard path {path[:80]!r} must be relative and stay inside "
                "the dataset directory"
            )
    recorded = {"total_tokens": manifest.total_tokens, "total_documents": manifest.total_documents,
                "num_shards": len(manifest.shards)}
    for key, actual in recorded.items():
        if key in doc and doc[key] != actual:
            raise ManifestError(
                f"manifest {manifest.url!r}: {key} is {str(doc[key])[:80]!r} but its shards give {actual!r}"
            )


def save_manifest(manifest: Manifest, output: str) -> str:
    """Write ``manifest.json`` into the output directory URL; returns its URL."""
    url = join_url(output, MANIFEST_NAME)
    write_bytes(url, manifest.to_json().encode())
    return url


def write_bytes(url: str, data: bytes) -> None:
    """Write a whole file (an object, on a store) under the retry policy: a retried write rewrites it."""

    def write() -> None:
        fs, path = url_to_fs(url)
        if not is_remote(url):
            fs.makedirs(fs._parent(path), exist_ok=True)
        fs.pipe_file(path, data)

    retrying(url, write, what="write")


def cat(url: str, start: int | None = None, end: int | None = None) -> bytes:
    """One read of a whole file or of its bytes ``[start, end)`` (one range GET on a store)."""
    fs, path = url_to_fs(url)
    return fs.cat_file(path, start=start, end=end)


def _npy_bytes(array: np.ndarray) -> bytes:
    """``.npy`` serialization of a 1-D array (deterministic header)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def _tar_member(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    info.mtime = 0
    info.mode = 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(payload))


def encode_shard(key: str, tokens: np.ndarray, lengths: np.ndarray) -> bytes:
    """Serialize one shard (see module docstring) to deterministic tar bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        _tar_member(tar, f"{key}.tokens.npy", _npy_bytes(tokens))
        _tar_member(tar, f"{key}.lengths.npy", _npy_bytes(lengths))
    return buf.getvalue()


def _npy_header(buf: bytes, offset: int, size: int, url: str, member: str) -> tuple[int, int, np.dtype]:
    """Parse the ``.npy`` header at ``buf[offset:]`` (no pickles): ``(header length, count, dtype)``."""
    header = io.BytesIO(buf[offset : offset + min(size, 4096)])
    try:
        version = np.lib.format.read_magic(header)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(header)
    except ValueError as exc:
        raise ShardError(f"shard {url!r}: member {member!r} is not a valid .npy: {exc}") from exc
    if dtype.hasobject or len(shape) != 1 or fortran:
        raise ShardError(f"shard {url!r}: member {member!r} must be a 1-D numeric array")
    count = int(shape[0])
    if header.tell() + count * dtype.itemsize > size:
        raise ShardError(f"shard {url!r}: member {member!r} is shorter than its header says")
    return header.tell(), count, dtype


def _npy_view(buf: bytes, offset: int, size: int, url: str, member: str) -> np.ndarray:
    """Zero-copy view of an ``.npy`` payload at ``buf[offset:offset+size]``."""
    header_len, count, dtype = _npy_header(buf, offset, size, url, member)
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset + header_len)


@dataclass(frozen=True)
class ShardIndex:
    """Where a shard's tokens are, for reading sample-sized byte ranges instead of whole shards.

    ``data_offset``: byte offset of the first token in the file; ``eos_positions``: positions of the
    EOS separators in the shard's stream (documents each followed by EOS).
    """

    data_offset: int
    dtype: np.dtype
    tokens: int
    eos_positions: np.ndarray


def _tar_member_at(url: str, offset: int, part: str, retries: int,
                   count: Callable[[int], None] | None) -> tuple[int, int, np.dtype, int, bytes]:
    """Read the tar header + npy header of member ``*.part`` at ``offset``:
    ``(payload offset, count, dtype, member size, bytes read from the payload start)``; ``count(1)``
    runs for each retry made."""
    head, _ = read_bytes(url, retries, offset, offset + 4096, count)
    if len(head) < 512:
        raise ShardError(f"shard {url!r} is truncated (no tar header at byte {offset})")
    try:
        info = tarfile.TarInfo.frombuf(head[:512], tarfile.ENCODING, "surrogateescape")
    except tarfile.TarError as exc:
        raise ShardError(f"shard {url!r} is not a readable tar (corrupt or truncated): {exc}") from exc
    if not info.name.endswith("." + part):
        raise ShardError(f"shard {url!r}: expected a '*.{part}' member at byte {offset}, found {info.name!r}")
    header_len, count, dtype = _npy_header(head, 512, info.size, url, part)
    payload = offset + 512 + header_len
    return payload, count, dtype, info.size, head[512 + header_len :]


def read_index(url: str, retries: int = 2, count: Callable[[int], None] | None = None) -> ShardIndex:
    """Read a shard's token offset and document lengths with small range reads (not the tokens);
    ``count(1)`` runs for each retry made, as it is made."""
    data_offset, tokens, dtype, size, _ = _tar_member_at(url, 0, "tokens.npy", retries, count)
    lengths_at = 512 + -(-size // 512) * 512
    offset, n_docs, ldtype, _, have = _tar_member_at(url, lengths_at, "lengths.npy", retries, count)
    need = n_docs * ldtype.itemsize
    if len(have) >= need:
        raw = have[:need]
    else:
        raw, _ = read_bytes(url, retries, offset, offset + need, count)
    if len(raw) != need:
        raise ShardError(f"shard {url!r} is truncated (document lengths cut off)")
    lengths = np.frombuffer(raw, dtype=ldtype).astype(np.int64)
    if int(lengths.sum()) != tokens:
        raise ShardError(f"shard {url!r}: document lengths sum to {int(lengths.sum())}, tokens {tokens}")
    return ShardIndex(data_offset, dtype, tokens, np.cumsum(lengths + 1) - 1)


def decode_shard(buf: bytes, url: str) -> tuple[np.ndarray, np.ndarray]:
    """Parse shard bytes into ``(tokens, lengths)`` views; corrupt or truncated tars raise ShardError."""
    members: dict[str, tuple[int, int]] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(buf), mode="r:") as tar:
            for info in tar:
                if info.isfile():
                    if info.offset_data + info.size > len(buf):
                        raise ShardError(f"shard {url!r} is truncated (member {info.name!r} cut off)")
                    members[info.name.split(".", 1)[-1]] = (info.offset_data, info.size)
    except (tarfile.TarError, EOFError) as exc:
        raise ShardError(f"shard {url!r} is not a readable tar (corrupt or truncated): {exc}") from exc
    for part in ("tokens.npy", "lengths.npy"):
        if part not in members:
            raise ShardError(f"shard {url!r} has no '*.{part}' member (truncated or not a shard)")
    tokens = _npy_view(buf, *members["tokens.npy"], url, "tokens.npy")
    lengths = _npy_view(buf, *members["lengths.npy"], url, "lengths.npy")
    if int(lengths.sum(dtype=np.int64)) != tokens.size:
        raise ShardError(f"shard {url!r}: document lengths sum to {int(lengths.sum())}, tokens {tokens.size}")
    return tokens, lengths


def checked_shard(
    data: bytes, url: str, entry: dict[str, Any], dtype: str, digest: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """Decode shard bytes and check them against their manifest ``entry``.

    ``digest`` is the sha256 of ``data`` (None skips the hash check); the token/document counts and
    the dtype are always checked. Any disagreement raises ``ShardError`` naming the file.
    """
    if digest is not None and digest != entry["sha256"]:
        raise ShardError(
            f"shard {url!r}: sha256 mismatch (manifest {entry['sha256'][:16]}…, file {digest[:16]}…); "
            "the file was modified, truncated or belongs to another build"
        )
    tokens, lengths = decode_shard(data, url)
    if tokens.size != int(entry["tokens"]) or lengths.size != int(entry["documents"]) or tokens.dtype != dtype:
        raise ShardError(
            f"shard {url!r}: holds {tokens.size} {tokens.dtype} tokens / {lengths.size} documents, manifest says "
            f"{entry['tokens']} {dtype} / {entry['documents']}"
        )
    return tokens, lengths


def with_retries(
    url: str, retries: int, read: Callable[[], bytes], on_error: Callable[[], None] | None = None,
    count: Callable[[int], None] | None = None,
) -> tuple[bytes, int]:
    """Run ``read()`` under ``data_pipeline.storage.retrying`` (``retries`` retries, the process's
    backoff); returns ``(data, retries_used)``. ``count(1)``, when given, runs for each retry as it is
    made, so that the retries of a read that fails in the end are counted too. A missing file is not
    retried. ``on_error`` runs after each failed attempt (e.g. to drop a cached file handle). Failures
    raise ``ShardError`` naming the URL."""
    used = [0]

    def counted(n: int) -> None:
        used[0] += n
        if count is not None:
            count(n)

    try:
        return retrying(url, read, counted, on_error, retries, what="read shard"), used[0]
    except FileNotFoundError as exc:
        raise ShardError(f"shard {url!r} is missing: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise ShardError(str(exc) if isinstance(exc, StorageError) else f"cannot read shard {url!r}: {exc}") from exc


def read_bytes(url: str, retries: int = 2, start: int | None = None, end: int | None = None,
               count: Callable[[int], None] | None = None) -> tuple[bytes, int]:
    """Read a file (or its byte range ``[start, end)``) through fsspec with ``with_retries``."""

    return with_retries(url, retries, lambda: cat(url, start, end), count=count)


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of a byte string."""
    return hashlib.sha256(data).hexdigest()
