"""engine.kind=single's payload: the CausalLM's weights as safetensors and a tensors-only optimizer file."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_model

from pretrain.checkpoint.layout import CheckpointError, cause

SINGLE_WEIGHTS = "model.safetensors"
SINGLE_OPTIMIZER = "optimizer.pt"


def save_torch_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The CausalLM's weights as safetensors and a tensors-only optimizer file."""
    os.makedirs(path, exist_ok=True)
    save_model(model, os.path.join(path, SINGLE_WEIGHTS))
    torch.save(optimizer.state_dict(), os.path.join(path, SINGLE_OPTIMIZER))


def load_torch_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Weights through safetensors, the optimizer weights-only: neither can run code."""
    load_model(model, os.path.join(path, SINGLE_WEIGHTS), strict=True)
    file = os.path.join(path, SINGLE_OPTIMIZER)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types; weights-only refusals among them
        raise CheckpointError(f"{file}: not a tensors-only optimizer state (refused to load it): {cause(err)}") from err
    optimizer.load_state_dict(state)


def holds(engine_dir: Path) -> bool:
    """Whether `engine_dir` is in this format."""
    return (engine_dir / SINGLE_WEIGHTS).is_file()


def read_weights(engine_dir: Path) -> dict[str, torch.Tensor]:
    path = engine_dir / SINGLE_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (engine.kind=single writes the weights there)")
    return load_file(str(path))  # saved from the bare CausalLM: no prefix
