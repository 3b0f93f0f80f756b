"""Weights-only start (`init.from`): a new run begins from another run's weights.

The source is an export directory (config.json + model.safetensors), a checkpoint step directory, or
a checkpoints or run directory (its newest committed checkpoint). Checkpoints are verified against
their manifest and consolidated whatever engine and world size wrote them (pretrain.export's
consolidation), so the new run may use another engine, another world size, another seq_len and
another data mixture. Only the parameters are copied: the optimizer, the step counter and the data
stream of the new run start fresh, and buffers derived from the config (the SOE kernel tables) are
those of the new config.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from data_pipeline.storage import is_remote
from model import CausalLM
from pretrain.checkpoint.consolidate import load_newest
from pretrain.checkpoint.fit import misfit, specs
from pretrain.checkpoint.layout import CheckpointError
from pretrain.config import ConfigError
from pretrain.export import CONFIG, ExportError, load_exported
from pretrain.export.object_store import download, is_export


def read_initial_weights(source: str) -> dict[str, torch.Tensor]:
    """The parameters (fp32, CPU) of the export, checkpoint or run directory `source`: a local path or
    an object-store URL (an export prefix is downloaded; a checkpoint's steps are read by manifest)."""
    try:
        if is_remote(source) and is_export(source):
            with tempfile.TemporaryDirectory(prefix="init-from-") as tmp:
                model = load_exported(download(source, Path(tmp)))
        elif not is_remote(source) and (Path(source) / CONFIG).is_file():
            model = load_exported(Path(source))
        else:
            model = load_newest(source, "init.from")[2]
    except (ExportError, CheckpointError) as err:
        raise ConfigError(f"init.from: {err}") from err
    return {name: param.detach() for name, param in model.named_parameters()}


@torch.no_grad()
def load_initial_weights(model: CausalLM, source: str) -> None:
    """Copy the parameters of `source` into `model` (before an engine shards it); every parameter
    must be there with the same shape (pretrain/checkpoint/fit.py; the dtype may differ, the copy
    converts it), so a different architecture fails here, naming the keys, before anything is copied."""
    weights = read_initial_weights(source)
    own = dict(model.named_parameters())
    problem = misfit(specs(weights, dtype=False), specs(own, dtype=False))
    if problem is not None:
        raise ConfigError(
            f"init.from: {source}: its weights do not fit this run's model.kind={model.config.kind!r}: {problem} "
            "(model sizes must agree; only seq_len-like settings may change)"
        )
    for name, param in own.items():
        param.copy_(weights[name])
