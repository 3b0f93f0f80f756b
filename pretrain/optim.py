"""AdamW parameter groups and the learning-rate schedules (one definition for every engine)."""

from __future__ import annotations

import math

from torch import nn

from model.interface import CausalLM
from pretrain.config import TrainSection


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices decay; norms, biases, embeddings and what a model names in its
    `no_weight_decay` (found at any depth of `model`, e.g. inside the trainer's wrapper) do not.

    Tied weights appear once (named_parameters de-duplicates them), under the embedding's name.
    """
    spared = set()
    for prefix, module in model.named_modules():
        if isinstance(module, CausalLM):
            spared |= {f"{prefix}.{name}" if prefix else name for name in module.no_weight_decay()}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or "embed" in name or "norm" in name or name in spared:
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def lr_at(step: int, train: TrainSection) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then the chosen decay.

    cosine: from lr down to lr * min_lr_ratio at the last step. wsd (warm-up, stable, decay): flat
    at lr, then a linear decay to lr * min_lr_ratio over the last `decay_fraction` of the steps.
    """
    peak, floor = train.lr, train.lr * train.min_lr_ratio
    if train.warmup_steps and step < train.warmup_steps:
        return peak * (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return peak
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    if train.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = 1.0 - train.decay_fraction
    if progress <= decay_start:
        return peak
    return peak + (floor - peak) * (progress - decay_start) / train.decay_fraction
