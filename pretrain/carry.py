"""The trainer's side of `train.carry_state`: truncated backpropagation through time.

Each row of the global batch is a lane of data_pipeline/lanes.py, a stream that continues from
one optimizer step to the next. The model's recurrent state after a step's window is kept
(detached: gradients stop at the window boundary, which is the truncation) and fed to the same
lane's next window, so the model trains on what it sees at evaluation time: a memory built over
the whole text so far and positions that keep growing, not a fresh state every `seq_len` tokens.

A state is whatever `CausalLM.forward` returns: nested lists and tuples (named or not) of tensors
with the batch first, plain ints (positions) and None. For checkpoints it is flattened per lane
(`lane000012/3.0` is lane 12's entry 0 of block 3), so a run resumes at any world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from data_pipeline.lanes import LaneStream
from model import CausalLM
from pretrain.config import RunConfig

CARRY_DIR = "carry"


def detach_state(state: Any) -> Any:
    """The same structure with every tensor detached from the graph that produced it."""
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(detach_state(s) for s in state))
    if isinstance(state, (list, tuple)):
        return type(state)(detach_state(s) for s in state)
    return state


def _flatten(state: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(state, (list, tuple)):
        for i, item in enumerate(state):
            yield from _flatten(item, f"{prefix}.{i}" if prefix else str(i))
    elif state is not None:
        yield prefix, state


def _unflatten(template: Any, entries: dict[str, torch.Tensor], prefix: str) -> Any:
    """Rebuild `template`'s structure from `entries`; a leaf missing from them becomes None."""
    if isinstance(template, (list, tuple)):
        items = [_unflatten(t, entries, f"{prefix}.{i}" if prefix else str(i)) for i, t in enumerate(template)]
        if hasattr(template, "_fields"):
            return type(template)(*items)
        return type(template)(items)
    value = entries.get(prefix)
    if value is None:
        return None
    return int(value) if value.dtype == torch.int64 and value.dim() == 0 else value


def lane_tensors(state: Any, lanes: list[int]) -> dict[str, torch.Tensor]:
    """One micro-batch's state as safetensors entries, split per lane (row)."""
    out = {}
    for path, leaf in _flatten(state, ""):
        for row, lane in enumerate(lanes):
            key = f"lane{lane:06d}/{path}"
            if isinstance(leaf, torch.Tensor):
                out[key] = leaf[row : row + 1].detach().cpu().contiguous()
            else:
                out[key] = torch.tensor(int(leaf), dtype=torch.int64)
    return out


class StateCarrier:
    """This rank's lanes and the states it carries: what the trainer uses in place of a loader.

    `next_step()` gives the step's micro-batches as (input_ids, labels, state), or (input_ids, labels,
    state, doc_start) under data.doc_boundaries, for the engine;
    `update()` keeps the states the engine returns. `state_dict()` is the lanes' position (saved
    in trainer_state.json); `save()` / `load()` write and read the states themselves.
    """

    def __init__(self, lanes: LaneStream, model: CausalLM, device: torch.device):
        self.lanes, self.model, self.device = lanes, model, device
        self.micro_batch = lanes.micro_batch
        self.n_micro = lanes.rows_per_rank // lanes.micro_batch
        self.states: dict[int, Any] = {}

    def stats(self) -> dict[str, int]:
        """The lanes' read counters (see ``PackedStream.stats``)."""
        return self.lanes.stream.stats()

    def next_step(self) -> list[tuple[Any, ...]]:
        out = []
        for micro, batch in enumerate(self.lanes.next_step()):
            if batch["reset"] or micro not in self.states:
                state = self.model.init_state(self.micro_batch, self.device)
            else:
                state = self.states[micro]
            keys = ("input_ids", "labels", "doc_start") if "doc_start" in batch else ("input_ids", "labels")
            ids, labels, *doc_start = (batch[key].to(self.device, non_blocking=True) for key in keys)
            out.append((ids, labels, state, *doc_start))
        return out

    def update(self, states: list[Any]) -> None:
        if len(states) != self.n_micro or any(s is None for s in states):
            raise RuntimeError(f"the engine returned {len(states)} states for {self.n_micro} carried micro-batches")
        self.states = {micro: detach_state(state) for micro, state in enumerate(states)}

    def state_dict(self) -> dict[str, Any]:
        return self.lanes.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lanes.load_state_dict(state)

    def position(self) -> int:
        """Global number of the next sample the lanes read (data_pipeline/lanes.py numbers them)."""
        return self.lanes.position()

    def skip(self, first: int, end: int) -> None:
        """Never train on global samples `first .. end - 1` (their steps are skipped whole)."""
        self.lanes.skip(first, end)

    def _lanes_of(self) -> list[list[int]]:
        return [self.lanes.lane_ids(micro) for micro in range(self.n_micro)]

    def save(self, checkpoint_dir: Path, rank: int) -> None:
        """Write this rank's states as `<checkpoint_dir>/carry/rank_<rank>.safetensors`."""
        tensors: dict[str, torch.Tensor] = {}
        for micro, lanes in enumerate(self._lanes_of()):
            if micro in self.states:
                tensors.update(lane_tensors(self.states[micro], lanes))
        (checkpoint_dir / CARRY_DIR).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(checkpoint_dir / CARRY_DIR / f"rank_{rank}.safetensors"))

    def load(self, checkpoint_dir: Path) -> None:
        """Take this rank's lanes from the files every rank of the saving run wrote, whatever its
        world size (lanes are global rows). A lane without a saved state starts from zero."""
        wanted = {f"lane{lane:06d}": (micro, row) for micro, lanes in enumerate(self._lanes_of())
                  for row, lane in enumerate(lanes)}
        files = sorted((checkpoint_dir / CARRY_DIR).glob("rank_*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{checkpoint_dir / CARRY_DIR}: no carried states (rank_*.safetensors); "
                                    "was this checkpoint written with train.carry_state?")
        found: dict[int, dict[str, list[torch.Tensor | None]]] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    lane, _, leaf = key.partition("/")
                    if lane in wanted:
                        micro, row = wanted[lane]
                        rows = found.setdefault(micro, {}).setdefault(leaf, [None] * self.micro_batch)
                        rows[row] = f.get_tensor(key)
        self.states = {}
        for micro, leaves in found.items():
            entries = {}
            for leaf, rows in leaves.items():
                if any(r is None for r in rows):
                    where = checkpoint_dir / CARRY_DIR
                    raise ValueError(f"{where}: {leaf!r} is missing for a lane of micro-batch {micro}")
                first = rows[0]
                entries[leaf] = first if first.dim() == 0 else torch.cat(rows).to(self.device)
            # init_state gives the structure; leaves it has as None (an attention cache that the
            # first call fills) are found by path among the entries
            self.states[micro] = _unflatten(self.model.init_state(self.micro_batch, self.device), entries, "")


def make_carrier(cfg: RunConfig, model: CausalLM, rank: int, world: int, device: torch.device) -> StateCarrier:
    lanes = LaneStream(
        cfg.data.train[0].path, cfg.data.seq_len, cfg.train.global_batch, cfg.train.micro_batch,
        seed=cfg.run.seed, rank=rank, world_size=world, expected_tokenizer=cfg.data.tokenizer,
        doc_boundaries=cfg.data.doc_boundaries, skip_samples=cfg.data.skip_samples,
    )
    return StateCarrier(lanes, model, device)
