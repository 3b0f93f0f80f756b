"""Synthetic tasks: determinism by seed, structure of inputs/labels/answers, scoring."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from data_pipeline.synthetic import (
    IGNORE_INDEX,
    CopyPaste,
    EntityLabelCopy,
    Example,
    NeedleHaystack,
    ZipfRetrieval,
    accuracy,
    collate,
)

BOOK = Path(__file__).resolve().parents[1] / "data" / "demo" / "valid" / "northangerabbey.txt"


def _same(a: Example, b: Example) -> bool:
    return np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.labels, b.labels) and a.answer == b.answer


def _check_labels(e: Example) -> None:
    start, end = e.answer
    assert end == e.input_ids.size
    scored = np.flatnonzero(e.labels != IGNORE_INDEX)
    assert scored.tolist() == list(range(start - 1, end - 1))
    assert np.array_equal(e.labels[scored], e.input_ids[start:end])


def _tasks() -> list:
    return [
        ZipfRetrieval(seq_len=512, seed=3),
        EntityLabelCopy(seq_len=512, seed=3),
        CopyPaste(seed=3),
        NeedleHaystack(4096, str(BOOK), seed=3),
    ]


@pytest.mark.parametrize("task", _tasks(), ids=lambda t: type(t).__name__)
def test_deterministic_and_well_formed(task) -> None:
    a, b, other = task.example(5), task.example(5), task.example(6)
    assert _same(a, b) and not _same(a, other)
    rebuilt = type(task)(**{**_kwargs(task), "seed": 4}).example(5)
    assert not _same(a, rebuilt)
    for i in range(20):
        _check_labels(task.example(i))


def _kwargs(task) -> dict:
    if isinstance(task, NeedleHaystack):
        return {"context_len": task.context_len, "haystack": task.text}
    if isinstance(task, CopyPaste):
        return {"max_copy": task.max_copy, "max_lookback": task.max_lookback}
    return {"seq_len": task.seq_len}


def test_key_value_answer_is_the_planted_value() -> None:
    task = EntityLabelCopy(seq_len=300, vocab_size=256, num_entities=6, label_len=4, seed=1)
    for i in range(30):
        e = task.example(i)
        ids = e.input_ids
        assert ids.size == 300 and ids.max() < 256
        key = e.meta["key"]
        at = ids.size - 6 - e.meta["lag"]
        assert ids[at] == task.mark and ids[at + 1] == key
        assert np.array_equal(ids[at + 2 : at + 6], ids[-4:])
        assert (ids[:-6] == task.query).sum() == 0
        assert (ids == task.mark).sum() == 6
        assert task.min_lag <= e.meta["lag"] <= task.max_lag


def test_zipf_lags_are_heavy_tailed() -> None:
    task = ZipfRetrieval(seq_len=4096, alpha=1.3, seed=0)
    lags = np.array([task.example(i).meta["lag"] for i in range(300)])
    assert np.median(lags) < 20 and lags.max() > 200 and lags.min() >= task.min_lag


def test_a_layout_that_cannot_be_placed_fails_instead_of_hanging() -> None:
    # 32 queried records of 3 tokens in a 160-token body: placed at unaligned Zipf lags, they leave
    # gaps too short for the rest (this drew lags forever before)
    task = ZipfRetrieval(seq_len=256, vocab_size=258, num_pairs=32, queries=32, seed=0)
    with pytest.raises(ValueError, match=r"task 'zipf' example 0: .*seq_len 256 is too short for 32 records"):
        task.example(0)


def test_copy_paste_bounds() -> None:
    task = CopyPaste(max_copy=1024, max_lookback=2048, seed=0)
    lens = []
    for i in range(50):
        e = task.example(i)
        n, lookback = e.meta["copy_len"], e.meta["lookback"]
        lens.append(n)
        assert 1 <= n <= 1024 and lookback <= 2048
        assert np.array_equal(e.input_ids[1 : 1 + n], e.input_ids[-n:])
        assert e.input_ids[lookback] == 0x03 and e.answer[0] == 1 + lookback
        assert e.input_ids.max() < 256
    assert max(lens) > 512


def test_distinct_labels_never_share_a_token_within_a_sequence() -> None:
    shared = EntityLabelCopy(seq_len=512, vocab_size=64, num_entities=8, label_len=4, queries=8, seed=2)
    distinct = EntityLabelCopy(seq_len=512, vocab_size=162, num_entities=8, label_len=4, queries=8, seed=2,
                               distinct_labels=True)
    repeats = 0
    for i in range(20):
        for task in (shared, distinct):
            ids = task.example(i).input_ids
            labels = np.stack([ids[p + 2 : p + 6] for p in np.flatnonzero(ids == task.mark)])
            assert labels.shape == (8, 4) and ((labels >= task.keys) & (labels < 2 * task.keys)).all()
            if task is distinct:
                assert np.unique(labels).size == 32
            else:
                repeats += np.unique(labels).size < 32
    assert repeats > 0  # the shared-alphabet labels do repeat: the check above can fail
    with pytest.raises(ValueError, match="distinct_values: vocab_size 64 has 15 value tokens, fewer than"):
        EntityLabelCopy(seq_len=512, vocab_size=64, num_entities=8, label_len=4, distinct_labels=True)


def test_distinct_copy_uses_letters_once_and_no_letter_in_the_filler() -> None:
    task = CopyPaste(max_copy=16, max_lookback=224, distinct=True, seed=1)
    assert task.alphabet == 52 and CopyPaste(max_copy=16, max_lookback=224).alphabet == 95
    for i in range(50):
        e = task.example(i)
        n, lookback = e.meta["copy_len"], e.meta["lookback"]
        segment, filler = e.input_ids[1 : 1 + n], e.input_ids[1 + n : lookback]
        assert np.array_equal(segment, e.input_ids[-n:]) and np.unique(segment).size == n
        assert all(chr(b).isalpha() for b in segment) and not any(chr(b).isalpha() for b in filler)
    with pytest.raises(ValueError, match="max_copy=60 exceeds the 52 ASCII letters"):
        CopyPaste(max_copy=60, max_lookback=224, distinct=True)


def test_log_uniform_lookbacks_are_as_many_per_octave() -> None:
    task = CopyPaste(max_copy=2, max_lookback=1024, lookbacks="log_uniform", seed=0)
    lookbacks = np.array([task.example(i).meta["lookback"] for i in range(3000)])
    assert lookbacks.min() >= 3 and lookbacks.max() <= 1024
    per_octave = [((lookbacks >= 2**k) & (lookbacks < 2 ** (k + 1))).mean() for k in (3, 5, 7, 9)]
    assert max(per_octave) < 1.3 * min(per_octave)
    plain = CopyPaste(max_copy=2, max_lookback=1024, seed=0)
    uniform = np.array([plain.example(i).meta["lookback"] for i in range(300)])
    assert (uniform < 64).mean() < 0.1 < (lookbacks < 64).mean()
    with pytest.raises(ValueError, match="lookbacks: expected 'uniform' or 'log_uniform', got 'zipf'"):
        CopyPaste(lookbacks="zipf")


def test_needle_in_512k_haystack_of_real_text() -> None:
    book = BOOK.read_bytes()
    task = NeedleHaystack(512 * 1024, book, depth=0.5, seed=0)
    e = task.example(0)
    assert e.input_ids.size == 512 * 1024
    text = e.input_ids.astype(np.uint8).tobytes()
    number = e.meta["number"]
    needle = b"The secret number is %06d." % number
    assert text.count(needle) == 1 and text.endswith(b"%06d" % number)
    assert abs(text.index(needle) / len(text) - 0.5) < 0.01
    assert book[1000:1100] in text


def test_accuracy_and_collate() -> None:
    task = EntityLabelCopy(seq_len=128, seed=0)
    examples = [task.example(i) for i in range(4)]
    batch = collate(examples, pad_id=0)
    perfect = torch.where(batch["labels"] == IGNORE_INDEX, 0, batch["labels"])
    assert accuracy(examples, perfect) == {"exact": 1.0, "token": 1.0}
    wrong = perfect.clone()
    wrong[0, examples[0].answer[0] - 1] += 1
    scores = accuracy(examples, wrong)
    assert scores["exact"] == 0.75 and scores["token"] == pytest.approx(15 / 16)
    copy = [CopyPaste(max_copy=8, max_lookback=16).example(i) for i in range(3)]
    padded = collate(copy, pad_id=257)
    assert padded["input_ids"].shape[1] == max(e.input_ids.size for e in copy)


def test_task_stream_partitions_and_pads() -> None:
    from torch.utils.data import DataLoader

    from data_pipeline.synthetic import TaskStream

    task = CopyPaste(max_copy=16, max_lookback=40, seed=2)
    width = 1 + 40 + 16
    ranks = [list(TaskStream(task, rank=r, world_size=2, start=4, num_examples=12, pad_to=width)) for r in range(2)]
    assert [x["index"] for x in ranks[0]] == [4, 6, 8, 10] and [x["index"] for x in ranks[1]] == [5, 7, 9, 11]
    for x in ranks[0] + ranks[1]:
        e = task.example(x["index"])
        n = e.input_ids.size
        assert x["input_ids"].shape == (width,) and x["input_ids"][:n].tolist() == e.input_ids.tolist()
        assert (x["labels"][n - 1 :] == IGNORE_INDEX).all() and x["labels"][: n - 1].tolist() == e.labels[:-1].tolist()
    batch = next(iter(DataLoader(TaskStream(task, pad_to=width), batch_size=3)))
    assert batch["input_ids"].shape == (3, width) and batch["index"].tolist() == [0, 1, 2]


def test_needle_accepts_a_file_object() -> None:
    with BOOK.open("rb") as f:
        task = NeedleHaystack(2048, f, seed=1)
    assert _same(task.example(0), NeedleHaystack(2048, BOOK.read_bytes(), seed=1).example(0))


def test_mqar_pairs_then_every_key_queried_once_with_only_its_value_labelled() -> None:
    from data_pipeline.synthetic import MultiQueryRecall

    task = MultiQueryRecall(64, vocab_size=40, num_pairs=8, seed=3)
    for i in range(20):
        e = task.example(i)
        ids, labels = e.input_ids, e.labels
        keys, values = ids[0:16:2], ids[1:16:2]
        assert len(set(keys.tolist())) == 8 and (keys < task.keys).all()
        assert ((values >= task.keys) & (values < 2 * task.keys)).all()
        places = np.flatnonzero(labels != IGNORE_INDEX)
        assert places.tolist() == e.meta["query_at"] and places.min() >= 16 and places.max() < 63
        assert sorted(ids[places].tolist()) == sorted(keys.tolist())
        answer = dict(zip(keys.tolist(), values.tolist()))
        assert [answer[k] for k in ids[places].tolist()] == labels[places].tolist()
        region = np.delete(ids[16:], places - 16)
        assert (region == task.filler).all()  # the answers are never in the input
        assert _same(e, task.example(i))
    assert not _same(task.example(0), task.example(1))
    with pytest.raises(ValueError, match="num_pairs"):
        MultiQueryRecall(64, vocab_size=20, num_pairs=10)
    with pytest.raises(ValueError, match="too short"):
        MultiQueryRecall(20, vocab_size=40, num_pairs=8)


def test_mqar_gap_puts_every_query_that_far_past_the_pairs_and_names_each_pairs_value() -> None:
    from data_pipeline.synthetic import MultiQueryRecall

    task = MultiQueryRecall(96, vocab_size=40, num_pairs=8, seed=1, gap=40)
    for i in range(20):
        e = task.example(i)
        query, value = np.asarray(e.meta["query_at"]), np.asarray(e.meta["value_at"])
        assert query.min() >= 16 + 40 and (query - value > 40).all()
        assert (e.input_ids[value - 1] == e.input_ids[query]).all()  # value_at follows the queried key
        assert (e.input_ids[value] == e.labels[query]).all()
        assert (e.input_ids[16:56] == task.filler).all()
    no_gap = MultiQueryRecall(64, vocab_size=40, num_pairs=8, seed=3, gap=0).example(5)
    assert _same(no_gap, MultiQueryRecall(64, vocab_size=40, num_pairs=8, seed=3).example(5))
    with pytest.raises(ValueError, match="a gap of 41"):
        MultiQueryRecall(64, vocab_size=40, num_pairs=8, gap=41)
    with pytest.raises(ValueError, match="gap must be"):
        MultiQueryRecall(64, vocab_size=40, num_pairs=8, gap=-1)
