"""Whether saved tensors fit what is to receive them, decided before any tensor is copied.

Every loader (the three engine payloads, `init.from`) compares the names, shapes and dtypes on both
sides first and copies only when all of them agree, so a checkpoint that does not fit leaves the
model and the optimizer exactly as they were. (`torch.nn.Module.load_state_dict(strict=True)` copies
every tensor that matches before it raises for the rest: a model half loaded from another run.)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pretrain.checkpoint.layout import CheckpointError

Spec = tuple[tuple[int, ...], torch.dtype | None]
"""A tensor's shape and dtype (None where the dtype is not compared)."""

SHOWN = 3  # names listed per kind of difference; the rest are counted


def spec(tensor: torch.Tensor, dtype: bool = True) -> Spec:
    """The Spec of `tensor` (its global shape for a sharded DTensor); without `dtype`, shape only."""
    return tuple(tensor.shape), tensor.dtype if dtype else None


def specs(tensors: Mapping[str, torch.Tensor], dtype: bool = True) -> dict[str, Spec]:
    """The Spec of every tensor of a state dict (entries that are not tensors are left out)."""
    return {name: spec(t, dtype) for name, t in tensors.items() if isinstance(t, torch.Tensor)}


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _describe(value: Spec) -> str:
    shape, dtype = value
    return f"{list(shape)}" + (f" {str(dtype).removeprefix('torch.')}" if dtype is not None else "")


def misfit(saved: Mapping[str, Spec], wanted: Mapping[str, Spec]) -> str | None:
    """How `saved` (name -> Spec) differs from `wanted`, in one line, or None when both hold the same
    names with the same shapes and dtypes (a dtype of None on either side is not compared)."""
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    differing = []
    for name in sorted(set(saved) & set(wanted)):
        (shape, dtype), (want_shape, want_dtype) = saved[name], wanted[name]
        if shape != want_shape or (dtype is not None and want_dtype is not None and dtype != want_dtype):
            differing.append(f"{name} {_describe(saved[name])} saved, {_describe(wanted[name])} here")
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from it ({_names(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) this run does not have ({_names(unexpected)})")
    if differing:
        problems.append(f"{len(differing)} of another shape or dtype ({_names(differing)})")
    return "; ".join(problems) or None


def check_fit(source: object, saved: Mapping[str, Spec], wanted: Mapping[str, Spec], what: str) -> None:
    """Raise a CheckpointError naming `source` and `what` (e.g. "this run's model") when `saved` does
    not fit `wanted` (see `misfit`); return when it does, before the caller copies anything."""
    problem = misfit(saved, wanted)
    if problem is not None:
        raise CheckpointError(f"{source}: does not fit {what}: {problem}")
