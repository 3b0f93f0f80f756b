"""Reading one source's shards as token streams (documents each followed by EOS): whole shards
(sha256-verified, cached, the next one prefetched in a thread) or byte ranges plus a small per-shard
index. Knows nothing of sample order; ``data_pipeline.order`` says which positions to read."""

from __future__ import annotations

import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from fsspec.core import url_to_fs

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
_INFLIGHT = 2
RANGE_AHEAD = 16
"""Byte ranges of upcoming samples read concurrently on an object store (range mode): one GET costs a
round trip, so reading one sample at a time would leave a rank waiting on latency, not bandwidth."""


@dataclass
class ReadPolicy:
    """How shards are read.

    mode: ``"shard"`` reads whole shards, ``"range"`` only the requested byte ranges.
    verify: check each whole shard's sha256 (impossible in range mode).
    retries: retries of a failed (non-missing) read before raising ``ShardError``.
    prefetch: read and hash the next shard in a background thread (shard mode).
    """

    mode: str = "shard"
    verify: bool = True
    retries: int = 2
    prefetch: bool = True

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
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._handles_pid = -1
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = -1
        self._inflight: OrderedDict[int, Future] = OrderedDict()
        self._ranges: OrderedDict[tuple[int, int, int], Future] = OrderedDict()
        self._range_pool: ThreadPoolExecutor | None = None
        self._range_pid = -1

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the shard cache, open files and the prefetch thread (workers rebuild them)."""
        state = dict(self.__dict__)
        state.update(_cache=OrderedDict(), _cached_tokens=0, _pool=None, _pool_pid=-1, _inflight=OrderedDict())
        state.update(_handles=OrderedDict(), _handles_pid=-1, _ranges=OrderedDict(), _range_pool=None, _range_pid=-1)
        return state

    def prefetch(self, idx: int, start: int, stop: int) -> None:
        """Start reading positions ``[start, stop)`` of shard ``idx`` in the background (range mode on
        an object store; elsewhere nothing): at most RANGE_AHEAD reads wait, concurrently. The shard's
        index is read here, in the caller's thread; the threads only fetch bytes."""
        if self.policy.mode != "range" or not is_remote(self.shard_urls[idx]):
            return
        if self._range_pool is None or self._range_pid != os.getpid():
            self._range_pool = ThreadPoolExecutor(max_workers=RANGE_AHEAD, thread_name_prefix="range-prefetch")
            self._range_pid, self._ranges = os.getpid(), OrderedDict()
        key = (idx, start, stop)
        if key in self._ranges:
            return
        lo, hi = self._byte_span(idx, start, stop)
        self._ranges[key] = self._range_pool.submit(self._read_range, idx, lo, hi)
        while len(self._ranges) > 4 * RANGE_AHEAD:  # ranges never asked for (a skip, a new iteration)
            self._ranges.popitem(last=False)

    def span(self, idx: int, start: int, stop: int, following: int | None) -> np.ndarray:
        """Positions ``[start, stop)`` of shard ``idx``'s stream; ``following`` is the shard read next
        in the epoch's order (prefetched in shard mode)."""
        if self.policy.mode == "range":
            return self._range(idx, start, stop)
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
        """Bytes ``[start, stop)`` of shard ``idx``: one range GET on an object store (an open
        file there would read whole blocks ahead), a seek and read of a cached handle on disk."""
        url = self.shard_urls[idx]
        if is_remote(url):
            return with_retries(url, self.policy.retries, lambda: cat(url, start, stop))

        def read() -> bytes:
            f = self._handle(idx)
            f.seek(start)
            return f.read(stop - start)

        return with_retries(self.shard_urls[idx], self.policy.retries, read, lambda: self._drop_handle(idx))

    def _fetch(self, idx: int) -> tuple[bytes, int, str]:
        """Read shard ``idx`` and hash it (runs in the prefetch thread or inline)."""
        data, used = read_bytes(self.shard_urls[idx], self.policy.retries)
        return data, used, sha256_hex(data) if self.policy.verify else ""

    def _schedule(self, idx: int) -> None:
        """Start reading shard ``idx`` in the background (one thread per process, fork-safe)."""
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch")
            self._pool_pid = os.getpid()
            self._inflight = OrderedDict()
        if idx in self._cache or idx in self._inflight:
            return
        self._inflight[idx] = self._pool.submit(self._fetch, idx)
        while len(self._inflight) > _INFLIGHT:
            self._inflight.popitem(last=False)

    def _shard(self, idx: int, following: int | None) -> np.ndarray:
        """Decoded shard ``idx`` as one stream, through an LRU cache; on a miss, ``following`` starts
        loading in the background so its reading and hashing overlap with packing this one."""
        hit = self._cache.get(idx)
        if hit is not None:
            self._cache.move_to_end(idx)
            return hit
        verify = self.policy.verify
        pending = self._inflight.pop(idx, None) if self._pool_pid == os.getpid() else None
        if pending is not None:
            data, used, digest = pending.result()
            self.stats.prefetched += 1
        else:
            data, used, digest = self._fetch(idx)
        if self.policy.prefetch and following is not None:
            self._schedule(following)
        self.stats.read_retries += used
        self.stats.shards_opened += 1
        self.stats.shard_bytes_read += len(data)
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
        keep = np.ones(size, dtype=bool)
        keep[eos_at] = False
        out[keep] = tokens
        out[eos_at] = self.eos
        return out

    def _index(self, idx: int) -> ShardIndex:
        """Token offset and EOS positions of shard ``idx`` (range mode), through a small LRU cache."""
        hit = self._indexes.get(idx)
        if hit is not None:
            self._indexes.move_to_end(idx)
            return hit
        url = self.shard_urls[idx]
        index = read_index(url, self.policy.retries)
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
        while len(self._indexes) > _CACHED_INDEXES:
            self._indexes.popitem(last=False)
        return index

    def _byte_span(self, idx: int, start: int, stop: int) -> tuple[int, int]:
        """The bytes of shard ``idx`` holding the tokens of stream positions ``[start, stop)``."""
        index = self._index(idx)
        first, last = int(index.eos_positions.searchsorted(start)), int(index.eos_positions.searchsorted(stop))
        item = index.dtype.itemsize
        return index.data_offset + (start - first) * item, index.data_offset + (stop - last) * item

    def _range(self, idx: int, start: int, stop: int) -> np.ndarray:
        """Stream positions ``[start, stop)`` of shard ``idx`` read as one byte range (no whole-shard
        read), or taken from a prefetch started for them."""
        index = self._index(idx)
        eos = index.eos_positions
        first, last = int(eos.searchsorted(start)), int(eos.searchsorted(stop))
        lo, hi = start - first, stop - last
        item = index.dtype.itemsize
        pending = self._ranges.pop((idx, start, stop), None) if self._range_pid == os.getpid() else None
        if pending is not None:
            raw, used = pending.result()
            self.stats.prefetched += 1
        else:
            raw, used = self._read_range(idx, index.data_offset + lo * item, index.data_offset + hi * item)
        self.stats.read_retries += used
        self.stats.shard_bytes_read += len(raw)
        if len(raw) != (hi - lo) * item:
            raise ShardError(f"shard {self.shard_urls[idx]!r} is truncated (tokens {lo}..{hi} cut off)")
        return self._with_eos(np.frombuffer(raw, dtype=index.dtype), eos[first:last] - start, stop - start)
