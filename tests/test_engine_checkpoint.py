"""Engine payloads without a process group: DeepSpeed's loaders run weights-only, a checkpoint's
recorded layout decides whether it goes through the universal format, and bad input is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import dcp_format, torch_format
from pretrain.checkpoint.consolidate import read_engine_weights
from pretrain.checkpoint.deepspeed_format import DEEPSPEED_FORMAT, _needs_universal, deepspeed_weights_only
from pretrain.checkpoint.layout import CheckpointError


class Unlisted:
    """A class no allow-list names: unpickling it would run code of the file's choosing."""


def test_deepspeed_loading_refuses_pickled_objects_and_restores_torch_load(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    torch.save({"w": torch.ones(2), "odd": Unlisted()}, path)
    original = torch.load
    with deepspeed_weights_only(), pytest.raises(Exception, match="Weights only load failed"):
        torch.load(path, weights_only=False)  # what DeepSpeed's own code asks for
    assert torch.load is original
    torch.save({"w": torch.ones(2)}, path)
    with deepspeed_weights_only():
        assert torch.equal(torch.load(path, weights_only=False)["w"], torch.ones(2))


def layout(path: Path, stage: int, ranks: int) -> Path:
    path.mkdir(exist_ok=True)
    (path / DEEPSPEED_FORMAT).write_text(json.dumps({"zero_stage": stage, "data_parallel_size": ranks}))
    return path


@pytest.mark.parametrize(
    ("saved", "now", "universal"),
    [((2, 2), (2, 2), False), ((2, 2), (2, 1), True), ((1, 1), (1, 2), True), ((2, 2), (1, 2), True),
     ((0, 2), (0, 1), False), ((3, 2), (3, 2), False), ((3, 2), (3, 1), True), ((3, 1), (3, 2), True)],
)
def test_universal_only_when_stage_or_size_differ(saved, now, universal, tmp_path: Path) -> None:
    assert _needs_universal(layout(tmp_path, *saved), now[0], now[1]) is universal


@pytest.mark.parametrize(("saved", "now"), [(0, 2), (2, 0), (3, 2), (1, 3)])
def test_stage_changes_deepspeed_cannot_load_are_refused(saved: int, now: int, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=rf"ZeRO-{saved}, this run is ZeRO-{now}.*engine\.zero_stage={saved}"):
        _needs_universal(layout(tmp_path, saved, 2), now, 2)


def test_checkpoint_without_layout_loads_as_it_is(tmp_path: Path) -> None:
    assert not _needs_universal(tmp_path, 3, 4)


def test_missing_or_unknown_payloads_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no engine payload in any known format \(torch_format, dcp_format"):
        read_engine_weights(tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing"):
        torch_format.read_weights(tmp_path)
    with pytest.raises(CheckpointError, match=r"not a torch\.distributed\.checkpoint"):
        dcp_format.read_weights(tmp_path)
    (tmp_path / "ds").mkdir()  # DeepSpeed's tag directory, but no format.json beside it
    with pytest.raises(CheckpointError, match=r"format\.json: cannot read the ZeRO stage"):
        read_engine_weights(tmp_path)
