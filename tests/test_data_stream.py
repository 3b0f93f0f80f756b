"""PackedStream: global order, exact resume across world sizes / workers / batch sizes, mixtures."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_pipeline.build import build_shards
from data_pipeline.shard_reader import ShardReader
from data_pipeline.shards import load_manifest
from data_pipeline.stream import PackedStream, StreamLoader, tokenizer_info
from data_pipeline.tokenizer import BYTE_VOCAB_SIZE, EOS_ID

SEQ = 16


def _corpus(root: Path, n_docs: int, seed: int) -> list[bytes]:
    """Random documents of varied length (some longer than a shard), one .txt file each."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(n_docs):
        data = rng.integers(0, 256, size=int(rng.integers(1, 120)), dtype=np.uint8).tobytes()
        (root / f"doc{i:04d}.txt").write_bytes(data)
        docs.append(data)
    return docs


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("stream")
    docs_a = _corpus(root / "a", 60, seed=1)
    docs_b = _corpus(root / "b", 30, seed=2)
    build_shards([str(root / "a" / "*.txt")], str(root / "shards_a"), shard_tokens=300)
    build_shards([str(root / "b" / "*.txt")], str(root / "shards_b"), shard_tokens=200)
    return {"a": str(root / "shards_a"), "b": str(root / "shards_b"), "docs_a": docs_a, "docs_b": docs_b}


def _stream(data: dict, rank: int = 0, world: int = 1, **kw) -> PackedStream:
    sources = kw.pop("sources", [(data["a"], 1.0)])
    return PackedStream(sources, seq_len=SEQ, seed=7, rank=rank, world_size=world, shuffle_buffer=8, **kw)


def _take(stream: PackedStream, n: int) -> list[dict]:
    it = iter(stream)
    return [next(it) for _ in range(n)]


def _ids(samples: list[dict]) -> list[tuple[int, tuple[int, ...]]]:
    return [(int(s["index"]), tuple(s["input_ids"].tolist())) for s in samples]


def test_sample_structure_and_tokenizer_info(data: dict) -> None:
    s = _stream(data, doc_boundaries=True)
    sample = next(iter(s))
    assert sample["input_ids"].dtype == torch.int64 and sample["input_ids"].shape == (SEQ,)
    assert sample["labels"].shape == (SEQ,)
    assert torch.equal(sample["input_ids"][1:], sample["labels"][:-1])
    assert int(sample["input_ids"].max()) < BYTE_VOCAB_SIZE
    assert sample["doc_start"].dtype == torch.bool
    info = tokenizer_info(data["a"])
    assert info["kind"] == "bytes" and info["vocab_size"] == BYTE_VOCAB_SIZE and info["eos_id"] == EOS_ID
    assert s.vocab_size == BYTE_VOCAB_SIZE


def test_unshuffled_stream_is_documents_with_eos(data: dict) -> None:
    """Packing is exact: consecutive samples overlap by one token and rebuild docs + EOS in order."""
    s = _stream(data, shuffle=False)
    n = s.samples_per_epoch()[0]
    samples = _take(s, n)
    rebuilt = [t for smp in samples for t in smp["input_ids"].tolist()] + [int(samples[-1]["labels"][-1])]
    expected = [t for d in data["docs_a"] for t in [*d, EOS_ID]]
    assert rebuilt == expected[: len(rebuilt)]
    assert len(expected) - len(rebuilt) < SEQ


def test_shuffled_epoch_is_a_permutation(data: dict) -> None:
    s = _stream(data)
    n = s.samples_per_epoch()[0]
    order = s._sources[0].order
    assert sorted(order.sample_in_epoch(0, q) for q in range(n)) == list(range(n))
    assert sorted(order.sample_in_epoch(1, q) for q in range(n)) == list(range(n))
    epoch0 = _ids(_take(_stream(data), n))
    unshuffled = _ids(_take(_stream(data, shuffle=False), n))
    assert [x for _, x in epoch0] != [x for _, x in unshuffled]


def test_same_global_order_at_any_world_size(data: dict) -> None:
    reference = _ids(_take(_stream(data), 36))
    for world in (2, 3, 4):
        merged: list = []
        per_rank = [_ids(_take(_stream(data, r, world), 36 // world)) for r in range(world)]
        for j in range(36 // world):
            merged.extend(per_rank[r][j] for r in range(world))
        assert merged == reference


@pytest.mark.parametrize("resume_world", [1, 2, 3])
def test_exact_resume_from_world_2(data: dict, resume_world: int) -> None:
    """Save after 5 samples per rank at world 2; resume at 1, 2, 3: exactly the rest, in order."""
    reference = _ids(_take(_stream(data), 40))
    ranks = [_stream(data, r, 2) for r in range(2)]
    before = [_take(s, 5) for s in ranks]
    states = [s.state_dict() for s in ranks]
    assert states[0] == states[1] and states[0]["consumed"] == 10
    seen = sorted(x for b in before for x in _ids(b))
    assert seen == reference[:10]
    resumed = []
    for r in range(resume_world):
        s = _stream(data, r, resume_world)
        s.load_state_dict(states[0])
        resumed.append(_ids(_take(s, 6)))
    after = sorted(x for chunk in resumed for x in chunk)
    assert after == reference[10 : 10 + 6 * resume_world]
    for r in range(resume_world):
        assert resumed[r] == reference[10 + r : 10 + 6 * resume_world : resume_world]


def test_reiterating_in_process_continues(data: dict) -> None:
    s = _stream(data)
    first = _ids(_take(s, 3))
    second = _ids(_take(s, 3))
    assert first + second == _ids(_take(_stream(data), 6))


def _loader_ids(loader: StreamLoader, batches: int) -> list[int]:
    out: list[int] = []
    for i, batch in enumerate(loader):
        out.extend(batch["index"].tolist())
        if i + 1 == batches:
            break
    return out


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_workers_and_batch_size_change_on_resume(data: dict) -> None:
    """DataLoader workers return the rank's samples in order; resume with other workers/batch/world."""
    world = 2
    loaders = [StreamLoader(_stream(data, r, world, batch_size=3), num_workers=2) for r in range(world)]
    got = [_loader_ids(ld, 3) for ld in loaders]
    for r in range(world):
        assert got[r] == list(range(r, 18, world))
    state = loaders[0].state_dict()
    assert state["consumed"] == 18 and state == loaders[1].state_dict()
    resumed = [StreamLoader(_stream(data, r, 3, batch_size=2), num_workers=w) for r, w in zip(range(3), (0, 3, 1))]
    for r, ld in enumerate(resumed):
        ld.load_state_dict(state)
        assert _loader_ids(ld, 2) == list(range(18 + r, 18 + 12, 3))
    reference = {x[0]: x[1] for x in _ids(_take(_stream(data), 30))}
    ld = StreamLoader(_stream(data, 1, 3, batch_size=2), num_workers=2)
    ld.load_state_dict(state)
    batch = next(iter(ld))
    assert [tuple(row) for row in batch["input_ids"].tolist()] == [reference[19], reference[22]]


def test_max_samples_stops_all_ranks(data: dict) -> None:
    got = [[int(x["index"]) for x in _stream(data, r, 3, max_samples=10)] for r in range(3)]
    assert sorted(i for g in got for i in g) == list(range(10))


def test_doc_start_marks_tokens_after_eos(data: dict) -> None:
    s = _stream(data, doc_boundaries=True)
    for sample in _take(s, 30):
        ids, starts = sample["input_ids"], sample["doc_start"]
        assert torch.equal(starts[1:], ids[:-1] == EOS_ID)
    first = next(iter(_stream(data, doc_boundaries=True, shuffle=False)))
    assert bool(first["doc_start"][0])


def test_multiple_epochs_repeat_with_new_order(data: dict) -> None:
    s = _stream(data)
    n = s.samples_per_epoch()[0]
    samples = _take(s, 2 * n)
    e0 = sorted(x for _, x in _ids(samples[:n]))
    e1 = sorted(x for _, x in _ids(samples[n:]))
    assert len(e0) == len(e1) == n
    assert s.epochs() == [2.0]


def test_mixture_weights_are_exact_per_block(data: dict) -> None:
    sources = [(data["a"], 3.0), (data["b"], 1.0)]
    s = _stream(data, sources=sources, mix_block=8)
    samples = _take(s, 64)
    src = [int(x["source"]) for x in samples]
    for b in range(8):
        assert src[8 * b : 8 * b + 8].count(0) == 6
    assert src != sorted(src)
    # each source's samples are that source's own stream, in order
    a_stream = _ids(_take(_stream(data), 48))
    assert [x[1] for x, s_ in zip(_ids(samples), src) if s_ == 0] == [x[1] for x in a_stream]
    again = _take(_stream(data, sources=sources, mix_block=8), 64)
    assert _ids(again) == _ids(samples)


def test_mixture_change_on_resume_continues_each_source(data: dict) -> None:
    old = _stream(data, sources=[(data["a"], 1.0), (data["b"], 1.0)], mix_block=8)
    before = _take(old, 20)
    state = old.state_dict()
    new = _stream(data, sources=[(data["a"], 9.0), (data["b"], 1.0)], mix_block=10)
    new.load_state_dict(state)
    after = _take(new, 30)
    assert [int(x["index"]) for x in after] == list(range(20, 50))
    for k in (0, 1):
        got = [tuple(x["input_ids"].tolist()) for x in before + after if int(x["source"]) == k]
        only = _stream(data, sources=[(data["a" if k == 0 else "b"], 1.0)])
        assert got == [tuple(x["input_ids"].tolist()) for x in _take(only, len(got))]
    assert sum(int(x["source"]) == 0 for x in after) == 27


def test_resume_with_other_seq_len_is_an_error(data: dict) -> None:
    state = _stream(data).state_dict()
    other = PackedStream([(data["a"], 1.0)], seq_len=SEQ + 1, seed=7, shuffle_buffer=8)
    with pytest.raises(ValueError, match="seq_len"):
        other.load_state_dict(state)


def test_memory_filesystem(tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 256, size=50, dtype=np.uint8).tobytes() for _ in range(6)]
    for i, d in enumerate(docs):
        fs.pipe(f"/dp_in/{i}.txt", d)
    m = build_shards(["memory://dp_in/*.txt"], "memory://dp_out", shard_tokens=100)
    assert len(m.shards) == 3 and load_manifest("memory://dp_out").total_tokens == 300
    s = PackedStream([("memory://dp_out", 1.0)], seq_len=8, seed=0, shuffle=False)
    first = next(iter(s))
    assert first["input_ids"].tolist() == list(docs[0][:8])
    fs.rm("/dp_in", recursive=True)
    fs.rm("/dp_out", recursive=True)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world_a=st.integers(1, 4),
    steps_a=st.integers(0, 6),
    world_b=st.integers(1, 5),
    seed=st.integers(0, 3),
)
def test_resume_property(data: dict, world_a: int, steps_a: int, world_b: int, seed: int) -> None:
    """Any save point at any world size, resumed at any other: the union is the global prefix."""
    ref = PackedStream([(data["a"], 1.0)], seq_len=SEQ, seed=seed, shuffle_buffer=5)
    total = world_a * steps_a + world_b * 4
    reference = [tuple(ref.get(g)["input_ids"].tolist()) for g in range(total)]
    streams = [
        PackedStream([(data["a"], 1.0)], seq_len=SEQ, seed=seed, rank=r, world_size=world_a, shuffle_buffer=5)
        for r in range(world_a)
    ]
    got = {}
    for s in streams:
        for x in _take(s, steps_a):
            got[int(x["index"])] = tuple(x["input_ids"].tolist())
    state = streams[0].state_dict()
    for r in range(world_b):
        s = PackedStream([(data["a"], 1.0)], seq_len=SEQ, seed=seed, rank=r, world_size=world_b, shuffle_buffer=5)
        s.load_state_dict(state)
        for x in _take(s, 4):
            assert int(x["index"]) not in got
            got[int(x["index"])] = tuple(x["input_ids"].tolist())
    assert [got[g] for g in range(total)] == reference


def test_10k_shard_manifest_reads_lazily(tmp_path: Path) -> None:
    """Start-up and a deep resume read one shard, not the corpus (10,000-shard manifest)."""
    from benchmarks.data_loader import write_scale_dataset

    write_scale_dataset(tmp_path, shards=10_000, shard_tokens=2_000, doc_tokens=100)
    s = PackedStream([(str(tmp_path), 1.0)], seq_len=64, seed=0, rank=1, world_size=4)
    state = s.state_dict()
    state["consumed"] = 250_000
    s.load_state_dict(state)
    sample = next(iter(s))
    assert int(sample["index"]) == 250_001
    assert s.stats()["shards_opened"] <= 2


def test_prefetch_gives_identical_samples(data: dict) -> None:
    with_prefetch = _stream(data, shuffle=False)
    without = _stream(data, shuffle=False, prefetch=False)
    n = with_prefetch.samples_per_epoch()[0]
    assert _ids(_take(with_prefetch, n)) == _ids(_take(without, n))
    stats = with_prefetch.stats()
    assert stats["prefetched"] >= stats["shards_opened"] - 1 > 0
    assert without.stats()["prefetched"] == 0


def test_equivalent_weights_are_no_mixture_change(data: dict) -> None:
    old = _stream(data, sources=[(data["a"], 1.0), (data["b"], 1.0)], mix_block=8)
    _take(old, 11)
    new = _stream(data, sources=[(data["a"], 0.5), (data["b"], 0.5)], mix_block=8)
    new.load_state_dict(old.state_dict())
    assert new.state_dict()["mixture"]["origin"] == 0
    fresh = _stream(data, sources=[(data["a"], 1.0), (data["b"], 1.0)], mix_block=8)
    assert _ids(_take(new, 5)) == _ids(_take(fresh, 16))[11:]


def test_pickled_stream_drops_cache_and_continues(data: dict) -> None:
    import pickle

    s = _stream(data)
    _take(s, 3)
    assert s._sources[0].reader._cache
    clone = pickle.loads(pickle.dumps(s))
    assert not clone._sources[0].reader._cache
    assert _ids(_take(clone, 4)) == _ids(_take(s, 4))
    assert clone.stats()["build_empty_documents"] == 0


@settings(max_examples=25, deadline=None)
@given(weights=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=5), block=st.integers(1, 64))
def test_mixture_quotas_property(weights: list[float], block: int) -> None:
    from data_pipeline.order import Mixture as _Mixture

    if sum(weights) <= 0:
        with pytest.raises(ValueError):
            _Mixture(weights, block, 0)
        return
    mix = _Mixture(weights, block, 0)
    assert int(mix.quota.sum()) == block
    expected = np.asarray(weights) / sum(weights) * block
    assert np.all(np.abs(mix.quota - expected) < 1.0 + 1e-9)
    seen = np.zeros(len(weights), dtype=np.int64)
    for n in range(3 * block):
        assert np.array_equal(mix.counts(n), seen)
        s, k = mix.locate(n)
        assert k == seen[s]
        seen[s] += 1


def test_range_reads_match_whole_shards_and_read_a_rank_share(data: dict) -> None:
    """read='range': identical samples at every rank; each rank reads only about its share of bytes."""
    world = 3
    n = _stream(data).samples_per_epoch()[0]
    per_rank = n // world
    for r in range(world):
        whole = _stream(data, r, world, doc_boundaries=True)
        ranged = _stream(data, r, world, doc_boundaries=True, read="range", verify=False)
        a, b = _take(whole, per_rank), _take(ranged, per_rank)
        for x, y in zip(a, b):
            assert x["index"] == y["index"]
            for key in ("input_ids", "labels", "doc_start"):
                assert torch.equal(x[key], y[key])
        content = ranged.stats()["shard_bytes_read"]
        assert content <= per_rank * (SEQ + 2) < whole.stats()["shard_bytes_read"]  # +1: token before (doc_start)
    with pytest.raises(ValueError, match="verify=False"):
        _stream(data, read="range")


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("read", ["shard", "range"])
def test_workers_after_parent_read_reopen_files_and_threads(data: dict, read: str) -> None:
    """The parent reads first (open handles / prefetch thread exist), then forked workers read too."""
    kw = {"read": read, "verify": read == "shard", "batch_size": 2}
    stream = _stream(data, **kw)
    parent = _ids(_take(stream, 4))
    loader = StreamLoader(stream, num_workers=2)
    got = _loader_ids(loader, 4)
    assert got == list(range(4, 12))
    reference = _ids(_take(_stream(data, **kw), 14))
    assert parent == reference[:4]
    batch = next(iter(loader))
    assert [tuple(r) for r in batch["input_ids"].tolist()] == [x for _, x in reference[12:14]]


# -- interleaved windows (interleave > 1): a rank's samples lie together in the shards


@pytest.mark.parametrize("interleave", [2, 4, 16])
def test_interleaved_epoch_is_a_permutation_whatever_its_tail(interleave: int) -> None:
    """Every epoch length (full spans, a tail span of smaller windows, the last samples) and window."""
    from data_pipeline.order import SourceOrder

    for n in (1, 3, 17, 64, 100, 257, 1031):
        for window in (1, 2, 3, 8):
            order = SourceOrder(np.array([n * 4 + 1]), 4, 7, 5, window, True, "x", interleave)
            assert order.samples_per_epoch == n
            for epoch in (0, 1):
                assert sorted(order.sample_in_epoch(epoch, q) for q in range(n)) == list(range(n)), (n, window)


def test_interleave_gives_each_rank_consecutive_windows() -> None:
    """Positions equal modulo W (W dividing C) lie in C / W consecutive windows of each span, and in
    C / W consecutive (smaller) windows of the epoch's tail span; for other W the order is the same."""
    from data_pipeline.order import SourceOrder

    window, lanes, n = 8, 16, 16 * 8 * 5 + 16 * 3 + 5  # 5 full spans, a tail span of windows of 3, 5 more
    order = SourceOrder(np.array([n * 4 + 1]), 4, 7, 5, window, True, "x", lanes)
    spans = [(t * lanes * window, (t + 1) * lanes * window, window) for t in range(5)]
    spans.append((5 * lanes * window, 5 * lanes * window + lanes * 3, 3))
    for world in (1, 2, 4, 8, 16):
        for rank in range(world):
            for first, end, size in spans:
                samples = sorted(order.sample_in_epoch(0, q) for q in range(first + rank, end, world))
                windows = sorted({(j - first) // size for j in samples})
                assert windows == list(range(windows[0], windows[0] + lanes // world)), (world, rank, windows)
                # and every sample of those windows is this rank's
                assert samples == list(range(first + windows[0] * size, first + (windows[-1] + 1) * size))


def test_interleaved_stream_reads_a_rank_share_in_few_places(data: dict) -> None:
    """Range reads at 4 ranks: the same samples as whole shards; with interleave 4 each rank's samples
    are one stretch of each span of 4 windows, without it every 4th sample of the stream."""
    world, per_rank = 4, 40
    for rank in range(world):
        plain = _stream(data, rank, world, read="range", verify=False)
        laid = _stream(data, rank, world, read="range", verify=False, interleave=4)
        whole = _stream(data, rank, world, interleave=4)
        a, b = _take(laid, per_rank), _take(whole, per_rank)
        assert _ids(a) == _ids(b)
        assert _ids(_take(plain, per_rank)) != _ids(a)
        def runs(stream: PackedStream, samples: list[dict]) -> int:
            """Stretches of consecutive samples of the stream that ``samples`` make."""
            order = stream._sources[0].order
            starts = sorted(order.sample_span(stream.locate(int(x["index"]))[1], False)[1] for x in samples)
            return sum(1 for x, y in itertools.pairwise(starts) if y - x != SEQ) + 1

        assert runs(laid, a) <= per_rank // 8  # one window of 8 samples of each span of 4 windows
        assert runs(plain, _take(_stream(data, rank, world, read="range", verify=False), per_rank)) > per_rank // 2


@pytest.mark.parametrize("interleave", [2, 8])
def test_interleaved_order_is_the_same_at_any_world_size_and_resumes_exactly(data: dict, interleave: int) -> None:
    reference = _ids(_take(_stream(data, interleave=interleave), 48))
    assert reference != _ids(_take(_stream(data), 48))
    for world in (2, 3, 4, 8):
        per_rank = [_ids(_take(_stream(data, r, world, interleave=interleave), 48 // world)) for r in range(world)]
        assert [per_rank[r][j] for j in range(48 // world) for r in range(world)] == reference
    ranks = [_stream(data, r, 2, interleave=interleave) for r in range(2)]
    for s in ranks:
        _take(s, 5)
    state = ranks[0].state_dict()
    assert state["interleave"] == interleave and state["consumed"] == 10
    for world in (1, 3, 4):
        for r in range(world):
            s = _stream(data, r, world, interleave=interleave)
            s.load_state_dict(state)
            assert _ids(_take(s, 6)) == reference[10 + r : 10 + 6 * world : world]


def test_interleave_is_part_of_the_saved_order(data: dict) -> None:
    state = _stream(data, interleave=4).state_dict()
    with pytest.raises(ValueError, match="interleave=4"):
        _stream(data).load_state_dict(state)
    old = _stream(data).state_dict()
    del old["interleave"]  # a state saved before interleave existed: the plain order
    plain = _stream(data)
    plain.load_state_dict(old)
    with pytest.raises(ValueError, match="interleave=1"):
        _stream(data, interleave=2).load_state_dict(old)
    for bad in (3, 0, True):
        with pytest.raises(ValueError, match="power of two"):
            _stream(data, interleave=bad)
    with pytest.raises(ValueError, match="shuffle=False"):
        _stream(data, interleave=2, shuffle=False)


def _source_positions(stream: PackedStream, samples: list[dict]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for x in samples:
        s, position = stream.locate(int(x["index"]))
        out.setdefault(s, []).append(position)
    return out


def test_interleaved_mixture_uses_each_source_sample_once_and_keeps_quotas(data: dict) -> None:
    """With lanes each lane has its own mixture blocks (exact quotas per lane block); a source's
    positions in a lane are its lane's positions in order, none twice, none skipped."""
    lanes, block = 4, 8
    sources = [(data["a"], 3.0), (data["b"], 1.0)]
    s = _stream(data, sources=sources, mix_block=block, interleave=lanes)
    samples = _take(s, lanes * block * 3)
    src = [int(x["source"]) for x in samples]
    for lane in range(lanes):
        mine = src[lane::lanes]
        for b in range(3):
            assert mine[block * b : block * (b + 1)].count(0) == 6
    assert len({tuple(src[lane::lanes]) for lane in range(lanes)}) > 1  # lanes are mixed apart
    for positions in _source_positions(s, samples).values():
        for lane in range(lanes):
            assert [p for p in positions if p % lanes == lane] == list(range(lane, lanes * (sum(
                1 for p in positions if p % lanes == lane)), lanes))
    # a source's samples are those of its own stream at the same positions
    only_a = _stream(data, sources=[(data["a"], 1.0)], interleave=lanes)
    for x in samples:
        s_, position = s.locate(int(x["index"]))
        if s_ == 0:
            assert torch.equal(x["input_ids"], only_a.get(position)["input_ids"])
    assert s.epochs()[0] == pytest.approx(src.count(0) / s.samples_per_epoch()[0])


def test_interleaved_mixture_change_on_resume_continues_each_source_lane(data: dict) -> None:
    lanes = 4
    old = _stream(data, sources=[(data["a"], 1.0), (data["b"], 1.0)], mix_block=8, interleave=lanes)
    before = _take(old, 22)
    state = old.state_dict()
    assert len(state["mixture"]["offsets"][0]) == lanes
    new = _stream(data, sources=[(data["a"], 9.0), (data["b"], 1.0)], mix_block=10, interleave=lanes)
    new.load_state_dict(state)
    after = _take(new, 50)
    assert [int(x["index"]) for x in after] == list(range(22, 72))
    seen: dict[int, list[int]] = {}
    for stream, chunk in ((old, before), (new, after)):
        for k, positions in _source_positions(stream, chunk).items():
            seen.setdefault(k, []).extend(positions)
    for positions in seen.values():
        assert len(set(positions)) == len(positions)
        for lane in range(lanes):
            mine = [p for p in positions if p % lanes == lane]
            assert mine == list(range(lane, lanes * len(mine), lanes))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world_a=st.integers(1, 4),
    steps_a=st.integers(0, 6),
    world_b=st.integers(1, 5),
    interleave=st.sampled_from([2, 4, 8]),
    mixed=st.booleans(),
)
def test_interleaved_resume_property(data: dict, world_a: int, steps_a: int, world_b: int, interleave: int,
                                     mixed: bool) -> None:
    """Any save point at any world size, resumed at any other, with interleaved windows (and a
    mixture): the union is the global prefix."""
    sources = [(data["a"], 2.0), (data["b"], 1.0)] if mixed else [(data["a"], 1.0)]
    kw = dict(sources=sources, interleave=interleave, mix_block=6)
    ref = _stream(data, **kw)
    total = world_a * steps_a + world_b * 4
    reference = [tuple(ref.get(g)["input_ids"].tolist()) for g in range(total)]
    got = {}
    streams = [_stream(data, r, world_a, **kw) for r in range(world_a)]
    for s in streams:
        for x in _take(s, steps_a):
            got[int(x["index"])] = tuple(x["input_ids"].tolist())
    state = streams[0].state_dict()
    for r in range(world_b):
        s = _stream(data, r, world_b, **kw)
        s.load_state_dict(state)
        for x in _take(s, 4):
            assert int(x["index"]) not in got
            got[int(x["index"])] = tuple(x["input_ids"].tolist())
    assert [got[g] for g in range(total)] == reference


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_interleaved_stream_through_workers_gives_the_rank_order(data: dict) -> None:
    kw = dict(interleave=4, batch_size=3)
    loader = StreamLoader(_stream(data, 1, 2, **kw), num_workers=2)
    got = _loader_ids(loader, 4)
    assert got == list(range(1, 24, 2))
    reference = _ids(_take(_stream(data, 1, 2, **kw), 12))
    batch_rows = []
    for i, batch in enumerate(StreamLoader(_stream(data, 1, 2, **kw), num_workers=2)):
        batch_rows.extend(tuple(r) for r in batch["input_ids"].tolist())
        if i == 3:
            break
    assert batch_rows == [x for _, x in reference]


def test_interleaved_whole_shard_prefetch_stays_in_the_rank_stretches(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole shards with interleave 16 at 4 ranks: the shards read ahead are those of the rank's own
    stretches, never the next shards of the epoch's order past a stretch's end (other ranks'); and the
    read-ahead still serves the rank's next shards. The plain order, read by every rank, keeps its
    read-ahead across windows."""
    _corpus(tmp_path / "docs", 400, seed=3)
    build_shards([str(tmp_path / "docs" / "*.txt")], str(tmp_path / "shards"), shard_tokens=300)
    fetched: list[int] = []
    real = ShardReader._fetch

    def spy(self: ShardReader, idx: int) -> tuple[bytes, str]:
        fetched.append(idx)
        return real(self, idx)

    monkeypatch.setattr(ShardReader, "_fetch", spy)
    world, per_rank, lookahead = 4, 160, 64  # a span is 16 windows of 8 samples: 32 samples a rank
    for interleave in (16, 1):
        for rank in range(world):
            stream = PackedStream([(str(tmp_path / "shards"), 1.0)], seq_len=SEQ, seed=7, rank=rank, world_size=world,
                                  shuffle_buffer=8, interleave=interleave)
            source = stream._sources[0]
            assert (per_rank + lookahead) * world < source.samples_per_epoch  # all in epoch 0
            fetched.clear()
            _take(stream, per_rank)
            stream.close(wait=True)
            needed = set()
            for i in range(per_rank + lookahead):
                epoch, start, stop, _ = source.order.sample_span(stream.locate(rank + i * world)[1], False)
                needed.update(shard for shard, *_ in source.order.pieces(epoch, start, stop, 0))
            assert set(fetched) <= needed, (interleave, rank, sorted(set(fetched) - needed))
            assert stream.stats()["prefetched"] > 0, (interleave, rank)
