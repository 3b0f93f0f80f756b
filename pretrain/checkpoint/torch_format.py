"""engine.kind=single's payload: the CausalLM's weights as safetensors and a tensors-only optimizer file.

Loading reads both files and checks them against the model and the optimizer (pretrain/checkpoint/fit.py)
before it copies anything, so a payload that does not fit, or does not read, leaves both as they were.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_model

from pretrain.checkpoint.fit import Spec, check_fit, spec, specs
from pretrain.checkpoint.layout import CheckpointError, cause

SINGLE_WEIGHTS = "model.safetensors"
SINGLE_OPTIMIZER = "optimizer.pt"


def save_torch_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The CausalLM's weights as safetensors and a tensors-only optimizer file."""
    os.makedirs(path, exist_ok=True)
    save_model(model, os.path.join(path, SINGLE_WEIGHTS))
    torch.save(optimizer.state_dict(), os.path.join(path, SINGLE_OPTIMIZER))


def load_torch_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Weights through safetensors, the optimizer weights-only: neither can run code. Both files are
    read and checked against `model` and `optimizer` (names, shapes, dtypes) before either is changed."""
    weights_file, optimizer_file = os.path.join(path, SINGLE_WEIGHTS), os.path.join(path, SINGLE_OPTIMIZER)
    weights = _read_safetensors(weights_file)
    try:
        state = torch.load(optimizer_file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types; weights-only refusals among them
        raise CheckpointError(
            f"{optimizer_file}: not a tensors-only optimizer state (refused to load it): {cause(err)}"
        ) from err
    weights = _with_tied_names(weights, model.state_dict())
    check_fit(weights_file, specs(weights), specs(model.state_dict()), "this run's model")
    _check_optimizer_state(optimizer_file, state, optimizer, model)
    model.load_state_dict(weights, strict=True)
    optimizer.load_state_dict(state)


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except Exception as err:  # safetensors raises its own error types for a missing file or a bad header
        raise CheckpointError(f"{path}: not a safetensors file: {cause(err)}") from err


def _with_tied_names(weights: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` plus the names safetensors' save_model left out because they share a tensor with a
    saved one (tied embeddings), so that they compare and load under the model's own names."""
    def storage(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
        return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)

    saved_by_storage = {storage(own[name]): name for name in weights if name in own}
    tied = {name: saved_by_storage.get(storage(t)) for name, t in own.items() if name not in weights}
    return {**weights, **{name: weights[twin] for name, twin in tied.items() if twin is not None}}


def _check_optimizer_state(
    source: str, state: Any, optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> None:
    """`state` (a saved optimizer state dict) must have `optimizer`'s groups, each with as many
    parameters, and a moment of each parameter's shape and dtype for every one it holds (torch checks
    the groups itself, but copies moments of any shape); raises CheckpointError naming `source`."""
    try:
        groups, per_param = state["param_groups"], state["state"]
        saved_ids = [list(group["params"]) for group in groups]
    except (TypeError, KeyError) as err:
        raise CheckpointError(f"{source}: not an optimizer state dict ({cause(err)})") from err
    sizes = [len(ids) for ids in saved_ids]
    own_sizes = [len(group["params"]) for group in optimizer.param_groups]
    if sizes != own_sizes:
        raise CheckpointError(f"{source}: does not fit this run's optimizer: parameter groups of {sizes} "
                              f"parameters saved, {own_sizes} here")
    names = {id(p): name for name, p in model.named_parameters()}
    saved: dict[str, Spec] = {}
    wanted: dict[str, Spec] = {}
    for ids, group in zip(saved_ids, optimizer.param_groups, strict=True):
        for saved_id, param in zip(ids, group["params"], strict=True):
            for key, value in per_param.get(saved_id, {}).items():
                if isinstance(value, torch.Tensor):
                    name = f"{names.get(id(param), saved_id)}.{key}"
                    saved[name] = spec(value, dtype=key != "step")
                    wanted[name] = ((), None) if key == "step" else spec(param)
    check_fit(source, saved, wanted, "this run's optimizer")


def holds(engine_dir: Path) -> bool:
    """Whether `engine_dir` is in this format."""
    return (engine_dir / SINGLE_WEIGHTS).is_file()


def read_weights(engine_dir: Path) -> dict[str, torch.Tensor]:
    path = engine_dir / SINGLE_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (engine.kind=single writes the weights there)")
    return load_file(str(path))  # saved from the bare CausalLM: no prefix
