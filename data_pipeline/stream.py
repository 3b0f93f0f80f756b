"""Streaming loader: a global, deterministic order of packed samples, resumable at any world size.

The order is defined once, globally, independent of ranks and data-loader workers:

1. Per source (one manifest) and epoch ``e``, the shards are permuted with a seed derived from
   ``(seed, source fingerprint, e)``. Their documents, each followed by EOS, are concatenated into
   one token stream in that order.
2. Packed sample ``j`` of the epoch is ``stream[j*L : j*L + L + 1]`` (``L = seq_len``): inputs are the
   first ``L`` tokens, labels the last ``L``; consecutive samples share one token, so every token is
   a target exactly once. The tail shorter than ``L + 1`` is dropped; the next epoch follows.
3. Shuffle: the epoch's samples are cut into windows of ``shuffle_buffer`` consecutive samples and
   each window is permuted with a seed derived from ``(seed, fingerprint, e, window)``.
4. Mixture: global sample ``g`` is assigned to a source by blocks of ``mix_block`` samples; each
   block holds each source's exact quota (largest-remainder rounding of the weights) in a seeded
   order, so the mixture is exact per block and needs no history to evaluate.

Rank ``r`` of ``world_size`` takes global samples ``start + r + i * world_size`` (``i = 0, 1, ...``);
with ``DataLoader`` workers, worker ``w`` of ``k`` produces the rank's batches ``w, w + k, ...`` (of
``batch_size`` samples), which is exactly the order in which ``DataLoader`` returns them. The
resumable state is therefore just the number of global samples consumed (plus the mixture
bookkeeping), so a run saved at one world size / worker count / batch size resumes at any other
with exactly the samples not yet consumed.

Reading: ``read="shard"`` loads whole shards (sha256-verified, cached, the next one prefetched in a
thread); ``read="range"`` reads only each sample's byte range plus a small per-shard index.

Memory: per shard two int64 counts, its URL and its hash (~200 bytes), one shuffle-window
permutation, and a bounded cache of decoded shards; nothing proportional to tokens or documents.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from fsspec.core import url_to_fs
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipeline.shards import (
    Manifest,
    ShardError,
    ShardIndex,
    checked_shard,
    load_manifest,
    read_bytes,
    read_index,
    sha256_hex,
    with_retries,
)
from data_pipeline.tokenizer import TokenizerMismatchError, check_tokenizer, smallest_dtype

STATE_VERSION = 1
_SHARD_ORDER_TAG = 1
_WINDOW_TAG = 2
_MIX_TAG = 3


def _rng(*keys: int) -> np.random.Generator:
    """A generator seeded from non-negative integer keys (order-sensitive, platform-independent)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in keys])))


def tokenizer_info(manifest: str | Manifest) -> dict[str, Any]:
    """Tokenizer identity of a manifest (URL/dir or loaded): kind, vocab_size, eos_id, pad_id,
    sha256, model, plus the shards' token ``dtype``. Trainers compare it with their tokenizer."""
    m = load_manifest(manifest) if isinstance(manifest, str) else manifest
    return {**m.tokenizer, "dtype": m.dtype}


class _Source:
    """One manifest of a mixture: shard table, per-epoch layout, shuffle window and shard cache."""

    def __init__(
        self, url: str, seq_len: int, seed: int, shuffle_buffer: int, shuffle: bool, prefetch: bool, read: str
    ) -> None:
        m = load_manifest(url)
        self.manifest = m
        self.url = m.url
        self.fingerprint = m.fingerprint
        self.salt = int(self.fingerprint[:15], 16)
        self.seq_len = seq_len
        self.seed = seed
        self.window = max(1, shuffle_buffer) if shuffle else 1
        self.shuffle = shuffle
        self.eos = int(m.tokenizer["eos_id"])
        self.out_dtype = smallest_dtype(int(m.tokenizer["vocab_size"]))
        self.tokens = np.array([int(s["tokens"]) for s in m.shards], dtype=np.int64)
        self.documents = np.array([int(s["documents"]) for s in m.shards], dtype=np.int64)
        self.shard_urls = [m.shard_url(i) for i in range(len(m.shards))]
        self.shard_sha = [s["sha256"] for s in m.shards]
        m.shards = []  # the per-shard dicts (~1 KB each) are replaced by the compact lists above
        self.lengths = self.tokens + self.documents
        total = int(self.lengths.sum())
        self.samples_per_epoch = (total - 1) // seq_len
        if self.samples_per_epoch < 1:
            raise ValueError(
                f"source {self.url!r} has {total} tokens (with EOS), fewer than seq_len + 1 = {seq_len + 1}"
            )
        self.cache_budget = self.window * (seq_len + 1) + 2 * int(self.lengths.max())
        self._epoch = -1
        self._order = np.empty(0, dtype=np.int64)
        self._ends = np.empty(0, dtype=np.int64)
        self._window_key: tuple[int, int] = (-1, -1)
        self._window_perm = np.empty(0, dtype=np.int64)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cached_tokens = 0
        self.prefetch = prefetch and read == "shard"
        self.read = read
        self._indexes: OrderedDict[int, ShardIndex] = OrderedDict()
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._handles_pid = -1
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = -1
        self._inflight: OrderedDict[int, Future] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the shard cache and the prefetch thread (workers rebuild them)."""
        state = dict(self.__dict__)
        state.update(_cache=OrderedDict(), _cached_tokens=0, _pool=None, _pool_pid=-1, _inflight=OrderedDict())
        state.update(_handles=OrderedDict(), _handles_pid=-1)
        return state

    def _handle(self, idx: int) -> Any:
        """An open fsspec file for shard ``idx`` (range mode), kept in a small LRU; reopened after fork."""
        if self._handles_pid != os.getpid():
            self._handles, self._handles_pid = OrderedDict(), os.getpid()
        f = self._handles.get(idx)
        if f is None:
            fs, path = url_to_fs(self.shard_urls[idx])
            f = self._handles[idx] = fs.open(path, "rb")
            while len(self._handles) > 16:
                self._handles.popitem(last=False)[1].close()
        self._handles.move_to_end(idx)
        return f

    def _drop_handle(self, idx: int) -> None:
        f = self._handles.pop(idx, None)
        if f is not None:
            f.close()

    def _read_range(self, idx: int, start: int, stop: int, retries: int) -> tuple[bytes, int]:
        """Bytes ``[start, stop)`` of shard ``idx`` through its cached handle."""

        def read() -> bytes:
            f = self._handle(idx)
            f.seek(start)
            return f.read(stop - start)

        return with_retries(self.shard_urls[idx], retries, read, lambda: self._drop_handle(idx))

    def _fetch(self, idx: int, verify: bool, retries: int) -> tuple[bytes, int, str]:
        """Read shard ``idx`` and hash it (runs in the prefetch thread or inline)."""
        data, used = read_bytes(self.shard_urls[idx], retries)
        return data, used, sha256_hex(data) if verify else ""

    def _schedule(self, idx: int, verify: bool, retries: int) -> None:
        """Start reading shard ``idx`` in the background (one thread per process, fork-safe)."""
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch")
            self._pool_pid = os.getpid()
            self._inflight = OrderedDict()
        if idx in self._cache or idx in self._inflight:
            return
        self._inflight[idx] = self._pool.submit(self._fetch, idx, verify, retries)
        while len(self._inflight) > 2:
            self._inflight.popitem(last=False)

    def _layout(self, epoch: int) -> None:
        """Shard order and cumulative stream ends for ``epoch`` (recomputed on epoch change)."""
        if epoch == self._epoch:
            return
        n = len(self.lengths)
        if self.shuffle:
            order = _rng(self.seed, self.salt, _SHARD_ORDER_TAG, epoch).permutation(n)
        else:
            order = np.arange(n)
        self._order = order
        self._ends = np.cumsum(self.lengths[order])
        self._epoch = epoch

    def _sample_in_epoch(self, epoch: int, q: int) -> int:
        """Packed-sample number within the epoch for shuffled position ``q``."""
        if self.window == 1:
            return q
        w, k = divmod(q, self.window)
        if self._window_key != (epoch, w):
            size = min(self.window, self.samples_per_epoch - w * self.window)
            self._window_perm = _rng(self.seed, self.salt, _WINDOW_TAG, epoch, w).permutation(size)
            self._window_key = (epoch, w)
        return w * self.window + int(self._window_perm[k])

    def _shard(self, idx: int, next_idx: int | None, stats: dict[str, int], verify: bool, retries: int) -> np.ndarray:
        """Decoded shard ``idx`` as one stream (documents each followed by EOS), through an LRU cache.

        On a miss, the shard that follows in the epoch's order (``next_idx``) starts loading in the
        background, so reading and hashing it overlaps with packing this one.
        """
        hit = self._cache.get(idx)
        if hit is not None:
            self._cache.move_to_end(idx)
            return hit
        url = self.shard_urls[idx]
        pending = self._inflight.pop(idx, None) if self._pool_pid == os.getpid() else None
        if pending is not None:
            data, used, digest = pending.result()
            stats["prefetched"] += 1
        else:
            data, used, digest = self._fetch(idx, verify, retries)
        if self.prefetch and next_idx is not None:
            self._schedule(next_idx, verify, retries)
        stats["read_retries"] += used
        stats["shards_opened"] += 1
        stats["shard_bytes_read"] += len(data)
        entry = {"sha256": self.shard_sha[idx], "tokens": self.tokens[idx], "documents": self.documents[idx]}
        tokens, lengths = checked_shard(data, url, entry, self.manifest.dtype, digest if verify else None)
        stats["sha256_verified"] += int(verify)
        stream = np.empty(tokens.size + lengths.size, dtype=self.out_dtype)
        eos_at = np.cumsum(lengths, dtype=np.int64) + np.arange(1, lengths.size + 1)
        eos_at -= 1
        keep = np.ones(stream.size, dtype=bool)
        keep[eos_at] = False
        stream[keep] = tokens
        stream[eos_at] = self.eos
        self._cache[idx] = stream
        self._cached_tokens += stream.size
        while self._cached_tokens > self.cache_budget and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= old.size
            stats["cache_evictions"] += 1
        return stream

    def _index(self, idx: int, stats: dict[str, int], retries: int) -> ShardIndex:
        """Token offset and EOS positions of shard ``idx`` (range-read mode), through a small LRU cache."""
        hit = self._indexes.get(idx)
        if hit is not None:
            self._indexes.move_to_end(idx)
            return hit
        url = self.shard_urls[idx]
        index = read_index(url, retries)
        stats["shards_opened"] += 1
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
        while len(self._indexes) > 64:
            self._indexes.popitem(last=False)
        return index

    def _range(self, idx: int, start: int, stop: int, stats: dict[str, int], retries: int) -> np.ndarray:
        """Stream positions ``[start, stop)`` of shard ``idx`` read as one byte range (no whole-shard read)."""
        index = self._index(idx, stats, retries)
        eos = index.eos_positions
        first, last = int(eos.searchsorted(start)), int(eos.searchsorted(stop))
        lo, hi = start - first, stop - last
        item = index.dtype.itemsize
        url = self.shard_urls[idx]
        raw, used = self._read_range(idx, index.data_offset + lo * item, index.data_offset + hi * item, retries)
        stats["read_retries"] += used
        stats["shard_bytes_read"] += len(raw)
        if len(raw) != (hi - lo) * item:
            raise ShardError(f"shard {url!r} is truncated (tokens {lo}..{hi} cut off)")
        out = np.empty(stop - start, dtype=self.out_dtype)
        at = eos[first:last] - start
        keep = np.ones(out.size, dtype=bool)
        keep[at] = False
        out[keep] = np.frombuffer(raw, dtype=index.dtype)
        out[at] = self.eos
        return out

    def span(self, epoch: int, start: int, stop: int, stats: dict[str, int], verify: bool, retries: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the epoch's stream (may cross shard boundaries)."""
        self._layout(epoch)
        pos = int(self._ends.searchsorted(start, side="right"))
        pieces = []
        while start < stop:
            shard_end = int(self._ends[pos])
            shard_start = shard_end - int(self.lengths[self._order[pos]])
            following = int(self._order[pos + 1]) if pos + 1 < len(self._order) else None
            take = min(stop, shard_end)
            idx = int(self._order[pos])
            if self.read == "range":
                pieces.append(self._range(idx, start - shard_start, take - shard_start, stats, retries))
            else:
                stream = self._shard(idx, following, stats, verify, retries)
                pieces.append(stream[start - shard_start : take - shard_start])
            start = take
            pos += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def sample(
        self, position: int, with_prev: bool, stats: dict[str, int], verify: bool, retries: int
    ) -> tuple[np.ndarray, bool]:
        """Tokens of the source's ``position``-th sample (``seq_len + 1`` of them, or one more in front
        when ``with_prev`` and the sample does not start the epoch); returns ``(tokens, has_prev)``."""
        epoch, q = divmod(position, self.samples_per_epoch)
        j = self._sample_in_epoch(epoch, q)
        start = j * self.seq_len
        has_prev = with_prev and start > 0
        return self.span(epoch, start - int(has_prev), start + self.seq_len + 1, stats, verify, retries), has_prev


class _Mixture:
    """Deterministic assignment of global sample numbers to sources (see module docstring, step 4)."""

    def __init__(self, weights: Sequence[float], block: int, seed: int) -> None:
        if block < 1:
            raise ValueError(f"mix_block must be >= 1, not {block}")
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or not np.all(np.isfinite(w)) or w.sum() <= 0:
            raise ValueError(f"mixture weights must be non-negative, finite and not all zero: {list(weights)}")
        w = w / w.sum()
        exact = w * block
        quota = np.floor(exact).astype(np.int64)
        remainder = exact - quota
        for i in np.argsort(-remainder, kind="stable")[: block - int(quota.sum())]:
            quota[i] += 1
        self.weights = w
        self.block = block
        self.seed = seed
        self.quota = quota
        self._base = np.repeat(np.arange(len(w)), quota)
        self._cached_block = -1
        self._perm = self._base
        self._rank = np.zeros(0, dtype=np.int64)

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Source of each slot in block ``b`` and its rank among that source's slots."""
        if b != self._cached_block:
            perm = _rng(self.seed, _MIX_TAG, b).permutation(self._base) if len(self.quota) > 1 else self._base
            order = np.argsort(perm, kind="stable")
            rank = np.empty(self.block, dtype=np.int64)
            rank[order] = np.arange(self.block) - np.repeat(np.cumsum(self.quota) - self.quota, self.quota)
            self._perm, self._rank, self._cached_block = perm, rank, b
        return self._perm, self._rank

    def locate(self, n: int) -> tuple[int, int]:
        """``(source, k)``: the ``n``-th sample of this mixture is source's ``k``-th sample."""
        b, i = divmod(n, self.block)
        perm, rank = self._block(b)
        s = int(perm[i])
        return s, b * int(self.quota[s]) + int(rank[i])

    def counts(self, n: int) -> np.ndarray:
        """How many of the first ``n`` samples of this mixture each source received."""
        b, i = divmod(n, self.block)
        perm, _ = self._block(b)
        return b * self.quota + np.bincount(perm[:i], minlength=len(self.quota))


class PackedStream(IterableDataset):
    """Packed, shuffled, mixed token sequences from shard manifests, resumable at any world size.

    Args:
        sources: ``[(manifest dir or URL, weight), ...]``; weights are normalized.
        seq_len: tokens per sample (``input_ids`` and ``labels`` each have ``seq_len``).
        seed: seeds shard order, shuffle windows and mixture order.
        rank, world_size: this data-parallel rank and the number of ranks.
        shuffle_buffer: samples per shuffle window (1 = no within-window shuffle).
        doc_boundaries: add ``doc_start`` (bool ``[seq_len]``, True where an input token starts a document).
        batch_size: per-rank batch size used with ``DataLoader(num_workers > 0)``; it decides which
            worker produces which batch so that ``DataLoader`` returns the rank's samples in order.
        shuffle: False gives shards in manifest order and no window shuffle (evaluation).
        verify: check each shard's sha256 when it is read (cost: one hash pass over the bytes).
        expected_tokenizer: ``"bytes"``, a sentencepiece model path, or an identity dict; a mismatch
            with the shards' tokenizer raises ``TokenizerMismatchError``.
        max_samples: stop before global sample ``max_samples`` (None: infinite stream, epochs repeat).
        mix_block: samples per mixture block (the mixture is exact within each block).
        read_retries: retries of a failed (non-missing) shard read before raising ``ShardError``.
        prefetch: read (and hash) the next shard in a background thread while packing the current one.
        read: ``"shard"`` reads, verifies and caches whole shards (every rank reads every shard of its
            shuffle windows); ``"range"`` reads only each sample's byte range plus a small per-shard
            index, so a rank reads ~1/world_size of the data. sha256 needs whole files, so
            ``"range"`` requires ``verify=False`` (structure and counts are still checked; verify the
            set once with ``python -m data_pipeline.verify``).

    Each sample is a dict: ``input_ids`` (int64 ``[seq_len]``), ``labels`` (int64 ``[seq_len]``,
    ``labels[t] = input_ids[t + 1]`` within the packed stream), ``index`` (global sample number),
    ``source`` (index into ``sources``) and, with ``doc_boundaries``, ``doc_start``.
    """

    def __init__(
        self,
        sources: Sequence[tuple[str, float]],
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 1024,
        doc_boundaries: bool = False,
        batch_size: int = 1,
        shuffle: bool = True,
        verify: bool = True,
        expected_tokenizer: str | dict[str, Any] | None = None,
        max_samples: int | None = None,
        mix_block: int = 4096,
        read_retries: int = 2,
        prefetch: bool = True,
        read: str = "shard",
    ) -> None:
        super().__init__()
        if seq_len < 1:
            raise ValueError("seq_len must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not sources:
            raise ValueError("at least one source is needed")
        if read not in ("shard", "range"):
            raise ValueError(f"read must be 'shard' or 'range', not {read!r}")
        if read == "range" and verify:
            raise ValueError("read='range' cannot check sha256 (it never reads whole shards); pass verify=False")
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle_buffer = shuffle_buffer
        self.doc_boundaries = doc_boundaries
        self.batch_size = batch_size
        self.verify = verify
        self.max_samples = max_samples
        self.read_retries = read_retries
        self.shuffle = shuffle
        self._sources = [_Source(url, seq_len, seed, shuffle_buffer, shuffle, prefetch, read) for url, _ in sources]
        fingerprints = [s.fingerprint for s in self._sources]
        if len(set(fingerprints)) != len(fingerprints):
            raise ValueError("the same dataset appears twice in sources; merge their weights instead")
        first = self._sources[0]
        for other in self._sources[1:]:
            try:
                check_tokenizer(other.manifest.tokenizer, first.manifest.tokenizer, where=f"shards of {other.url!r}")
            except TokenizerMismatchError as exc:
                raise TokenizerMismatchError(f"sources disagree on the tokenizer ({first.url!r}): {exc}") from exc
        if expected_tokenizer is not None:
            check_tokenizer(first.manifest.tokenizer, expected_tokenizer, where=f"shards of {first.url!r}")
        self.weights = [float(w) for _, w in sources]
        self._mixture = _Mixture(self.weights, mix_block, seed)
        self._origin = 0
        self._offsets = np.zeros(len(self._sources), dtype=np.int64)
        self._start = 0
        self._yielded = 0
        self._stats = self._zero_stats()

    @staticmethod
    def _zero_stats() -> dict[str, int]:
        return {
            "samples": 0,
            "shards_opened": 0,
            "shard_bytes_read": 0,
            "sha256_verified": 0,
            "read_retries": 0,
            "cache_evictions": 0,
            "prefetched": 0,
        }

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the shards' tokenizer."""
        return int(self._sources[0].manifest.tokenizer["vocab_size"])

    @property
    def tokenizer(self) -> dict[str, Any]:
        """Tokenizer identity shared by all sources (see ``tokenizer_info``)."""
        return tokenizer_info(self._sources[0].manifest)

    def samples_per_epoch(self) -> list[int]:
        """Packed samples in one epoch of each source (for logging epochs)."""
        return [s.samples_per_epoch for s in self._sources]

    def stats(self) -> dict[str, int]:
        """Counters for the logs: this process's reads (per data-loader worker when workers are used)
        plus the build-time skip counts of all sources (``build_empty_documents``,
        ``build_invalid_utf8_documents``, from the manifests)."""
        out = dict(self._stats)
        for key in ("empty_documents", "invalid_utf8_documents"):
            out[f"build_{key}"] = sum(int(s.manifest.stats.get(key, 0)) for s in self._sources)
        return out

    def locate(self, g: int) -> tuple[int, int]:
        """``(source, position within that source's infinite sample sequence)`` of global sample ``g``."""
        if g < self._origin:
            raise ValueError(f"sample {g} precedes the mixture change at sample {self._origin}; it has no source")
        s, k = self._mixture.locate(g - self._origin)
        return s, int(self._offsets[s]) + k

    def get(self, g: int) -> dict[str, Any]:
        """The sample with global number ``g`` (random access; the iterator uses the same path)."""
        s, position = self.locate(g)
        tokens, has_prev = self._sources[s].sample(
            position, self.doc_boundaries, self._stats, self.verify, self.read_retries
        )
        seq = tokens[1:] if has_prev else tokens
        out: dict[str, Any] = {
            "input_ids": torch.from_numpy(seq[:-1].astype(np.int64)),
            "labels": torch.from_numpy(seq[1:].astype(np.int64)),
            "index": g,
            "source": s,
        }
        if self.doc_boundaries:
            eos = self._sources[s].eos
            starts = np.empty(self.seq_len, dtype=bool)
            starts[0] = tokens[0] == eos if has_prev else True
            starts[1:] = seq[: self.seq_len - 1] == eos
            out["doc_start"] = torch.from_numpy(starts)
        return out

    def _local_indices(self) -> Iterator[int]:
        """Rank-local sample numbers this process produces, in the order ``DataLoader`` returns them."""
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        b = self.batch_size
        batch = worker
        while True:
            yield from range(batch * b, (batch + 1) * b)
            batch += workers

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield this rank's (and worker's) samples from the current resume point.

        In-process (no workers), a new iteration continues after the samples already yielded.
        """
        if get_worker_info() is None:
            self._start += self._yielded * self.world_size
        self._yielded = 0
        for j in self._local_indices():
            g = self._start + self.rank + j * self.world_size
            if self.max_samples is not None and g >= self.max_samples:
                return
            sample = self.get(g)
            self._stats["samples"] += 1
            self._yielded += 1
            yield sample

    def epochs(self, local_consumed: int | None = None) -> list[float]:
        """Fractional epochs of each source consumed so far (see ``state_dict`` for the argument)."""
        consumed = self.state_dict(local_consumed)["consumed"]
        positions = self._offsets + self._mixture.counts(consumed - self._origin)
        return [float(p) / s.samples_per_epoch for p, s in zip(positions.tolist(), self._sources)]

    def state_dict(self, local_consumed: int | None = None) -> dict[str, Any]:
        """Resumable state after this rank consumed ``local_consumed`` samples since the last resume
        point (default: the samples this object yielded in-process, i.e. ``num_workers=0``).

        All ranks hold the same state at a step boundary, so saving rank 0's is enough. Format::

            {"version": 1, "consumed": <global samples consumed>, "seq_len", "seed",
             "shuffle_buffer", "shuffle", "mix_block",
             "mixture": {"origin": <global sample where the current weights took effect>,
                         "sources": [fingerprint, ...], "urls": [...], "weights": [...],
                         "offsets": [per-source position at origin, ...]}}
        """
        n = self._yielded if local_consumed is None else local_consumed
        return {
            "version": STATE_VERSION,
            "consumed": self._start + n * self.world_size,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shuffle_buffer": self.shuffle_buffer,
            "shuffle": self.shuffle,
            "mix_block": self._mixture.block,
            "mixture": {
                "origin": self._origin,
                "sources": [s.fingerprint for s in self._sources],
                "urls": [s.url for s in self._sources],
                "weights": self.weights,
                "offsets": [int(x) for x in self._offsets],
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the samples ``state`` says were consumed, at this object's world size.

        Seq len, seed and shuffle settings must match (they define the order). If the mixture
        changed (per-block quotas, or sources added/removed), the new weights apply from the saved
        point on and each source that was in the old mixture continues where it stopped; new
        sources start at 0. Weights that normalize to the same quotas are no change.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported stream state version {state.get('version')!r}")
        for key in ("seq_len", "seed", "shuffle_buffer", "shuffle"):
            mine = getattr(self, key)
            if state[key] != mine:
                raise ValueError(
                    f"cannot resume exactly: the saved stream had {key}={state[key]!r}, this one has {mine!r}"
                )
        consumed = int(state["consumed"])
        mix = state["mixture"]
        fingerprints = [s.fingerprint for s in self._sources]
        old = _Mixture(mix["weights"], int(state["mix_block"]), self.seed)
        if (
            mix["sources"] == fingerprints
            and old.block == self._mixture.block
            and np.array_equal(old.quota, self._mixture.quota)
        ):
            self._origin = int(mix["origin"])
            self._offsets = np.asarray(mix["offsets"], dtype=np.int64)
        else:
            old_positions = np.asarray(mix["offsets"], dtype=np.int64) + old.counts(consumed - int(mix["origin"]))
            by_fingerprint = dict(zip(mix["sources"], old_positions.tolist()))
            self._origin = consumed
            self._offsets = np.array([by_fingerprint.get(f, 0) for f in fingerprints], dtype=np.int64)
        self._start = consumed
        self._yielded = 0


class StreamLoader:
    """A ``DataLoader`` over a ``PackedStream`` that knows how many samples were consumed.

    Iterating yields collated batches of ``stream.batch_size`` samples; ``state_dict()`` counts
    only batches handed to the caller (not those prefetched by workers), so it is exact with any
    ``num_workers``. A new iterator starts from the last ``load_state_dict`` / consumed point.
    """

    def __init__(self, stream: PackedStream, num_workers: int = 0, **loader_kwargs: Any) -> None:
        if loader_kwargs.get("persistent_workers") or "batch_size" in loader_kwargs:
            raise ValueError("StreamLoader sets batch_size from the stream and cannot use persistent workers")
        self.stream = stream
        self.num_workers = num_workers
        self.loader_kwargs = loader_kwargs
        stream.load_state_dict(stream.state_dict())  # start after samples the stream already yielded
        self._consumed_local = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        base = self.stream.state_dict(self._consumed_local)
        self.stream.load_state_dict(base)
        self._consumed_local = 0
        loader = DataLoader(
            self.stream, batch_size=self.stream.batch_size, num_workers=self.num_workers, **self.loader_kwargs
        )
        for batch in loader:
            self._consumed_local += int(batch["input_ids"].shape[0])
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Stream state after the batches yielded so far."""
        return self.stream.state_dict(self._consumed_local)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a state saved by any ``StreamLoader`` / ``PackedStream`` of the same data."""
        self.stream.load_state_dict(state)
        self._consumed_local = 0

    def stats(self) -> dict[str, int]:
        """The stream's I/O counters (see ``PackedStream.stats``)."""
        return self.stream.stats()


__all__ = ["PackedStream", "ShardError", "StreamLoader", "TokenizerMismatchError", "tokenizer_info"]
