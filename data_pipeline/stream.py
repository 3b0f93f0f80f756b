"""Packed, shuffled, mixed token sequences from shard manifests, resumable at any world size.

``data_pipeline.order`` defines one global sample order, independent of ranks and workers;
``data_pipeline.shard_reader`` reads the shard positions it names. This module packs samples from
them, splits the order over ranks and ``DataLoader`` workers, and keeps the resumable state: the
number of global samples consumed plus the mixture bookkeeping (see docs/data.md).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipeline import shard_reader
from data_pipeline.order import Mixture, SourceOrder, check_interleave
from data_pipeline.shard_reader import ReadPolicy, ReadStats, ShardReader
from data_pipeline.shards import Manifest, ShardError, load_manifest
from data_pipeline.skips import SkipRanges
from data_pipeline.tokenizer import TokenizerMismatchError, check_tokenizer

STATE_VERSION = 1


def tokenizer_info(manifest: str | Manifest) -> dict[str, Any]:
    """Tokenizer identity of a manifest (URL/dir or loaded): kind, vocab_size, eos_id, pad_id,
    sha256, model, plus the shards' token ``dtype``. Trainers compare it with their tokenizer."""
    m = load_manifest(manifest) if isinstance(manifest, str) else manifest
    return {**m.tokenizer, "dtype": m.dtype}


_Planned = tuple[list[tuple[tuple[int, int, int, list[int]], Any]], bool]
"""Where a sample lies: its pieces (shard, first and end position, following shards) with what the
reader worked out for each when it asked for their blocks, and whether a token precedes it."""


class _Source:
    """One manifest of a mixture: its sample order and its shard reader."""

    def __init__(
        self,
        url: str,
        seq_len: int,
        seed: int,
        shuffle_buffer: int,
        shuffle: bool,
        policy: ReadPolicy,
        stats: ReadStats,
        interleave: int = 1,
        region: int = 1,
    ) -> None:
        m = load_manifest(url)
        self.manifest = m
        self.url = m.url
        self.fingerprint = m.fingerprint
        window = max(1, shuffle_buffer) if shuffle else 1
        # the reader's caches hold the windows a rank reads side by side (``region`` of them)
        self.reader = ShardReader(m, policy, stats, region * window * (seq_len + 1))
        self.eos = self.reader.eos
        salt = int(self.fingerprint[:15], 16)
        self.order = SourceOrder(self.reader.lengths, seq_len, seed, salt, window, shuffle, self.url, interleave)
        self.samples_per_epoch = self.order.samples_per_epoch
        self.region = region

    def prefetch(self, position: int, with_prev: bool) -> _Planned:
        """Let the reader start fetching the ``position``-th sample (range mode on an object store);
        returns where the sample lies, which ``sample`` takes instead of working it out again."""
        epoch, start, stop, has_prev = self.order.sample_span(position, with_prev)
        pieces = [(piece, self.reader.prefetch(*piece[:3])) for piece in self.order.pieces(epoch, start, stop, 0)]
        return pieces, has_prev

    def sample(self, position: int, with_prev: bool, planned: _Planned | None = None) -> tuple[np.ndarray, bool]:
        """Tokens of the source's ``position``-th sample (``seq_len + 1`` of them, or one more in front
        when ``with_prev`` and the sample does not start the epoch); returns ``(tokens, has_prev)``.
        ``planned``: what ``prefetch`` returned for it."""
        if planned is None:
            epoch, start, stop, has_prev = self.order.sample_span(position, with_prev)
            limit = self.order.stretch_limit(position % self.samples_per_epoch, self.region)
            pieces = self.order.pieces(epoch, start, stop, shard_reader.SHARDS_AHEAD, limit)
            planned = [(piece, None) for piece in pieces], has_prev
        located, has_prev = planned
        pieces = [self.reader.span(*piece, eos) for piece, eos in located]
        return (pieces[0] if len(pieces) == 1 else np.concatenate(pieces)), has_prev


def document_starts(ids: np.ndarray, eos_id: int, first: bool = True) -> np.ndarray:
    """bool [len(ids)]: True where a token starts a document, i.e. follows an EOS; ``first`` is ids[0]'s
    (whose predecessor is not in ids). The ``doc_start`` of data.doc_boundaries."""
    starts = np.empty(ids.shape[0], dtype=bool)
    starts[0] = first
    starts[1:] = ids[:-1] == eos_id
    return starts


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
        prefetch: read (and hash) the next shards in a background thread while packing the current one;
            with ``read="range"`` on an object store, request the blocks of this rank's next samples
            (at least two blocks of the stream ahead) from a few threads.
        read: ``"shard"`` reads, verifies and caches whole shards (every rank reads every shard of its
            shuffle windows); ``"range"`` reads only each sample's byte range plus a small per-shard
            index, so a rank reads ~1/world_size of the data (on an object store: the blocks of
            ``storage.block_size`` bytes that hold its samples, which is all of them unless the ranks
            are many or the blocks small; docs/data.md, "Reading"). sha256 needs whole files, so
            ``"range"`` requires ``verify=False`` (structure and counts are still checked; verify the
            set once with ``python -m data_pipeline.verify``).
        block_size: bytes per request of range reads on an object store (None: ``storage.block_size``).
        skip_samples: ``[[first, end), ...]`` global sample numbers never read (data_pipeline/skips.py);
            the ranges are part of the state, so a resumed stream skips them too.
        interleave: shuffle windows read side by side (a power of two, C; 1 = window after window).
            Global samples equal modulo C form a lane: the mixture gives each lane its own blocks, and
            a source's lane-``c`` samples are its positions equal to ``c`` modulo C, which the order
            lays out so that the lanes of a rank (of a world size W dividing C) read C / W
            consecutive windows of each span of C windows (``order.SourceOrder``): a rank's samples
            lie together in the shards, so range reads on an object store fetch blocks of mostly its
            own samples (docs/data.md, "Interleaved windows"). Part of the order: a resume keeps it.

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
        skip_samples: Sequence[Sequence[int]] = (),
        block_size: int | None = None,
        interleave: int = 1,
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
        interleave = check_interleave(interleave)
        if interleave > 1 and not shuffle:
            raise ValueError("interleave > 1 lays out shuffle windows; with shuffle=False it must be 1")
        policy = ReadPolicy(mode=read, verify=verify, retries=read_retries, prefetch=prefetch and read == "shard",
                            block_size=block_size)
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle_buffer = shuffle_buffer
        self.doc_boundaries = doc_boundaries
        self.batch_size = batch_size
        self.max_samples = max_samples
        self.shuffle = shuffle
        self.interleave = interleave
        self._read_stats = ReadStats()
        self._read_ahead = 0  # samples whose blocks are requested ahead (range reads on an object store)
        self._samples = 0
        self._skips = SkipRanges(skip_samples)
        region = interleave // math.gcd(world_size, interleave)  # windows a rank reads side by side
        self._sources = [
            _Source(url, seq_len, seed, shuffle_buffer, shuffle, policy, self._read_stats, interleave, region)
            for url, _ in sources
        ]
        self._prefetch = prefetch
        self._plan_read_ahead()
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
        self._mixture = Mixture(self.weights, mix_block, seed, interleave)
        self._origin = 0
        self._offsets = np.zeros((len(self._sources), interleave), dtype=np.int64)  # per source and lane
        self._start = self._skips.nth(0, 0)
        self._yielded = 0

    def _plan_read_ahead(self) -> None:
        """How many samples ahead the blocks of range reads on an object store are asked for, and the
        block caches that this needs (in each data-loader worker anew: a worker's samples lie further
        apart)."""
        remote = [s.reader for s in self._sources if s.reader.remote_ranges()]
        if not (self._prefetch and remote):
            return
        self._read_ahead = max(self._samples_ahead(reader) for reader in remote)
        for reader in remote:
            item = np.dtype(reader.manifest.dtype).itemsize
            reader.set_read_ahead(self._read_ahead, (self.seq_len + 2) * item, self._read_ahead * self._stride(item))

    def _stride(self, itemsize: int) -> int:
        """Bytes of a source's stream between two samples of this rank (and data-loader worker), within
        the windows the rank reads side by side (its ``world_size / gcd(world_size, interleave)``-th
        samples of them)."""
        info = get_worker_info()
        ranks = self.world_size // math.gcd(self.world_size, self.interleave)
        return ranks * (1 if info is None else info.num_workers) * self.seq_len * itemsize

    def _samples_ahead(self, reader: ShardReader) -> int:
        """This rank's samples to look ahead so that the read-ahead spans ``BLOCKS_AHEAD`` blocks of
        the stream, at least ``RANGE_AHEAD`` and at most 4,096."""
        stride = self._stride(np.dtype(reader.manifest.dtype).itemsize)
        spans = math.ceil(shard_reader.BLOCKS_AHEAD * reader.block_size / stride)
        return min(4096, max(shard_reader.RANGE_AHEAD, spans))

    def close(self, wait: bool = False) -> None:
        """Stop this process's background reads (shards, blocks, indexes), drop the caches (a later iteration
        starts again); with ``wait``, return once the running reads end (their retries all in ``stats()``)."""
        for source in self._sources:
            source.reader.close(wait)

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
        out = {"samples": self._samples, **asdict(self._read_stats)}
        for key in ("empty_documents", "invalid_utf8_documents"):
            out[f"build_{key}"] = sum(int(s.manifest.stats.get(key, 0)) for s in self._sources)
        return out

    def locate(self, g: int) -> tuple[int, int]:
        """``(source, position within that source's infinite sample sequence)`` of global sample ``g``."""
        if g < self._origin:
            raise ValueError(f"sample {g} precedes the mixture change at sample {self._origin}; it has no source")
        lanes = self.interleave
        lane, i = g % lanes, g // lanes
        s, k = self._mixture.locate(i - self._lane_start(self._origin, lane), lane)
        return s, (int(self._offsets[s, lane]) + k) * lanes + lane

    def _lane_start(self, g: int, lane: int) -> int:
        """How many samples of ``lane`` (global numbers equal to it modulo ``interleave``) precede ``g``."""
        return -((lane - g) // self.interleave)

    def _positions(self, mixture: Mixture, origin: int, offsets: np.ndarray, consumed: int) -> np.ndarray:
        """Each source's position in each lane (int64 ``[sources, lanes]``) after the global samples
        before ``consumed``, for a mixture that took effect at ``origin`` with ``offsets``."""
        positions = np.array(offsets, dtype=np.int64, copy=True)
        for lane in range(self.interleave):
            n = self._lane_start(consumed, lane) - self._lane_start(origin, lane)
            positions[:, lane] += mixture.counts(n, lane)
        return positions

    def get(self, g: int) -> dict[str, Any]:
        """The sample with global number ``g`` (random access; the iterator uses the same path)."""
        return self._get(g, *self.locate(g))

    def _get(self, g: int, s: int, position: int, planned: _Planned | None = None) -> dict[str, Any]:
        """``get(g)`` for a sample already located: source ``s``'s ``position``-th (and where it lies,
        from its read-ahead)."""
        tokens, has_prev = self._sources[s].sample(position, self.doc_boundaries, planned)
        seq = tokens[1:] if has_prev else tokens
        out: dict[str, Any] = {
            "input_ids": torch.from_numpy(seq[:-1].astype(np.int64)),
            "labels": torch.from_numpy(seq[1:].astype(np.int64)),
            "index": g,
            "source": s,
        }
        if self.doc_boundaries:
            eos = self._sources[s].eos
            first = bool(tokens[0] == eos) if has_prev else True
            out["doc_start"] = torch.from_numpy(document_starts(seq[: self.seq_len], eos, first))
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
            self._start = self._skips.nth(self._start, self._yielded * self.world_size)
        else:
            self._plan_read_ahead()
        self._yielded = 0
        ahead: deque[tuple[int, Any]] = deque()  # global number, and where the read-ahead located it
        upcoming = self._local_indices()
        while True:
            while len(ahead) <= self._read_ahead:  # range reads of the next samples start now
                g = self._skips.nth(self._start, self.rank + next(upcoming) * self.world_size)
                located = None
                if self._read_ahead and (self.max_samples is None or g < self.max_samples):
                    s, position = self.locate(g)
                    located = s, position, self._sources[s].prefetch(position, self.doc_boundaries)
                ahead.append((g, located))
            g, located = ahead.popleft()
            if self.max_samples is not None and g >= self.max_samples:
                return
            sample = self.get(g) if located is None else self._get(g, *located)
            self._samples += 1
            self._yielded += 1
            yield sample

    def epochs(self, local_consumed: int | None = None) -> list[float]:
        """Fractional epochs of each source consumed so far (see ``state_dict`` for the argument)."""
        consumed = self.state_dict(local_consumed)["consumed"]
        positions = self._positions(self._mixture, self._origin, self._offsets, consumed).sum(axis=1)
        return [float(p) / s.samples_per_epoch for p, s in zip(positions.tolist(), self._sources)]

    def state_dict(self, local_consumed: int | None = None) -> dict[str, Any]:
        """Resumable state after this rank consumed ``local_consumed`` samples since the last resume
        point (default: the samples this object yielded in-process, i.e. ``num_workers=0``).

        All ranks hold the same state at a step boundary, so saving rank 0's is enough. Format::

            {"version": 1, "consumed": <global number of the next sample to read (samples before it
                                        were consumed or skipped)>,
             "skip": [[first, end], ...] (skipped ranges, data_pipeline/skips.py), "seq_len", "seed",
             "shuffle_buffer", "shuffle", "interleave", "mix_block",
             "mixture": {"origin": <global sample where the current weights took effect>,
                         "sources": [fingerprint, ...], "urls": [...], "weights": [...],
                         "offsets": [per-source position at origin, ...]}}

        With ``interleave`` > 1 each source's offset is a list, its position in each lane.
        """
        n = self._yielded if local_consumed is None else local_consumed
        return {
            "version": STATE_VERSION,
            "consumed": self._skips.nth(self._start, n * self.world_size),
            "skip": self._skips.to_list(),
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shuffle_buffer": self.shuffle_buffer,
            "shuffle": self.shuffle,
            "interleave": self.interleave,
            "mix_block": self._mixture.block,
            "mixture": {
                "origin": self._origin,
                "sources": [s.fingerprint for s in self._sources],
                "urls": [s.url for s in self._sources],
                "weights": self.weights,
                "offsets": [int(x) for x in self._offsets[:, 0]] if self.interleave == 1 else self._offsets.tolist(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the samples ``state`` says were consumed, at this object's world size.

        Seq len, seed, shuffle settings and ``interleave`` must match (they define the order). If the mixture
        changed (per-block quotas, or sources added/removed), the new weights apply from the saved
        point on and each source that was in the old mixture continues where it stopped; new
        sources start at 0. Weights that normalize to the same quotas are no change. The saved
        skipped ranges are added to this stream's own (a state without them skips none more).
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported stream state version {state.get('version')!r}")
        for key in ("seq_len", "seed", "shuffle_buffer", "shuffle", "interleave"):
            mine = getattr(self, key)
            saved = state.get(key, 1) if key == "interleave" else state[key]  # older states: the plain order
            if saved != mine:
                raise ValueError(
                    f"cannot resume exactly: the saved stream had {key}={saved!r}, this one has {mine!r}"
                )
        for first, end in state.get("skip", []):
            self._skips.add(first, end)
        consumed = int(state["consumed"])
        mix = state["mixture"]
        fingerprints = [s.fingerprint for s in self._sources]
        lanes = self.interleave
        old = Mixture(mix["weights"], int(state["mix_block"]), self.seed, lanes)
        offsets = np.asarray(mix["offsets"], dtype=np.int64).reshape(len(mix["sources"]), lanes)
        if (
            mix["sources"] == fingerprints
            and old.block == self._mixture.block
            and np.array_equal(old.quota, self._mixture.quota)
        ):
            self._origin = int(mix["origin"])
            self._offsets = offsets
        else:
            old_positions = self._positions(old, int(mix["origin"]), offsets, consumed)
            by_fingerprint = dict(zip(mix["sources"], old_positions))
            self._origin = consumed
            self._offsets = np.stack([by_fingerprint.get(f, np.zeros(lanes, dtype=np.int64)) for f in fingerprints])
        self._start = self._skips.nth(consumed, 0)
        self._yielded = 0


def recorded_sources(state: dict[str, Any]) -> dict[str, str]:
    """``{manifest URL: fingerprint}`` of the sources a saved state (``PackedStream.state_dict``) was
    reading: a source whose manifest now has another fingerprint was rebuilt since."""
    mixture = state.get("mixture") or {}
    return dict(zip(mixture.get("urls") or [], mixture.get("sources") or []))


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

    def position(self) -> int:
        """Global number of the next sample to read (what the state calls ``consumed``)."""
        return int(self.state_dict()["consumed"])

    def skip(self, first: int, end: int) -> None:
        """Never read global samples ``first .. end - 1``; a new iterator starts past them."""
        state = self.state_dict()
        self.load_state_dict({**state, "skip": [*state["skip"], [first, end]]})

    def stats(self) -> dict[str, int]:
        """The stream's I/O counters (see ``PackedStream.stats``)."""
        return self.stream.stats()


__all__ = ["PackedStream", "ShardError", "StreamLoader", "TokenizerMismatchError", "recorded_sources", "tokenizer_info"]
