"""`train.compile`: which parts of the training module torch.compile covers, and how it is applied.

``blocks`` (the default of ``train.compile: true``) compiles each block's forward: the blocks of a
model share their code and shapes, so one graph serves every layer (the first step compiles one block,
not the whole stack), and the engines' per-module hooks (ZeRO-3's parameter gathers, FSDP2's
all-gathers around each block) stay outside the graph, where they run in eager mode as they were
written to. The random features, routing, norms, gates, short convolution, phasor rotations and tree
reads, the scans (custom ops, kernels/library.py) and the sequence-parallel exchange (functional
collectives) are all inside a block. ``model`` compiles the whole training module: the embedding,
final norm and chunked loss join the graph too, at the price of a compile of the whole stack and of
tracing through the engine's hooks. docs/training.md ("Compiling the step") has the measured gain.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from pretrain.config import RunConfig

CompileMode = Literal["blocks", "model"]

DEFAULT_MODE: CompileMode = "blocks"
"""What ``train.compile: true`` means (the module docstring gives the reasons)."""

DYNAMO_SETTINGS = {"skip_fwd_side_effects_in_bwd_under_checkpoint": True}
"""torch._dynamo settings of a compiled run. The layers keep what their last forward measured (VORT's
orders, PMNet's slot use and balance loss) as module attributes; under activation checkpointing a
compiled checkpoint would otherwise break its graph there, since eager checkpointing sets them again
when the backward recomputes the forward. The recompute sets the values the forward set, so not
replaying it loses nothing."""


def compile_mode(cfg: RunConfig) -> CompileMode | None:
    """The run's compile mode: None when `train.compile` is false, the default for true."""
    value = cfg.train.compile
    if value is False:
        return None
    return DEFAULT_MODE if value is True else value


def compile_blocks(model: nn.Module) -> None:
    """Replace each block's forward by its compiled form, in place: the parameter names, the state dict
    and the module hooks are untouched (the hooks run around the compiled forward)."""
    for block in model.blocks:
        block.forward = distinct_tensor_inputs(torch.compile(block.forward))


def distinct_tensor_inputs(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` called with each tensor argument as its own object: a tensor passed twice (PMNet's
    first block gets the embeddings as both ``x`` and ``embedded``) goes in the second time as a view.

    Dynamo compiles one graph for two distinct inputs and another, which takes the tensor once, for the
    same tensor twice; each saves a different number of tensors for the backward. Whether a block sees
    one tensor or two can change between the forward and its recompute under activation checkpointing:
    FSDP2's pre-forward hook hands the block each input through its post-backward autograd Function,
    as distinct outputs, in the forward but not in the recompute, so the recompute ran the other graph
    and torch.utils.checkpoint stopped at the mismatch. With every tensor input distinct both passes
    run the same graph. A view shares the storage and copies nothing.
    """

    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        seen: set[int] = set()

        def distinct(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) in seen:
                return value.view_as(value)
            seen.add(id(value))
            return value

        args = tuple(distinct(a) for a in args)
        return forward(*args, **{name: distinct(v) for name, v in kwargs.items()})

    return call


def compile_model(cfg: RunConfig, model: nn.Module) -> bool:
    """Apply the run's compile mode to `model` as far as the model goes (``blocks``: compile them now)
    and say whether the engine must compile its whole training module (``model``)."""
    mode = compile_mode(cfg)
    if mode is not None:
        for name, value in DYNAMO_SETTINGS.items():
            setattr(torch._dynamo.config, name, value)
    if mode == "blocks":
        compile_blocks(model)
    return mode == "model"
