"""The build's streaming stages, in input order with bounded memory: a reader thread a fixed number
of items ahead (`in_thread`), and tokenization in the main thread or a process pool with a bounded
number of batches in flight (`encoded`). data_pipeline/build.py chains them into parts and shards."""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import TypeVar

import numpy as np

from data_pipeline.sources import Document
from data_pipeline.tokenizer import Tokenizer

_BATCH_BYTES = 4 << 20
_QUEUE_DEPTH = 64

T = TypeVar("T")


def _encode_batch(tokenizer: Tokenizer, datas: list[bytes]) -> list[tuple[np.ndarray, bool]]:
    """Tokenize a batch of documents (runs in a worker process when workers > 1)."""
    return [tokenizer.encode(d) for d in datas]


def _batches(docs: Iterator[Document]) -> Iterator[list[Document]]:
    """Group documents into batches of about ``_BATCH_BYTES`` for the worker pool."""
    batch: list[Document] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.data)
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def in_thread(items: Iterable[T], depth: int = _QUEUE_DEPTH) -> Iterator[T]:
    """Iterate ``items`` in a background thread, ``depth`` items ahead; its exceptions re-raise here.

    Leaving the loop early stops the thread at its next item.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(entry: tuple[object, BaseException | None]) -> bool:
        """Queue ``entry`` unless the consumer has left; whether it was queued."""
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((done, None))
        except BaseException as exc:
            put((done, exc))

    thread = threading.Thread(target=run, name="build-reader", daemon=True)
    thread.start()
    try:
        while True:
            item, exc = q.get()
            if item is done:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        stop.set()
        thread.join()


def encoded(
    tokenizer: Tokenizer, docs: Iterator[Document], pool: Executor | None, workers: int
) -> Iterator[tuple[Document, np.ndarray, bool]]:
    """Yield ``(document, ids, invalid_utf8)`` in input order, tokenizing in ``pool`` when given.

    At most ``2 * workers`` batches are in flight, so memory stays bounded for any corpus size.
    """
    if pool is None:
        for doc in docs:
            ids, invalid = tokenizer.encode(doc.data)
            yield doc, ids, invalid
        return
    pending: deque[tuple[list[Document], Future]] = deque()
    for batch in _batches(docs):
        pending.append((batch, pool.submit(_encode_batch, tokenizer, [d.data for d in batch])))
        while len(pending) >= 2 * workers:
            done_batch, fut = pending.popleft()
            for doc, (ids, invalid) in zip(done_batch, fut.result()):
                yield doc, ids, invalid
    while pending:
        done_batch, fut = pending.popleft()
        for doc, (ids, invalid) in zip(done_batch, fut.result()):
            yield doc, ids, invalid
