"""The global sample order: where each packed sample of a source lies, and which source each global
sample comes from. Pure arithmetic on shard lengths and seeds, no I/O (see docs/data.md, "The
stream: one global order")."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np

_SHARD_ORDER_TAG = 1
_WINDOW_TAG = 2
_MIX_TAG = 3
_KEPT_ITEMS = 1 << 20
"""Permutation entries kept for look-ups that alternate between places (a read-ahead runs ahead of the
samples being read): at most this many per cache, at least two windows or mixture blocks."""


def _kept(size: int, most: int) -> int:
    """How many permutations of ``size`` entries a cache keeps: ``most``, fewer when they are large."""
    return max(2, min(most, _KEPT_ITEMS // max(1, size)))


def check_interleave(interleave: int) -> int:
    """``interleave`` as an int, if it is a power of two from 1 to 2^16 (``ValueError`` otherwise)."""
    if isinstance(interleave, bool) or int(interleave) != interleave or not 1 <= interleave <= 1 << 16 \
            or interleave & (interleave - 1):
        raise ValueError(f"interleave must be a power of two from 1 to 65536, not {interleave!r}")
    return int(interleave)


def bit_reversal(bits: int) -> list[int]:
    """``x`` with its ``bits`` low bits in reverse order, for every ``x < 2**bits``."""
    return [int(format(x, f"0{bits}b")[::-1], 2) if bits else 0 for x in range(1 << bits)]


def seeded_rng(*keys: int) -> np.random.Generator:
    """A generator seeded from non-negative integer keys (order-sensitive, platform-independent)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in keys])))


class SourceOrder:
    """Per-epoch shard permutation, packing into ``seq_len + 1`` windows and shuffle windows of one source.

    ``lengths[i]`` is shard ``i``'s stream length (tokens plus one EOS per document); ``salt`` comes
    from the source fingerprint, so the order does not depend on where the data is stored.

    ``interleave`` (a power of two, C) reads C shuffle windows side by side: the epoch's samples are
    cut into spans of C consecutive windows, and position ``u`` of a span takes sample ``u // C`` of
    its window permutation from the window in slot ``bit_reversal(u % C)`` of the span. Positions
    that are equal modulo any power of two W dividing C so lie in C / W consecutive windows of each
    span: a data-parallel rank of W, whose positions are equal modulo W, reads one contiguous stretch
    of the stream per span instead of every W-th sample of it. The epoch's tail, shorter than a span,
    is one more span of C smaller windows (its length // C samples each), then one window of the
    fewer than C samples left. C = 1 is the plain order: window after window, the last one partial.
    """

    def __init__(
        self, lengths: np.ndarray, seq_len: int, seed: int, salt: int, window: int, shuffle: bool, name: str,
        interleave: int = 1,
    ) -> None:
        total = int(lengths.sum())
        self.samples_per_epoch = (total - 1) // seq_len
        if self.samples_per_epoch < 1:
            raise ValueError(f"source {name!r} has {total} tokens (with EOS), fewer than seq_len + 1 = {seq_len + 1}")
        self.lengths = lengths
        self.seq_len = seq_len
        self.seed = seed
        self.salt = salt
        self.window = window
        self.shuffle = shuffle
        self.interleave = check_interleave(interleave)
        self._bits = self.interleave.bit_length() - 1
        self._reversed = bit_reversal(self._bits)
        self._spans = self.samples_per_epoch // (self.interleave * window)  # full spans
        self._tail_window = (self.samples_per_epoch - self._spans * self.interleave * window) // self.interleave
        self._epoch = -1
        self._order = np.empty(0, dtype=np.int64)
        self._ends = np.empty(0, dtype=np.int64)
        self._layouts: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._windows_kept = max(2 * self.interleave, _kept(window, 64))  # spans read side by side

    def _layout(self, epoch: int) -> None:
        """Shard order and cumulative stream ends for ``epoch`` (the last two epochs' are kept: a
        read-ahead runs into the next epoch while this one is read)."""
        if epoch == self._epoch:
            return
        layout = self._layouts.get(epoch)
        if layout is None:
            n = len(self.lengths)
            if self.shuffle:
                order = seeded_rng(self.seed, self.salt, _SHARD_ORDER_TAG, epoch).permutation(n)
            else:
                order = np.arange(n)
            layout = self._layouts[epoch] = order, np.cumsum(self.lengths[order])
            while len(self._layouts) > 2:
                self._layouts.popitem(last=False)
        self._order, self._ends = layout
        self._epoch = epoch

    def _slot(self, q: int) -> tuple[int, int, int, int]:
        """``(window, first, size, k)``: shuffled position ``q`` of the epoch reads sample ``k`` of the
        permutation of window number ``window``, which holds the ``size`` samples from ``first``."""
        lanes, window = self.interleave, self.window
        t, u = divmod(q, lanes * window)
        if t < self._spans:  # a full span
            lane, k = u % lanes, u // lanes
            w = t * lanes + self._reversed[lane]
            return w, w * window, window, k
        first, w, size = self._spans * lanes * window, self._spans * lanes, self._tail_window
        if u < lanes * size:  # the tail's span of smaller windows
            lane, k = u % lanes, u // lanes
            return w + self._reversed[lane], first + self._reversed[lane] * size, size, k
        first += lanes * size  # the last samples, fewer than C: one window
        return w + lanes, first, self.samples_per_epoch - first, q - first

    def sample_in_epoch(self, epoch: int, q: int) -> int:
        """Packed-sample number within the epoch for shuffled position ``q``."""
        if self.window == 1 and self.interleave == 1:
            return q
        w, first, size, k = self._slot(q)
        if self.window == 1:
            return first + k
        perm = self._windows.get((epoch, w))
        if perm is None:  # a few windows are kept: a read-ahead runs into the next while this one is read
            perm = self._windows[(epoch, w)] = seeded_rng(self.seed, self.salt, _WINDOW_TAG, epoch, w).permutation(size)
            while len(self._windows) > self._windows_kept:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end((epoch, w))
        return first + int(perm[k])

    def sample_span(self, position: int, with_prev: bool) -> tuple[int, int, int, bool]:
        """``(epoch, start, stop, has_prev)``: stream positions of the source's ``position``-th sample
        (``seq_len + 1`` tokens, or one more in front when ``with_prev`` and it does not start the epoch)."""
        epoch, q = divmod(position, self.samples_per_epoch)
        start = self.sample_in_epoch(epoch, q) * self.seq_len
        has_prev = with_prev and start > 0
        return epoch, start - int(has_prev), start + self.seq_len + 1, has_prev

    def stretch_end(self, q: int, region: int) -> int | None:
        """The epoch sample where the stretch of the span that holds shuffled position ``q`` ends, for a
        reader whose positions fill ``region`` aligned window slots of each span (a rank of W reads
        ``interleave / gcd(W, interleave)`` of them): past it the epoch's stream holds other ranks'
        windows. None where the stream runs on into this reader's samples (``region`` covers the
        span: the plain order, or one rank) or ``q`` lies in the epoch's last window, every rank's."""
        lanes, window = self.interleave, self.window
        if region >= lanes:
            return None
        t, u = divmod(q, lanes * window)
        slots_end = (self._reversed[u % lanes] // region + 1) * region
        if t < self._spans:
            return (t * lanes + slots_end) * window
        first, size = self._spans * lanes * window, self._tail_window
        if u < lanes * size:  # the tail's span of smaller windows
            return first + slots_end * size
        return None

    def stretch_limit(self, q: int, region: int) -> int | None:
        """The stream position (tokens) that whole shards are read ahead up to from shuffled position ``q``:
        the end of its stretch (`stretch_end`), so that the read-ahead stays out of other ranks' windows."""
        end = self.stretch_end(q, region)
        return None if end is None else end * self.seq_len + 1

    def pieces(self, epoch: int, start: int, stop: int, ahead: int = 2,
               limit: int | None = None) -> Iterator[tuple[int, int, int, list[int]]]:
        """``(shard, lo, hi, following shards)`` for each shard that positions ``[start, stop)`` of the
        epoch's stream cross; ``[lo, hi)`` are positions within that shard's stream, and the following
        shards the (at most ``ahead``) next ones of the epoch's order that start before stream
        position ``limit`` (None: any)."""
        self._layout(epoch)
        ends, order = self._ends, self._order
        pos = bisect.bisect_right(ends, start)  # not numpy's searchsorted, which releases the interpreter lock
        while start < stop:
            shard_end = int(ends[pos])
            shard = int(order[pos])
            shard_start = shard_end - int(self.lengths[shard])
            following = order[pos + 1 : pos + 1 + ahead].tolist()
            if limit is not None:  # a following shard starts where the one before it ends
                following = following[: bisect.bisect_left(ends, limit, pos, pos + len(following)) - pos]
            take = min(stop, shard_end)
            yield shard, start - shard_start, take - shard_start, following
            start = take
            pos += 1


class Mixture:
    """Deterministic assignment of global sample numbers to sources: blocks of ``block`` samples, each
    holding every source's exact quota (largest-remainder rounding of the weights) in a seeded order.

    With ``lanes`` > 1 each lane (the global samples equal modulo ``lanes``, see ``PackedStream``) has
    blocks of its own, in an order seeded by the lane too: ``locate`` and ``counts`` then take the
    lane and count its samples."""

    def __init__(self, weights: Sequence[float], block: int, seed: int, lanes: int = 1) -> None:
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
        self.lanes = check_interleave(lanes)
        self._base = np.repeat(np.arange(len(w)), quota)
        self._blocks: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._blocks_kept = max(2 * self.lanes, _kept(2 * block, 16))

    def _block(self, b: int, lane: int) -> tuple[np.ndarray, np.ndarray]:
        """Source of each slot in block ``b`` of ``lane`` and its rank among that source's slots (a few
        blocks are kept: a read-ahead runs into the next ones while this one is read)."""
        cached = self._blocks.get((b, lane))
        if cached is not None:
            self._blocks.move_to_end((b, lane))
            return cached
        if len(self.quota) == 1:
            perm = self._base
        else:
            keys = (self.seed, _MIX_TAG, b) if self.lanes == 1 else (self.seed, _MIX_TAG, b, lane)
            perm = seeded_rng(*keys).permutation(self._base)
        order = np.argsort(perm, kind="stable")
        rank = np.empty(self.block, dtype=np.int64)
        rank[order] = np.arange(self.block) - np.repeat(np.cumsum(self.quota) - self.quota, self.quota)
        # in the smallest integers that hold them: with lanes, two blocks of every lane may be kept
        perm = perm.astype(np.min_scalar_type(len(self.quota) - 1))
        rank = rank.astype(np.min_scalar_type(self.block - 1))
        self._blocks[(b, lane)] = perm, rank
        while len(self._blocks) > self._blocks_kept:
            self._blocks.popitem(last=False)
        return perm, rank

    def locate(self, n: int, lane: int = 0) -> tuple[int, int]:
        """``(source, k)``: the ``n``-th sample of this mixture (of ``lane``) is source's ``k``-th sample
        (of that lane)."""
        b, i = divmod(n, self.block)
        perm, rank = self._block(b, lane)
        s = int(perm[i])
        return s, b * int(self.quota[s]) + int(rank[i])

    def counts(self, n: int, lane: int = 0) -> np.ndarray:
        """How many of the first ``n`` samples of this mixture (of ``lane``) each source received."""
        b, i = divmod(n, self.block)
        perm, _ = self._block(b, lane)
        return b * self.quota + np.bincount(perm[:i], minlength=len(self.quota))
