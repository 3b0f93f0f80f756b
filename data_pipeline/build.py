"""Corpus -> shards: tokenize documents and write webdataset tar shards plus ``manifest.json``.

``python -m data_pipeline.build --input <files/globs/URLs> --output <dir or URL> --tokenizer bytes|<sp model>``

The build is cut into **parts** fixed by the inputs and flags alone: input units (files, or runs of
a large parquet file's row groups, see ``sources.split_units``) are taken in their deterministic
order and a part closes once it holds ``part_bytes`` input bytes. A shard never spans two parts
(the last shard of a part may be short) and documents are never split across shards. Because
parts do not depend on who builds them, a build spread over N tasks
(``--num-tasks N --task-index i``: task ``i`` builds parts ``i, i + N, ...``) followed by
``--merge`` writes the same shards and byte-identical ``manifest.json`` as one process. A part,
once all its shards are written, leaves a record ``parts/part-NNNNNN.json``; a restarted build
skips the parts whose record matches the current plan (same inputs, sizes, tokenizer and flags),
so a build killed mid-way redoes at most the parts it was writing.

Inside a task, reading runs in a thread, tokenizing in ``--workers`` processes (or the main thread;
both stages are ``data_pipeline/encode.py``) and tar encoding, hashing and writing in another thread,
with bounded queues between them.
The output is the same bytes whatever the number of workers or tasks (neither is recorded).

Skip-and-count policy at build time: empty documents (zero bytes or zero tokens) are skipped and
counted in ``manifest.stats.empty_documents``; with a sentencepiece tokenizer, documents that are
not valid UTF-8 are decoded with replacement characters and counted in
``manifest.stats.invalid_utf8_documents`` (the byte-level tokenizer keeps bytes exactly).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from fsspec.core import url_to_fs
from tqdm import tqdm

from data_pipeline import storage
from data_pipeline.encode import encoded, in_thread
from data_pipeline.errors import DATA_ERRORS, report_data_error
from data_pipeline.shards import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    encode_shard,
    join_url,
    load_manifest,
    save_manifest,
    sha256_hex,
    write_bytes,
)
from data_pipeline.sources import Document, Unit, expand_inputs, read_unit, split_units
from data_pipeline.storage import retrying
from data_pipeline.tokenizer import Tokenizer, load_tokenizer

DEFAULT_SHARD_TOKENS = 1 << 22
DEFAULT_PART_BYTES = 1 << 28
PARTS_DIR = "parts"
_SHARDS_PER_PART = 1_000_000
_WRITES_IN_FLIGHT = 2
_SHARD_FILE = re.compile(r"shard-\d{6,}\.tar")
_PART_RECORD = re.compile(r"part-(\d{6})\.json")


def shard_name(part: int, index: int) -> str:
    """Key of shard ``index`` of ``part``: ``shard-`` and ``part * 1,000,000 + index`` (six digits
    at least), so part 0's shards keep the names single-part builds have always had."""
    if index >= _SHARDS_PER_PART:
        raise ValueError(
            f"part {part} needs more than {_SHARDS_PER_PART} shards; raise --shard-tokens or lower --part-bytes"
        )
    return f"shard-{part * _SHARDS_PER_PART + index:06d}"


def _write_shard(url: str, key: str, tokens: list[np.ndarray]) -> dict[str, Any]:
    """Encode, hash and write one shard; returns its manifest entry."""
    lengths = np.fromiter((a.size for a in tokens), dtype=np.int64, count=len(tokens))
    lengths = lengths.astype(np.uint32 if lengths.max() <= np.iinfo(np.uint32).max else np.uint64)
    flat = np.concatenate(tokens)
    payload = encode_shard(key, flat, lengths)
    name = f"{key}.tar"
    write_bytes(join_url(url, name), payload)
    return {
        "path": name,
        "tokens": int(flat.size),
        "documents": len(tokens),
        "bytes": len(payload),
        "sha256": sha256_hex(payload),
    }


class _ShardWriter:
    """Accumulates one part's documents and hands a shard to the writer thread whenever
    ``shard_tokens`` is reached; at most ``_WRITES_IN_FLIGHT`` shards wait to be written."""

    def __init__(self, output: str, part: int, dtype: np.dtype, shard_tokens: int, writer: Executor) -> None:
        self.output = output
        self.part = part
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.writer = writer
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.futures: list[Future] = []

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids.astype(self.dtype, copy=False))
        self.pending_tokens += ids.size
        if self.pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        key = shard_name(self.part, len(self.futures))
        self.futures.append(self.writer.submit(_write_shard, self.output, key, self.pending))
        self.pending, self.pending_tokens = [], 0
        unfinished = [f for f in self.futures if not f.done()]
        if len(unfinished) > _WRITES_IN_FLIGHT:
            unfinished[0].result()

    def entries(self) -> list[dict[str, Any]]:
        """Flush the last shard and wait for all writes; the part's entries in order."""
        self.flush()
        return [f.result() for f in self.futures]


@dataclass(frozen=True)
class BuildPlan:
    """Everything that fixes a build's output: the tokenizer, the parts and the manifest's records."""

    tokenizer: Tokenizer
    output: str
    parts: list[list[Unit]]
    input_files: int
    build: dict[str, Any]
    digest: str

    def record_url(self, part: int) -> str:
        """Where part ``part`` records its finished shards."""
        return join_url(join_url(self.output, PARTS_DIR), f"part-{part:06d}.json")


def plan_build(
    inputs: list[str],
    output: str,
    tokenizer: str = "bytes",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    text_field: str = "text",
    part_bytes: int = DEFAULT_PART_BYTES,
    follow_symlinks: bool = False,
) -> BuildPlan:
    """Expand the inputs and cut them into parts (see the module docstring); reads no documents."""
    if shard_tokens < 1:
        raise ValueError("shard_tokens must be >= 1")
    if part_bytes < 1:
        raise ValueError("part_bytes must be >= 1")
    tok = load_tokenizer(tokenizer)
    paths = expand_inputs(inputs, follow_symlinks)
    parts: list[list[Unit]] = [[]]
    size = 0
    for unit in split_units(paths, part_bytes):
        if size >= part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(unit)
        size += unit.size
    build = {"inputs": list(inputs), "shard_tokens": shard_tokens, "text_field": text_field, "part_bytes": part_bytes}
    identity = {
        "tokenizer": tok.identity(),
        "build": build,
        "parts": [[[u.url, u.size, u.row_groups] for u in part] for part in parts],
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return BuildPlan(tok, output, parts, len(paths), build, digest)


def _finished(plan: BuildPlan, part: int) -> dict[str, Any] | None:
    """The part's record if it belongs to this plan and its shards are all there with their sizes."""
    fs, path = url_to_fs(plan.record_url(part))
    try:
        record = json.loads(retrying(plan.record_url(part), lambda: fs.cat_file(path), what="read part record"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("plan") != plan.digest:
        return None
    out_path = url_to_fs(plan.output)[1]
    for entry in record["shards"]:
        try:
            if fs.size(join_url(out_path, entry["path"])) != entry["bytes"]:
                return None
        except FileNotFoundError:
            return None
    return record


def _read_units(units: list[Unit], text_field: str, bar: tqdm) -> Iterator[Document]:
    """The documents of `units`, advancing `bar` (input bytes) by each document's bytes up to its unit's
    size and by the rest of the unit when it is read: a compressed file reaches its end early."""
    for unit in units:
        done = 0
        for doc in read_unit(unit, text_field):
            step = min(len(doc.data), unit.size - done)
            bar.update(step)
            done += step
            yield doc
        bar.update(unit.size - done)


def _build_part(plan: BuildPlan, part: int, pool: Executor | None, workers: int, writer: Executor, bar: tqdm) -> None:
    """Read, tokenize and write one part, then its record."""
    shards = _ShardWriter(plan.output, part, plan.tokenizer.storage_dtype, plan.build["shard_tokens"], writer)
    stats = {"empty_documents": 0, "invalid_utf8_documents": 0}
    docs = in_thread(_read_units(plan.parts[part], plan.build["text_field"], bar))
    for _, ids, invalid in encoded(plan.tokenizer, docs, pool, workers):
        stats["invalid_utf8_documents"] += int(invalid)
        if ids.size == 0:
            stats["empty_documents"] += 1
            continue
        shards.add(ids)
    record = {"plan": plan.digest, "part": part, "shards": shards.entries(), "stats": stats}
    write_bytes(plan.record_url(part), (json.dumps(record, sort_keys=True, indent=1) + "\n").encode())


def _tokenizer_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` tokenizer processes, started now, before the build's reader, writer and
    progress threads exist: forking a process while other threads hold locks can deadlock the child."""
    pool = ProcessPoolExecutor(max_workers=workers)
    pool.submit(int).result()
    return pool


def build_parts(
    plan: BuildPlan, workers: int = 1, num_tasks: int = 1, task_index: int = 0, progress: bool = False
) -> list[int]:
    """Build the parts of ``plan`` that belong to task ``task_index`` of ``num_tasks`` (parts
    ``task_index, task_index + num_tasks, ...``), skipping finished ones; returns the parts built.

    Removes any ``manifest.json`` in the output first: a build in progress must not leave an old
    manifest over new shards.
    """
    if not 0 <= task_index < num_tasks:
        raise ValueError(f"task_index must be in [0, num_tasks={num_tasks}), got {task_index}")
    fs, out_path = url_to_fs(plan.output)
    fs.makedirs(join_url(out_path, PARTS_DIR), exist_ok=True)
    stale = join_url(out_path, MANIFEST_NAME)
    if fs.exists(stale):
        fs.rm(stale)
    mine = [p for p in range(task_index, len(plan.parts), num_tasks) if _finished(plan, p) is None]
    pool = _tokenizer_pool(workers) if workers > 1 and mine else None
    tag = f" (task {task_index}/{num_tasks})" if num_tasks > 1 else ""
    total = sum(unit.size for part in mine for unit in plan.parts[part])  # input bytes; 0 where sizes are unknown
    bar = tqdm(total=total or None, unit="B", unit_scale=True, desc=f"build shards{tag}", disable=not progress,
               file=sys.stderr)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="build-writer") as writer:
        try:
            for i, part in enumerate(mine):
                bar.set_postfix_str(f"part {i + 1}/{len(mine)}")
                _build_part(plan, part, pool, workers, writer, bar)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
            bar.close()
    return mine


class OutputInUseError(ValueError):
    """The output already holds the shards of another build, and replacing them was not asked for."""


def _records(plan: BuildPlan) -> list[dict[str, Any] | None]:
    """Each part's record under this plan (None for a part not finished with it)."""
    return [_finished(plan, p) for p in range(len(plan.parts))]


def check_output(plan: BuildPlan, overwrite: bool) -> Manifest | None:
    """Whether ``plan`` may build into its output. Returns the manifest there when it is this very
    build (same inputs, sizes, tokenizer and flags, every part finished): nothing is left to do. Returns
    None when the output holds no manifest, or holds another build's and ``overwrite`` replaces it.
    Raises ``OutputInUseError`` for another build's shards without ``overwrite``: a run training on
    them would otherwise find other data under the same path."""
    fs, out_path = url_to_fs(plan.output)
    if not fs.exists(join_url(out_path, MANIFEST_NAME)):
        return None
    try:
        existing = load_manifest(plan.output)
    except ManifestError as err:
        existing, held = None, f"a {MANIFEST_NAME} that does not load ({err})"
    else:
        held = f"{len(existing.shards)} shards, {existing.total_tokens:,} tokens from {existing.build.get('inputs')}"
        records = _records(plan)
        if all(records) and [e for r in records for e in r["shards"]] == existing.shards:
            return existing
    if overwrite:
        return None
    raise OutputInUseError(
        f"{plan.output}: already holds the shards of another build ({held}); replacing them would change the data "
        "under any run that trains on them. Pass --overwrite to replace them (nothing stale is left), or choose "
        "another --output"
    )


def _remove_stale(plan: BuildPlan, manifest: Manifest) -> None:
    """Delete the shards and part records in the output that ``manifest`` does not use: what an
    overwritten build leaves behind. Only files named as this module names them are touched."""
    fs, out_path = url_to_fs(plan.output)
    listed = {entry["path"] for entry in manifest.shards}
    for path in fs.ls(out_path, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if _SHARD_FILE.fullmatch(name) and name not in listed:
            fs.rm(path)
    parts_dir = join_url(out_path, PARTS_DIR)
    for path in fs.ls(parts_dir, detail=False) if fs.exists(parts_dir) else []:
        match = _PART_RECORD.fullmatch(path.rstrip("/").rsplit("/", 1)[-1])
        if match and int(match.group(1)) >= len(plan.parts):
            fs.rm(path)


def merge_parts(plan: BuildPlan) -> Manifest:
    """Write ``manifest.json`` from the records of every part of ``plan``, then delete the shards it
    does not list (an earlier build's); returns it.

    Raises ``FileNotFoundError`` listing the parts not yet built (with this plan), and
    ``ValueError`` when no non-empty document was found.
    """
    records = _records(plan)
    missing = [p for p, r in enumerate(records) if r is None]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise FileNotFoundError(
            f"{len(missing)} of {len(plan.parts)} parts of the build in {plan.output!r} are not finished "
            f"(parts {shown}); run the build tasks for them with the same inputs and flags, then merge again"
        )
    entries = [e for r in records for e in r["shards"]]
    if not entries:
        raise ValueError(f"no non-empty documents in inputs {plan.build['inputs']!r}")
    stats = {"input_files": plan.input_files, "empty_documents": 0, "invalid_utf8_documents": 0}
    for r in records:
        for key in ("empty_documents", "invalid_utf8_documents"):
            stats[key] += r["stats"][key]
    manifest = Manifest(
        tokenizer=plan.tokenizer.identity(),
        dtype=plan.tokenizer.storage_dtype.name,
        shards=entries,
        build=plan.build,
        stats=stats,
        url=join_url(plan.output, MANIFEST_NAME),
    )
    save_manifest(manifest, plan.output)
    _remove_stale(plan, manifest)
    return manifest


def build_shards(
    inputs: list[str],
    output: str,
    tokenizer: str = "bytes",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int = 1,
    text_field: str = "text",
    progress: bool = False,
    part_bytes: int = DEFAULT_PART_BYTES,
    follow_symlinks: bool = False,
    overwrite: bool = False,
) -> Manifest:
    """Tokenize ``inputs`` into shards under ``output`` and write ``output/manifest.json`` in one process.

    ``inputs``: files, directories, globs or fsspec URLs (formats in ``data_pipeline.sources``).
    ``tokenizer``: ``"bytes"`` or a sentencepiece model path/URL. Parts finished by an earlier,
    interrupted build with the same plan are reused, and an output that already holds this build is
    returned as it is. Another build's output is refused unless ``overwrite`` (``check_output``).
    Returns the manifest. Raises ``ValueError`` when no non-empty document was found.
    """
    plan = plan_build(inputs, output, tokenizer, shard_tokens, text_field, part_bytes, follow_symlinks)
    done = check_output(plan, overwrite)
    if done is not None:
        return done
    build_parts(plan, workers, progress=progress)
    return merge_parts(plan)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: build shards (all parts and the manifest, one task's parts, or only the merge)."""
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.build", description=__doc__)
    parser.add_argument("--input", nargs="+", required=True, help="files, globs, directories or fsspec URLs")
    parser.add_argument("--output", required=True, help="output directory or fsspec URL")
    parser.add_argument("--tokenizer", default="bytes", help="'bytes' or a sentencepiece model path/URL")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument("--part-bytes", type=int, default=DEFAULT_PART_BYTES, help="input bytes per part")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes in this task")
    parser.add_argument("--text-field", default="text", help="JSONL field / parquet column holding the text")
    parser.add_argument("--num-tasks", type=int, default=1, help="build split over this many tasks")
    parser.add_argument("--task-index", type=int, default=0, help="which task this is (0-based)")
    parser.add_argument("--merge", action="store_true", help="only write the manifest from finished parts")
    parser.add_argument("--follow-symlinks", action="store_true",
                        help="read files that symlinks in an input directory lead to outside it")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the shards of another build in --output (refused without it)")
    parser.add_argument("--no-progress", action="store_true")
    storage.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        # s3fs keeps its own retries here: the inputs are streamed outside storage.retrying's loop
        storage.configure_from_args(args, single_attempt=False)
        return _run(args)
    except DATA_ERRORS as err:
        return report_data_error(err)


def _run(args: argparse.Namespace) -> int:
    """The build `main` asks for, raising on bad input."""
    plan = plan_build(args.input, args.output, args.tokenizer, args.shard_tokens, args.text_field,
                      args.part_bytes, args.follow_symlinks)
    done = check_output(plan, args.overwrite)
    if done is not None:
        print(f"{done.url}: already holds this build ({len(done.shards)} shards, {done.total_tokens} tokens; same "
              "inputs, tokenizer and flags): nothing to do")
        return 0
    if args.num_tasks > 1 and not args.merge:
        built = build_parts(plan, args.workers, args.num_tasks, args.task_index, progress=not args.no_progress)
        print(f"task {args.task_index}/{args.num_tasks}: built parts {built} of {len(plan.parts)}; merge with --merge")
        return 0
    if not args.merge:
        build_parts(plan, args.workers, progress=not args.no_progress)
    m = merge_parts(plan)
    print(
        f"wrote {len(m.shards)} shards, {m.total_tokens} tokens, {m.total_documents} documents "
        f"({m.stats['empty_documents']} empty skipped, {m.stats['invalid_utf8_documents']} invalid UTF-8) "
        f"to {m.url}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
