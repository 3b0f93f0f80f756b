"""Reading one source's shards as token streams (documents each followed by EOS): whole shards
(sha256-verified, cached, the next ones prefetched in a thread) or byte ranges plus a small per-shard
index. Knows nothing of sample order; ``data_pipeline.order`` says which positions to read.

Byte ranges on an object store are read in aligned blocks of ``storage.block_size`` bytes of a
shard's token payload (8 MiB by default), never one request per sample: a request costs a round
trip and the server's work whatever its size, so a sample-sized GET (a few kB) is bound by requests
per second. The blocks the next samples need are fetched ahead by a small pool of threads (the stream
says which samples come next: ``prefetch``) into a per-reader LRU bounded in bytes; what a sample
holds never depends on which block arrived first."""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from fsspec.core import url_to_fs

from data_pipeline import storage
from data_pipeline.shards import (
    Manifest,
    ShardError,
    ShardIndex,
    cat,
    checked_shard,
    read_bytes,
    read_index,
    sha256_hex,
    with_retries,
)
from data_pipeline.storage import is_remote
from data_pipeline.tokenizer import smallest_dtype

_OPEN_HANDLES = 16
_CACHED_INDEXES = 64
_EOS_AS_LIST = 1 << 16
SHARDS_AHEAD = 2
"""Whole shards read ahead in epoch order (shard mode): the next two, fetched one after the other in a
background thread while this one is packed."""
RANGE_AHEAD = 16
"""Fewest upcoming samples whose blocks are requested ahead on an object store (range mode); the
stream looks further ahead when that spans less than ``BLOCKS_AHEAD`` blocks of the stream."""
BLOCKS_AHEAD = 2
"""Blocks of the epoch's stream the range read-ahead spans (at least): the next block is on its way
while this one is read."""
BLOCK_THREADS = 2
"""Block requests in flight at once per reader (range mode on an object store)."""
_stats_lock = threading.Lock()


@dataclass
class ReadPolicy:
    """How shards are read.

    mode: ``"shard"`` reads whole shards, ``"range"`` only the requested byte ranges.
    verify: check each whole shard's sha256 (impossible in range mode).
    retries: retries of a failed (non-missing) read before raising ``ShardError``.
    prefetch: read and hash the next shards in a background thread (shard mode).
    block_size: bytes per request of range reads on an object store (None: the process's
        ``storage.block_size()``, set from ``storage.block_size``).
    """

    mode: str = "shard"
    verify: bool = True
    retries: int = 2
    prefetch: bool = True
    block_size: int | None = None  # range reads on an object store; None: storage.block_size()

    def __post_init__(self) -> None:
        if self.mode not in ("shard", "range"):
            raise ValueError(f"read must be 'shard' or 'range', not {self.mode!r}")
        if self.mode == "range" and self.verify:
            raise ValueError("read='range' cannot check sha256 (it never reads whole shards); pass verify=False")


@dataclass
class ReadStats:
    """Read counters of one process, shared by the readers of all sources of a stream."""

    shards_opened: int = 0
    shard_bytes_read: int = 0
    sha256_verified: int = 0
    read_retries: int = 0
    cache_evictions: int = 0
    prefetched: int = 0


class ShardReader:
    """Stream positions of one manifest's shards, read under a ``ReadPolicy`` and counted in ``ReadStats``.

    ``window_tokens`` is how many stream tokens one shuffle window of samples spans; the whole-shard
    cache holds that plus the two largest shards, so a window is read once. Per shard only two
    counts, its URL and its hash are kept; the manifest's per-shard dicts are dropped.
    """

    def __init__(self, manifest: Manifest, policy: ReadPolicy, stats: ReadStats, window_tokens: int) -> None:
        self.manifest = manifest
        self.policy = policy
        self.stats = stats
        self.eos = int(manifest.tokenizer["eos_id"])
        self.out_dtype = smallest_dtype(int(manifest.tokenizer["vocab_size"]))
        self.tokens = np.array([int(s["tokens"]) for s in manifest.shards], dtype=np.int64)
        self.documents = np.array([int(s["documents"]) for s in manifest.shards], dtype=np.int64)
        self.shard_urls = [manifest.shard_url(i) for i in range(len(manifest.shards))]
        self.shard_sha = [s["sha256"] for s in manifest.shards]
        manifest.shards = []
        self.lengths = self.tokens + self.documents
        self.cache_budget = window_tokens + 2 * int(self.lengths.max())
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cached_tokens = 0
        self._indexes: OrderedDict[int, ShardIndex] = OrderedDict()
        self._eos_lists: dict[int, list[int]] = {}
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._handles_pid = -1
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = -1
        self._inflight: OrderedDict[int, Future] = OrderedDict()
        self._remote_ranges = policy.mode == "range" and is_remote(self.shard_urls[0])
        self.block_size = int(policy.block_size or storage.block_size())
        self.window_bytes = window_tokens * np.dtype(manifest.dtype).itemsize
        self.block_budget = self.window_bytes + 2 * self.block_size  # set_read_ahead adds the read-ahead's
        self._blocks: OrderedDict[tuple[int, int], _Block] = OrderedDict()
        self._block_bytes = 0
        self._block_pool: ThreadPoolExecutor | None = None
        self._index_pool: ThreadPoolExecutor | None = None
        self._block_pid = -1
        self._index_reads: dict[int, Future] = {}
        self._waiting: dict[int, list[tuple[int, int]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the shard cache, open files and the prefetch thread (workers rebuild them)."""
        state = dict(self.__dict__)
        state.update(_cache=OrderedDict(), _cached_tokens=0, _pool=None, _pool_pid=-1, _inflight=OrderedDict())
        state.update(_handles=OrderedDict(), _handles_pid=-1, _blocks=OrderedDict(), _block_bytes=0, _block_pool=None,
                     _index_pool=None, _block_pid=-1, _index_reads={}, _waiting={})
        return state

    def close(self, wait: bool = False) -> None:
        """Stop this process's background reads: those not started are dropped, those running finish
        (each is one read, with its retries) and are let go, or waited for with ``wait``; the caches
        are emptied."""
        for pool in (self._pool, self._block_pool, self._index_pool):
            if pool is not None:
                pool.shutdown(wait=wait, cancel_futures=True)
        self._pool = self._block_pool = self._index_pool = None
        self._pool_pid = self._block_pid = -1
        self._inflight, self._blocks, self._block_bytes = OrderedDict(), OrderedDict(), 0
        self._index_reads, self._waiting = {}, {}
        self._cache, self._cached_tokens = OrderedDict(), 0

    def set_read_ahead(self, samples: int, sample_bytes: int, stream_bytes: int) -> None:
        """Size the block cache for a read-ahead of ``samples`` samples of ``sample_bytes`` each,
        spanning ``stream_bytes`` of the epoch's stream: the blocks of two shuffle windows (the one
        read and the one the read-ahead has reached), of the read-ahead (at most its span, at most
        each sample's bytes and two blocks cut by its ends), the one read and one cut by a shard's end."""
        ahead = min(stream_bytes, samples * (sample_bytes + 2 * self.block_size))
        self.block_budget = 2 * self.window_bytes + ahead + 2 * self.block_size

    def remote_ranges(self) -> bool:
        """Whether positions are read as blocks of an object store (range mode, remote shards)."""
        return self._remote_ranges

    def prefetch(self, idx: int, start: int, stop: int) -> tuple[int, int] | None:
        """Start reading the blocks that positions ``[start, stop)`` of shard ``idx`` need, in the
        background (range mode on an object store; elsewhere nothing). A shard whose index is not
        here yet has it read by an index thread first; the blocks are asked for once it has come.
        The caches and counts are kept in the caller's thread; the threads only read. Returns how
        many EOS of the shard lie before ``start`` and before ``stop`` where it worked them out
        (``span`` can take them), else None."""
        if not self.remote_ranges():
            return None
        self._pool_for_blocks()
        if self._index_reads:
            self._settle_indexes()
        if idx not in self._indexes:  # its blocks are asked for when the index has come
            if idx not in self._index_reads:
                self._index_reads[idx] = self._index_pool.submit(self._read_index, idx)
            self._waiting.setdefault(idx, []).append((start, stop))
            return None
        return self._want(idx, start, stop)

    def _want(self, idx: int, start: int, stop: int) -> tuple[int, int]:
        index = self._index(idx)
        eos = self._eos_before(idx, index, start), self._eos_before(idx, index, stop)
        lo, hi = self._bytes_of(index, start, stop, eos)
        for b in self._block_numbers(index, lo, hi):
            self._block(idx, b).wanted += 1
        return eos

    def _settle_indexes(self) -> None:
        """Take in the shard indexes read in the background, and ask for the blocks of the samples
        that were waiting for them (a failed read is left for ``_index`` to raise when it is needed)."""
        for idx in [i for i, future in self._index_reads.items() if future.done()]:
            future = self._index_reads[idx]
            waiting = self._waiting.pop(idx, [])
            if future.exception() is not None:
                continue
            del self._index_reads[idx]
            self._keep_index(idx, future.result())
            for start, stop in waiting:
                self._want(idx, start, stop)

    def span(self, idx: int, start: int, stop: int, following: list[int],
             eos: tuple[int, int] | None = None) -> np.ndarray:
        """Positions ``[start, stop)`` of shard ``idx``'s stream; ``following`` are the shards read next
        in the epoch's order (prefetched in shard mode); ``eos`` what ``prefetch`` returned for them."""
        if self.policy.mode == "range":
            return self._range(idx, start, stop, eos)
        return self._shard(idx, following)[start:stop]

    def _handle(self, idx: int) -> Any:
        """An open fsspec file for shard ``idx`` (range mode), kept in a small LRU; reopened after fork."""
        if self._handles_pid != os.getpid():
            self._handles, self._handles_pid = OrderedDict(), os.getpid()
        f = self._handles.get(idx)
        if f is None:
            fs, path = url_to_fs(self.shard_urls[idx])
            f = self._handles[idx] = fs.open(path, "rb")
            while len(self._handles) > _OPEN_HANDLES:
                self._handles.popitem(last=False)[1].close()
        self._handles.move_to_end(idx)
        return f

    def _drop_handle(self, idx: int) -> None:
        f = self._handles.pop(idx, None)
        if f is not None:
            f.close()

    def _read_range(self, idx: int, start: int, stop: int) -> tuple[bytes, int]:
        """Bytes ``[start, stop)`` of shard ``idx``: a seek and read of a cached handle (local files and
        other stores read without blocks)."""

        def read() -> bytes:
            f = self._handle(idx)
            f.seek(start)
            return f.read(stop - start)

        return with_retries(self.shard_urls[idx], self.policy.retries, read, lambda: self._drop_handle(idx),
                            self._count_retries)

    def _count_retries(self, n: int) -> None:
        """Add ``n`` retries to ``read_retries`` as they are made (from any of this reader's threads),
        also those of a read ahead that the stream never reaches or of a read that fails in the end."""
        with _stats_lock:
            self.stats.read_retries += n

    def _fetch(self, idx: int) -> tuple[bytes, str]:
        """Read shard ``idx`` and hash it (runs in the prefetch thread or inline); its bytes are counted
        as they arrive, also those of a shard read ahead that the stream never reaches."""
        data, _ = read_bytes(self.shard_urls[idx], self.policy.retries, count=self._count_retries)
        with _stats_lock:
            self.stats.shard_bytes_read += len(data)
        return data, sha256_hex(data) if self.policy.verify else ""

    def _schedule(self, idx: int) -> None:
        """Start reading shard ``idx`` in the background (one thread per process, fork-safe)."""
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch")
            self._pool_pid = os.getpid()
            self._inflight = OrderedDict()
        if idx in self._cache or idx in self._inflight:
            return
        self._inflight[idx] = self._pool.submit(self._fetch, idx)
        while len(self._inflight) > SHARDS_AHEAD + 1:
            self._inflight.popitem(last=False)[1].cancel()

    def _shard(self, idx: int, following: list[int]) -> np.ndarray:
        """Decoded shard ``idx`` as one stream, through an LRU cache; on a miss, the ``following``
        shards start loading in the background so their reading and hashing overlap with packing
        this one."""
        hit = self._cache.get(idx)
        if hit is not None:
            self._cache.move_to_end(idx)
            return hit
        verify = self.policy.verify
        pending = self._inflight.pop(idx, None) if self._pool_pid == os.getpid() else None
        if pending is not None:
            data, digest = pending.result()
            self.stats.prefetched += 1
        else:
            data, digest = self._fetch(idx)
        if self.policy.prefetch:
            for later in following[:SHARDS_AHEAD]:
                self._schedule(later)
        self.stats.shards_opened += 1
        entry = {"sha256": self.shard_sha[idx], "tokens": self.tokens[idx], "documents": self.documents[idx]}
        tokens, lengths = checked_shard(
            data, self.shard_urls[idx], entry, self.manifest.dtype, digest if verify else None
        )
        self.stats.sha256_verified += int(verify)
        eos_at = np.cumsum(lengths, dtype=np.int64) + np.arange(1, lengths.size + 1)
        eos_at -= 1
        stream = self._with_eos(tokens, eos_at, tokens.size + lengths.size)
        self._cache[idx] = stream
        self._cached_tokens += stream.size
        while self._cached_tokens > self.cache_budget and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= old.size
            self.stats.cache_evictions += 1
        return stream

    def _with_eos(self, tokens: np.ndarray, eos_at: np.ndarray, size: int) -> np.ndarray:
        """``size`` stream positions: EOS at ``eos_at``, ``tokens`` in order everywhere else."""
        out = np.empty(size, dtype=self.out_dtype)
        if eos_at.size <= 64 or tokens.size >= 256 * eos_at.size:  # long documents: a copy per document
            begin = 0
            for n, at in enumerate(eos_at.tolist()):
                out[begin:at] = tokens[begin - n : at - n]
                begin = at + 1
            out[begin:] = tokens[begin - eos_at.size :]
        else:
            keep = np.ones(size, dtype=bool)
            keep[eos_at] = False
            out[keep] = tokens
        out[eos_at] = self.eos
        return out

    def _index(self, idx: int) -> ShardIndex:
        """Token offset and EOS positions of shard ``idx`` (range mode), through a small LRU cache;
        waits for a read that ``prefetch`` started."""
        hit = self._indexes.get(idx)
        if hit is not None:
            self._indexes.move_to_end(idx)
            return hit
        pending = self._index_reads.pop(idx, None) if self._block_pid == os.getpid() else None
        if pending is None:
            return self._keep_index(idx, self._read_index(idx))
        index = self._keep_index(idx, pending.result())
        for start, stop in self._waiting.pop(idx, []):  # prefetches that came before the index
            self._want(idx, start, stop)
        return index

    def _read_index(self, idx: int) -> ShardIndex:
        """Read shard ``idx``'s index (in the caller's thread or an index thread); its retries are counted
        as they happen, as a block's are, also for an index read ahead that the stream never reaches."""
        return read_index(self.shard_urls[idx], self.policy.retries, self._count_retries)

    def _keep_index(self, idx: int, index: ShardIndex) -> ShardIndex:
        """Check a shard's index against the manifest and cache it (the caller's thread)."""
        url = self.shard_urls[idx]
        self.stats.shards_opened += 1
        if (
            index.tokens != self.tokens[idx]
            or index.eos_positions.size != self.documents[idx]
            or index.dtype != self.manifest.dtype
        ):
            raise ShardError(
                f"shard {url!r}: holds {index.tokens} {index.dtype} tokens / {index.eos_positions.size} documents, "
                f"manifest says {self.tokens[idx]} {self.manifest.dtype} / {self.documents[idx]}"
            )
        self._indexes[idx] = index
        if index.eos_positions.size <= _EOS_AS_LIST:
            self._eos_lists[idx] = index.eos_positions.tolist()
        while len(self._indexes) > _CACHED_INDEXES:
            self._eos_lists.pop(self._indexes.popitem(last=False)[0], None)
        return index

    def _eos_before(self, idx: int, index: ShardIndex, position: int) -> int:
        """How many EOS of shard ``idx`` lie before stream position ``position`` (a bisection of a
        Python list where the shard's documents are not too many: numpy's searchsorted would hand
        the interpreter lock to the block threads on each call)."""
        positions = self._eos_lists.get(idx)
        if positions is None:
            return int(index.eos_positions.searchsorted(position))
        return bisect.bisect_left(positions, position)

    @staticmethod
    def _bytes_of(index: ShardIndex, start: int, stop: int, eos: tuple[int, int]) -> tuple[int, int]:
        """The bytes holding the tokens of stream positions ``[start, stop)``, ``eos`` EOS before each."""
        item = index.dtype.itemsize
        return index.data_offset + (start - eos[0]) * item, index.data_offset + (stop - eos[1]) * item

    def _range(self, idx: int, start: int, stop: int, counts: tuple[int, int] | None = None) -> np.ndarray:
        """Stream positions ``[start, stop)`` of shard ``idx``, from their token bytes: read as one byte
        range (no whole-shard read), or cut from the blocks that hold them on an object store.
        ``counts``: the EOS before ``start`` and before ``stop``, where the caller has them."""
        index = self._index(idx)
        eos = index.eos_positions
        if counts is None:
            counts = self._eos_before(idx, index, start), self._eos_before(idx, index, stop)
        first, last = counts
        lo, hi = start - first, stop - last
        item = index.dtype.itemsize
        if self.remote_ranges():
            raw = self._from_blocks(idx, index, index.data_offset + lo * item, index.data_offset + hi * item)
        else:
            raw, _ = self._read_range(idx, index.data_offset + lo * item, index.data_offset + hi * item)
            self.stats.shard_bytes_read += len(raw)
        if len(raw) != (hi - lo) * item:
            raise ShardError(f"shard {self.shard_urls[idx]!r} is truncated (tokens {lo}..{hi} cut off)")
        return self._with_eos(np.frombuffer(raw, dtype=index.dtype), eos[first:last] - start, stop - start)

    # -- blocks (range mode on an object store)

    def _block_numbers(self, index: ShardIndex, lo: int, hi: int) -> range:
        """Blocks of a shard (``index``) that bytes ``[lo, hi)`` of its file lie in (block 0 starts at
        the first token byte)."""
        if hi <= lo:
            return range(0)
        origin = index.data_offset
        return range((lo - origin) // self.block_size, (hi - 1 - origin) // self.block_size + 1)

    def _block(self, idx: int, b: int) -> _Block:
        """Block ``b`` of shard ``idx``, requested now unless it is cached or on its way (the caller
        has made this process's threads: ``_pool_for_blocks``). Past ``block_budget`` bytes the cache
        drops blocks that no sample asked for by ``prefetch`` still needs first, then the least
        recently asked for (never the one asked for now)."""
        key = (idx, b)
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
            return block
        index = self._index(idx)
        end = index.data_offset + index.tokens * index.dtype.itemsize
        lo = index.data_offset + b * self.block_size
        hi = min(lo + self.block_size, end)
        block = self._blocks[key] = _Block(lo, hi - lo, self._block_pool.submit(self._read_block, idx, lo, hi))
        self._block_bytes += block.size
        while self._block_bytes > self.block_budget and len(self._blocks) > 1:
            done = next((k for k, v in self._blocks.items() if v.wanted <= 0 and k != key), None)
            old = self._blocks.pop(done if done is not None else next(iter(self._blocks)))
            self._block_bytes -= old.size
            old.future.cancel()
            self.stats.cache_evictions += 1
        return block

    def _pool_for_blocks(self) -> None:
        """The block and index threads of this process (made anew after a fork, with empty caches)."""
        if self._block_pool is None or self._block_pid != os.getpid():
            self._block_pool = ThreadPoolExecutor(max_workers=BLOCK_THREADS, thread_name_prefix="block-read")
            self._index_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="index-read")
            self._block_pid, self._blocks, self._block_bytes = os.getpid(), OrderedDict(), 0
            self._index_reads, self._waiting = {}, {}

    def _read_block(self, idx: int, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)`` of shard ``idx`` with one range GET, retried (in a block thread); the
        retries and bytes are counted as they happen."""
        url = self.shard_urls[idx]
        data, _ = with_retries(url, self.policy.retries, lambda: cat(url, lo, hi), count=self._count_retries)
        with _stats_lock:
            self.stats.shard_bytes_read += len(data)
        return data

    def _from_blocks(self, idx: int, index: ShardIndex, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)`` of shard ``idx``'s file (``index``), cut from its blocks (waiting for those
        on their way; a failed read raises its ShardError here, naming the shard)."""
        self._pool_for_blocks()
        parts = []
        for b in self._block_numbers(index, lo, hi):
            block = self._block(idx, b)
            try:
                data = block.future.result()
            except BaseException:
                self._blocks.pop((idx, b), None)
                self._block_bytes -= block.size
                raise
            block.wanted -= 1
            if not block.used:
                block.used = True
                with _stats_lock:
                    self.stats.prefetched += 1
            parts.append(data[max(lo, block.start) - block.start : min(hi, block.start + block.size) - block.start])
        return parts[0] if len(parts) == 1 else b"".join(parts)


@dataclass
class _Block:
    """One block of a shard's token payload: file bytes ``[start, start + size)``, being read or read."""

    start: int
    size: int
    future: Future
    used: bool = False  # a sample was cut from it
    wanted: int = 0  # pieces of samples that prefetch asked it for and that were not read yet
