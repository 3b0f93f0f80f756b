"""The training data of a run: the loader its config names (packed shards or a synthetic task), and
each step's micro-batches cut to this rank's piece of the sequence and moved to its device."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from data_pipeline import storage
from data_pipeline.lanes import recorded_source
from data_pipeline.shards import load_manifest
from data_pipeline.stream import PackedStream, StreamLoader, recorded_sources
from data_pipeline.synthetic import TaskBatches
from model import SequenceParallel
from pretrain.config import RunConfig
from pretrain.distributed.parallel_dims import local_slice
from pretrain.preflight import task_generator
from pretrain.protocols import Batch


def configure_storage(cfg: RunConfig) -> None:
    """This process's retry policy and s3:// settings from the config's `storage` section
    (data_pipeline/storage.py); before anything remote is read."""
    storage.apply(cfg.storage)


def make_task_data(cfg: RunConfig, rank: int, world: int) -> TaskBatches:
    """Batches of the configured synthetic task (token ids must fit the model's vocabulary)."""
    return TaskBatches(task_generator(cfg), cfg.data.seq_len, cfg.train.micro_batch, rank, world,
                       skip_samples=cfg.data.skip_samples)


def make_loader(cfg: RunConfig, rank: int, world: int) -> StreamLoader | TaskBatches:
    """The loader of data-parallel rank `rank` of `world`: the task's batches, or the packed shards."""
    if cfg.data.task is not None:
        return make_task_data(cfg, rank, world)
    stream = PackedStream(
        [(s.path, s.weight) for s in cfg.data.train],
        seq_len=cfg.data.seq_len,
        seed=cfg.run.seed,
        rank=rank,
        world_size=world,
        shuffle_buffer=cfg.data.shuffle_buffer,
        interleave=cfg.data.interleave,
        doc_boundaries=cfg.data.doc_boundaries,
        batch_size=cfg.train.micro_batch,
        expected_tokenizer=cfg.data.tokenizer,
        skip_samples=cfg.data.skip_samples,
        read_retries=cfg.storage.retries,
        read=cfg.data.read,
        verify=cfg.data.read == "shard",
    )
    # pinned batches copy to the GPU without making the host wait (the loop's non_blocking copies)
    return StreamLoader(stream, num_workers=cfg.data.num_workers, pin_memory=torch.cuda.is_available())


def rebuilt_sources(cfg: RunConfig, saved: dict[str, Any]) -> list[str]:
    """The data.train sources whose shards are not those the saved loader state `saved` was reading
    (the same manifest URL with another fingerprint: rebuilt in place), one line each."""
    if cfg.data.task is not None:
        return []
    manifests = [load_manifest(source.path) for source in cfg.data.train]
    if cfg.train.carry_state:  # one source, recorded by its fingerprint alone
        recorded = {manifests[0].url: recorded_source(saved)} if manifests else {}
    else:
        recorded = recorded_sources(saved)
    return [
        f"data.train[{i}] ({cfg.data.train[i].path}): fingerprint {recorded[m.url][:12]} -> {m.fingerprint[:12]}"
        for i, m in enumerate(manifests) if recorded.get(m.url) not in (None, m.fingerprint)
    ]


class StepBatches:
    """Each step's `gas` micro-batches from `loader`, as the engines take them: this rank's slice of
    the sequence (under sequence parallelism), on `device`. It has the loader's state and statistics,
    as the state carrier of train.carry_state does, so that the loop treats both alike."""

    def __init__(
        self, loader: StreamLoader | TaskBatches, gas: int, sequence_parallel: SequenceParallel | None,
        device: torch.device,
    ) -> None:
        self.loader, self.gas, self.sequence_parallel, self.device = loader, gas, sequence_parallel, device
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None

    def _forever(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield from self.loader

    def _micro_batch(self, batch: dict[str, torch.Tensor]) -> Batch:
        """(input_ids, labels), or (input_ids, labels, None, doc_start) under data.doc_boundaries."""
        keys = ("input_ids", "labels", "doc_start") if "doc_start" in batch else ("input_ids", "labels")
        pieces: list[Any] = [
            local_slice(batch[key], self.sequence_parallel).to(self.device, non_blocking=True) for key in keys
        ]
        if len(pieces) == 3:
            pieces.insert(2, None)  # no carried state
        return tuple(pieces)

    def next_step(self) -> list[Batch]:
        if self._batches is None:  # started on first use, after a resume has restored the position
            self._batches = self._forever()
        return [self._micro_batch(next(self._batches)) for _ in range(self.gas)]

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; batches drawn before are forgotten (a rollback reloads mid-run)."""
        self.loader.load_state_dict(state)
        self._batches = None

    def position(self) -> int:
        """Global number of the next sample to read (the same on every rank at a step boundary)."""
        return self.loader.position()

    def skip(self, first: int, end: int) -> None:
        """Never train on global samples `first .. end - 1`."""
        self.loader.skip(first, end)
        self._batches = None

    def stats(self) -> dict[str, float]:
        return self.loader.stats()
